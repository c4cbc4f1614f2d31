"""KV through host staging, end to end: P and D as processes (``kvsim``)
with ``host_staging = "always"`` over their host caches, so the whole
staged path runs as it does for a CUDA cache (the native worker registers
and moves the staging only; the package copies between the cache and the
staging, real copies) and every byte is checked where the engine reads it.

Also: more requests than slots (they wait, then each lands or fails
cleanly within ``staging_wait``), a process killed mid-copy, and a pull
cancelled mid-copy; every slot comes back on every path.

Copies are held un-run with ``Instance.hold_copies`` (a test hook), so
"mid-copy" is a state the test puts a process in, not a race it hopes for.
"""

from __future__ import annotations

import time

import pytest
from conftest import collected, free_port, no_violations, step_until

BLOCK = 16
#: One block of kvsim's cache in every region: 4 layers x K and V x 2 heads x 16 tokens x 16 dims x 2 bytes.
SLOT_BYTES = 4 * 2 * 2 * BLOCK * 16 * 2


def staged(slots: int, **extra) -> dict:
    return {"host_staging": "always", "staging_bytes": slots * SLOT_BYTES, **extra}


def start_pair(instances, p_slots=16, d_slots=16, p_extra=None, d_extra=None, release="0.14.0", p_env=None):
    port = free_port()
    p = instances(
        "P",
        "kv_producer",
        extra=staged(p_slots, **(p_extra or {})),
        env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port), **(p_env or {})},
        vllm_release=release,
    )
    d = instances("D", "kv_consumer", extra=staged(d_slots, transfer_timeout=20, **(d_extra or {})), vllm_release=release)
    assert p.ready["staging"]["slots"] == p_slots and d.ready["staging"]["slots"] == d_slots
    return p, d


def prefill(p, rid: str, prompt_len: int) -> dict:
    """Prefills ``rid`` on P, then runs the step vLLM runs after a request
    finished, which hands it to P's worker (its copy into the slots); P may
    be idle from then on: its staging thread keeps the request moving."""
    p.call("add", request_id=rid, prompt_len=prompt_len, params={"do_remote_decode": True})
    out = p.call("step")["finished"][rid]
    assert out["delay_free"] is True
    p.call("step")
    return out["kv_transfer_params"]


def wait_state(proc, cond, what: str, timeout: float = 10.0, step: bool = False) -> dict:
    """Polls ``proc``'s state (stepping it if asked) until ``cond(state)``; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        if step:
            proc.call("step")
        state = proc.call("state")
        if cond(state):
            return state
        assert time.monotonic() < deadline, f"{proc.name}: {what} not reached within {timeout} s: {state}"
        time.sleep(0.005)


def all_slots_free(state: dict) -> bool:
    s = state["staging"]
    return s["requests"] == 0 and s["free_slots"] == s["slots"] and s["copies_in_flight"] == 0 and s["copies_held"] == 0


def failed_by_cause(proc, name: str) -> dict[str, int]:
    family = next(f for f in proc.call("metrics") if f["name"] == name)
    return {s["labels"]["cause"]: s["value"] for s in family["samples"] if s["value"]}


def wait_gauge(proc, name: str, at_least: int, what: str, timeout: float = 10.0) -> None:
    """Polls ``proc``'s gauge ``name`` until it reaches ``at_least``; bounded."""
    deadline = time.monotonic() + timeout
    while True:
        family = next(f for f in proc.call("metrics") if f["name"] == name)
        value = sum(s["value"] for s in family["samples"])
        if value >= at_least:
            return
        assert time.monotonic() < deadline, f"{proc.name}: {what} not reached within {timeout} s: {name}={value}"
        time.sleep(0.005)


def staging_figures(proc) -> dict[str, int]:
    """The staging metrics of ``proc`` (failed copies summed over directions)."""
    out: dict[str, int] = {}
    for f in proc.call("metrics"):
        if f["name"].startswith("staging_"):
            out[f["name"]] = sum(s["value"] for s in f["samples"])
    return out


@pytest.mark.parametrize("piece_slots", [0, 2], ids=["whole", "pieces_of_two_blocks"])
def test_staged_transfers_land_byte_exact_from_staging(instances, piece_slots):
    pieces = {"staging_piece_bytes": piece_slots * SLOT_BYTES}
    p, d = start_pair(instances, p_extra=pieces, d_extra=pieces)
    lengths = {"a": 3 * BLOCK + 5, "b": 5 * BLOCK, "c": 2 * BLOCK}
    params = {rid: prefill(p, rid, n) for rid, n in lengths.items()}
    # P reports each request sent once its KV is in the slots, before any
    # pull: its engine frees the blocks and reuses them.
    state = wait_state(p, lambda s: s["requests"] == {}, "P freed every request's blocks", step=True)
    assert state["staging"]["requests"] == 3 and state["staging"]["free_slots"] == 16 - (4 + 5 + 2)
    assert p.call("scribble_free_blocks") == p.call("state")["free_blocks"] > 0
    # D pulls from P's staging: "b" with a 2-block prefix hit on D (only its tail is pulled).
    for rid, n in lengths.items():
        d.call("add", request_id=rid, prompt_len=n, params=params[rid], max_tokens=100, hit_blocks=2 if rid == "b" else 0)
    ev = step_until([p, d], lambda e: set(collected(e["D"], "finished_recving")) == set(lengths), what="D received all")
    assert collected(ev["D"], "invalid_block_ids") == []
    for rid in lengths:
        v = d.call("verify", request_id=rid)
        assert v["bad"] == [], (rid, v)
    assert sorted(collected(ev["D"], "finished_recving")) == sorted(lengths), "each reported once"
    # Every slot back on both sides.
    wait_state(p, all_slots_free, "P's slots free", step=True)
    wait_state(d, all_slots_free, "D's slots free", step=True)
    assert failed_by_cause(d, "pulls_failed") == {}
    no_violations(p, d)


def test_more_requests_than_slots_wait_then_all_land(instances):
    # Six requests of two blocks through four slots on each side.
    p, d = start_pair(instances, p_slots=4, d_slots=4)
    rids = [f"r{i}" for i in range(6)]
    params = {rid: prefill(p, rid, 2 * BLOCK) for rid in rids}
    # Ahead of their pulls, P stages one: room for another stays free.
    assert p.call("state")["staging"]["free_slots"] == 2
    for rid in rids:
        d.call("add", request_id=rid, prompt_len=2 * BLOCK, params=params[rid], max_tokens=100)
    ev = step_until([p, d], lambda e: set(collected(e["D"], "finished_recving")) == set(rids), what="all received")
    assert collected(ev["D"], "invalid_block_ids") == []
    for rid in rids:
        assert d.call("verify", request_id=rid)["bad"] == [], rid
    # P's engine got every request's blocks back (the first while the
    # others still waited for slots).
    state = wait_state(p, all_slots_free, "P's slots free", step=True)
    assert state["requests"] == {}
    wait_state(d, all_slots_free, "D's slots free", step=True)
    no_violations(p, d)


@pytest.mark.parametrize("short", ["P", "D"])
def test_no_room_within_the_bound_fails_cleanly_and_leaks_no_slot(instances, short):
    """The short side has 4 slots, its copies held (so its first two
    requests keep them) and a 1 s ``staging_wait``: its four other requests
    fail with ``staging_exhausted`` (P: their pulls are answered failed and
    its engine gets their blocks back; D: reported failed, its engine
    recomputes); then the held copies run and the first two land."""
    short_extra = {"staging_wait": 1}
    if short == "P":
        p, d = start_pair(instances, p_slots=4, d_slots=32, p_extra=short_extra)
    else:
        # Renewals off and the default lease (480 s): only D's word that it
        # gave up frees P's hold on the requests it could not stage.
        p, d = start_pair(instances, p_slots=32, d_slots=4, p_extra={"lease_renewal": 0}, d_extra=short_extra)
    tight = p if short == "P" else d
    tight.call("hold_copies", held=True)
    rids = [f"r{i}" for i in range(6)]
    params = {rid: prefill(p, rid, 2 * BLOCK) for rid in rids}
    # Two pulls first, then four (two transfer requests: P answers each whole).
    for group in (rids[:2], rids[2:]):
        for rid in group:
            d.call("add", request_id=rid, prompt_len=2 * BLOCK, params=params[rid], max_tokens=100)
        d.call("step")
        if short == "P" and group == rids[:2]:
            # P waits on its held copies with the first transfer request:
            # the next pulls must make a second one, not join the first
            # while D's connection is still being opened.
            wait_gauge(p, "transfers_in_progress", 1, "P serving the first two pulls")
    failed = set(rids[2:])
    # On P, its engine hears the failed sends at a step of its own, which
    # may come after D's.
    ev = step_until(
        [p, d],
        lambda e: set(collected(e["D"], "finished_recving")) == failed
        and (short != "P" or failed <= set(collected(e["P"], "finished_sending"))),
        what="the requests without room failed",
    )
    assert tight.call("state")["staging"]["copies_held"] == 2
    blocks = {rid: d.call("block_ids", request_id=rid) for rid in failed}
    assert sorted(collected(ev["D"], "invalid_block_ids")) == sorted(b for rid in failed for b in blocks[rid])
    assert failed_by_cause(d, "pulls_failed") == {"staging_exhausted": 4}
    if short == "P":
        # P's engine got their blocks back without sending them.
        assert failed <= set(collected(ev["P"], "finished_sending"))
    # The held copies run: the first two land, byte-exact.
    tight.call("hold_copies", held=False)
    more = step_until(
        [p, d],
        lambda e: set(collected(e["D"], "finished_recving")) == set(rids[:2]),
        what="the first two received",
    )
    assert collected(more["D"], "invalid_block_ids") == []
    for rid in rids[:2]:
        assert d.call("verify", request_id=rid)["bad"] == [], rid
    # The failed ones are recomputed on D; nothing is reported twice.
    assert sorted(d.call("state")["recompute"]) == sorted(failed)
    wait_state(p, all_slots_free, "P's slots free", step=True)
    if short == "D":
        lease = next(f for f in p.call("metrics") if f["name"] == "lease_expiries")
        assert lease["samples"][0]["value"] == 0, "freed by D's word, not by a lease"
        assert staging_figures(d)["staging_exhausted"] == 4
    wait_state(d, all_slots_free, "D's slots free", step=True)
    no_violations(p, d)


def test_prefill_killed_mid_copy_fails_the_pull_and_d_keeps_no_slot(instances):
    p, d = start_pair(instances)
    p.call("hold_copies", held=True)
    params = prefill(p, "k1", 3 * BLOCK)
    # P's copy into its slots is ordered and held: P is mid-copy.
    state = wait_state(p, lambda s: s["staging"]["copies_held"] == 1, "P's copy ordered", step=True)
    assert state["staging"]["requests"] == 1
    d.call("add", request_id="k1", prompt_len=3 * BLOCK, params=params, max_tokens=100)
    d.call("step")
    wait_state(p, lambda s: s["transfers_in_progress"] >= 1, "P admitted D's pull")
    blocks = d.call("block_ids", request_id="k1")
    p.kill()
    ev = step_until([d], lambda e: "k1" in collected(e["D"], "finished_recving"), what="the pull failed")
    assert sorted(collected(ev["D"], "invalid_block_ids")) == sorted(blocks)
    assert d.call("blocks_written", blocks=blocks) == [], "nothing landed in D's blocks"
    wait_state(d, all_slots_free, "D's slots free", step=True)
    state = d.call("state")
    assert state["recompute"] == ["k1"] and state["violations"] == []


def test_decode_killed_mid_copy_leaves_p_with_every_slot_free(instances):
    p, d = start_pair(instances)
    d.call("hold_copies", held=True)
    params = prefill(p, "k2", 3 * BLOCK)
    # P's copy into the slots runs on its staging thread, after the step
    # that ordered it: a later step reports the request sent (its blocks free).
    wait_state(p, lambda s: s["requests"] == {}, "P's engine got the blocks back once they were in the slots", step=True)
    d.call("add", request_id="k2", prompt_len=3 * BLOCK, params=params, max_tokens=100)
    # The pull lands in D's slots; the copy to D's blocks is held: D is mid-copy.
    wait_state(d, lambda s: s["staging"]["copies_held"] == 1, "D's copy to its blocks ordered", step=True)
    d.kill()
    wait_state(p, all_slots_free, "P's slots free", step=True)
    assert p.call("state")["requests"] == {}
    no_violations(p)


@pytest.mark.parametrize("release", ["0.14.0", "0.32.0"])
def test_pull_cancelled_mid_copy_never_writes_device_blocks(instances, release):
    """The pull landed in D's slots and its copy to D's blocks is ordered
    (held) when vLLM aborts the request: the next ``start_load_kv`` fences
    it, dropping the copy; after it no byte lands in the blocks, even once
    copies run again. 0.14 never hears of the pull; 0.32 once, no load error."""
    p, d = start_pair(instances, release=release)
    free_at_start = d.call("state")["free_blocks"]
    d.call("hold_copies", held=True)
    params = prefill(p, "c1", 2 * BLOCK)
    d.call("add", request_id="c1", prompt_len=2 * BLOCK, params=params, max_tokens=100)
    wait_state(d, lambda s: s["staging"]["copies_held"] == 1, "D's copy to its blocks ordered", step=True)
    blocks = d.call("block_ids", request_id="c1")
    assert d.call("abort", request_id="c1") == {"delay_free": False, "kv_transfer_params": None}
    first = d.call("step")  # start_load_kv cancels and fences the pull
    state = d.call("state")
    assert state["staging"]["copies_held"] == 0, "the cancelled pull's copy was dropped"
    d.call("hold_copies", held=False)
    later = [d.call("step") for _ in range(3)]
    recving = [e["finished_recving"] for e in [first, *later] if e["finished_recving"]]
    assert recving == ([] if release == "0.14.0" else [["c1"]])
    assert all(not e["invalid_block_ids"] for e in [first, *later])
    assert d.call("blocks_written", blocks=blocks) == [], "no byte of the pull reached D's blocks"
    state = wait_state(d, all_slots_free, "D's slots free", step=True)
    assert state["free_blocks"] == free_at_start and state["held_for_pull"] == []
    no_violations(p, d)


def test_staging_is_capped_at_the_cache_and_must_hold_a_block(instances):
    # More staging than the cache itself: one slot per block of the cache.
    d = instances("D", "kv_consumer", extra={"host_staging": "always", "staging_bytes": 1 << 40})
    assert d.ready["staging"]["slots"] == 64
    # Less than one block of every layer: a start-up error naming the key.
    with pytest.raises(AssertionError, match=r"kv_connector_extra_config\.staging_bytes = 8191 is smaller"):
        instances("D2", "kv_consumer", extra={"host_staging": "always", "staging_bytes": SLOT_BYTES - 1})
    # "auto" over a host cache: no staging at all.
    assert instances("D3", "kv_consumer").ready["staging"] is None


def test_copy_runs_coalesce_consecutive_slots_and_blocks():
    from kvlink_vllm.staging import runs

    assert runs([(7, 0), (8, 1), (9, 2)]) == [(0, 3, True)]
    assert runs([(7, 0), (3, 1), (9, 2)]) == [(0, 3, False)]
    assert runs([(7, 0), (8, 2), (9, 3)]) == [(0, 1, True), (1, 2, True)]
    assert runs([(1, 5)]) == [(0, 1, True)]
    assert runs([]) == []


@pytest.mark.parametrize("failing", ["P", "D"])
def test_a_failed_copy_fails_its_request_not_the_engine(instances, failing):
    """A copy that raises (P: into its slots; D: into its blocks) fails that
    request cleanly: D reports it failed with its blocks and recomputes it
    (counted once, ``copy_failed``), P's engine gets its blocks back, every
    slot comes back, and both engines go on: the next request lands."""
    p, d = start_pair(instances)
    broken = p if failing == "P" else d
    broken.call("fail_copies", count=1)
    params = prefill(p, "f1", 3 * BLOCK)
    d.call("add", request_id="f1", prompt_len=3 * BLOCK, params=params, max_tokens=100)
    ev = step_until([p, d], lambda e: "f1" in collected(e["D"], "finished_recving"), what="the pull failed")
    blocks = d.call("block_ids", request_id="f1")
    assert len(blocks) == 3 and sorted(collected(ev["D"], "invalid_block_ids")) == sorted(blocks)
    assert failed_by_cause(d, "pulls_failed") == {"copy_failed": 1}
    if failing == "P":
        assert failed_by_cause(p, "sends_failed") == {"copy_failed": 1}
    failed_copies = staging_figures(broken)["staging_copies_failed"]
    assert failed_copies == 1 and broken.call("state")["staging"]["copies_failed"] == 1
    # The engines go on: the next request lands byte-exact.
    params = prefill(p, "f2", 2 * BLOCK)
    d.call("add", request_id="f2", prompt_len=2 * BLOCK, params=params, max_tokens=100)
    step_until([p, d], lambda e: "f2" in collected(e["D"], "finished_recving"), what="the next request received")
    assert d.call("verify", request_id="f2")["bad"] == []
    assert d.call("state")["recompute"] == ["f1"], "the failed one is recomputed"
    wait_state(p, all_slots_free, "P's slots free", step=True)
    wait_state(d, all_slots_free, "D's slots free", step=True)
    assert staging_figures(d)["staging_free_slots"] == staging_figures(d)["staging_slots"] == 16
    no_violations(p, d)
