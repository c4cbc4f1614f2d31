//! The transport conformance suite (`test_support::conformance`) against
//! the reference `BatchWriter`, the in-memory one: every case the network
//! transports pass (each in its own crate's `tests/conformance.rs`), it
//! passes too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use kv_proto::BatchWriter;
use kv_worker::in_memory::InMemoryNetwork;
use test_support::conformance::Backend;

/// Writers on one in-memory network, named in turn.
#[derive(Default)]
struct InMemory {
    network: InMemoryNetwork,
    made: usize,
}

impl Backend for InMemory {
    async fn writer(&mut self) -> Arc<dyn BatchWriter> {
        self.made += 1;
        self.network.writer(&format!("node-{}", self.made))
    }

    fn failure_bound(&self) -> Duration {
        Duration::from_secs(5)
    }
}

test_support::conformance_suite!(InMemory::default());
