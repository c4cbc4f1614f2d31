//! The transport conformance suite (`test_support::conformance`) against
//! `RdmaTransport`: every case of the `BatchWriter` contract, on the RDMA
//! device `KVLINK_RDMA_DEVICE` names (`cargo xtask rdma-test` runs it in a
//! Soft-RoCE guest).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kv_proto::BatchWriter;
use test_support::conformance::{Network, CONNECT_TIMEOUT, IO_TIMEOUT};
use transport_rdma::{RdmaConfig, RdmaTransport};

/// An RDMA transport on the device the environment names, its control
/// listener on loopback, with the suite's timeouts.
async fn rdma() -> Arc<dyn BatchWriter> {
    let config = RdmaConfig { connect_timeout: CONNECT_TIMEOUT, io_timeout: IO_TIMEOUT, ..RdmaConfig::default() }
        .with_env(|name| std::env::var(name).ok())
        .unwrap();
    RdmaTransport::bind(config).await.unwrap()
}

test_support::conformance_suite!(Network(rdma));
