"""``KvlinkConnector``: the class vLLM loads with
``{"kv_connector": "KvlinkConnector", "kv_connector_module_path": "kvlink_vllm"}``.

It subclasses vLLM's ``KVConnectorBase_V1`` when vLLM is importable (else a
stand-in with the same worker-side plumbing, so the class can be exercised
without vLLM) and delegates to :mod:`kvlink_vllm.adapter`.

The name must not be ``MooncakeConnector``: vLLM's factory looks names up in
its own registry before ``kv_connector_module_path``.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import TYPE_CHECKING, Any, Optional

from . import adapter, bootstrap, logs, stats, versions

try:  # vLLM present: subclass its real base classes.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    HAVE_VLLM = True
except ImportError:  # Without vLLM: stand-ins, for tests and tools.
    HAVE_VLLM = False

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorMetadata``."""

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorRole``."""

        SCHEDULER = 0
        WORKER = 1

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorBase_V1``: the constructor and the
        metadata binding the model runner uses."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            if getattr(vllm_config, "kv_transfer_config", None) is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None


if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvlinkConnectorMetadata(KVConnectorMetadata):
    """One step's metadata: opaque bytes built by kvlink's scheduler (JSON of
    the scheduler's ``ConnectorMetadata`` and the notify-only pulls). Pickles
    as a plain bytes attribute."""

    def __init__(self, payload: bytes = b""):
        self.payload = payload

    def decoded(self) -> dict[str, Any]:
        """The payload as a dict (for logs and tests)."""
        return json.loads(self.payload) if self.payload else {}

    def __repr__(self) -> str:
        return f"KvlinkConnectorMetadata({len(self.payload)} bytes)"


def _is_scheduler(role: Any) -> bool:
    return getattr(role, "name", str(role)) == "SCHEDULER"


def _host() -> str:
    if HAVE_VLLM:
        from vllm.utils.network_utils import get_ip

        return get_ip()
    return adapter.default_host()


def _tp(vllm_config: Any) -> tuple[int, int]:
    """(tp_size, tp_rank) of this process."""
    parallel = getattr(vllm_config, "parallel_config", None)
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    if HAVE_VLLM:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            return tp_size, int(get_tensor_model_parallel_rank())
        except AssertionError:  # no tensor-parallel group: a single worker
            return tp_size, 0
    return tp_size, int(getattr(parallel, "tensor_parallel_rank", 0) or 0)


def _pp(vllm_config: Any) -> tuple[int, int]:
    """(pp_size, pp_rank) of this process: its pipeline stage holds its
    share of the layers, and its worker pulls them from the same stage of
    the prefill instance."""
    parallel = getattr(vllm_config, "parallel_config", None)
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if HAVE_VLLM and pp_size > 1:
        from vllm.distributed.parallel_state import get_pp_group

        try:
            return pp_size, int(get_pp_group().rank_in_group)
        except AssertionError:  # no pipeline group: a single stage
            return pp_size, 0
    return pp_size, int(getattr(parallel, "pipeline_parallel_rank", 0) or 0)


def _text(value: Any) -> str:
    text = "" if value is None else str(value)
    return text.removeprefix("torch.")


def _number(get: Any) -> int:
    try:
        value = get() if callable(get) else get
        return int(value or 0)
    except Exception:  # an attribute this release or model lacks: undeclared
        return 0


def _model_name(hf_config: Any) -> str:
    """The architecture's class names (``Qwen2ForCausalLM``), else its
    ``model_type``; empty where the config says neither."""
    try:
        architectures = getattr(hf_config, "architectures", None) or []
        name = ",".join(str(a) for a in architectures)
        return name or _text(getattr(hf_config, "model_type", ""))
    except Exception:  # a config this release shapes otherwise: undeclared
        return ""


def model_identity(vllm_config: Any) -> dict[str, Any]:
    """What must agree between this instance and its peers for KV to mean
    the same (kv-proto's ``ModelIdentity``): P refuses a decode instance
    that differs in any of it at connect, naming both values. What cannot
    be read is left empty (0), and is then not compared."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    config_hash = ""
    hf_config = getattr(model, "hf_config", None)
    if hf_config is not None and hasattr(hf_config, "to_json_string"):
        try:
            doc = json.loads(hf_config.to_json_string(use_diff=False))
            # Where the checkpoint lives is not what it is: the same model
            # mounted at another path on P and D must agree.
            for key in ("_name_or_path", "name_or_path", "transformers_version"):
                doc.pop(key, None)
            text = json.dumps(doc, sort_keys=True)
            config_hash = hashlib.sha256(text.encode()).hexdigest()[:16]
        except Exception:  # a config that does not serialize: undeclared
            config_hash = ""
    text_config = getattr(model, "hf_text_config", None)
    engine_version = ""
    if HAVE_VLLM:
        import vllm

        engine_version = _text(getattr(vllm, "__version__", ""))
    return {
        # What the model is, not where it lives or what it is served as: a
        # path and a served name differ between hosts that run one model.
        "model": _model_name(hf_config),
        "config_hash": config_hash,
        "kv_dtype": _text(getattr(model, "dtype", "")),
        "cache_dtype": _text(getattr(cache, "cache_dtype", "")),
        "num_layers": _number(getattr(text_config, "num_hidden_layers", 0)),
        "num_kv_heads": _number(getattr(model, "get_total_num_kv_heads", 0)),
        "head_size": _number(getattr(model, "get_head_size", 0)),
        # Filled from the cache's strides once it is registered.
        "attention_layout": "",
        "tp_size": _number(getattr(parallel, "tensor_parallel_size", 0)),
        "pp_size": _number(getattr(parallel, "pipeline_parallel_size", 0)),
        "engine_version": engine_version,
        "kvlink_version": "",
    }


def _dp_rank(vllm_config: Any) -> int:
    parallel = getattr(vllm_config, "parallel_config", None)
    index = getattr(parallel, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel, "data_parallel_rank", 0)
    return int(index or 0)


class KvlinkConnector(KVConnectorBase_V1):
    """kvlink as a vLLM v1 KV connector (P/D disaggregation, MooncakeConnector's protocol roles)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: "KVConnectorRole",
        kv_cache_config: Optional["KVCacheConfig"] = None,
    ):
        # Before anything logs: the package's lines join vLLM's log.
        logs.follow_vllm()
        # The installed release's contract, chosen once per process.
        behaviour = versions.current()
        self.behaviour = behaviour
        super().__init__(vllm_config, role, kv_cache_config)
        if HAVE_VLLM and behaviour.cache_hit_source is not None:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource

            # What vLLM's prefix-cache metrics call kvlink's hits: KV pulled
            # from a peer instance.
            self._cache_hit_source = CacheHitSource[behaviour.cache_hit_source]
        settings = adapter.settings_from_transfer_config(vllm_config.kv_transfer_config)
        self.settings = settings
        tp_size, tp_rank = _tp(vllm_config)
        pp_size, pp_rank = _pp(vllm_config)
        # This host's address is only looked up when none is configured.
        host = settings.advertised_host or _host()
        self.connector_scheduler: adapter.SchedulerSide | None = None
        self.connector_worker: adapter.WorkerSide | None = None
        if _is_scheduler(role):
            self.connector_scheduler = adapter.SchedulerSide(
                settings, host, _dp_rank(vllm_config), tp_size, pp_size, int(vllm_config.cache_config.block_size)
            )
        else:
            cache_config = vllm_config.cache_config
            model_config = getattr(vllm_config, "model_config", None)
            self.connector_worker = adapter.WorkerSide(
                settings,
                host,
                block_size=int(cache_config.block_size),
                use_mla=bool(getattr(model_config, "use_mla", False)),
                num_blocks=getattr(kv_cache_config, "num_blocks", None),
                dp_rank=_dp_rank(vllm_config),
                tp_size=tp_size,
                tp_rank=tp_rank,
                pp_size=pp_size,
                pp_rank=pp_rank,
                report_abandoned_pulls=behaviour.report_abandoned_pulls,
                identity=model_identity(vllm_config),
                bootstrap_placement=(
                    bootstrap.placement(vllm_config, tp_rank, pp_rank, settings)
                    if settings.role != "kv_consumer"
                    else None
                ),
            )

    def _scheduler(self) -> adapter.SchedulerSide:
        if self.connector_scheduler is None:
            raise RuntimeError("scheduler-side method called on a worker-side KvlinkConnector")
        return self.connector_scheduler

    def _worker(self) -> adapter.WorkerSide:
        if self.connector_worker is None:
            raise RuntimeError("worker-side method called on a scheduler-side KvlinkConnector")
        return self.connector_worker

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvlinkConnectorMetadata:
        return KvlinkConnectorMetadata(self._scheduler().build_connector_meta())

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        self._scheduler().update_connector_output(connector_output)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """(Later releases.) A pull restores the request's own blocks in
        every group that takes part in transfers, not only the
        prefix-cacheable ones the base class assumes."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    # ---------------------------------------------------------------- memory

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """(0.33 and later.) No: sleep mode unmaps the KV cache while a pull
        may still be landing in it or a staging copy reading it, and kvlink
        does not fence its transfers and copies on vLLM's unregister hook,
        so vLLM refuses ``--enable-sleep-mode`` at start-up, naming kvlink,
        instead of letting a late byte fault the device."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """(0.34 and later.) In-process access only: a device cache is read
        and written by torch copies into kvlink's pinned host staging, and
        only host memory is ever registered with a transport, so the
        extensible KV cache may allocate the device cache however it likes."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.IN_PROCESS

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvlinkConnectorMetadata):
            raise TypeError(f"KvlinkConnector got {type(meta).__name__} metadata; the scheduler must run KvlinkConnector too")
        self._worker().start_load_kv(meta.payload)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Pulls land between steps, not layer by layer: nothing to wait for."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: "torch.Tensor",
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        """The decode side pulls from the cache itself: nothing to save."""

    def wait_for_save(self):
        """Nothing is saved per layer: nothing to wait for."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ---------------------------------------------------------------- metrics

    def get_kv_connector_stats(self) -> Optional[stats.KvlinkConnectorStats]:
        """Worker side: what the kvlink worker counted since the previous
        step (None if nothing changed); the scheduler side has none."""
        if self.connector_worker is None:
            return None
        data = self.connector_worker.get_kv_connector_stats()
        return stats.KvlinkConnectorStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> stats.KvlinkConnectorStats:
        """The stats of ``data`` (what crossed from the engine to the process
        that logs), or empty ones."""
        return stats.build(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> stats.KvlinkPromMetrics:
        """kvlink's metrics as ``vllm:kvlink_<name>`` on the engine's ``/metrics``."""
        return stats.KvlinkPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
