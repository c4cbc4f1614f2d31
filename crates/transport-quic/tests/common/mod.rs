//! Helpers of the transport-quic integration tests: nodes over QUIC, a raw
//! QUIC client speaking the wire by hand, and fake receivers with their own
//! certificates. What other crates' tests share too (test memory, byte
//! patterns, resources) is `test_support`'s.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;

use kv_proto::auth::{client_proof, verify_server_proof, AuthSecret, Channel, Transcript};
use kv_proto::dataplane::{
    decode_verdict_header, encode_op, put_verdict, ReplyStatus, MAX_REASON_LEN, VERDICT_HEADER_LEN,
};
use kv_proto::{BatchWriter, Endpoint, Grant, GrantId, Protocol};
use quinn::{Connection, RecvStream, SendStream};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use test_support::listener::refusals::Refusals;
use transport_quic::details::{EndpointDetails, Fingerprint};
use transport_quic::tls::{fingerprint_of, pinned_client_config};
use transport_quic::wire::{
    transcript_context, BatchHeader, ClientHello, ServerHello, ALPN, CLIENT_HELLO_LEN, EXPORTER_LABEL, EXPORTER_LEN,
    SERVER_HELLO_LEN, SERVER_NAME,
};
use transport_quic::{OpListLimits, QuicConfig, QuicTransport};

/// Upper bound on any single wait in these tests (never reached when things work).
pub use test_support::listener::BOUND;

/// A QUIC transport and its one registered buffer.
pub type Node = test_support::Node<QuicTransport>;

/// A transport bound with `config`, with a buffer of `len` bytes.
pub async fn node(config: QuicConfig, len: usize) -> Node {
    Node::registered(QuicTransport::bind(config).await.unwrap(), len)
}

/// A transport with the default configuration, with a buffer of `len` bytes.
pub async fn default_node(len: usize) -> Node {
    node(QuicConfig::default(), len).await
}

/// QUIC to the listener cases of `test_support::listener`.
pub struct Quic;

impl test_support::listener::Listener for Quic {
    type Transport = QuicTransport;

    async fn node(&self, secret: Option<&str>, len: usize) -> Node {
        node(QuicConfig { auth_secret: secret.map(AuthSecret::new), ..QuicConfig::default() }, len).await
    }
}

/// Each batch on a stream of its own; a held batch on another stream of the
/// same connection.
impl Refusals for Quic {
    type Client = RawClient;
    type Held = (SendStream, RecvStream);

    async fn budgeted(&self, op_lists: OpListLimits, len: usize) -> Node {
        node(QuicConfig { op_lists, ..QuicConfig::default() }, len).await
    }

    fn budget_used(receiver: &Node) -> u64 {
        receiver.transport.op_list_budget().used()
    }

    /// The bound on ops per batch travels in the receiver's endpoint.
    async fn client(&self, receiver: &Node) -> (RawClient, u64) {
        let details = EndpointDetails::decode(&receiver.transport.endpoint().details).unwrap();
        (RawClient::connect(receiver).await, details.max_ops_per_batch)
    }

    async fn batch(
        client: &mut RawClient,
        grant: GrantId,
        ops: &[(u64, u64)],
        payload: &[u8],
    ) -> (ReplyStatus, String) {
        client.exchange(&request(&grant, ops, payload.len() as u64, payload)).await.unwrap()
    }

    async fn hold(&self, _receiver: &Node, beside: &RawClient, grant: GrantId, ops: &[(u64, u64)]) -> Self::Held {
        let (mut send, recv) = beside.stream().await;
        let total = ops.iter().map(|&(_, len)| len).sum();
        send.write_all(&request(&grant, ops, total, &[])).await.unwrap();
        (send, recv)
    }

    async fn release((mut send, mut recv): Self::Held, payload: &[u8]) -> (ReplyStatus, String) {
        send.write_all(payload).await.unwrap();
        send.finish().unwrap();
        reply(&mut recv).await.unwrap()
    }
}

/// A new, well-behaved sender (holding the victim's secret, if any)
/// writes a patterned batch into `victim` under a fresh grant and checks it
/// landed: the endpoint still serves.
pub async fn assert_still_serves(victim: &Node) {
    let config = QuicConfig { auth_secret: victim.transport.config().auth_secret.clone(), ..QuicConfig::default() };
    let mut sender = node(config, 1 << 16).await;
    test_support::assert_still_serves(&mut sender, victim, BOUND).await;
}

/// The bytes of a request: header, op list, payload.
pub fn request(grant: &GrantId, ops: &[(u64, u64)], total_bytes: u64, payload: &[u8]) -> Vec<u8> {
    let mut bytes = BatchHeader { grant: *grant, op_count: ops.len() as u64, total_bytes }.encode().to_vec();
    for &(dst, len) in ops {
        bytes.extend_from_slice(&encode_op(dst, len));
    }
    bytes.extend_from_slice(payload);
    bytes
}

/// A verdict's bytes.
pub fn verdict(status: ReplyStatus, reason: &str) -> Vec<u8> {
    let mut out = Vec::new();
    put_verdict(&mut out, status, reason);
    out
}

/// A client endpoint on loopback.
pub fn client_endpoint() -> quinn::Endpoint {
    quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap()
}

/// The keying material a hello's proofs are bound to, on `conn`.
pub fn exported(conn: &Connection) -> [u8; EXPORTER_LEN] {
    let mut out = [0u8; EXPORTER_LEN];
    conn.export_keying_material(&mut out, EXPORTER_LABEL, b"").unwrap();
    out
}

/// The secret the tests' receivers hold when they hold one.
pub const RIGHT_SECRET: &str = test_support::listener::SECRET;

/// How a raw client proves itself in the hello.
#[derive(Clone, Debug)]
pub enum Proving {
    /// Says it has no secret.
    NoSecret,
    /// Proves with this secret, for this channel, over the exporter value of
    /// this connection (or of `other`'s).
    Secret { secret: AuthSecret, channel: Channel, exporter_of: Option<Connection> },
}

/// What the raw client saw of the hello.
#[derive(Debug)]
pub enum HelloOutcome {
    /// The receiver accepted (its verdict, or its no-secret answer).
    Accepted,
    /// The receiver's answer, when it is not accepted outright.
    Answered(ServerHello),
    /// The connection was closed (code, reason).
    Closed(u64, String),
}

/// A raw QUIC client speaking the data-plane wire by hand, pinned to the
/// victim's certificate.
pub struct RawClient {
    pub endpoint: quinn::Endpoint,
    pub conn: Connection,
}

impl RawClient {
    /// Connects and says hello without a secret (the receiver must have none).
    pub async fn connect(node: &Node) -> Self {
        let client = Self::handshake(node).await;
        let outcome = client.hello(&Proving::NoSecret).await;
        assert!(matches!(outcome, HelloOutcome::Accepted), "{outcome:?}");
        client
    }

    /// Connects (TLS only, no hello yet).
    pub async fn handshake(node: &Node) -> Self {
        Self::handshake_from(node, std::net::Ipv4Addr::LOCALHOST).await.unwrap()
    }

    /// Connects from the loopback address `source` (any of 127.0.0.0/8 is a
    /// host of its own to the receiver), TLS only, no hello yet; the error
    /// if the handshake fails.
    pub async fn handshake_from(node: &Node, source: std::net::Ipv4Addr) -> Result<Self, quinn::ConnectionError> {
        let endpoint = quinn::Endpoint::client(SocketAddr::from((source, 0))).unwrap();
        let config = pinned_client_config(node.transport.fingerprint()).unwrap();
        let conn = tokio::time::timeout(
            BOUND,
            endpoint.connect_with(config, node.transport.local_addr(), SERVER_NAME).unwrap(),
        )
        .await
        .unwrap()?;
        Ok(Self { endpoint, conn })
    }

    /// The hello, as the client, by hand.
    pub async fn hello(&self, proving: &Proving) -> HelloOutcome {
        let closed = |conn: &Connection| match conn.close_reason() {
            Some(quinn::ConnectionError::ApplicationClosed(c)) => {
                HelloOutcome::Closed(c.error_code.into_inner(), String::from_utf8_lossy(&c.reason).into_owned())
            }
            other => HelloOutcome::Closed(u64::MAX, format!("{other:?}")),
        };
        let (mut send, mut recv) = self.stream().await;
        let nonce = [0x5a; 32];
        let hello = ClientHello { auth: !matches!(proving, Proving::NoSecret), nonce }.encode();
        send.write_all(&hello).await.unwrap();
        let mut answer = [0u8; SERVER_HELLO_LEN];
        if tokio::time::timeout(BOUND, recv.read_exact(&mut answer)).await.unwrap().is_err() {
            return closed(&self.conn);
        }
        let server = ServerHello::decode(&answer).unwrap();
        let Proving::Secret { secret, channel, exporter_of } = proving else {
            return if server.auth { HelloOutcome::Answered(server) } else { HelloOutcome::Accepted };
        };
        if !server.auth {
            return HelloOutcome::Answered(server);
        }
        let exporter = exported(exporter_of.as_ref().unwrap_or(&self.conn));
        let context = transcript_context(&exporter, &hello);
        let transcript =
            Transcript { channel: *channel, client_nonce: &nonce, server_nonce: &server.nonce, context: &context };
        // The receiver proves itself for the QUIC data plane on this
        // connection, whatever the client then claims.
        let ours = Transcript {
            channel: Channel::DataQuic,
            context: &transcript_context(&exported(&self.conn), &hello),
            ..transcript
        };
        let right_secret = *secret == AuthSecret::new(RIGHT_SECRET);
        assert_eq!(verify_server_proof(secret, &ours, &server.proof), right_secret, "the receiver's proof");
        send.write_all(&client_proof(secret, &transcript)).await.unwrap();
        send.finish().unwrap();
        let mut header = [0u8; VERDICT_HEADER_LEN];
        match tokio::time::timeout(BOUND, recv.read_exact(&mut header)).await.unwrap() {
            Ok(()) if decode_verdict_header(&header).0 == ReplyStatus::Ok => HelloOutcome::Accepted,
            _ => {
                // Wait for the close the refusal comes with.
                tokio::time::timeout(BOUND, self.conn.closed()).await.unwrap();
                closed(&self.conn)
            }
        }
    }

    pub async fn stream(&self) -> (SendStream, RecvStream) {
        self.try_stream().await.expect("the receiver closed the connection")
    }

    /// A new stream, or `None` once the receiver has closed the connection.
    pub async fn try_stream(&self) -> Option<(SendStream, RecvStream)> {
        tokio::time::timeout(BOUND, self.conn.open_bi()).await.expect("no stream within the bound").ok()
    }

    /// Sends `bytes` on a new stream, finishes it, and reads the reply.
    pub async fn exchange(&self, bytes: &[u8]) -> Result<(ReplyStatus, String), quinn::ReadExactError> {
        let (mut send, mut recv) = self.stream().await;
        // The receiver may stop the stream before all of it is written.
        let _ = send.write_all(bytes).await;
        let _ = send.finish();
        reply(&mut recv).await
    }
}

/// Reads one reply (verdict and reason) within `BOUND`.
pub async fn reply(recv: &mut RecvStream) -> Result<(ReplyStatus, String), quinn::ReadExactError> {
    let mut h = [0u8; VERDICT_HEADER_LEN];
    tokio::time::timeout(BOUND, recv.read_exact(&mut h)).await.expect("no reply within the bound")?;
    let (status, reason_len) = decode_verdict_header(&h);
    assert!(reason_len as usize <= MAX_REASON_LEN);
    let mut reason = vec![0u8; reason_len as usize];
    tokio::time::timeout(BOUND, recv.read_exact(&mut reason)).await.expect("no reason within the bound")?;
    Ok((status, String::from_utf8(reason).unwrap()))
}

/// The receiver's side of a hello without a secret, by hand (for fake
/// receivers): reads the client's hello, answers "no secret".
pub async fn fake_server_hello(conn: &Connection) -> anyhow::Result<()> {
    let (mut send, mut recv) = conn.accept_bi().await?;
    let mut hello = [0u8; CLIENT_HELLO_LEN];
    recv.read_exact(&mut hello).await?;
    ClientHello::decode(&hello)?;
    send.write_all(&ServerHello { auth: false, nonce: [0; 32], proof: [0; 32] }.encode()).await?;
    send.finish()?;
    Ok(())
}

/// A receiver that is not a `QuicTransport`: its own certificate, its own
/// behaviour.
pub struct FakeReceiver {
    pub endpoint: quinn::Endpoint,
    pub fingerprint: Fingerprint,
}

impl FakeReceiver {
    /// Binds on loopback with a fresh certificate, offering `alpn`.
    pub fn bind(alpn: &[u8]) -> Self {
        Self::bind_with(alpn, quinn::TransportConfig::default())
    }

    /// Binds on loopback with a fresh certificate, offering `alpn`, with
    /// these transport parameters.
    pub fn bind_with(alpn: &[u8], transport: quinn::TransportConfig) -> Self {
        let certified = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_owned()]).unwrap();
        let cert: CertificateDer<'static> = certified.cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.key_pair.serialize_der()));
        let fingerprint = fingerprint_of(&cert);
        let mut crypto =
            rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(vec![cert], key)
                .unwrap();
        crypto.alpn_protocols = vec![alpn.to_vec()];
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(crypto).unwrap();
        let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        config.transport_config(Arc::new(transport));
        let endpoint = quinn::Endpoint::server(config, SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        Self { endpoint, fingerprint }
    }

    /// The endpoint a sender is given for this receiver.
    pub fn endpoint(&self) -> Endpoint {
        let details = EndpointDetails { fingerprint: self.fingerprint, max_ops_per_batch: 1 << 20 };
        Endpoint {
            protocol: Protocol::Quic,
            address: self.endpoint.local_addr().unwrap().to_string(),
            details: details.encode(),
        }
    }

    /// The ALPN a well-behaved fake offers.
    pub fn kvlink() -> Self {
        Self::bind(ALPN)
    }
}

/// A grant no receiver issued (fake receivers do not check grants).
pub fn any_grant() -> Grant {
    Grant::plain(GrantId::random().unwrap())
}

/// Runs `test` alone on a runtime of its own and checks that it left no
/// descriptor and no heap behind ([`test_support::isolated`]).
pub fn isolated(test: impl std::future::Future<Output = ()>) {
    test_support::isolated(test, BOUND);
}
