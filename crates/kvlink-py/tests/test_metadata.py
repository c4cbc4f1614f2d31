"""Scheduler side: the metadata pickles, and vLLM's dict is updated as the reference does."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from kvsim import Blocks, RequestStatus


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
        "remote_request_id": "cmpl-1-0-b00fff6e",
        "remote_engine_id": "e-prefill",
        "remote_renewal_key": "ab" * 16,
        "remote_block_ids": "kept as is",
    }
    # D's engine names the request its own way; P's id travels in the params.
    req = request("cmpl-1-0-9760c8b8", params)
    assert c.get_num_new_matched_tokens(req, 16) == (24, True)
    c.update_state_after_alloc(req, Blocks([7, 3, 5], hashed=1), 24)
    # Cleared in the engine's own dict (same object), nothing else touched.
    assert req.kv_transfer_params is params
    assert params == {
        "do_remote_prefill": False,
        "do_remote_decode": False,
        "remote_host": "10.0.0.9",
        "remote_port": 9000,
        "remote_request_id": "cmpl-1-0-b00fff6e",
        "remote_engine_id": "e-prefill",
        "remote_renewal_key": "ab" * 16,
        "remote_block_ids": "kept as is",
    }
    meta = c.build_connector_meta(SimpleNamespace())
    assert isinstance(meta, KvlinkConnectorMetadata)
    copy = pickle.loads(pickle.dumps(meta))
    assert type(copy) is KvlinkConnectorMetadata and copy.payload == meta.payload
    body = copy.decoded()
    assert body["meta"]["reqs_to_recv"] == {
        "cmpl-1-0-9760c8b8": {
            "local_block_ids": [3, 5],
            # D's prefix cache held the first 16 tokens: its blocks start there.
            "first_token": 16,
            "remote": {
                "remote_host": "10.0.0.9",
                "remote_port": 9000,
                "remote_request_id": "cmpl-1-0-b00fff6e",
                "remote_engine_id": "e-prefill",
                "remote_renewal_key": "ab" * 16,
                "bootstrap": None,
            },
        }
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
    # Side channel base port: past the bootstrap port 8998, + dp_rank 1 * tp_size 2.
    assert (c.connector_scheduler.host, c.connector_scheduler.port) == ("10.1.2.3", 9001)
    req = request("p1", {"do_remote_decode": True})
    c.update_state_after_alloc(req, Blocks([4, 5, 6], hashed=0), 0)
    body = c.build_connector_meta(SimpleNamespace()).decoded()
    assert body["meta"]["reqs_to_send"] == {"p1": "Expect"}
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, out = c.request_finished(req, [4, 5, 6])
    assert delay is True
    key = out.pop("remote_renewal_key")
    assert re.fullmatch("[0-9a-f]{32}", key), "the request's renewal key: 128 bits, hex"
    assert out == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": "10.1.2.3",
        "remote_port": 9001,
        "remote_request_id": "p1",
        "remote_engine_id": "e-kv_producer",
    }
    body = c.build_connector_meta(SimpleNamespace()).decoded()
    assert body["meta"]["reqs_to_send"] == {"p1": {"Ready": {"block_ids": [4, 5, 6]}}}
    # The worker is given the same key, with the update.
    assert body["meta"]["renewal_keys"] == {"p1": key}
    # Stopped early: blocks freed now, the worker's entry withdrawn (no leak).
    stopped = request("p2", {"do_remote_decode": True})
    c.update_state_after_alloc(stopped, Blocks([9], hashed=0), 0)
    stopped.status = RequestStatus.FINISHED_STOPPED
    assert c.request_finished(stopped, [9]) == (False, None)
    assert c.build_connector_meta(SimpleNamespace()).decoded()["meta"]["reqs_to_send"] == {"p2": "Forget"}
    assert c.connector_scheduler._native.live_send_entries == 0


#: Client params no engine may raise on: each is served as a local request.
BAD_PARAMS = [
    ("kv_consumer", {"do_remote_prefill": True, "remote_host": "h", "remote_port": "9000"}),
    ("kv_consumer", {"do_remote_prefill": True, "remote_host": "h", "remote_port": 70000}),
    ("kv_consumer", {"do_remote_prefill": True, "remote_host": "h", "remote_port": -1}),
    ("kv_consumer", {"do_remote_prefill": "yes", "remote_host": "h", "remote_port": 1}),
    ("kv_consumer", {"do_remote_prefill": 1, "remote_host": "h", "remote_port": 1}),
    ("kv_consumer", {"do_remote_decode": True}),
    ("kv_consumer", {"do_remote_prefill": True, "remote_port": 1}),
    ("kv_consumer", {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_request_id": 7}),
    ("kv_consumer", {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_request_id": "x" * 100_000}),
    ("kv_consumer", {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_engine_id": ["p"]}),
    ("kv_consumer", ["not", "a", "dict"]),
    ("kv_consumer", {"do_remote_prefill": True, "remote_host": object(), "remote_port": 1}),
    ("kv_producer", {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}),
    ("kv_producer", {"do_remote_decode": "true"}),
]


@pytest.mark.parametrize(("role", "params"), BAD_PARAMS)
def test_bad_client_params_serve_the_request_locally_and_never_raise(role, params, caplog):
    c = scheduler(role)
    req = request("bad", params)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    c.update_state_after_alloc(req, Blocks([1, 2, 3], hashed=0), 0)
    meta = c.build_connector_meta(SimpleNamespace()).decoded()["meta"]
    assert meta["reqs_to_recv"] == {} and meta["reqs_to_send"] == {} and meta["reqs_to_watch"] == {}
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.request_finished(req, [1, 2, 3]) == (False, None), "no block is held for it"
    assert c.build_connector_meta(SimpleNamespace()).decoded()["meta"]["reqs_to_recv"] == {}
    assert c.connector_scheduler._native.live_send_entries == 0
    # The next, good request is served as usual.
    good = request("good", {"do_remote_decode": True} if role == "kv_producer" else {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1})
    assert c.get_num_new_matched_tokens(good, 0) == ((0, False) if role == "kv_producer" else (40, True))


def test_an_unknown_status_frees_the_blocks():
    c = scheduler("kv_producer")
    req = request("p1", {"do_remote_decode": True})
    c.update_state_after_alloc(req, Blocks([4], hashed=0), 0)
    req.status = SimpleNamespace(name="WAITING_FOR_SOMETHING_NEW")
    assert c.request_finished(req, [4]) == (False, None)
    assert c.build_connector_meta(SimpleNamespace()).decoded()["meta"]["reqs_to_send"] == {"p1": "Forget"}


def test_a_repetition_stop_is_no_hand_off():
    # vLLM 0.32's FINISHED_REPETITION is an early stop: no hand-off, the send
    # entry withdrawn.
    c = scheduler("kv_producer")
    req = request("p2", {"do_remote_decode": True})
    c.update_state_after_alloc(req, Blocks([5], hashed=0), 0)
    req.status = SimpleNamespace(name="FINISHED_REPETITION")
    assert c.request_finished(req, [5]) == (False, None)
    assert c.build_connector_meta(SimpleNamespace()).decoded()["meta"]["reqs_to_send"] == {"p2": "Forget"}
    # The length-capped end of a prefill still hands off.
    req = request("p3", {"do_remote_decode": True})
    c.update_state_after_alloc(req, Blocks([6], hashed=0), 0)
    req.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    delay, params = c.request_finished(req, [6])
    assert delay is True and params["do_remote_prefill"] is True


#: A scheduler, alone in a fresh interpreter (as vLLM's engine core runs
#: it when its workers are other processes), sees two requests whose params
#: name P's request without a renewal key, then one with a key.
STRIPPED_KEY_CHILD = """
import test_metadata as t
stripped = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "remote_request_id": "p-1"}
c = t.scheduler("kv_consumer")
for rid in ("d-1", "d-2"):
    assert c.get_num_new_matched_tokens(t.request(rid, dict(stripped)), 0) == (40, True)
keyed = t.scheduler("kv_consumer")
keyed_params = {**stripped, "remote_renewal_key": "0f" * 16}
assert keyed.get_num_new_matched_tokens(t.request("d-3", keyed_params), 0) == (40, True)
"""


def test_params_naming_ps_request_without_a_renewal_key_are_warned_once():
    """A proxy that keeps only the fields it knows drops the renewal key: D
    then cannot renew P's hold, and says so once, not per request, in the
    log of the scheduler's own process (where no worker ever started);
    params with the key say nothing."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, "-c", STRIPPED_KEY_CHILD], cwd=here, env=env, capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    assert child.stderr.count("carry no remote_renewal_key") == 1, child.stderr
    assert "d-1" in child.stderr and "d-3" not in child.stderr, "params with the key say nothing"
