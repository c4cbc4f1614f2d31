//! Workers, caches and data planes shared by the end-to-end tests.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kv_proto::{
    BatchWriter, BlockId, ConnectorMetadata, Endpoint, Grant, GrantId, KvRole, LayoutKind, MemoryRegion, Protocol,
    RecvReqMeta, RegionAccess, RemotePrefill, RenewalKey, RenewalSecret, ReqId, SendUpdate, TransportError, WriteOp,
};
use kv_worker::in_memory::InMemoryNetwork;
use kv_worker::{pattern, CacheDims, CacheShape, DataEndpointPolicy, Finished, OwnedKvCache, Worker, WorkerConfig};
use tokio::sync::Semaphore;
/// Upper bound on any wait here (never reached when things work; generous
/// for the RDMA tests' emulated device).
pub const BOUND: Duration = Duration::from_secs(60);

pub fn shape() -> CacheShape {
    CacheShape::try_new(CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers: 2,
        num_blocks: 16,
        block_size: 16,
        num_kv_heads: 2,
        head_dim: 16,
        dtype_bytes: 2,
    })
    .unwrap()
}

/// A worker over a library-allocated cache and the given writer.
pub struct Instance {
    pub worker: Worker,
    pub cache: Arc<OwnedKvCache>,
}

pub async fn start(config: WorkerConfig, writer: Arc<dyn BatchWriter>) -> Instance {
    let cache = Arc::new(OwnedKvCache::allocate(shape()).unwrap());
    // SAFETY: `cache` outlives the worker (the instance drops the worker
    // first, which closes the writer), and the test reads blocks only after
    // they were reported.
    let worker = unsafe { Worker::start_with_writer(config, cache.registered().clone(), writer) }.await.unwrap();
    Instance { worker, cache }
}

/// A worker over a cache of `shape` it allocates itself, with the transport
/// `config` names.
pub async fn start_owned(config: WorkerConfig, shape: CacheShape) -> Instance {
    let cache = Arc::new(OwnedKvCache::allocate(shape).unwrap());
    let worker = Worker::start(config, Arc::clone(&cache)).await.unwrap();
    Instance { worker, cache }
}

/// A data plane under test.
#[derive(Clone, Copy, Debug)]
pub enum Backend {
    InMemory,
    Tcp,
    Quic,
}

/// Makes workers' configs and writers for one backend.
pub struct Net {
    pub backend: Backend,
    pub mem: InMemoryNetwork,
}

impl Net {
    /// `None` when the backend is not compiled in (the test passes vacuously).
    pub fn new(backend: Backend) -> Option<Self> {
        let compiled = match backend {
            Backend::InMemory => true,
            Backend::Tcp => cfg!(feature = "tcp"),
            Backend::Quic => cfg!(feature = "quic"),
        };
        compiled.then(|| Self { backend, mem: InMemoryNetwork::new() })
    }

    pub fn config(&self, role: KvRole, name: &str) -> WorkerConfig {
        let base = WorkerConfig::loopback(role, name);
        match self.backend {
            // In-memory endpoints are not host:port.
            Backend::InMemory => WorkerConfig { data_endpoint_policy: DataEndpointPolicy::Any, ..base },
            Backend::Tcp => WorkerConfig { protocol: Protocol::Tcp, ..base },
            Backend::Quic => WorkerConfig { protocol: Protocol::Quic, ..base },
        }
    }

    pub async fn writer(&self, role: KvRole, name: &str) -> Arc<dyn BatchWriter> {
        match self.backend {
            Backend::InMemory => self.mem.writer(name),
            Backend::Tcp | Backend::Quic => kv_worker::transport::open(&self.config(role, name)).await.unwrap(),
        }
    }
}

/// Writes request `seed`'s KV into `blocks` of every region (prompt positions from 0).
pub fn fill(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) {
    let mut buf = vec![0u8; cache.block_len()];
    for region in 0..cache.shape().region_count() {
        for (position, &block) in blocks.iter().enumerate() {
            pattern::fill(&mut buf, pattern::block_seed(seed, region, position as u32));
            // SAFETY: no transfer reads or writes these blocks while the test fills them.
            unsafe { cache.write_block(region as usize, block, &buf) }.unwrap();
        }
    }
}

/// `block` of `region`, copied out.
pub fn read(cache: &OwnedKvCache, region: u32, block: BlockId) -> Vec<u8> {
    let mut buf = vec![0u8; cache.block_len()];
    // SAFETY: the test reads only blocks whose pull was reported (or never
    // started): no transfer writes them any more.
    unsafe { cache.read_block(region as usize, block, &mut buf) }.unwrap();
    buf
}

/// Whether `blocks` hold request `seed`'s KV in every region.
pub fn holds(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) -> bool {
    (0..cache.shape().region_count()).all(|region| {
        blocks.iter().enumerate().all(|(position, &block)| {
            pattern::matches(&read(cache, region, block), pattern::block_seed(seed, region, position as u32))
        })
    })
}

pub fn all_zero(cache: &OwnedKvCache, blocks: &[BlockId]) -> bool {
    (0..cache.shape().region_count())
        .all(|region| blocks.iter().all(|&block| read(cache, region, block).iter().all(|&b| b == 0)))
}

/// P's id of the request D calls `req`: engines name their copies of a
/// request differently, and so do these tests (P's id never equals D's).
pub fn p_id(req: &str) -> ReqId {
    ReqId::new(format!("p-{req}"))
}

/// The renewal key P's scheduler gives request `p_id(req)`.
pub fn renewal_key(req: &str) -> RenewalKey {
    RenewalSecret::from_bytes([0x11; 32]).key_for(&p_id(req))
}

/// What D's metadata names as the prefill of `req` at `host:port`, with
/// the renewal key P gave it.
pub fn remote(host: &str, port: u16, req: &str) -> RemotePrefill {
    RemotePrefill {
        remote_host: host.into(),
        remote_port: port,
        remote_request_id: p_id(req),
        remote_engine_id: None,
        remote_renewal_key: Some(renewal_key(req)),
        bootstrap: None,
    }
}

/// P's request `p_id(req)` finished prefill into `blocks` (its renewal
/// key comes with it, as P's scheduler sends it).
pub fn ready(p: &Instance, req: &str, blocks: &[BlockId]) {
    let mut meta = ConnectorMetadata::default();
    meta.reqs_to_send.insert(p_id(req), SendUpdate::Ready { block_ids: blocks.to_vec() });
    meta.renewal_keys.insert(p_id(req), renewal_key(req));
    p.worker.start_load_kv(&meta);
}

/// P's request `p_id(req)` is scheduled for a remote decode.
pub fn expect(p: &Instance, req: &str) {
    let mut meta = ConnectorMetadata::default();
    meta.reqs_to_send.insert(p_id(req), SendUpdate::Expect);
    p.worker.start_load_kv(&meta);
}

/// D pulls `pulls` (D's request, D's blocks) from the side channel at
/// `host:port`, naming each to P by [`p_id`].
pub fn pull(d: &Instance, host: &str, port: u16, pulls: &[(&str, &[BlockId])]) {
    let reqs_to_recv = pulls
        .iter()
        .map(|(req, blocks)| {
            let meta =
                RecvReqMeta { local_block_ids: blocks.to_vec(), first_token: None, remote: remote(host, port, req) };
            (ReqId::new(*req), meta)
        })
        .collect::<BTreeMap<_, _>>();
    d.worker.start_load_kv(&ConnectorMetadata { reqs_to_recv, ..ConnectorMetadata::default() });
}

/// Collects what `worker` reports until `done` says enough, within [`BOUND`].
pub async fn until(worker: &Worker, mut done: impl FnMut(&Finished) -> bool) -> Finished {
    let deadline = Instant::now() + BOUND;
    let mut all = Finished::default();
    while !done(&all) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "nothing more reported within {BOUND:?}: {all:?}");
        let f = worker.next_finished(left).await;
        all.sending.extend(f.sending);
        all.receiving.extend(f.receiving);
        all.failed_receiving.extend(f.failed_receiving);
    }
    assert!(Instant::now() < deadline, "reported only at the bound: a wake-up was missed ({all:?})");
    all
}

/// Polls `worker`'s metrics until `done` holds (a counter a server task
/// bumps after the client saw the outcome), within [`BOUND`].
pub async fn metrics_until(
    worker: &Worker,
    done: impl Fn(&kv_worker::metrics::MetricsSnapshot) -> bool,
) -> kv_worker::metrics::MetricsSnapshot {
    let deadline = Instant::now() + BOUND;
    loop {
        let metrics = worker.metrics();
        if done(&metrics) {
            return metrics;
        }
        assert!(Instant::now() < deadline, "metrics never got there: {metrics:#?}");
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Starts an instance's workers on consecutive side-channel ports: runs
/// `start(base)` from `first`, then `first + stride`, and so on, until it
/// returns the started workers. `start` answers `None` when a port from
/// that base was taken (another test's worker holds it).
pub async fn on_free_ports<T, F>(first: u16, stride: u16, mut start: impl FnMut(u16) -> F) -> (u16, T)
where
    F: std::future::Future<Output = Option<T>>,
{
    for attempt in 0..20u16 {
        let base = first + attempt * stride;
        if let Some(started) = start(base).await {
            return (base, started);
        }
    }
    panic!("no free run of side-channel ports");
}

pub fn side_channel(p: &Instance) -> (String, u16) {
    let addr = p.worker.side_channel_addr().unwrap();
    (addr.ip().to_string(), addr.port())
}

/// A writer that holds its first `held` batches until the test opens the
/// gate, then behaves like the writer it wraps.
pub struct GatedWriter {
    inner: Arc<dyn BatchWriter>,
    gate: Semaphore,
    held: AtomicUsize,
    waiting: tokio::sync::Notify,
    waiting_count: AtomicUsize,
}

impl GatedWriter {
    pub fn new(inner: Arc<dyn BatchWriter>, held: usize) -> Arc<Self> {
        Arc::new(Self {
            inner,
            gate: Semaphore::new(0),
            held: AtomicUsize::new(held),
            waiting: tokio::sync::Notify::new(),
            waiting_count: AtomicUsize::new(0),
        })
    }

    /// Waits until `n` batches are held at the gate.
    pub async fn until_held(&self, n: usize) {
        tokio::time::timeout(BOUND, async {
            loop {
                let changed = self.waiting.notified();
                if self.waiting_count.load(Ordering::SeqCst) >= n {
                    return;
                }
                changed.await;
            }
        })
        .await
        .expect("no batch reached the gate");
    }

    pub fn open(&self) {
        self.gate.add_permits(Semaphore::MAX_PERMITS / 2);
    }
}

#[async_trait]
impl BatchWriter for GatedWriter {
    fn protocol(&self) -> Protocol {
        self.inner.protocol()
    }
    unsafe fn register_regions(&self, regions: &[MemoryRegion], access: RegionAccess) -> Result<(), TransportError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.inner.register_regions(regions, access) }
    }
    fn endpoint(&self) -> Endpoint {
        self.inner.endpoint()
    }
    async fn grant(&self, ranges: &[MemoryRegion], valid_for: Duration) -> Result<Grant, TransportError> {
        self.inner.grant(ranges, valid_for).await
    }
    async fn revoke(&self, grant: &GrantId) {
        self.inner.revoke(grant).await;
    }
    async fn batch_write(&self, peer: &Endpoint, grant: &Grant, ops: &[WriteOp]) -> Result<(), TransportError> {
        let hold = self.held.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if hold {
            self.waiting_count.fetch_add(1, Ordering::SeqCst);
            self.waiting.notify_waiters();
            let _permit = self.gate.acquire().await.expect("gate closed");
        }
        self.inner.batch_write(peer, grant, ops).await
    }
    fn close(&self) {
        self.inner.close();
    }
    async fn shutdown(&self) {
        self.inner.shutdown().await;
    }
}
