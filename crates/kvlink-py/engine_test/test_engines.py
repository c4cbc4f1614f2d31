"""kvlink between two real vLLM engines: P and D as ``vllm serve`` processes
on loopback, a router in front, a baseline engine without a connector.

The tests run in this order and share the engines (``conftest.Cluster``);
each starts by restarting whatever an earlier one left dead.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
import uuid

import client
import engines
import prompts
from report import FIGURES, phase

#: What kvlink's worker logs when a pull fails (WARN, target ``kv_worker``),
#: and what vLLM's scheduler logs when it recomputes after one.
PULL_FAILED = ("KV pull failed", "prefill failed to send KV", "prefill's reply has no outcome")
KVLINK_WARNING = re.compile(r"\b(WARN|ERROR)\b.*\bkv_worker\b")
VLLM_RECOMPUTE = "Recovered from KV load failure"

#: The longest a request that has lost its P may take on D: the pull's
#: connect and transfer bounds, then a recompute (well under a second here).
RECOMPUTE_BOUND = engines.CONNECT_TIMEOUT + engines.TRANSFER_TIMEOUT + 10
#: vLLM's gauge of the KV cache in use (1 = all of it).
KV_USAGE = "vllm:kv_cache_usage_perc"
#: D's count of prompt tokens a connector provided (vLLM lowers a request's
#: share by the tokens of a failed load before counting it).
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
#: kvlink's own metrics on the engines' /metrics (the connector's Prometheus hook).
KVLINK = "vllm:kvlink_"
PULLS_RECEIVED = "vllm:kvlink_pulls_received_total"
PULLS_FAILED = "vllm:kvlink_pulls_failed_total"
SENDS_DONE = "vllm:kvlink_sends_done_total"
SENDS_FAILED = "vllm:kvlink_sends_failed_total"
PULLS_IN_FLIGHT = "vllm:kvlink_pulls_in_flight"
#: vLLM's periodic log line of connector stats, with kvlink's summary.
KV_LOG_LINE = "KV Transfer metrics: Pulls received="
#: D's one warning when P's params reach it without their renewal key.
NO_RENEWAL_KEY = "carry no remote_renewal_key"
#: How many requests vLLM recomputed after failed loads, per log line.
RECOMPUTED = re.compile(r"Recovered from KV load failure: (\d+) request")
#: Host staging's gauges (slots in all, and free now), and the line each
#: worker logs when it stages.
STAGING_SLOTS = "vllm:kvlink_staging_slots"
STAGING_FREE = "vllm:kvlink_staging_free_slots"
STAGING_LOG_LINE = f"kvlink host staging: {engines.STAGING_SLOTS} slots"
#: Bound on a metric reaching /metrics: the step that counted it is
#: recorded by the front end as the engine core's output arrives.
METRIC_BOUND = 15.0


def request_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:12]}"


def pull_failures(log: str) -> list[str]:
    """Lines of a D log saying a pull failed or was recomputed."""
    return [
        line
        for line in log.splitlines()
        if KVLINK_WARNING.search(line) or VLLM_RECOMPUTE in line or any(p in line for p in PULL_FAILED)
    ]


def failure_lines_of(log: str, needle: str) -> list[str]:
    return [line for line in log.splitlines() if needle in line and any(p in line for p in PULL_FAILED)]


def wait_p_idle(cluster, bound: float = 30.0) -> float:
    """P's KV cache usage once it is back at its idle value (or the last
    reading at the bound). vLLM's engine loop steps only while it has
    requests, and a connector reports the blocks it has sent (so P frees
    them) only during a step: an idle P is poked with a one-token request
    without transfer params, whose own blocks are freed as it finishes."""
    deadline = time.monotonic() + bound
    usage = cluster.p.metric(KV_USAGE)
    probe = 0
    while usage > cluster.p_idle_usage and time.monotonic() < deadline:
        probe += 1
        client.post(cluster.p.url, client.completion_body(prompts.prompt("probe", probe, 8), max_tokens=1))
        usage = cluster.p.metric(KV_USAGE)
        if usage > cluster.p_idle_usage:
            time.sleep(0.5)
    return usage


def until(read, want, bound: float = METRIC_BOUND, poke=None):
    """``read()`` until it returns ``want`` or ``bound`` seconds passed; the
    last reading. ``poke`` runs between readings (an idle vLLM engine does
    not step, and a connector reports only in a step)."""
    deadline = time.monotonic() + bound

    def reading():
        # A busy engine can be slow to answer one scrape: that is "not
        # yet" until the bound, not a failure.
        while True:
            try:
                return read()
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise

    value = reading()
    while value != want and time.monotonic() < deadline:
        if poke is not None:
            poke()
        time.sleep(0.2)
        value = reading()
    return value


def grown(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Per label value, what a counter grew by (values that did not grow left out)."""
    return {k: v - before.get(k, 0.0) for k, v in now.items() if v - before.get(k, 0.0)}


def poke_p(cluster, name: str):
    """A plain one-token request to P (it steps, and reports what it sent)."""
    return poke(cluster.p, name)


def poke(engine, name: str):
    """A plain one-token request to ``engine``: it steps, and its connector
    reports (an idle vLLM engine does neither)."""
    count = [0]

    def send() -> None:
        count[0] += 1
        client.post(engine.url, client.completion_body(prompts.prompt(name, count[0], 8), max_tokens=1))

    return send


def own_usage(params: dict) -> dict:
    """P's params for D without ``remote_prefill_cached_tokens`` (vLLM 0.32
    adds P's prefix-cache hits there, and D then reports them as its
    ``cached_tokens``): D's usage shows what D itself had, as on 0.14."""
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


def through_router(cluster, prompt: list[int], router=None) -> tuple[client.Answer, int]:
    """One request through the router, and how many of its prompt tokens D
    got from the connector. The answer's own ``cached_tokens`` cannot say:
    vllm-router replaces D's figure with P's (its prefix cache hits, which
    is what a P/D client is billed), so D's counter is read around the
    request instead (requests are sent one at a time)."""
    before = cluster.d.metric(EXTERNAL_HITS)
    answer = client.post((router or cluster.router).url, client.completion_body(prompt))
    return answer, int(cluster.d.metric(EXTERNAL_HITS) - before)


def check_answers(cluster, pairs, loaded: list[int] | None = None) -> list[str]:
    """What is wrong with (prompt, answer) pairs: not answered, other
    tokens than the baseline's, or (given ``loaded``, the tokens D had
    from the connector for each) not all of the prompt from P."""
    problems = []
    for index, (prompt, answer) in enumerate(pairs):
        what = f"{len(prompt)}-token prompt"
        if not answer.ok:
            problems.append(f"{what}: {answer.describe()}")
            continue
        if answer.token_ids != cluster.expected(prompt):
            problems.append(f"{what}: tokens {answer.token_ids} differ from the baseline's {cluster.expected(prompt)}")
        if loaded is not None and loaded[index] != len(prompt):
            problems.append(f"{what}: D had {loaded[index]} of its tokens from the connector, not all (not from P)")
    return problems


def pd_through_router(cluster, set_name: str, label: str, prefill_ranks: int = 1, router=None) -> list[str]:
    """Prompt set ``set_name`` through the router, one at a time: what is
    wrong. D's tokens must be the baseline's, every prompt must have come
    from P (D's connector hits, and kvlink's pulls received on D), no pull
    may fail, each of P's ``prefill_ranks`` ranks must count every prompt
    sent, and P must end with no block held. Figures go under ``label``."""
    log_start = cluster.d.log_size()
    pd_prompts = prompts.prompt_set(set_name)
    d_received, d_failed = cluster.d.metric_sum(PULLS_RECEIVED), cluster.d.by_label(PULLS_FAILED, "cause")
    p_sent, p_failed = cluster.p.metric_sum(SENDS_DONE), cluster.p.by_label(SENDS_FAILED, "cause")
    with phase(f"{label}: 8 prompts (200-2,000 tokens) through the router"):
        answers, loaded = zip(*(through_router(cluster, p, router) for p in pd_prompts))
    problems = check_answers(cluster, list(zip(pd_prompts, answers)), list(loaded))
    failures = pull_failures(cluster.d.log_text(log_start))
    with phase(f"{label}: P's KV cache usage back to idle"):
        usage = wait_p_idle(cluster)
    if usage > cluster.p_idle_usage:
        problems.append(f"P's {KV_USAGE} is {usage}, not back to its idle {cluster.p_idle_usage}: blocks stranded")
    problems += [f"D log: {line}" for line in failures[:10]]
    # The router must pass P's params on whole, renewal key included, or D
    # cannot renew P's hold (D's scheduler warns once when it is missing).
    if NO_RENEWAL_KEY in cluster.d.log_text(log_start):
        problems.append(f"D's log says {NO_RENEWAL_KEY!r}: the router dropped P's renewal key")

    # kvlink's metrics on both engines' /metrics: every prompt pulled, none
    # failed. vLLM sums the workers' counters: each P rank counts the
    # requests it wrote its heads of.
    sends = len(pd_prompts) * prefill_ranks
    with phase(f"{label}: kvlink's metrics on /metrics and in vLLM's log"):
        received = until(lambda: cluster.d.metric_sum(PULLS_RECEIVED) - d_received, len(pd_prompts))
        sent = until(lambda: cluster.p.metric_sum(SENDS_DONE) - p_sent, sends, poke=poke_p(cluster, "sent"))
        logged = until(
            lambda: KV_LOG_LINE in cluster.d.log_text(log_start), True, bound=3 * engines.LOG_STATS_INTERVAL + 5
        )
    if received != len(pd_prompts):
        problems.append(f"D's {PULLS_RECEIVED} grew by {received}, not by the {len(pd_prompts)} prompts")
    if sent != sends:
        problems.append(
            f"P's {SENDS_DONE} grew by {sent}, not by the {len(pd_prompts)} prompts on each of its {prefill_ranks} ranks"
        )
    for engine, name, before in ((cluster.d, PULLS_FAILED, d_failed), (cluster.p, SENDS_FAILED, p_failed)):
        now = engine.by_label(name, "cause")
        if not now:
            problems.append(f"{engine.name}'s /metrics has no {name} series")
        if grown(now, before):
            problems.append(f"{engine.name}'s {name} grew: {grown(now, before)}")
    if not logged:
        problems.append(f"D's log has no line with {KV_LOG_LINE!r} (vLLM's periodic connector stats)")
    FIGURES[f"{label}: kvlink counters"] = {"D pulls received": received, "P sends done": sent}
    lines = [line for line in cluster.d.log_text(log_start).splitlines() if KV_LOG_LINE in line]
    if lines:
        FIGURES[f"{label}: D's log: kvlink summary"] = lines[-1].split("KV Transfer metrics: ", 1)[1]
    return problems


def test_pd_matches_baseline(cluster):
    """Every prompt through the router: D's tokens are the baseline's, its
    prompt came from P, no pull failed, and P ends with no block held."""
    cluster.ready("a")
    problems = pd_through_router(cluster, "pd", "P/D")
    series = {engine.name: engine.series_names(KVLINK) for engine in (cluster.d, cluster.p)}
    for name, names in series.items():
        if not names:
            problems.append(f"{name}'s /metrics carries no {KVLINK}* series")
    FIGURES["kvlink series on D's /metrics"] = series["decode"]
    assert not problems, "\n".join(problems)


def test_pd_through_the_mooncake_router_matches_baseline(cluster):
    """vllm-router in its ``mooncake`` mode (vLLM's Mooncake deployment since
    0.16): it read P's bootstrap server at start, mints a transfer id per
    request and sends D its leg from what it knows, not from P's answer.
    D's tokens are the baseline's, every prompt came from P, and P ends
    with no block held."""
    cluster.ready("a")
    problems = pd_through_router(cluster, "pd-mooncake", "P/D (router in mooncake mode)", router=cluster.mooncake_router)
    assert not problems, "\n".join(problems)


def test_both_legs_at_once_match_baseline(cluster):
    """Both legs dispatched at once, as vLLM's Mooncake proxy does, and D's
    sent first, P's only once D's pull is out (so it reaches P before P has
    even seen the request): D's tokens are the baseline's, every prompt
    came from P, and P ends with no block held."""
    cluster.ready("a")
    engine_id = client.bootstrap_engines(cluster.p.bootstrap_url)["0"]
    both = prompts.prompt_set("pd-both-legs")
    received_before = cluster.d.metric_sum(PULLS_RECEIVED)
    problems, results = [], []
    with phase("both legs at once: 8 prompts, D's leg first"):
        for index, prompt in enumerate(both):
            p_leg, d_leg = client.bootstrap_legs(cluster.p.bootstrap_url, engine_id, f"xfer-{uuid.uuid4()}")
            before = cluster.d.metric(EXTERNAL_HITS)
            decode: dict = {}
            d_thread = threading.Thread(
                target=lambda: decode.update(answer=client.post(cluster.d.url, client.completion_body(prompt, params=d_leg)))
            )
            d_thread.start()
            if index % 2 == 0:
                # Every other one: P's leg only once D's pull waits on P.
                until(lambda: cluster.d.metric_sum(PULLS_IN_FLIGHT) > 0, True)
            prefill = client.post(cluster.p.url, client.completion_body(prompt, max_tokens=1, params=p_leg))
            d_thread.join(client.REQUEST_TIMEOUT)
            if not prefill.ok:
                problems.append(f"{len(prompt)}-token prompt, P's leg: {prefill.describe()}")
            if prefill.kv_transfer_params:
                problems.append(f"P returned params in the bootstrap flow: {prefill.kv_transfer_params}")
            answer = decode.get("answer") or client.Answer(None, error="D's leg did not end")
            results.append((prompt, answer, int(cluster.d.metric(EXTERNAL_HITS) - before)))
    problems += check_answers(cluster, [(p, a) for p, a, _ in results], [n for _, _, n in results])
    received = until(lambda: cluster.d.metric_sum(PULLS_RECEIVED) - received_before, len(both))
    if received != len(both):
        problems.append(f"D's {PULLS_RECEIVED} grew by {received}, not by the {len(both)} prompts")
    with phase("both legs at once: P's KV cache usage back to idle"):
        usage = wait_p_idle(cluster)
    if usage > cluster.p_idle_usage:
        problems.append(f"P's {KV_USAGE} is {usage}, not back to its idle {cluster.p_idle_usage}: blocks stranded")
    assert not problems, "\n".join(problems)


def test_a_leg_to_d_alone_is_recomputed_within_the_bound(cluster):
    """The router's P leg failed or was never sent: D's pull waits on P for
    a request P never sees, P says so before D's bound, and D recomputes
    (the baseline's tokens) within it, counting the cause; nothing stays
    held on either side."""
    cluster.ready("a")
    engine_id = client.bootstrap_engines(cluster.p.bootstrap_url)["0"]
    prompt = prompts.prompt_set("never-sent")[0]
    _, d_leg = client.bootstrap_legs(cluster.p.bootstrap_url, engine_id, f"xfer-{uuid.uuid4()}")
    failed_before = cluster.d.by_label(PULLS_FAILED, "cause")
    with phase("D's leg alone: recomputed"):
        answer = client.post(cluster.d.url, client.completion_body(prompt, params=d_leg))
    problems = check_answers(cluster, [(prompt, answer)])
    if answer.seconds > RECOMPUTE_BOUND:
        problems.append(f"answered after {answer.seconds:.1f} s, past the {RECOMPUTE_BOUND} s bound")
    failed = until(lambda: grown(cluster.d.by_label(PULLS_FAILED, "cause"), failed_before), {"prefill_never_seen": 1.0})
    if failed != {"prefill_never_seen": 1.0}:
        problems.append(f"D's {PULLS_FAILED} grew by {failed}, not by one prefill_never_seen")
    if cluster.d.metric(KV_USAGE) > 0:
        problems.append(f"D's {KV_USAGE} is {cluster.d.metric(KV_USAGE)} after the request ended")
    if wait_p_idle(cluster) > cluster.p_idle_usage:
        problems.append("P holds blocks for a request it never saw")
    assert not problems, "\n".join(problems)


def test_ttft(cluster):
    """D's time to first token with the prompt pulled from P, and recomputed
    (no params), for three prompt lengths: median of 5 runs each. Printed,
    not asserted (beyond every request being answered)."""
    cluster.ready("a")
    figures = {}
    with phase("TTFT: 3 lengths x 5 runs, pulled and recomputed"):
        for length in (256, 1024, 2000):
            pulled, recomputed, loaded = [], [], 0
            for run in range(5):
                # A fresh prompt each time: D's prefix cache must not answer.
                prompt = prompts.prompt("ttft-pulled", run, length)
                rid = request_id(f"ttft-{length}-{run}")
                pre = client.post(
                    cluster.p.url, client.completion_body(prompt, max_tokens=1, params=client.PREFILL_PARAMS), rid
                )
                assert pre.ok and pre.kv_transfer_params, f"P: {pre.describe()}"
                # What lets only the decode instance given these params renew P's hold.
                key = pre.kv_transfer_params.get("remote_renewal_key")
                assert isinstance(key, str) and re.fullmatch("[0-9a-f]{32}", key), pre.kv_transfer_params
                before = cluster.d.metric(EXTERNAL_HITS)
                answer = client.stream(cluster.d.url, client.completion_body(prompt, params=pre.kv_transfer_params), rid)
                assert answer.ok and answer.ttft is not None, f"D (pulled): {answer.describe()}"
                pulled.append(answer.ttft)
                # D's count of prompt tokens from the connector (requests go
                # one at a time): all of them when the pull landed.
                loaded += int(cluster.d.metric(EXTERNAL_HITS) - before) == length
                other = prompts.prompt("ttft-recomputed", run, length)
                answer = client.stream(cluster.d.url, client.completion_body(other))
                assert answer.ok and answer.ttft is not None, f"D (recomputed): {answer.describe()}"
                recomputed.append(answer.ttft)
            figures[f"{length} tokens"] = {
                "pulled_ms": round(statistics.median(pulled) * 1000, 1),
                "recomputed_ms": round(statistics.median(recomputed) * 1000, 1),
                "runs": 5,
                "runs_loaded_from_P": loaded,
            }
    FIGURES["D TTFT (median of 5)"] = figures


def both_legs_streamed(cluster, prompt: list[int], engine_id: str, transfer_id: str) -> client.Answer:
    """One request as vLLM's Mooncake proxy dispatches it: P's leg (one
    token) and D's leg (streamed) sent at once; D's answer, timed from
    the dispatch."""
    p_leg, d_leg = client.bootstrap_legs(cluster.p.bootstrap_url, engine_id, transfer_id)
    prefill = threading.Thread(
        target=client.post, args=(cluster.p.url, client.completion_body(prompt, max_tokens=1, params=p_leg))
    )
    prefill.start()
    answer = client.stream(cluster.d.url, client.completion_body(prompt, params=d_leg))
    prefill.join(client.REQUEST_TIMEOUT)
    return answer


def test_ttft_by_deployment(cluster):
    """The client's time to first token through each deployment, for three
    prompt lengths, median of 5 runs each: vllm-router in its default mode
    (P answers, then the router sends D P's params), in its mooncake mode
    (the bootstrap flow, the router still waits for P), and both legs at
    once as vLLM's Mooncake proxy sends them (D's scheduling and the
    router's second hop off the critical path). Printed, not asserted
    (beyond every answer being the baseline's and pulled from P)."""
    cluster.ready("a")
    engine_id = client.bootstrap_engines(cluster.p.bootstrap_url)["0"]
    ways = {
        "router_default_ms": lambda prompt: client.stream(cluster.router.url, client.completion_body(prompt)),
        "router_mooncake_ms": lambda prompt: client.stream(cluster.mooncake_router.url, client.completion_body(prompt)),
        "both_legs_at_once_ms": lambda prompt: both_legs_streamed(cluster, prompt, engine_id, f"xfer-{uuid.uuid4()}"),
    }
    figures: dict = {}
    problems = []
    with phase("TTFT by deployment: 3 lengths x 5 runs x 3 ways"):
        for length in (256, 1024, 2000):
            times: dict[str, list[float]] = {way: [] for way in ways}
            for run in range(5):
                for way, send in ways.items():
                    # A fresh prompt each time: D's prefix cache must not answer.
                    prompt = prompts.prompt(f"ttft-{way}", run, length)
                    before = cluster.d.metric(EXTERNAL_HITS)
                    answer = send(prompt)
                    if not answer.ok or answer.ttft is None:
                        problems.append(f"{way}, {length} tokens: {answer.describe()}")
                        continue
                    if int(cluster.d.metric(EXTERNAL_HITS) - before) != length:
                        problems.append(f"{way}, {length} tokens: not pulled from P")
                    times[way].append(answer.ttft)
            figures[f"{length} tokens"] = {
                way: round(statistics.median(t) * 1000, 1) for way, t in times.items() if t
            } | {"runs": 5}
    FIGURES["TTFT by deployment (median of 5)"] = figures
    assert not problems, "\n".join(problems)


def bad_params(target: str, side_host: str, side_port: int) -> dict[str, dict]:
    """Each malformed or mis-targeted ``kv_transfer_params`` for ``target``
    ("P" or "D"): that engine's own shape of params with one thing wrong."""
    if target == "P":
        base = dict(client.PREFILL_PARAMS)
    else:
        base = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_host": side_host,
            "remote_port": side_port,
            "remote_engine_id": "no-such-engine",
            "remote_request_id": "no-such-request",
        }
    changes: dict[str, dict] = {
        "remote_port as a string": {"remote_port": str(side_port)},
        "remote_port 70000": {"remote_port": 70000},
        "remote_port -1": {"remote_port": -1},
        'do_remote_prefill "yes"': {"do_remote_prefill": "yes"},
        "do_remote_prefill 1": {"do_remote_prefill": 1},
        "do_remote_prefill without remote_host": {"do_remote_prefill": True, "remote_host": None},
        "remote_request_id a number": {"remote_request_id": 12345},
        "remote_request_id of 100 kB": {"remote_request_id": "r" * 100_000},
        "remote_engine_id a list": {"remote_engine_id": ["no-such-engine"]},
        "remote_renewal_key not hex": {"remote_renewal_key": "z" * 32},
        "remote_renewal_key of 100 kB": {"remote_renewal_key": "0" * 100_000},
    }
    if target == "D":
        changes["do_remote_decode sent to the consumer"] = {"do_remote_decode": True}
    else:
        changes["do_remote_prefill sent to the producer"] = {
            "do_remote_prefill": True,
            "remote_host": side_host,
            "remote_port": side_port,
        }
    cases = {}
    for name, change in changes.items():
        params = dict(base)
        for key, value in change.items():
            if value is None and key == "remote_host":
                params.pop(key, None)
            else:
                params[key] = value
        cases[name] = params
    return cases


def test_bad_client_params(cluster):
    """Malformed or mis-targeted params, straight to P and to D: each request
    is served (HTTP 200), and both engines stay up and keep transferring."""
    cluster.ready("a")
    problems = []
    with phase("bad client params: 20 requests straight to P and D"):
        for target, engine in (("P", cluster.p), ("D", cluster.d)):
            for index, (name, params) in enumerate(bad_params(target, cluster.p.host, cluster.p.side_channel_port).items()):
                prompt = prompts.prompt(f"bad-{target}", index, 200)
                answer = client.post(engine.url, client.completion_body(prompt, max_tokens=2, params=params))
                if not answer.ok:
                    problems.append(f"{target}, {name}: {answer.describe()}")
    with phase("bad client params: a good request through the router"):
        for engine in (cluster.p, cluster.d):
            if not engine.healthy():
                problems.append(f"{engine.name} is not healthy after the bad params")
        prompt = prompts.prompt("after-bad", 0, 512)
        answer, loaded = through_router(cluster, prompt)
        if not answer.ok or loaded != len(prompt):
            problems.append(
                f"good request through the router afterwards: {answer.describe()}, {loaded} tokens from the connector"
            )
    assert not problems, "\n".join(problems)


def test_unreachable_prefill(cluster):
    """D told to pull from a port nobody listens on: it answers (recomputed,
    the baseline's tokens) within its bounds, logs the failure once with
    the reason, and keeps serving."""
    cluster.ready("a")
    closed_port = engines.free_port()  # bound and released: nothing listens there
    rid = request_id("unreachable")
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_host": "127.0.0.1",
        "remote_port": closed_port,
        "remote_engine_id": "engine-that-is-not-there",
        "remote_request_id": "cmpl-nowhere-0-00000000",
    }
    log_start = cluster.d.log_size()
    failed_before = cluster.d.by_label(PULLS_FAILED, "cause")
    prompt = prompts.prompt_set("unreachable")[4]
    with phase("unreachable P: D recomputes"):
        answer = client.post(cluster.d.url, client.completion_body(prompt, params=params), rid)
    problems = check_answers(cluster, [(prompt, answer)])
    counted = until(lambda: grown(cluster.d.by_label(PULLS_FAILED, "cause"), failed_before), {"connection_lost": 1.0})
    if counted != {"connection_lost": 1.0}:
        problems.append(f"D's {PULLS_FAILED} grew by {counted}, not by one connection_lost")
    if answer.ok and answer.cached_tokens:
        problems.append(f"cached_tokens {answer.cached_tokens}: nothing can have been loaded")
    if answer.seconds > RECOMPUTE_BOUND:
        problems.append(f"answered after {answer.seconds:.1f} s, past {RECOMPUTE_BOUND} s")
    lines = failure_lines_of(cluster.d.log_text(log_start), rid)
    if len(lines) != 1 or "reason" not in lines[0]:
        problems.append(f"D should log the failed pull of {rid} once, with its reason; it logged: {lines}")
    after = client.post(cluster.d.url, client.completion_body(prompts.prompt("after-unreachable", 0, 300)))
    if not after.ok:
        problems.append(f"D afterwards: {after.describe()}")
    assert not problems, "\n".join(problems)


def test_prefill_killed_mid_run(cluster):
    """P SIGKILLed with requests in flight through the router, and with
    three requests prefilled but not yet sent to D. Every request handed to
    D is answered with the baseline's tokens within the bound; the router
    fails the ones P had not prefilled (an error, not a hang); D serves on."""
    cluster.ready("a")
    router_prompts = prompts.prompt_set("killed-router")
    held_prompts = prompts.prompt_set("killed-held")[-3:]
    held = []
    for index, prompt in enumerate(held_prompts):
        rid = request_id(f"held-{index}")
        pre = client.post(cluster.p.url, client.completion_body(prompt, max_tokens=1, params=client.PREFILL_PARAMS), rid)
        assert pre.ok and pre.kv_transfer_params, f"P: {pre.describe()}"
        held.append((rid, prompt, pre.kv_transfer_params))

    results: dict[str, client.Answer] = {}

    def send(key: str, url: str, body: dict, rid: str | None = None) -> None:
        results[key] = client.post(url, body, rid)

    log_start = cluster.d.log_size()
    failed_before = cluster.d.by_label(PULLS_FAILED, "cause")
    threads = [
        threading.Thread(target=send, args=(f"router-{i}", cluster.router.url, client.completion_body(p)), daemon=True)
        for i, p in enumerate(router_prompts)
    ]
    with phase("P killed mid-run: requests answered or failed"):
        for thread in threads:
            thread.start()
        # Kill P once D has a request (it is pulling, or about to).
        deadline = time.monotonic() + 30
        in_d = 0.0
        while time.monotonic() < deadline and not in_d:
            in_d = cluster.d.metric("vllm:num_requests_running") + cluster.d.metric("vllm:num_requests_waiting")
            if not in_d and results:
                in_d = float(len(results))  # one already came back through D
            if not in_d:
                time.sleep(0.02)
        cluster.p.kill()
        held_threads = [
            threading.Thread(
                target=send,
                args=(f"held-{i}", cluster.d.url, client.completion_body(prompt, params=own_usage(params)), rid),
                daemon=True,
            )
            for i, (rid, prompt, params) in enumerate(held)
        ]
        for thread in held_threads:
            thread.start()
        for thread in threads + held_threads:
            thread.join(timeout=client.REQUEST_TIMEOUT + 5)

    problems = []
    if not in_d:
        problems.append("no request reached D within 30 s of being sent through the router")
    router_answers = [results.get(f"router-{i}") for i in range(len(router_prompts))]
    answered = [(p, a) for p, a in zip(router_prompts, router_answers) if a is not None and a.ok]
    for prompt, answer in zip(router_prompts, router_answers):
        if answer is None:
            problems.append(f"router, {len(prompt)}-token prompt: no answer within {client.REQUEST_TIMEOUT} s")
        elif answer.status is None:
            problems.append(f"router, {len(prompt)}-token prompt: {answer.describe()}")
    problems += [f"router: {p}" for p in check_answers(cluster, answered)]
    if not answered:
        problems.append("no request through the router was answered, though D had one when P was killed")

    log = cluster.d.log_text(log_start)
    for index, (rid, prompt, _) in enumerate(held):
        answer = results.get(f"held-{index}")
        if answer is None:
            problems.append(f"held {rid}: no answer")
            continue
        problems += [f"held {rid}: {p}" for p in check_answers(cluster, [(prompt, answer)])]
        if answer.ok and answer.cached_tokens:
            problems.append(f"held {rid}: cached_tokens {answer.cached_tokens}, though P was dead")
        if answer.ok and answer.seconds > RECOMPUTE_BOUND:
            problems.append(f"held {rid}: answered after {answer.seconds:.1f} s, past {RECOMPUTE_BOUND} s")
        # kv-worker warns of a cause's first failure, then at most once per
        # cause every 10 s with the count held back (the unreachable test's
        # failure a moment ago may hold these back): never twice for one
        # request. Each is counted on /metrics (checked below).
        lines = failure_lines_of(log, rid)
        if len(lines) > 1:
            problems.append(f"held {rid}: D logged its failed pull {len(lines)} times: {lines}")
    if not cluster.d.healthy():
        problems.append("D is not healthy after P was killed")
    after = client.post(cluster.d.url, client.completion_body(prompts.prompt("after-kill", 0, 300)))
    if not after.ok:
        problems.append(f"D afterwards: {after.describe()}")
    # Every request D recomputed is one failed pull on D's /metrics, by cause.
    recomputed = sum(int(n) for n in RECOMPUTED.findall(cluster.d.log_text(log_start)))
    until(lambda: sum(grown(cluster.d.by_label(PULLS_FAILED, "cause"), failed_before).values()), recomputed)
    failed = grown(cluster.d.by_label(PULLS_FAILED, "cause"), failed_before)
    if sum(failed.values()) != recomputed:
        problems.append(f"D recomputed {recomputed} requests, but its {PULLS_FAILED} grew by {failed}")
    if recomputed < len(held):
        problems.append(f"D recomputed {recomputed} requests, fewer than the {len(held)} held ones")
    FIGURES["P killed"] = {
        "D recomputed": recomputed,
        "D pull failures by cause": failed,
        "through the router": {
            "answered": len(answered),
            "failed": sum(1 for a in router_answers if a is not None and not a.ok),
        },
        "held, answered by D": sum(1 for i in range(len(held)) if results.get(f"held-{i}") and results[f"held-{i}"].ok),
    }
    assert not problems, "\n".join(problems)


def test_other_weights_prefill_changes_decode(cluster):
    """P restarted on the same ports with another checkpoint (same shapes and
    tokenizer): D's answers now differ from the baseline's for most prompts,
    which they could not if D computed the prompt itself."""
    cluster.ready("b")
    other_prompts = prompts.prompt_set("other-weights")
    with phase("P on other weights: 8 prompts through the router"):
        results = [through_router(cluster, p) for p in other_prompts]
    problems = []
    differ = 0
    for prompt, (answer, loaded) in zip(other_prompts, results):
        if not answer.ok:
            problems.append(f"{len(prompt)}-token prompt: {answer.describe()}")
            continue
        if loaded != len(prompt):
            problems.append(f"{len(prompt)}-token prompt: D had {loaded} of its tokens from the connector, not all")
        differ += answer.token_ids != cluster.expected(prompt)
    FIGURES["P on other weights: answers differing from the baseline"] = f"{differ} of {len(other_prompts)}"
    if differ <= len(other_prompts) // 2:
        problems.append(f"only {differ} of {len(other_prompts)} answers differ from the baseline's")
    assert not problems, "\n".join(problems)


def test_prefill_at_tp2_decode_at_tp1(cluster):
    """P restarted at tensor-parallel size 2, D left at 1: vLLM splits the
    two KV heads over P's ranks. D's one rank learns that from the hello
    and pulls each head from the P rank holding it (0.14's split K and V
    and 0.32's rows of K and V side by side alike): D's tokens must be the
    (TP 1) baseline's, every prompt must come from P, each P rank must
    count every prompt, and P must end with no block held."""
    cluster.ready("a", prefill_tp=2)
    problems = pd_through_router(cluster, "tp2", "P at TP 2, D at TP 1", prefill_ranks=2)
    assert not problems, "\n".join(problems)


def test_staged_pd_matches_baseline(cluster):
    """P and D restarted with host staging forced on (``host_staging``
    "always": the path a CUDA cache takes, here over the CPU backend's
    cache, with synchronous copies): P copies each finished prompt's
    blocks into 20 slots of staging in pieces of 2 blocks and sends from
    there, D pulls into its own staging and copies into its blocks. The
    same checks as P/D matches the baseline, and both engines run with
    the configured staging and end with every slot free."""
    cluster.ready("a", staged=True)
    problems = []
    for engine in (cluster.p, cluster.d):
        if STAGING_LOG_LINE not in engine.log_text():
            problems.append(f"{engine.name}'s log has no {STAGING_LOG_LINE!r}: it does not stage")
    problems += pd_through_router(cluster, "staged", "staged P/D")
    with phase("staged P/D: every staging slot free on P and D"):
        for engine in (cluster.p, cluster.d):
            slots = until(lambda: engine.metric_sum(STAGING_SLOTS), engines.STAGING_SLOTS, poke=poke(engine, "slots"))
            free = until(lambda: engine.metric_sum(STAGING_FREE), slots, poke=poke(engine, "free"))
            FIGURES[f"staged P/D: {engine.name}'s staging slots free"] = f"{free:g} of {slots:g}"
            if slots != engines.STAGING_SLOTS:
                problems.append(f"{engine.name}'s {STAGING_SLOTS} is {slots}, not {engines.STAGING_SLOTS}")
            if free != slots:
                problems.append(f"{engine.name}'s {STAGING_FREE} is {free} of {slots}: slots leaked")
    assert not problems, "\n".join(problems)
