"""Scheduler side: the metadata pickles, and vLLM's dict is updated as the reference does."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
from kvsim import Blocks, RequestStatus

from kvlink_vllm import ConfigError, KvlinkError
from kvlink_vllm.connector import KVConnectorRole, KvlinkConnector, KvlinkConnectorMetadata


def scheduler(role: str) -> KvlinkConnector:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role=role, engine_id=f"e-{role}", kv_connector_extra_config={"advertised_host": "10.1.2.3"}
        ),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, data_parallel_rank=1, data_parallel_index=1),
    )
    return KvlinkConnector(config, KVConnectorRole.SCHEDULER, None)


def request(rid: str, params, prompt_len: int = 40, status=RequestStatus.WAITING):
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=list(range(prompt_len)), kv_transfer_params=params, status=status
    )


def test_decode_side_records_one_pull_and_clears_do_remote_prefill():
    c = scheduler("kv_consumer")
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": "10.0.0.9",
        "remote_port": 9000,
        "remote_engine_id": "kept as is",
    }
    req = request("r1", params)
    assert c.get_num_new_matched_tokens(req, 16) == (24, True)
    c.update_state_after_alloc(req, Blocks([7, 3, 5], hashed=1), 24)
    # Cleared in the engine's own dict (same object), nothing else touched.
    assert req.kv_transfer_params is params
    assert params == {
        "do_remote_prefill": False,
        "do_remote_decode": False,
        "remote_host": "10.0.0.9",
        "remote_port": 9000,
        "remote_engine_id": "kept as is",
    }
    meta = c.build_connector_meta(SimpleNamespace())
    assert isinstance(meta, KvlinkConnectorMetadata)
    copy = pickle.loads(pickle.dumps(meta))
    assert type(copy) is KvlinkConnectorMetadata and copy.payload == meta.payload
    body = copy.decoded()
    assert body["meta"]["reqs_to_recv"] == {
        "r1": {"local_block_ids": [3, 5], "remote_host": "10.0.0.9", "remote_port": 9000}
    }
    assert body["notify_only"] == []
    # A second allocation of the same request triggers no second pull.
    assert c.get_num_new_matched_tokens(req, 16) == (0, False)
    c.update_state_after_alloc(req, Blocks([7, 3, 5, 8], hashed=1), 0)
    assert c.build_connector_meta(SimpleNamespace()).decoded()["meta"]["reqs_to_recv"] == {}


def test_notices_vllm_does_not_wait_for_are_marked():
    c = scheduler("kv_consumer")
    remote = {"remote_host": "10.0.0.9", "remote_port": 9000}
    full_hit = request("hit", {"do_remote_prefill": True, **remote})
    c.update_state_after_alloc(full_hit, Blocks([1, 2], hashed=2), 0)
    aborted = request("gone", {"do_remote_prefill": True, **remote}, status=RequestStatus.FINISHED_ABORTED)
    assert c.request_finished(aborted, []) == (False, None)
    assert aborted.kv_transfer_params["do_remote_prefill"] is False
    body = pickle.loads(pickle.dumps(c.build_connector_meta(SimpleNamespace()))).decoded()
    assert body["meta"]["reqs_to_recv"]["hit"]["local_block_ids"] == []
    assert body["meta"]["reqs_to_recv"]["gone"]["local_block_ids"] == []
    assert body["notify_only"] == ["gone", "hit"]


def test_prefill_side_delays_free_and_points_decode_here():
    c = scheduler("kv_producer")
    # Side channel base port: bootstrap 8998 + dp_rank 1 * tp_size 2.
    assert (c.connector_scheduler.host, c.connector_scheduler.port) == ("10.1.2.3", 9000)
    req = request("p1", {"do_remote_decode": True})
    c.update_state_after_alloc(req, Blocks([4, 5, 6], hashed=0), 0)
    body = c.build_connector_meta(SimpleNamespace()).decoded()
    assert body["meta"]["reqs_to_send"] == {"p1": "Expect"}
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, out = c.request_finished(req, [4, 5, 6])
    assert delay is True
    assert out == {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "10.1.2.3", "remote_port": 9000}
    body = c.build_connector_meta(SimpleNamespace()).decoded()
    assert body["meta"]["reqs_to_send"] == {"p1": {"Ready": {"block_ids": [4, 5, 6]}}}
    # Stopped early: blocks freed now, the worker's entry withdrawn (no leak).
    stopped = request("p2", {"do_remote_decode": True})
    c.update_state_after_alloc(stopped, Blocks([9], hashed=0), 0)
    stopped.status = RequestStatus.FINISHED_STOPPED
    assert c.request_finished(stopped, [9]) == (False, None)
    assert c.build_connector_meta(SimpleNamespace()).decoded()["meta"]["reqs_to_send"] == {"p2": "Forget"}
    assert c.connector_scheduler._native.live_send_entries == 0


def test_role_violations_and_bad_params_are_errors():
    c = scheduler("kv_producer")
    req = request("x", {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1})
    with pytest.raises(KvlinkError, match="do_remote_prefill"):
        c.update_state_after_alloc(req, Blocks([1], hashed=0), 16)
    bad = request("y", {"do_remote_prefill": True, "remote_port": "9000"})
    with pytest.raises(ConfigError, match="remote_port"):
        c.get_num_new_matched_tokens(bad, 0)
