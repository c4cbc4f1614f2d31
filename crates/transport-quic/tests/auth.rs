//! The shared secret on QUIC: with `QuicConfig::auth_secret` on either side,
//! a connection carries batches only after a mutual challenge–response on
//! its first stream, bound to that TLS connection and to the QUIC data
//! plane. Without a secret on either side, batches flow as before.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{
    assert_still_serves, exported, isolated, node, request, FakeReceiver, HelloOutcome, Node, Proving, RawClient, BOUND,
};
use kv_proto::auth::{server_proof, AuthSecret, Channel, Transcript};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchWriter, TransportError, WriteOp};
use rstest::rstest;
use test_support::pattern::{check, fill};
use transport_quic::wire::{transcript_context, ClientHello, ServerHello, CLIENT_HELLO_LEN, CLOSE_AUTH};
use transport_quic::{ListenerLimits, QuicConfig};

fn secret() -> AuthSecret {
    AuthSecret::new(common::RIGHT_SECRET)
}

fn with_secret(secret: Option<AuthSecret>) -> QuicConfig {
    QuicConfig { auth_secret: secret, ..QuicConfig::default() }
}

/// Writes one patterned batch from `a` into `b` under a fresh grant.
async fn write(a: &mut Node, b: &Node) -> Result<Vec<WriteOp>, TransportError> {
    let ops: Vec<WriteOp> =
        (0..4).map(|k| WriteOp { src: a.buf.addr() + k * 4096, dst: b.buf.addr() + k * 4096, len: 4096 }).collect();
    fill(&mut a.buf, &ops);
    let grant = b.grant_range(0, 4 * 4096).await;
    let result = tokio::time::timeout(BOUND, a.transport.batch_write(&b.transport.endpoint(), &grant, &ops))
        .await
        .expect("the batch hung");
    b.transport.revoke(&grant.id).await;
    result.map(|()| ops)
}

#[rstest]
#[case::neither(None, None)]
#[case::both(Some(secret()), Some(secret()))]
fn matching_configurations_carry_batches(#[case] sender: Option<AuthSecret>, #[case] receiver: Option<AuthSecret>) {
    isolated(async move {
        let mut a = node(with_secret(sender), 1 << 16).await;
        let b = node(with_secret(receiver), 1 << 16).await;
        let ops = write(&mut a, &b).await.unwrap();
        check(&b.buf, &ops);
        // The next batch reuses the authenticated connection.
        write(&mut a, &b).await.unwrap();
        assert_eq!(a.transport.connections_opened(), 1);
        assert_eq!(b.transport.connections_accepted(), 1);
    });
}

#[rstest]
#[case::sender_without_secret(None, Some(secret()), "requires the data-plane shared secret")]
#[case::receiver_without_secret(Some(secret()), None, "has no data-plane shared secret")]
#[case::wrong_secret(Some(AuthSecret::new("another secret")), Some(secret()), "proof does not verify")]
fn mismatched_secrets_are_refused_with_a_clear_error(
    #[case] sender: Option<AuthSecret>,
    #[case] receiver: Option<AuthSecret>,
    #[case] says: &str,
) {
    isolated(async move {
        let mut a = node(with_secret(sender), 1 << 16).await;
        let b = node(with_secret(receiver), 1 << 16).await;
        let err = write(&mut a, &b).await.unwrap_err();
        match &err {
            TransportError::Connect { reason, .. } => assert!(reason.contains(says), "unclear reason: {reason}"),
            other => panic!("expected Connect, got {other:?}"),
        }
        assert!(b.buf.is_zero(), "bytes landed over an unauthenticated connection");
        assert_eq!(b.transport.bytes_received(), 0);
        if b.transport.config().auth_secret.is_some() {
            assert_eq!(b.transport.connections_accepted(), 0);
        }
        // (A receiver without a secret serves anyone; the sender refused it.)
        assert_eq!(a.transport.connections_opened(), 0);
        assert_still_serves(&b).await;
    });
}

/// How a raw client (the right certificate pinned) tries the hello.
#[derive(Clone, Copy, Debug)]
enum Attempt {
    /// Says it has no secret.
    NoSecret,
    /// Proves with another secret.
    WrongSecret,
    /// The right secret, the proof made for the TCP data plane.
    DataTcpProof,
    /// The right secret, the proof made for the side channel.
    SideChannelProof,
    /// The right secret, the proof bound to another connection (as a relay
    /// would get it).
    OtherConnectionProof,
    /// The right proof (control).
    RightProof,
}

#[rstest]
fn a_raw_client_must_prove_the_secret_for_this_connection_and_protocol(
    #[values(
        Attempt::NoSecret,
        Attempt::WrongSecret,
        Attempt::DataTcpProof,
        Attempt::SideChannelProof,
        Attempt::OtherConnectionProof,
        Attempt::RightProof
    )]
    attempt: Attempt,
) {
    isolated(async move {
        let victim = node(with_secret(Some(secret())), 1 << 16).await;
        let grant = victim.grant_all().await.id;
        let client = RawClient::handshake(&victim).await;
        let other = RawClient::handshake(&victim).await;
        let proving = |secret: AuthSecret, channel: Channel| Proving::Secret { secret, channel, exporter_of: None };
        let proving = match attempt {
            Attempt::NoSecret => Proving::NoSecret,
            Attempt::WrongSecret => proving(AuthSecret::new("guess"), Channel::DataQuic),
            Attempt::DataTcpProof => proving(secret(), Channel::DataTcp),
            Attempt::SideChannelProof => proving(secret(), Channel::SideChannel),
            Attempt::OtherConnectionProof => {
                Proving::Secret { secret: secret(), channel: Channel::DataQuic, exporter_of: Some(other.conn.clone()) }
            }
            Attempt::RightProof => proving(secret(), Channel::DataQuic),
        };
        let outcome = client.hello(&proving).await;
        let batch = request(&grant, &[(victim.buf.addr(), 4096)], 4096, &[0xee; 4096]);
        if let Attempt::RightProof = attempt {
            assert!(matches!(outcome, HelloOutcome::Accepted), "{outcome:?}");
            let (status, reason) = client.exchange(&batch).await.unwrap();
            assert_eq!(status, ReplyStatus::Ok, "{reason}");
            victim.transport.revoke(&grant).await;
            assert!(victim.buf.bytes()[..4096].iter().all(|&b| b == 0xee));
            return;
        }
        match &outcome {
            HelloOutcome::Closed(code, reason) => {
                assert_eq!(*code, u64::from(CLOSE_AUTH), "{attempt:?}: {reason}");
                assert!(!reason.is_empty());
            }
            other => panic!("{attempt:?}: not refused: {other:?}"),
        }
        // Nothing can be written on the refused connection.
        let written = tokio::time::timeout(BOUND, async {
            let (mut send, mut recv) = client.conn.open_bi().await?;
            send.write_all(&batch).await?;
            send.finish()?;
            anyhow::Ok(common::reply(&mut recv).await?)
        })
        .await
        .expect("the refused connection hung");
        assert!(written.is_err(), "{attempt:?}: a batch was answered: {written:?}");
        victim.transport.revoke(&grant).await;
        assert!(victim.buf.is_zero(), "{attempt:?}: bytes landed");
        assert_eq!(victim.transport.connections_accepted(), 0);
        assert_still_serves(&victim).await;
    });
}

/// What a fake receiver proves in its hello.
#[derive(Clone, Copy, Debug)]
enum FakeProof {
    /// A proof made for the TCP data plane.
    DataTcp,
    /// A proof made for the side channel.
    SideChannel,
    /// A QUIC proof over another connection's keying material.
    OtherConnection,
    /// A QUIC proof with another secret.
    WrongSecret,
}

#[rstest]
fn a_sender_refuses_a_receiver_proof_not_made_for_this_connection(
    #[values(FakeProof::DataTcp, FakeProof::SideChannel, FakeProof::OtherConnection, FakeProof::WrongSecret)]
    proof: FakeProof,
) {
    isolated(async move {
        let mut a = node(with_secret(Some(secret())), 1 << 16).await;
        let fake = FakeReceiver::kvlink();
        let accepting = fake.endpoint.clone();
        let server = tokio::spawn(async move {
            let conn = accepting.accept().await.unwrap().await.unwrap();
            let (mut send, mut recv) = conn.accept_bi().await.unwrap();
            let mut hello = [0u8; CLIENT_HELLO_LEN];
            recv.read_exact(&mut hello).await.unwrap();
            let client = ClientHello::decode(&hello).unwrap();
            assert!(client.auth);
            let nonce = [0x33; 32];
            let exporter = match proof {
                FakeProof::OtherConnection => [0; 32],
                _ => exported(&conn),
            };
            let context = transcript_context(&exporter, &hello);
            let channel = match proof {
                FakeProof::DataTcp => Channel::DataTcp,
                FakeProof::SideChannel => Channel::SideChannel,
                _ => Channel::DataQuic,
            };
            let key = match proof {
                FakeProof::WrongSecret => AuthSecret::new("guess"),
                _ => secret(),
            };
            let transcript =
                Transcript { channel, client_nonce: &client.nonce, server_nonce: &nonce, context: &context };
            let answer = ServerHello { auth: true, nonce, proof: server_proof(&key, &transcript) };
            send.write_all(&answer.encode()).await.unwrap();
            // The sender must not answer with its own proof.
            let mut their_proof = [0u8; 32];
            let got = tokio::time::timeout(BOUND, recv.read_exact(&mut their_proof)).await.expect("the sender hung");
            assert!(got.is_err(), "the sender proved itself to a receiver that did not");
            conn.close_reason()
        });
        let ops = vec![WriteOp { src: a.buf.addr(), dst: 0x1000, len: 4096 }];
        fill(&mut a.buf, &ops);
        let err = tokio::time::timeout(BOUND, a.transport.batch_write(&fake.endpoint(), &common::any_grant(), &ops))
            .await
            .unwrap()
            .unwrap_err();
        match &err {
            TransportError::Connect { reason, .. } => assert!(reason.contains("proof does not verify"), "{reason}"),
            other => panic!("expected Connect, got {other:?}"),
        }
        let closed = server.await.unwrap();
        match closed {
            Some(quinn::ConnectionError::ApplicationClosed(close)) => {
                assert_eq!(close.error_code.into_inner(), u64::from(CLOSE_AUTH))
            }
            other => panic!("the sender did not close with the auth code: {other:?}"),
        }
        fake.endpoint.close(0u32.into(), b"done");
    });
}

#[rstest]
#[case::no_stream(0)]
#[case::half_a_hello(CLIENT_HELLO_LEN / 2)]
fn a_hello_that_never_completes_is_cut_at_the_deadline(#[case] sent: usize) {
    isolated(async move {
        const DEADLINE: Duration = Duration::from_millis(400);
        let limits = ListenerLimits { handshake_timeout: DEADLINE, ..ListenerLimits::default() };
        let config = QuicConfig { limits, ..with_secret(Some(secret())) };
        let victim = node(config, 1 << 16).await;
        let client = RawClient::handshake(&victim).await;
        let started = Instant::now();
        let mut streams = None;
        if sent > 0 {
            let (mut send, recv) = client.stream().await;
            let hello = ClientHello { auth: true, nonce: [1; 32] }.encode();
            send.write_all(&hello[..sent]).await.unwrap();
            streams = Some((send, recv));
        }
        let close = tokio::time::timeout(BOUND, client.conn.closed()).await.expect("the stalled hello was never cut");
        let waited = started.elapsed();
        assert!(waited < DEADLINE + Duration::from_secs(2), "cut only after {waited:?}");
        match close {
            quinn::ConnectionError::ApplicationClosed(c) => {
                assert_eq!(c.error_code.into_inner(), u64::from(CLOSE_AUTH))
            }
            other => panic!("unexpected close {other:?}"),
        }
        drop(streams);
        assert_eq!(victim.transport.connections_accepted(), 0);
        assert_still_serves(&victim).await;
    });
}

#[test]
fn a_receiver_that_never_answers_the_hello_fails_the_connect_in_time() {
    isolated(async move {
        const CONNECT_TIMEOUT: Duration = Duration::from_millis(400);
        let config = QuicConfig { connect_timeout: CONNECT_TIMEOUT, ..with_secret(Some(secret())) };
        let mut a = node(config, 1 << 16).await;
        let fake = FakeReceiver::kvlink();
        let accepting = fake.endpoint.clone();
        // Completes the TLS handshake, reads the hello, never answers.
        let server = tokio::spawn(async move {
            let conn = accepting.accept().await.unwrap().await.unwrap();
            let (_send, mut recv) = conn.accept_bi().await.unwrap();
            let _ = recv.read_to_end(1024).await;
            conn.closed().await
        });
        let ops = vec![WriteOp { src: a.buf.addr(), dst: 0x1000, len: 16 }];
        fill(&mut a.buf, &ops);
        let started = Instant::now();
        let err = tokio::time::timeout(BOUND, a.transport.batch_write(&fake.endpoint(), &common::any_grant(), &ops))
            .await
            .expect("the connect was not bounded")
            .unwrap_err();
        assert!(matches!(err, TransportError::Timeout { what: "connect", .. }), "{err:?}");
        assert!(
            started.elapsed() < CONNECT_TIMEOUT + Duration::from_secs(2),
            "failed only after {:?}",
            started.elapsed()
        );
        fake.endpoint.close(0u32.into(), b"done");
        let _ = server.await;
    });
}
