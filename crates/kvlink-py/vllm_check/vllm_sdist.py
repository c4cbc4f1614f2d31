"""vLLM's source distributions (for their tests and their connector base
class): fetched from the package index pip is configured with, checked
against the pinned hashes below, cached by release.

``pip download --no-binary :all: vllm==X`` cannot be used: pip then
prepares the package's metadata, which runs vLLM's build backend (torch,
cmake, ...). This asks the index's simple API (PEP 503, the one pip reads)
for the file instead, as pip would find it, and checks its sha256.

Run as a script: ``python vllm_sdist.py RELEASE DEST [MEMBER_PREFIX ...]``
extracts the members under each prefix (default: the connector unit
tests) into ``DEST/vllm-RELEASE/`` and prints that directory.
"""

from __future__ import annotations

import hashlib
import html.parser
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

#: The source distributions' sha256, as the index lists them (0.15 has none:
#: only wheels were published).
SHA256 = {
    "0.14.0": "ed86c6a9d22fbfd059648794493cad88444c71688f3ff6efcb26c5ca353f0e5d",
    "0.16.0": "1f684bb31fbef59d862e2fe666e23a41f1d39d93f86215ce1ce1db89a8f5665b",
    "0.17.0": "b0b62e58ef4eb633ef371f2726976372cf6dfcb7ff2ea9ddf7194c1930d5629a",
    "0.18.0": "9a1bee091db8dbb4664a2a09cd9c61912e9912a44af1ce12b8593a231d05971c",
    "0.19.0": "81e59cf87175e7a62eb8d9acf5989484bbd17089d5eface353f89067bda282d9",
    "0.20.0": "a6d50152936ee292455af3ffbe359f7a284ac43bf3b68caccf29f368e196cc72",
    "0.21.0": "05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058",
    "0.22.0": "6d41581a9e5288cd69278518a550c6d7ce510ae27a506556a3427d01284be7fe",
    "0.23.0": "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5",
    "0.24.0": "0862453adc1f3339f1a0c9dca1179c34d6ed6e118f87b6e5bddd120af614ac66",
    "0.25.0": "7e04e2b37164de8c4012f27f75af6c4768039b32610865e9b6fb8c49c34a84aa",
    "0.26.0": "23e9fa19d7e20ce7dcc1c074d41503e2116d23f19e688f5d5ea91b741f958502",
    "0.27.0": "862671641625d6cfb7aaab98a5386126738b59ca50e5d01ca539a4e32f63ffcb",
    "0.28.0": "ac96dd0ec5be9c13f2aa4bfb50498c4727110406f6e4980b58a4097e4d18634a",
    "0.29.0": "c03feb07943ecae9e69e7dc424d7c5569ecf8d1292513aef2a4de67af381cd97",
    "0.30.0": "5f8f4e890c042ffa1c3e103f81c35e2d96f60a0a175ac43a4adbae7006bef62b",
    "0.31.0": "dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380",
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
}
#: Releases with no source distribution: whose tests stand in for theirs
#: (0.15.0's nearest earlier source distribution is 0.14.1, whose tests
#: are 0.14.0's byte for byte).
TESTS_FROM = {"0.15.0": "0.14.0"}
#: What the checks read from a source distribution.
UNIT_TESTS = "tests/v1/kv_connector/unit/"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
DEFAULT_MEMBERS = (UNIT_TESTS,)
#: Bound on each network operation.
TIMEOUT = 300


def _index_url() -> str:
    """The index pip uses: ``PIP_INDEX_URL``, pip's configured
    ``index-url``, else pip's default."""
    url = os.environ.get("PIP_INDEX_URL", "").strip()
    if url:
        return url
    for key in ("global.index-url", "install.index-url", "download.index-url"):
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", key], capture_output=True, text=True, timeout=60
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    from pip._internal.models.index import PyPI

    return PyPI.simple_url


def _context() -> ssl.SSLContext:
    cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    return ssl.create_default_context(cafile=cert) if cert else ssl.create_default_context()


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def _sdist_url(release: str) -> str:
    page = _index_url().rstrip("/") + "/vllm/"
    request = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+html, text/html"})
    with urllib.request.urlopen(request, timeout=TIMEOUT, context=_context()) as response:
        text = response.read().decode()
    links = _Links()
    links.feed(text)
    name = f"vllm-{release}.tar.gz"
    for href in links.hrefs:
        url = urllib.parse.urljoin(page, href)
        if urllib.parse.urlsplit(url).path.endswith("/" + name):
            return url.split("#", 1)[0]
    raise SystemExit(f"the package index lists no {name}")


def tarball(release: str, cache: Path) -> Path:
    """The release's source distribution in ``cache`` (downloaded once, checked each time)."""
    if release not in SHA256:
        raise SystemExit(f"no pinned source distribution for vLLM {release}; pinned: {', '.join(SHA256)}")
    path = cache / f"vllm-{release}.tar.gz"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        url = _sdist_url(release)
        with tempfile.NamedTemporaryFile(dir=cache, delete=False) as tmp:
            with urllib.request.urlopen(url, timeout=TIMEOUT, context=_context()) as response:
                shutil.copyfileobj(response, tmp)
        os.replace(tmp.name, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256[release]:
        path.unlink()
        raise SystemExit(f"vllm-{release}.tar.gz has sha256 {digest}, not the pinned {SHA256[release]}; removed it")
    return path


def extract(release: str, cache: Path, dest: Path, members: tuple[str, ...] = DEFAULT_MEMBERS) -> Path:
    """Extracts ``members`` (path prefixes inside the sdist) into a fresh
    ``dest/vllm-RELEASE``; returns it. A release without a source
    distribution gets those of :data:`TESTS_FROM`'s stand-in."""
    root = dest / f"vllm-{release}"
    if root.exists():
        shutil.rmtree(root)
    source = TESTS_FROM.get(release, release)
    top = f"vllm-{source}/"
    with tarfile.open(tarball(source, cache)) as tar:
        chosen = [
            m
            for m in tar.getmembers()
            if m.isfile() and m.name.startswith(top) and m.name[len(top):].startswith(members)
        ]
        if not chosen:
            raise SystemExit(f"vllm-{source}.tar.gz holds nothing under {members}")
        for m in chosen:
            target = root / m.name[len(top):]
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(m)
            assert source is not None
            target.write_bytes(source.read())
    return root


def read(release: str, cache: Path, *members: str) -> dict[str, str]:
    """Files of the release's source distribution, as text, read in one pass."""
    top = f"vllm-{release}/"
    wanted = {top + member: member for member in members}
    found: dict[str, str] = {}
    with tarfile.open(tarball(release, cache)) as tar:
        for m in tar:
            if m.name in wanted:
                source = tar.extractfile(m)
                if source is not None:
                    found[wanted[m.name]] = source.read().decode()
                    if len(found) == len(wanted):
                        break
    missing = sorted(set(members) - set(found))
    if missing:
        raise SystemExit(f"vllm-{release}.tar.gz has no {', '.join(missing)}")
    return found


def cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-$HOME/.cache}/kvlink/vllm-sdist``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvlink" / "vllm-sdist"


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: vllm_sdist.py RELEASE DEST [MEMBER_PREFIX ...]")
    prefixes = tuple(sys.argv[3:]) or DEFAULT_MEMBERS
    print(extract(sys.argv[1], cache_dir(), Path(sys.argv[2]), prefixes))
