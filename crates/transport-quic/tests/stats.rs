//! `BatchWriter::stats` on the QUIC data plane: the receiver counts every
//! batch it refuses, once and by reason (the grant checks of its memory and
//! the op-list budget of its listener), and every peer whose proof of the
//! shared secret does not verify; a sender counts a receiver that fails its
//! proof. (That live grants follow `grant` and `revoke` is a case of the
//! conformance suite.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{default_node, reply, request, HelloOutcome, Node, Proving, Quic, RawClient, BOUND};
use kv_proto::auth::{AuthSecret, Channel};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchRefusal, BatchWriter};
use test_support::listener::proofs::Proofs;
use test_support::listener::refusals;
use test_support::stats::{expected, reaches};
use transport_quic::wire::{ClientHello, ServerHello, CLOSE_AUTH, SERVER_HELLO_LEN};

/// An unknown grant, a revoked grant (through a real sender), an op outside
/// a live grant, and an op list that finds no room in the budget: each is
/// counted once, under its reason (`test_support::listener::refusals`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_refusal_is_counted_once_by_reason() {
    refusals::each_refusal_is_counted_once_by_reason(Quic).await;
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
