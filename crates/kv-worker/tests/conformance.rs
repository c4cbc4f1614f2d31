//! The transport conformance suite: one set of contract tests that every
//! `BatchWriter` passes, with one rstest case per backend.
//!
//! A backend is added by a `Backend` variant and an arm in
//! `Harness::writer` (and one `#[case]` line per test). Everything else here
//! speaks the trait only.
//!
//! The RDMA cases run where an RDMA device is named by `KVLINK_RDMA_DEVICE`
//! (`cargo xtask rdma-test` sets it in its Soft-RoCE guest) and kv-worker's
//! `rdma` feature is on; elsewhere they pass vacuously. Buffers are real allocations registered with the
//! writers; every byte that should land is checked against a per-op pattern,
//! and every byte that must not land is checked untouched.
//!
//! The grant contract: a peer writes only inside a live grant the receiver
//! issued; a batch for an unknown, expired or revoked grant, or with an op
//! outside it (a source region included), is refused whole; `revoke` is a
//! fence; a writer that registered only sources accepts no write at all.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use kv_proto::{BatchWriter, Endpoint, Grant, GrantId, MemoryRegion, Protocol, RegionAccess, TransportError, WriteOp};
use kv_worker::in_memory::InMemoryNetwork;
use rstest::rstest;
use tokio::task::JoinSet;

/// Timeouts given to network backends.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Validity of the grants these tests issue (never reached when things work).
const GRANT_TTL: Duration = Duration::from_secs(120);

/// A backend under test.
#[derive(Clone, Copy, Debug)]
enum Backend {
    InMemory,
    Tcp,
    Quic,
    Rdma,
}

/// Makes writers of one backend that reach each other.
struct Harness {
    backend: Backend,
    network: InMemoryNetwork,
    next: usize,
}

impl Harness {
    /// `None` when the backend is not compiled in (the test then passes vacuously).
    fn new(backend: Backend) -> Option<Self> {
        let compiled = match backend {
            Backend::InMemory => true,
            Backend::Tcp => cfg!(feature = "tcp"),
            Backend::Quic => cfg!(feature = "quic"),
            Backend::Rdma => cfg!(feature = "rdma") && std::env::var_os("KVLINK_RDMA_DEVICE").is_some(),
        };
        compiled.then(|| Self { backend, network: InMemoryNetwork::new(), next: 0 })
    }

    /// A new writer with no regions.
    async fn writer(&mut self) -> Arc<dyn BatchWriter> {
        self.next += 1;
        match self.backend {
            Backend::InMemory => self.network.writer(&format!("node-{}", self.next)),
            #[cfg(feature = "tcp")]
            Backend::Tcp => {
                let config = transport_tcp::TcpConfig {
                    connect_timeout: CONNECT_TIMEOUT,
                    io_timeout: IO_TIMEOUT,
                    ..transport_tcp::TcpConfig::default()
                };
                transport_tcp::TcpTransport::bind(config).await.unwrap()
            }
            #[cfg(not(feature = "tcp"))]
            Backend::Tcp => unreachable!("Harness::new refuses backends that are not compiled in"),
            #[cfg(feature = "quic")]
            Backend::Quic => {
                let config = transport_quic::QuicConfig {
                    connect_timeout: CONNECT_TIMEOUT,
                    io_timeout: IO_TIMEOUT,
                    ..transport_quic::QuicConfig::default()
                };
                transport_quic::QuicTransport::bind(config).await.unwrap()
            }
            #[cfg(not(feature = "quic"))]
            Backend::Quic => unreachable!("Harness::new refuses backends that are not compiled in"),
            #[cfg(feature = "rdma")]
            Backend::Rdma => {
                let config = transport_rdma::RdmaConfig {
                    connect_timeout: CONNECT_TIMEOUT,
                    io_timeout: IO_TIMEOUT,
                    ..transport_rdma::RdmaConfig::default()
                }
                .with_env(|name| std::env::var(name).ok())
                .unwrap();
                transport_rdma::RdmaTransport::bind(config).await.unwrap()
            }
            #[cfg(not(feature = "rdma"))]
            Backend::Rdma => unreachable!("Harness::new refuses backends that are not compiled in"),
        }
    }

    /// A writer with one zeroed buffer per entry of `sizes`, registered both
    /// as sources and as destinations (a `kv_both` instance).
    async fn node(&mut self, sizes: &[usize]) -> Node {
        self.node_with(sizes, &[RegionAccess::Source, RegionAccess::Destination]).await
    }

    /// A writer with one zeroed buffer per entry of `sizes`, registered with
    /// each of `accesses`.
    async fn node_with(&mut self, sizes: &[usize], accesses: &[RegionAccess]) -> Node {
        let writer = self.writer().await;
        let bufs: Vec<TestBuf> = sizes.iter().map(|&len| TestBuf::new(len)).collect();
        let regions: Vec<MemoryRegion> = bufs.iter().map(TestBuf::region).collect();
        for &access in accesses {
            // SAFETY: the buffers live in the returned `Node`, which drops
            // its writer (closing it) before them; nobody reads a
            // destination while a grant over it is live (tests look only
            // after `batch_write` returned or the grant was revoked).
            unsafe { writer.register_regions(&regions, access) }.unwrap();
        }
        Node { writer, bufs }
    }

    /// How long a batch to a dead peer may take to fail: the backend's
    /// bounds (a stale pooled connection, then a new connection attempt),
    /// with slack.
    fn failure_bound(&self) -> Duration {
        match self.backend {
            Backend::InMemory => Duration::from_secs(5),
            Backend::Tcp | Backend::Quic | Backend::Rdma => 2 * (CONNECT_TIMEOUT + IO_TIMEOUT),
        }
    }
}

/// A zeroed, page-aligned allocation that transports write into.
struct TestBuf {
    ptr: NonNull<u8>,
    len: usize,
}

const ALIGN: usize = 4096;

impl TestBuf {
    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len, ALIGN).unwrap();
        // SAFETY: `len` > 0 in every test, so the layout is not zero-sized.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).expect("allocation failed");
        Self { ptr, len }
    }

    fn addr(&self) -> u64 {
        self.ptr.as_ptr().expose_provenance() as u64
    }

    fn region(&self) -> MemoryRegion {
        MemoryRegion::new(self.addr(), self.len as u64)
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation is `len` bytes, live until drop; tests read
        // only while no transfer into it is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for TestBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).unwrap();
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// A writer and its registered buffers. Field order matters: the writer is
/// dropped (and stops touching memory) before the buffers are freed.
struct Node {
    writer: Arc<dyn BatchWriter>,
    bufs: Vec<TestBuf>,
}

impl Node {
    fn endpoint(&self) -> Endpoint {
        self.writer.endpoint()
    }

    /// A grant over `ranges`, valid for [`GRANT_TTL`].
    async fn grant(&self, ranges: &[MemoryRegion]) -> Grant {
        self.writer.grant(ranges, GRANT_TTL).await.unwrap()
    }

    /// A grant over exactly the destinations of `ops` (zero-length ops add nothing).
    async fn grant_for(&self, ops: &[WriteOp]) -> Grant {
        self.grant(&covering(ops)).await
    }

    /// A grant over every buffer.
    async fn grant_all(&self) -> Grant {
        let all: Vec<MemoryRegion> = self.bufs.iter().map(TestBuf::region).collect();
        self.grant(&all).await
    }

    fn addr(&self, buf: usize, offset: usize) -> u64 {
        self.bufs[buf].addr() + offset as u64
    }

    fn locate(&self, addr: u64, len: u64) -> (usize, usize) {
        let i = self
            .bufs
            .iter()
            .position(|b| addr >= b.addr() && addr + len <= b.addr() + b.len as u64)
            .unwrap_or_else(|| panic!("{addr:#x}+{len} is in no buffer"));
        (i, (addr - self.bufs[i].addr()) as usize)
    }

    fn slice(&self, addr: u64, len: u64) -> &[u8] {
        let (i, off) = self.locate(addr, len);
        &self.bufs[i].bytes()[off..off + len as usize]
    }

    fn slice_mut(&mut self, addr: u64, len: u64) -> &mut [u8] {
        let (i, off) = self.locate(addr, len);
        &mut self.bufs[i].bytes_mut()[off..off + len as usize]
    }

    /// Fills each op's source range with its pattern (seed = op index).
    fn fill_sources(&mut self, ops: &[WriteOp]) {
        for (k, op) in ops.iter().enumerate() {
            fill_pattern(self.slice_mut(op.src, op.len), k as u64);
        }
    }

    /// Checks each op's destination range holds its pattern.
    fn check_destinations(&self, ops: &[WriteOp]) {
        for (k, op) in ops.iter().enumerate() {
            assert!(has_pattern(self.slice(op.dst, op.len), k as u64), "op {k} ({op:?}) landed wrong");
        }
    }

    /// Checks every byte of every buffer outside the ops' destinations is zero.
    fn check_untouched_outside(&self, ops: &[WriteOp]) {
        for (i, buf) in self.bufs.iter().enumerate() {
            let mut covered: Vec<(usize, usize)> = ops
                .iter()
                .filter(|op| op.dst >= buf.addr() && op.dst < buf.addr() + buf.len as u64)
                .map(|op| ((op.dst - buf.addr()) as usize, op.len as usize))
                .collect();
            covered.sort_unstable();
            let mut at = 0;
            for (off, len) in covered.into_iter().chain([(buf.len, 0)]) {
                if off > at {
                    assert!(buf.bytes()[at..off].iter().all(|&b| b == 0), "buffer {i}: bytes {at}..{off} were written");
                }
                at = at.max(off + len);
            }
        }
    }

    fn all_zero(&self) -> bool {
        self.bufs.iter().all(|b| b.bytes().iter().all(|&x| x == 0))
    }
}

/// The destination ranges of `ops`, merged where they touch or overlap.
fn covering(ops: &[WriteOp]) -> Vec<MemoryRegion> {
    let mut ranges: Vec<(u64, u64)> = ops.iter().filter(|op| op.len > 0).map(|op| (op.dst, op.dst + op.len)).collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (start, end) in ranges {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged.into_iter().map(|(start, end)| MemoryRegion::new(start, end - start)).collect()
}

const PERIOD: usize = 251;
const BLOCK: usize = PERIOD * 256;

fn pattern_byte(seed: u64, i: usize) -> u8 {
    let shift = (seed % PERIOD as u64) as usize;
    let tag = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8;
    (((i + shift) % PERIOD) as u8) ^ tag
}

fn pattern_block(seed: u64) -> Vec<u8> {
    (0..BLOCK).map(|i| pattern_byte(seed, i)).collect()
}

fn fill_pattern(buf: &mut [u8], seed: u64) {
    if buf.len() <= 4096 {
        buf.iter_mut().enumerate().for_each(|(i, b)| *b = pattern_byte(seed, i));
        return;
    }
    let block = pattern_block(seed);
    for chunk in buf.chunks_mut(BLOCK) {
        chunk.copy_from_slice(&block[..chunk.len()]);
    }
}

fn has_pattern(buf: &[u8], seed: u64) -> bool {
    if buf.len() <= 4096 {
        return buf.iter().enumerate().all(|(i, &b)| b == pattern_byte(seed, i));
    }
    let block = pattern_block(seed);
    buf.chunks(BLOCK).all(|chunk| chunk == &block[..chunk.len()])
}

/// `count` ops of `len` bytes: sources packed from the start of buffer 0 of
/// `src`, destinations packed from the start of buffer 0 of `dst`.
fn packed_ops(src: &Node, dst: &Node, count: usize, len: usize) -> Vec<WriteOp> {
    (0..count).map(|k| WriteOp { src: src.addr(0, k * len), dst: dst.addr(0, k * len), len: len as u64 }).collect()
}

/// Writes `ops` from `a` to `b` under a grant over exactly their
/// destinations, and checks every byte.
async fn write_and_check(a: &mut Node, b: &Node, ops: &[WriteOp]) {
    a.fill_sources(ops);
    let grant = b.grant_for(ops).await;
    a.writer.batch_write(&b.endpoint(), &grant, ops).await.unwrap();
    b.writer.revoke(&grant.id).await;
    b.check_destinations(ops);
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_names_the_writers_protocol(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let a = h.node(&[4096]).await;
    let endpoint = a.endpoint();
    assert_eq!(endpoint.protocol, a.writer.protocol());
    assert!(!endpoint.address.is_empty());
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_op(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[1 << 16]).await;
    let b = h.node(&[1 << 16]).await;
    let ops = [WriteOp { src: a.addr(0, 100), dst: b.addr(0, 5000), len: 8192 }];
    write_and_check(&mut a, &b, &ops).await;
    b.check_untouched_outside(&ops);
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_ops(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[4 << 20]).await;
    let b = h.node(&[4 << 20]).await;
    let ops = packed_ops(&a, &b, 1000, 4096);
    write_and_check(&mut a, &b, &ops).await;
    b.check_untouched_outside(&ops);
}

/// Non-contiguous sources and destinations, odd lengths, destinations in
/// reverse order spread over two regions.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scattered_ops(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[2 << 20]).await;
    let b = h.node(&[1 << 20, 1 << 20]).await;
    let mut ops = Vec::new();
    let mut src_at = 0usize;
    let mut dst_end = [1usize << 20, 1 << 20];
    for k in 0..400usize {
        let len = 1 + (k * 7919) % 4000;
        let region = k % 2;
        let dst_at = dst_end[region] - len - 13;
        dst_end[region] = dst_at;
        ops.push(WriteOp { src: a.addr(0, src_at), dst: b.addr(region, dst_at), len: len as u64 });
        src_at += len + 7;
    }
    write_and_check(&mut a, &b, &ops).await;
    b.check_untouched_outside(&ops);
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_length_ops_and_empty_batch(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[1 << 16]).await;
    let b = h.node(&[1 << 16]).await;
    let grant = b.grant_all().await;
    a.writer.batch_write(&b.endpoint(), &grant, &[]).await.unwrap();
    let only_empty = [WriteOp { src: a.addr(0, 10), dst: b.addr(0, 20), len: 0 }];
    a.writer.batch_write(&b.endpoint(), &grant, &only_empty).await.unwrap();
    assert!(b.all_zero());
    let ops = [
        WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 0 },
        WriteOp { src: a.addr(0, 100), dst: b.addr(0, 1000), len: 300 },
        WriteOp { src: a.addr(0, 1 << 16), dst: b.addr(0, 1 << 16), len: 0 },
        WriteOp { src: a.addr(0, 500), dst: b.addr(0, 2000), len: 1 },
    ];
    a.fill_sources(&ops);
    a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap();
    b.check_destinations(&ops);
    b.check_untouched_outside(&ops);
}

/// 200,000 small ops in one batch, destinations strided and reversed.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_batch_of_small_ops(#[case] backend: Backend) {
    const COUNT: usize = 200_000;
    const LEN: usize = 64;
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[COUNT * LEN]).await;
    let b = h.node(&[COUNT * LEN * 2]).await;
    let ops: Vec<WriteOp> = (0..COUNT)
        .map(|k| WriteOp { src: a.addr(0, k * LEN), dst: b.addr(0, (COUNT - 1 - k) * LEN * 2), len: LEN as u64 })
        .collect();
    write_and_check(&mut a, &b, &ops).await;
    b.check_untouched_outside(&ops);
}

/// One 256 MiB op and three 8 MiB ones (destinations reversed) in one batch.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_ops(#[case] backend: Backend) {
    const MIB: usize = 1 << 20;
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[280 * MIB]).await;
    let b = h.node(&[256 * MIB, 24 * MIB]).await;
    let mut ops = vec![WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: (256 * MIB) as u64 }];
    for k in 0..3 {
        ops.push(WriteOp {
            src: a.addr(0, (256 + 8 * k) * MIB),
            dst: b.addr(1, (16 - 8 * k) * MIB),
            len: (8 * MIB) as u64,
        });
    }
    write_and_check(&mut a, &b, &ops).await;
}

/// The bad op of an out-of-range batch.
#[derive(Clone, Copy, Debug)]
enum BadDst {
    /// Starts at the end of the region.
    PastEnd,
    /// Starts inside, ends past the end.
    StraddlesEnd,
    /// Starts before the region, ends inside.
    StraddlesStart,
    /// `dst + len` overflows u64.
    Overflows,
    /// An address no region covers.
    Unregistered,
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destination_out_of_range_is_refused_whole(
    #[case] backend: Backend,
    #[values(BadDst::PastEnd, BadDst::StraddlesEnd, BadDst::StraddlesStart, BadDst::Overflows, BadDst::Unregistered)]
    bad: BadDst,
) {
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[1 << 16]).await;
    let b = h.node(&[1 << 16]).await;
    let end = b.addr(0, 1 << 16);
    let (dst, len) = match bad {
        BadDst::PastEnd => (end, 16),
        BadDst::StraddlesEnd => (end - 8, 16),
        BadDst::StraddlesStart => (b.addr(0, 0) - 8, 16),
        BadDst::Overflows => (u64::MAX - 8, 16),
        BadDst::Unregistered => (0x1000, 16),
    };
    let good = [
        WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 4096 },
        WriteOp { src: a.addr(0, 8192), dst: b.addr(0, 8192), len: 4096 },
    ];
    // The bad op's source (16 bytes inside `a`) is valid: only the peer can
    // refuse it. The grant covers all of `b`'s memory; the op is outside.
    let ops = [good[0], WriteOp { src: a.addr(0, 4096), dst, len }, good[1]];
    a.fill_sources(&ops);
    let grant = b.grant_all().await;
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    match &err {
        TransportError::Refused { reason, .. } => assert!(reason.contains("op 1"), "reason {reason:?} names no op"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(b.all_zero(), "a refused batch wrote bytes");
    // The refusal costs nothing else: the same pair keeps working.
    write_and_check(&mut a, &b, &good).await;
    b.check_untouched_outside(&good);
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_out_of_range_is_refused(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let a = h.node(&[1 << 16]).await;
    let b = h.node(&[1 << 16]).await;
    let end = a.addr(0, 1 << 16);
    let grant = b.grant_all().await;
    for (src, len) in [(end, 1), (end - 8, 16), (a.addr(0, 0) - 1, 2), (u64::MAX - 8, 16), (0x1000, 8)] {
        let ops = [WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 64 }, WriteOp { src, dst: b.addr(0, 64), len }];
        let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
        assert!(
            matches!(err, TransportError::SourceOutOfBounds { addr, len: l } if addr == src && l == len),
            "source {src:#x}+{len}: unexpected {err:?}"
        );
    }
    assert!(b.all_zero());
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_protocol_and_bad_address_are_refused(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let a = h.node(&[4096]).await;
    let b = h.node(&[4096]).await;
    let ops = [WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 16 }];
    let grant = b.grant_for(&ops).await;
    let other = match a.writer.protocol() {
        Protocol::Quic => Protocol::Rdma,
        _ => Protocol::Quic,
    };
    let wrong = Endpoint { protocol: other, ..b.endpoint() };
    let err = a.writer.batch_write(&wrong, &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::WrongProtocol { .. }), "{err:?}");
    let bad = Endpoint { address: "no port here".to_owned(), ..b.endpoint() };
    let err = a.writer.batch_write(&bad, &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::BadEndpoint { .. }), "{err:?}");
    assert!(b.all_zero());
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_regions_are_refused(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let a = h.node(&[8192]).await;
    let overlapping = MemoryRegion::new(a.addr(0, 4096), 8192);
    // SAFETY: the registration is refused, so nothing ever touches the range.
    let err = unsafe { a.writer.register_regions(&[overlapping], RegionAccess::Destination) }.unwrap_err();
    assert!(matches!(err, TransportError::Registration(_)), "{err:?}");
    // SAFETY: as above; a zero-length region is refused.
    let err = unsafe { a.writer.register_regions(&[MemoryRegion::new(a.addr(0, 0), 0)], RegionAccess::Destination) }
        .unwrap_err();
    assert!(matches!(err, TransportError::Registration(_)), "{err:?}");
}

/// How a peer goes away.
#[derive(Clone, Copy, Debug)]
enum Gone {
    ShutDown,
    Dropped,
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writing_to_a_gone_peer_fails_within_the_bound(
    #[case] backend: Backend,
    #[values(Gone::ShutDown, Gone::Dropped)] gone: Gone,
) {
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[1 << 16]).await;
    let b = h.node(&[1 << 16]).await;
    let ops = packed_ops(&a, &b, 4, 1024);
    // A first batch leaves a pooled connection behind where there are any.
    write_and_check(&mut a, &b, &ops).await;
    let endpoint = b.endpoint();
    let grant = b.grant_for(&ops).await;
    match gone {
        Gone::ShutDown => {
            b.writer.shutdown().await;
            // Keep the shut-down writer (and its memory) alive; it must not serve.
            let result = tokio::time::timeout(h.failure_bound(), a.writer.batch_write(&endpoint, &grant, &ops)).await;
            assert_dead_peer_error(result.expect("the batch did not fail within the bound"));
            drop(b);
        }
        Gone::Dropped => {
            drop(b);
            let result = tokio::time::timeout(h.failure_bound(), a.writer.batch_write(&endpoint, &grant, &ops)).await;
            assert_dead_peer_error(result.expect("the batch did not fail within the bound"));
        }
    }
}

fn assert_dead_peer_error(result: Result<(), TransportError>) {
    let err = result.expect_err("a batch to a gone peer succeeded");
    assert!(
        matches!(
            err,
            TransportError::Connect { .. }
                | TransportError::PeerClosed { .. }
                | TransportError::Io { .. }
                | TransportError::Timeout { .. }
        ),
        "unexpected error for a gone peer: {err:?}"
    );
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_writer_refuses_work(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let a = h.node(&[4096]).await;
    let b = h.node(&[4096]).await;
    let ops = [WriteOp { src: a.addr(0, 0), dst: b.addr(0, 0), len: 16 }];
    let grant = b.grant_for(&ops).await;
    a.writer.shutdown().await;
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
    let extra = TestBuf::new(4096);
    // SAFETY: refused (the writer is shut down), so the buffer is never used.
    let err = unsafe { a.writer.register_regions(&[extra.region()], RegionAccess::Destination) }.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
    let err = a.writer.grant(&[MemoryRegion::new(a.addr(0, 0), 16)], GRANT_TTL).await.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
    assert!(b.all_zero());
}

/// Eight batches in flight at once from one writer to one peer.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_to_one_peer(#[case] backend: Backend) {
    const BATCHES: usize = 8;
    const OPS: usize = 512;
    const LEN: usize = 2048;
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[BATCHES * OPS * LEN]).await;
    let b = h.node(&[BATCHES * OPS * LEN * 2]).await;
    let all = packed_ops(&a, &b, BATCHES * OPS, LEN);
    // Scatter: every other slot of the destination, so batches interleave.
    let all: Vec<WriteOp> =
        all.iter().enumerate().map(|(k, op)| WriteOp { dst: b.addr(0, k * LEN * 2), ..*op }).collect();
    a.fill_sources(&all);
    let mut tasks = JoinSet::new();
    for chunk in all.chunks(OPS) {
        // One grant per batch, as one pull per transfer request.
        let grant = b.grant_for(chunk).await;
        let (writer, endpoint, ops) = (Arc::clone(&a.writer), b.endpoint(), chunk.to_vec());
        tasks.spawn(async move { writer.batch_write(&endpoint, &grant, &ops).await });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.unwrap().unwrap();
    }
    b.check_destinations(&all);
    b.check_untouched_outside(&all);
}

/// Four writers write into distinct ranges of one receiver at once.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_peers_into_one_receiver(#[case] backend: Backend) {
    const SENDERS: usize = 4;
    const OPS: usize = 1024;
    const LEN: usize = 1024;
    let Some(mut h) = Harness::new(backend) else { return };
    let b = h.node(&[SENDERS * OPS * LEN]).await;
    let mut senders = Vec::new();
    let mut all = Vec::new();
    for s in 0..SENDERS {
        let mut a = h.node(&[OPS * LEN]).await;
        // Sender s owns every SENDERS-th slot, starting at slot s.
        let ops: Vec<WriteOp> = (0..OPS)
            .map(|k| WriteOp { src: a.addr(0, k * LEN), dst: b.addr(0, (k * SENDERS + s) * LEN), len: LEN as u64 })
            .collect();
        // Seeds must differ between senders: offset each sender's op index.
        for (k, op) in ops.iter().enumerate() {
            fill_pattern(a.slice_mut(op.src, op.len), (s * OPS + k) as u64);
        }
        all.extend(ops.iter().copied());
        senders.push((a, ops));
    }
    let mut tasks = JoinSet::new();
    for (a, ops) in &senders {
        let grant = b.grant_for(ops).await;
        let (writer, endpoint, ops) = (Arc::clone(&a.writer), b.endpoint(), ops.clone());
        tasks.spawn(async move { writer.batch_write(&endpoint, &grant, &ops).await });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.unwrap().unwrap();
    }
    for (s, (_, ops)) in senders.iter().enumerate() {
        for (k, op) in ops.iter().enumerate() {
            assert!(has_pattern(b.slice(op.dst, op.len), (s * OPS + k) as u64), "sender {s} op {k} landed wrong");
        }
    }
    b.check_untouched_outside(&all);
}

/// How a batch lacks a live grant.
#[derive(Clone, Copy, Debug)]
enum NoGrant {
    /// An id the receiver never issued.
    Forged,
    /// A grant the receiver revoked.
    Revoked,
    /// A grant whose validity ran out.
    Expired,
    /// A live grant of another receiver.
    Elsewhere,
}

/// A batch without a live grant of the receiver lands nothing, and the
/// same pair keeps working under a real one.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_without_a_live_grant_is_refused_whole(
    #[case] backend: Backend,
    #[values(NoGrant::Forged, NoGrant::Revoked, NoGrant::Expired, NoGrant::Elsewhere)] how: NoGrant,
) {
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[1 << 16]).await;
    let b = h.node(&[1 << 16]).await;
    let c = h.node(&[1 << 16]).await;
    let ops = packed_ops(&a, &b, 8, 2048);
    a.fill_sources(&ops);
    let grant = match how {
        NoGrant::Forged => Grant::plain(GrantId::random().unwrap()),
        NoGrant::Revoked => {
            let grant = b.grant_for(&ops).await;
            b.writer.revoke(&grant.id).await;
            grant
        }
        NoGrant::Expired => b.writer.grant(&covering(&ops), Duration::ZERO).await.unwrap(),
        NoGrant::Elsewhere => c.grant_all().await,
    };
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{how:?}: expected Refused, got {err:?}");
    assert!(b.all_zero(), "{how:?}: a batch without a live grant wrote bytes");
    write_and_check(&mut a, &b, &ops).await;
}

/// Where an op outside the grant points.
#[derive(Clone, Copy, Debug)]
enum OutsideGrant {
    /// A destination region the grant does not cover.
    UngrantedDestination,
    /// A region the receiver registered only as a source.
    SourceRegion,
    /// One byte past the grant's last range.
    PastTheGrant,
}

/// An op outside the grant (though perhaps inside registered memory) makes
/// the whole batch refused; a large batch too (transports that spread a
/// batch over several connections must still refuse it whole).
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_op_outside_the_grant_is_refused_whole(
    #[case] backend: Backend,
    #[values(OutsideGrant::UngrantedDestination, OutsideGrant::SourceRegion, OutsideGrant::PastTheGrant)]
    outside: OutsideGrant,
    #[values(64 * 1024, 32 << 20)] batch_bytes: usize,
) {
    let Some(mut h) = Harness::new(backend) else { return };
    let size = batch_bytes * 2;
    let mut a = h.node_with(&[size], &[RegionAccess::Source]).await;
    // Buffer 0: destinations; buffer 1: a source region of the receiver.
    let b = h.node_with(&[size, 4096], &[]).await;
    let b_regions: Vec<MemoryRegion> = b.bufs.iter().map(TestBuf::region).collect();
    // SAFETY: as in `Harness::node_with`: the buffers outlive the writer.
    unsafe {
        b.writer.register_regions(&b_regions[..1], RegionAccess::Destination).unwrap();
        b.writer.register_regions(&b_regions[1..], RegionAccess::Source).unwrap();
    }
    let ops = packed_ops(&a, &b, 16, batch_bytes / 16);
    let grant = b.grant_for(&ops).await;
    let bad_dst = match outside {
        OutsideGrant::UngrantedDestination => b.addr(0, size - 4096),
        OutsideGrant::SourceRegion => b.addr(1, 0),
        OutsideGrant::PastTheGrant => b.addr(0, batch_bytes),
    };
    let mut bad = ops.clone();
    bad.push(WriteOp { src: a.addr(0, batch_bytes), dst: bad_dst, len: 16 });
    a.fill_sources(&bad);
    let err = a.writer.batch_write(&b.endpoint(), &grant, &bad).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{outside:?}: expected Refused, got {err:?}");
    assert!(b.all_zero(), "{outside:?}: a batch with an op outside its grant wrote bytes");
    // A grant can never cover a source region.
    let err = b.writer.grant(&b_regions[1..], GRANT_TTL).await.unwrap_err();
    assert!(matches!(err, TransportError::Grant(_)), "{err:?}");
    // The grant itself is still good.
    a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap();
    b.check_destinations(&ops);
    b.check_untouched_outside(&ops);
}

/// A writer that registered only sources (a prefill-only instance) accepts
/// no write: it has nothing to grant, and no forged grant opens it.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_only_writer_accepts_no_writes(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let p = h.node_with(&[1 << 16], &[RegionAccess::Source]).await;
    let mut hostile = h.node(&[1 << 16]).await;
    let ops = packed_ops(&hostile, &p, 4, 1024);
    hostile.fill_sources(&ops);
    let err = p.writer.grant(&covering(&ops), GRANT_TTL).await.unwrap_err();
    assert!(matches!(err, TransportError::Grant(_)), "a source-only writer granted its sources: {err:?}");
    let forged = Grant::plain(GrantId::random().unwrap());
    let err = hostile.writer.batch_write(&p.endpoint(), &forged, &ops).await.unwrap_err();
    assert!(
        matches!(err, TransportError::Refused { .. } | TransportError::Connect { .. }),
        "expected a refusal, got {err:?}"
    );
    assert!(p.all_zero(), "a peer wrote into a sender's source memory");
}

/// A hostile peer's refused batches cost an honest peer nothing: both write
/// into one receiver at once; the honest one's batch lands, the hostile
/// ones land nothing.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_honest_peer_is_unaffected_by_a_hostile_one(#[case] backend: Backend) {
    const OPS: usize = 256;
    const LEN: usize = 4096;
    let Some(mut h) = Harness::new(backend) else { return };
    let b = h.node(&[2 * OPS * LEN]).await;
    let mut honest = h.node(&[OPS * LEN]).await;
    let mut hostile = h.node(&[OPS * LEN]).await;
    let honest_ops = packed_ops(&honest, &b, OPS, LEN);
    honest.fill_sources(&honest_ops);
    let hostile_ops: Vec<WriteOp> = (0..OPS)
        .map(|k| WriteOp { src: hostile.addr(0, k * LEN), dst: b.addr(0, (OPS + k) * LEN), len: LEN as u64 })
        .collect();
    hostile.fill_sources(&hostile_ops);
    let grant = b.grant_for(&honest_ops).await;
    let forged = Grant::plain(GrantId::random().unwrap());
    let mut tasks = JoinSet::new();
    for attempt in 0..4 {
        // Alternately a forged grant, and the honest grant stolen for ops outside it.
        let used = if attempt % 2 == 0 { forged.clone() } else { grant.clone() };
        let (writer, endpoint, ops) = (Arc::clone(&hostile.writer), b.endpoint(), hostile_ops.clone());
        tasks.spawn(async move { (false, writer.batch_write(&endpoint, &used, &ops).await) });
    }
    let (writer, endpoint, ops) = (Arc::clone(&honest.writer), b.endpoint(), honest_ops.clone());
    let honest_grant = grant.clone();
    tasks.spawn(async move { (true, writer.batch_write(&endpoint, &honest_grant, &ops).await) });
    while let Some(joined) = tasks.join_next().await {
        match joined.unwrap() {
            (true, result) => result.unwrap(),
            (false, result) => {
                let err = result.unwrap_err();
                assert!(matches!(err, TransportError::Refused { .. }), "hostile batch: {err:?}");
            }
        }
    }
    b.check_destinations(&honest_ops);
    b.check_untouched_outside(&honest_ops);
}

/// Revocation is a fence: a batch racing `revoke` either completed before
/// it returned or lands nothing after; a batch sent after it is refused.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_is_a_fence(#[case] backend: Backend) {
    const SIZE: usize = 64 << 20;
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[SIZE]).await;
    let b = h.node(&[SIZE]).await;
    let ops = packed_ops(&a, &b, 64, SIZE / 64);
    a.fill_sources(&ops);
    let grant = b.grant_for(&ops).await;
    let (writer, endpoint, batch_ops, batch_grant) = (Arc::clone(&a.writer), b.endpoint(), ops.clone(), grant.clone());
    let batch = tokio::spawn(async move { writer.batch_write(&endpoint, &batch_grant, &batch_ops).await });
    // Let the batch get going, then revoke in the middle of it (or after it,
    // on a fast machine: the assertions hold either way).
    tokio::task::yield_now().await;
    b.writer.revoke(&grant.id).await;
    let at_revoke: Vec<u8> = b.bufs[0].bytes().to_vec();
    let result = batch.await.unwrap();
    assert_eq!(b.bufs[0].bytes(), &at_revoke[..], "bytes landed after revoke returned (result {result:?})");
    if result.is_ok() {
        b.check_destinations(&ops);
    }
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "a batch after revoke: {err:?}");
    assert_eq!(b.bufs[0].bytes(), &at_revoke[..], "a batch after revoke wrote bytes");
}

/// `close` ends all access at once: no grant survives it, nothing is served.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_ends_every_grant(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[1 << 16]).await;
    let b = h.node(&[1 << 16]).await;
    let ops = packed_ops(&a, &b, 4, 1024);
    a.fill_sources(&ops);
    let grant = b.grant_for(&ops).await;
    b.writer.close();
    let result = tokio::time::timeout(h.failure_bound(), a.writer.batch_write(&b.endpoint(), &grant, &ops))
        .await
        .expect("the batch did not fail within the bound");
    assert!(result.is_err(), "a closed writer accepted a batch");
    assert!(b.all_zero(), "a closed writer let bytes land");
}

/// Two ops of one batch writing the same bytes is always a sender's bug:
/// the batch is refused whole, in any op order.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[case::rdma(Backend::Rdma)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_writes_in_one_batch_are_refused_whole(#[case] backend: Backend) {
    let Some(mut h) = Harness::new(backend) else { return };
    let mut a = h.node(&[1 << 16]).await;
    let b = h.node(&[1 << 16]).await;
    let ops = [
        WriteOp { src: a.addr(0, 0), dst: b.addr(0, 8192), len: 4096 },
        WriteOp { src: a.addr(0, 4096), dst: b.addr(0, 0), len: 4096 },
        WriteOp { src: a.addr(0, 8192), dst: b.addr(0, 10240), len: 4096 },
    ];
    a.fill_sources(&ops);
    let grant = b.grant_all().await;
    let err = a.writer.batch_write(&b.endpoint(), &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "expected Refused, got {err:?}");
    assert!(b.all_zero(), "a batch with overlapping writes wrote bytes");
    write_and_check(&mut a, &b, &ops[..2]).await;
}
