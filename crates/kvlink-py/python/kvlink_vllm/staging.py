"""Host staging: KV of a cache kvlink's transports cannot reach (a CUDA
cache) moved through bounded, page-locked host memory.

The native worker registers, grants and writes the staging only (its
"cache" is the staging: one region per region of the engine's cache, the
same block length, as many blocks as there are slots); kv-worker's
``StagedWorker`` decides which request holds which slots and orders the
copies between the engine's blocks and the slots. This module runs them:

* **P** (``to_staging``): a request finished with delayed free is copied
  device→host into its slots on a dedicated CUDA stream, ordered after the
  forward pass (the stream waits on an event recorded on the engine's
  stream in ``start_load_kv``); the copy is reported done (and the request
  becomes ready to send from the slots, and its device blocks free) only
  once its event completed.
* **D** (``to_device``): after the pull landed in the slots and its grant
  was revoked, the slots are copied host→device on the same stream; the
  pull is reported received only once that copy's event completed (polled,
  never a blocking sync in the engine's step).
* A pull cancelled while its slots are copied to the device is finished
  (an un-started copy is dropped, a started one waited for) before
  ``start_load_kv`` returns: no byte lands in its blocks after the fence.

Copies are plain torch copies (``index_select`` / ``index_copy_`` and
``copy_(non_blocking=True)`` between pinned host memory and the device);
kvlink has no CUDA code of its own. A host cache (vLLM's CPU backend with
``host_staging = "always"``, or the package's tests without torch) is
copied synchronously: torch copies for torch tensors, ``ctypes.memmove``
by address otherwise.

Requests are copied in pieces (``staging_piece_bytes``): P's sender
writes each piece once it is in the slots while the next ones copy, and D
copies each piece into the engine's blocks as soon as P says it landed,
while the rest is on the wire.

A copy that fails (its launch raises, or its completion reports an error)
fails its request cleanly instead of the engine: the worker answers the
pull failed (P, its blocks freed) or reports it failed (D, the engine
recomputes; a pull still on the wire is cut short, so P stops writing it
and lets go), counted under ``copy_failed``, logged at a bounded rate, and
every slot comes back. A copy whose completion errors later, at a query on
the background thread, is reported failed the same way; the thread goes on.

A background thread (``kvlink-staging``) launches the copies and keeps
staging moving between the engine's steps: it polls copies, hands the
finished ones to the worker and gives freed slots to waiting requests (an
idle prefill instance does not step, but a decode instance may still be
waiting for its KV). It sleeps on the worker's change signal, so a piece
that lands or a slot that comes free is acted on at once, and polls only
what time alone moves (CUDA events). The engine's step only records the
event, hands its metadata to the worker and polls events (constant work
per request), and wakes the thread; it never waits behind a launch (see
``Stager``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from . import logs
from ._native import ConfigError, KvlinkError
from .layout import HOST_DEVICES, CacheLayout, Region

logger = logging.getLogger(logs.LOGGER)

#: Device memory kvlink stages through pinned host memory (torch's ROCm
#: builds name their devices "cuda" too).
STAGED_DEVICES = ("cuda",)

#: The longest the background thread waits between looks at copies and
#: slots while something is being staged, and while nothing is. It wakes
#: sooner at every change the worker signals (a piece landed, a transfer
#: ended) and at every engine call; the bound is for what only time moves
#: (a CUDA event completing, a wait for slots running out).
BUSY_POLL_S = 0.002
IDLE_POLL_S = 0.02

#: At most one log line about failed copies per this many seconds (after
#: the first), with the count since the last line.
COPY_FAILURE_LOG_S = 10.0


def _device(t: Any) -> str:
    device = getattr(t, "device", "cpu")
    return str(getattr(device, "type", device))


def should_stage(kv_caches: Mapping[str, Any], host_staging: str, protocol: str) -> bool:
    """Whether this cache's KV moves through host staging; a cache kvlink
    cannot handle is a ``ConfigError`` naming the layer and its device."""
    devices: dict[str, str] = {}
    for name, t in kv_caches.items():
        devices.setdefault(_device(t), name)
    if len(devices) > 1:
        listed = ", ".join(f"{layer!r} on {device}" for device, layer in devices.items())
        raise ConfigError(f"KV cache layers are on different devices ({listed}); kvlink needs one device for all layers")
    if not devices:
        return False
    (device, name), = devices.items()
    if device in HOST_DEVICES:
        return host_staging == "always"
    if device not in STAGED_DEVICES:
        raise ConfigError(
            f"KV cache layer {name!r} is in {device} device memory, which kvlink cannot handle: "
            f"mooncake_protocol={protocol!r} moves host memory, and kvlink stages only CUDA device memory "
            "through pinned host memory. Fix: run this instance on CUDA GPUs or on vLLM's CPU backend."
        )
    if host_staging == "never":
        raise ConfigError(
            f"KV cache layer {name!r} is in {device} device memory, which mooncake_protocol={protocol!r} "
            "cannot reach (kvlink's transports move host memory), and kv_connector_extra_config.host_staging "
            '= "never" forbids moving it through pinned host staging. Fix: host_staging "auto" (the default), '
            "or run this instance on vLLM's CPU backend (KV cache in host memory)."
        )
    return True


@dataclass(frozen=True)
class Plan:
    """The staging of one cache: its distinct regions (layers that share a
    tensor share its regions), in registration order, and the slots."""

    regions: tuple[Region, ...]
    #: The layer each region was first seen in.
    region_layers: tuple[str, ...]
    #: Device region address -> index in ``regions``.
    index: Mapping[int, int]
    block_len: int
    slots: int

    @property
    def region_bytes(self) -> int:
        return self.slots * self.block_len

    @property
    def total_bytes(self) -> int:
        return len(self.regions) * self.region_bytes

    def native_layers(self, cache: CacheLayout, bases: Sequence[int]) -> list[tuple[str, list[tuple[int, int, int, int]]]]:
        """The staging as the native worker registers it: every layer's
        regions, each replaced by its staging region."""
        return [
            (
                name,
                [(bases[self.index[r.addr]], self.region_bytes, self.slots, r.block_size) for r in regions],
            )
            for name, regions in cache.layers
        ]


def plan(cache: CacheLayout, staging_bytes: int) -> Plan:
    """Slots for ``staging_bytes`` of staging: as many blocks of every
    region as fit, at most the cache's own block count."""
    regions: list[Region] = []
    region_layers: list[str] = []
    index: dict[int, int] = {}
    for name, layer in cache.layers:
        for r in layer:
            if r.addr not in index:
                index[r.addr] = len(regions)
                regions.append(r)
                region_layers.append(name)
    first = regions[0]
    for name, r in zip(region_layers, regions):
        if (r.length, r.num_blocks) != (first.length, first.num_blocks):
            raise ConfigError(
                f"KV cache layer {name!r}: a region of {r.length} bytes in {r.num_blocks} blocks, where the first "
                f"has {first.length} bytes in {first.num_blocks}; kvlink needs equal regions"
            )
    per_slot = cache.block_len * len(regions)
    slots = min(first.num_blocks, staging_bytes // per_slot)
    if slots < 1:
        raise ConfigError(
            f"kv-transfer-config: kv_connector_extra_config.staging_bytes = {staging_bytes} is smaller than one "
            f"block of every layer ({per_slot} bytes: {len(regions)} regions x {cache.block_len}); "
            "give it room for the longest request's blocks"
        )
    return Plan(tuple(regions), tuple(region_layers), index, cache.block_len, int(slots))


# ---------------------------------------------------------------------- copy orders


@dataclass(frozen=True)
class CopyOrder:
    """One copy the native worker ordered (``Worker.take_copies``)."""

    id: int
    req: str
    #: "to_staging" (engine blocks into slots) or "to_device" (slots into engine blocks).
    direction: str
    #: ``(engine block, slot)`` in prompt order.
    pairs: tuple[tuple[int, int], ...]

    @classmethod
    def from_native(cls, t: Sequence[Any]) -> "CopyOrder":
        id_, req, direction, pairs = t
        return cls(int(id_), str(req), str(direction), tuple((int(b), int(s)) for b, s in pairs))


def runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """``pairs`` cut into runs of consecutive slots: ``(first pair, length,
    engine blocks consecutive too)``."""
    out: list[tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(pairs) + 1):
        if i < len(pairs) and pairs[i][1] == pairs[i - 1][1] + 1:
            continue
        n = i - start
        blocks = [b for b, _ in pairs[start:i]]
        out.append((start, n, all(blocks[k] == blocks[0] + k for k in range(n))))
        start = i
    return out


class _Done:
    """A copy that completed when it was launched."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


DONE = _Done()


class HostCopier:
    """Copies between a host cache and host staging by address
    (``ctypes.memmove``): for caches that are not torch tensors (the
    package's tests, tools). Synchronous."""

    kind = "host"

    def __init__(self, plan: Plan):
        self.plan = plan
        self._map = mmap.mmap(-1, plan.total_bytes)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.bases = [base + i * plan.region_bytes for i in range(len(plan.regions))]
        self.pinned = False

    @property
    def keepalive(self) -> Any:
        return self._map

    def note_forward(self) -> None:
        """Nothing to order: host copies run when launched."""

    def launch(self, order: CopyOrder) -> Any:
        bl = self.plan.block_len
        for start, n, contiguous in runs(order.pairs):
            block, slot = order.pairs[start]
            spans = [(block, slot, n)] if contiguous else [(b, s, 1) for b, s in order.pairs[start : start + n]]
            for region, base in zip(self.plan.regions, self.bases):
                for b, s, count in spans:
                    engine_at, staging_at = region.addr + b * bl, base + s * bl
                    if order.direction == "to_staging":
                        ctypes.memmove(staging_at, engine_at, count * bl)
                    else:
                        ctypes.memmove(engine_at, staging_at, count * bl)
        return DONE

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        pass


class _Event:
    """A launched CUDA copy: done when its event completed; then what it
    kept alive is let go and ``release`` (a pinned index buffer going back
    to its pool) runs, once."""

    def __init__(self, event: Any, keep: list, release: Any = None):
        self.event = event
        self.keep = keep  # tensors the copy reads or writes, alive until it ends
        self.release = release

    def _ended(self) -> None:
        self.keep = []
        release, self.release = self.release, None
        if release is not None:
            release()

    def done(self) -> bool:
        if self.event.query():
            self._ended()
            return True
        return False

    def wait(self) -> None:
        self.event.synchronize()
        self._ended()


class _Failed:
    """A copy whose launch raised: reported failed like one whose event
    errors (at the next poll, or when a cancelled pull waits for it)."""

    def __init__(self, error: BaseException):
        self.error = error

    def done(self) -> bool:
        raise self.error

    def wait(self) -> None:
        raise self.error


#: Pinned index buffers kept for reuse, at most, and the smallest allocated
#: (in block ids).
INDEX_POOL_MAX = 16
INDEX_MIN_LEN = 256


class TorchCopier:
    """Copies between torch cache tensors and staging with torch: on CUDA,
    asynchronous on a dedicated stream between the device and pinned host
    memory; on the CPU, synchronous (the same code, for tests and the
    ``--device cpu`` mode of :mod:`kvlink_vllm.gpu_check`)."""

    kind = "torch"

    def __init__(self, kv_caches: Mapping[str, Any], cache: CacheLayout, plan: Plan, torch: Any):
        self.torch = torch
        self.plan = plan
        first = next(iter(kv_caches.values()))
        self.device = first.device
        for name, t in kv_caches.items():
            if t.device != self.device:
                raise ConfigError(f"KV cache layer {name!r} is on {t.device}, another layer on {self.device}; kvlink needs one device")
        self.cuda = self.device.type == "cuda"
        self.block_len = plan.block_len
        # Each distinct region of the engine's cache as (blocks, block bytes),
        # a view of the tensor's own storage.
        self.views = [self._bytes_view(kv_caches[name], name, r) for name, r in zip(plan.region_layers, plan.regions)]
        self.pinned = False
        self._registered = None
        self.host = self._allocate(plan.total_bytes)
        self.bases = [self.host.data_ptr() + i * plan.region_bytes for i in range(len(plan.regions))]
        self.staging = self.host.view(len(plan.regions), plan.slots, plan.block_len)
        if self.cuda:
            self.stream = torch.cuda.Stream(device=self.device)
        #: The event the engine's step recorded last (``note_forward``),
        #: written by the engine's thread, read by the launching one.
        self._after_forward: Any = None
        #: Pinned host buffers for block indices, free for the next launch
        #: (one goes back once the copy that uploaded from it completed).
        self._index_pool: list[Any] = []
        self._index_lock = threading.Lock()
        #: Pinned index buffers allocated (the pool grew): for tests.
        self.index_buffers_allocated = 0

    def _bytes_view(self, t: Any, name: str, r: Region) -> Any:
        storage = t.untyped_storage()
        offset = r.addr - storage.data_ptr()
        if offset < 0 or offset + r.length > storage.nbytes():
            raise ConfigError(f"KV cache layer {name!r}: a region lies outside its tensor's storage")
        view = self.torch.empty(0, dtype=self.torch.uint8, device=t.device)
        return view.set_(storage, offset, (r.num_blocks, self.block_len), (self.block_len, 1))

    def _allocate(self, nbytes: int) -> Any:
        host, self._registered, self.pinned = host_buffer(self.torch, nbytes, pinned=self.cuda)
        return host

    @property
    def keepalive(self) -> Any:
        return self.host

    def note_forward(self) -> None:
        """Marks the engine's stream here (called in the engine's step, on
        its thread: its one CUDA call there): copies launched from now on,
        on the staging thread, wait for everything it ran before (the
        forward passes that wrote or read the blocks)."""
        if self.cuda:
            event = self.torch.cuda.Event()
            event.record(self.torch.cuda.current_stream(self.device))
            self._after_forward = event

    def _check(self, order: CopyOrder) -> None:
        blocks, slots = self.views[0].shape[0], self.plan.slots
        for b, s in order.pairs:
            if not (0 <= b < blocks and 0 <= s < slots):
                raise KvlinkError(f"kvlink: copy {order.id} of {order.req}: block {b} or slot {s} out of range")

    def launch(self, order: CopyOrder) -> Any:
        """Launches one copy; on CUDA, on the staging stream, after the
        event the engine's step recorded last (``note_forward``). Called on
        the staging thread (``Stager``), never in the engine's step."""
        self._check(order)
        torch = self.torch
        spans = runs(order.pairs)
        gather = not all(contiguous for _, _, contiguous in spans)
        if not self.cuda:
            idx = torch.tensor([b for b, _ in order.pairs], dtype=torch.long) if gather else None
            self._copy(order, spans, idx, non_blocking=False, keep=None)
            return DONE
        keep: list = []
        release = None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            after = self._after_forward
            if after is not None:
                self.stream.wait_event(after)
            idx = None
            if gather:
                host_idx, release = self._index(order)
                idx = host_idx.to(self.device, non_blocking=True)
                keep.append(idx)
            self._copy(order, spans, idx, non_blocking=True, keep=keep)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _Event(event, keep, release)

    def _index(self, order: CopyOrder) -> tuple[Any, Any]:
        """The order's engine blocks in a pinned buffer from the pool (a new
        one, twice as large as needed, where none free is large enough), and
        the call that gives the buffer back once the copy completed."""
        torch, n = self.torch, len(order.pairs)
        buf = None
        with self._index_lock:
            fits = [i for i, b in enumerate(self._index_pool) if b.numel() >= n]
            if fits:
                buf = self._index_pool.pop(min(fits, key=lambda i: self._index_pool[i].numel()))
        if buf is None:
            size = max(INDEX_MIN_LEN, 1 << max(0, n - 1).bit_length())
            buf = torch.empty(size, dtype=torch.long).pin_memory()
            self.index_buffers_allocated += 1
        host_idx = buf[:n]
        host_idx.copy_(torch.tensor([b for b, _ in order.pairs], dtype=torch.long))

        def give_back() -> None:
            with self._index_lock:
                self._index_pool.append(buf)
                if len(self._index_pool) > INDEX_POOL_MAX:
                    self._index_pool.remove(min(self._index_pool, key=lambda b: b.numel()))

        return host_idx, give_back

    def _copy(self, order: CopyOrder, spans: list[tuple[int, int, bool]], idx: Any, non_blocking: bool, keep: list | None) -> None:
        to_staging = order.direction == "to_staging"
        for start, n, contiguous in spans:
            block, slot = order.pairs[start]
            for view, staging in zip(self.views, self.staging):
                host = staging[slot : slot + n]
                if contiguous:
                    engine = view[block : block + n]
                    if to_staging:
                        host.copy_(engine, non_blocking=non_blocking)
                    else:
                        engine.copy_(host, non_blocking=non_blocking)
                    continue
                at = idx[start : start + n]
                if to_staging:
                    if self.cuda:
                        gathered = view.index_select(0, at)
                        host.copy_(gathered, non_blocking=True)
                        keep.append(gathered)  # type: ignore[union-attr]
                    else:
                        self.torch.index_select(view, 0, at, out=host)
                elif self.cuda:
                    moved = host.to(self.device, non_blocking=True)
                    view.index_copy_(0, at, moved)
                    keep.append(moved)  # type: ignore[union-attr]
                else:
                    view.index_copy_(0, at, host)

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()

    def release(self) -> None:
        """Unregisters the pinned staging (call only once nothing can touch it)."""
        if self._registered is not None:
            release_host_buffer(self.torch, self._registered)
            self._registered = None


def host_buffer(torch: Any, nbytes: int, pinned: bool) -> tuple[Any, int | None, bool]:
    """``nbytes`` of host memory as a uint8 tensor; ``pinned``: page-locked
    for CUDA, the exact size registered with ``cudaHostRegister`` (torch's
    ``pin_memory=True`` would round the allocation up to a power of two).
    Returns the tensor, the address to unregister (or None) and whether it
    is page-locked. Memory that cannot be page-locked is a ``ConfigError``
    naming ``staging_bytes``."""
    if not pinned:
        return torch.empty(nbytes, dtype=torch.uint8), None, False
    cudart = torch.cuda.cudart()
    if not hasattr(cudart, "cudaHostRegister"):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return host, None, bool(host.is_pinned())
    host = torch.empty(nbytes, dtype=torch.uint8)
    err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        raise ConfigError(
            f"kv-transfer-config: cannot page-lock {nbytes} bytes of host staging "
            f"(kv_connector_extra_config.staging_bytes): cudaHostRegister: {cudart.cudaGetErrorString(err)}; "
            "give staging_bytes less"
        )
    return host, host.data_ptr(), True


def release_host_buffer(torch: Any, registered: int) -> None:
    """Unregisters what :func:`host_buffer` registered (once nothing can touch it)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(registered)
    except Exception as e:  # noqa: BLE001 - shutdown goes on
        logger.warning("kvlink: cudaHostUnregister failed: %r", e)


def copier_for(kv_caches: Mapping[str, Any], cache: CacheLayout, plan: Plan) -> Any:
    """The copier of this cache, with its staging allocated."""
    torch = sys.modules.get("torch")
    tensors = list(kv_caches.values())
    if torch is not None and all(isinstance(t, torch.Tensor) for t in tensors):
        return TorchCopier(kv_caches, cache, plan, torch)
    name, t = next(iter(kv_caches.items()))
    device = _device(t)
    if device in HOST_DEVICES:
        return HostCopier(plan)
    raise ConfigError(
        f"KV cache layer {name!r} is in {device} device memory and is not a torch tensor (torch is "
        f"{'not imported' if torch is None else 'imported'}): kvlink stages device memory with PyTorch's copies only"
    )


# ---------------------------------------------------------------------- the flow


class Stager:
    """Runs the native worker's copy orders with a copier, and keeps
    staging moving between the engine's steps.

    The engine's step does O(1) work per request: ``start_load_kv`` records
    an event on the engine's stream (``copier.note_forward``) and hands the
    metadata to the worker, which orders the copies; ``get_finished`` polls
    the launched copies' events. The copies are taken from the worker and
    launched (index upload, one gather and copy per region and piece) on
    the background thread (``kvlink-staging``), which the step wakes.

    One lock guards the state (the launch queue, the copies in flight, the
    calls to the worker about them); it is never held while copies are
    launched, so the step never waits behind a launch. Launches are
    serialized by a lock of their own; a cancelled pull whose copy is being
    launched when the step fences it waits for that one launch, then for
    the copy (the only wait in a step). With ``thread=False`` (tests,
    tools) the engine's calls launch the copies themselves, outside the
    state lock.
    """

    def __init__(self, worker: Any, copier: Any, thread: bool = True):
        self._worker = worker
        self.copier = copier
        self._lock = threading.RLock()
        #: Signalled when a launch ended (a fence may be waiting for it).
        self._launched = threading.Condition(self._lock)
        #: Serializes launches (the staging thread, or the caller without one).
        self._launch_lock = threading.Lock()
        #: Launched copies not yet reported done, by id: (request, handle).
        self._inflight: dict[int, tuple[str, Any]] = {}
        #: Copies taken from the worker, not launched yet (held ones too),
        #: as the worker gave them (read on the launching thread).
        self._queue: deque[Sequence[Any]] = deque()
        #: The copy being launched now, outside the lock (its id).
        self._launching: int | None = None
        #: Ids a fence is finishing: polls leave them to it.
        self._fencing: set[int] = set()
        #: Copies ordered and held un-run (``hold_copies``, a test hook).
        self._held = False
        #: Copies to fail on launch (``fail_copies``, a test hook).
        self._fail_next = 0
        #: Copies that failed, and the log's state: when it last wrote, and
        #: how many failed since.
        self.failed_copies = 0
        self._failure_logged_at: float | None = None
        self._failures_unlogged = 0
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="kvlink-staging", daemon=True)
            self._thread.start()

    # Engine calls.

    def start_load_kv(self, payload: bytes) -> None:
        """Records an event on the engine's stream (every copy ordered from
        now on runs after what it ran so far: the forward passes that wrote
        or read their blocks) and hands the step's metadata to the worker;
        the copies it orders are launched on the staging thread. Those the
        worker names (pulls the step cancelled mid-copy) are finished before
        this returns: dropped if not launched, else waited for."""
        self._raise_error()
        with self._lock:
            # Before the worker orders this step's copies: none of them may
            # run ahead of the engine's stream as it is now.
            self.copier.note_forward()
            cancelled = set(self._worker.start_load_kv(payload))
            if cancelled:
                self._fence(cancelled)
        self._kick()

    def get_finished(self, finished_req_ids: list[str]) -> tuple[list[str], list[str]]:
        """The worker's report of the step, once every copy whose event
        completed was handed to it (polled, never waited for); the copies
        that became due are launched on the staging thread."""
        self._raise_error()
        if self._thread is None:
            self.pump()
        with self._lock:
            self._poll()
            self._worker.pump()
            report = self._worker.get_finished(finished_req_ids)
        self._kick()
        return report

    # The background thread's (the engine's calls' without one).

    def pump(self) -> None:
        """Hands finished copies to the worker, lets it move on, and
        launches what it ordered (outside the state lock)."""
        with self._lock:
            self._poll()
            self._worker.pump()
            self._take()
        self._launch_queued()
        with self._lock:
            self._poll()

    def _kick(self) -> None:
        """After an engine call: the staging thread takes and launches the
        copies the worker ordered; without a thread, this caller does."""
        if self._thread is None:
            self.pump()
        else:
            self._worker.wake()

    def _fence(self, cancelled: set[int]) -> None:
        """(Lock held.) Finishes the copies of pulls this step cancelled:
        one not launched is dropped, one being launched is waited for, then
        every launched one is waited for; each is reported to the worker
        once (done, or failed where its launch or its wait raised)."""
        # Orders not taken yet are taken here, so that none of them is
        # launched later.
        self._take()
        dropped = [t for t in self._queue if int(t[0]) in cancelled]
        if dropped:
            self._queue = deque(t for t in self._queue if int(t[0]) not in cancelled)
            for t in dropped:
                logger.debug("kvlink: copy %s of cancelled pull %s dropped before it ran", t[0], t[1])
        self._fencing = cancelled
        try:
            while self._launching is not None and self._launching in cancelled:
                self._launched.wait()
            failed = []
            for id_ in cancelled:
                entry = self._inflight.pop(id_, None)
                if entry is None:
                    continue
                req, handle = entry
                try:
                    handle.wait()
                except Exception as e:  # noqa: BLE001 - it ended: failed
                    self._copy_failed(id_, req, e)
                    failed.append(id_)
        finally:
            self._fencing = set()
        self._worker.copies_done(sorted(cancelled - set(failed)))
        if failed:
            self._worker.copies_failed(failed)

    def _poll(self) -> None:
        """(Lock held.) Reports the launched copies that ended."""
        done, failed = [], []
        for id_, (req, handle) in self._inflight.items():
            if id_ in self._fencing:
                continue
            try:
                if handle.done():
                    done.append(id_)
            except Exception as e:  # noqa: BLE001 - the copy ended in an error
                self._copy_failed(id_, req, e)
                failed.append(id_)
        for id_ in done + failed:
            del self._inflight[id_]
        if done:
            self._worker.copies_done(done)
        if failed:
            self._worker.copies_failed(failed)

    def _take(self) -> None:
        """(Lock held.) The worker's new copy orders join the launch queue
        (read into ``CopyOrder`` by the launching thread, outside the lock)."""
        self._queue.extend(self._worker.take_copies())

    def _launch_queued(self) -> None:
        """Launches the queued copies, one at a time, with the state lock
        taken only to pick each and to record it launched (never held while
        the copier launches)."""
        with self._launch_lock:
            while True:
                with self._lock:
                    if self._held or not self._queue:
                        return
                    raw = self._queue.popleft()
                    self._launching = id_ = int(raw[0])
                    inject = self._fail_next > 0
                    if inject:
                        self._fail_next -= 1
                req = str(raw[1])
                try:
                    order = CopyOrder.from_native(raw)
                    req = order.req
                    if inject:
                        raise KvlinkError("injected copy failure (Stager.fail_copies)")
                    handle = self.copier.launch(order)
                except Exception as e:  # noqa: BLE001 - fails its request, not the engine
                    handle = _Failed(e)
                with self._lock:
                    self._inflight[id_] = (req, handle)
                    self._launching = None
                    self._launched.notify_all()

    def _copy_failed(self, id_: int, req: str, error: BaseException) -> None:
        """Counts a failed copy and logs it: the first at once, then at
        most one line per :data:`COPY_FAILURE_LOG_S` with the count."""
        self.failed_copies += 1
        self._failures_unlogged += 1
        now = time.monotonic()
        if self._failure_logged_at is not None and now - self._failure_logged_at < COPY_FAILURE_LOG_S:
            return
        logger.warning(
            "kvlink: a staging copy failed (copy %d%s): %r; its request fails (copy_failed), %d failed copies since the last line",
            id_,
            f" of {req}" if req else "",
            error,
            self._failures_unlogged,
        )
        self._failure_logged_at = now
        self._failures_unlogged = 0

    def _busy(self) -> bool:
        if self._inflight or self._queue or self._launching is not None:
            return True
        state = self._worker.staging_state
        return bool(state and state[0])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                # Read before the pump: a change during it ends the wait at once.
                seen = self._worker.change_count
                self.pump()
                busy = self._busy()
                self._worker.wait_changed(seen, BUSY_POLL_S if busy else IDLE_POLL_S)
            except Exception as e:  # noqa: BLE001 - reported to the engine's next call
                if not self._stop.is_set():
                    self._fail(e)
                return

    def _fail(self, e: BaseException) -> None:
        logger.error("kvlink staging thread stopped: %r", e)
        self._error = e

    def _raise_error(self) -> None:
        if self._error is not None:
            raise KvlinkError(f"kvlink host staging failed: {self._error!r}") from self._error

    # Tests and tools.

    def hold_copies(self, held: bool) -> None:
        """Test hook: while held, copies are ordered but not run (so a test
        can end a process mid-copy); released, the held ones run (launched
        by this call)."""
        with self._lock:
            self._held = held
        if not held:
            self._launch_queued()

    def fail_copies(self, count: int) -> None:
        """Test hook: the next ``count`` copies fail as they are launched,
        as a copy whose launch raises does."""
        with self._lock:
            self._fail_next = count

    def state(self) -> dict[str, int]:
        with self._lock:
            requests, free, slots = self._worker.staging_state or (0, 0, 0)
            return {
                "requests": requests,
                "free_slots": free,
                "slots": slots,
                "copies_in_flight": len(self._inflight) + (self._launching is not None),
                "copies_held": len(self._queue),
                "copies_failed": self.failed_copies,
            }

    # Shutdown.

    def stop(self) -> None:
        """Stops the background thread (bounded)."""
        self._stop.set()
        try:
            self._worker.wake()
        except Exception:  # noqa: BLE001 - the thread then stops at its bound
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def close(self, worker_stopped: bool) -> None:
        """After the worker stopped: waits for launched copies, then releases
        the pinned staging if the worker let go of it."""
        self.stop()
        with self._launch_lock, self._lock:
            self.copier.synchronize()
            self._inflight.clear()
            self._queue.clear()
            if worker_stopped:
                self.copier.release()
