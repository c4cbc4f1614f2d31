//! Admission of incoming connections: a connection in its handshake holds a
//! handshake place (bounded in total and per source host), and takes an
//! established place only once its handshake (and proof of the secret)
//! succeeded. Peers that never finish a handshake cannot crowd out an
//! honest, authenticated sender, one host cannot take every handshake
//! place, and a peer past the established limit is told why it is closed.
//! Hostile connections come from 127.0.0.2, honest senders from 127.0.0.1.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::Ipv4Addr;
use std::time::Duration;

use common::{isolated, node, Node, RawClient, BOUND};
use kv_proto::auth::{self, AuthSecret};
use kv_proto::{BatchWriter, TransportError};
use rstest::rstest;
use test_support::pattern::{check, covering, fill, packed_ops};
use tokio::io::AsyncReadExt;
use transport_tcp::wire::{
    Accept, AcceptStatus, Preamble, ACCEPT_LEN, AUTH_BUSY, AUTH_TAG_LEN, CHALLENGE_LEN, FLAG_AUTH, VERSION,
};
use transport_tcp::{ListenerLimits, TcpConfig};

const SECRET: &str = "s3cret";
const HOSTILE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Longer than any test here: a hostile handshake ends only when the test
/// closes it (or when the receiver refuses it).
const LONG: Duration = Duration::from_secs(120);

/// How a hostile connection holds its handshake place.
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// Connects and says nothing (no secret configured).
    Silent,
    /// Announces the secret, reads the challenge, never proves it.
    NeverProves,
}

impl Stall {
    fn secret(self) -> Option<AuthSecret> {
        match self {
            Stall::Silent => None,
            Stall::NeverProves => Some(AuthSecret::new(SECRET)),
        }
    }

    /// A connection from [`HOSTILE`] holding a handshake place (once this
    /// returns, the receiver has accepted it).
    async fn open(self, victim: &Node) -> RawClient {
        let mut client = RawClient::connect_from(victim, HOSTILE).await;
        if let Stall::NeverProves = self {
            let mut opening = Preamble { version: VERSION, flags: FLAG_AUTH }.encode().to_vec();
            opening.extend_from_slice(&auth::fresh_nonce().unwrap());
            client.send(&opening).await;
            assert_eq!(client.accept().await.status, AcceptStatus::Accepted);
            let mut challenge = [0u8; CHALLENGE_LEN];
            tokio::time::timeout(BOUND, client.stream.read_exact(&mut challenge)).await.unwrap().unwrap();
        }
        client
    }
}

/// An honest sender (from 127.0.0.1) writes a batch into `victim`.
async fn honest_batch(victim: &Node, secret: Option<AuthSecret>) -> Result<(), TransportError> {
    let mut sender = node(TcpConfig { auth_secret: secret, ..TcpConfig::default() }, 1 << 16).await;
    test_support::write_batch(&mut sender, victim, 0, BOUND).await
}

/// As many stalled handshakes as the receiver has established places (so
/// one pool for both would be full), from one host up to its share: an
/// honest sender still connects, proves the secret and writes its batch.
#[rstest]
fn stalled_handshakes_do_not_crowd_out_an_honest_sender(#[values(Stall::Silent, Stall::NeverProves)] stall: Stall) {
    isolated(async move {
        const PLACES: usize = 4;
        let config = TcpConfig {
            auth_secret: stall.secret(),
            limits: ListenerLimits {
                max_connections: PLACES,
                max_handshakes_per_host: PLACES,
                ..ListenerLimits::default()
            },
            handshake_timeout: LONG,
            ..TcpConfig::default()
        };
        let victim = node(config, 1 << 16).await;
        let mut stalled = Vec::new();
        for _ in 0..PLACES {
            stalled.push(stall.open(&victim).await);
        }
        // One more from that host is closed at once: every place before it
        // was taken.
        RawClient::connect_from(&victim, HOSTILE).await.until_closed().await;
        honest_batch(&victim, stall.secret()).await.expect("the honest sender was refused");
        drop(stalled);
    });
}

/// A host over its share of handshake places is refused at accept, while
/// another host is still served.
#[test]
fn a_host_over_its_handshake_share_is_refused_while_others_are_served() {
    isolated(async move {
        let config = TcpConfig {
            limits: ListenerLimits { max_handshakes_per_host: 2, ..ListenerLimits::default() },
            handshake_timeout: LONG,
            ..TcpConfig::default()
        };
        let victim = node(config, 1 << 16).await;
        let held = [Stall::Silent.open(&victim).await, Stall::Silent.open(&victim).await];
        let over = RawClient::connect_from(&victim, HOSTILE).await.until_closed().await;
        assert!(over.is_empty(), "a refused connection is closed unanswered");
        honest_batch(&victim, None).await.expect("another host was refused");
        drop(held);
    });
}

/// A peer that finished its handshake when every established place is
/// taken is told so, then closed; the established connection goes on.
#[rstest]
fn a_peer_past_the_connection_limit_is_told_why(#[values(None, Some(SECRET))] secret: Option<&str>) {
    isolated(async move {
        let secret = secret.map(AuthSecret::new);
        let config = TcpConfig {
            auth_secret: secret.clone(),
            limits: ListenerLimits { max_connections: 1, ..ListenerLimits::default() },
            ..TcpConfig::default()
        };
        let victim = node(config, 1 << 16).await;
        // A sender whose pooled connection holds the one place.
        let mut first = node(TcpConfig { auth_secret: secret.clone(), ..TcpConfig::default() }, 1 << 16).await;
        let batch = packed_ops(&first.buf, &victim.buf, 2, 512);
        fill(&mut first.buf, &batch);
        let grant = victim.grant(&covering(&batch)).await;
        first.transport.batch_write(&victim.transport.endpoint(), &grant, &batch).await.unwrap();

        let refused = honest_batch(&victim, secret.clone()).await.expect_err("a second connection was served");
        assert!(matches!(refused, TransportError::Connect { .. }), "{refused:?}");
        assert!(refused.to_string().contains("max_connections"), "{refused}");

        // On the wire: status 5 before authentication, verdict 2 after it.
        let mut raw = RawClient::connect(&victim).await;
        match &secret {
            None => {
                raw.send(&Preamble::current().encode()).await;
                assert_eq!(raw.accept().await.status, AcceptStatus::Busy);
            }
            Some(secret) => {
                let preamble = Preamble { version: VERSION, flags: FLAG_AUTH }.encode();
                let client_nonce = auth::fresh_nonce().unwrap();
                let mut opening = preamble.to_vec();
                opening.extend_from_slice(&client_nonce);
                raw.send(&opening).await;
                let mut accept = [0u8; ACCEPT_LEN];
                let mut challenge = [0u8; CHALLENGE_LEN];
                tokio::time::timeout(BOUND, async {
                    raw.stream.read_exact(&mut accept).await.unwrap();
                    raw.stream.read_exact(&mut challenge).await.unwrap();
                })
                .await
                .unwrap();
                assert_eq!(Accept::decode(&accept).unwrap().status, AcceptStatus::Accepted);
                let server_nonce: [u8; AUTH_TAG_LEN] = challenge[..AUTH_TAG_LEN].try_into().unwrap();
                let context = transport_tcp::wire::auth_context(&preamble, &accept);
                let transcript = auth::Transcript {
                    channel: auth::Channel::DataTcp,
                    client_nonce: &client_nonce,
                    server_nonce: &server_nonce,
                    context: &context,
                };
                raw.send(&auth::client_proof(secret, &transcript)).await;
                let mut verdict = [0u8; 1];
                tokio::time::timeout(BOUND, raw.stream.read_exact(&mut verdict)).await.unwrap().unwrap();
                assert_eq!(verdict[0], AUTH_BUSY);
            }
        }
        assert!(raw.until_closed().await.is_empty());

        // The established connection still carries batches.
        first.transport.batch_write(&victim.transport.endpoint(), &grant, &batch).await.unwrap();
        victim.transport.revoke(&grant.id).await;
        check(&victim.buf, &batch);
    });
}
