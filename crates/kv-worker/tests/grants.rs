//! The holes a review found, end to end through real workers: a late write
//! into blocks D already reused, a side channel cut mid-batch, one slow
//! request starving its batch, and writing past D's wait budget.
//!
//! The data plane is the in-memory transport, so the test can hold P's
//! write at the door (a gate in front of `batch_write`) and let it through
//! after D gave up: exactly a P that waited for a transfer slot, or was
//! mid-batch, when D's deadline passed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kv_proto::{
    BatchWriter, BlockId, ConnectorMetadata, Endpoint, Grant, GrantId, KvRole, LayoutKind, MemoryRegion, Protocol,
    RecvReqMeta, RegionAccess, ReqId, SendUpdate, TransportError, WriteOp,
};
use kv_worker::in_memory::InMemoryNetwork;
use kv_worker::{pattern, CacheDims, CacheShape, DataEndpointPolicy, Finished, OwnedKvCache, Worker, WorkerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Upper bound on any wait here (never reached when things work).
const BOUND: Duration = Duration::from_secs(20);
/// D's transfer timeout in the scenarios where D gives up.
const SHORT: Duration = Duration::from_millis(300);

fn shape() -> CacheShape {
    CacheShape::try_new(CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers: 2,
        num_blocks: 8,
        block_size: 16,
        num_kv_heads: 2,
        head_dim: 16,
        dtype_bytes: 2,
    })
    .unwrap()
}

/// A writer that holds its first `held` batches until the test opens the
/// gate, then behaves like the writer it wraps.
struct GatedWriter {
    inner: Arc<dyn BatchWriter>,
    gate: Semaphore,
    held: AtomicUsize,
    waiting: tokio::sync::Notify,
    waiting_count: AtomicUsize,
}

impl GatedWriter {
    fn new(inner: Arc<dyn BatchWriter>, held: usize) -> Arc<Self> {
        Arc::new(Self {
            inner,
            gate: Semaphore::new(0),
            held: AtomicUsize::new(held),
            waiting: tokio::sync::Notify::new(),
            waiting_count: AtomicUsize::new(0),
        })
    }

    /// Waits until `n` batches are held at the gate.
    async fn until_held(&self, n: usize) {
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

    fn open(&self) {
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

/// A worker over a library-allocated cache and the given writer.
struct Instance {
    worker: Worker,
    cache: Arc<OwnedKvCache>,
}

async fn start(config: WorkerConfig, writer: Arc<dyn BatchWriter>) -> Instance {
    let cache = Arc::new(OwnedKvCache::allocate(shape()).unwrap());
    // SAFETY: `cache` outlives the worker (the instance drops the worker
    // first, which closes the writer), and the test reads blocks only after
    // they were reported.
    let worker = unsafe { Worker::start_with_writer(config, cache.registered().clone(), writer) }.await.unwrap();
    Instance { worker, cache }
}

fn config(role: KvRole, name: &str) -> WorkerConfig {
    WorkerConfig { data_endpoint_policy: DataEndpointPolicy::Any, ..WorkerConfig::loopback(role, name) }
}

/// Writes request `seed`'s KV into `blocks` of every region (prompt positions from 0).
fn fill(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) {
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
fn read(cache: &OwnedKvCache, region: u32, block: BlockId) -> Vec<u8> {
    let mut buf = vec![0u8; cache.block_len()];
    // SAFETY: the test reads only blocks whose pull was reported (or never
    // started): no transfer writes them any more.
    unsafe { cache.read_block(region as usize, block, &mut buf) }.unwrap();
    buf
}

/// Whether `blocks` hold request `seed`'s KV in every region.
fn holds(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) -> bool {
    (0..cache.shape().region_count()).all(|region| {
        blocks.iter().enumerate().all(|(position, &block)| {
            pattern::matches(&read(cache, region, block), pattern::block_seed(seed, region, position as u32))
        })
    })
}

fn all_zero(cache: &OwnedKvCache, blocks: &[BlockId]) -> bool {
    (0..cache.shape().region_count())
        .all(|region| blocks.iter().all(|&block| read(cache, region, block).iter().all(|&b| b == 0)))
}

fn ready(p: &Instance, req: &str, blocks: &[BlockId]) {
    let mut meta = ConnectorMetadata::default();
    meta.reqs_to_send.insert(ReqId::new(req), SendUpdate::Ready { block_ids: blocks.to_vec() });
    p.worker.start_load_kv(&meta);
}

fn expect(p: &Instance, req: &str) {
    let mut meta = ConnectorMetadata::default();
    meta.reqs_to_send.insert(ReqId::new(req), SendUpdate::Expect);
    p.worker.start_load_kv(&meta);
}

/// D pulls `pulls` (request, D's blocks) from the side channel at `host:port`.
fn pull(d: &Instance, host: &str, port: u16, pulls: &[(&str, &[BlockId])]) {
    let reqs_to_recv = pulls
        .iter()
        .map(|(req, blocks)| {
            let meta = RecvReqMeta { local_block_ids: blocks.to_vec(), remote_host: host.into(), remote_port: port };
            (ReqId::new(*req), meta)
        })
        .collect::<BTreeMap<_, _>>();
    d.worker.start_load_kv(&ConnectorMetadata { reqs_to_recv, ..ConnectorMetadata::default() });
}

/// Collects what `worker` reports until `done` says enough, within [`BOUND`].
async fn until(worker: &Worker, mut done: impl FnMut(&Finished) -> bool) -> Finished {
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

fn side_channel(p: &Instance) -> (String, u16) {
    let addr = p.worker.side_channel_addr().unwrap();
    (addr.ip().to_string(), addr.port())
}

/// Hole 1: D gives up on X (P's write is stuck behind a transfer slot), the
/// engine reuses X's blocks for Y, Y lands; then P's write of X goes ahead:
/// not one byte of it lands in Y's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_cannot_touch_blocks_d_reused() {
    let net = InMemoryNetwork::new();
    let gated = GatedWriter::new(net.writer("p"), 1);
    let p = start(config(KvRole::Producer, "p"), gated.clone()).await;
    let d = start(WorkerConfig { transfer_timeout: SHORT, ..config(KvRole::Consumer, "d") }, net.writer("d")).await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 1, &[0, 1]);
    fill(&p.cache, 2, &[2, 3]);
    ready(&p, "x", &[0, 1]);
    ready(&p, "y", &[2, 3]);

    pull(&d, &host, port, &[("x", &[4, 5])]);
    gated.until_held(1).await;
    let failed = until(&d.worker, |f| !f.failed_receiving.is_empty()).await;
    assert_eq!(failed.failed_receiving, BTreeMap::from([(ReqId::new("x"), vec![4, 5])]));

    // The engine hands blocks 4 and 5 to Y, which arrives whole.
    pull(&d, &host, port, &[("y", &[4, 5])]);
    let received = until(&d.worker, |f| !f.receiving.is_empty()).await;
    assert!(received.receiving.contains(&ReqId::new("y")), "{received:?}");
    assert!(holds(&d.cache, 2, &[4, 5]));

    // P's write of X now goes ahead, under the grant D revoked.
    gated.open();
    let sent = until(&p.worker, |f| f.sending.contains(&ReqId::new("x"))).await;
    assert!(sent.sending.contains(&ReqId::new("x")), "P frees X's blocks once its write failed");
    assert!(holds(&d.cache, 2, &[4, 5]), "the late write of X landed in Y's blocks");
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// A TCP relay the test can cut: one connection, both directions.
struct Relay {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn to(upstream: (String, u16)) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let (mut inbound, _) = listener.accept().await.unwrap();
            let mut outbound = TcpStream::connect((upstream.0.as_str(), upstream.1)).await.unwrap();
            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        });
        Self { port, task }
    }

    /// Drops both connections at once.
    fn cut(&self) {
        self.task.abort();
    }
}

/// The side channel drops while P's write is in flight: D reports the pull
/// failed, and no byte of it lands afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lands_after_the_side_channel_dropped_mid_batch() {
    let net = InMemoryNetwork::new();
    let gated = GatedWriter::new(net.writer("p"), 1);
    let p = start(config(KvRole::Producer, "p"), gated.clone()).await;
    let d = start(config(KvRole::Consumer, "d"), net.writer("d")).await;
    let relay = Relay::to(side_channel(&p)).await;
    fill(&p.cache, 1, &[0, 1]);
    ready(&p, "x", &[0, 1]);

    pull(&d, "127.0.0.1", relay.port, &[("x", &[4, 5])]);
    gated.until_held(1).await;
    relay.cut();
    let failed = until(&d.worker, |f| !f.failed_receiving.is_empty()).await;
    assert_eq!(failed.failed_receiving, BTreeMap::from([(ReqId::new("x"), vec![4, 5])]));

    gated.open();
    until(&p.worker, |f| f.sending.contains(&ReqId::new("x"))).await;
    assert!(all_zero(&d.cache, &[4, 5]), "bytes landed after D reported the pull failed");
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// Hole 4: a transfer request for a request that is not ready yet (A) and
/// one that is (B): B is written at once, without waiting for A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_request_does_not_hold_back_its_batch() {
    let net = InMemoryNetwork::new();
    let p = start(config(KvRole::Producer, "p"), net.writer("p")).await;
    let d = start(config(KvRole::Consumer, "d"), net.writer("d")).await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 1, &[0, 1]);
    fill(&p.cache, 2, &[2, 3]);
    expect(&p, "a");
    ready(&p, "b", &[2, 3]);

    pull(&d, &host, port, &[("a", &[4, 5]), ("b", &[6, 7])]);
    let sent = until(&p.worker, |f| !f.sending.is_empty()).await;
    assert_eq!(sent.sending.iter().map(ReqId::as_str).collect::<Vec<_>>(), ["b"], "B went out while A was not ready");

    ready(&p, "a", &[0, 1]);
    let received = until(&d.worker, |f| f.receiving.len() == 2).await;
    assert!(received.failed_receiving.is_empty(), "{received:?}");
    assert!(holds(&d.cache, 1, &[4, 5]) && holds(&d.cache, 2, &[6, 7]));
    until(&p.worker, |f| f.sending.contains(&ReqId::new("a"))).await;
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// P does not start writing once D's wait budget has passed: X becomes ready
/// on P only after D gave up, and nothing of it is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_written_past_the_wait_budget() {
    let net = InMemoryNetwork::new();
    let p = start(config(KvRole::Producer, "p"), net.writer("p")).await;
    let d = start(WorkerConfig { transfer_timeout: SHORT, ..config(KvRole::Consumer, "d") }, net.writer("d")).await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 1, &[0, 1]);
    expect(&p, "x");

    pull(&d, &host, port, &[("x", &[4, 5])]);
    let failed = until(&d.worker, |f| !f.failed_receiving.is_empty()).await;
    assert!(failed.failed_receiving.contains_key(&ReqId::new("x")));
    // P's wait for X ends at the budget too: no transfer is left waiting.
    let deadline = Instant::now() + BOUND;
    while p.worker.transfers_in_progress() > 0 {
        assert!(Instant::now() < deadline, "P still waits for X past D's budget");
        tokio::task::yield_now().await;
    }
    ready(&p, "x", &[0, 1]);
    assert!(all_zero(&d.cache, &[4, 5]));
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// The engine aborts X while P's write of it is in flight (vLLM frees the
/// blocks at once): when `start_load_kv` with the cancellation returns, no
/// byte of X can land, so the blocks can go straight to Y.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_cancelled_by_the_engine_lands_nothing_after_the_step() {
    let net = InMemoryNetwork::new();
    let gated = GatedWriter::new(net.writer("p"), 1);
    let p = start(config(KvRole::Producer, "p"), gated.clone()).await;
    let d = start(config(KvRole::Consumer, "d"), net.writer("d")).await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 1, &[0, 1]);
    fill(&p.cache, 2, &[2, 3]);
    ready(&p, "x", &[0, 1]);
    ready(&p, "y", &[2, 3]);

    pull(&d, &host, port, &[("x", &[4, 5])]);
    gated.until_held(1).await;
    let cancel = ConnectorMetadata { reqs_to_cancel: [ReqId::new("x")].into(), ..ConnectorMetadata::default() };
    d.worker.start_load_kv(&cancel);
    // The engine reuses 4 and 5 for Y at once.
    pull(&d, &host, port, &[("y", &[4, 5])]);
    let received = until(&d.worker, |f| f.receiving.contains(&ReqId::new("y"))).await;
    assert!(
        !received.receiving.contains(&ReqId::new("x")) && !received.failed_receiving.contains_key(&ReqId::new("x"))
    );
    assert!(holds(&d.cache, 2, &[4, 5]));

    gated.open();
    until(&p.worker, |f| f.sending.contains(&ReqId::new("x"))).await;
    assert!(holds(&d.cache, 2, &[4, 5]), "the cancelled pull's write landed in Y's blocks");
    let later = d.worker.get_finished();
    assert!(
        !later.receiving.contains(&ReqId::new("x")) && !later.failed_receiving.contains_key(&ReqId::new("x")),
        "a cancelled pull is never reported: {later:?}"
    );
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}
