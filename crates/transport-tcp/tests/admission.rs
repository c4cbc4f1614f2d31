//! Admission of incoming connections over TCP: the cases of
//! `test_support::listener::admission` (stalled handshakes cannot crowd out
//! an honest sender, one host cannot take every handshake place, a peer
//! past the established limit is told why), through a raw client speaking
//! the TCP handshake by hand.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{node, Node, RawClient, Tcp, BOUND};
use kv_proto::auth::{self, AuthSecret};
use test_support::listener::admission::{Admission, Places, Stall};
use test_support::listener::HOSTILE;
use tokio::io::AsyncReadExt;
use transport_tcp::wire::{
    Accept, AcceptStatus, Preamble, ACCEPT_LEN, AUTH_BUSY, AUTH_TAG_LEN, CHALLENGE_LEN, FLAG_AUTH, VERSION,
};
use transport_tcp::TcpConfig;

impl Admission for Tcp {
    type Held = RawClient;

    async fn victim(&self, places: Places, secret: Option<&str>) -> Node {
        let limits = places.limits();
        let secret = secret.map(AuthSecret::new);
        let config = TcpConfig { auth_secret: secret, limits, ..TcpConfig::default() };
        node(config, 1 << 16).await
    }

    async fn stall(&self, victim: &Node, stall: Stall) -> RawClient {
        let mut client = RawClient::connect_from(victim, HOSTILE).await;
        if let Stall::NeverProves = stall {
            let mut opening = Preamble { version: VERSION, flags: FLAG_AUTH }.encode().to_vec();
            opening.extend_from_slice(&auth::fresh_nonce().unwrap());
            client.send(&opening).await;
            assert_eq!(client.accept().await.status, AcceptStatus::Accepted);
            let mut challenge = [0u8; CHALLENGE_LEN];
            tokio::time::timeout(BOUND, client.stream.read_exact(&mut challenge)).await.unwrap().unwrap();
        }
        client
    }

    async fn assert_refused_at_accept(&self, victim: &Node) {
        let over = RawClient::connect_from(victim, HOSTILE).await.until_closed().await;
        assert!(over.is_empty(), "a refused connection is closed unanswered");
    }

    /// Status 5 before authentication, verdict 2 after it.
    async fn assert_told_busy(&self, victim: &Node, secret: Option<&str>) {
        let mut raw = RawClient::connect(victim).await;
        match secret.map(AuthSecret::new) {
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
                raw.send(&auth::client_proof(&secret, &transcript)).await;
                let mut verdict = [0u8; 1];
                tokio::time::timeout(BOUND, raw.stream.read_exact(&mut verdict)).await.unwrap().unwrap();
                assert_eq!(verdict[0], AUTH_BUSY);
            }
        }
        assert!(raw.until_closed().await.is_empty());
    }
}

test_support::admission_suite!(Tcp);
