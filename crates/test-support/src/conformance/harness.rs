//! What the cases stand on: a [`Backend`] makes writers, the [`Harness`]
//! gives each one registered buffers ([`Peer`]), and the checks look at
//! every byte that should land and every byte that must not.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kv_proto::{BatchWriter, Endpoint, Grant, MemoryRegion, RegionAccess, TransportError, WriteOp};

use crate::{pattern, TestBuf};

/// The connect timeout a network backend's writers should be given.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The I/O timeout a network backend's writers should be given.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a batch to a gone peer may take to fail on a network backend
/// built with [`CONNECT_TIMEOUT`] and [`IO_TIMEOUT`]: a stale pooled
/// connection, then a new connection attempt, with slack.
pub const NETWORK_FAILURE_BOUND: Duration = Duration::from_secs(2 * (CONNECT_TIMEOUT.as_secs() + IO_TIMEOUT.as_secs()));
/// Validity of the grants the cases issue (never reached when things work).
pub const GRANT_TTL: Duration = Duration::from_secs(120);

/// A `BatchWriter` implementation under test: it makes writers that reach
/// each other.
pub trait Backend {
    /// A new writer with no regions, reachable from (and reaching) every
    /// writer this backend made before.
    fn writer(&mut self) -> impl Future<Output = Arc<dyn BatchWriter>>;

    /// How long a batch to a peer that shut down or was dropped may take
    /// to fail ([`NETWORK_FAILURE_BOUND`] for a network backend).
    fn failure_bound(&self) -> Duration;
}

/// A network backend: `bind` makes a writer listening on loopback (with
/// [`CONNECT_TIMEOUT`] and [`IO_TIMEOUT`]), which any other reaches.
pub struct Network<F>(pub F);

impl<F, Fut> Backend for Network<F>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Arc<dyn BatchWriter>>,
{
    fn writer(&mut self) -> impl Future<Output = Arc<dyn BatchWriter>> {
        (self.0)()
    }

    fn failure_bound(&self) -> Duration {
        NETWORK_FAILURE_BOUND
    }
}

/// Makes writers of one backend with registered buffers.
pub struct Harness<B> {
    backend: B,
}

impl<B: Backend> Harness<B> {
    /// A harness over `backend`.
    pub fn new(backend: B) -> Self {
        Self { backend }
    }

    /// A writer with one zeroed buffer per entry of `sizes`, registered both
    /// as sources and as destinations (a `kv_both` instance).
    pub async fn peer(&mut self, sizes: &[usize]) -> Peer {
        self.peer_with(sizes, &[RegionAccess::Source, RegionAccess::Destination]).await
    }

    /// A writer with one zeroed buffer per entry of `sizes`, registered with
    /// each of `accesses`.
    pub async fn peer_with(&mut self, sizes: &[usize], accesses: &[RegionAccess]) -> Peer {
        let writer = self.backend.writer().await;
        let bufs: Vec<TestBuf> = sizes.iter().map(|&len| TestBuf::new(len)).collect();
        let regions: Vec<MemoryRegion> = bufs.iter().map(TestBuf::region).collect();
        for &access in accesses {
            // SAFETY: the buffers live in the returned `Peer`, which drops
            // its writer (closing it) before them; nobody reads a
            // destination while a grant over it is live (the cases look
            // only after `batch_write` returned or the grant was revoked).
            unsafe { writer.register_regions(&regions, access) }.unwrap();
        }
        Peer { writer, bufs }
    }

    /// How long a batch to a gone peer may take to fail.
    pub fn failure_bound(&self) -> Duration {
        self.backend.failure_bound()
    }
}

/// A writer and its registered buffers. Field order matters: the writer is
/// dropped (and stops touching memory) before the buffers are freed.
pub struct Peer {
    /// The writer.
    pub writer: Arc<dyn BatchWriter>,
    /// Its buffers, in the order they were asked for.
    pub bufs: Vec<TestBuf>,
}

impl Peer {
    /// Where other writers reach it.
    pub fn endpoint(&self) -> Endpoint {
        self.writer.endpoint()
    }

    /// A grant over `ranges`, valid for [`GRANT_TTL`].
    pub async fn grant(&self, ranges: &[MemoryRegion]) -> Grant {
        self.writer.grant(ranges, GRANT_TTL).await.unwrap()
    }

    /// A grant over exactly the destinations of `ops` (zero-length ops add nothing).
    pub async fn grant_for(&self, ops: &[WriteOp]) -> Grant {
        self.grant(&pattern::covering(ops)).await
    }

    /// A grant over every buffer.
    pub async fn grant_all(&self) -> Grant {
        let all: Vec<MemoryRegion> = self.bufs.iter().map(TestBuf::region).collect();
        self.grant(&all).await
    }

    /// The address of byte `offset` of buffer `buf`.
    pub fn addr(&self, buf: usize, offset: usize) -> u64 {
        self.bufs[buf].at(offset)
    }

    fn locate(&self, addr: u64, len: u64) -> (usize, usize) {
        let i = self
            .bufs
            .iter()
            .position(|b| addr >= b.addr() && addr + len <= b.end())
            .unwrap_or_else(|| panic!("{addr:#x}+{len} is in no buffer"));
        (i, (addr - self.bufs[i].addr()) as usize)
    }

    /// The bytes at `[addr, addr + len)`, inside one buffer.
    pub fn slice(&self, addr: u64, len: u64) -> &[u8] {
        let (i, off) = self.locate(addr, len);
        &self.bufs[i].bytes()[off..off + len as usize]
    }

    /// The bytes at `[addr, addr + len)`, inside one buffer, to fill.
    pub fn slice_mut(&mut self, addr: u64, len: u64) -> &mut [u8] {
        let (i, off) = self.locate(addr, len);
        &mut self.bufs[i].bytes_mut()[off..off + len as usize]
    }

    /// Fills each op's source range with its pattern (seed = op index).
    pub fn fill_sources(&mut self, ops: &[WriteOp]) {
        for (k, op) in ops.iter().enumerate() {
            pattern::fill_slice(self.slice_mut(op.src, op.len), k as u64);
        }
    }

    /// Checks each op's destination range holds its pattern.
    pub fn check_destinations(&self, ops: &[WriteOp]) {
        for (k, op) in ops.iter().enumerate() {
            assert!(pattern::holds(self.slice(op.dst, op.len), k as u64), "op {k} ({op:?}) landed wrong");
        }
    }

    /// Checks every byte of every buffer outside the ops' destinations is zero.
    pub fn check_untouched_outside(&self, ops: &[WriteOp]) {
        for (i, buf) in self.bufs.iter().enumerate() {
            let mut covered: Vec<(usize, usize)> = ops
                .iter()
                .filter(|op| op.dst >= buf.addr() && op.dst < buf.end())
                .map(|op| ((op.dst - buf.addr()) as usize, op.len as usize))
                .collect();
            covered.sort_unstable();
            let mut at = 0;
            for (off, len) in covered.into_iter().chain([(buf.len(), 0)]) {
                if off > at {
                    assert!(buf.bytes()[at..off].iter().all(|&b| b == 0), "buffer {i}: bytes {at}..{off} were written");
                }
                at = at.max(off + len);
            }
        }
    }

    /// Whether no byte of any buffer was written.
    pub fn all_zero(&self) -> bool {
        self.bufs.iter().all(TestBuf::is_zero)
    }
}

/// `count` ops of `len` bytes: sources packed from the start of buffer 0 of
/// `src`, destinations packed from the start of buffer 0 of `dst`.
pub fn packed_ops(src: &Peer, dst: &Peer, count: usize, len: usize) -> Vec<WriteOp> {
    pattern::packed_ops(&src.bufs[0], &dst.bufs[0], count, len)
}

/// Writes `ops` from `a` to `b` under a grant over exactly their
/// destinations, and checks every byte.
pub async fn write_and_check(a: &mut Peer, b: &Peer, ops: &[WriteOp]) {
    a.fill_sources(ops);
    let grant = b.grant_for(ops).await;
    a.writer.batch_write(&b.endpoint(), &grant, ops).await.unwrap();
    b.writer.revoke(&grant.id).await;
    b.check_destinations(ops);
}

/// Asserts a batch to a gone peer failed as a dead peer does.
pub fn assert_dead_peer_error(result: Result<(), TransportError>) {
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
