//! `BatchWriter::stats` on the TCP data plane: the receiver counts every
//! batch it refuses, once and by reason (the grant checks of its memory and
//! the op-list budget of its listener), and every peer whose proof of the
//! shared secret does not verify; a sender counts a receiver that fails its
//! proof. (That live grants follow `grant` and `revoke` is a case of the
//! conformance suite.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{default_node, Node, RawClient, Tcp, BOUND};
use kv_proto::auth::{self, AuthSecret, Channel, Nonce, Transcript};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchRefusal, BatchWriter};
use test_support::listener::proofs::Proofs;
use test_support::listener::refusals;
use test_support::stats::{expected, reaches};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport_tcp::wire::{
    auth_context, Accept, AcceptStatus, Preamble, ACCEPT_LEN, AUTH_FAILED, AUTH_TAG_LEN, CHALLENGE_LEN, FLAG_AUTH,
    VERSION,
};

/// An unknown grant, a revoked grant (through a real sender), an op outside
/// a live grant, and an op list that finds no room in the budget: each is
/// counted once, under its reason (`test_support::listener::refusals`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_refusal_is_counted_once_by_reason() {
    refusals::each_refusal_is_counted_once_by_reason(Tcp).await;
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
