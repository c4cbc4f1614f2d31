//! Admission of incoming connections: a connection in its handshake and
//! hello holds a handshake place (bounded in total and per source host),
//! and takes an established place only once its hello (and proof of the
//! secret) succeeded. Peers that never finish a hello cannot crowd out an
//! honest, authenticated sender, one host cannot take every handshake
//! place, and a peer past the established limit is told why it is closed.
//! Hostile connections come from 127.0.0.2, honest senders from 127.0.0.1.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::Ipv4Addr;
use std::time::Duration;

use common::{isolated, node, HelloOutcome, Node, Proving, RawClient, BOUND, RIGHT_SECRET};
use kv_proto::auth::{AuthSecret, Channel};
use kv_proto::{BatchWriter, TransportError, WriteOp};
use quinn::{RecvStream, SendStream};
use rstest::rstest;
use test_support::pattern::{check, fill};
use transport_quic::wire::{ClientHello, ServerHello, CLOSE_BUSY, SERVER_HELLO_LEN};
use transport_quic::{ListenerLimits, QuicConfig};

const HOSTILE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Longer than any test here: a hostile hello ends only when the test
/// closes it (or when the receiver refuses it).
const LONG: Duration = Duration::from_secs(120);

/// How a hostile connection holds its handshake place.
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// Completes the QUIC/TLS handshake and never says hello (no secret
    /// configured).
    Silent,
    /// Says hello announcing the secret, reads the challenge, never proves it.
    NeverProves,
}

impl Stall {
    fn secret(self) -> Option<AuthSecret> {
        match self {
            Stall::Silent => None,
            Stall::NeverProves => Some(AuthSecret::new(RIGHT_SECRET)),
        }
    }

    /// A connection from [`HOSTILE`] holding a handshake place (once this
    /// returns, the receiver has accepted it), with its hello's stream.
    async fn open(self, victim: &Node) -> (RawClient, Option<(SendStream, RecvStream)>) {
        let client = RawClient::handshake_from(victim, HOSTILE).await.expect("refused a connection within its share");
        let mut hello = None;
        if let Stall::NeverProves = self {
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
}

/// An honest sender (from 127.0.0.1) writes a batch into `victim`.
async fn honest_batch(victim: &Node, secret: Option<AuthSecret>) -> Result<(), TransportError> {
    let mut sender = node(QuicConfig { auth_secret: secret, ..QuicConfig::default() }, 1 << 16).await;
    test_support::write_batch(&mut sender, victim, 0, BOUND).await
}

/// As many stalled hellos as the receiver has established places (so one
/// pool for both would be full), from one host up to its share: an honest
/// sender still connects, proves the secret and writes its batch.
#[rstest]
fn stalled_hellos_do_not_crowd_out_an_honest_sender(#[values(Stall::Silent, Stall::NeverProves)] stall: Stall) {
    isolated(async move {
        const PLACES: usize = 4;
        let config = QuicConfig {
            auth_secret: stall.secret(),
            limits: ListenerLimits {
                max_connections: PLACES,
                max_handshakes_per_host: PLACES,
                ..ListenerLimits::default()
            },
            connect_timeout: LONG,
            ..QuicConfig::default()
        };
        let victim = node(config, 1 << 16).await;
        let mut stalled = Vec::new();
        for _ in 0..PLACES {
            stalled.push(stall.open(&victim).await);
        }
        // One more from that host is refused at once: every place before it
        // was taken.
        assert!(RawClient::handshake_from(&victim, HOSTILE).await.is_err(), "a host over its share was served");
        honest_batch(&victim, stall.secret()).await.expect("the honest sender was refused");
        drop(stalled);
    });
}

/// Before its hello succeeds, a peer can make the receiver buffer little:
/// only the hello's stream opens, and that stream takes only a small
/// window of unread bytes (not a full receive window per connection).
#[rstest]
fn a_peer_before_its_hello_opens_one_stream_and_sends_little(
    #[values(Stall::Silent, Stall::NeverProves)] stall: Stall,
) {
    isolated(async move {
        let config = QuicConfig { auth_secret: stall.secret(), connect_timeout: LONG, ..QuicConfig::default() };
        let victim = node(config, 1 << 16).await;
        let (client, hello) = stall.open(&victim).await;
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
        honest_batch(&victim, stall.secret()).await.expect("the honest sender was refused");
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
                ..ListenerLimits::default()
            },
            connect_timeout: LONG,
            ..QuicConfig::default()
        };
        let victim = node(config, 1 << 16).await;
        let mut stalled = Vec::new();
        for _ in 0..PLACES / 2 {
            stalled.push(Stall::Silent.open(&victim).await);
        }
        assert_eq!(victim.transport.connections_retried(), 0, "asked for proof of address without pressure");
        honest_batch(&victim, None).await.expect("the honest sender was refused");
        assert!(victim.transport.connections_retried() >= 1, "a new source under pressure took a place unproven");
        drop(stalled);
    });
}

/// A host over its share of handshake places is refused at accept, while
/// another host is still served.
#[test]
fn a_host_over_its_handshake_share_is_refused_while_others_are_served() {
    isolated(async move {
        let config = QuicConfig {
            limits: ListenerLimits { max_handshakes_per_host: 2, ..ListenerLimits::default() },
            connect_timeout: LONG,
            ..QuicConfig::default()
        };
        let victim = node(config, 1 << 16).await;
        let held = [Stall::Silent.open(&victim).await, Stall::Silent.open(&victim).await];
        let over = RawClient::handshake_from(&victim, HOSTILE).await;
        assert!(
            matches!(over, Err(quinn::ConnectionError::ConnectionClosed(_))),
            "a host over its share: {:?}",
            over.map(|_| ())
        );
        honest_batch(&victim, None).await.expect("another host was refused");
        drop(held);
    });
}

/// A peer that finished its hello when every established place is taken is
/// told so, then closed; the established connection goes on.
#[rstest]
fn a_peer_past_the_connection_limit_is_told_why(#[values(None, Some(RIGHT_SECRET))] secret: Option<&str>) {
    isolated(async move {
        let secret = secret.map(AuthSecret::new);
        let config = QuicConfig {
            auth_secret: secret.clone(),
            limits: ListenerLimits { max_connections: 1, ..ListenerLimits::default() },
            ..QuicConfig::default()
        };
        let victim = node(config, 1 << 16).await;
        // A sender whose connection holds the one place.
        let mut first = node(QuicConfig { auth_secret: secret.clone(), ..QuicConfig::default() }, 1 << 16).await;
        let ops: Vec<WriteOp> = (0..2)
            .map(|k| WriteOp {
                src: first.buf.addr() + k * 512,
                dst: victim.buf.addr() + 32 * 1024 + k * 512,
                len: 512,
            })
            .collect();
        fill(&mut first.buf, &ops);
        let grant = victim.grant_range(32 * 1024, 1024).await;
        first.transport.batch_write(&victim.transport.endpoint(), &grant, &ops).await.unwrap();

        let refused = honest_batch(&victim, secret.clone()).await.expect_err("a second connection was served");
        assert!(matches!(refused, TransportError::Connect { .. }), "{refused:?}");
        assert!(refused.to_string().contains("max_connections"), "{refused}");

        // On the wire: the connection closed with CLOSE_BUSY and the reason,
        // in place of the hello's last answer.
        let raw = RawClient::handshake(&victim).await;
        let proving = match &secret {
            None => Proving::NoSecret,
            Some(secret) => Proving::Secret { secret: secret.clone(), channel: Channel::DataQuic, exporter_of: None },
        };
        match raw.hello(&proving).await {
            HelloOutcome::Closed(code, reason) => {
                assert_eq!(code, u64::from(CLOSE_BUSY));
                assert!(reason.contains("max_connections"), "{reason}");
            }
            other => panic!("a peer past the limit saw {other:?}"),
        }

        // The established connection still carries batches.
        first.transport.batch_write(&victim.transport.endpoint(), &grant, &ops).await.unwrap();
        victim.transport.revoke(&grant.id).await;
        check(&victim.buf, &ops);
    });
}
