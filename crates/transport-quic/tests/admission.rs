//! Admission of incoming connections over QUIC: the cases of
//! `test_support::listener::admission` (stalled hellos cannot crowd out an
//! honest sender, one host cannot take every handshake place, a peer past
//! the established limit is told why), through a raw QUIC client speaking
//! the hello by hand; and what QUIC adds: before its hello a peer gets one
//! small stream, and under pressure a new source proves its address first.
//! A connection holds a handshake place through its QUIC/TLS handshake and
//! its hello.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{isolated, node, HelloOutcome, Node, Proving, Quic, RawClient, BOUND};
use kv_proto::auth::{AuthSecret, Channel};
use quinn::{RecvStream, SendStream};
use rstest::rstest;
use test_support::listener::admission::{Admission, Places, Stall};
use test_support::listener::{honest_batch, HOSTILE};
use transport_quic::wire::{ClientHello, ServerHello, CLOSE_BUSY, SERVER_HELLO_LEN};
use transport_quic::{ListenerLimits, QuicConfig};

/// Longer than any test here: a hostile hello ends only when the test
/// closes it (or when the receiver refuses it).
const LONG: Duration = Duration::from_secs(120);

impl Admission for Quic {
    /// The connection, and its hello's stream where it said hello.
    type Held = (RawClient, Option<(SendStream, RecvStream)>);

    async fn victim(&self, places: Places, secret: Option<&str>) -> Node {
        let limits = places.limits();
        let secret = secret.map(AuthSecret::new);
        let config = QuicConfig { auth_secret: secret, limits, connect_timeout: LONG, ..QuicConfig::default() };
        node(config, 1 << 16).await
    }

    /// `Silent` completes the QUIC/TLS handshake and never says hello;
    /// `NeverProves` says hello announcing the secret and reads the
    /// challenge.
    async fn stall(&self, victim: &Node, stall: Stall) -> Self::Held {
        let client = RawClient::handshake_from(victim, HOSTILE).await.expect("refused a connection within its share");
        let mut hello = None;
        if let Stall::NeverProves = stall {
            let (mut send, mut recv) = client.stream().await;
            send.write_all(&ClientHello { auth: true, nonce: [0x5a; 32] }.encode()).await.unwrap();
            let mut answer = [0u8; SERVER_HELLO_LEN];
            tokio::time::timeout(BOUND, recv.read_exact(&mut answer)).await.unwrap().unwrap();
            assert!(ServerHello::decode(&answer).unwrap().auth);
            // The hello's stream stays open: the receiver waits for the proof.
            hello = Some((send, recv));
        }
        (client, hello)
    }

    async fn assert_refused_at_accept(&self, victim: &Node) {
        let over = RawClient::handshake_from(victim, HOSTILE).await;
        assert!(
            matches!(over, Err(quinn::ConnectionError::ConnectionClosed(_))),
            "a host over its share: {:?}",
            over.map(|_| ())
        );
    }

    /// The connection closed with `CLOSE_BUSY` and the reason, in place of
    /// the hello's last answer.
    async fn assert_told_busy(&self, victim: &Node, secret: Option<&str>) {
        let raw = RawClient::handshake(victim).await;
        let proving = match secret {
            None => Proving::NoSecret,
            Some(secret) => {
                Proving::Secret { secret: AuthSecret::new(secret), channel: Channel::DataQuic, exporter_of: None }
            }
        };
        match raw.hello(&proving).await {
            HelloOutcome::Closed(code, reason) => {
                assert_eq!(code, u64::from(CLOSE_BUSY));
                assert!(reason.contains("max_connections"), "{reason}");
            }
            other => panic!("a peer past the limit saw {other:?}"),
        }
    }
}

test_support::admission_suite!(Quic);

/// Before its hello succeeds, a peer can make the receiver buffer little:
/// only the hello's stream opens, and that stream takes only a small
/// window of unread bytes (not a full receive window per connection).
#[rstest]
fn a_peer_before_its_hello_opens_one_stream_and_sends_little(
    #[values(Stall::Silent, Stall::NeverProves)] stall: Stall,
) {
    isolated(async move {
        let victim = Quic.victim(Places::default(), stall.secret()).await;
        let (client, hello) = Quic.stall(&victim, stall).await;
        let (mut send, _recv) = match hello {
            Some(stream) => stream,
            None => client.stream().await,
        };
        // Neither completes, ever: the bound only ends the test.
        let patience = Duration::from_millis(500);
        let second = tokio::time::timeout(patience, client.conn.open_bi()).await;
        assert!(second.is_err(), "a second stream opened before the hello succeeded");
        // The flood stalls at the small window (or the receiver, reading
        // garbage where the hello or proof belongs, closes the connection):
        // never are all 4 MiB taken.
        let flood = vec![0u8; 4 << 20];
        let sent = tokio::time::timeout(patience, send.write_all(&flood)).await;
        assert!(!matches!(sent, Ok(Ok(()))), "the receiver took 4 MiB from a peer that has not finished its hello");
        // Once a peer has proven itself it gets the full window: an honest
        // sender's batch goes through alongside.
        honest_batch(&Quic, &victim, stall.secret()).await.expect("the honest sender was refused");
    });
}

/// Once half the handshake places are taken, a new source must prove its
/// address (a QUIC retry) before it takes one, so forged source addresses
/// cannot fill them; an honest sender gets through, a round trip later.
#[test]
fn under_pressure_a_new_source_proves_its_address_first() {
    isolated(async move {
        const PLACES: usize = 4;
        let config = QuicConfig {
            limits: ListenerLimits {
                max_handshakes: PLACES,
                max_handshakes_per_host: PLACES,
                handshake_timeout: LONG,
                ..ListenerLimits::default()
            },
            connect_timeout: LONG,
            ..QuicConfig::default()
        };
        let victim = node(config, 1 << 16).await;
        let mut stalled = Vec::new();
        for _ in 0..PLACES / 2 {
            stalled.push(Quic.stall(&victim, Stall::Silent).await);
        }
        assert_eq!(victim.transport.connections_retried(), 0, "asked for proof of address without pressure");
        honest_batch(&Quic, &victim, None).await.expect("the honest sender was refused");
        assert!(victim.transport.connections_retried() >= 1, "a new source under pressure took a place unproven");
        drop(stalled);
    });
}
