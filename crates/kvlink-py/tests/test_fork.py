"""Import and fork safety: importing starts no thread; a forked child of a
process that started a worker fails fast instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))


def run(script: str, timeout: float = 60) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_starts_no_thread():
    r = run(
        """
        import json, os, threading
        before = (len(os.listdir("/proc/self/task")), threading.active_count())
        import kvlink_vllm, kvlink_vllm.adapter, kvlink_vllm.layout, kvlink_vllm.connector
        from kvlink_vllm import _native
        kvlink_vllm.KvlinkConnector
        after = (len(os.listdir("/proc/self/task")), threading.active_count())
        print(json.dumps({"before": before, "after": after, "owner": _native.runtime_owner_pid()}))
        """
    )
    assert r["before"] == r["after"]
    assert r["owner"] is None


def test_call_in_forked_child_fails_fast():
    r = run(
        """
        import ctypes, gc, json, mmap, os, time
        from types import SimpleNamespace
        from kvsim import FakeTensor, Instance
        from kvlink_vllm import ForkError, _native, adapter

        inst = Instance("kv_consumer", "d", {"advertised_host": "127.0.0.1"}, num_blocks=8, num_layers=1)
        worker = inst.worker.connector_worker.worker
        parent = os.getpid()
        assert _native.runtime_owner_pid() == parent
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:
            results = {}
            def timed(name, fn):
                t0 = time.monotonic()
                try:
                    fn()
                    results[name] = ["no error", time.monotonic() - t0]
                except ForkError as e:
                    results[name] = [str(e), time.monotonic() - t0]
            timed("get_finished", lambda: worker.get_finished([]))
            timed("start_load_kv", lambda: worker.start_load_kv(b"{}"))
            def new_worker():
                mm = mmap.mmap(-1, 2 * 8 * 16 * 16 * 2)
                addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
                side = adapter.WorkerSide(inst.worker.settings, "127.0.0.1", block_size=16)
                side.register_kv_caches({"l": FakeTensor(mm, addr, (2, 8, 1, 16, 16), 2)})
            timed("new_worker", new_worker)
            # The scheduler side is sans-IO: it keeps working in a child.
            s = inst.scheduler.connector_scheduler
            results["scheduler_meta"] = len(s.build_connector_meta())
            # Dropping the inherited worker in the child must not hang either.
            t0 = time.monotonic()
            del worker
            inst.worker.connector_worker._worker = None
            gc.collect()
            results["drop"] = time.monotonic() - t0
            os.write(write_end, json.dumps(results).encode())
            os._exit(0)
        os.close(write_end)
        deadline = time.monotonic() + 20
        while True:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.kill(child, 9)
                raise SystemExit("forked child hung")
            time.sleep(0.01)
        results = json.loads(os.read(read_end, 65536))
        results["parent"] = parent
        # The parent's worker is unaffected.
        results["parent_get_finished"] = worker.get_finished([])
        inst.worker.shutdown()
        print(json.dumps(results))
        """
    )
    for name in ("get_finished", "start_load_kv", "new_worker"):
        message, seconds = r[name]
        assert "forked from pid" in message and str(r["parent"]) in message, (name, message)
        assert seconds < 1.0, (name, seconds)
    assert r["scheduler_meta"] > 0
    assert r["drop"] < 1.0
    assert r["parent_get_finished"] == [[], []]
