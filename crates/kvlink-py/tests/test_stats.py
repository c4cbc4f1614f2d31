"""kvlink's connector stats (``KvlinkConnectorStats``) and Prometheus
metrics (``KvlinkPromMetrics``), from real workers moving real KV: P and D
as processes (``kvsim``), each step's ``get_kv_connector_stats()`` data as
vLLM's model runner collects it, aggregated as vLLM's scheduler and
loggers do, checked against the workers' own cumulative counters and
against what was moved.

The Prometheus side runs here over recording stand-ins of prometheus_client's
classes (this environment has no vLLM); ``vllm_check`` runs it under each
release's real ``PrometheusStatLogger``."""

from __future__ import annotations

import json
import pickle
import random

import pytest
from conftest import collected, free_port, step_until

from kvlink_vllm import metrics
from kvlink_vllm.connector import KvlinkConnector
from kvlink_vllm.stats import KvlinkConnectorStats, KvlinkPromMetrics

BLOCK = 16
#: What one block of kvsim's cache holds: 4 layers x K and V x 2 heads x 16 tokens x 16 dims x 2 bytes.
BLOCK_BYTES = 4 * 2 * 2 * BLOCK * 16 * 2


def start_pair(instances):
    port = free_port()
    p = instances("P", "kv_producer", env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)})
    d = instances("D", "kv_consumer", extra={"transfer_timeout": 20})
    return p, d


def interval_stats(events: list[dict]) -> KvlinkConnectorStats:
    """Every step's stats of one instance, aggregated as vLLM's logger does
    (each rebuilt from its data by the connector class, as in the process that logs)."""
    total = KvlinkConnector.build_kv_connector_stats()
    for e in events:
        if e["stats"] is not None:
            total = total.aggregate(KvlinkConnector.build_kv_connector_stats(e["stats"]))
    return total


def cumulative(families: list[dict], name: str) -> int | tuple[int, float]:
    """A counter (all labels) or a histogram (count, sum) of the worker's own totals."""
    for f in families:
        if f["name"] == name:
            if f["kind"] == "histogram":
                return sum(sum(s["counts"]) for s in f["samples"]), sum(s["sum"] for s in f["samples"])
            return sum(s["value"] for s in f["samples"])
    raise AssertionError(f"no family {name}")


def transfer(p, d, rid: str, prompt_len: int) -> dict:
    """One request prefilled on P and pulled by D; returns the steps' events."""
    p.call("add", request_id=rid, prompt_len=prompt_len, params={"do_remote_decode": True})
    ev = p.call("step")
    params = ev["finished"][rid]["kv_transfer_params"]
    d.call("add", request_id=rid, prompt_len=prompt_len, params=params, max_tokens=100)
    steps = step_until(
        [p, d],
        lambda e: rid in collected(e["D"], "finished_recving") and rid in collected(e["P"], "finished_sending"),
        what=f"{rid} received and sent",
    )
    steps["P"].insert(0, ev)
    return steps


def test_first_report_lists_every_family_then_nothing_until_a_change(instances):
    d = instances("D", "kv_consumer")
    first = d.call("step")["stats"]
    assert first is not None, "the first step reports every family"
    stats = KvlinkConnector.build_kv_connector_stats(first)
    assert stats.is_empty() is False  # the gauges are reported
    names = {f["name"] for f in first["families"]} | {
        f["name"] for report in first["gauges"].values() for f in report["families"]
    }
    assert names == {f["name"] for f in d.call("metrics")}
    failed = next(f for f in first["families"] if f["name"] == "pulls_failed")
    assert len(failed["samples"]) > 1 and all(s["value"] == 0 for s in failed["samples"])
    assert first["roles"] == ["kv_consumer"] and list(first["gauges"]) == ["0.0"]
    # Nothing happened since: no stats at all (vLLM's output stays empty).
    for _ in range(3):
        assert d.call("step")["stats"] is None


def test_transfers_are_counted_on_both_sides(instances):
    p, d = start_pair(instances)
    sizes = {"s1": 3 * BLOCK + 5, "s2": 5 * BLOCK}  # 4 and 5 blocks
    events = {"P": [], "D": []}
    for rid, n in sizes.items():
        ev = transfer(p, d, rid, n)
        events["P"] += ev["P"]
        events["D"] += ev["D"]
    # P counts a request sent once its reply to D is built, which may be
    # after it reported the request sent: its next steps carry the count.
    more = step_until(
        [p],
        lambda e: interval_stats(events["P"] + e["P"]).counter("sends_done") == 2,
        what="P's sends counted",
    )
    events["P"] += more["P"]
    moved = sum(d.call("verify", request_id=rid)["bytes"] for rid in sizes)
    assert moved == 9 * BLOCK_BYTES

    on_d, on_p = interval_stats(events["D"]), interval_stats(events["P"])
    assert on_d.counter("pulls_started") == 2
    assert on_d.counter("pulls_received") == 2
    assert on_d.by_label("pulls_failed", "cause") and set(on_d.by_label("pulls_failed", "cause").values()) == {0}
    assert on_d.counter("received_bytes") == moved
    assert on_d.histogram("pull_seconds")[0] == 2
    assert on_d.histogram("pull_bytes") == (2, float(moved))
    assert on_d.gauge("pulls_in_flight") == 0
    assert on_p.counter("sends_done") == 2
    assert set(on_p.by_label("sends_failed", "cause").values()) == {0}
    assert on_p.counter("sent_bytes") == moved
    # The intervals add up to the workers' own totals.
    sides = ((d, on_d, ("pulls_received", "received_bytes")), (p, on_p, ("sends_done", "sent_bytes")))
    for inst, stats, names in sides:
        totals = inst.call("metrics")
        for name in names:
            assert stats.counter(name) == cumulative(totals, name), name
    assert on_d.histogram("pull_seconds") == pytest.approx(cumulative(d.call("metrics"), "pull_seconds"))

    # vLLM's log line.
    line = on_d.reduce()
    assert line["Pulls received"] == 2 and line["Pulls failed"] == 0 and line["Pull GB/s"] > 0
    assert not any(k.startswith("Pulls failed (") for k in line)
    assert "Sends done" not in line
    sent = on_p.reduce()
    assert sent["Sends done"] == 2 and sent["Sends failed"] == 0 and sent["Send GB/s"] > 0
    assert "Pulls received" not in sent


def test_a_failed_pull_is_counted_by_cause(instances):
    d = instances("D", "kv_consumer", extra={"transfer_timeout": 5, "connect_timeout": 1})
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port()}
    d.call("add", request_id="f1", prompt_len=2 * BLOCK, params=params, max_tokens=100)
    ev = step_until([d], lambda e: "f1" in collected(e["D"], "finished_recving"), what="failure reported")
    for _ in range(2):
        ev["D"].append(d.call("step"))
    stats = interval_stats(ev["D"])
    failed = {cause: n for cause, n in stats.by_label("pulls_failed", "cause").items() if n}
    recomputed = d.call("state")["recompute"]
    assert recomputed == ["f1"]
    assert sum(failed.values()) == len(recomputed)
    assert failed == {"connection_lost": 1}
    assert stats.counter("pulls_received") == 0
    line = stats.reduce()
    assert line["Pulls failed"] == 1 and line["Pulls failed (connection_lost)"] == 1
    assert line["Pulls received"] == 0 and line["Pull GB/s"] == 0


def test_round_trips_and_aggregation_rules(instances):
    p, d = start_pair(instances)
    ev = transfer(p, d, "r1", 4 * BLOCK)
    reports = [e["stats"] for e in ev["D"] if e["stats"] is not None]
    assert len(reports) >= 2
    one = KvlinkConnector.build_kv_connector_stats(reports[-1])
    # Through the serialisations vLLM uses between its processes.
    for back in (json.loads(json.dumps(one.data)), pickle.loads(pickle.dumps(one)).data):
        assert KvlinkConnector.build_kv_connector_stats(back).data == one.data
    assert one.to_dict() is one.data

    # Empty: nothing given, None, or an interval with nothing in it.
    for empty in (KvlinkConnector.build_kv_connector_stats(), KvlinkConnector.build_kv_connector_stats(None)):
        assert empty.is_empty() and empty.reduce() == {}
        assert empty.aggregate(empty).is_empty()
    assert KvlinkConnector.build_kv_connector_stats({"something": "else"}).is_empty()

    # Aggregation leaves both sides as they were.
    total = interval_stats(ev["D"])
    before = json.dumps(total.data, sort_keys=True)
    other = KvlinkConnector.build_kv_connector_stats(json.loads(json.dumps(reports[-1])))
    total.aggregate(other)
    assert json.dumps(total.data, sort_keys=True) == before

    # Two tensor-parallel workers of one step: counters add, gauges add
    # (one value per worker); a later report of one worker replaces its gauges.
    rank1 = json.loads(json.dumps(total.data).replace('"0.0"', '"0.1"'))
    both = total.aggregate(KvlinkConnectorStats(data=rank1))
    assert both.counter("pulls_received") == 2 * total.counter("pulls_received") == 2
    assert both.histogram("pull_bytes")[1] == 2 * total.histogram("pull_bytes")[1]
    assert set(both.data["gauges"]) == {"0.0", "0.1"}
    later = json.loads(json.dumps(rank1))
    later["families"] = []
    later["gauges"]["0.1"]["seq"] += 1
    in_flight = next(f for f in later["gauges"]["0.1"]["families"] if f["name"] == "pulls_in_flight")
    in_flight["samples"][0]["value"] = 5
    after = both.aggregate(KvlinkConnectorStats(data=later))
    assert after.gauge("pulls_in_flight") == 5 and after.counter("pulls_received") == 2
    # An older report does not replace a newer one.
    stale = json.loads(json.dumps(rank1))
    stale["families"] = []
    stale["gauges"]["0.1"]["seq"] -= 1
    assert after.aggregate(KvlinkConnectorStats(data=stale)).gauge("pulls_in_flight") == 5


class Recorded:
    """A recording stand-in of a prometheus_client metric class."""

    made: dict[str, "Recorded"] = {}

    def __init__(self, name: str, documentation: str, labelnames: list[str], **kwargs):
        if name in Recorded.made:
            raise ValueError(f"Duplicated timeseries in CollectorRegistry: {name}")
        Recorded.made[name] = self
        self.name, self.documentation, self.labelnames, self.kwargs = name, documentation, list(labelnames), kwargs
        self.children: dict[tuple, dict] = {}
        self._key: tuple = ()

    def labels(self, *values):
        assert len(values) == len(self.labelnames), (self.name, values, self.labelnames)
        child = Recorded.__new__(Recorded)
        child.__dict__ = self.__dict__.copy()
        child._key = tuple(str(v) for v in values)
        self.children.setdefault(child._key, {"value": 0, "observed": []})
        return child

    def inc(self, amount=1):
        self.children[self._key]["value"] += amount

    def set(self, value):
        self.children[self._key]["value"] = value

    def observe(self, value):
        self.children[self._key]["observed"].append(value)


class Gauge(Recorded):
    pass


class Counter(Recorded):
    pass


class Histogram(Recorded):
    pass


def test_prometheus_metrics_carry_every_family_per_engine(instances):
    Recorded.made = {}
    p, d = start_pair(instances)
    events = transfer(p, d, "m1", 6 * BLOCK)
    labelnames = ["model_name", "engine"]
    prom = KvlinkConnector.build_prom_metrics(
        None, {Gauge: Gauge, Counter: Counter, Histogram: Histogram}, labelnames, {0: ["tiny", "0"], 1: ["tiny", "1"]}
    )
    assert isinstance(prom, KvlinkPromMetrics)
    families = d.call("metrics")
    # Every family is registered when the object is made, before any report,
    # each series of every engine at zero.
    assert sorted(Recorded.made) == sorted("vllm:kvlink_" + f["name"] for f in families)
    zero_failed = Recorded.made["vllm:kvlink_pulls_failed"].children
    causes = len(next(f for f in families if f["name"] == "pulls_failed")["samples"])
    assert len(zero_failed) == 2 * causes and all(c["value"] == 0 for c in zero_failed.values())
    assert ("tiny", "0") in Recorded.made["vllm:kvlink_pull_seconds"].children
    for e in events["D"]:
        if e["stats"] is not None:
            prom.observe(e["stats"], engine_idx=1)
    assert sorted(Recorded.made) == sorted("vllm:kvlink_" + f["name"] for f in families)
    assert prom.names() == sorted(Recorded.made)
    for f in families:
        metric = Recorded.made["vllm:kvlink_" + f["name"]]
        assert type(metric).__name__ == f["kind"].capitalize(), f["name"]
        assert metric.labelnames == labelnames + f["labels"]
        assert metric.documentation == f["help"]
        assert {key[:2] for key in metric.children} <= {("tiny", "0"), ("tiny", "1")}, "the engines' labels"
        for key, child in metric.children.items():
            if key[:2] == ("tiny", "0"):
                assert child == {"value": 0, "observed": []}, ("engine 0 reported nothing", f["name"], key)
    received = Recorded.made["vllm:kvlink_pulls_received"].children
    assert received[("tiny", "1")]["value"] == 1
    failed = Recorded.made["vllm:kvlink_pulls_failed"].children
    assert len([k for k in failed if k[:2] == ("tiny", "1")]) == causes
    assert all(c["value"] == 0 for c in failed.values()), "every cause has a series, at 0"
    # Histograms: the worker's buckets and sum, exactly.
    for name in ("pull_seconds", "pull_bytes"):
        fam = next(f for f in families if f["name"] == name)
        bounds, counts, total = fam["samples"][0]["bounds"], fam["samples"][0]["counts"], fam["samples"][0]["sum"]
        observed = Recorded.made["vllm:kvlink_" + name].children[("tiny", "1")]["observed"]
        assert Recorded.made["vllm:kvlink_" + name].kwargs["buckets"] == bounds
        assert bucket_counts(bounds, observed) == counts
        assert sum(observed) == pytest.approx(total, rel=1e-9)
    in_flight = Recorded.made["vllm:kvlink_pulls_in_flight"]
    assert in_flight.kwargs.get("multiprocess_mode") == "mostrecent"
    assert in_flight.children[("tiny", "1")]["value"] == 0
    # Bad input costs that report only, never an exception in vLLM's loop.
    prom.observe({"kvlink": 1, "families": "not a list"}, 1)
    prom.observe(None, 0)
    prom.observe(events["D"][-1]["stats"] or {}, 7)  # no such engine


def test_prometheus_gauges_sum_workers_and_drop_gone_label_values():
    Recorded.made = {}
    prom = KvlinkPromMetrics(None, {Gauge: Gauge, Counter: Counter, Histogram: Histogram}, ["engine"], {0: ["0"]})

    def report(worker: str, seq: int, peers: dict[str, int]) -> dict:
        fam = {
            "name": "connections",
            "kind": "gauge",
            "labels": ["peer"],
            "help": "h",
            "samples": [{"labels": {"peer": k}, "value": v} for k, v in peers.items()],
        }
        gauges = {worker: {"seq": seq, "families": [fam]}}
        return {"kvlink": 1, "roles": ["kv_producer"], "families": [], "gauges": gauges}

    prom.observe(report("0.0", 1, {"a": 1, "b": 2}), 0)
    prom.observe(report("0.1", 1, {"a": 3}), 0)
    children = Recorded.made["vllm:kvlink_connections"].children
    assert children[("0", "a")]["value"] == 4 and children[("0", "b")]["value"] == 2
    prom.observe(report("0.0", 2, {"a": 1}), 0)  # peer b went away on rank 0
    assert children[("0", "a")]["value"] == 4 and children[("0", "b")]["value"] == 0
    prom.observe(report("0.0", 1, {"a": 9}), 0)  # older than what rank 0 reported: ignored
    assert children[("0", "a")]["value"] == 4


def bucket_counts(bounds: list[float], values: list[float]) -> list[int]:
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    return counts


def test_spread_reproduces_buckets_and_sum():
    bounds = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0]
    rng = random.Random(7)
    for case in range(200):
        values = [rng.choice([rng.uniform(0, 0.01), rng.uniform(0, 20), 10.0, 1e-4]) for _ in range(rng.randint(1, 40))]
        counts, total = bucket_counts(bounds, values), sum(values)
        observed = [v for v, n in metrics.spread(bounds, counts, total) for _ in range(n)]
        assert bucket_counts(bounds, observed) == counts, case
        assert sum(observed) == pytest.approx(total, rel=1e-9, abs=1e-12), case
    assert metrics.spread(bounds, [0] * (len(bounds) + 1), 0.0) == []
