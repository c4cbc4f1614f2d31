"""kvlink under each supported vLLM release's own scheduler
(``cargo xtask vllm-check``, CI steps ``vllm-check:<release>``).

Runs in the release's engine-test environment (vLLM's CPU build, torch).
No model weights: the model is a local ``config.json``, the tokenizer is
skipped, nothing is fetched. The connectors are created by vLLM's ``KVConnectorFactory`` from
``kv_connector_module_path``; the scheduler is vLLM's ``Scheduler``; the
worker side is the connector over CPU tensors in the CPU backend's layout,
driven in the model runner's order. P and D live in one process here (the
process separation is what the CI tests cover).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm.v1.structured_output import StructuredOutputManager
from vllm.utils.hashing import sha256

import kvlink_vllm
from kvlink_vllm import versions
from kvlink_vllm.connector import KvlinkConnector

# The package tests that need torch (skipped in the `python` step's
# environment) run here: `python -m kvlink_vllm.gpu_check --device cpu`, and
# the torch copier's CUDA branch over CPU tensors.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_gpu_check import test_gpu_check_cpu_mode, test_gpu_check_cpu_mode_many_small_requests  # noqa: E402,F401
from test_torch_copier import (  # noqa: E402,F401
    test_index_buffers_are_pinned_once_and_reused,
    test_torch_copier_cuda_path_on_cpu_tensors,
)

#: The installed release's behaviour (a supported one: the connector checks it too).
BEHAVIOUR = versions.check(versions.installed_version(), allow_unsupported=False)
RELEASE = BEHAVIOUR.release
#: Where vLLM's own parts this harness stands in for changed (the model
#: runner, the CPU backend, ``Request``), as read in each release's sources.
#: The CPU backend's cache is (2, blocks, heads, block_size, head_size)
#: before 0.23, then (blocks, heads, block_size, 2 x head_size).
CPU_CACHE_FUSED = RELEASE >= (0, 23)
#: ``Request`` takes the EOS token before 0.17; later it reads it from the sampling params.
REQUEST_TAKES_EOS = RELEASE < (0, 17)
#: The model runner asks ``get_transfer_results`` (which asks ``get_finished``) from 0.30.
RUNNER_ASKS_TRANSFER_RESULTS = RELEASE >= (0, 30)
#: ``ModelRunnerOutput`` has ``req_id_to_index`` until 0.33.
RUNNER_OUTPUT_INDEXES = RELEASE < (0, 34)


def runner_output(req_ids: list[str], **fields) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` of ``req_ids`` as this release's runner makes it."""
    if RUNNER_OUTPUT_INDEXES:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


BLOCK = 16
BLOCKS = 64
HEADS, HEAD = 2, 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": HEADS * HEAD * 2,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": HEADS,
                "head_dim": HEAD,
                "num_hidden_layers": len(LAYERS),
                "vocab_size": 1000,
                "max_position_embeddings": 1024,
                "torch_dtype": "float32",
                "eos_token_id": 2,
            }
        )
    )
    init_none_hash(sha256)
    return str(d)


def cpu_cache_shape() -> tuple[int, ...]:
    """The CPU backend's per-layer cache (see ``CPU_CACHE_FUSED``)."""
    if not CPU_CACHE_FUSED:
        return (2, BLOCKS, HEADS, BLOCK, HEAD)
    return (BLOCKS, HEADS, BLOCK, 2 * HEAD)


def vllm_config(model_dir: str, role: str, extra: dict | None = None) -> VllmConfig:
    """An engine's configuration with kvlink as its connector in ``role``."""
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, seed=0)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_model_len=1024,
            is_encoder_decoder=False,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            enable_chunked_prefill=True,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvlinkConnector",
            kv_connector_module_path="kvlink_vllm",
            kv_role=role,
            # 0.14's default; 0.17 and later default to "fail".
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"advertised_host": "127.0.0.1", **(extra or {})},
        ),
        device_config=DeviceConfig("cpu"),
    )


class Instance:
    """vLLM's scheduler plus one worker-side connector over CPU tensors."""

    def __init__(self, model_dir: str, role: str, extra: dict | None = None):
        self.config = vllm_config(model_dir, role, extra)
        self.config.cache_config.num_gpu_blocks = BLOCKS
        self.kv_cache_config = KVCacheConfig(
            num_blocks=BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32))
            ],
        )
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        shape = cpu_cache_shape()
        self.caches = {name: torch.zeros(shape, dtype=torch.float32) for name in LAYERS}
        self.worker.register_kv_caches(self.caches)
        self.outputs: list = []
        #: Each step's worker-side connector stats, and the SchedulerStats the
        #: engine core sent after it (as the front end decodes them).
        self.worker_stats: list = []
        self.scheduler_stats: list = []
        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)

    def add(self, rid: str, prompt_len: int, params: dict, max_tokens: int) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        eos = {"eos_token_id": 2} if REQUEST_TAKES_EOS else {}
        if not eos:
            sp.update_from_generation_config({}, 2)
        req = Request(
            request_id=rid,
            prompt_token_ids=[(7 * i + 3) % 1000 for i in range(prompt_len)],
            sampling_params=sp,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
            **eos,
        )
        req.kv_transfer_params = params
        self.scheduler.add_request(req)
        return req

    def block(self, t: torch.Tensor, block: int) -> torch.Tensor:
        """One block of a layer's cache (K and V)."""
        return t[block] if CPU_CACHE_FUSED else t[:, block]

    def fill(self, rid: str, value_of) -> None:
        for i, block in enumerate(self.scheduler.kv_cache_manager.get_block_ids(rid)[0]):
            for layer, t in enumerate(self.caches.values()):
                self.block(t, block)[...] = value_of(rid, i, layer)

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks

    def step(self, compute=None) -> dict:
        out = self.scheduler.schedule()
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)
        if compute:
            for rid in out.num_scheduled_tokens:
                compute(self, rid)
        w.wait_for_save()
        if not RUNNER_ASKS_TRANSFER_RESULTS:
            sending, recving = w.get_finished(out.finished_req_ids)
        else:  # the model runner asks for transfer results, which ask get_finished
            results = w.get_transfer_results(out.finished_req_ids)
            sending, recving = results.finished_sending or None, results.finished_recving or None
        invalid = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()
        w.clear_connector_metadata()
        rids = list(out.num_scheduled_tokens)
        runner = runner_output(
            rids,
            # A chunk that leaves the prompt unfinished samples nothing
            # (schedule() already counted the chunk as computed).
            sampled_token_ids=[
                [5] if self.scheduler.requests[r].num_computed_tokens >= self.scheduler.requests[r].num_prompt_tokens else []
                for r in rids
            ],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid, kv_connector_stats=stats
            ),
        )
        self.worker_stats.append(stats)
        engine_outputs = self.scheduler.update_from_output(out, runner)
        finished = {}
        for eco in engine_outputs.values():
            if eco.scheduler_stats is not None:
                # What the engine core sends the front end, through vLLM's own encoding.
                wire = self.decoder.decode(self.encoder.encode(EngineCoreOutputs(scheduler_stats=eco.scheduler_stats)))
                self.scheduler_stats.append(wire.scheduler_stats)
            for o in eco.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = o.kv_transfer_params
        return {
            "sending": sending or set(),
            "recving": recving or set(),
            "invalid": invalid,
            "finished": finished,
            "scheduled": dict(out.num_scheduled_tokens),
        }


def value(rid: str, block: int, layer: int) -> float:
    """KV of a block: every prompt here starts with the same tokens, so a
    block's KV depends on its position (and layer) only."""
    return float(1000 * block + layer + 1)


def compute_prefill(inst: Instance, rid: str) -> None:
    inst.fill(rid, value)


def steps_until(insts, cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    log = []
    while True:
        events = [i.step(compute_prefill if i is insts[0] else None) for i in insts]
        log.append(events)
        if cond(log):
            return log
        assert time.monotonic() < deadline, log
        time.sleep(0.005)


def test_connector_comes_from_vllms_factory(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(free_port()))
    p = Instance(model_dir, "kv_producer")
    assert type(p.scheduler.connector) is kvlink_vllm.KvlinkConnector
    assert isinstance(p.scheduler.connector, KVConnectorBase_V1) and isinstance(p.worker, KvlinkConnector)
    p.worker.shutdown()


def test_prefill_to_decode_under_vllms_scheduler(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(free_port()))
    p = Instance(model_dir, "kv_producer")
    d = Instance(model_dir, "kv_consumer", {"transfer_timeout": 20})
    try:
        p.add("r1", 70, {"do_remote_decode": True}, max_tokens=1)
        ev = p.step(compute_prefill)
        params = ev["finished"]["r1"]
        assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
        # D's engine has its own id for the request; P's travels in the params.
        assert params["remote_request_id"] == "r1"
        req = d.add("d-r1", 70, dict(params), max_tokens=4)
        log = steps_until(
            [p, d],
            lambda log: any("d-r1" in e[1]["recving"] for e in log) and any("r1" in e[0]["sending"] for e in log),
        )
        assert all(not e[1]["invalid"] for e in log)
        assert req.kv_transfer_params["do_remote_prefill"] is False
        # D schedules it from the pulled KV: every byte equals what P computed.
        d.step()
        assert req.status == RequestStatus.RUNNING
        assert req.num_computed_tokens >= 69
        for i, block in enumerate(d.scheduler.kv_cache_manager.get_block_ids("d-r1")[0][:5]):
            for layer, t in enumerate(d.caches.values()):
                assert torch.all(d.block(t, block) == value("r1", i, layer)), (i, layer)
        # P freed its blocks when its worker reported r1 sent.
        assert "r1" not in p.scheduler.requests
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


@pytest.mark.parametrize("slots", [64, 4])
def test_staged_prefill_to_decode_under_vllms_scheduler(model_dir, monkeypatch, slots):
    """Host staging forced on over the CPU backend's torch tensors (the
    copies a CUDA cache gets, run synchronously): P's KV goes through its
    staging, D's through its own; with 4 slots the 5-block prompt cannot
    be staged and D's vLLM recomputes it."""
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(free_port()))
    extra = {"host_staging": "always", "staging_bytes": slots * 2 * len(LAYERS) * BLOCK * HEADS * HEAD * 4}
    p = Instance(model_dir, "kv_producer", extra)
    d = Instance(model_dir, "kv_consumer", {"transfer_timeout": 20, **extra})
    try:
        assert p.worker.connector_worker.stager.state()["slots"] == slots
        p.add("r1", 70, {"do_remote_decode": True}, max_tokens=1)
        params = p.step(compute_prefill)["finished"]["r1"]
        req = d.add("d-r1", 70, dict(params), max_tokens=4)
        log = steps_until(
            [p, d],
            lambda log: any("d-r1" in e[1]["recving"] for e in log) and any("r1" in e[0]["sending"] for e in log),
        )
        invalid = set().union(*(e[1]["invalid"] for e in log))
        blocks = d.scheduler.kv_cache_manager.get_block_ids("d-r1")[0][:5]
        ev = d.step()
        assert req.status == RequestStatus.RUNNING
        if slots == 4:
            # vLLM's recompute policy: D computes the whole prompt itself.
            assert invalid == set(blocks) and ev["scheduled"] == {"d-r1": 70}
        else:
            assert not invalid and req.num_computed_tokens >= 69
            for i, block in enumerate(blocks):
                for layer, t in enumerate(d.caches.values()):
                    assert torch.all(d.block(t, block) == value("r1", i, layer)), (i, layer)
        for inst in (p, d):
            state = inst.worker.connector_worker.stager.state()
            deadline = time.monotonic() + 10
            while state["requests"] or state["free_slots"] != slots:
                assert time.monotonic() < deadline, state
                inst.step()
                state = inst.worker.connector_worker.stager.state()
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


def test_failed_pull_is_recomputed_by_vllm(model_dir, monkeypatch):
    dead = free_port()  # nothing listens there
    d = Instance(model_dir, "kv_consumer", {"transfer_timeout": 5, "connect_timeout": 1})
    try:
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": dead}
        req = d.add("r2", 40, params, max_tokens=4)
        log = steps_until([d], lambda log: any("r2" in e[0]["recving"] for e in log))
        invalid = set().union(*(e[0]["invalid"] for e in log))
        assert invalid == set(d.scheduler.kv_cache_manager.get_block_ids("r2")[0])
        ev = d.step()
        # vLLM's recompute policy: the request runs, computing the whole prompt itself.
        assert ev["scheduled"] == {"r2": 40}
        assert req.status == RequestStatus.RUNNING
    finally:
        d.worker.shutdown()


def test_partial_prefix_hit_pulls_only_the_tail(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(free_port()))
    p = Instance(model_dir, "kv_producer")
    d = Instance(model_dir, "kv_consumer", {"transfer_timeout": 20})
    try:
        # D computed a 2-block prefix of the same prompt earlier: it is in D's prefix cache.
        d.add("warm", 2 * BLOCK + 1, None, max_tokens=1)
        assert "warm" in d.step(compute_prefill)["finished"]
        matched = []
        original = d.scheduler.connector.get_num_new_matched_tokens

        def record(request, num_computed_tokens):
            out = original(request, num_computed_tokens)
            matched.append((request.request_id, num_computed_tokens, out))
            return out

        monkeypatch.setattr(d.scheduler.connector, "get_num_new_matched_tokens", record)
        p.add("r3", 5 * BLOCK, {"do_remote_decode": True}, max_tokens=1)
        params = p.step(compute_prefill)["finished"]["r3"]
        req = d.add("r3", 5 * BLOCK, dict(params), max_tokens=4)
        steps_until(
            [p, d],
            lambda log: any("r3" in e[1]["recving"] for e in log) and any("r3" in e[0]["sending"] for e in log),
        )
        assert matched[0] == ("r3", 2 * BLOCK, (3 * BLOCK, True))
        d.step()
        assert req.status == RequestStatus.RUNNING
        # The prompt's 5 blocks (a 6th now holds the first decoded token).
        for i, block in enumerate(d.scheduler.kv_cache_manager.get_block_ids("r3")[0][:5]):
            for layer, t in enumerate(d.caches.values()):
                assert torch.all(d.block(t, block) == value("r3", i, layer)), (i, layer)
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


def test_abort_before_scheduling_frees_prefill_and_leaves_no_trace(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(free_port()))
    p = Instance(model_dir, "kv_producer")
    d = Instance(model_dir, "kv_consumer", {"transfer_timeout": 20})
    try:
        p.add("r4", 3 * BLOCK, {"do_remote_decode": True}, max_tokens=1)
        params = p.step(compute_prefill)["finished"]["r4"]
        d.add("r4", 3 * BLOCK, dict(params), max_tokens=4)
        d.scheduler.finish_requests("r4", RequestStatus.FINISHED_ABORTED)
        log = steps_until([p, d], lambda log: any("r4" in e[0]["sending"] for e in log))
        assert all(not e[1]["recving"] and not e[1]["invalid"] for e in log)
        for _ in range(3):
            d.step()
        # vLLM's D scheduler holds nothing for it (the reference leaves the id in this set).
        assert "r4" not in d.scheduler.requests
        assert d.scheduler.finished_recving_kv_req_ids == set()
        assert "r4" not in p.scheduler.requests
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


def test_abort_during_pull_holds_no_block_and_no_late_write(model_dir, monkeypatch):
    """vLLM finishes (aborts) a request on D while its pull is in flight.
    0.14 frees its blocks at once and must never hear of the pull; 0.32
    holds them until the pull is reported, which kvlink does once, after
    fencing it. Either way D ends with every block free and none written."""
    port = free_port()
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(port))
    p = Instance(model_dir, "kv_producer")
    d = Instance(model_dir, "kv_consumer", {"transfer_timeout": 20})
    try:
        # 600 tokens in chunks of 256: after one step P is still prefilling
        # (its send entry announced, its KV not ready).
        p.add("r5", 600, {"do_remote_decode": True}, max_tokens=1)
        assert "r5" not in p.step(compute_prefill)["finished"]
        free_at_start = d.free_blocks()
        params = {
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": port + 1,  # P's side channel, past its bootstrap port
            "remote_request_id": "r5",
            "remote_engine_id": p.config.kv_transfer_config.engine_id,
        }
        d.add("d-r5", 600, params, max_tokens=4)
        log = [d.step()]
        blocks = d.scheduler.kv_cache_manager.get_block_ids("d-r5")[0]
        assert len(blocks) == 38 and d.free_blocks() == free_at_start - 38
        # P has D's transfer request and waits for its own KV.
        deadline = time.monotonic() + 10
        while p.worker.connector_worker.worker.transfers_in_progress < 1:
            assert time.monotonic() < deadline, "P never admitted D's transfer request"
            time.sleep(0.01)
        d.scheduler.finish_requests("d-r5", RequestStatus.FINISHED_ABORTED)
        if not BEHAVIOUR.report_abandoned_pulls:
            assert "d-r5" not in d.scheduler.requests and d.free_blocks() == free_at_start
        else:
            assert "d-r5" in d.scheduler.requests and d.free_blocks() == free_at_start - 38
        # D's next step cancels and fences the pull (0.32: and reports it).
        log.append(d.step())
        assert d.free_blocks() == free_at_start and "d-r5" not in d.scheduler.requests
        # P finishes the prefill and tries to send: the grant is revoked.
        log += [e[1] for e in steps_until([p, d], lambda log: any("r5" in e[0]["sending"] for e in log))]
        for _ in range(3):
            log.append(d.step())
        reported = [e["recving"] for e in log if e["recving"]]
        assert reported == ([{"d-r5"}] if BEHAVIOUR.report_abandoned_pulls else [])
        assert all(not e["invalid"] for e in log)
        assert d.free_blocks() == free_at_start
        assert d.scheduler.finished_recving_kv_req_ids == set()
        # No late write: D computed nothing, so every byte is still zero.
        for t in d.caches.values():
            for block in blocks:
                assert not torch.any(d.block(t, block)), block
        assert "r5" not in p.scheduler.requests
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


def prometheus_samples() -> dict[str, list[tuple[dict, float]]]:
    """Every sample of prometheus_client's default registry (what vLLM's
    ``/metrics`` serves in a single-process front end), by sample name."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def stats_of(payloads) -> "KvlinkConnectorStats":
    from kvlink_vllm.stats import KvlinkConnectorStats

    total = KvlinkConnector.build_kv_connector_stats()
    for data in payloads:
        total = total.aggregate(KvlinkConnector.build_kv_connector_stats(data))
    assert isinstance(total, KvlinkConnectorStats)
    return total


def test_stats_reach_vllms_log_line_and_prometheus(model_dir, monkeypatch):
    """A transfer's stats from the worker-side connectors through vLLM's
    scheduler (``SchedulerStats.kv_connector_stats``, msgpack-encoded as the
    engine core sends them), then vLLM's ``KVConnectorLogging`` (the periodic
    log line) and its ``PrometheusStatLogger`` (``/metrics``)."""
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from kvlink_vllm.stats import KvlinkPromMetrics

    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(free_port()))
    p = Instance(model_dir, "kv_producer")
    d = Instance(model_dir, "kv_consumer", {"transfer_timeout": 20})
    try:
        p.add("r1", 70, {"do_remote_decode": True}, max_tokens=1)
        params = p.step(compute_prefill)["finished"]["r1"]
        d.add("d-r1", 70, dict(params), max_tokens=4)
        steps_until(
            [p, d],
            lambda log: any("d-r1" in e[1]["recving"] for e in log) and any("r1" in e[0]["sending"] for e in log),
        )
        # P counts a request sent as its reply to D is built: maybe a step later.

        def payloads(inst):
            return [s.kv_connector_stats for s in inst.scheduler_stats if s.kv_connector_stats]

        steps_until([p], lambda log: stats_of(payloads(p)).counter("sends_done") == 1)
        block_bytes = sum(d.block(t, 0).numel() * t.element_size() for t in d.caches.values())
        moved = 5 * block_bytes  # 70 tokens: 5 blocks of 16

        # vLLM's periodic log line, from what the front end received.
        logging = KVConnectorLogging(d.config.kv_transfer_config)
        for data in payloads(d):
            logging.observe(data)
        lines: list[str] = []
        logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        assert len(lines) == 1, lines
        assert lines[0].startswith("KV Transfer metrics: Pulls received=1, Pulls failed=0, Pull GB/s="), lines[0]
        assert "Pulls failed (" not in lines[0]
        logging_p = KVConnectorLogging(p.config.kv_transfer_config)
        for data in payloads(p):
            logging_p.observe(data)
        lines = []
        logging_p.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        assert len(lines) == 1, lines
        assert lines[0].startswith("KV Transfer metrics: Sends done=1, Sends failed=0, Send GB/s="), lines[0]

        # vLLM's Prometheus logger: our metrics class, its engine labels.
        for inst, role_families in ((d, ("pulls_received",)), (p, ("sends_done",))):
            prom = PrometheusStatLogger(inst.config, engine_indexes=[0])
            assert isinstance(prom.kv_connector_prom.prom_metrics, KvlinkPromMetrics)
            for stats in inst.scheduler_stats:
                prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
            samples = prometheus_samples()
            engine = {"model_name": inst.config.model_config.served_model_name, "engine": "0"}
            for name in role_families:
                assert samples[f"vllm:kvlink_{name}_total"] == [(engine, 1.0)], name
            families = inst.worker.connector_worker.worker.metrics()
            for family in families:
                if family["labels"] and not family["samples"]:
                    continue  # a labelled family with no label value yet (no peer connected): no series
                kind = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[family["kind"]]
                suffix = {"counter": "_total", "gauge": "", "histogram": "_count"}[family["kind"]]
                exposed = "vllm:kvlink_" + family["name"] + suffix
                assert exposed in samples, f"{exposed} ({kind.__name__}) is not on /metrics"
                for labels, _ in samples[exposed]:
                    assert {k: labels[k] for k in engine} == engine
                    assert set(labels) == set(engine) | set(family["labels"])
            if inst is d:
                failed = samples["vllm:kvlink_pulls_failed_total"]
                causes = next(f for f in families if f["name"] == "pulls_failed")["samples"]
                assert len(failed) == len(causes) and all(v == 0 for _, v in failed), failed
                assert samples["vllm:kvlink_received_bytes_total"] == [(engine, float(moved))]
                assert samples["vllm:kvlink_pull_bytes_count"] == [(engine, 1.0)]
                assert samples["vllm:kvlink_pull_bytes_sum"] == [(engine, float(moved))]
                assert samples["vllm:kvlink_pulls_in_flight"] == [(engine, 0.0)]
                buckets = {labels["le"]: v for labels, v in samples["vllm:kvlink_pull_bytes_bucket"]}
                bounds = next(f for f in families if f["name"] == "pull_bytes")["samples"][0]["bounds"]
                assert buckets["+Inf"] == 1.0
                finite = {float(le): v for le, v in buckets.items() if le != "+Inf"}
                assert all(v == (1.0 if le >= moved else 0.0) for le, v in finite.items()), buckets
                assert len(buckets) == len(bounds) + 1
            else:
                assert samples["vllm:kvlink_sent_bytes_total"] == [(engine, float(moved))]
                assert all(v == 0 for _, v in samples["vllm:kvlink_sends_failed_total"])
    finally:
        p.worker.shutdown()
        d.worker.shutdown()


def test_tensor_parallel_workers_stats_aggregate_through_vllms_output_aggregator(model_dir):
    """Two tensor-parallel workers' stats of one step, through vLLM's
    ``KVOutputAggregator`` (the executor's): counters add, each worker's
    gauges are kept; a failed pull is counted by its cause."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    from kvlink_vllm.stats import KvlinkConnectorStats

    d = Instance(model_dir, "kv_consumer", {"transfer_timeout": 5, "connect_timeout": 1})
    try:
        dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port()}
        d.add("r1", 40, dead, max_tokens=4)
        steps_until([d], lambda log: any("r1" in e[0]["recving"] for e in log))
        rank0 = stats_of(s.data for s in d.worker_stats if s is not None)
        assert rank0.by_label("pulls_failed", "cause")["connection_lost"] == 1
        rank1 = KvlinkConnectorStats(data=json.loads(json.dumps(rank0.data).replace('"0.0"', '"0.1"')))

        def output(stats):
            return runner_output(
                [],
                sampled_token_ids=[],
                kv_connector_output=KVConnectorOutput(kv_connector_stats=stats),
            )

        merged = KVOutputAggregator.from_connector(d.worker, world_size=2).aggregate([output(rank0), output(rank1)])
        got = merged.kv_connector_output.kv_connector_stats
        assert isinstance(got, KvlinkConnectorStats)
        assert got.by_label("pulls_failed", "cause")["connection_lost"] == 2
        assert set(got.data["gauges"]) == {"0.0", "0.1"}
        # The inputs are as they were.
        assert rank0.by_label("pulls_failed", "cause")["connection_lost"] == 1
        assert got.reduce()["Pulls failed (connection_lost)"] == 2
    finally:
        d.worker.shutdown()


@pytest.mark.skipif(RELEASE < (0, 33), reason="sleep mode asks connectors from vLLM 0.33")
def test_vllm_refuses_sleep_mode_with_kvlink(model_dir):
    """vLLM's own start-up check (through its connector factory) refuses
    ``--enable-sleep-mode`` with kvlink, naming it: sleep would unmap the
    cache under a pull or a staging copy."""
    config = vllm_config(model_dir, "kv_both")
    config._verify_kv_transfer_compat()  # without sleep mode: accepted
    # The CPU platform has no sleep mode of its own: set it past ModelConfig's platform check.
    config.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="KvlinkConnector does not support sleep mode"):
        config._verify_kv_transfer_compat()


@pytest.mark.skipif(RELEASE < (0, 34), reason="kv_cache_access comes with vLLM 0.34")
def test_kv_cache_access_is_in_process(model_dir):
    """The extensible KV cache reads kvlink's declaration through vLLM's
    factory: in-process access, no single physical allocation needed."""
    from vllm.config.kv_transfer import KVCacheAccess

    # kvlink's own declaration, not the base class's default (which may change).
    assert "kv_cache_access" in vars(KvlinkConnector)
    transfer = vllm_config(model_dir, "kv_both").kv_transfer_config
    assert transfer.kv_cache_access() == KVCacheAccess.IN_PROCESS
    assert not transfer.kv_cache_access().needs_single_chunk()
