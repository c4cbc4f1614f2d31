"""``python -m kvlink_vllm.gpu_check --device cpu``: the GPU check's whole
path (vLLM-shaped caches, P and D as two processes, host staging, loopback
TCP, every byte checked where D's engine reads it) with CPU tensors.

It needs PyTorch: skipped where torch is absent (the ``python`` CI step's
environment); the ``vllm-check:<release>`` steps run it, in the release's
environment (vllm_check/test_vllm_scheduler.py calls :func:`check_cpu_mode`).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def check_cpu_mode(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvlink_vllm.gpu_check", "--device", "cpu", "--json", *args],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["received"] == report["requests"], report
    assert report["bad_blocks"] == 0 and report["failed_blocks"] == 0, report
    assert report["checked_bytes"] == report["kv_bytes"] > 0, report
    # Staging smaller than the KV moved (its slots were reused), and all free after.
    assert report["staging_bytes"] < report["kv_bytes"], report
    for side in ("P", "D"):
        after = report["staging_after"][side]
        assert after["requests"] == 0 and after["free_slots"] == after["slots"] > 0, (side, after)
    for rate in ("d2h_bytes_per_s", "h2d_bytes_per_s", "tcp_bytes_per_s", "staged_bytes_per_s"):
        assert report[rate] > 0, rate
    return report


@pytest.mark.parametrize("layout", ["flash", "fused"])
@pytest.mark.parametrize("piece_mib", ["32", "0.0625", "0"], ids=["default_pieces", "small_pieces", "whole"])
def test_gpu_check_cpu_mode(layout, piece_mib):
    pytest.importorskip("torch")
    report = check_cpu_mode("--layout", layout, "--piece-mib", piece_mib)
    assert report["piece_bytes"] == int(float(piece_mib) * (1 << 20))


def test_gpu_check_cpu_mode_many_small_requests():
    """More requests than either side's staging holds, each in many small
    pieces, pulled in an order other than the one P finished them in: P
    must not fill its staging with requests D has not asked for yet while
    D's pull, holding D's staging, waits for one P cannot stage (this
    stalled until the transfer timeout in about one run in three)."""
    pytest.importorskip("torch")
    report = check_cpu_mode("--requests", "32", "--tokens", "512", "--piece-mib", "0.0625", "--timeout", "60")
    assert report["requests"] == 32
