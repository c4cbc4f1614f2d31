"""Shared fixtures: engine instances as real processes on loopback."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

#: Bound on one command to an instance process (a step never waits on the network).
CALL_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """An engine instance (``instance.py``) in its own process."""

    def __init__(self, name: str, config: dict, env: dict | None = None):
        self.name = name
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "instance.py"), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=full_env,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._answer(CALL_TIMEOUT)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _answer(self, timeout: float):
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no answer within {timeout} s") from None
        if line is None:
            raise AssertionError(f"{self.name}: process exited ({self.proc.wait()})")
        answer = json.loads(line)
        if not answer["ok"]:
            raise AssertionError(f"{self.name}: {answer['error']}")
        return answer["result"]

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **args):
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=CALL_TIMEOUT)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit")
            except (AssertionError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=CALL_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def step_until(procs: list[Proc], done, timeout: float = 20.0, what: str = "condition"):
    """Steps every instance in turn until ``done(events)`` holds for the
    events collected so far (``{name: [events of each step]}``); bounded."""
    events: dict[str, list] = {p.name: [] for p in procs}
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            events[p.name].append(p.call("step"))
        if done(events):
            return events
        if time.monotonic() > deadline:
            last = {name: evs[-3:] for name, evs in events.items()}
            raise AssertionError(f"{what} not reached within {timeout} s; last steps: {last}")
        time.sleep(0.005)  # pace the steps like an engine's loop; the condition, not the sleep, ends the wait


def no_violations(*procs) -> None:
    """Each instance's scheduler saw nothing vLLM's would refuse."""
    for p in procs:
        assert p.call("state")["violations"] == [], p.name


def collected(events: list[dict], key: str) -> list:
    return [x for e in events for x in e[key]]


@pytest.fixture
def instances():
    """Factory of engine-instance processes, all closed at the end of the test."""
    started: list[Proc] = []

    def start(name: str, role: str, extra: dict | None = None, env: dict | None = None, **config) -> Proc:
        extra_config = {"mooncake_protocol": "tcp", "advertised_host": "127.0.0.1"}
        extra_config.update(extra or {})
        p = Proc(name, {"role": role, "engine_id": name, "extra_config": extra_config, **config}, env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()
