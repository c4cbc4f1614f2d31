//! The transport conformance suite (`test_support::conformance`) against
//! `QuicTransport`: every case of the `BatchWriter` contract, over real UDP
//! sockets on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use kv_proto::BatchWriter;
use test_support::conformance::{Network, CONNECT_TIMEOUT, IO_TIMEOUT};
use transport_quic::{QuicConfig, QuicTransport};

/// A QUIC transport on loopback, with the suite's timeouts.
async fn quic() -> Arc<dyn BatchWriter> {
    let config = QuicConfig { connect_timeout: CONNECT_TIMEOUT, io_timeout: IO_TIMEOUT, ..QuicConfig::default() };
    QuicTransport::bind(config).await.unwrap()
}

test_support::conformance_suite!(Network(quic));
