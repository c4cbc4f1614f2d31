//! Helpers shared by the transport-tcp integration tests: registered test
//! buffers, byte patterns, and a raw client speaking the wire by hand.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code, unreachable_pub)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use kv_proto::{BatchWriter, Grant, GrantId, MemoryRegion, RegionAccess, WriteOp};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use transport_tcp::wire::{
    encode_op, Accept, BatchHeader, Preamble, ReplyHeader, ACCEPT_LEN, MAX_REASON_LEN, REPLY_HEADER_LEN,
};
use transport_tcp::{TcpConfig, TcpTransport};

/// Upper bound on any single wait in these tests (never reached when things work).
pub const BOUND: Duration = Duration::from_secs(20);

const ALIGN: usize = 4096;

/// A zeroed, page-aligned allocation.
pub struct TestBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl TestBuf {
    pub fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len, ALIGN).unwrap();
        // SAFETY: `len` > 0 in every test, so the layout is not zero-sized.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).expect("allocation failed");
        Self { ptr, len }
    }

    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr().expose_provenance() as u64
    }

    pub fn end(&self) -> u64 {
        self.addr() + self.len as u64
    }

    pub fn region(&self) -> MemoryRegion {
        MemoryRegion::new(self.addr(), self.len as u64)
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation is `len` bytes, live until drop; tests read
        // only while no transfer into it is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub fn is_zero(&self) -> bool {
        self.bytes().iter().all(|&b| b == 0)
    }

    /// Byte `i`, read while the kernel may be writing into the buffer (a
    /// volatile read through the raw pointer; no reference is made).
    pub fn peek_volatile(&self, i: usize) -> u8 {
        assert!(i < self.len);
        // SAFETY: `i` is inside the live allocation; a volatile read of a u8
        // is a plain load the compiler cannot elide or merge.
        unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(i)) }
    }
}

impl Drop for TestBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).unwrap();
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// A transport and its one registered buffer (a source and a destination,
/// as on a `kv_both` instance); the transport is dropped first.
pub struct Node {
    pub transport: Arc<TcpTransport>,
    pub buf: TestBuf,
}

impl Node {
    pub async fn new(config: TcpConfig, len: usize) -> Self {
        let transport = TcpTransport::bind(config).await.unwrap();
        let buf = TestBuf::new(len);
        // SAFETY: `buf` lives in the returned Node, which drops the transport
        // first; tests read it only after the batches into it completed or
        // their grant was revoked.
        unsafe {
            transport.register_regions(&[buf.region()], RegionAccess::Source).unwrap();
            transport.register_regions(&[buf.region()], RegionAccess::Destination).unwrap();
        }
        Self { transport, buf }
    }

    pub async fn with_defaults(len: usize) -> Self {
        Self::new(TcpConfig::default(), len).await
    }

    /// A grant over `ranges` of this node's buffer, valid for `BOUND`.
    pub async fn grant(&self, ranges: &[MemoryRegion]) -> Grant {
        self.transport.grant(ranges, BOUND).await.unwrap()
    }

    /// A grant over this node's whole buffer, valid for `BOUND`.
    pub async fn grant_all(&self) -> Grant {
        self.grant(&[self.buf.region()]).await
    }
}

/// The destination ranges of `ops`, for a grant covering exactly them.
pub fn dst_ranges(ops: &[WriteOp]) -> Vec<MemoryRegion> {
    ops.iter().filter(|op| op.len > 0).map(|op| MemoryRegion::new(op.dst, op.len)).collect()
}

pub fn pattern(seed: u64, i: usize) -> u8 {
    ((i as u64).wrapping_mul(31).wrapping_add(seed.wrapping_mul(0x9E37_79B9)) % 251) as u8
}

/// Fills the source ranges of `ops` (inside `src`) with per-op patterns.
pub fn fill(src: &mut TestBuf, ops: &[WriteOp]) {
    let base = src.addr();
    for (k, op) in ops.iter().enumerate() {
        let off = (op.src - base) as usize;
        for (i, b) in src.bytes_mut()[off..off + op.len as usize].iter_mut().enumerate() {
            *b = pattern(k as u64, i);
        }
    }
}

/// Checks the destination ranges of `ops` (inside `dst`) hold their patterns.
pub fn check(dst: &TestBuf, ops: &[WriteOp]) {
    let base = dst.addr();
    for (k, op) in ops.iter().enumerate() {
        let off = (op.dst - base) as usize;
        let got = &dst.bytes()[off..off + op.len as usize];
        assert!(got.iter().enumerate().all(|(i, &b)| b == pattern(k as u64, i)), "op {k} landed wrong");
    }
}

/// `count` ops of `len` bytes between the starts of two buffers.
pub fn ops(src: &TestBuf, dst: &TestBuf, count: usize, len: usize) -> Vec<WriteOp> {
    (0..count)
        .map(|k| WriteOp { src: src.addr() + (k * len) as u64, dst: dst.addr() + (k * len) as u64, len: len as u64 })
        .collect()
}

/// A new, well-behaved sender writes a patterned batch into `victim` and
/// checks it landed: the listener still serves.
pub async fn assert_still_serves(victim: &Node) {
    let mut sender = Node::with_defaults(1 << 16).await;
    let dst_off = 32 * 1024;
    let ops: Vec<WriteOp> = (0..8)
        .map(|k| WriteOp { src: sender.buf.addr() + k * 1024, dst: victim.buf.addr() + dst_off + k * 1024, len: 1024 })
        .collect();
    fill(&mut sender.buf, &ops);
    let grant = victim.grant(&dst_ranges(&ops)).await;
    tokio::time::timeout(BOUND, sender.transport.batch_write(&victim.transport.endpoint(), &grant, &ops))
        .await
        .expect("well-behaved batch timed out")
        .expect("well-behaved batch failed");
    victim.transport.revoke(&grant.id).await;
    check(&victim.buf, &ops);
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

/// Descriptors and live heap at one moment, to come back to within
/// [`BOUND`].
#[derive(Clone, Copy, Debug)]
pub struct Resources(test_support::Resources);

impl Resources {
    pub fn now() -> Self {
        Self(test_support::Resources::now())
    }

    /// Waits (bounded) until this process holds no more descriptors and
    /// (within the slack) no more live heap than at `self`.
    pub async fn back(&self, what: &str) {
        self.0.back(what, BOUND).await;
    }
}

/// Runs `test` alone on a runtime of its own and checks that it left no
/// descriptor and no heap behind ([`test_support::isolated`]).
pub fn isolated(test: impl std::future::Future<Output = ()>) {
    test_support::isolated(test, BOUND);
}
