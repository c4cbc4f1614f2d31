//! Helpers of the transport-tcp integration tests: nodes over TCP and a raw
//! client speaking the wire by hand. What other crates' tests share too
//! (test memory, byte patterns, resources) is `test_support`'s.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code, unreachable_pub)]

use std::net::SocketAddr;

use kv_proto::auth::AuthSecret;
use kv_proto::dataplane::ReplyStatus;
use kv_proto::GrantId;
use test_support::listener::refusals::Refusals;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use transport_tcp::wire::{
    encode_op, Accept, BatchHeader, Preamble, ReplyHeader, ACCEPT_LEN, MAX_REASON_LEN, REPLY_HEADER_LEN,
};
use transport_tcp::{OpListLimits, TcpConfig, TcpTransport};

/// Upper bound on any single wait in these tests (never reached when things work).
pub use test_support::listener::BOUND;

/// A TCP transport and its one registered buffer.
pub type Node = test_support::Node<TcpTransport>;

/// A transport bound with `config`, with a buffer of `len` bytes.
pub async fn node(config: TcpConfig, len: usize) -> Node {
    Node::registered(TcpTransport::bind(config).await.unwrap(), len)
}

/// A transport with the default configuration, with a buffer of `len` bytes.
pub async fn default_node(len: usize) -> Node {
    node(TcpConfig::default(), len).await
}

/// TCP to the listener cases of `test_support::listener`.
pub struct Tcp;

impl test_support::listener::Listener for Tcp {
    type Transport = TcpTransport;

    async fn node(&self, secret: Option<&str>, len: usize) -> Node {
        node(TcpConfig { auth_secret: secret.map(AuthSecret::new), ..TcpConfig::default() }, len).await
    }
}

/// Batches on a connection run one after another: a held batch takes a
/// connection of its own. Each batch is read back before the next is sent,
/// so one batch id serves them all.
impl Refusals for Tcp {
    type Client = RawClient;
    type Held = RawClient;

    async fn budgeted(&self, op_lists: OpListLimits, len: usize) -> Node {
        node(TcpConfig { op_lists, ..TcpConfig::default() }, len).await
    }

    fn budget_used(receiver: &Node) -> u64 {
        receiver.transport.op_list_budget().used()
    }

    async fn client(&self, receiver: &Node) -> (RawClient, u64) {
        let (client, accept) = RawClient::handshaken(receiver).await;
        (client, accept.max_ops_per_batch)
    }

    async fn batch(
        client: &mut RawClient,
        grant: GrantId,
        ops: &[(u64, u64)],
        payload: &[u8],
    ) -> (ReplyStatus, String) {
        client.batch(1, grant, ops, payload.len() as u64, payload).await;
        client.batch_reply(1).await
    }

    async fn hold(&self, receiver: &Node, _beside: &RawClient, grant: GrantId, ops: &[(u64, u64)]) -> RawClient {
        let (mut holder, _) = RawClient::handshaken(receiver).await;
        holder.batch(1, grant, ops, ops.iter().map(|&(_, len)| len).sum(), &[]).await;
        holder
    }

    async fn release(mut held: RawClient, payload: &[u8]) -> (ReplyStatus, String) {
        held.send(payload).await;
        held.batch_reply(1).await
    }
}

/// A new, well-behaved sender writes a patterned batch into `victim` and
/// checks it landed: the listener still serves.
pub async fn assert_still_serves(victim: &Node) {
    let mut sender = default_node(1 << 16).await;
    test_support::assert_still_serves(&mut sender, victim, BOUND).await;
}

/// A raw client speaking the data-plane wire by hand.
pub struct RawClient {
    pub stream: TcpStream,
    /// Once authenticated: tags the batches it sends, checks the replies.
    pub session: Option<kv_proto::session::Session>,
}

impl RawClient {
    pub async fn connect(node: &Node) -> Self {
        Self::connect_to(node.transport.local_addr()).await
    }

    pub async fn connect_to(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Self { stream, session: None }
    }

    /// Connects to `node` from the loopback address `source` (any of
    /// 127.0.0.0/8 is a host of its own to the receiver).
    pub async fn connect_from(node: &Node, source: std::net::Ipv4Addr) -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from((source, 0))).unwrap();
        let stream = socket.connect(node.transport.local_addr()).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Self { stream, session: None }
    }

    /// Connects and completes the preamble exchange.
    pub async fn handshaken(node: &Node) -> (Self, Accept) {
        Self::handshaken_to(node.transport.local_addr()).await
    }

    /// Connects to `addr` and completes the preamble exchange.
    pub async fn handshaken_to(addr: SocketAddr) -> (Self, Accept) {
        let mut client = Self::connect_to(addr).await;
        client.send(&Preamble::current().encode()).await;
        let accept = client.accept().await;
        (client, accept)
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    pub async fn accept(&mut self) -> Accept {
        let mut b = [0u8; ACCEPT_LEN];
        tokio::time::timeout(BOUND, self.stream.read_exact(&mut b)).await.unwrap().unwrap();
        Accept::decode(&b).unwrap()
    }

    /// Sends a batch header under `grant`, its op list and `payload`.
    pub async fn batch(&mut self, batch_id: u64, grant: GrantId, ops: &[(u64, u64)], total_bytes: u64, payload: &[u8]) {
        self.batch_with_flags(batch_id, 0, grant, ops, total_bytes, payload).await;
    }

    /// [`RawClient::batch`] with header flags.
    pub async fn batch_with_flags(
        &mut self,
        batch_id: u64,
        flags: u32,
        grant: GrantId,
        ops: &[(u64, u64)],
        total_bytes: u64,
        payload: &[u8],
    ) {
        let header = BatchHeader { batch_id, flags, reserved: 0, op_count: ops.len() as u64, total_bytes, grant };
        let mut bytes = header.encode().to_vec();
        if let Some(session) = &mut self.session {
            let tag = session.send.seal(&[&bytes]);
            bytes.extend_from_slice(&tag);
        }
        let op_list = bytes.len();
        for &(dst, len) in ops {
            bytes.extend_from_slice(&encode_op(dst, len));
        }
        if let Some(session) = &mut self.session {
            let tag = session.send.seal(&[&bytes[op_list..]]);
            bytes.extend_from_slice(&tag);
        }
        bytes.extend_from_slice(payload);
        self.send(&bytes).await;
    }

    /// Reads one reply (header and reason).
    pub async fn reply(&mut self) -> (ReplyHeader, String) {
        let mut h = [0u8; REPLY_HEADER_LEN];
        tokio::time::timeout(BOUND, self.stream.read_exact(&mut h)).await.unwrap().unwrap();
        let header = ReplyHeader::decode(&h);
        assert!(header.reason_len as usize <= MAX_REASON_LEN);
        let mut reason = vec![0u8; header.reason_len as usize];
        tokio::time::timeout(BOUND, self.stream.read_exact(&mut reason)).await.unwrap().unwrap();
        if let Some(session) = &mut self.session {
            let mut tag = [0u8; kv_proto::session::FRAME_TAG_LEN];
            tokio::time::timeout(BOUND, self.stream.read_exact(&mut tag)).await.unwrap().unwrap();
            session.recv.open(&[&h, &reason], &tag).expect("a reply whose tag does not match");
        }
        (header, String::from_utf8(reason).unwrap())
    }

    /// Reads one reply, which must answer `batch_id`: its status and reason.
    pub async fn batch_reply(&mut self, batch_id: u64) -> (ReplyStatus, String) {
        let (header, reason) = self.reply().await;
        assert_eq!(header.batch_id, batch_id, "{reason}");
        (header.status, reason)
    }

    /// Reads until the receiver closes the connection (EOF or reset) and
    /// returns what came before; panics if it stays open past `BOUND`.
    pub async fn until_closed(&mut self) -> Vec<u8> {
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        tokio::time::timeout(BOUND, async {
            loop {
                match self.stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&chunk[..n]),
                }
            }
        })
        .await
        .expect("the receiver kept a hostile connection open");
        got
    }
}

/// Runs `test` alone on a runtime of its own and checks that it left no
/// descriptor and no heap behind ([`test_support::isolated`]).
pub fn isolated(test: impl std::future::Future<Output = ()>) {
    test_support::isolated(test, BOUND);
}
