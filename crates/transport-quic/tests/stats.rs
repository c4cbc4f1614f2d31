//! `BatchWriter::stats` on the QUIC data plane: the receiver counts every
//! batch it refuses, once and by reason (the grant checks of its memory and
//! the op-list budget of its listener), and every peer whose proof of the
//! shared secret does not verify; a sender counts a receiver that fails its
//! proof. (That live grants follow `grant` and `revoke` is a case of the
//! conformance suite.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{default_node, node, reply, request, HelloOutcome, Node, Proving, Quic, RawClient, BOUND};
use kv_proto::auth::{AuthSecret, Channel};
use kv_proto::dataplane::{ReplyStatus, OP_LEN};
use kv_proto::{BatchRefusal, BatchWriter, GrantId, TransportError, WriteOp};
use test_support::listener::proofs::Proofs;
use test_support::stats::{expected, reaches};
use transport_quic::wire::{ClientHello, ServerHello, CLOSE_AUTH, SERVER_HELLO_LEN};
use transport_quic::{OpListLimits, QuicConfig};

/// Ops the receiver's op-list budget holds in the budget test.
const BUDGET_OPS: u64 = 16;

/// An unknown grant, a revoked grant (through a real sender), an op outside
/// a live grant, and an op list that finds no room in the budget: each is
/// counted once, under its reason; the batches that land count nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_refusal_is_counted_once_by_reason() {
    let config = QuicConfig {
        // Room for one list of `BUDGET_OPS` ops; a second list waits this long.
        op_lists: OpListLimits {
            unauthenticated_budget: BUDGET_OPS * OP_LEN as u64,
            timeout: Duration::from_millis(300),
            ..OpListLimits::default()
        },
        ..QuicConfig::default()
    };
    let rx = node(config, 1 << 16).await;
    let base = rx.buf.addr();
    let live = rx.grant_range(0, 4096).await;
    let client = RawClient::connect(&rx).await;

    // Never issued.
    let (status, reason) =
        client.exchange(&request(&GrantId::from_bytes([0x42; 16]), &[(base, 4)], 4, &[1; 4])).await.unwrap();
    assert_eq!(status, ReplyStatus::Refused, "{reason}");
    reaches(&rx.transport, &expected(1, &[(BatchRefusal::UnknownGrant, 1)], 0), BOUND).await;

    // Revoked, written by a real sender: the receiver counts it, the
    // sender (whose batch it is) does not.
    let mut tx = default_node(1 << 16).await;
    tx.buf.bytes_mut()[..8].fill(7);
    let revoked = rx.grant_range(8192, 4096).await;
    rx.transport.revoke(&revoked.id).await;
    let ops = [WriteOp { src: tx.buf.addr(), dst: base + 8192, len: 8 }];
    let err = tx.transport.batch_write(&rx.transport.endpoint(), &revoked, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{err:?}");
    reaches(&rx.transport, &expected(1, &[(BatchRefusal::UnknownGrant, 2)], 0), BOUND).await;
    assert_eq!(tx.transport.stats(), expected(0, &[], 0), "a sender counts no refusal of its own batch");

    // Live, one op outside it (inside the registered destination).
    let (status, reason) =
        client.exchange(&request(&live.id, &[(base, 4), (base + 16384, 4)], 8, &[2; 8])).await.unwrap();
    assert_eq!(status, ReplyStatus::Refused, "{reason}");
    assert!(reason.contains("op 1"), "{reason}");
    let after_outside = [(BatchRefusal::UnknownGrant, 2), (BatchRefusal::OutsideGrant, 1)];
    reaches(&rx.transport, &expected(1, &after_outside, 0), BOUND).await;

    // The budget: one stream holds all of it (its op list is in, its
    // payload not yet), so another's list finds no room within the op-list
    // timeout.
    let (mut held_send, mut held_recv) = client.stream().await;
    let held: Vec<(u64, u64)> = (0..BUDGET_OPS).map(|k| (base + k, 1)).collect();
    held_send.write_all(&request(&live.id, &held, BUDGET_OPS, &[])).await.unwrap();
    let deadline = tokio::time::Instant::now() + BOUND;
    while rx.transport.op_list_budget().used() < BUDGET_OPS * OP_LEN as u64 {
        assert!(tokio::time::Instant::now() < deadline, "the holder's op list was never charged");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (status, reason) = client.exchange(&request(&live.id, &[(base + 100, 1)], 1, &[4])).await.unwrap();
    assert_eq!(status, ReplyStatus::Refused, "{reason}");
    assert!(reason.contains("no room"), "{reason}");
    held_send.write_all(&[3; BUDGET_OPS as usize]).await.unwrap();
    held_send.finish().unwrap();
    let (status, reason) = reply(&mut held_recv).await.unwrap();
    assert_eq!(status, ReplyStatus::Ok, "{reason}");

    // And a batch that lands counts nothing.
    let (status, reason) = client.exchange(&request(&live.id, &[(base + 200, 2)], 2, &[5; 2])).await.unwrap();
    assert_eq!(status, ReplyStatus::Ok, "{reason}");
    let all = [(BatchRefusal::UnknownGrant, 2), (BatchRefusal::OutsideGrant, 1), (BatchRefusal::OpBudget, 1)];
    reaches(&rx.transport, &expected(1, &all, 0), BOUND).await;
    rx.transport.revoke(&live.id).await;
    reaches(&rx.transport, &expected(0, &all, 0), BOUND).await;
    assert_eq!(&rx.buf.bytes()[..BUDGET_OPS as usize], &[3; BUDGET_OPS as usize]);
    assert_eq!(&rx.buf.bytes()[200..202], &[5; 2]);
}

/// A batch admitted, then fenced mid-payload by `revoke`: counted once, as
/// a batch under a grant that is no longer live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_mid_batch_is_counted() {
    const LEN: usize = 64 * 1024;
    const FIRST: usize = 16 * 1024;
    let rx = default_node(LEN).await;
    let grant = rx.grant_all().await;
    let client = RawClient::connect(&rx).await;
    let (mut send, mut recv) = client.stream().await;
    send.write_all(&request(&grant.id, &[(rx.buf.addr(), LEN as u64)], LEN as u64, &[7; FIRST])).await.unwrap();
    let deadline = tokio::time::Instant::now() + BOUND;
    while rx.transport.bytes_received() < FIRST as u64 {
        assert!(tokio::time::Instant::now() < deadline, "the payload never started landing");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    rx.transport.revoke(&grant.id).await;
    // The receiver may stop the stream before all of it is written.
    let _ = send.write_all(&[9; LEN - FIRST]).await;
    let _ = send.finish();
    let (status, reason) = reply(&mut recv).await.unwrap();
    assert_eq!(status, ReplyStatus::Refused, "{reason}");
    assert!(reason.contains("revoked"), "{reason}");
    reaches(&rx.transport, &expected(0, &[(BatchRefusal::UnknownGrant, 1)], 0), BOUND).await;
}

impl Proofs for Quic {
    const RECEIVER_PROOF_FAILED: &'static str = "proof does not verify";

    /// Finishes the hello stream after the receiver's answer: the receiver
    /// finds it truncated and closes the connection.
    async fn leave_before_proving(&self, receiver: &Node) {
        let gone = RawClient::handshake(receiver).await;
        let (mut send, mut recv) = gone.stream().await;
        send.write_all(&ClientHello { auth: true, nonce: [0x5a; 32] }.encode()).await.unwrap();
        let mut answer = [0u8; SERVER_HELLO_LEN];
        tokio::time::timeout(BOUND, recv.read_exact(&mut answer)).await.unwrap().unwrap();
        assert!(ServerHello::decode(&answer).unwrap().auth);
        send.finish().unwrap();
        tokio::time::timeout(BOUND, gone.conn.closed()).await.expect("the receiver kept a truncated hello open");
    }

    async fn prove_a_wrong_secret(&self, receiver: &Node) {
        let wrong = RawClient::handshake(receiver).await;
        let proving =
            Proving::Secret { secret: AuthSecret::new("guess"), channel: Channel::DataQuic, exporter_of: None };
        match wrong.hello(&proving).await {
            HelloOutcome::Closed(code, reason) => assert_eq!(code, u64::from(CLOSE_AUTH), "{reason}"),
            other => panic!("a wrong proof was not refused: {other:?}"),
        }
    }
}

test_support::proofs_suite!(Quic);
