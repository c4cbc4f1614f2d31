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

#: The source distributions' sha256, as the index lists them.
SHA256 = {
    "0.14.0": "ed86c6a9d22fbfd059648794493cad88444c71688f3ff6efcb26c5ca353f0e5d",
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
}
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
    ``dest/vllm-RELEASE``; returns it."""
    root = dest / f"vllm-{release}"
    if root.exists():
        shutil.rmtree(root)
    top = f"vllm-{release}/"
    with tarfile.open(tarball(release, cache)) as tar:
        chosen = [
            m
            for m in tar.getmembers()
            if m.isfile() and m.name.startswith(top) and m.name[len(top):].startswith(members)
        ]
        if not chosen:
            raise SystemExit(f"vllm-{release}.tar.gz holds nothing under {members}")
        for m in chosen:
            target = root / m.name[len(top):]
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(m)
            assert source is not None
            target.write_bytes(source.read())
    return root


def read(release: str, cache: Path, member: str) -> str:
    """One file of the release's source distribution, as text."""
    with tarfile.open(tarball(release, cache)) as tar:
        source = tar.extractfile(f"vllm-{release}/{member}")
        if source is None:
            raise SystemExit(f"vllm-{release}.tar.gz has no {member}")
        return source.read().decode()


def cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-$HOME/.cache}/kvlink/vllm-sdist``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvlink" / "vllm-sdist"


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: vllm_sdist.py RELEASE DEST [MEMBER_PREFIX ...]")
    prefixes = tuple(sys.argv[3:]) or DEFAULT_MEMBERS
    print(extract(sys.argv[1], cache_dir(), Path(sys.argv[2]), prefixes))
