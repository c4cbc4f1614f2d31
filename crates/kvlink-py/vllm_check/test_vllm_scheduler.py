"""kvlink under vLLM 0.14.0's own scheduler (``cargo xtask vllm-check``, not CI).

Needs ``vllm==0.14.0`` installed (it brings torch). No model weights: the
model is a local ``config.json``, the tokenizer is skipped, nothing is
fetched. The connectors are created by vLLM's ``KVConnectorFactory`` from
``kv_connector_module_path``; the scheduler is vLLM's ``Scheduler``; the
worker side is the connector over CPU tensors in the CPU backend's layout,
driven in the model runner's order. P and D live in one process here (the
process separation is what the CI tests cover).
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.utils.hashing import sha256

import kvlink_vllm
from kvlink_vllm.connector import KvlinkConnector

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


class Instance:
    """vLLM's scheduler plus one worker-side connector over CPU tensors."""

    def __init__(self, model_dir: str, role: str, extra: dict | None = None):
        model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, seed=0)
        self.config = VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_model_len=1024, is_encoder_decoder=False, max_num_seqs=8, max_num_batched_tokens=256
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KvlinkConnector",
                kv_connector_module_path="kvlink_vllm",
                kv_role=role,
                kv_connector_extra_config={"advertised_host": "127.0.0.1", **(extra or {})},
            ),
            device_config=DeviceConfig("cpu"),
        )
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
        shape = CPUAttentionBackend.get_kv_cache_shape(BLOCKS, BLOCK, HEADS, HEAD)
        self.caches = {name: torch.zeros(shape, dtype=torch.float32) for name in LAYERS}
        self.worker.register_kv_caches(self.caches)
        self.outputs: list = []

    def add(self, rid: str, prompt_len: int, params: dict, max_tokens: int) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(
            request_id=rid,
            prompt_token_ids=[(7 * i + 3) % 1000 for i in range(prompt_len)],
            sampling_params=sp,
            pooling_params=None,
            eos_token_id=2,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        req.kv_transfer_params = params
        self.scheduler.add_request(req)
        return req

    def fill(self, rid: str, value_of) -> None:
        for i, block in enumerate(self.scheduler.kv_cache_manager.get_block_ids(rid)[0]):
            for layer, t in enumerate(self.caches.values()):
                t[:, block] = value_of(rid, i, layer)

    def step(self, compute=None) -> dict:
        out = self.scheduler.schedule()
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)
        if compute:
            for rid in out.num_scheduled_tokens:
                compute(self, rid)
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        rids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={r: i for i, r in enumerate(rids)},
            sampled_token_ids=[[5] for _ in rids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid
            ),
        )
        engine_outputs = self.scheduler.update_from_output(out, runner)
        finished = {}
        for eco in engine_outputs.values():
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
                assert torch.all(t[:, block] == value("r1", i, layer)), (i, layer)
        # P freed its blocks when its worker reported r1 sent.
        assert "r1" not in p.scheduler.requests
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
                assert torch.all(t[:, block] == value("r3", i, layer)), (i, layer)
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
