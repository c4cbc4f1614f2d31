//! The transport conformance suite (`test_support::conformance`) against
//! `TcpTransport`: every case of the `BatchWriter` contract, over real
//! sockets on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kv_proto::BatchWriter;
use test_support::conformance::{Network, CONNECT_TIMEOUT, IO_TIMEOUT};
use transport_tcp::{TcpConfig, TcpTransport};

/// A TCP transport on loopback, with the suite's timeouts.
async fn tcp() -> Arc<dyn BatchWriter> {
    let config = TcpConfig { connect_timeout: CONNECT_TIMEOUT, io_timeout: IO_TIMEOUT, ..TcpConfig::default() };
    TcpTransport::bind(config).await.unwrap()
}

test_support::conformance_suite!(Network(tcp));
