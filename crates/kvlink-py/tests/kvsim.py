"""A vLLM engine instance reduced to what the KV connector sees (0.14's
step sequence; ``vllm_release`` picks what differs in later releases).

One :class:`Instance` holds a scheduler-side and a worker-side
``KvlinkConnector`` (created as vLLM's factory does, from a config object)
and a KV cache of memory-mapped fake tensors in the CPU backend's layout.
:meth:`Instance.step` replays the calls of one vLLM 0.14 engine step in
vLLM's order:

scheduler ``schedule()``
    waiting requests: ``WAITING_FOR_REMOTE_KVS`` ones become runnable once
    reported in ``finished_recving``; new ones get
    ``get_num_new_matched_tokens``, blocks, ``update_state_after_alloc``;
    then ``build_connector_meta``; the step's output carries the requests
    finished since the last step (``finished_req_ids``).
worker ``execute_model()`` (the metadata crosses a process boundary: pickled)
    ``bind_connector_metadata``, ``start_load_kv``, forward (prefill writes
    the request's KV into its blocks), ``wait_for_save``, ``get_finished``,
    ``get_block_ids_with_load_errors``, ``get_kv_connector_stats`` (its
    data is the step's ``stats``), ``clear_connector_metadata``.
scheduler ``update_from_output()``
    invalid blocks mark waiting requests for recompute; ``finished_recving``
    ids join the ready set; ``finished_sending`` ids free their blocks; a
    prefill whose ``max_tokens`` is reached finishes (length capped):
    ``request_finished``, blocks freed unless delayed.

With ``host_staging`` in the extra config ("always": this cache is host
memory) the worker moves KV through host staging, and its copies between
the cache and the staging are real copies; :meth:`Instance.hold_copies`
holds them un-run, so a test can end a process or cancel a pull mid-copy.

``vllm_release="0.32.0"``: a request aborted while its pull is in flight
keeps its blocks until the worker reports the pull in ``finished_recving``
(vLLM PR #32255); the connector runs with that release's behaviour.

Contract checks vLLM 0.14 makes (or must be able to rely on) are recorded
as ``violations`` instead of asserting, so a test can show them all.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import mmap
import pickle
import secrets
from types import SimpleNamespace
from typing import Any

from kvlink_vllm import versions
from kvlink_vllm.connector import KVConnectorRole, KvlinkConnector


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class FakeDevice:
    def __init__(self, type_: str):
        self.type = type_


class FakeTensor:
    """A tensor over raw memory: what ``register_kv_caches`` reads of a torch tensor."""

    def __init__(self, owner: Any, addr: int, shape: tuple[int, ...], elem: int, device: str = "cpu", strides=None):
        self._owner = owner  # keeps the memory alive
        self._addr = addr
        self.shape = tuple(shape)
        self._elem = elem
        self.device = FakeDevice(device)
        if strides is None:
            strides, acc = [], 1
            for d in reversed(self.shape):
                strides.append(acc)
                acc *= d
            strides = tuple(reversed(strides))
        self._strides = tuple(strides)

    def data_ptr(self) -> int:
        return self._addr

    def stride(self) -> tuple[int, ...]:
        return self._strides

    def element_size(self) -> int:
        return self._elem


class Blocks:
    """vLLM's ``KVCacheBlocks`` of one request: the first ``hashed`` are prefix-cache hits."""

    def __init__(self, block_ids: list[int], hashed: int):
        self.block_ids = block_ids
        self.hashed = hashed

    def get_unhashed_block_ids(self) -> list[int]:
        return self.block_ids[self.hashed :]


class Request:
    def __init__(self, client_id: str, request_id: str, prompt_len: int, params: dict | None, max_tokens: int, hit_blocks: int):
        #: The id the client (and the test) names the request by.
        self.client_id = client_id
        #: This engine's own id of it, as vLLM's ``assign_request_id`` makes
        #: one per engine: what the connector sees, never the same on P and D.
        self.request_id = request_id
        self.prompt_token_ids = list(range(prompt_len))
        self.kv_transfer_params = params
        self.status = RequestStatus.WAITING
        self.max_tokens = max_tokens
        self.hit_blocks = hit_blocks
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.hold = False
        self.recompute = False
        self.loaded = False  # KV pulled from the prefill instance


def pattern(request_id: str, logical_block: int, region: int, length: int) -> bytes:
    """The KV bytes a prefill of ``request_id`` computes for one block of one region."""
    seed = hashlib.blake2b(f"{request_id}/{logical_block}/{region}".encode(), digest_size=64).digest()
    return (seed * (length // len(seed) + 1))[:length]


class Instance:
    def __init__(
        self,
        role: str,
        engine_id: str,
        extra_config: dict,
        num_blocks: int = 64,
        block_size: int = 16,
        num_layers: int = 4,
        num_heads: int = 2,
        head_dim: int = 16,
        elem: int = 2,
        vllm_release: str = "0.14.0",
    ):
        behaviour = versions.check(vllm_release, allow_unsupported=False)
        # The connectors of this process run with that release's behaviour.
        versions.current = lambda: behaviour
        self.holds_abandoned_pulls = behaviour.report_abandoned_pulls
        self.block_size = block_size
        self.num_blocks = num_blocks
        kv_transfer_config = SimpleNamespace(
            kv_connector="KvlinkConnector",
            kv_connector_module_path="kvlink_vllm",
            kv_role=role,
            engine_id=engine_id,
            kv_connector_extra_config=extra_config,
        )
        vllm_config = SimpleNamespace(
            kv_transfer_config=kv_transfer_config,
            cache_config=SimpleNamespace(block_size=block_size),
            model_config=SimpleNamespace(use_mla=False),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0, data_parallel_index=0),
        )
        kv_cache_config = SimpleNamespace(num_blocks=num_blocks)
        self.scheduler = KvlinkConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.worker = KvlinkConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)

        # The CPU backend's layout, one memory-mapped tensor per layer:
        # (2, num_blocks, num_heads, block_size, head_dim).
        shape = (2, num_blocks, num_heads, block_size, head_dim)
        size = elem
        for d in shape:
            size *= d
        self._maps = []
        kv_caches = {}
        for layer in range(num_layers):
            mm = mmap.mmap(-1, size)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            self._maps.append(mm)
            kv_caches[f"model.layers.{layer}.self_attn.attn"] = FakeTensor(mm, addr, shape, elem)
        self.worker.register_kv_caches(kv_caches)
        cache = self.worker.connector_worker.layout
        self.regions = [r for _, regions in cache.layers for r in regions]
        self.block_len = cache.block_len

        self.free_blocks = list(range(num_blocks))
        self.requests: dict[str, Request] = {}  # by this engine's own id
        self.internal_ids: dict[str, str] = {}  # client id -> this engine's id
        self.client_ids: dict[str, str] = {}  # this engine's id -> client id
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self.delay_freed: set[str] = set()
        # Aborted while their pull was in flight (later releases): blocks held
        # until the pull is reported.
        self.held_for_pull: set[str] = set()
        self.pulled: set[str] = set()  # requests handed to the worker for a pull vLLM waits for
        self.violations: list[str] = []
        self.step_no = 0

    # ------------------------------------------------------------------ memory

    def _block_addr(self, region: int, block: int) -> int:
        return self.regions[region].addr + block * self.block_len

    def write_kv(self, req: Request, logical_blocks: range) -> None:
        for i in logical_blocks:
            for region in range(len(self.regions)):
                data = pattern(req.client_id, i, region, self.block_len)
                ctypes.memmove(self._block_addr(region, req.block_ids[i]), data, self.block_len)

    def verify(self, request_id: str) -> dict:
        """Compares every byte of the request's blocks with what its prefill computes."""
        req = self.requests[self.internal_ids[request_id]]
        checked, bad = 0, []
        for i, block in enumerate(req.block_ids):
            for region in range(len(self.regions)):
                got = ctypes.string_at(self._block_addr(region, block), self.block_len)
                checked += len(got)
                if got != pattern(request_id, i, region, self.block_len):
                    bad.append([i, region])
        return {"bytes": checked, "bad": bad, "blocks": list(req.block_ids)}

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, prompt_len: int, params: dict | None, max_tokens: int = 1, hit_blocks: int = 0, hold: bool = False):
        internal = f"{request_id}-{secrets.token_hex(4)}"
        self.internal_ids[request_id] = internal
        self.client_ids[internal] = request_id
        req = Request(request_id, internal, prompt_len, params, max_tokens, hit_blocks)
        req.hold = hold
        self.requests[internal] = req
        self.waiting.append(req)

    def _client(self, ids) -> list[str]:
        """Engine ids as the client knows them (vLLM's output processor maps them back)."""
        return sorted(self.client_ids.get(i, i) for i in ids)

    def internal_id(self, request_id: str) -> str:
        """This engine's own id of the client's request (what a prefill
        returns as ``remote_request_id`` once it finishes)."""
        return self.internal_ids[request_id]

    def release(self, request_id: str) -> None:
        self.requests[self.internal_ids[request_id]].hold = False

    def abort(self, request_id: str) -> dict:
        """``Scheduler.finish_requests(..., FINISHED_ABORTED)``."""
        req = self.requests.get(self.internal_ids.get(request_id, ""))
        if req is None or req.status.is_finished():
            return {}
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        hold = (
            self.holds_abandoned_pulls
            and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and req.request_id not in self.finished_recving_kv_req_ids
        )
        self.finished_recving_kv_req_ids.discard(req.request_id)
        self.failed_recving_kv_req_ids.discard(req.request_id)
        req.status = RequestStatus.FINISHED_ABORTED
        return self._free_request(req, hold_for_pull=hold)

    def finish(self, request_id: str) -> dict:
        """A decode ends (stop token)."""
        req = self.requests[self.internal_ids[request_id]]
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        return self._free_request(req)

    def _free_request(self, req: Request, hold_for_pull: bool = False) -> dict:
        delay, params = self.scheduler.request_finished(req, list(req.block_ids))
        self.finished_req_ids.add(req.request_id)
        if delay:
            self.delay_freed.add(req.request_id)
        if hold_for_pull:
            self.held_for_pull.add(req.request_id)
        if not (delay or hold_for_pull):
            self._free_blocks(req)
        return {"delay_free": delay, "kv_transfer_params": params}

    def _free_blocks(self, req: Request) -> None:
        self.free_blocks.extend(req.block_ids)
        req.block_ids = []
        del self.requests[req.request_id]

    # ------------------------------------------------------------------ the step

    def _schedule(self) -> tuple[Any, set[str], list[Request]]:
        # Running requests first (decode, or a prefill still in progress), then waiting ones.
        scheduled: list[Request] = list(self.running)
        for req in list(self.waiting):
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self.finished_recving_kv_req_ids:
                    continue
                self.finished_recving_kv_req_ids.discard(req.request_id)
                if req.request_id in self.failed_recving_kv_req_ids:
                    self.failed_recving_kv_req_ids.discard(req.request_id)
                    req.recompute = True
                    req.num_computed_tokens = 0
                else:
                    req.loaded = True
                    req.num_computed_tokens = min(len(req.block_ids) * self.block_size, len(req.prompt_token_ids)) - 1
                req.status = RequestStatus.WAITING
                self.waiting.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                scheduled.append(req)
                continue
            num_local = req.hit_blocks * self.block_size
            ext, load_async = self.scheduler.get_num_new_matched_tokens(req, num_local)
            total = -(-len(req.prompt_token_ids) // self.block_size)
            need = total - req.hit_blocks
            if need > len(self.free_blocks):
                continue
            hit = [self.free_blocks.pop(0) for _ in range(req.hit_blocks)]
            new = [self.free_blocks.pop(0) for _ in range(need)]
            req.block_ids = hit + new
            # The prefix-cache hit: an earlier request with the same prompt computed these.
            self.write_kv(req, range(req.hit_blocks))
            self.scheduler.update_state_after_alloc(req, Blocks(req.block_ids, req.hit_blocks), ext)
            self.waiting.remove(req)
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.waiting.append(req)
                self.pulled.add(req.request_id)
                continue
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_local + ext
            self.running.append(req)
            scheduled.append(req)
        meta = self.scheduler.build_connector_meta(SimpleNamespace())
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return meta, finished, scheduled

    def step(self) -> dict:
        self.step_no += 1
        meta, finished_req_ids, scheduled = self._schedule()
        # The scheduler output crosses to the worker processes.
        meta = pickle.loads(pickle.dumps(meta))

        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for req in scheduled:  # forward: the prefill computes KV
            if not req.loaded and req.num_computed_tokens < len(req.prompt_token_ids):
                first = req.num_computed_tokens // self.block_size
                self.write_kv(req, range(first, len(req.block_ids)))
                req.num_computed_tokens = len(req.prompt_token_ids)
        w.wait_for_save()
        sending, recving = w.get_finished(finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()
        w.clear_connector_metadata()
        # The stats cross to the scheduler (pickled), which passes their data on.
        stats = pickle.loads(pickle.dumps(stats))

        events = self._update_from_output(sending or set(), recving or set(), invalid, scheduled)
        events["stats"] = stats.data if stats is not None else None
        return events

    def _update_from_output(self, sending: set[str], recving: set[str], invalid: set[int], scheduled) -> dict:
        events: dict[str, Any] = {
            "step": self.step_no,
            "finished_sending": self._client(sending),
            "finished_recving": self._client(recving),
            "invalid_block_ids": sorted(invalid),
            "finished": {},
        }
        if invalid:
            for req in self.waiting:
                if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and set(req.block_ids) & invalid:
                    self.failed_recving_kv_req_ids.add(req.request_id)
            owned = {b for r in self.requests.values() for b in r.block_ids}
            if not invalid <= owned:
                self.violations.append(f"step {self.step_no}: invalid blocks {sorted(invalid - owned)} belong to no request")
        for rid in recving:
            req = self.requests.get(rid)
            if rid in self.held_for_pull:
                # Later releases: the aborted request's blocks are freed now.
                self.held_for_pull.discard(rid)
                self.pulled.discard(rid)
                if rid not in self.delay_freed:
                    self._free_blocks(req)
                continue
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS or rid not in self.pulled:
                self.violations.append(f"step {self.step_no}: finished_recving {rid} is not waiting for remote KV")
            self.pulled.discard(rid)
            self.finished_recving_kv_req_ids.add(rid)
        # As vLLM's scheduler: the connector hears what the workers reported.
        self.scheduler.update_connector_output(SimpleNamespace(finished_sending=sending, finished_recving=recving))
        for rid in sending:
            if rid not in self.requests or rid not in self.delay_freed:
                self.violations.append(f"step {self.step_no}: finished_sending {rid} is not a delay-freed live request")
                continue
            self.delay_freed.discard(rid)
            self._free_blocks(self.requests[rid])
        for req in scheduled:
            if req.hold:
                continue
            req.num_output_tokens += 1
            if req.num_output_tokens >= req.max_tokens:
                self.running.remove(req)
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                events["finished"][req.client_id] = self._free_request(req)
        return events

    def state(self) -> dict:
        return {
            "requests": {r.client_id: r.status.name for r in self.requests.values()},
            "free_blocks": len(self.free_blocks),
            "held_for_pull": sorted(self.client_ids.get(r, r) for r in self.held_for_pull),
            "violations": list(self.violations),
            "transfers_in_progress": self.worker.connector_worker.worker.transfers_in_progress,
            "side_channel_port": self.worker.connector_worker.worker.side_channel_port,
            "recompute": sorted(r.client_id for r in self.requests.values() if r.recompute),
            "live_send_entries": self.scheduler.connector_scheduler._native.live_send_entries,
            "live_transfer_names": self.scheduler.connector_scheduler._native.live_transfer_names,
            "staging": self._stager().state() if self._stager() else None,
            "identity": self.worker.connector_worker.identity,
            "layout": {
                "token_layout": self.worker.connector_worker.layout.token_layout,
                "block_heads": self.worker.connector_worker.layout.block_heads,
            },
        }

    # ------------------------------------------------------------------ host staging

    def _stager(self):
        return self.worker.connector_worker.stager

    def hold_copies(self, held: bool) -> dict:
        """Holds the staging copies un-run (or runs the held ones): a test
        can then end this process mid-copy, or cancel a pull mid-copy."""
        self._stager().hold_copies(held)
        return self._stager().state()

    def fail_copies(self, count: int) -> dict:
        """The next ``count`` staging copies fail as they are launched (a
        copy engine that raises): each fails its request, not the engine."""
        self._stager().fail_copies(count)
        return self._stager().state()

    def metrics(self) -> list:
        """The worker's metric families now (counters since it started)."""
        return self.worker.connector_worker.worker.metrics()

    def blocks_written(self, blocks: list[int]) -> list[int]:
        """Of ``blocks``, those holding any non-zero byte in any region."""
        return [
            b
            for b in blocks
            if any(ctypes.string_at(self._block_addr(r, b), self.block_len).strip(b"\0") for r in range(len(self.regions)))
        ]

    def scribble_free_blocks(self) -> int:
        """Overwrites every free block (what a new request's forward would
        do to blocks the engine got back); returns how many."""
        junk = b"\xa5" * self.block_len
        for block in self.free_blocks:
            for region in range(len(self.regions)):
                ctypes.memmove(self._block_addr(region, block), junk, self.block_len)
        return len(self.free_blocks)

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.requests[self.internal_ids[request_id]].block_ids)
