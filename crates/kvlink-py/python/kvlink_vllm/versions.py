"""The vLLM releases kvlink_vllm supports, checked once when a connector is made.

vLLM's connector contract changes between releases in ways that break a
connector silently (which requests' blocks are freed when, which statuses
exist, which methods the scheduler calls), so an unsupported vLLM is a
start-up error naming the installed version and the supported range, not
a failure in the middle of serving. Version-specific behaviour, when a
second release is supported, belongs here, chosen once from the installed
version.
"""

from __future__ import annotations

import logging
import os
import re

from ._native import ConfigError

logger = logging.getLogger("kvlink_vllm")

#: Supported releases, as (major, minor): every patch release of each.
SUPPORTED = ((0, 14),)
#: The releases the test suites run against.
TESTED = ("0.14.0",)
#: Set to 1 to run on an unsupported vLLM anyway (with a warning).
ENV_ALLOW = "KVLINK_ALLOW_UNSUPPORTED_VLLM"


def supported_range() -> str:
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.14.0+cpu``."""
    m = re.match(r"^\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check(version: str, allow_unsupported: bool | None = None) -> None:
    """Raises ``ConfigError`` unless ``version`` is a supported vLLM release
    (or ``KVLINK_ALLOW_UNSUPPORTED_VLLM=1``, which only warns)."""
    if release(version) in SUPPORTED:
        return
    if allow_unsupported is None:
        allow_unsupported = os.environ.get(ENV_ALLOW, "").strip() == "1"
    text = (
        f"kvlink_vllm supports vLLM {supported_range()} (tested: {', '.join(TESTED)}); "
        f"the installed vLLM is {version}"
    )
    if allow_unsupported:
        logger.warning("%s; running anyway because %s=1", text, ENV_ALLOW)
        return
    raise ConfigError(f"{text}. Install a supported vLLM, or set {ENV_ALLOW}=1 to try it at your own risk")


def check_installed() -> None:
    """Checks the vLLM this process imported."""
    import vllm

    check(str(getattr(vllm, "__version__", "unknown")))
