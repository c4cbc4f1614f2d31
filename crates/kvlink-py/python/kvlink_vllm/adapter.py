"""The connector's logic over duck-typed vLLM objects (no torch, no vllm import).

:class:`SchedulerSide` takes request objects with ``request_id``,
``prompt_token_ids``, ``status`` (an enum with ``.name``, or its name) and
``kv_transfer_params`` (vLLM's dict, updated in place as the reference
does), and block objects with ``get_unhashed_block_ids()``.

:class:`WorkerSide` takes per-layer tensors (see :mod:`kvlink_vllm.layout`)
and the metadata bytes the scheduler side built; a cache outside host
memory (CUDA) moves through host staging (:mod:`kvlink_vllm.staging`).

Both are what :class:`kvlink_vllm.connector.KvlinkConnector` delegates to,
and what tests drive directly.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any, Iterable, Mapping

from . import _native, bootstrap, layout, logs, metrics, staging

logger = logging.getLogger(logs.LOGGER)

#: The request parameter fields kvlink reads; the rest of the dict is left alone.
#: ``remote_request_id`` and ``remote_engine_id`` are what a prefill instance
#: returns about itself (its own id of the request, its engine id): the
#: decode instance names the request to it by them. ``remote_renewal_key``
#: is the request's renewal key: only a decode instance given it can renew
#: the prefill's hold on the request.
PARAM_FIELDS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_engine_id",
    "remote_renewal_key",
    # The bootstrap flow (vLLM's Mooncake deployment since 0.16): the
    # router's id of the request on both instances, and where D learns P.
    "transfer_id",
    "remote_bootstrap_addr",
)


def settings_from_transfer_config(kv_transfer_config: Any) -> _native.Settings:
    """kvlink's settings from vLLM's ``KVTransferConfig`` (or any object with
    ``kv_role``, ``engine_id`` and ``kv_connector_extra_config``)."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    doc = {
        "kv_role": getattr(kv_transfer_config, "kv_role", None),
        "engine_id": getattr(kv_transfer_config, "engine_id", None),
        "kv_connector_extra_config": dict(extra),
    }
    try:
        text = json.dumps(doc)
    except TypeError as e:
        raise _native.ConfigError(f"kv_connector_extra_config is not JSON-serializable: {e}") from e
    settings = _native.Settings(text)
    if settings.ignored_keys:
        logger.info(
            "kvlink ignores these kv_connector_extra_config keys of other vLLM connectors: %s",
            ", ".join(f"{key} ({by})" for key, by in settings.ignored_keys),
        )
    return settings


def default_host() -> str:
    """This host's address when vLLM's ``get_ip`` is not at hand:
    ``VLLM_HOST_IP``, else what the host name resolves to, else loopback.
    Set ``advertised_host`` (or ``VLLM_HOST_IP``) for multi-host deployments."""
    host = os.environ.get("VLLM_HOST_IP", "").strip()
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _status_name(status: Any) -> str:
    return str(getattr(status, "name", status))


def _params_json(params: Any) -> str | None:
    """The fields kvlink reads, as JSON text for the native scheduler.

    ``kv_transfer_params`` come from the client: anything that is not a
    mapping of JSON values is passed on as a value the native side refuses
    (the request is then served locally, with a warning), never raised here.
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        return json.dumps(f"<{type(params).__name__}>")
    try:
        return json.dumps({k: params[k] for k in PARAM_FIELDS if k in params})
    except (TypeError, ValueError):
        return json.dumps("<kv_transfer_params that are not JSON>")


def _prompt_len(request: Any) -> int:
    return len(getattr(request, "prompt_token_ids", None) or [])


class SchedulerSide:
    """vLLM's scheduler-side connector methods over kvlink's scheduler."""

    def __init__(
        self,
        settings: _native.Settings,
        host: str,
        dp_rank: int = 0,
        tp_size: int = 1,
        pp_size: int = 1,
        block_size: int = 0,
    ):
        self.settings = settings
        # The base port of this data-parallel rank: every stage's workers
        # listen from it (pp_rank * tp_size + tp_rank). The block size cuts
        # the engine's block lists to the prompt's blocks.
        self._native = _native.Scheduler(settings, host, dp_rank, tp_size, pp_size, block_size)

    @property
    def host(self) -> str:
        return self._native.host

    @property
    def port(self) -> int:
        return self._native.port

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._native.get_num_new_matched_tokens(
            request.request_id,
            _prompt_len(request),
            _params_json(request.kv_transfer_params),
            num_computed_tokens,
        )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        unhashed = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
        clear = self._native.update_state_after_alloc(
            request.request_id, _prompt_len(request), _params_json(params), unhashed, num_external_tokens
        )
        if clear:
            # Only one transfer per request, as the reference does to vLLM's
            # dict (clear is only ever set for a dict the native side parsed).
            params["do_remote_prefill"] = False

    def build_connector_meta(self) -> bytes:
        return self._native.build_connector_meta()

    def update_connector_output(self, connector_output: Any) -> None:
        """The requests the workers reported sent (vLLM's
        ``finished_sending``): the transfer ids naming them are free again."""
        sent = getattr(connector_output, "finished_sending", None)
        if sent:
            self._native.sending_finished([str(r) for r in sent])

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        delay, out, clear = self._native.request_finished(
            request.request_id,
            _prompt_len(request),
            _status_name(request.status),
            _params_json(params),
            list(block_ids),
        )
        if clear:
            params["do_remote_prefill"] = False
        return delay, (json.loads(out) if out is not None else None)


class WorkerSide:
    """vLLM's worker-side connector methods over a kvlink worker.

    The worker starts in :meth:`register_kv_caches` (vLLM calls it once the
    cache is allocated); the tensors stay referenced until :meth:`shutdown`.
    With host staging (``host_staging``: a CUDA cache, or any with
    "always"), the native worker registers the staging and :attr:`stager`
    runs the copies between the cache and it.
    """

    def __init__(
        self,
        settings: _native.Settings,
        host: str,
        block_size: int,
        use_mla: bool = False,
        num_blocks: int | None = None,
        dp_rank: int = 0,
        tp_size: int = 1,
        tp_rank: int = 0,
        report_abandoned_pulls: bool = False,
        identity: Mapping[str, Any] | None = None,
        pp_size: int = 1,
        pp_rank: int = 0,
        bootstrap_placement: bootstrap.Placement | None = None,
    ):
        self.settings = settings
        #: Where a prefill worker registers with its instance's bootstrap
        #: server (``None``: it does not).
        self.bootstrap_placement = bootstrap_placement
        self._registrar: bootstrap.Registrar | None = None
        #: What must agree with the peer instance (see ``connector.model_identity``).
        self.identity = dict(identity or {})
        self.report_abandoned_pulls = report_abandoned_pulls
        self.host = host
        self.block_size = block_size
        self.use_mla = use_mla
        self.num_blocks = num_blocks
        self.dp_rank, self.tp_size, self.tp_rank = dp_rank, tp_size, tp_rank
        self.pp_size, self.pp_rank = pp_size, pp_rank
        self.layout: layout.CacheLayout | None = None
        self._worker: _native.Worker | None = None
        #: The copies between the cache and the staging (staged only).
        self.stager: staging.Stager | None = None
        self._load_errors: set[int] = set()
        #: This worker's name in connector stats (its gauges are kept per worker).
        self.stats_key = f"{dp_rank}.{tp_rank}" if pp_size == 1 else f"{dp_rank}.{pp_rank}.{tp_rank}"
        self._stats_seq = 0

    @property
    def worker(self) -> _native.Worker:
        if self._worker is None:
            raise _native.KvlinkError("kvlink worker not started: register_kv_caches was not called")
        return self._worker

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        if self._worker is not None:
            raise _native.KvlinkError("register_kv_caches called twice")
        staged = staging.should_stage(kv_caches, self.settings.host_staging, self.settings.protocol)
        cache = layout.describe(kv_caches, self.block_size, self.use_mla, self.num_blocks)
        self.layout = cache
        if cache.attention_layout and not cache.token_layout and self.identity:
            # What P and D compare at connect (the model's identity, when
            # the engine declares one), only where blocks are copied whole:
            # a declared token order is mapped to the peer's at the hello
            # (NHD against HND), so it need not agree.
            self.identity["attention_layout"] = cache.attention_layout
        copier = None
        if staged:
            plan = staging.plan(cache, self.settings.staging_bytes)
            copier = staging.copier_for(kv_caches, cache, plan)
            layers = plan.native_layers(cache, copier.bases)
            # The worker moves the staging; the cache's tensors stay alive
            # with it too (the copies use them until it stopped).
            keepalive: Any = {"kv_caches": dict(kv_caches), "staging": copier.keepalive}
        else:
            layers = cache.native_layers()
            # The tensors are handed over as their owner: the native worker
            # keeps them alive until it has stopped touching their memory.
            keepalive = dict(kv_caches)
        try:
            self._worker = _native.Worker(
                self.settings,
                self.host,
                cache.kind,
                self.block_size,
                layers,
                keepalive,
                self.dp_rank,
                self.tp_size,
                self.tp_rank,
                self.report_abandoned_pulls,
                staged,
                json.dumps(self.identity) if self.identity else None,
                self.pp_size,
                self.pp_rank,
                cache.block_heads,
                cache.token_layout,
                cache.dtype_bytes,
            )
        except BaseException:
            if copier is not None:
                copier.release()  # nothing registered the staging with a transport
            raise
        if self.bootstrap_placement is not None and self._worker.side_channel_port is not None:
            # Before the engine serves: a router reads the server once all
            # workers are listed, and vLLM waits for register_kv_caches.
            try:
                self._registrar = bootstrap.Registrar(self.settings, self.bootstrap_placement, self.tp_size, self.pp_size)
                self._registrar.register(self.tp_rank, self.pp_rank, self.host, self._worker.side_channel_port)
            except BaseException:
                self.shutdown()
                if copier is not None:
                    copier.release()
                raise
        if copier is not None:
            self.stager = staging.Stager(self._worker, copier)
            logger.info(
                "kvlink host staging: %d slots (%d tokens per transfer at most) of %d bytes, %s host memory (%s copies)",
                plan.slots,
                plan.slots * self.block_size,
                plan.total_bytes,
                "pinned" if copier.pinned else "pageable",
                copier.kind,
            )
        logger.info(
            "kvlink worker started: role=%s protocol=%s layout=%s order=%s heads=%d tp=%d/%d pp=%d/%d regions=%d block_len=%d staged=%s side_channel_port=%s data=%s",
            self.settings.role,
            self.settings.protocol,
            cache.kind,
            cache.token_layout or "whole blocks",
            cache.block_heads,
            self.tp_rank,
            self.tp_size,
            self.pp_rank,
            self.pp_size,
            sum(len(r) for _, r in cache.layers),
            cache.block_len,
            staged,
            self._worker.side_channel_port,
            self._worker.data_endpoint,
        )

    def start_load_kv(self, payload: bytes) -> None:
        worker = self.worker
        if self.stager is not None:
            self.stager.start_load_kv(payload)
        else:
            worker.start_load_kv(payload)

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self.worker
        if self.stager is not None:
            sending, recving = self.stager.get_finished(list(finished_req_ids))
        else:
            sending, recving = worker.get_finished(list(finished_req_ids))
        self._load_errors.update(worker.take_load_errors())
        return (set(sending) or None), (set(recving) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The data of what the worker counted since the previous call (see
        :mod:`kvlink_vllm.metrics`), or None if nothing changed. Never
        raises: metrics must not fail a step."""
        if self._worker is None:
            return None
        try:
            families = self._worker.metrics_since_last()
        except Exception as e:  # noqa: BLE001 - the step goes on without stats
            metrics.warnings.warning("worker-stats", "kvlink: worker metrics not read: %r", e)
            return None
        if families is None:
            return None
        self._stats_seq += 1
        return metrics.interval(families, self.stats_key, self._stats_seq, self.settings.role)

    def shutdown(self) -> None:
        registrar, self._registrar = self._registrar, None
        if registrar is not None:
            registrar.stop()
        worker, self._worker = self._worker, None
        stager, self.stager = self.stager, None
        if stager is not None:
            stager.stop()
        stopped = worker.shutdown() if worker is not None else True
        if not stopped:
            logger.error("kvlink worker did not stop in time; its KV cache memory stays allocated")
        if stager is not None:
            stager.close(worker_stopped=stopped)
