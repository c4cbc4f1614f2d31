"""Which of vLLM's KV-connector unit tests (``tests/v1/kv_connector/unit/``
of each release's source distribution) run against ``KvlinkConnector``,
and why the others do not. Read by ``kvlink_unit_plugin``: a file of the
directory neither run nor given a reason in ``NOT_RUN``, a run file the
release lacks, or a deselected test that does not exist is an error, so
nothing is skipped silently.

The files run are those that drive vLLM's real ``Scheduler`` and
``KVCacheManager`` through a P/D connector built by their ``utils.py``
helpers (NIXL's, replaced by kvlink's); the files not run test other
connectors' own classes, or vLLM parts without a connector under test.
Why a file is not run is declared once, in ``NOT_RUN``, for every release
whose directory has it; each release lists only its run files and
deselected tests.

Every x.y.0 release from 0.14.0 to 0.34.0 is here; 0.15.0, which has no
source distribution, runs 0.14.0's tests (``vllm_sdist.TESTS_FROM``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Release:
    #: Test files run with the NIXL connector of their helpers replaced by kvlink.
    run: tuple[str, ...]
    #: Tests of those files not run, by node id within the file
    #: (``file.py::test`` for every parameter, or ``file.py::test[param]``): the reason.
    deselected: dict[str, str] = field(default_factory=dict)

    def not_run(self, present: Iterable[str]) -> dict[str, str]:
        """The files of ``present`` (the release's directory, see
        :func:`files`) not run, with their reasons from ``NOT_RUN``; a file
        neither run nor in ``NOT_RUN`` is left out (the plugin's error)."""
        return {name: NOT_RUN[name] for name in sorted(present) if name in NOT_RUN and name not in self.run}


def files(unit_dir: Path) -> set[str]:
    """What the manifest accounts for in a release's unit directory: its
    ``test_*.py`` files and its subdirectories (named with a trailing ``/``)."""
    names = {p.name for p in unit_dir.iterdir() if p.name.startswith("test_") and p.suffix == ".py"}
    names |= {p.name + "/" for p in unit_dir.iterdir() if p.is_dir() and not p.name.startswith("__")}
    return names


#: The scheduler-side P/D contract: vLLM's Scheduler and KVCacheManager
#: driven with simulated worker reports, the connector in between.
SCHEDULER_CONTRACT = (
    "test_remote_prefill_lifecycle.py",
    "test_remote_decode_lifecycle.py",
    "test_kv_load_failure_recovery.py",
    "test_invalid_blocks_correctness.py",
    "test_error_propagation.py",
    "test_cache_pollution_prevention.py",
    "test_config.py",
)
#: The connector's metadata bound and cleared by the model runner's mixin
#: (the file's name until 0.17, and from 0.18 until 0.33; 0.34 dropped it
#: with the mixin's no-forward path).
LIFECYLE = "test_kv_connector_lifecyle.py"
LIFECYCLE = "test_kv_connector_lifecycle.py"

REMOTE_BLOCK_IDS = (
    "asserts NIXL's remote_block_ids in the params a finished prefill returns: kvlink's decode "
    "instance pulls by the prefill's request id, and the prefill returns no block ids"
)
NO_HMA = (
    "needs the hybrid KV cache manager (several KV cache groups: sliding window or Mamba): kvlink "
    "does not implement SupportsHMA, and vLLM refuses a non-HMA connector there"
)
MODULE_PATH_FIRST = (
    "points the config create_vllm_config made at TestExampleConnector by setting kv_connector alone, so "
    "the kv_connector_module_path kvlink_unit_plugin gave it (kvlink_vllm) stays; this release's factory "
    "loads a module path before its registry and finds no TestExampleConnector in kvlink_vllm (the test "
    "does not involve kvlink)"
)

NIXL = "tests NixlConnector's own classes (its worker, handshake, metadata or transfer plans), not a connector contract"
OTHER = "tests {}'s own classes, not a connector contract kvlink implements"
NO_CONNECTOR = "tests {} alone; no P/D connector is under test"

#: Why each file (a directory ends in ``/``) that no release runs is not
#: run, for every release whose directory has it.
NOT_RUN = {
    "offloading_connector/": OTHER.format("OffloadingConnector"),
    "test_backwards_compatibility.py": NO_CONNECTOR.format(
        "the factory's handling of connectors with the old constructor signature (its own test connectors)"
    ),
    "test_bidirectional_kv_transfer.py": NIXL + " (P pulling from D by remote_block_ids)",
    "test_decode_bench_connector.py": OTHER.format("DecodeBenchConnector"),
    "test_example_connector.py": OTHER.format("ExampleConnector"),
    "test_flexkv_connector.py": OTHER.format("FlexKVConnectorV1"),
    "test_handshake_pp_aggregation.py": NO_CONNECTOR.format(
        "the engine core's handshake-metadata plumbing (kvlink has no handshake metadata)"
    ),
    "test_hf3fs_client.py": OTHER.format("the HF3FS connector"),
    "test_hf3fs_connector.py": OTHER.format("the HF3FS connector"),
    "test_hf3fs_metadata_server.py": OTHER.format("the HF3FS connector"),
    "test_hidden_states_connector.py": OTHER.format("ExampleHiddenStatesConnector"),
    "test_hisparse_connector.py": OTHER.format("the HiSparse connector"),
    "test_hisparse_stats.py": OTHER.format("the HiSparse connector"),
    "test_hma_auto_config.py": NO_CONNECTOR.format(
        "the hybrid manager's auto-disable with MultiConnector and ExampleConnector"
    ),
    "test_kv_cache_layout.py": NO_CONNECTOR.format(
        "the attention backends' KV cache stride orders (the cross-layer layout)"
    ),
    "test_lmcache_connector.py": OTHER.format("LMCacheConnector"),
    "test_lmcache_integration.py": OTHER.format("LMCacheConnector"),
    "test_mooncake_connector.py": OTHER.format("vLLM's MooncakeConnector (it needs the mooncake engine)"),
    "test_mooncake_connector_hma.py": OTHER.format("vLLM's MooncakeConnector (HMA)"),
    "test_mooncake_connector_hybrid_mamba.py": OTHER.format("vLLM's MooncakeConnector (hybrid Mamba)"),
    "test_mooncake_proxy.py": NO_CONNECTOR.format("the Mooncake example's proxy server (examples/, not extracted)"),
    "test_mooncake_stats.py": OTHER.format("vLLM's MooncakeConnector (its stats)"),
    "test_mooncake_store_cache_prefix.py": OTHER.format("MooncakeStoreConnector"),
    "test_mooncake_store_connector.py": OTHER.format("MooncakeStoreConnector"),
    "test_mooncake_store_coordinator.py": OTHER.format("MooncakeStoreConnector"),
    "test_mooncake_store_hma_e2e.py": OTHER.format("MooncakeStoreConnector"),
    "test_mooncake_store_layout.py": OTHER.format("MooncakeStoreConnector"),
    "test_mooncake_store_lookup.py": OTHER.format("MooncakeStoreConnector"),
    "test_mooncake_store_prepare_values.py": OTHER.format("MooncakeStoreConnector"),
    "test_mooncake_store_scheduler.py": OTHER.format("MooncakeStoreConnector"),
    "test_mooncake_store_worker.py": OTHER.format("MooncakeStoreConnector"),
    "test_moriio_connector.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_hetero_tp_write.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_hma_scheduler.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_kv_layout.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_proxy_routing.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_read_tp.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_routing.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_routing_fairness.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_toy_proxy_server.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_tp_ack.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_tp_mapping.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_transfer_completion.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_unmap.py": OTHER.format("MoRIIOConnector"),
    "test_moriio_write_done_routing.py": OTHER.format("MoRIIOConnector"),
    "test_multi_connector.py": OTHER.format("MultiConnector (over NIXL and example connectors)"),
    "test_nixl_connector.py": NIXL,
    "test_nixl_connector_hma.py": NIXL,
    "test_nixl_desc_geometry.py": NIXL,
    "test_nixl_heartbeat.py": NIXL,
    "test_nixl_push_connector.py": NIXL,
    "test_nixl_rocm_gpu_mem_diag.py": NIXL,
    "test_nixl_simple_cpu_offload.py": NIXL,
    "test_offloading_connector.py": OTHER.format("OffloadingConnector"),
    "test_output_aggregator.py": NO_CONNECTOR.format("KVOutputAggregator"),
    "test_rixl_gpu_mem_diag.py": OTHER.format("RixlConnector (GPU memory after its shutdown, ROCm only)"),
    "test_scheduler_kv_connector_override.py": NO_CONNECTOR.format(
        "the scheduler's connector override plugin (its own DummyKVConnector)"
    ),
    "test_simple_cpu_offload_connector.py": OTHER.format("SimpleCPUOffloadConnector"),
    "test_simple_cpu_offload_metrics.py": OTHER.format("SimpleCPUOffloadConnector"),
    "test_tp_mapping.py": NIXL,
    "test_transfer_topology_sharded.py": NO_CONNECTOR.format("TransferTopology (NIXL's transfer plans)"),
    "test_umbp_async_lookup.py": OTHER.format("UMBPStoreConnector (ROCm with mori only)"),
    "test_umbp_core.py": OTHER.format("UMBPStoreConnector (ROCm with mori only)"),
    "test_umbp_embedded.py": OTHER.format("UMBPStoreConnector (ROCm with mori only)"),
    "test_umbp_events.py": OTHER.format("UMBPStoreConnector (ROCm with mori only)"),
    "test_umbp_hybrid.py": OTHER.format("UMBPStoreConnector (ROCm with mori only)"),
    "test_umbp_standalone.py": OTHER.format("UMBPStoreConnector (ROCm only)"),
}

#: Deselections, by the releases whose files have the tests.
DECODE_BLOCK_IDS = {  # every release
    "test_remote_decode_lifecycle.py::test_short_prompt_lifecycle": REMOTE_BLOCK_IDS,
    "test_remote_decode_lifecycle.py::test_prefix_cache_lifecycle": REMOTE_BLOCK_IDS,
}
MAMBA_PREFILL = {  # from 0.19
    "test_remote_prefill_lifecycle.py::test_p_side_chunked_prefill_mamba": NO_HMA,
}
HYBRID_RESERVATIONS = {  # from 0.32 (0.31's promotion-margin test has one group and no hybrid manager)
    "test_remote_prefill_lifecycle.py::test_async_load_reserves_blocks_for_promotion_margin": NO_HMA
    + " (every case turns the hybrid manager on)",
    "test_remote_prefill_lifecycle.py::test_async_load_does_not_double_reserve_mamba_spec_blocks": NO_HMA,
}
RETARGETED_LIFECYCLE = {  # 0.20 and 0.21 (0.22 names the connector to create_vllm_config)
    LIFECYCLE + "::test_kv_connector_mixin_clears_metadata": MODULE_PATH_FIRST,
}

RELEASES: dict[str, Release] = {
    "0.14.0": Release(run=SCHEDULER_CONTRACT + (LIFECYLE,), deselected=DECODE_BLOCK_IDS),
    # 0.15.0 runs 0.14.0's tests (vllm_sdist.TESTS_FROM: it has no source distribution).
    "0.15.0": Release(run=SCHEDULER_CONTRACT + (LIFECYLE,), deselected=DECODE_BLOCK_IDS),
    "0.16.0": Release(run=SCHEDULER_CONTRACT + (LIFECYLE,), deselected=DECODE_BLOCK_IDS),
    "0.17.0": Release(run=SCHEDULER_CONTRACT + (LIFECYLE,), deselected=DECODE_BLOCK_IDS),
    "0.18.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected=DECODE_BLOCK_IDS),
    "0.19.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.20.0": Release(
        run=SCHEDULER_CONTRACT + (LIFECYCLE,),
        deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL, **RETARGETED_LIFECYCLE},
    ),
    "0.21.0": Release(
        run=SCHEDULER_CONTRACT + (LIFECYCLE,),
        deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL, **RETARGETED_LIFECYCLE},
    ),
    "0.22.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.23.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.24.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.25.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.26.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.27.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.28.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.29.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.30.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.31.0": Release(run=SCHEDULER_CONTRACT + (LIFECYCLE,), deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL}),
    "0.32.0": Release(
        run=SCHEDULER_CONTRACT + (LIFECYCLE,),
        deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL, **HYBRID_RESERVATIONS},
    ),
    "0.33.0": Release(
        run=SCHEDULER_CONTRACT + (LIFECYCLE,),
        deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL, **HYBRID_RESERVATIONS},
    ),
    "0.34.0": Release(run=SCHEDULER_CONTRACT, deselected={**DECODE_BLOCK_IDS, **MAMBA_PREFILL, **HYBRID_RESERVATIONS}),
}


def _check() -> None:
    """What the manifest itself must keep: no file both run and given a
    reason not to be, and every deselected test in a file the release runs."""
    for release, manifest in RELEASES.items():
        both = set(manifest.run) & set(NOT_RUN)
        if both:
            raise ValueError(f"unit_manifest: vLLM {release} runs files NOT_RUN gives a reason for: {sorted(both)}")
        stray = {name for name in manifest.deselected if name.split("::", 1)[0] not in manifest.run}
        if stray:
            raise ValueError(f"unit_manifest: vLLM {release} deselects tests of files it does not run: {sorted(stray)}")


_check()
