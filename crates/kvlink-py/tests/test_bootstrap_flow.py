"""The bootstrap flow (vLLM's Mooncake deployment since 0.16) between two
processes on loopback: P serves its bootstrap server, the "router" (this
test) mints a transfer id and sends both legs from what it knows; D learns
P's side channel from the bootstrap server and pulls by the transfer id,
before or after P has even seen the request. Every byte that lands on D
is compared with what P computed."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from types import SimpleNamespace

import pytest
from conftest import collected, free_port, no_violations, step_until
from kvlink_vllm import _native, adapter

BLOCK = 16


def start_pair(instances, d_extra=None):
    port = free_port()
    p = instances("P", "kv_producer", env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)})
    d = instances("D", "kv_consumer", extra={"transfer_timeout": 20, **(d_extra or {})})
    return p, d, port


def legs(port: int, transfer_id: str, engine: str = "P") -> tuple[dict, dict]:
    """What the router sends P and D (vllm-router's mooncake mode's fields)."""
    p_leg = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
    d_leg = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": f"http://127.0.0.1:{port}",
        "remote_engine_id": engine,
    }
    return p_leg, d_leg


def test_the_bootstrap_server_lists_ps_workers_as_vllm_does(instances):
    p, _, port = start_pair(instances)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/query", timeout=5) as reply:
        listed = json.loads(reply.read())
    side_channel = p.ready["side_channel_port"]
    assert listed == {"0": {"engine_id": "P", "worker_addr": {"0": {"0": f"tcp://127.0.0.1:{side_channel}"}}}}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(
            urllib.request.Request(
                f"http://127.0.0.1:{port}/register",
                data=json.dumps(
                    {"engine_id": "P", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://10.6.6.6:1"}
                ).encode(),
                method="POST",
            ),
            timeout=5,
        )
    assert refused.value.code == 400, "a registered worker cannot be moved elsewhere"


@pytest.mark.parametrize("order", ["p_first", "d_first", "d_before_p_is_scheduled"])
def test_a_request_moves_by_its_transfer_id_in_either_order(instances, order):
    p, d, port = start_pair(instances)
    p_leg, d_leg = legs(port, "xfer-1b2c")
    prompt = 3 * BLOCK + 5  # 4 blocks
    if order == "p_first":
        # vllm-router's order: P's answer, then D.
        p.call("add", request_id="r1", prompt_len=prompt, params=p_leg)
        out = p.call("step")["finished"]["r1"]
        assert out == {"delay_free": True, "kv_transfer_params": None}, "P returns nothing in this flow"
        d.call("add", request_id="r1", prompt_len=prompt, params=d_leg, max_tokens=100)
    else:
        # vLLM's proxy dispatches both at once: D may ask first.
        d.call("add", request_id="r1", prompt_len=prompt, params=d_leg, max_tokens=100)
        for _ in range(3):
            d.call("step")
        if order == "d_first":
            p.call("add", request_id="r1", prompt_len=prompt, params=p_leg, hold=True)
            p.call("step")  # scheduled, still prefilling
            p.call("release", request_id="r1")
        else:
            p.call("add", request_id="r1", prompt_len=prompt, params=p_leg)
    ev = step_until(
        [p, d],
        lambda e: "r1" in collected(e["D"], "finished_recving") and "r1" in collected(e["P"], "finished_sending"),
        what="r1 received on D and sent on P",
    )
    assert collected(ev["D"], "invalid_block_ids") == []
    v = d.call("verify", request_id="r1")
    assert v["bad"] == [] and len(v["blocks"]) == 4
    # Reported under each engine's own id, once.
    assert collected(ev["P"], "finished_sending").count("r1") == 1
    assert p.call("state")["live_transfer_names"] == 0
    no_violations(p, d)


def test_a_pull_for_a_request_p_never_sees_fails_within_ds_bound(instances):
    p, d, port = start_pair(instances, d_extra={"transfer_timeout": 2})
    _, d_leg = legs(port, "xfer-never")
    d.call("add", request_id="r2", prompt_len=2 * BLOCK, params=d_leg, max_tokens=100)
    ev = step_until([p, d], lambda e: "r2" in collected(e["D"], "finished_recving"), timeout=15, what="pull fails")
    # The blocks hold no KV: the engine recomputes.
    assert sorted(collected(ev["D"], "invalid_block_ids")) == d.call("block_ids", request_id="r2")
    family = next(f for f in d.call("metrics") if f["name"] == "pulls_failed")
    failed = {str(s): s for s in family["samples"] if s["value"]}
    assert len(failed) == 1 and "prefill_never_seen" in next(iter(failed)), failed
    no_violations(p, d)


def test_a_bootstrap_server_that_does_not_answer_fails_the_pull(instances):
    p, d, _ = start_pair(instances, d_extra={"bootstrap_timeout": 1})
    _, d_leg = legs(free_port(), "xfer-nowhere")
    d.call("add", request_id="r3", prompt_len=2 * BLOCK, params=d_leg, max_tokens=100)
    ev = step_until([d], lambda e: "r3" in collected(e["D"], "finished_recving"), timeout=15, what="pull fails")
    assert sorted(collected(ev["D"], "invalid_block_ids")) == d.call("block_ids", request_id="r3")
    no_violations(d)


def test_a_transfer_id_of_another_engine_is_not_pulled(instances):
    p, d, port = start_pair(instances, d_extra={"bootstrap_timeout": 2})
    p_leg, d_leg = legs(port, "xfer-other", engine="not-P")
    p.call("add", request_id="r4", prompt_len=2 * BLOCK, params=p_leg)
    p.call("step")
    d.call("add", request_id="r4", prompt_len=2 * BLOCK, params=d_leg, max_tokens=100)
    ev = step_until([p, d], lambda e: "r4" in collected(e["D"], "finished_recving"), timeout=15, what="pull fails")
    assert sorted(collected(ev["D"], "invalid_block_ids")) == d.call("block_ids", request_id="r4")
    no_violations(p, d)


def test_p_killed_while_ds_pull_waits_on_it(instances):
    """D's pull waits on P for a request P has not seen; P dies: D learns
    it at once (the connection), not at its bound, and recomputes."""
    p, d, port = start_pair(instances, d_extra={"transfer_timeout": 30})
    _, d_leg = legs(port, "xfer-orphan")
    d.call("add", request_id="r5", prompt_len=2 * BLOCK, params=d_leg, max_tokens=100)
    step_until([p, d], lambda e: p.call("state")["transfers_in_progress"] == 1, what="D's pull waits on P")
    p.kill()
    ev = step_until([d], lambda e: "r5" in collected(e["D"], "finished_recving"), timeout=15, what="pull fails")
    assert sorted(collected(ev["D"], "invalid_block_ids")) == d.call("block_ids", request_id="r5")
    no_violations(d)


def test_a_request_p_sees_after_ds_pull_gave_up_is_not_held(instances):
    """D's pull waits on P, D dies, then P's leg arrives: P frees the
    request's blocks as soon as its prefill ends, not at its lease."""
    p, d, port = start_pair(instances)
    p_leg, d_leg = legs(port, "xfer-gone")
    d.call("add", request_id="r6", prompt_len=2 * BLOCK, params=d_leg, max_tokens=100)
    step_until([p, d], lambda e: p.call("state")["transfers_in_progress"] == 1, what="D's pull waits on P")
    d.kill()
    step_until([p], lambda e: p.call("state")["transfers_in_progress"] == 0, what="P sees D gone")
    p.call("add", request_id="r6", prompt_len=2 * BLOCK, params=p_leg)
    ev = step_until([p], lambda e: "r6" in collected(e["P"], "finished_sending"), timeout=10, what="P frees r6")
    assert p.call("state")["live_transfer_names"] == 0
    no_violations(p)
    assert ev


def test_workers_register_with_an_external_bootstrap_server(instances):
    """``bootstrap_server_address`` (vLLM 0.32's key): P runs no server of
    its own and registers with the one named; D learns P there."""
    external = _native.BootstrapServer(
        adapter.settings_from_transfer_config(
            SimpleNamespace(kv_role="kv_producer", engine_id="server", kv_connector_extra_config={})
        ),
        "127.0.0.1",
        0,
        1,
        1,
        1,
    )
    try:
        own_port = free_port()
        p = instances(
            "P",
            "kv_producer",
            extra={"bootstrap_server_address": f"127.0.0.1:{external.port}"},
            env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(own_port)},
        )
        d = instances("D", "kv_consumer", extra={"transfer_timeout": 20})
        assert external.is_complete
        with socket.socket() as s:
            s.bind(("0.0.0.0", own_port))  # P serves nothing on its own bootstrap port
        p_leg, d_leg = legs(external.port, "xfer-ext")
        p.call("add", request_id="r7", prompt_len=2 * BLOCK, params=p_leg)
        p.call("step")
        d.call("add", request_id="r7", prompt_len=2 * BLOCK, params=d_leg, max_tokens=100)
        step_until([p, d], lambda e: "r7" in collected(e["D"], "finished_recving"), what="r7 received")
        assert d.call("verify", request_id="r7")["bad"] == []
        no_violations(p, d)
    finally:
        external.stop()
