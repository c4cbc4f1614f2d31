"""Which of vLLM's KV-connector unit tests (``tests/v1/kv_connector/unit/``
of each release's source distribution) run against ``KvlinkConnector``,
and why the others do not. Read by ``kvlink_unit_plugin``: a file of the
directory missing here, a listed file the release lacks, or a deselected
test that does not exist is an error, so nothing is skipped silently.

The files run are those that drive vLLM's real ``Scheduler`` and
``KVCacheManager`` through a P/D connector built by their ``utils.py``
helpers (NIXL's, replaced by kvlink's); the files not run test other
connectors' own classes, or vLLM parts without a connector under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Release:
    #: Test files run with the NIXL connector of their helpers replaced by kvlink.
    run: tuple[str, ...]
    #: Tests of those files not run, by node id within the file
    #: (``file.py::test`` for every parameter, or ``file.py::test[param]``): the reason.
    deselected: dict[str, str] = field(default_factory=dict)
    #: Files (a directory ends in ``/``) not run at all: the reason.
    not_run: dict[str, str] = field(default_factory=dict)


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

REMOTE_BLOCK_IDS = (
    "asserts NIXL's remote_block_ids in the params a finished prefill returns: kvlink's decode "
    "instance pulls by the prefill's request id, and the prefill returns no block ids"
)
NO_HMA = (
    "needs the hybrid KV cache manager (several KV cache groups: sliding window or Mamba): kvlink "
    "does not implement SupportsHMA, and vLLM refuses a non-HMA connector there"
)

NIXL = "tests NixlConnector's own classes (its worker, handshake, metadata or transfer plans), not a connector contract"
OTHER = "tests {}'s own classes, not a connector contract kvlink implements"
NO_CONNECTOR = "tests {} alone; no P/D connector is under test"

COMMON_NOT_RUN = {
    "test_decode_bench_connector.py": OTHER.format("DecodeBenchConnector"),
    "test_example_connector.py": OTHER.format("ExampleConnector"),
    "test_lmcache_connector.py": OTHER.format("LMCacheConnector"),
    "test_lmcache_integration.py": OTHER.format("LMCacheConnector"),
    "test_moriio_connector.py": OTHER.format("MoRIIOConnector"),
    "test_multi_connector.py": OTHER.format("MultiConnector (over NIXL and example connectors)"),
    "test_nixl_connector.py": NIXL,
    "test_offloading_connector.py": OTHER.format("OffloadingConnector"),
    "test_output_aggregator.py": NO_CONNECTOR.format("KVOutputAggregator"),
}

RELEASES: dict[str, Release] = {
    "0.14.0": Release(
        run=SCHEDULER_CONTRACT + ("test_kv_connector_lifecyle.py",),
        deselected={
            "test_remote_decode_lifecycle.py::test_short_prompt_lifecycle": REMOTE_BLOCK_IDS,
            "test_remote_decode_lifecycle.py::test_prefix_cache_lifecycle": REMOTE_BLOCK_IDS,
        },
        not_run={
            **COMMON_NOT_RUN,
            "test_backwards_compatibility.py": NO_CONNECTOR.format(
                "the factory's handling of connectors with the old constructor signature (its own test connectors)"
            ),
        },
    ),
    "0.32.0": Release(
        run=SCHEDULER_CONTRACT + ("test_kv_connector_lifecycle.py",),
        deselected={
            "test_remote_decode_lifecycle.py::test_short_prompt_lifecycle": REMOTE_BLOCK_IDS,
            "test_remote_decode_lifecycle.py::test_prefix_cache_lifecycle": REMOTE_BLOCK_IDS,
            "test_remote_prefill_lifecycle.py::test_p_side_chunked_prefill_mamba": NO_HMA,
            "test_remote_prefill_lifecycle.py::test_async_load_reserves_blocks_for_promotion_margin": NO_HMA
            + " (every case turns the hybrid manager on)",
            "test_remote_prefill_lifecycle.py::test_async_load_does_not_double_reserve_mamba_spec_blocks": NO_HMA,
        },
        not_run={
            **COMMON_NOT_RUN,
            "offloading_connector/": OTHER.format("OffloadingConnector"),
            "test_bidirectional_kv_transfer.py": NIXL + " (P pulling from D by remote_block_ids)",
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
            "test_mooncake_connector.py": OTHER.format("vLLM's MooncakeConnector (it needs the mooncake engine)"),
            "test_mooncake_connector_hma.py": OTHER.format("vLLM's MooncakeConnector (HMA)"),
            "test_mooncake_connector_hybrid_mamba.py": OTHER.format("vLLM's MooncakeConnector (hybrid Mamba)"),
            "test_mooncake_stats.py": OTHER.format("vLLM's MooncakeConnector (its stats)"),
            "test_mooncake_store_connector.py": OTHER.format("MooncakeStoreConnector"),
            "test_mooncake_store_coordinator.py": OTHER.format("MooncakeStoreConnector"),
            "test_mooncake_store_hma_e2e.py": OTHER.format("MooncakeStoreConnector"),
            "test_mooncake_store_layout.py": OTHER.format("MooncakeStoreConnector"),
            "test_mooncake_store_scheduler.py": OTHER.format("MooncakeStoreConnector"),
            "test_mooncake_store_worker.py": OTHER.format("MooncakeStoreConnector"),
            "test_moriio_hma_scheduler.py": OTHER.format("MoRIIOConnector"),
            "test_moriio_kv_layout.py": OTHER.format("MoRIIOConnector"),
            "test_moriio_proxy_routing.py": OTHER.format("MoRIIOConnector"),
            "test_moriio_routing.py": OTHER.format("MoRIIOConnector"),
            "test_moriio_routing_fairness.py": OTHER.format("MoRIIOConnector"),
            "test_moriio_toy_proxy_server.py": OTHER.format("MoRIIOConnector"),
            "test_moriio_tp_ack.py": OTHER.format("MoRIIOConnector"),
            "test_moriio_transfer_completion.py": OTHER.format("MoRIIOConnector"),
            "test_moriio_unmap.py": OTHER.format("MoRIIOConnector"),
            "test_moriio_write_done_routing.py": OTHER.format("MoRIIOConnector"),
            "test_nixl_connector_hma.py": NIXL,
            "test_nixl_desc_geometry.py": NIXL,
            "test_nixl_heartbeat.py": NIXL,
            "test_nixl_push_connector.py": NIXL,
            "test_nixl_rocm_gpu_mem_diag.py": NIXL,
            "test_nixl_simple_cpu_offload.py": NIXL,
            "test_scheduler_kv_connector_override.py": NO_CONNECTOR.format(
                "the scheduler's connector override plugin (its own DummyKVConnector)"
            ),
            "test_simple_cpu_offload_connector.py": OTHER.format("SimpleCPUOffloadConnector"),
            "test_simple_cpu_offload_metrics.py": OTHER.format("SimpleCPUOffloadConnector"),
            "test_tp_mapping.py": NIXL,
            "test_transfer_topology_sharded.py": NO_CONNECTOR.format("TransferTopology (NIXL's transfer plans)"),
        },
    ),
}
