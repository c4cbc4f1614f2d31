//! What a transport's `BatchWriter::stats` should say, and waiting
//! (bounded) until it says it.

use std::sync::Arc;
use std::time::Duration;

use kv_proto::{BatchRefusal, BatchWriter, TransportStats};

/// The stats a transport should report: `grants_live`, `refused` batches
/// per reason (every other reason zero, every reason listed),
/// `auth_failures`, and no frame that failed its tag.
pub fn expected(grants_live: u64, refused: &[(BatchRefusal, u64)], auth_failures: u64) -> TransportStats {
    let batches_refused = BatchRefusal::ALL
        .iter()
        .map(|&why| (why, refused.iter().find(|(w, _)| *w == why).map_or(0, |(_, n)| *n)))
        .collect();
    TransportStats { grants_live, batches_refused, auth_failures, tag_failures: 0 }
}

/// Waits (at most `bound`) until `writer` reports `want`: a receiver's
/// task may count a refusal just after the peer saw it.
pub async fn reaches<W: BatchWriter + ?Sized>(writer: &Arc<W>, want: &TransportStats, bound: Duration) {
    let deadline = tokio::time::Instant::now() + bound;
    while writer.stats() != *want && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(writer.stats(), *want);
}
