"""kvlink's worker metrics as the plain data vLLM's connector stats carry
(no vLLM, no torch import: :mod:`kvlink_vllm.stats` wraps it in vLLM's classes).

The native worker lists every metric once, as families (kv-worker's
``MetricsSnapshot::families``; nothing here names a metric except the few
that :func:`reduce` summarises for vLLM's log line)::

    {"name": "pulls_failed", "kind": "counter", "labels": ["cause"], "help": "...",
     "samples": [{"labels": {"cause": "timeout"}, "value": 0}, ...]}

a histogram's sample being ``{"labels": {...}, "bounds": [...], "counts":
[per bucket, the last +Inf], "sum": x}``. One interval's data (what
``KvlinkConnectorStats.data`` holds, and what crosses vLLM's processes:
JSON-like values only) is::

    {"kvlink": 1,
     "roles": ["kv_consumer"],
     "families": [counter and histogram families: what changed in the interval],
     "gauges": {"<worker>": {"seq": n, "families": [gauge families: values now]}}}

Counters and histograms add when intervals or workers are aggregated
(histograms bucket by bucket); gauges are kept per worker (``dp.tp``
rank), the latest report of each (highest ``seq``), and summed over
workers when read. So the same merge is right for vLLM's two uses of
``aggregate``: across a step's tensor-parallel workers and across a log
interval's steps.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any, Iterable, Mapping

from . import logs

logger = logging.getLogger(logs.LOGGER)

#: Version of the data's shape.
FORMAT = 1
#: Kinds whose samples add across intervals and workers.
ADDITIVE = ("counter", "histogram")


class RateLimitedLog:
    """Logs a message at most once per ``period`` seconds per key, then the
    number of times it was held back (never muted for good)."""

    def __init__(self, period: float = 60.0):
        self.period = period
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.period:
            self._held[key] = self._held.get(key, 0) + 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        suffix = f" ({held} more like it since the last report)" if held else ""
        logger.warning(message + suffix, *args)


#: Rate-limited warnings of this module and its users.
warnings = RateLimitedLog()


def empty() -> dict[str, Any]:
    """The data of an interval in which nothing was reported."""
    return {"kvlink": FORMAT, "roles": [], "families": [], "gauges": {}}


def label_key(family: Mapping[str, Any], sample: Mapping[str, Any]) -> tuple[str, ...]:
    """A sample's label values, in the family's label order."""
    labels = sample.get("labels") or {}
    return tuple(str(labels.get(name, "")) for name in family.get("labels") or ())


def interval(families: Iterable[Mapping[str, Any]], worker: str, seq: int, role: str) -> dict[str, Any]:
    """One worker's interval data from the native worker's families
    (``Worker.metrics_since_last()``). The worker's first report
    (``seq`` 1) keeps every family and sample, zeros included, so every
    series can exist before the first event; later ones keep only the
    counter and histogram samples that changed (gauges: all, as they are now)."""
    additive, gauges = [], []
    for family in families:
        if family.get("kind") == "gauge":
            gauges.append(dict(family))
            continue
        if seq > 1:
            family = dict(family, samples=[s for s in family.get("samples") or () if _active(s)])
            if not family["samples"]:
                continue
        additive.append(dict(family))
    return {
        "kvlink": FORMAT,
        "roles": [role],
        "families": additive,
        "gauges": {worker: {"seq": int(seq), "families": gauges}},
    }


def _checked(data: Any) -> dict[str, Any]:
    """``data`` if it has this module's shape, else an empty interval (with
    a warning): what crosses processes is never trusted to the point of an
    exception inside vLLM's loops."""
    if not data:
        return empty()
    if (
        isinstance(data, Mapping)
        and data.get("kvlink") == FORMAT
        and isinstance(data.get("families", []), list)
        and isinstance(data.get("gauges", {}), Mapping)
    ):
        return {
            "kvlink": FORMAT,
            "roles": list(data.get("roles") or []),
            "families": list(data.get("families") or []),
            "gauges": dict(data.get("gauges") or {}),
        }
    warnings.warning("data", "kvlink: connector stats of an unknown shape ignored: %.200r", data)
    return empty()


def _add_sample(family: dict[str, Any], into: dict[str, Any], sample: Mapping[str, Any]) -> None:
    if "value" in sample:
        into["value"] = int(into.get("value", 0)) + int(sample["value"])
        return
    if list(into.get("bounds") or []) != list(sample.get("bounds") or []):
        warnings.warning(
            "bounds:" + str(family.get("name")),
            "kvlink: histogram %s reported with other bucket bounds; those observations are dropped",
            family.get("name"),
        )
        return
    mine, theirs = list(into.get("counts") or []), list(sample.get("counts") or [])
    into["counts"] = [int(a) + int(b) for a, b in zip(mine, theirs)] + mine[len(theirs) :] + theirs[len(mine) :]
    into["sum"] = float(into.get("sum", 0.0)) + float(sample.get("sum", 0.0))


def merge_families(mine: list[dict[str, Any]], theirs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Counter and histogram families of two intervals (or workers) added
    sample by sample; ``mine`` is not changed."""
    out = copy.deepcopy(mine)
    by_name = {f.get("name"): f for f in out}
    for family in theirs:
        name = family.get("name")
        have = by_name.get(name)
        if have is None:
            have = copy.deepcopy(dict(family))
            out.append(have)
            by_name[name] = have
            continue
        if have.get("kind") != family.get("kind") or list(have.get("labels") or []) != list(family.get("labels") or []):
            warnings.warning(
                "shape:" + str(name), "kvlink: metric %s reported with another kind or labels; dropped", name
            )
            continue
        samples = {label_key(have, s): s for s in have.get("samples") or []}
        for sample in family.get("samples") or []:
            key = label_key(family, sample)
            if key in samples:
                _add_sample(have, samples[key], sample)
            else:
                added = copy.deepcopy(dict(sample))
                have.setdefault("samples", []).append(added)
                samples[key] = added
    return out


def merge_gauges(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, Any]:
    """Per worker, the later report (higher ``seq``) of the two."""
    out = dict(mine)
    for worker, report in theirs.items():
        have = out.get(worker)
        if have is None or int(report.get("seq", 0)) >= int(have.get("seq", 0)):
            out[worker] = report
    return out


def aggregate(a: Any, b: Any) -> dict[str, Any]:
    """Two intervals' (or workers') data as one; neither is changed."""
    a, b = _checked(a), _checked(b)
    return {
        "kvlink": FORMAT,
        "roles": sorted(set(a["roles"]) | set(b["roles"])),
        "families": merge_families(a["families"], b["families"]),
        "gauges": merge_gauges(a["gauges"], b["gauges"]),
    }


def _active(sample: Mapping[str, Any]) -> bool:
    if "value" in sample:
        return bool(sample.get("value"))
    return any(sample.get("counts") or ())


def is_empty(data: Any) -> bool:
    """Whether nothing was counted, observed or reported (gauges) in the interval."""
    data = _checked(data)
    if data["gauges"]:
        return False
    return not any(_active(s) for f in data["families"] for s in f.get("samples") or ())


def counter(data: Any, name: str, **labels: str) -> int:
    """A counter of the interval, summed over the samples matching ``labels``."""
    total = 0
    for family in _checked(data)["families"]:
        if family.get("name") != name:
            continue
        for sample in family.get("samples") or ():
            have = sample.get("labels") or {}
            if "value" in sample and all(have.get(k) == v for k, v in labels.items()):
                total += int(sample["value"])
    return total


def by_label(data: Any, name: str, label: str) -> dict[str, int]:
    """A labelled counter of the interval per value of ``label``."""
    out: dict[str, int] = {}
    for family in _checked(data)["families"]:
        if family.get("name") != name:
            continue
        for sample in family.get("samples") or ():
            value = (sample.get("labels") or {}).get(label)
            if value is not None and "value" in sample:
                out[value] = out.get(value, 0) + int(sample["value"])
    return out


def histogram(data: Any, name: str) -> tuple[int, float]:
    """(observations, sum) of a histogram of the interval."""
    count, total = 0, 0.0
    for family in _checked(data)["families"]:
        if family.get("name") != name:
            continue
        for sample in family.get("samples") or ():
            count += sum(int(c) for c in sample.get("counts") or ())
            total += float(sample.get("sum") or 0.0)
    return count, total


def gauge_values(data: Any) -> dict[str, dict[tuple[str, ...], int]]:
    """Every gauge now, summed over the workers' latest reports:
    ``{name: {label values: value}}``."""
    out: dict[str, dict[tuple[str, ...], int]] = {}
    for report in _checked(data)["gauges"].values():
        for family in report.get("families") or ():
            values = out.setdefault(str(family.get("name")), {})
            for sample in family.get("samples") or ():
                key = label_key(family, sample)
                values[key] = values.get(key, 0) + int(sample.get("value") or 0)
    return out


def gauge(data: Any, name: str) -> int:
    """A gauge now, over all its label values and workers."""
    return sum(gauge_values(data).get(name, {}).values())


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def _failures(out: dict[str, int | float], what: str, causes: Mapping[str, int]) -> None:
    out[f"{what} failed"] = sum(causes.values())
    for cause, n in sorted(causes.items()):
        if n:
            out[f"{what} failed ({cause})"] = n


def reduce(data: Any) -> dict[str, int | float]:
    """The interval in a few figures, for vLLM's periodic log line
    (``KV Transfer metrics: k=v, ...``): per role, the transfers, their
    failures (with each cause that occurred), and the rate in GB/s over the
    time transfers took; with host staging, its free slots, waiting
    requests, waits, exhaustion and failed copies."""
    data = _checked(data)
    roles = set(data["roles"])
    out: dict[str, int | float] = {}
    if roles & {"kv_consumer", "kv_both"}:
        pulls, pull_seconds = histogram(data, "pull_seconds")
        out["Pulls received"] = counter(data, "pulls_received")
        _failures(out, "Pulls", by_label(data, "pulls_failed", "cause"))
        out["Pull GB/s"] = _rate(counter(data, "received_bytes"), pull_seconds)
        out["Avg pull ms"] = round(pull_seconds / pulls * 1e3, 3) if pulls else 0.0
        out["Pulls in flight"] = gauge(data, "pulls_in_flight")
    if roles & {"kv_producer", "kv_both"}:
        _, write_seconds = histogram(data, "batch_write_seconds")
        out["Sends done"] = counter(data, "sends_done")
        _failures(out, "Sends", by_label(data, "sends_failed", "cause"))
        out["Send GB/s"] = _rate(counter(data, "sent_bytes"), write_seconds)
        out["Lease expiries"] = counter(data, "lease_expiries")
        out["Held requests"] = gauge(data, "held_requests")
    if gauge(data, "staging_slots"):
        # Host staging (GPU caches): room, waits, and what failed in it.
        out["Staging free slots"] = gauge(data, "staging_free_slots")
        out["Staging waiting"] = gauge(data, "staging_waiting")
        out["Staging waits"] = counter(data, "staging_waits")
        out["Staging exhausted"] = counter(data, "staging_exhausted")
        out["Staging copies failed"] = sum(by_label(data, "staging_copies_failed", "direction").values())
    return out


def spread(bounds: list[float], counts: list[int], total: float) -> list[tuple[float, int]]:
    """Values to observe, each ``count`` times, so that a Prometheus
    histogram with these ``bounds`` gets exactly ``counts`` per bucket and
    ``total`` as its sum (what the worker's histogram holds; Prometheus'
    histograms take observations, not buckets). Each bucket's observations
    share one value inside the bucket, all moved together from the buckets'
    lower ends towards their upper ends until the sum is ``total``; what an
    upper end cannot hold goes to the ``+Inf`` bucket."""
    counts = [int(c) for c in counts]
    edges = [float(b) for b in bounds]
    n = len(edges)
    if n == 0 or len(counts) != n + 1:
        return [(total / max(sum(counts), 1), sum(counts))] if sum(counts) else []
    low = [0.0] + [math.nextafter(b, math.inf) for b in edges]  # values of bucket i are in (b[i-1], b[i]]
    high = edges + [low[-1]]
    least = sum(c * lo for c, lo in zip(counts, low))
    most = sum(c * hi for c, hi in zip(counts, high))
    if total <= least or most <= least:
        values = low
    elif total <= most:
        t = (total - least) / (most - least)
        values = [min(hi, lo + t * (hi - lo)) for lo, hi in zip(low, high)]
    else:
        values = high[:]
        if counts[n]:
            values[n] = low[n] + (total - most) / counts[n]
    return [(v, c) for v, c in zip(values, counts) if c]
