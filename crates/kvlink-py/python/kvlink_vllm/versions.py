"""The vLLM releases kvlink_vllm supports, checked once when a connector is made.

vLLM's connector contract changes between releases in ways that break a
connector silently (which requests' blocks are freed when, which statuses
exist, which methods the scheduler calls), so an unsupported vLLM is a
start-up error naming the installed version and the supported range, not
a failure in the middle of serving. Version-specific behaviour lives
here only: :func:`behaviour` picks one :class:`Behaviour` per release,
once, from the installed version; the rest of the package reads its
fields and never probes vLLM with ``hasattr``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass

from . import logs
from ._native import ConfigError

logger = logging.getLogger(logs.LOGGER)


@dataclass(frozen=True)
class Behaviour:
    """What differs between the supported releases' connector contracts."""

    #: The release, as (major, minor).
    release: tuple[int, int]
    #: A request vLLM finishes (aborts) while its pull is in flight: 0.14
    #: frees its blocks at once and must never hear of the pull again;
    #: later releases (vLLM PR #32255) hold the blocks until the connector
    #: reports the pull in ``finished_recving``, which kvlink does once the
    #: pull is fenced (no byte of it can land any more).
    report_abandoned_pulls: bool
    #: ``KVConnectorBase_V1._cache_hit_source`` (a ``CacheHitSource`` member
    #: name; later releases label external prefix-cache hits by tier), or
    #: None where the base class has no such attribute.
    cache_hit_source: str | None


#: Supported releases, as (major, minor): every patch release of each.
#: (The connector-stats hooks need no field: 0.14 sends ``stats.data`` and
#: 0.32 ``stats.to_dict()``, which returns it; 0.32 dropped
#: ``KVConnectorPromMetrics.make_per_engine``, and ``kvlink_vllm.stats`` uses
#: neither release's helper but the labels its constructor is given.)
BEHAVIOURS = {
    (0, 14): Behaviour(release=(0, 14), report_abandoned_pulls=False, cache_hit_source=None),
    (0, 32): Behaviour(release=(0, 32), report_abandoned_pulls=True, cache_hit_source="P2P"),
}
SUPPORTED = tuple(BEHAVIOURS)
#: The releases the test suites run against.
TESTED = ("0.14.0", "0.32.0")
#: What an unsupported release allowed by ``KVLINK_ALLOW_UNSUPPORTED_VLLM``
#: runs with: the newest supported release's contract.
NEWEST = BEHAVIOURS[max(BEHAVIOURS)]
#: Set to 1 to run on an unsupported vLLM anyway (with a warning).
ENV_ALLOW = "KVLINK_ALLOW_UNSUPPORTED_VLLM"


def supported_range() -> str:
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.14.0+cpu``."""
    m = re.match(r"^\s*(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check(version: str, allow_unsupported: bool | None = None) -> Behaviour:
    """The behaviour for ``version``; raises ``ConfigError`` unless it is a
    supported vLLM release (or ``KVLINK_ALLOW_UNSUPPORTED_VLLM=1``, which
    only warns and runs with the newest supported release's behaviour)."""
    known = BEHAVIOURS.get(release(version))  # type: ignore[arg-type]
    if known is not None:
        return known
    if allow_unsupported is None:
        allow_unsupported = os.environ.get(ENV_ALLOW, "").strip() == "1"
    text = (
        f"kvlink_vllm supports vLLM {supported_range()} (tested: {', '.join(TESTED)}); "
        f"the installed vLLM is {version}"
    )
    if allow_unsupported:
        logger.warning(
            "%s; running anyway because %s=1, as for vLLM %d.%d", text, ENV_ALLOW, *NEWEST.release
        )
        return NEWEST
    raise ConfigError(f"{text}. Install a supported vLLM, or set {ENV_ALLOW}=1 to try it at your own risk")


def installed_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


@functools.lru_cache(maxsize=1)
def check_installed() -> Behaviour:
    """Checks the vLLM this process imported, once; its behaviour."""
    return check(installed_version())


def current() -> Behaviour:
    """The behaviour of this process: the installed vLLM's (checked once),
    or, where vLLM is not installed (tools, tests), the newest supported
    release's."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return NEWEST
    return check_installed()
