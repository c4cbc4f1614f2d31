//! Helpers shared by the transport-quic integration tests: registered test
//! buffers, byte patterns, a raw QUIC client speaking the wire by hand, and
//! fake receivers with their own certificates.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code, unreachable_pub)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use kv_proto::{BatchWriter, Endpoint, MemoryRegion, Protocol, WriteOp};
use quinn::{Connection, RecvStream, SendStream};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use transport_quic::details::{EndpointDetails, Fingerprint};
use transport_quic::tls::{fingerprint_of, pinned_client_config};
use transport_quic::wire::{encode_op, BatchHeader, ReplyHeader, ALPN, MAX_REASON_LEN, REPLY_HEADER_LEN, SERVER_NAME};
use transport_quic::{QuicConfig, QuicTransport};

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
}

impl Drop for TestBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).unwrap();
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// A transport and its one registered buffer; the transport is dropped first.
pub struct Node {
    pub transport: Arc<QuicTransport>,
    pub buf: TestBuf,
}

impl Node {
    pub async fn new(config: QuicConfig, len: usize) -> Self {
        let transport = QuicTransport::bind(config).await.unwrap();
        let buf = TestBuf::new(len);
        // SAFETY: `buf` lives in the returned Node, which drops the transport
        // first; tests read it only after the batches into it completed.
        unsafe { transport.register_regions(&[buf.region()]) }.unwrap();
        Self { transport, buf }
    }

    pub async fn with_defaults(len: usize) -> Self {
        Self::new(QuicConfig::default(), len).await
    }
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

/// A new, well-behaved sender writes a patterned batch into `victim` and
/// checks it landed: the endpoint still serves.
pub async fn assert_still_serves(victim: &Node) {
    let mut sender = Node::with_defaults(1 << 16).await;
    let dst_off = 32 * 1024;
    let ops: Vec<WriteOp> = (0..8)
        .map(|k| WriteOp { src: sender.buf.addr() + k * 1024, dst: victim.buf.addr() + dst_off + k * 1024, len: 1024 })
        .collect();
    fill(&mut sender.buf, &ops);
    tokio::time::timeout(BOUND, sender.transport.batch_write(&victim.transport.endpoint(), &ops))
        .await
        .expect("well-behaved batch timed out")
        .expect("well-behaved batch failed");
    check(&victim.buf, &ops);
}

/// The bytes of a request: header, op list, payload.
pub fn request(ops: &[(u64, u64)], total_bytes: u64, payload: &[u8]) -> Vec<u8> {
    let mut bytes = BatchHeader { op_count: ops.len() as u64, total_bytes }.encode().to_vec();
    for &(dst, len) in ops {
        bytes.extend_from_slice(&encode_op(dst, len));
    }
    bytes.extend_from_slice(payload);
    bytes
}

/// A client endpoint on loopback.
pub fn client_endpoint() -> quinn::Endpoint {
    quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap()
}

/// A raw QUIC client speaking the data-plane wire by hand, pinned to the
/// victim's certificate.
pub struct RawClient {
    pub endpoint: quinn::Endpoint,
    pub conn: Connection,
}

impl RawClient {
    pub async fn connect(node: &Node) -> Self {
        let endpoint = client_endpoint();
        let config = pinned_client_config(node.transport.fingerprint()).unwrap();
        let conn = tokio::time::timeout(
            BOUND,
            endpoint.connect_with(config, node.transport.local_addr(), SERVER_NAME).unwrap(),
        )
        .await
        .unwrap()
        .unwrap();
        Self { endpoint, conn }
    }

    pub async fn stream(&self) -> (SendStream, RecvStream) {
        tokio::time::timeout(BOUND, self.conn.open_bi()).await.unwrap().unwrap()
    }

    /// Sends `bytes` on a new stream, finishes it, and reads the reply.
    pub async fn exchange(&self, bytes: &[u8]) -> Result<(ReplyHeader, String), quinn::ReadExactError> {
        let (mut send, mut recv) = self.stream().await;
        // The receiver may stop the stream before all of it is written.
        let _ = send.write_all(bytes).await;
        let _ = send.finish();
        reply(&mut recv).await
    }
}

/// Reads one reply (header and reason) within `BOUND`.
pub async fn reply(recv: &mut RecvStream) -> Result<(ReplyHeader, String), quinn::ReadExactError> {
    let mut h = [0u8; REPLY_HEADER_LEN];
    tokio::time::timeout(BOUND, recv.read_exact(&mut h)).await.expect("no reply within the bound")?;
    let header = ReplyHeader::decode(&h);
    assert!(header.reason_len as usize <= MAX_REASON_LEN);
    let mut reason = vec![0u8; header.reason_len as usize];
    tokio::time::timeout(BOUND, recv.read_exact(&mut reason)).await.expect("no reason within the bound")?;
    Ok((header, String::from_utf8(reason).unwrap()))
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
        let config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        let endpoint = quinn::Endpoint::server(config, SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        Self { endpoint, fingerprint }
    }

    /// The endpoint a sender is given for this receiver (no regions listed,
    /// so every batch is sent).
    pub fn endpoint(&self) -> Endpoint {
        let details = EndpointDetails { fingerprint: self.fingerprint, max_ops_per_batch: 1 << 20, regions: None };
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
