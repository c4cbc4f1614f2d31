"""kvlink's metrics through vLLM's connector hooks.

* :class:`KvlinkConnectorStats` (a vLLM ``KVConnectorStats``): one
  interval's data (:mod:`kvlink_vllm.metrics`), made by the worker-side
  connector's ``get_kv_connector_stats`` each step something changed,
  aggregated by vLLM across tensor-parallel workers and log intervals,
  rebuilt from its ``data`` by ``KvlinkConnector.build_kv_connector_stats``
  in the process that logs, and summarised by ``reduce`` for vLLM's periodic
  ``KV Transfer metrics:`` log line.
* :class:`KvlinkPromMetrics` (a vLLM ``KVConnectorPromMetrics``): every
  family the workers report, as Prometheus metrics named ``vllm:kvlink_<name>``
  with vLLM's engine labels (``model_name``, ``engine``) before the family's
  own, on the engine's ``/metrics``. Every family is registered when the
  object is made, each series of the engine's labels at zero (kv-worker's
  ``MetricsSnapshot::zero()``, ``_native.zero_metrics()``), so rates and
  alerts see every series before the first report; a family a report
  brings that this build does not know is registered when it arrives.

Nothing here raises into vLLM's loops: a report that cannot be used is
dropped with a rate-limited warning.

Without vLLM (tools, the package's tests) both subclass stand-ins with the
same constructor and fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import _native, metrics

try:  # vLLM present: its real base classes.
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

    HAVE_VLLM = True
except ImportError:  # Without vLLM: stand-ins, for tests and tools.
    HAVE_VLLM = False

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorStats``."""

        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorPromMetrics``: the metric classes
        by kind (keyed by classes named ``Gauge``, ``Counter``, ``Histogram``,
        as vLLM keys them by prometheus_client's)."""

        def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict):
            by_name = {getattr(k, "__name__", str(k)): v for k, v in metric_types.items()}
            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            self._gauge_cls = by_name["Gauge"]
            self._counter_cls = by_name["Counter"]
            self._histogram_cls = by_name["Histogram"]
            self._labelnames = labelnames


#: Prometheus name prefix of every family.
PREFIX = "vllm:kvlink_"


@dataclass
class KvlinkConnectorStats(KVConnectorStats):
    """One interval of kvlink's metrics (``data``: see :mod:`kvlink_vllm.metrics`)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = metrics.empty()

    def to_dict(self) -> dict[str, Any]:
        """The serializable payload (what vLLM 0.32 sends; 0.14 reads ``data``)."""
        return self.data

    def aggregate(self, other: Any) -> "KvlinkConnectorStats":
        """This interval and ``other`` (another worker's, or a later
        interval's) as one; neither is changed."""
        try:
            return KvlinkConnectorStats(data=metrics.aggregate(self.data, getattr(other, "data", None)))
        except Exception as e:  # never into vLLM's loop
            metrics.warnings.warning("aggregate", "kvlink: connector stats not aggregated: %r", e)
            return self

    def reduce(self) -> dict[str, int | float]:
        """The interval in a few figures for vLLM's log line: transfers,
        failures (and each cause that occurred), GB/s."""
        try:
            return metrics.reduce(self.data)
        except Exception as e:
            metrics.warnings.warning("reduce", "kvlink: connector stats not summarised: %r", e)
            return {}

    def is_empty(self) -> bool:
        try:
            return metrics.is_empty(self.data)
        except Exception as e:
            metrics.warnings.warning("is_empty", "kvlink: connector stats unreadable: %r", e)
            return True

    # Readers, for tests and tools.

    def counter(self, name: str, **labels: str) -> int:
        return metrics.counter(self.data, name, **labels)

    def by_label(self, name: str, label: str) -> dict[str, int]:
        return metrics.by_label(self.data, name, label)

    def histogram(self, name: str) -> tuple[int, float]:
        return metrics.histogram(self.data, name)

    def gauge(self, name: str) -> int:
        return metrics.gauge(self.data, name)


def build(data: dict[str, Any] | None = None) -> KvlinkConnectorStats:
    """What ``KvlinkConnector.build_kv_connector_stats`` returns."""
    return KvlinkConnectorStats(data=data) if data is not None else KvlinkConnectorStats()


class KvlinkPromMetrics(KVConnectorPromMetrics):
    """kvlink's families as Prometheus metrics ``vllm:kvlink_<name>``, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # Kept here: the base class's name for them differs between releases.
        self._engine_labelnames = list(labelnames)
        self._engine_labelvalues = {int(k): list(v) for k, v in per_engine_labelvalues.items()}
        #: name -> (kind, label names, bounds, metric); None where it could not be registered.
        self._metrics: dict[str, tuple[str, tuple[str, ...], tuple[float, ...], Any] | None] = {}
        #: engine -> the gauge reports seen so far, by worker.
        self._gauges: dict[int, dict[str, Any]] = {}
        #: (engine, gauge name) -> label values set so far (reset to 0 when a report lacks them).
        self._gauge_keys: dict[tuple[int, str], set[tuple[str, ...]]] = {}
        self._register_all()

    def _register_all(self) -> None:
        """Every family, and each of its series per engine at zero (a
        series whose labels depend on what happens, a peer, appears with
        its first report)."""
        try:
            families = _native.zero_metrics()
        except Exception as e:  # never into vLLM's start-up: the families then come with the first report
            metrics.warnings.warning("prom-zero", "kvlink: metrics not registered ahead of the first report: %r", e)
            return
        for family in families:
            metric = self._metric(family)
            if metric is None:
                continue
            for engine_idx in self._engine_labelvalues:
                for sample in family.get("samples") or ():
                    try:
                        self._child(metric, engine_idx, family, sample)
                    except Exception as e:  # that series only
                        metrics.warnings.warning("prom-zero:" + str(family.get("name")), "kvlink: %r", e)

    def names(self) -> list[str]:
        """The Prometheus names registered so far (as created; a counter is
        exposed with ``_total`` appended)."""
        return sorted(PREFIX + name for name, m in self._metrics.items() if m is not None)

    def _metric(self, family: dict[str, Any]) -> Any:
        name = str(family.get("name"))
        kind = str(family.get("kind"))
        labels = tuple(str(x) for x in family.get("labels") or ())
        bounds: tuple[float, ...] = ()
        if kind == "histogram":
            samples = family.get("samples") or [{}]
            bounds = tuple(float(b) for b in samples[0].get("bounds") or ())
        if name in self._metrics:
            known = self._metrics[name]
            if known is None:
                return None
            if known[:3] != (kind, labels, bounds):
                metrics.warnings.warning(
                    "prom-shape:" + name, "kvlink: metric %s changed shape; its report is dropped", name
                )
                return None
            return known[3]
        labelnames = self._engine_labelnames + list(labels)
        documentation = str(family.get("help") or name)
        try:
            if kind == "counter":
                metric = self._counter_cls(name=PREFIX + name, documentation=documentation, labelnames=labelnames)
            elif kind == "gauge":
                metric = self._gauge_cls(
                    name=PREFIX + name,
                    documentation=documentation,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
            elif kind == "histogram":
                metric = self._histogram_cls(
                    name=PREFIX + name, documentation=documentation, labelnames=labelnames, buckets=list(bounds)
                )
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except Exception as e:  # a duplicate name, a bad label: that metric only
            metrics.warnings.warning("prom-register:" + name, "kvlink: cannot export %s%s: %r", PREFIX, name, e)
            self._metrics[name] = None
            return None
        self._metrics[name] = (kind, labels, bounds, metric)
        return metric

    def _child(self, metric: Any, engine_idx: int, family: dict[str, Any], sample: dict[str, Any]) -> Any:
        return metric.labels(*self._engine_labelvalues[engine_idx], *metrics.label_key(family, sample))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Adds one interval's counters and histograms of engine ``engine_idx``
        to its metrics, and sets its gauges to the sum of its workers' latest
        values."""
        try:
            self._observe(transfer_stats_data, int(engine_idx))
        except Exception as e:  # never into vLLM's output loop
            metrics.warnings.warning("observe", "kvlink: connector stats not exported: %r", e)

    def _observe(self, data: Any, engine_idx: int) -> None:
        if engine_idx not in self._engine_labelvalues:
            metrics.warnings.warning("engine", "kvlink: stats of unknown engine %d not exported", engine_idx)
            return
        data = metrics.aggregate(metrics.empty(), data)  # checked, and a copy
        for family in data["families"]:
            metric = self._metric(family)
            if metric is None:
                continue
            for sample in family.get("samples") or ():
                child = self._child(metric, engine_idx, family, sample)
                if family.get("kind") == "counter":
                    value = int(sample.get("value") or 0)
                    if value > 0:
                        child.inc(value)
                else:
                    bounds, counts = list(sample.get("bounds") or ()), list(sample.get("counts") or ())
                    for value, count in metrics.spread(bounds, counts, float(sample.get("sum") or 0)):
                        for _ in range(count):
                            child.observe(value)
        if not data["gauges"]:
            return
        seen = metrics.merge_gauges(self._gauges.get(engine_idx, {}), data["gauges"])
        self._gauges[engine_idx] = seen
        families = {}
        for report in seen.values():
            for family in report.get("families") or ():
                families.setdefault(str(family.get("name")), family)
        values = metrics.gauge_values({**metrics.empty(), "gauges": seen})
        for name, family in families.items():
            metric = self._metric(family)
            if metric is None:
                continue
            now = values.get(name, {})
            keys = self._gauge_keys.setdefault((engine_idx, name), set())
            keys |= set(now)
            for key in keys:
                metric.labels(*self._engine_labelvalues[engine_idx], *key).set(now.get(key, 0))
