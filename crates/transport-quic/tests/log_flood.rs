//! What a peer can provoke as fast as it likes costs the receiver's log at
//! most one line a second: batches naming grants it never issued (each
//! still refused, nothing landing), one line saying how many were left out.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::default_node;
use kv_proto::{BatchWriter, Grant, GrantId, TransportError, WriteOp};
use test_support::Logs;

/// On a current-thread runtime, so every task logs to this test's subscriber.
#[tokio::test]
async fn a_flood_of_forged_grants_logs_a_bounded_number_of_lines() {
    const FLOOD: u64 = 500;
    let (logs, _guard) = Logs::capture(tracing::Level::WARN);

    let receiver = default_node(4096).await;
    let sender = default_node(4096).await;
    let op = [WriteOp { src: sender.buf.addr(), dst: receiver.buf.addr(), len: 8 }];
    let started = std::time::Instant::now();
    for n in 1..=FLOOD {
        let forged = Grant::plain(GrantId::from_bytes(u128::from(n).to_le_bytes()));
        let refused = sender.transport.batch_write(&receiver.transport.endpoint(), &forged, &op).await;
        assert!(matches!(refused, Err(TransportError::Refused { .. })), "{refused:?}");
    }
    let seconds = started.elapsed().as_secs();
    assert!(receiver.buf.bytes()[..8].iter().all(|&b| b == 0), "a forged grant wrote");
    let text = logs.text();
    let lines = text.lines().filter(|l| l.contains("refusing batch")).count();
    assert!(lines >= 1 && lines as u64 <= 2 + seconds, "{lines} lines for {FLOOD} refusals in {seconds} s:\n{text}");
}
