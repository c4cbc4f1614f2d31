//! `BatchWriter::stats` on the TCP data plane: the receiver counts every
//! batch it refuses, once and by reason (the grant checks of its memory and
//! the op-list budget of its listener), and every peer whose proof of the
//! shared secret does not verify; a sender counts a receiver that fails its
//! proof. (That live grants follow `grant` and `revoke` is a case of the
//! conformance suite.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{default_node, node, Node, RawClient, Tcp, BOUND};
use kv_proto::auth::{self, AuthSecret, Channel, Nonce, Transcript};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchRefusal, BatchWriter, GrantId, MemoryRegion, TransportError, WriteOp};
use test_support::listener::proofs::Proofs;
use test_support::stats::{expected, reaches};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport_tcp::wire::{
    auth_context, Accept, AcceptStatus, Preamble, ACCEPT_LEN, AUTH_FAILED, AUTH_TAG_LEN, CHALLENGE_LEN, FLAG_AUTH,
    OP_LEN, VERSION,
};
use transport_tcp::{OpListLimits, TcpConfig};

/// Ops the receiver's op-list budget holds in the budget test.
const BUDGET_OPS: u64 = 16;

/// An unknown grant, a revoked grant (through a real sender), an op outside
/// a live grant, and an op list that finds no room in the budget: each is
/// counted once, under its reason; the batches that land count nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_refusal_is_counted_once_by_reason() {
    let config = TcpConfig {
        // Room for one list of `BUDGET_OPS` ops; a second list waits this long.
        op_lists: OpListLimits {
            unauthenticated_budget: BUDGET_OPS * OP_LEN as u64,
            timeout: Duration::from_millis(300),
            ..OpListLimits::default()
        },
        ..TcpConfig::default()
    };
    let rx = node(config, 1 << 16).await;
    let base = rx.buf.addr();
    let live = rx.grant(&[MemoryRegion::new(base, 4096)]).await;
    let (mut client, accept) = RawClient::handshaken(&rx).await;
    assert_eq!(accept.max_ops_per_batch, BUDGET_OPS);

    // Never issued.
    client.batch(1, GrantId::from_bytes([0x42; 16]), &[(base, 4)], 4, &[1; 4]).await;
    let (reply, reason) = client.reply().await;
    assert_eq!(reply.status, ReplyStatus::Refused, "{reason}");
    reaches(&rx.transport, &expected(1, &[(BatchRefusal::UnknownGrant, 1)], 0), BOUND).await;

    // Revoked, written by a real sender: the receiver counts it, the
    // sender (whose batch it is) does not.
    let mut tx = default_node(1 << 16).await;
    tx.buf.bytes_mut()[..8].fill(7);
    let revoked = rx.grant(&[MemoryRegion::new(base + 8192, 4096)]).await;
    rx.transport.revoke(&revoked.id).await;
    let ops = [WriteOp { src: tx.buf.addr(), dst: base + 8192, len: 8 }];
    let err = tx.transport.batch_write(&rx.transport.endpoint(), &revoked, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{err:?}");
    reaches(&rx.transport, &expected(1, &[(BatchRefusal::UnknownGrant, 2)], 0), BOUND).await;
    assert_eq!(tx.transport.stats(), expected(0, &[], 0), "a sender counts no refusal of its own batch");

    // Live, one op outside it (inside the registered destination).
    client.batch(2, live.id, &[(base, 4), (base + 16384, 4)], 8, &[2; 8]).await;
    let (reply, reason) = client.reply().await;
    assert_eq!(reply.status, ReplyStatus::Refused, "{reason}");
    assert!(reason.contains("op 1"), "{reason}");
    let after_outside = [(BatchRefusal::UnknownGrant, 2), (BatchRefusal::OutsideGrant, 1)];
    reaches(&rx.transport, &expected(1, &after_outside, 0), BOUND).await;

    // The budget: one batch holds all of it (its op list is in, its payload
    // not yet), so another's list finds no room within the op-list timeout.
    let (mut holder, _) = RawClient::handshaken(&rx).await;
    let held: Vec<(u64, u64)> = (0..BUDGET_OPS).map(|k| (base + k, 1)).collect();
    holder.batch(3, live.id, &held, BUDGET_OPS, &[]).await;
    let deadline = tokio::time::Instant::now() + BOUND;
    while rx.transport.op_list_budget().used() < BUDGET_OPS * OP_LEN as u64 {
        assert!(tokio::time::Instant::now() < deadline, "the holder's op list was never charged");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    client.batch(4, live.id, &[(base + 100, 1)], 1, &[4]).await;
    let (reply, reason) = client.reply().await;
    assert_eq!(reply.status, ReplyStatus::Refused, "{reason}");
    assert!(reason.contains("no room"), "{reason}");
    holder.send(&[3; BUDGET_OPS as usize]).await;
    let (reply, reason) = holder.reply().await;
    assert_eq!(reply.status, ReplyStatus::Ok, "{reason}");

    // And a batch that lands counts nothing.
    client.batch(5, live.id, &[(base + 200, 2)], 2, &[5; 2]).await;
    assert_eq!(client.reply().await.0.status, ReplyStatus::Ok);
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
    let rx = default_node(LEN).await;
    let grant = rx.grant_all().await;
    let (mut client, _) = RawClient::handshaken(&rx).await;
    client.batch(1, grant.id, &[(rx.buf.addr(), LEN as u64)], LEN as u64, &[0xAA; LEN / 2]).await;
    let deadline = tokio::time::Instant::now() + BOUND;
    while rx.buf.peek_volatile(0) != 0xAA {
        assert!(tokio::time::Instant::now() < deadline, "the payload never started landing");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    rx.transport.revoke(&grant.id).await;
    client.send(&[0xBB; LEN / 2]).await;
    let (reply, reason) = client.reply().await;
    assert_eq!(reply.status, ReplyStatus::Refused, "{reason}");
    assert!(reason.contains("revoked"), "{reason}");
    reaches(&rx.transport, &expected(0, &[(BatchRefusal::UnknownGrant, 1)], 0), BOUND).await;
}

/// A raw sender's opening with `FLAG_AUTH`, up to the receiver's challenge;
/// returns the transcript's parts (client nonce, server nonce, context).
async fn opening(client: &mut RawClient) -> (Nonce, Nonce, Vec<u8>) {
    let preamble = Preamble { version: VERSION, flags: FLAG_AUTH }.encode();
    let client_nonce = auth::fresh_nonce().unwrap();
    let mut bytes = preamble.to_vec();
    bytes.extend_from_slice(&client_nonce);
    client.send(&bytes).await;
    let mut accept = [0u8; ACCEPT_LEN];
    let mut challenge = [0u8; CHALLENGE_LEN];
    tokio::time::timeout(BOUND, async {
        client.stream.read_exact(&mut accept).await.unwrap();
        client.stream.read_exact(&mut challenge).await.unwrap();
    })
    .await
    .unwrap();
    assert_eq!(Accept::decode(&accept).unwrap().status, AcceptStatus::Accepted);
    let server_nonce: Nonce = challenge[..AUTH_TAG_LEN].try_into().unwrap();
    (client_nonce, server_nonce, auth_context(&preamble, &accept).to_vec())
}

impl Proofs for Tcp {
    const RECEIVER_PROOF_FAILED: &'static str = "failed to prove";

    /// Half-closes after the challenge: the receiver reads the end of the
    /// stream where the proof belongs and closes.
    async fn leave_before_proving(&self, receiver: &Node) {
        let mut gone = RawClient::connect(receiver).await;
        opening(&mut gone).await;
        gone.stream.shutdown().await.unwrap();
        gone.until_closed().await;
    }

    async fn prove_a_wrong_secret(&self, receiver: &Node) {
        let mut wrong = RawClient::connect(receiver).await;
        let (client_nonce, server_nonce, context) = opening(&mut wrong).await;
        let transcript = Transcript {
            channel: Channel::DataTcp,
            client_nonce: &client_nonce,
            server_nonce: &server_nonce,
            context: &context,
        };
        wrong.send(&auth::client_proof(&AuthSecret::new("guess"), &transcript)).await;
        let mut verdict = [0u8; 1];
        tokio::time::timeout(BOUND, wrong.stream.read_exact(&mut verdict)).await.unwrap().unwrap();
        assert_eq!(verdict[0], AUTH_FAILED);
        wrong.until_closed().await;
    }
}

test_support::proofs_suite!(Tcp);
