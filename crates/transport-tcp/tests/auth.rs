//! Data-plane shared-secret authentication: only peers that prove the
//! secret for this connection's transcript exchange batches; a proof made
//! for another protocol, another connection or the other role is refused; a
//! failed or slow handshake costs only that connection, for a bounded time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{isolated, node, Node, RawClient, BOUND};
use kv_proto::auth::{self, AuthSecret, Channel, Nonce, Transcript};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::session::{End, Session};
use kv_proto::{BatchWriter, GrantId, TransportError};
use rstest::rstest;
use test_support::pattern::{check, covering, fill, packed_ops};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport_tcp::wire::{
    auth_context, Accept, AcceptStatus, Preamble, ACCEPT_LEN, AUTH_FAILED, AUTH_OK, AUTH_TAG_LEN, CHALLENGE_LEN,
    FLAG_AUTH, PREAMBLE_LEN, VERSION,
};
use transport_tcp::{ListenerLimits, TcpConfig};

const SECRET: &str = "s3cret";

fn config(secret: Option<&str>) -> TcpConfig {
    TcpConfig { auth_secret: secret.map(AuthSecret::new), ..TcpConfig::default() }
}

#[rstest]
#[case::same_secret(Some(SECRET), Some(SECRET), None)]
#[case::receiver_requires_it(None, Some(SECRET), Some("requires the data-plane shared secret"))]
#[case::sender_requires_it(Some(SECRET), None, Some("has no data-plane shared secret"))]
#[case::different_secrets(Some("guess"), Some(SECRET), Some("failed to prove"))]
fn batches_flow_only_between_peers_proving_the_same_secret(
    #[case] sender: Option<&str>,
    #[case] receiver: Option<&str>,
    #[case] refusal: Option<&str>,
) {
    isolated(async move {
        let mut a = node(config(sender), 1 << 16).await;
        let b = node(config(receiver), 1 << 16).await;
        let batch = packed_ops(&a.buf, &b.buf, 8, 1024);
        fill(&mut a.buf, &batch);
        let grant = b.grant(&covering(&batch)).await;
        let result = a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await;
        match refusal {
            None => {
                result.unwrap();
                check(&b.buf, &batch);
            }
            Some(expected) => {
                let err = result.unwrap_err();
                assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
                assert!(err.to_string().contains(expected), "{err}");
                assert!(b.buf.is_zero(), "nothing lands without authentication");
            }
        }
    });
}

/// A raw client's authentication exchange up to its proof.
struct Exchange {
    client: RawClient,
    preamble: [u8; PREAMBLE_LEN],
    accept: [u8; ACCEPT_LEN],
    client_nonce: Nonce,
    server_nonce: Nonce,
    server_proof: [u8; AUTH_TAG_LEN],
}

impl Exchange {
    /// Connects, announces the secret, and reads the accept reply and the
    /// receiver's challenge (whose proof is checked, so the test's
    /// transcript is the receiver's).
    async fn start(node: &Node) -> Self {
        let mut client = RawClient::connect(node).await;
        let preamble = Preamble { version: VERSION, flags: FLAG_AUTH }.encode();
        let client_nonce = auth::fresh_nonce().unwrap();
        let mut opening = preamble.to_vec();
        opening.extend_from_slice(&client_nonce);
        client.send(&opening).await;
        let mut accept = [0u8; ACCEPT_LEN];
        let mut challenge = [0u8; CHALLENGE_LEN];
        tokio::time::timeout(BOUND, async {
            client.stream.read_exact(&mut accept).await.unwrap();
            client.stream.read_exact(&mut challenge).await.unwrap();
        })
        .await
        .unwrap();
        assert_eq!(Accept::decode(&accept).unwrap().status, AcceptStatus::Accepted);
        let (server_nonce, server_proof) = challenge.split_at(AUTH_TAG_LEN);
        let exchange = Self {
            client,
            preamble,
            accept,
            client_nonce,
            server_nonce: server_nonce.try_into().unwrap(),
            server_proof: server_proof.try_into().unwrap(),
        };
        let context = exchange.context();
        let secret = AuthSecret::new(SECRET);
        assert!(
            auth::verify_server_proof(
                &secret,
                &exchange.transcript(Channel::DataTcp, &context),
                &exchange.server_proof
            ),
            "the receiver's proof binds the channel, both nonces, the preamble and the accept reply"
        );
        exchange
    }

    fn context(&self) -> Vec<u8> {
        auth_context(&self.preamble, &self.accept).to_vec()
    }

    fn transcript<'a>(&'a self, channel: Channel, context: &'a [u8]) -> Transcript<'a> {
        Transcript { channel, client_nonce: &self.client_nonce, server_nonce: &self.server_nonce, context }
    }

    /// Sends `proof` and returns the receiver's verdict byte; once accepted
    /// the client tags what it sends under the session's keys.
    async fn prove(&mut self, proof: &[u8]) -> u8 {
        self.client.send(proof).await;
        let mut verdict = [0u8; 1];
        tokio::time::timeout(BOUND, self.client.stream.read_exact(&mut verdict)).await.unwrap().unwrap();
        if verdict[0] == AUTH_OK {
            let context = self.context();
            let transcript = self.transcript(Channel::DataTcp, &context);
            self.client.session = Session::derive(&AuthSecret::new(SECRET), &transcript, End::Client);
        }
        verdict[0]
    }
}

/// What a client without a valid proof offers instead.
#[derive(Clone, Copy, Debug)]
enum ForgedProof {
    /// A client proof for the side channel (same key, nonces and context).
    SideChannel,
    /// A client proof for the QUIC data plane.
    DataQuic,
    /// The nonces swapped (client's where the server's belongs).
    NoncesSwapped,
    /// The receiver's own proof sent back (reflection).
    Reflected,
    /// A server proof made by the client for this very transcript.
    ServerRole,
    /// A client proof over the preamble alone, without the accept reply.
    ShortContext,
    /// A client proof with the right transcript and another secret.
    OtherSecret,
    /// All zeros.
    Zeros,
}

#[rstest]
fn a_proof_not_made_for_this_connection_is_refused(
    #[values(
        ForgedProof::SideChannel,
        ForgedProof::DataQuic,
        ForgedProof::NoncesSwapped,
        ForgedProof::Reflected,
        ForgedProof::ServerRole,
        ForgedProof::ShortContext,
        ForgedProof::OtherSecret,
        ForgedProof::Zeros
    )]
    forged: ForgedProof,
) {
    isolated(async move {
        let b = node(config(Some(SECRET)), 1 << 16).await;
        let secret = AuthSecret::new(SECRET);
        let mut exchange = Exchange::start(&b).await;
        let context = exchange.context();
        let proof = match forged {
            ForgedProof::SideChannel => {
                auth::client_proof(&secret, &exchange.transcript(Channel::SideChannel, &context))
            }
            ForgedProof::DataQuic => auth::client_proof(&secret, &exchange.transcript(Channel::DataQuic, &context)),
            ForgedProof::NoncesSwapped => auth::client_proof(
                &secret,
                &Transcript {
                    channel: Channel::DataTcp,
                    client_nonce: &exchange.server_nonce,
                    server_nonce: &exchange.client_nonce,
                    context: &context,
                },
            ),
            ForgedProof::Reflected => exchange.server_proof,
            ForgedProof::ServerRole => auth::server_proof(&secret, &exchange.transcript(Channel::DataTcp, &context)),
            ForgedProof::ShortContext => {
                auth::client_proof(&secret, &exchange.transcript(Channel::DataTcp, &exchange.preamble))
            }
            ForgedProof::OtherSecret => {
                auth::client_proof(&AuthSecret::new("guess"), &exchange.transcript(Channel::DataTcp, &context))
            }
            ForgedProof::Zeros => [0u8; AUTH_TAG_LEN],
        };
        assert_eq!(exchange.prove(&proof).await, AUTH_FAILED, "{forged:?} was accepted");
        assert!(exchange.client.until_closed().await.is_empty(), "the receiver closes after a failed proof");

        // The right proof on a new connection is accepted, and a batch flows.
        let mut honest = Exchange::start(&b).await;
        let context = honest.context();
        let proof = auth::client_proof(&secret, &honest.transcript(Channel::DataTcp, &context));
        assert_eq!(honest.prove(&proof).await, AUTH_OK);
        let grant = b.grant_all().await;
        let base = b.buf.addr();
        honest.client.batch(1, grant.id, &[(base, 4)], 4, &[1, 2, 3, 4]).await;
        assert_eq!(honest.client.reply().await.0.status, ReplyStatus::Ok);
        b.transport.revoke(&grant.id).await;
        assert_eq!(&b.buf.bytes()[..5], &[1, 2, 3, 4, 0]);
    });
}

#[test]
fn a_failed_proof_writes_nothing_and_the_receiver_keeps_serving() {
    isolated(async move {
        let b = node(config(Some(SECRET)), 1 << 16).await;
        let grant = b.grant_all().await;
        let mut exchange = Exchange::start(&b).await;
        assert_eq!(exchange.prove(&[0u8; AUTH_TAG_LEN]).await, AUTH_FAILED);
        // A batch sent after the refused proof is never read.
        exchange.client.batch(1, grant.id, &[(b.buf.addr(), 4)], 4, &[9; 4]).await;
        exchange.client.until_closed().await;
        assert!(b.buf.is_zero());

        let mut unannounced = RawClient::connect(&b).await;
        unannounced.send(&Preamble::current().encode()).await;
        assert_eq!(unannounced.accept().await.status, AcceptStatus::AuthRequired);
        unannounced.until_closed().await;

        let mut a = node(config(Some(SECRET)), 1 << 16).await;
        let batch = packed_ops(&a.buf, &b.buf, 4, 512);
        fill(&mut a.buf, &batch);
        a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
        check(&b.buf, &batch);
    });
}

/// Which part of the handshake a slow client dribbles.
#[derive(Clone, Copy, Debug)]
enum Dribble {
    /// The preamble, without authentication.
    Preamble,
    /// The preamble and the nonce, with authentication.
    PreambleAndNonce,
    /// The proof, byte by byte, after a prompt preamble and nonce.
    Proof,
}

/// One byte per interval, each well inside `io_timeout`: the handshake's one
/// overall deadline cuts the connection off anyway, long before the bytes
/// would be complete.
#[rstest]
fn a_handshake_dribbled_byte_by_byte_is_cut_off_at_the_deadline(
    #[values(Dribble::Preamble, Dribble::PreambleAndNonce, Dribble::Proof)] dribble: Dribble,
) {
    isolated(async move {
        const DEADLINE: Duration = Duration::from_millis(600);
        const INTERVAL: Duration = Duration::from_millis(150);
        let secret = match dribble {
            Dribble::Preamble => None,
            Dribble::PreambleAndNonce | Dribble::Proof => Some(SECRET),
        };
        let config = TcpConfig {
            limits: ListenerLimits { handshake_timeout: DEADLINE, ..ListenerLimits::default() },
            io_timeout: Duration::from_secs(30),
            auth_secret: secret.map(AuthSecret::new),
            ..TcpConfig::default()
        };
        let b = node(config, 1 << 16).await;
        let started = Instant::now();
        let (mut client, bytes) = match dribble {
            Dribble::Preamble => (RawClient::connect(&b).await, Preamble::current().encode().to_vec()),
            Dribble::PreambleAndNonce => {
                let mut bytes = Preamble { version: VERSION, flags: FLAG_AUTH }.encode().to_vec();
                bytes.extend_from_slice(&[7; AUTH_TAG_LEN]);
                (RawClient::connect(&b).await, bytes)
            }
            Dribble::Proof => (Exchange::start(&b).await.client, [0u8; AUTH_TAG_LEN].to_vec()),
        };
        // Dribbling all of it would take bytes.len() × INTERVAL: 1.2 s for the
        // 8-byte preamble, 4.8 s for the proof, 6 s for preamble and nonce.
        assert!(INTERVAL * bytes.len() as u32 >= 2 * DEADLINE);
        let (mut reader, mut writer) = client.stream.split();
        let dribbling = async {
            let mut ticks = tokio::time::interval(INTERVAL);
            for byte in &bytes {
                ticks.tick().await;
                if writer.write_all(&[*byte]).await.is_err() {
                    break;
                }
            }
            // Everything sent: wait for the receiver's end.
            std::future::pending::<()>().await;
        };
        let closed = async {
            let mut sink = Vec::new();
            let _ = reader.read_to_end(&mut sink).await;
        };
        tokio::select! {
            () = dribbling => unreachable!(),
            () = closed => {}
            () = tokio::time::sleep(BOUND) => panic!("the dribbling connection was never cut off"),
        }
        let lived = started.elapsed();
        assert!(lived >= DEADLINE, "cut off after {lived:?}, before the deadline");
        assert!(
            lived < DEADLINE + Duration::from_millis(1500),
            "{dribble:?}: cut off only after {lived:?} (the deadline is {DEADLINE:?})"
        );

        // The receiver serves an honest sender meanwhile and afterwards.
        let mut a = node(TcpConfig { auth_secret: secret.map(AuthSecret::new), ..TcpConfig::default() }, 1 << 16).await;
        let batch = packed_ops(&a.buf, &b.buf, 4, 256);
        fill(&mut a.buf, &batch);
        let grant = b.grant(&covering(&batch)).await;
        a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
        check(&b.buf, &batch);
    });
}

/// The handshake deadline covers the handshake only: an authenticated
/// connection idles up to `idle_timeout` and carries batches long after it.
#[test]
fn the_deadline_ends_with_the_handshake() {
    isolated(async move {
        let config = TcpConfig {
            limits: ListenerLimits { handshake_timeout: Duration::from_millis(300), ..ListenerLimits::default() },
            auth_secret: Some(AuthSecret::new(SECRET)),
            ..TcpConfig::default()
        };
        let b = node(config, 1 << 16).await;
        let secret = AuthSecret::new(SECRET);
        let mut exchange = Exchange::start(&b).await;
        let context = exchange.context();
        let proof = auth::client_proof(&secret, &exchange.transcript(Channel::DataTcp, &context));
        assert_eq!(exchange.prove(&proof).await, AUTH_OK);
        let grant = b.grant_all().await;
        let base = b.buf.addr();
        // Three handshake deadlines later, one batch at a time.
        for i in 0..3u8 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            exchange.client.batch(u64::from(i), grant.id, &[(base + u64::from(i), 1)], 1, &[i + 1]).await;
            assert_eq!(exchange.client.reply().await.0.status, ReplyStatus::Ok);
        }
        let forged = GrantId::from_bytes([1; 16]);
        exchange.client.batch(9, forged, &[(base, 1)], 1, &[0xFF]).await;
        assert_eq!(exchange.client.reply().await.0.status, ReplyStatus::Refused);
        b.transport.revoke(&grant.id).await;
        assert_eq!(&b.buf.bytes()[..4], &[1, 2, 3, 0]);
    });
}
