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
    #: and 0.15 free its blocks at once and must never hear of the pull
    #: again; later releases hold the blocks until the connector reports the
    #: pull in ``finished_recving``, which kvlink does once the pull is
    #: fenced (no byte of it can land any more).
    report_abandoned_pulls: bool = False
    #: ``KVConnectorBase_V1._cache_hit_source`` (a ``CacheHitSource`` member
    #: name; later releases label external prefix-cache hits by tier), or
    #: None where the base class has no such attribute.
    cache_hit_source: str | None = None


@dataclass(frozen=True)
class Change:
    """One difference of vLLM's connector contract, from the release that
    brought it on, and what kvlink does about it. Most need no branch in
    kvlink (a hook only later releases call, a status it already maps);
    those that do name the :class:`Behaviour` field they set."""

    #: The first release with it, as (major, minor).
    since: tuple[int, int]
    #: What changed in vLLM, for the package README's table (which a test holds to this).
    what: str
    #: What kvlink does about it, for the same table.
    does: str
    #: The :class:`Behaviour` field it sets, and to what (None: no branch).
    field: str | None = None
    value: object = None


#: The oldest and newest supported releases, as (major, minor): every minor
#: release between them is supported, each with every patch release.
OLDEST = (0, 14)
NEWEST_RELEASE = (0, 34)
#: Every contract difference between OLDEST and NEWEST_RELEASE that kvlink
#: meets, oldest first, each read in the sources of the release that
#: brought it.
CHANGES = (
    Change(
        (0, 15),
        "`RequestStatus.WAITING_FOR_STREAMING_REQ` (resumable streaming-input requests)",
        "mapped to waiting: a request is handed off only when it finishes length-capped",
    ),
    Change(
        (0, 16),
        "a request aborted while its pull is in flight keeps its blocks until the connector reports the pull "
        "in `finished_recving` (before: freed at once, and the pull must never be reported)",
        "the pull is cancelled and fenced in the next step's `start_load_kv`, then reported once, "
        "with no load error",
        "report_abandoned_pulls",
        True,
    ),
    Change(
        (0, 16),
        "`finished_recving` naming a request the scheduler no longer holds, or one not waiting for a pull, "
        "is an `AssertionError` in the engine core (before: ignored)",
        "each pull kvlink started is reported exactly once, notify-only pulls never",
    ),
    Change(
        (0, 16),
        "vLLM's own Mooncake deployment moves to a bootstrap server and router-made `transfer_id`s",
        "both flows served: P runs the bootstrap server on the bootstrap port (its side channels listen from "
        "the port after it) and names a request by its `transfer_id`; D learns P from the bootstrap server and "
        "pulls by the `transfer_id`, before P has seen the request if it comes first; without a `transfer_id` "
        "P returns `remote_host`, `remote_port`, `remote_request_id`, `remote_engine_id` as before",
    ),
    Change(
        (0, 17),
        "`kv_load_failure_policy` defaults to `fail` (before: `recompute`)",
        "none: set `recompute` for a failed pull to be recomputed rather than answered with an error",
    ),
    Change((0, 17), "`RequestStatus.FINISHED_REPETITION`", "mapped to stopped: no hand-off"),
    Change(
        (0, 18),
        "an async load's token count is taken exactly (before: rounded up to whole blocks) and asserted "
        "to fit the request",
        "none: kvlink answers the prompt's uncomputed tokens",
    ),
    Change(
        (0, 19),
        "`WAITING_FOR_FSM` renamed `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`; `handle_preemptions` takes the "
        "step's metadata and runs every step; `KVConnectorPromMetrics.make_per_engine` removed",
        "both status names mapped; base `handle_preemptions`; per-engine metrics made from the labels the "
        "constructor gets",
    ),
    Change(
        (0, 20),
        "the factory looks `kv_connector_module_path` up before its registry; a request finished on P is "
        "handed every block it holds, speculative decoding's lookahead block included (until 0.25 clips "
        "them), and D's async-load blocks may hold one too (0.23, 0.24)",
        "the scheduler cuts both block lists to the blocks holding prompt tokens (P's KV lands in D's "
        "blocks as P's last blocks: one extra block would shift every byte)",
    ),
    Change(
        (0, 21),
        "`kv_cache_config` is a required constructor argument; a request rejected before it reached the "
        "engine comes back pre-aborted, with its `kv_transfer_params`",
        "the constructor takes it either way; the rejected request tells P to free its blocks",
    ),
    Change(
        (0, 23),
        "FlashAttention and Triton caches become `(blocks, 2, block_size, heads, head_size)`; the CPU cache "
        "becomes `(blocks, heads, block_size, 2 x head_size)`, each head's K rows before its V rows",
        "both read from shapes and strides (one region per layer); a prefill and a decode instance of "
        "different vLLM releases are refused at the hello, naming both (the engine version is compared)",
    ),
    Change(
        (0, 26),
        "FlashAttention, FlashInfer and Triton caches become `(blocks, heads, block_size, 2 x head_size)`, "
        "each row one token's K then V",
        "read as fused rows: heads and tokens map as whole rows",
    ),
    Change(
        (0, 27),
        "`requires_kv_delivery` (the producer role): a request preempted while its hand-off is pending is "
        "recomputed",
        "base: P hands off only what vLLM still holds",
    ),
    Change(
        (0, 29),
        "every layer reaches `register_kv_caches` as `(blocks, heads, block_size, dim)`, MLA layers with "
        "one head; `start_load_kv` may run after the forward when a step has no synchronous load",
        "MLA read as `(blocks, 1, block_size, dim)`; pulls land between steps either way",
    ),
    Change(
        (0, 30),
        "the model runner asks `get_transfer_results` (`failed_recving`); stats cross as `to_dict()` "
        "(before: `.data`)",
        "base `get_transfer_results` over `get_finished` (failed pulls reported by block); `to_dict()` "
        "returns the data",
    ),
    Change(
        (0, 31),
        "vLLM's prefill adds `remote_prefill_cached_tokens` to its params; `wait_for_save` runs on empty "
        "steps too",
        "neither is used: kvlink's params are its own, and it saves nothing per layer",
    ),
    Change(
        (0, 32),
        "`_cache_hit_source` labels external prefix-cache hits by tier; `get_loaded_kv_cache_group_ids`",
        "kvlink's hits are `P2P`; a pull restores every transfer group",
        "cache_hit_source",
        "P2P",
    ),
    Change(
        (0, 33),
        "`supports_sleep_mode` (default yes), `unregister_kv_caches`, `restore_kv_caches`; with speculative "
        "decoding `get_finished` runs before the drafter, `wait_for_save` and clearing the metadata after",
        "`supports_sleep_mode` is False: vLLM refuses `--enable-sleep-mode` at start-up naming kvlink, as "
        "pulls and staging copies are not fenced on unregister; the moved calls are no-ops for kvlink",
    ),
    Change(
        (0, 34),
        "`kv_cache_access` decides how the extensible KV cache allocates the device cache; "
        "`may_load_async`; `skip_reading_external_kv` replaces `skip_reading_prefix_cache`",
        "`kv_cache_access` is `IN_PROCESS` (device caches move through torch copies into host staging; only "
        "host memory is registered); base `may_load_async`; the scheduler applies the skip after asking",
    ),
)


def _behaviour(release: tuple[int, int]) -> Behaviour:
    fields: dict[str, object] = {}
    for change in CHANGES:
        if change.field is not None and change.since <= release:
            fields[change.field] = change.value
    return Behaviour(release=release, **fields)  # type: ignore[arg-type]


#: Supported releases, as (major, minor): every patch release of each.
SUPPORTED = tuple((OLDEST[0], minor) for minor in range(OLDEST[1], NEWEST_RELEASE[1] + 1))
BEHAVIOURS = {release: _behaviour(release) for release in SUPPORTED}
#: The release whose tests stand for each minor release (``cargo xtask vllm-matrix`` runs them all).
TESTED = tuple(f"{major}.{minor}.0" for major, minor in SUPPORTED)
#: What an unsupported release allowed by ``KVLINK_ALLOW_UNSUPPORTED_VLLM``
#: runs with: the newest supported release's contract.
NEWEST = BEHAVIOURS[NEWEST_RELEASE]
#: Set to 1 to run on an unsupported vLLM anyway (with a warning).
ENV_ALLOW = "KVLINK_ALLOW_UNSUPPORTED_VLLM"


def supported_range() -> str:
    return f"{OLDEST[0]}.{OLDEST[1]}.x to {NEWEST_RELEASE[0]}.{NEWEST_RELEASE[1]}.x"


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
        f"kvlink_vllm supports vLLM {supported_range()} (every minor release, each tested); "
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
