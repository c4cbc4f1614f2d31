"""``python -m kvlink_vllm.gpu_check``: kvlink's host staging on a GPU,
measured, with PyTorch and CUDA and without vLLM.

It builds vLLM-shaped KV caches on the device for a prefill (P) and a
decode (D) instance, two processes on one GPU, and moves ``--requests``
requests from P to D through kvlink's real path: P's scheduler and worker
side (``kvlink_vllm.adapter``) copy each finished request device→host into
pinned staging, D pulls it over loopback TCP into its staging and copies
it host→device; D then checks every byte on the device against what P
wrote there. In one run it prints the device↔host pinned-copy bandwidths,
loopback TCP's, kvlink's staged rate (bytes over the time from P handing
the requests to its worker to D's engine hearing the last one received)
and its ratio to the slowest of the three (target: 0.8 or more).

``--device cpu`` runs the same code with CPU tensors (host staging forced
on, copies synchronous): the package's tests run it where torch is
installed. Exit status 0: every request landed and every byte matched
(and, with ``--min-ratio``, the ratio was met); 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

GIB = 1 << 30

#: Per-layer cache shapes, as vLLM's backends allocate them (``n`` blocks).
LAYOUTS = {
    # FlashAttention (0.14): (2, blocks, block_size, heads, head_dim); the CPU
    # backend's own order on the CPU: (2, blocks, heads, block_size, head_dim).
    "flash": lambda n, b, h, d, device: (2, n, b, h, d) if device == "cuda" else (2, n, h, b, d),
    # FlashInfer (0.14): (blocks, 2, block_size, heads, head_dim).
    "flashinfer": lambda n, b, h, d, device: (n, 2, b, h, d),
    # Later releases: (blocks, heads, block_size, 2 x head_size).
    "fused": lambda n, b, h, d, device: (n, h, b, 2 * d),
    # MLA: (blocks, block_size, latent + rope dims).
    "mla": lambda n, b, h, d, device: (n, b, d),
}


@dataclass
class Shape:
    device: str
    gpu: int
    layout: str
    requests: int
    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    staging_bytes: int
    piece_bytes: int
    protocol: str
    timeout: float

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        # Room for every request, and some the requests do not use.
        return self.requests * self.blocks_per_request + 8

    def torch_device(self) -> str:
        return f"cuda:{self.gpu}" if self.device == "cuda" else "cpu"


def _caches(torch: Any, shape: Shape) -> dict[str, Any]:
    dims = LAYOUTS[shape.layout](shape.num_blocks, shape.block_size, shape.kv_heads, shape.head_dim, shape.device)
    dtype = getattr(torch, shape.dtype)
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(dims, dtype=dtype, device=shape.torch_device())
        for i in range(shape.layers)
    }


def _pattern(torch: Any, device: Any, request: int, region: int, blocks: int, block_len: int) -> Any:
    """What request ``request`` holds in ``region``: (blocks, block_len)
    bytes, distinct per request, region and block position (computed on
    the device; no product exceeds 2^53)."""
    position = torch.arange(blocks, device=device, dtype=torch.int64).unsqueeze(1)
    column = torch.arange(block_len, device=device, dtype=torch.int64).unsqueeze(0)
    x = column * 2654435761 + (position + 1) * 40503 + request * 1_000_003 + region * 7919
    x = x ^ (x >> 13)
    return (x & 0xFF).to(torch.uint8)


def _block_ids(shape: Shape, seed: int) -> list[list[int]]:
    """Each request's blocks: a shuffled assignment, as a busy engine's
    free list gives them (so copies gather and scatter)."""
    ids = list(range(shape.num_blocks))
    random.Random(seed).shuffle(ids)
    n = shape.blocks_per_request
    return [ids[i * n : (i + 1) * n] for i in range(shape.requests)]


def _settings(role: str, shape: Shape):
    from . import adapter

    extra = {
        "mooncake_protocol": shape.protocol,
        "advertised_host": "127.0.0.1",
        "host_staging": "always" if shape.device == "cpu" else "auto",
        "staging_bytes": shape.staging_bytes,
        "staging_piece_bytes": shape.piece_bytes,
        "transfer_timeout": shape.timeout,
        # Transfers P runs at once: each batch of 16 MiB or more opens two
        # data connections, and D's TCP listener admits 16 handshakes per
        # host at once; the default 10 can exceed that on a cold start.
        "num_workers": 4,
    }
    return adapter.settings_from_transfer_config(
        SimpleNamespace(kv_role=role, engine_id=f"gpu-check-{role}", kv_connector_extra_config=extra)
    )


class _Blocks:
    def __init__(self, block_ids: list[int]):
        self.block_ids = block_ids

    def get_unhashed_block_ids(self) -> list[int]:
        return self.block_ids


def _request(request_id: str, tokens: int, params: dict, status: str = "RUNNING") -> Any:
    return SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(range(tokens)), status=status, kv_transfer_params=params
    )


def _side(role: str, shape: Shape, torch: Any):
    from . import adapter

    settings = _settings(role, shape)
    caches = _caches(torch, shape)
    worker = adapter.WorkerSide(
        settings, "127.0.0.1", block_size=shape.block_size, use_mla=shape.layout == "mla", num_blocks=shape.num_blocks
    )
    worker.register_kv_caches(caches)
    scheduler = adapter.SchedulerSide(settings, "127.0.0.1")
    return settings, caches, worker, scheduler


def _views(torch: Any, worker: Any) -> list[Any]:
    """The distinct regions of the worker's cache, as (blocks, block bytes)."""
    return worker.stager.copier.views


def _prefill(shape_dict: dict, peer: Any, out: Any) -> None:
    """P: writes each request's KV on the device, finishes it with delayed
    free once D is up, hands D the params, and steps until D is done."""
    import torch

    shape = Shape(**shape_dict)
    if shape.device == "cuda":
        torch.cuda.set_device(shape.gpu)
    _, _, worker, scheduler = _side("kv_producer", shape, torch)
    try:
        views = _views(torch, worker)
        device = views[0].device
        block_len = views[0].shape[1]
        assignment = _block_ids(shape, seed=1)
        requests = []
        for i, blocks in enumerate(assignment):
            req = _request(f"req-{i}", shape.tokens, {"do_remote_decode": True})
            scheduler.get_num_new_matched_tokens(req, 0)
            scheduler.update_state_after_alloc(req, _Blocks(blocks), 0)
            requests.append((req, blocks))
        # The step that runs their prefill: P's worker expects them from now
        # on, and the forward pass writes their KV on the engine's stream.
        worker.start_load_kv(scheduler.build_connector_meta())
        for i, blocks in enumerate(assignment):
            idx = torch.tensor(blocks, dtype=torch.long, device=device)
            for r, view in enumerate(views):
                view.index_copy_(0, idx, _pattern(torch, device, i, r, len(blocks), block_len))
        worker.get_finished(set())
        if peer.recv() != "ready":
            raise RuntimeError("D did not start")
        params = []
        for req, blocks in requests:
            req.status = "FINISHED_LENGTH_CAPPED"
            delay, returned = scheduler.request_finished(req, blocks)
            assert delay and returned, "the request was not delay-freed"
            params.append(returned)
        started = time.monotonic()
        peer.send(params)
        sent: set[str] = set()
        deadline = started + shape.timeout
        while time.monotonic() < deadline and not peer.poll():  # until D is done
            worker.start_load_kv(scheduler.build_connector_meta())
            sending, _ = worker.get_finished(set())
            sent |= sending or set()
            time.sleep(0.001)
        # D is done: P's last slots come back as its worker reports the sends (bounded).
        drained = time.monotonic() + 10
        while worker.stager.state()["requests"] and time.monotonic() < drained:
            worker.start_load_kv(scheduler.build_connector_meta())
            worker.get_finished(set())
            time.sleep(0.001)
        out.send({"started": started, "sent": len(sent), "staging": worker.stager.state()})
    finally:
        worker.shutdown()


def _decode(shape_dict: dict, peer: Any, out: Any) -> None:
    """D: pulls each request (one per step, as they arrive), then checks
    every byte of every request on the device."""
    import torch

    shape = Shape(**shape_dict)
    if shape.device == "cuda":
        torch.cuda.set_device(shape.gpu)
    _, _, worker, scheduler = _side("kv_consumer", shape, torch)
    try:
        views = _views(torch, worker)
        device = views[0].device
        block_len = views[0].shape[1]
        peer.send("ready")
        given = peer.recv()
        assignment = _block_ids(shape, seed=2)
        pending = list(enumerate(zip(given, assignment)))
        received: dict[str, float] = {}
        errors: set[int] = set()
        names = {f"d-req-{i}" for i in range(shape.requests)}
        deadline = time.monotonic() + shape.timeout
        while set(received) != names and time.monotonic() < deadline:
            if pending:
                i, (params, blocks) = pending.pop(0)
                req = _request(f"d-req-{i}", shape.tokens, dict(params), status="WAITING")
                matched, load_async = scheduler.get_num_new_matched_tokens(req, 0)
                assert load_async and matched, (matched, load_async)
                scheduler.update_state_after_alloc(req, _Blocks(blocks), matched)
            worker.start_load_kv(scheduler.build_connector_meta())
            _, recving = worker.get_finished(set())
            now = time.monotonic()
            for rid in recving or ():
                received.setdefault(rid, now)
            errors |= worker.get_block_ids_with_load_errors()
            if not pending:
                time.sleep(0.0005)
        ended = max(received.values()) if received else time.monotonic()
        peer.send("done")
        # Every byte, on the device: what P wrote is what D's blocks hold.
        checked, bad = 0, 0
        for i, blocks in enumerate(assignment):
            idx = torch.tensor(blocks, dtype=torch.long, device=device)
            for r, view in enumerate(views):
                got = view.index_select(0, idx)
                want = _pattern(torch, device, i, r, len(blocks), block_len)
                bad += int((got != want).any(dim=1).sum().item())
                checked += got.numel()
        out.send(
            {
                "received": len(received),
                "failed_blocks": len(errors),
                "ended": ended,
                "checked_bytes": checked,
                "bad_blocks": bad,
                "staging": worker.stager.state(),
                "pinned": worker.stager.copier.pinned,
            }
        )
    finally:
        worker.shutdown()


def _copy_bandwidths(torch: Any, shape: Shape, nbytes: int) -> tuple[float, float]:
    """D2H and H2D bandwidth between device memory and pinned host memory
    (on the CPU: host to host), bytes per second."""
    from .staging import host_buffer, release_host_buffer

    cuda = shape.device == "cuda"
    device = shape.torch_device()
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host, registered, _ = host_buffer(torch, nbytes, pinned=cuda)
    try:
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        reps = 5

        def timed(copy) -> float:
            copy()
            sync()
            started = time.perf_counter()
            for _ in range(reps):
                copy()
            sync()
            return reps * nbytes / (time.perf_counter() - started)

        d2h = timed(lambda: host.copy_(dev, non_blocking=cuda))
        h2d = timed(lambda: dev.copy_(host, non_blocking=cuda))
        return d2h, h2d
    finally:
        sync_all = torch.cuda.synchronize if cuda else (lambda: None)
        sync_all()
        if registered is not None:
            release_host_buffer(torch, registered)  # before the memory goes


def _tcp_bandwidth(nbytes: int) -> float:
    """One loopback TCP stream, bytes per second."""
    chunk = 4 << 20
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    got = [0]

    def serve() -> None:
        conn, _ = listener.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        with conn:
            while got[0] < nbytes:
                n = conn.recv_into(view)
                if n == 0:
                    break
                got[0] += n
            conn.sendall(b"k")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    payload = memoryview(bytearray(os.urandom(1 << 16)) * (chunk >> 16))
    with socket.create_connection(("127.0.0.1", port)) as s:
        started = time.perf_counter()
        left = nbytes
        while left > 0:
            n = min(left, chunk)
            s.sendall(payload[:n])
            left -= n
        s.recv(1)
        elapsed = time.perf_counter() - started
    thread.join(timeout=10)
    listener.close()
    return nbytes / elapsed


def _gb(x: float) -> str:
    return f"{x / 1e9:8.2f} GB/s"


def run(shape: Shape, min_ratio: float | None = None, as_json: bool = False) -> int:
    import torch

    if shape.device == "cuda" and not torch.cuda.is_available():
        print("kvlink gpu_check: CUDA is not available to PyTorch (use --device cpu for the CPU mode)", file=sys.stderr)
        return 1
    started_run = time.monotonic()
    probe = _caches(torch, Shape(**{**asdict(shape), "requests": 1, "tokens": shape.block_size}))
    from .layout import describe

    cache = describe(probe, shape.block_size, shape.layout == "mla", 1 + 8)
    regions = len({r.addr for _, rs in cache.layers for r in rs})
    del probe
    total = shape.requests * shape.blocks_per_request * regions * cache.block_len
    measure = max(min(total, 256 << 20), 16 << 20)
    d2h, h2d = _copy_bandwidths(torch, shape, measure)
    tcp = _tcp_bandwidth(max(min(2 * total, 1 << 30), 64 << 20))

    ctx = mp.get_context("spawn")
    p_conn, d_conn = ctx.Pipe()
    p_out, p_in = ctx.Pipe()
    d_out, d_in = ctx.Pipe()
    bootstrap = socket.socket()
    bootstrap.bind(("127.0.0.1", 0))
    port = bootstrap.getsockname()[1]
    bootstrap.close()
    os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(port)
    procs = [
        ctx.Process(target=_prefill_main, args=(asdict(shape), p_conn, p_in), name="kvlink-gpu-check-P"),
        ctx.Process(target=_decode_main, args=(asdict(shape), d_conn, d_in), name="kvlink-gpu-check-D"),
    ]
    for p in procs:
        p.start()
    results: dict[str, dict] = {}
    outs = {"D": d_out, "P": p_out}
    deadline = time.monotonic() + shape.timeout + 60
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            for (name, conn), proc in zip(outs.items(), reversed(procs)):
                if name in results:
                    continue
                if conn.poll(0.05):
                    try:
                        results[name] = conn.recv()
                    except EOFError:
                        results[name] = {"error": "exited without a result"}
                elif not proc.is_alive() and not conn.poll(0):
                    results[name] = {"error": f"exited ({proc.exitcode}) without a result"}
            if any("error" in r for r in results.values()):
                break
    finally:
        for proc in procs:
            proc.join(timeout=0 if len(results) < 2 else 30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    p_result, d_result = results.get("P"), results.get("D")
    if not (p_result and d_result) or "error" in p_result or "error" in d_result:
        print(f"kvlink gpu_check: failed: P={p_result} D={d_result}", file=sys.stderr)
        return 1
    elapsed = d_result["ended"] - p_result["started"]
    staged = total / elapsed if elapsed > 0 else 0.0
    copies = "pinned copy" if shape.device == "cuda" else "copy (host)"
    slowest_name, slowest = min(
        ((f"D2H {copies}", d2h), (f"H2D {copies}", h2d), ("loopback TCP", tcp)), key=lambda x: x[1]
    )
    ratio = staged / slowest if slowest else 0.0
    ok = (
        d_result["received"] == shape.requests
        and d_result["failed_blocks"] == 0
        and d_result["bad_blocks"] == 0
        and d_result["checked_bytes"] == total
    )
    met = ratio >= 0.8
    report = {
        "device": _device_name(torch, shape),
        "layout": shape.layout,
        "requests": shape.requests,
        "tokens": shape.tokens,
        "kv_bytes": total,
        "staging_bytes": shape.staging_bytes,
        "piece_bytes": shape.piece_bytes,
        "staging_slots": d_result["staging"]["slots"],
        "pinned": d_result["pinned"],
        "d2h_bytes_per_s": d2h,
        "h2d_bytes_per_s": h2d,
        "tcp_bytes_per_s": tcp,
        "staged_bytes_per_s": staged,
        "slowest": slowest_name,
        "ratio": ratio,
        "target_met": met,
        "received": d_result["received"],
        "failed_blocks": d_result["failed_blocks"],
        "checked_bytes": d_result["checked_bytes"],
        "bad_blocks": d_result["bad_blocks"],
        "staging_after": {"P": p_result["staging"], "D": d_result["staging"]},
        "seconds": time.monotonic() - started_run,
        "ok": ok,
    }
    if as_json:
        print(json.dumps(report))
    else:
        print(
            f"kvlink gpu_check: {report['device']}, layout {shape.layout}, {shape.requests} requests x {shape.tokens} tokens, "
            f"{shape.layers} layers: {total / GIB:.3f} GiB of KV; staging {shape.staging_bytes / GIB:.3f} GiB per side "
            f"({report['staging_slots']} slots, {'pinned' if report['pinned'] else 'pageable'}), "
            + (f"pieces of {shape.piece_bytes / (1 << 20):g} MiB" if shape.piece_bytes else "whole requests")
        )
        print(f"  D2H {copies}      : {_gb(d2h)}")
        print(f"  H2D {copies}      : {_gb(h2d)}")
        print(f"  loopback TCP         : {_gb(tcp)}")
        print(
            f"  kvlink staged P->D   : {_gb(staged)}  ratio to the slowest ({slowest_name}): {ratio:.2f}"
            f" (target >= 0.8: {'met' if met else 'NOT met'})"
        )
        print(
            f"  verified on {shape.device:4}     : {d_result['checked_bytes']} bytes, "
            f"{d_result['received']}/{shape.requests} requests received, {d_result['bad_blocks']} bad blocks, "
            f"{d_result['failed_blocks']} failed blocks"
        )
        print(f"  slots free after     : P {_free(p_result['staging'])}, D {_free(d_result['staging'])}")
        print(f"  time                 : {report['seconds']:.1f} s; {'OK' if ok else 'FAILED'}")
    if not ok:
        return 1
    if min_ratio is not None and ratio < min_ratio:
        return 1
    return 0


def _free(state: dict) -> str:
    return f"{state['free_slots']}/{state['slots']}"


def _device_name(torch: Any, shape: Shape) -> str:
    if shape.device == "cuda":
        return f"cuda:{shape.gpu} ({torch.cuda.get_device_name(shape.gpu)})"
    return "cpu"


def _guarded(fn, shape_dict: dict, peer: Any, out: Any) -> None:
    try:
        fn(shape_dict, peer, out)
    except BaseException as e:  # reported to the parent, which fails with it
        import traceback

        traceback.print_exc()
        try:
            out.send({"error": repr(e)})
        except Exception:  # noqa: BLE001 - the parent times out instead
            pass


def _prefill_main(shape_dict: dict, peer: Any, out: Any) -> None:
    _guarded(_prefill, shape_dict, peer, out)


def _decode_main(shape_dict: dict, peer: Any, out: Any) -> None:
    _guarded(_decode, shape_dict, peer, out)


def parse(argv: list[str] | None = None) -> tuple[Shape, float | None, bool]:
    ap = argparse.ArgumentParser(prog="python -m kvlink_vllm.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default), or cpu: the same path with CPU tensors")
    ap.add_argument("--gpu", type=int, default=0, help="CUDA device index of both instances")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="flash", help="per-layer cache layout (default flash)")
    ap.add_argument("--requests", type=int, help="requests moved (default 16; cpu 8)")
    ap.add_argument("--tokens", type=int, help="tokens per request (default 2048; cpu 256)")
    ap.add_argument("--layers", type=int, help="layers (default 32; cpu 4)")
    ap.add_argument("--kv-heads", type=int, help="KV heads (default 8; cpu 2)")
    ap.add_argument("--head-dim", type=int, help="head size (default 128; cpu 64; mla: the latent size, default 576)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    ap.add_argument("--dtype", default="bfloat16", help="cache dtype (default bfloat16)")
    ap.add_argument("--staging-bytes", type=int, help="staging per side (default: half of the KV moved, so slots are reused)")
    ap.add_argument(
        "--piece-mib",
        type=float,
        default=32.0,
        help="staging_piece_bytes in MiB: requests copied and sent in pieces this large (default 32; 0: whole requests)",
    )
    ap.add_argument("--protocol", default="tcp", help="mooncake_protocol (default tcp)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for the transfers (default 120)")
    ap.add_argument("--min-ratio", type=float, help="exit 1 if the staged rate is below this ratio of the slowest")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    mla = a.layout == "mla"
    shape = Shape(
        device=a.device,
        gpu=a.gpu,
        layout=a.layout,
        requests=a.requests or (8 if cpu else 16),
        tokens=a.tokens or (256 if cpu else 2048),
        layers=a.layers or (4 if cpu else 32),
        kv_heads=a.kv_heads or (2 if cpu else 8),
        head_dim=a.head_dim or (576 if mla else 64 if cpu else 128),
        block_size=a.block_size,
        dtype=a.dtype,
        staging_bytes=0,
        piece_bytes=int(a.piece_mib * (1 << 20)),
        protocol=a.protocol,
        timeout=a.timeout,
    )
    if min(shape.requests, shape.tokens, shape.layers, shape.kv_heads, shape.head_dim, shape.block_size) < 1:
        ap.error("sizes must be positive")
    if a.piece_mib < 0:
        ap.error("--piece-mib must be 0 or more")
    per_block = shape.layers * {"flash": 2}.get(shape.layout, 1) * _block_bytes(shape)
    total = shape.requests * shape.blocks_per_request * per_block
    staging = a.staging_bytes if a.staging_bytes is not None else max(total // 2, shape.blocks_per_request * per_block)
    shape.staging_bytes = staging
    return shape, a.min_ratio, a.json


def _block_bytes(shape: Shape) -> int:
    """Bytes of one block of one region (what ``layout.describe`` computes)."""
    import torch

    elem = torch.empty(0, dtype=getattr(torch, shape.dtype)).element_size()
    heads = 1 if shape.layout == "mla" else shape.kv_heads
    kv = 2 if shape.layout in ("flashinfer", "fused") else 1
    return shape.block_size * heads * shape.head_dim * kv * elem


def main(argv: list[str] | None = None) -> int:
    shape, min_ratio, as_json = parse(argv)
    return run(shape, min_ratio, as_json)


if __name__ == "__main__":
    sys.exit(main())
