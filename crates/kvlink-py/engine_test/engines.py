"""The test's processes: ``vllm serve`` engines and the P/D router.

Each runs in its own process group (``start_new_session``), so stopping
it reaches vLLM's engine-core child too, with stdout and stderr going to
a log file. Every wait is bounded; a process that dies while waited for
fails the wait at once with its log's tail.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import client

#: A vLLM engine on this 2-core machine starts in 40-60 s (three at once);
#: a slower CI machine gets twice that before the wait gives up.
START_TIMEOUT = 240.0
#: SIGTERM, then this long for a clean exit, then SIGKILL.
STOP_GRACE = 20.0
#: D's pull bounds: a pull that cannot be made fails within seconds and D
#: recomputes (the defaults, 60 s and 5 s, are for real deployments).
TRANSFER_TIMEOUT = 5
CONNECT_TIMEOUT = 2
#: Seconds between vLLM's periodic stats log lines.
LOG_STATS_INTERVAL = 2
#: The served model name every request uses.
MODEL_NAME = "tiny"

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Host staging forced on (``host_staging`` "always"), as a CUDA cache gets
#: it, over the CPU backend's cache: room for 20 blocks of every layer (the
#: tiny model's 128-token blocks take 512 KiB in all; the longest prompt,
#: 2,000 tokens, takes 16), so the prompts reuse each other's slots, and
#: pieces of 2 blocks, so each request is copied and sent in several.
STAGING = {"host_staging": "always", "staging_bytes": 20 * 512 * 1024, "staging_piece_bytes": 2 * 512 * 1024}
#: The slots that makes.
STAGING_SLOTS = 20


def prefill_config(**extra: object) -> str:
    return kv_transfer_config("kv_producer", **extra)


def decode_config(**extra: object) -> str:
    return kv_transfer_config(
        "kv_consumer", transfer_timeout=TRANSFER_TIMEOUT, connect_timeout=CONNECT_TIMEOUT, **extra
    )


def kv_transfer_config(role: str, **extra: object) -> str:
    """``--kv-transfer-config`` selecting kvlink in ``role``."""
    return json.dumps(
        {
            "kv_connector": "KvlinkConnector",
            "kv_connector_module_path": "kvlink_vllm",
            "kv_role": role,
            # A failed pull is recomputed (0.14's default; later vLLM
            # releases default to "fail", which answers the client 500).
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp", **extra},
        }
    )


class Process:
    """A process group writing to ``log_path``; subclasses say what to run."""

    def __init__(self, name: str, log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.port = free_port()
        #: The address it serves on and peers reach it at.
        self.host = "127.0.0.1"
        #: The network namespace it runs in (``None``: this one).
        self.netns: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def place(self, host: str, netns: str | None = None) -> None:
        """Serve on ``host``, inside network namespace ``netns`` if given."""
        self.host, self.netns = host, netns

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until ``/health`` answered 200; fails if the process exits."""
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) while starting\n{self.tail()}")
            if client.health(self.url):
                return time.monotonic() - started
            time.sleep(0.2)
        raise AssertionError(f"{self.name} not healthy within {timeout:.0f} s\n{self.tail()}")

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> None:
        assert not self.alive(), f"{self.name} is already running"
        self.starts += 1
        with open(self.log_path, "ab") as log:
            command = self.command()
            if self.netns is not None:
                # ip(8) enters the namespace and executes the command.
                command = ["ip", "netns", "exec", self.netns, *command]
            log.write(f"\n===== {self.name}: start {self.starts}: {' '.join(command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL to the whole group at once: the host losing the process."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=STOP_GRACE)

    def stop(self) -> None:
        """SIGTERM, a bounded wait, then SIGKILL; also reaps a group whose
        leader already exited (vLLM's engine core may outlive its server)."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=STOP_GRACE)

    def log_text(self, start: int = 0) -> str:
        """The log from byte ``start`` on, colour codes removed."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                return ANSI.sub("", f.read().decode(errors="replace"))
        except FileNotFoundError:
            return ""

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except FileNotFoundError:
            return 0

    def tail(self, lines: int = 60) -> str:
        text = self.log_text().splitlines()[-lines:]
        return f"----- last {len(text)} lines of {self.log_path}\n" + "\n".join(text)


class Engine(Process):
    """``vllm serve`` on 127.0.0.1: a baseline (``kv_config`` None), P or D."""

    def __init__(self, name: str, log_dir: str, model: str, kv_config: str | None = None):
        super().__init__(name, log_dir)
        self.model = model
        self.kv_config = kv_config
        #: ``--tensor-parallel-size``: with more than 1, vLLM runs one worker
        #: process per rank, and kvlink's side channel listens past the
        #: bootstrap port, + rank.
        self.tp_size = 1
        # P's bootstrap server listens on this port, its side channel from
        # the next; D's are unused but set anyway, so no two engines could
        # ever share the default.
        self.bootstrap_port = free_port()

    @property
    def side_channel_port(self) -> int:
        """P's first worker's side channel (past the bootstrap port)."""
        return self.bootstrap_port + 1

    @property
    def bootstrap_url(self) -> str:
        """P's bootstrap server, as a router names it to D."""
        return f"http://{self.host}:{self.bootstrap_port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--host", self.host,
            "--port", str(self.port),
            "--served-model-name", MODEL_NAME,
            # vLLM's CPU backend would otherwise run the fp32 checkpoint in
            # bf16, where two engines' kernels disagree in more than the last bit.
            "--dtype", "float32",
            "--enforce-eager",
            "--max-model-len", "4096",
            "--enable-prompt-tokens-details",
            "--seed", "0",
        ]  # fmt: skip
        if self.tp_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tp_size)]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", self.kv_config]
        return cmd

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                # The address this host's peers reach it at, as a
                # deployment sets it per host.
                "VLLM_HOST_IP": self.host,
                "KVLINK_LOG": "info",
                # One compute thread each, not bound to a core: three engines
                # share two cores, and vLLM's default binds each to all of them.
                "OMP_NUM_THREADS": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
                "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port),
                # vLLM's periodic stats line (with kvlink's "KV Transfer
                # metrics" summary) every LOG_STATS_INTERVAL s, not 10.
                "VLLM_LOG_STATS_INTERVAL": str(LOG_STATS_INTERVAL),
            }
        )
        return env

    def healthy(self) -> bool:
        return self.alive() and client.health(self.url)

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> float:
        return super().wait_healthy(timeout)

    def metric(self, name: str) -> float:
        return client.metric(self.url, name)

    def metric_sum(self, name: str, **labels: str) -> float:
        """A metric summed over its series matching ``labels`` (0 before it has any)."""
        return client.metric_sum(self.url, name, **labels)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """A metric's value per value of ``label``."""
        out: dict[str, float] = {}
        for sample, labels, value in client.samples(self.url, name):
            if sample == name:
                out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + value
        return out

    def series_names(self, prefix: str) -> list[str]:
        """The names of the samples on ``/metrics`` starting with ``prefix``."""
        return sorted({name for name, _, _ in client.samples(self.url, prefix)})


class Router(Process):
    """vllm-router in vLLM P/D mode in front of P and D: its default
    ``nixl`` mode (P answers first, the router hands P's params to D), or
    ``mooncake`` (the bootstrap flow of vLLM's Mooncake deployment: the
    router reads P's bootstrap server at start, mints a transfer id and
    sends both legs from what it knows)."""

    def __init__(self, name: str, log_dir: str, prefill: Engine, decode: Engine, kv_connector: str = "nixl"):
        super().__init__(name, log_dir)
        self.prefill, self.decode = prefill, decode
        self.kv_connector = kv_connector
        self.metrics_port = free_port()

    def command(self) -> list[str]:
        prefill = [self.prefill.url]
        if self.kv_connector == "mooncake":
            prefill.append(str(self.prefill.bootstrap_port))
        return [
            sys.executable, "-m", "vllm_router.launch_router",
            "--vllm-pd-disaggregation",
            "--kv-connector", self.kv_connector,
            "--prefill", *prefill,
            "--decode", self.decode.url,
            "--policy", "round_robin",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(self.metrics_port),
            "--worker-startup-timeout-secs", "60",
        ]  # fmt: skip

    def wait_ready(self, timeout: float = 60.0) -> float:
        return self.wait_healthy(timeout)


class TwoHosts:
    """P's own host: a network namespace joined to this one by a veth pair
    (addresses of the test's own, 10.203.N.1 here and .2 there), so P and D
    reach each other only by the addresses they advertise, never by a
    shared loopback. Made by ``create`` (``None`` where namespaces cannot
    be made: no root or no iproute2), removed by ``remove``."""

    def __init__(self, name: str, here: str, there: str):
        self.name, self.here, self.there = name, here, there

    @staticmethod
    def create() -> "TwoHosts | None":
        pid = os.getpid()
        name = f"kvlink-p-{pid}"
        subnet = f"10.203.{pid % 200 + 1}"
        outer, inner = f"kvo{pid % 100000}", f"kvi{pid % 100000}"
        steps = [
            ["ip", "netns", "add", name],
            ["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", name],
            ["ip", "addr", "add", f"{subnet}.1/24", "dev", outer],
            ["ip", "link", "set", outer, "up"],
            ["ip", "-n", name, "addr", "add", f"{subnet}.2/24", "dev", inner],
            ["ip", "-n", name, "link", "set", inner, "up"],
            ["ip", "-n", name, "link", "set", "lo", "up"],
        ]
        for index, step in enumerate(steps):
            try:
                done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                done = subprocess.CompletedProcess(step, 1, "", repr(e))
            if done.returncode != 0:
                if index > 0:
                    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
                    subprocess.run(["ip", "link", "del", outer], capture_output=True, timeout=30)
                print(f"engine-test: P and D share this host's loopback ({' '.join(step)}: {done.stderr.strip()})")
                return None
        return TwoHosts(name, f"{subnet}.1", f"{subnet}.2")

    def remove(self) -> None:
        # The veth pair goes with the namespace.
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
