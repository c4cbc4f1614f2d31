"""P and D as two processes on loopback, driven through vLLM 0.14's call
sequence (see ``kvsim``), over memory-mapped fake KV tensors; every byte
that lands on D is compared with what P computed."""

from __future__ import annotations

import time

import pytest
from conftest import collected, free_port, no_violations, step_until

BLOCK = 16


def start_pair(instances, p_env=None, d_extra=None):
    port = free_port()
    env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)}
    env.update(p_env or {})
    p = instances("P", "kv_producer", env=env)
    d = instances("D", "kv_consumer", extra=d_extra or {"transfer_timeout": 20})
    assert p.ready["side_channel_port"] == port + 1, "the side channel listens past the bootstrap port"
    return p, d


def prefill(p, rid: str, prompt_len: int, hold: bool = False) -> dict:
    """Runs the prefill of ``rid`` on P; returns the params for D (as the proxy does)."""
    p.call("add", request_id=rid, prompt_len=prompt_len, params={"do_remote_decode": True}, hold=hold)
    ev = p.call("step")
    if hold:
        return {}
    out = ev["finished"][rid]
    assert out["delay_free"] is True
    params = out["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1"
    return params


def test_plain_prefill_to_decode(instances):
    p, d = start_pair(instances)
    # The CPU backend's blocks are head-major: declared, so a peer of
    # another tensor-parallel size, block size or token order maps them;
    # the identity names an attention layout only where blocks are copied
    # whole (then it must agree).
    for side in (p, d):
        state = side.call("state")
        assert state["layout"] == {"token_layout": "HND", "block_heads": 2}
        assert state["identity"]["attention_layout"] == ""
    params = prefill(p, "r1", prompt_len=3 * BLOCK + 5)  # 4 blocks
    d.call("add", request_id="r1", prompt_len=3 * BLOCK + 5, params=params, max_tokens=100)
    ev = step_until(
        [p, d],
        lambda e: "r1" in collected(e["D"], "finished_recving") and "r1" in collected(e["P"], "finished_sending"),
        what="r1 received on D and sent on P",
    )
    assert collected(ev["D"], "invalid_block_ids") == []
    v = d.call("verify", request_id="r1")
    assert v["bad"] == [] and len(v["blocks"]) == 4
    assert v["bytes"] == 4 * 8 * 2 * BLOCK * 16 * 2  # blocks x regions x heads x tokens x head_dim x bf16
    # Reported once each, and D's request runs (decodes) from the pulled KV.
    assert collected(ev["D"], "finished_recving").count("r1") == 1
    assert collected(ev["P"], "finished_sending").count("r1") == 1
    d.call("step")
    assert d.call("state")["requests"]["r1"] == "RUNNING"
    assert "r1" not in p.call("state")["requests"]  # P freed its blocks
    no_violations(p, d)


def test_partial_prefix_hit_on_decode(instances):
    p, d = start_pair(instances)
    params = prefill(p, "r2", prompt_len=5 * BLOCK)  # 5 blocks on P
    # D already holds the first 2 blocks (prefix cache): only the last 3 are pulled.
    d.call("add", request_id="r2", prompt_len=5 * BLOCK, params=params, max_tokens=100, hit_blocks=2)
    ev = step_until(
        [p, d],
        lambda e: "r2" in collected(e["D"], "finished_recving") and "r2" in collected(e["P"], "finished_sending"),
        what="r2 received",
    )
    assert collected(ev["D"], "invalid_block_ids") == []
    v = d.call("verify", request_id="r2")
    assert v["bad"] == [] and len(v["blocks"]) == 5
    no_violations(p, d)


def test_abort_before_scheduling_on_decode(instances):
    p, d = start_pair(instances)
    params = prefill(p, "r3", prompt_len=2 * BLOCK)
    d.call("add", request_id="r3", prompt_len=2 * BLOCK, params=params, max_tokens=100)
    # Aborted before D's scheduler ever ran it: D must still tell P to free.
    out = d.call("abort", request_id="r3")
    assert out == {"delay_free": False, "kv_transfer_params": None}
    ev = step_until([p, d], lambda e: "r3" in collected(e["P"], "finished_sending"), what="P frees r3")
    # P freed on D's notice, long before its 480 s lease; D reports nothing for r3.
    assert collected(ev["D"], "finished_recving") == []
    assert collected(ev["D"], "invalid_block_ids") == []
    for _ in range(3):
        assert d.call("step")["finished_recving"] == []
    no_violations(p, d)


def test_prefill_lease_frees_unpulled_blocks(instances):
    p, d = start_pair(instances, p_env={"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": "1"})
    params = prefill(p, "r4", prompt_len=2 * BLOCK)
    started = time.monotonic()
    step_until([p], lambda e: "r4" in collected(e["P"], "finished_sending"), timeout=10, what="lease end")
    held = time.monotonic() - started
    assert held >= 0.9, f"blocks freed after {held:.2f} s, before the 1 s lease"
    assert "r4" not in p.call("state")["requests"]
    # A late pull for it fails on D (reported with its blocks), it does not hang.
    d.call(
        "add",
        request_id="r4",
        prompt_len=2 * BLOCK,
        params=params,
        max_tokens=100,
    )
    ev = step_until([p, d], lambda e: "r4" in collected(e["D"], "finished_recving"), what="late pull fails")
    assert sorted(collected(ev["D"], "invalid_block_ids")) == d.call("verify", request_id="r4")["blocks"]
    no_violations(p, d)


def test_prefill_killed_mid_transfer(instances):
    p, d = start_pair(instances, d_extra={"transfer_timeout": 30})
    port = p.ready["side_channel_port"]
    # P is still prefilling r5 (its forward spans steps) when D asks for it:
    # P admits D's transfer request and holds it until r5 is ready.
    prefill(p, "r5", prompt_len=3 * BLOCK, hold=True)
    d.call(
        "add",
        request_id="r5",
        prompt_len=3 * BLOCK,
        params={
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": p.ready["side_channel_port"],
            # What P will return once the prefill ends: its own id of the request.
            "remote_request_id": p.call("internal_id", request_id="r5"),
        },
        max_tokens=100,
    )
    d.call("step")  # D schedules r5 and starts the pull
    deadline = time.monotonic() + 10
    while p.call("state")["transfers_in_progress"] < 1:
        assert time.monotonic() < deadline, "P never admitted D's transfer request"
        time.sleep(0.01)
    blocks = d.call("verify", request_id="r5")["blocks"]
    p.kill()
    started = time.monotonic()
    ev = step_until([d], lambda e: "r5" in collected(e["D"], "finished_recving"), timeout=10, what="failure reported")
    assert time.monotonic() - started < 5, "the failure took longer than a dead connection should"
    assert collected(ev["D"], "finished_recving") == ["r5"]
    assert sorted(collected(ev["D"], "invalid_block_ids")) == sorted(blocks)
    # Same step: the ids and the blocks arrive together.
    last = ev["D"][-1]
    assert last["finished_recving"] == ["r5"] and sorted(last["invalid_block_ids"]) == sorted(blocks)
    # Exactly once; the request is then recomputed locally.
    for _ in range(3):
        e = d.call("step")
        assert e["finished_recving"] == [] and e["invalid_block_ids"] == []
    state = d.call("state")
    assert state["recompute"] == ["r5"] and state["requests"]["r5"] == "RUNNING"
    assert state["violations"] == []


@pytest.mark.parametrize("release", ["0.14.0", "0.32.0"])
def test_decode_abort_during_pull_holds_no_block_and_no_late_write(instances, release):
    """0.14 frees the blocks at the abort and must never hear of the pull;
    0.32 holds them until the pull is reported, which kvlink does once,
    after the fence. Either way no byte of P's lands in them."""
    port = free_port()
    p = instances("P", "kv_producer", env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)}, vllm_release=release)
    d = instances("D", "kv_consumer", extra={"transfer_timeout": 20}, vllm_release=release)
    free_at_start = d.call("state")["free_blocks"]
    prefill(p, "r6", prompt_len=2 * BLOCK, hold=True)  # still prefilling on P
    d.call(
        "add",
        request_id="r6",
        prompt_len=2 * BLOCK,
        params={
            "do_remote_prefill": True,
            "remote_host": "127.0.0.1",
            "remote_port": p.ready["side_channel_port"],
            # What P will return once the prefill ends: its own id of the request.
            "remote_request_id": p.call("internal_id", request_id="r6"),
        },
        max_tokens=100,
    )
    d.call("step")  # D starts the pull
    blocks = d.call("block_ids", request_id="r6")
    assert len(blocks) == 2
    deadline = time.monotonic() + 10
    while p.call("state")["transfers_in_progress"] < 1:
        assert time.monotonic() < deadline, "P never admitted D's transfer request"
        time.sleep(0.01)
    # vLLM aborts the request on D while its pull is in flight.
    assert d.call("abort", request_id="r6") == {"delay_free": False, "kv_transfer_params": None}
    held = d.call("state")
    if release == "0.14.0":
        assert held["free_blocks"] == free_at_start and held["held_for_pull"] == []
    else:
        assert held["free_blocks"] == free_at_start - 2 and held["held_for_pull"] == ["r6"]
    # The next step fences the pull (and on 0.32 reports it, so vLLM frees).
    first = d.call("step")
    # P finishes the prefill and writes, if it still can.
    p.call("release", request_id="r6")
    ev = step_until([p, d], lambda e: "r6" in collected(e["P"], "finished_sending"), what="P sends r6")
    for _ in range(3):
        ev["D"].append(d.call("step"))
    recving = [first["finished_recving"]] + [e["finished_recving"] for e in ev["D"]]
    assert [r for r in recving if r] == ([] if release == "0.14.0" else [["r6"]])
    assert first["invalid_block_ids"] == [] and collected(ev["D"], "invalid_block_ids") == []
    state = d.call("state")
    assert state["free_blocks"] == free_at_start and state["held_for_pull"] == [] and "r6" not in state["requests"]
    # No late write: the blocks are as D left them (zero), after P's send ended.
    assert d.call("blocks_written", blocks=blocks) == []
    no_violations(p, d)
