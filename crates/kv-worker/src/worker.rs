//! The worker: the engine-facing API and the tokio driver around the sans-IO
//! sender and receiver cores.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kv_proto::bootstrap::BootstrapUrl;
use kv_proto::{
    BatchWriter, BlockId, BootstrapTarget, ConnectorMetadata, Endpoint, FailureCause, Grant, GrantId, Hello,
    LayoutKind, RankTopology, RecvReqMeta, RegionAccess, RemotePrefill, ReqId, XferProgress, XferRequest,
};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::OwnedKvCache;
use crate::changes::Changes;
use crate::config::WorkerConfig;
use crate::layout::RegisteredCache;
use crate::metrics::{FailureLog, Gauges, Metrics, MetricsSnapshot};
use crate::names::SendNames;
use crate::plan::grant_ranges;
use crate::receiver::{PullBatch, PullProgress, ReceiverCore, SideChannelAddr};
use crate::resolve::{Directory, Parked, Placed};
use crate::sender::SenderCore;
use crate::side_channel::client::{ClientSettings, SideChannelClient};
use crate::side_channel::client::{ProgressSink, PullError};
use crate::side_channel::{self, server};
use crate::watch::WatchList;
use crate::WorkerError;

/// What finished since the last [`Worker::get_finished`]; each request is
/// reported once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Finished {
    /// P: requests whose blocks may be freed (sent, failed, or lease ended).
    pub sending: BTreeSet<ReqId>,
    /// D: requests whose KV is entirely in local memory.
    pub receiving: BTreeSet<ReqId>,
    /// D: requests whose pull failed, with the blocks that hold no valid KV.
    /// The engine recomputes or fails them.
    pub failed_receiving: BTreeMap<ReqId, Vec<BlockId>>,
}

impl Finished {
    /// Whether nothing finished.
    pub fn is_empty(&self) -> bool {
        self.sending.is_empty() && self.receiving.is_empty() && self.failed_receiving.is_empty()
    }
}

/// State shared by the worker's tasks.
pub(crate) struct Shared {
    pub(crate) config: WorkerConfig,
    /// This worker's place in its instance and the heads its cache holds.
    pub(crate) topology: RankTopology,
    pub(crate) cache: RegisteredCache,
    pub(crate) writer: Arc<dyn BatchWriter>,
    pub(crate) sender: Mutex<SenderCore>,
    /// P: the engine's id of each send entry named by a transfer id.
    pub(crate) send_names: Mutex<SendNames>,
    pub(crate) sender_changed: Notify,
    /// Signalled whenever an outcome becomes available to `get_finished`.
    pub(crate) finished_changed: Arc<Changes>,
    pub(crate) receiver: Mutex<ReceiverCore>,
    pub(crate) admission: Arc<Semaphore>,
    /// Places for established side-channel connections (P).
    pub(crate) established: kv_net::EstablishedPlaces,
    pub(crate) transfer_slots: Semaphore,
    pub(crate) clients: Mutex<HashMap<SideChannelAddr, Arc<SideChannelClient>>>,
    /// D: where prefill engines named by their bootstrap server are.
    pub(crate) directory: Mutex<Directory>,
    /// D: requests whose hold on P the worker renews.
    pub(crate) watches: Mutex<WatchList>,
    /// Signalled when a request starts being watched.
    pub(crate) watches_changed: Notify,
    /// P: log lines about transfer requests it refuses (meant for another
    /// prefill engine, another pipeline stage, or an endpoint it will not
    /// write to; any D can send them as fast as it likes).
    pub(crate) refusal_log: kv_net::RefusalLog,
    /// What the worker counts.
    pub(crate) metrics: Metrics,
    /// D: failed pulls, logged by cause at a bounded rate.
    pub(crate) failure_log: FailureLog,
    /// Side-channel connections and failed authentications, both roles.
    pub(crate) side_channel_counts: Arc<side_channel::Counts>,
    /// D, staged: pulls that landed, counted received only once the engine
    /// holds them ([`Worker::settle_landed`]): bytes and start, by request.
    /// `None`: counted when they land.
    pub(crate) landed: Mutex<Option<HashMap<ReqId, (u64, Instant)>>>,
    pub(crate) cancel: CancellationToken,
    pub(crate) tracker: TaskTracker,
    /// Keeps library-allocated memory alive as long as any task may touch it.
    _owned_cache: Option<Arc<OwnedKvCache>>,
}

impl Shared {
    pub(crate) fn lock_sender(&self) -> MutexGuard<'_, SenderCore> {
        // A panic while holding the lock leaves plain bookkeeping behind; keep serving.
        self.sender.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn lock_directory(&self) -> MutexGuard<'_, Directory> {
        self.directory.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn lock_send_names(&self) -> MutexGuard<'_, SendNames> {
        self.send_names.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn lock_receiver(&self) -> MutexGuard<'_, ReceiverCore> {
        self.receiver.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Counts what `receiver` ended, while the caller still holds its lock:
    /// an outcome is counted before any `get_finished` can hand it to the
    /// engine (one on another thread used to, ahead of the count).
    pub(crate) fn record_reports(&self, receiver: &mut ReceiverCore) {
        self.record_pulls(receiver.take_reports());
    }

    pub(crate) fn lock_watches(&self) -> MutexGuard<'_, WatchList> {
        self.watches.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn client(self: &Arc<Self>, peer: &SideChannelAddr) -> Arc<SideChannelClient> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if !clients.contains_key(peer) {
            // Prefill workers come and go (restarts, other ports): forget
            // those whose connection is gone rather than keep one per peer
            // ever pulled from.
            clients.retain(|_, client| !client.is_dead());
        }
        clients
            .entry(peer.clone())
            .or_insert_with(|| {
                let settings = ClientSettings {
                    hello: Hello {
                        client_nonce: [0; kv_proto::auth::AUTH_TAG_LEN], // fresh per connection
                        engine_id: self.config.engine_id.clone(),
                        protocol: self.writer.protocol(),
                        layout: self.cache.layout(),
                        identity: self.config.identity.clone(),
                        topology: self.topology,
                    },
                    connect_timeout: self.config.connect_timeout,
                    max_frame_len: self.config.max_frame_len,
                    auth_secret: self.config.auth_secret.clone(),
                    counts: self.side_channel_counts.clone(),
                };
                SideChannelClient::new(peer.clone(), settings, self.cancel.clone(), self.tracker.clone())
            })
            .clone()
    }
}

impl Shared {
    /// Blocks of one piece ([`WorkerConfig::piece_bytes`] over the bytes of
    /// a block in every region), or `None`: whole requests.
    pub(crate) fn piece_blocks(&self) -> Option<u32> {
        let per_block = self.cache.block_len().saturating_mul(self.cache.regions().len() as u64);
        if self.config.piece_bytes == 0 || per_block == 0 {
            return None;
        }
        Some(u32::try_from((self.config.piece_bytes / per_block).max(1)).unwrap_or(u32::MAX))
    }

    /// Counts and logs how each request of the pulls that just ended ended
    /// (taken from the receiver core, which decided it).
    pub(crate) fn record_pulls(&self, reports: crate::receiver::PullReports) {
        let now = Instant::now();
        let bytes_per_block = self.cache.block_len() * self.cache.regions().len() as u64;
        self.metrics.pulls_started(reports.started);
        self.metrics.pulls_cancelled(reports.cancelled);
        for report in reports.ended {
            match &report.failure {
                None => {
                    let bytes = report.blocks as u64 * bytes_per_block;
                    let mut landed = self.landed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    match landed.as_mut() {
                        Some(landed) => {
                            landed.insert(report.req.clone(), (bytes, report.started));
                        }
                        None => self.metrics.pull_received(bytes, now.saturating_duration_since(report.started)),
                    }
                }
                Some((cause, reason)) => {
                    self.metrics.pull_failed(*cause);
                    let peer: &dyn std::fmt::Display = match &report.peer {
                        Some(peer) => peer,
                        None => &"-",
                    };
                    let _ = self.failure_log.failed(*cause, &report.req, &report.remote, peer, reason, now);
                }
            }
        }
    }
}

/// How a pull that landed ends for the engine (a staged decode copies it
/// into the engine's blocks first): see [`Worker::settle_landed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Copied: the engine holds every byte.
    Copied,
    /// A copy of it failed: the engine recomputes it.
    CopyFailed,
    /// The engine cancelled it first.
    Cancelled,
}

/// Issues the grant of a pull: exactly the blocks of its requests, valid
/// until its deadline.
async fn grant_pull(
    shared: &Shared,
    requests: &[kv_proto::RequestBlocks],
    deadline: Instant,
) -> Result<Grant, PullError> {
    let cache = &shared.cache;
    let refused = |e: &dyn std::fmt::Display| {
        PullError::new(FailureCause::GrantRefused, format!("cannot grant the pull's blocks: {e}"))
    };
    let blocks = requests.iter().flat_map(|r| r.block_ids.iter().copied());
    let ranges =
        grant_ranges(&cache.base_addrs(), cache.block_len(), cache.num_blocks(), blocks).map_err(|e| refused(&e))?;
    let valid_for = deadline.saturating_duration_since(Instant::now());
    shared.writer.grant(&ranges, valid_for).await.map_err(|e| match e {
        kv_proto::TransportError::Shutdown => PullError::new(FailureCause::Shutdown, "decode worker shutting down"),
        e => refused(&e),
    })
}

/// Revokes a pull's grant, then lets its outcome be reported: no byte of it
/// can land once the engine learns the blocks are received or failed.
async fn fence(shared: &Shared, xfer_id: u64, grant: Option<GrantId>) {
    if let Some(grant) = grant {
        shared.writer.revoke(&grant).await;
    }
    {
        let mut receiver = shared.lock_receiver();
        receiver.handle_fenced(xfer_id);
        shared.record_reports(&mut receiver);
    }
    shared.finished_changed.signal();
}

/// Runs one pull on the worker's runtime (the caller has entered it):
/// grants it, sends it, fences it.
fn spawn_pull(shared: &Arc<Shared>, batch: PullBatch) {
    let tracker = shared.tracker.clone();
    let shared = shared.clone();
    // Pieces only for a worker that copies them on as they land (every
    // part of a request asks for the same pieces of D's blocks).
    let piece_blocks = if shared.lock_receiver().keeps_progress() { shared.piece_blocks().unwrap_or(0) } else { 0 };
    {
        // One span per transfer request: its id, the peer and (once issued)
        // the grant; each request's two ids are logged inside it.
        let span = tracing::info_span!(
            "pull",
            xfer_id = batch.xfer_id,
            peer = %batch.peer,
            requests = batch.requests.len(),
            grant = tracing::field::Empty,
        );
        let pull = async move {
            let PullBatch { xfer_id, peer, requests, deadline, heads } = batch;
            for r in &requests {
                let req_id = r.decode_req_id.as_ref().unwrap_or(&r.req_id);
                tracing::debug!(%req_id, remote_req_id = %r.req_id, blocks = r.block_ids.len(), "pulling");
            }
            let failed = |error: PullError| {
                shared.lock_receiver().handle_batch_failed(xfer_id, error.cause, &error.reason);
            };
            let grant = match grant_pull(&shared, &requests, deadline).await {
                Ok(grant) => grant,
                Err(error) => {
                    failed(error);
                    fence(&shared, xfer_id, None).await;
                    return;
                }
            };
            tracing::Span::current().record("grant", tracing::field::display(&grant.id));
            if !shared.lock_receiver().handle_granted(xfer_id, grant.id) {
                failed(PullError::new(FailureCause::Other, "the engine cancelled part of the pull"));
                fence(&shared, xfer_id, Some(grant.id)).await;
                return;
            }
            let request = XferRequest {
                xfer_id,
                endpoint: shared.writer.endpoint(),
                grant: grant.clone(),
                wait_budget: deadline.saturating_duration_since(Instant::now()),
                region_base_addrs: shared.cache.base_addrs(),
                requests,
                heads,
                piece_blocks,
            };
            // P's progress goes straight to the receiver core.
            let progress = (piece_blocks > 0).then(|| {
                let weak = Arc::downgrade(&shared);
                Arc::new(move |p: XferProgress| {
                    if let Some(shared) = weak.upgrade() {
                        if shared.lock_receiver().handle_progress(p) {
                            shared.finished_changed.signal();
                        }
                    }
                }) as ProgressSink
            });
            let client = shared.client(&peer);
            let timeout = shared.config.transfer_timeout;
            let result = tokio::select! {
                () = shared.cancel.cancelled() => Err(PullError::new(FailureCause::Shutdown, "decode worker shutting down")),
                r = tokio::time::timeout_at(deadline.into(), client.request(request, progress)) => match r {
                    Ok(r) => r,
                    Err(_) => Err(PullError::new(FailureCause::Timeout, format!("no reply from {peer} within {timeout:?}"))),
                },
            };
            match result {
                Ok(reply) => shared.lock_receiver().handle_reply(reply),
                Err(error) => failed(error),
            }
            fence(&shared, xfer_id, Some(grant.id)).await;
        };
        tracker.spawn(tracing::Instrument::instrument(pull, span));
    }
}

/// Learns a prefill instance from its first worker's hello (on the
/// worker's runtime, which the caller has entered), then starts the pulls
/// that waited for it, or fails them.
/// D: this step's watches and pulls with P's side channel filled in where
/// the bootstrap flow names P by its bootstrap server (`None`: none does).
/// Those whose lookup is out wait in the directory; pulls whose lookup
/// failed fail now. Cancelled pulls and ended watches are withdrawn from
/// the directory first.
fn place_bootstrapped(
    shared: &Arc<Shared>,
    meta: &ConnectorMetadata,
    now: Instant,
) -> Option<(BTreeMap<ReqId, RemotePrefill>, BTreeMap<ReqId, RecvReqMeta>)> {
    let named = |remote: &RemotePrefill| remote.bootstrap.is_some();
    let any = meta.reqs_to_watch.values().any(named) || meta.reqs_to_recv.values().any(|m| named(&m.remote));
    if !any && !shared.lock_directory().has_waiting() {
        return None;
    }
    let mut directory = shared.lock_directory();
    for req in &meta.reqs_to_cancel {
        directory.withdraw(req, true);
    }
    for req in meta.reqs_to_unwatch.iter().chain(meta.reqs_to_recv.keys()) {
        directory.withdraw(req, false);
    }
    let (mut watches, mut recvs, mut failed) = (BTreeMap::new(), BTreeMap::new(), Vec::new());
    for (req, remote) in &meta.reqs_to_watch {
        match &remote.bootstrap {
            None => {
                watches.insert(req.clone(), remote.clone());
            }
            Some(target) => {
                let parked = Parked::Watch { req: req.clone(), remote: remote.clone() };
                if let Placed::Ready(Parked::Watch { req, remote }) = directory.place(target, parked, now) {
                    watches.insert(req, remote);
                }
            }
        }
    }
    for (req, meta) in &meta.reqs_to_recv {
        match &meta.remote.bootstrap {
            None => {
                recvs.insert(req.clone(), meta.clone());
            }
            Some(target) => {
                let parked = Parked::Pull { req: req.clone(), meta: meta.clone(), at: now };
                match directory.place(target, parked, now) {
                    Placed::Ready(Parked::Pull { req, meta, .. }) => {
                        recvs.insert(req, meta);
                    }
                    Placed::Failed(parked, reason) => failed.push((parked, reason)),
                    _ => {}
                }
            }
        }
    }
    drop(directory);
    fail_unlocated(shared, failed, now);
    spawn_lookups(shared);
    Some((watches, recvs))
}

/// D: pulls whose prefill engine could not be looked up fail.
fn fail_unlocated(shared: &Arc<Shared>, failed: Vec<(Parked, String)>, now: Instant) {
    if failed.is_empty() {
        return;
    }
    let mut receiver = shared.lock_receiver();
    for (parked, reason) in failed {
        if let Parked::Pull { req, meta, at } = parked {
            let reason = format!("cannot look the prefill engine up on its bootstrap server: {reason}");
            receiver.fail_unstarted(&req, &meta, FailureCause::ConnectionLost, reason, at.min(now));
        }
    }
    shared.record_reports(&mut receiver);
    drop(receiver);
    shared.finished_changed.signal();
}

/// D: starts watching `watches` (except those pulled in the same step,
/// `pulled`) and stops watching `unwatch`. An instance not known yet is
/// learned now; until its hello is read its requests are renewed where
/// the guess says, then moved (`spawn_discovery`). Both locks are held
/// (receiver, then watches, as there) so a hello read meanwhile cannot
/// move the requests before they are watched.
fn apply_watches<'a>(
    shared: &Arc<Shared>,
    watches: &BTreeMap<ReqId, RemotePrefill>,
    unwatch: impl Iterator<Item = &'a ReqId>,
    pulled: &BTreeMap<ReqId, RecvReqMeta>,
) {
    let discoveries = {
        let mut receiver = shared.lock_receiver();
        let mut list = shared.lock_watches();
        // A pull holds its requests on P from when P reads it.
        for req in unwatch {
            list.unwatch(req);
        }
        for (req, remote) in watches.iter().filter(|(req, _)| !pulled.contains_key(*req)) {
            let instance = SideChannelAddr { host: remote.remote_host.clone(), port: remote.remote_port };
            receiver.learn(&instance, remote.remote_engine_id.as_ref());
            list.watch(req, remote, receiver.renewal_peers(&instance));
        }
        receiver.take_discoveries()
    };
    for instance in discoveries {
        spawn_discovery(shared, instance);
    }
    if !watches.is_empty() {
        shared.watches_changed.notify_one();
    }
}

/// D: starts pulls that arrived at `now` (their deadlines count from it).
fn start_pulls(shared: &Arc<Shared>, recvs: &BTreeMap<ReqId, RecvReqMeta>, now: Instant) {
    if recvs.is_empty() {
        return;
    }
    let (batches, discoveries) = {
        let mut receiver = shared.lock_receiver();
        let batches = receiver.start(recvs, now);
        shared.record_reports(&mut receiver);
        (batches, receiver.take_discoveries())
    };
    for instance in discoveries {
        spawn_discovery(shared, instance);
    }
    for batch in batches {
        spawn_pull(shared, batch);
    }
}

/// D: tells P's workers to let go of `reqs` (see [`Worker::release_on_prefill`]).
fn release(shared: &Arc<Shared>, reqs: &BTreeMap<ReqId, RemotePrefill>, now: Instant) {
    if reqs.is_empty() {
        return;
    }
    let (batches, discoveries) = {
        let mut receiver = shared.lock_receiver();
        let batches = receiver.release(reqs, now);
        (batches, receiver.take_discoveries())
    };
    for instance in discoveries {
        spawn_discovery(shared, instance);
    }
    for batch in batches {
        spawn_pull(shared, batch);
    }
}

/// D: where the first worker of the prefill engine `target` names listens
/// for side-channel connections, as its bootstrap server says within
/// `timeout` (the other workers' places follow from its hello, as for an
/// address P returned itself).
async fn locate(target: &BootstrapTarget, timeout: std::time::Duration) -> Result<SideChannelAddr, String> {
    let url = BootstrapUrl::parse(&target.url).map_err(|e| e.to_string())?;
    let reply = crate::bootstrap::client::query(&url, timeout).await.map_err(|e| e.to_string())?;
    let engine = reply.engine(target.engine_id.as_str()).ok_or_else(|| {
        format!("bootstrap server {url} lists no prefill engine {}", target.engine_id.as_str().escape_debug())
    })?;
    let first = engine.worker(0, 0).ok_or_else(|| {
        format!("bootstrap server {url} lists no first worker of prefill engine {}", engine.engine_id())
    })?;
    Ok(SideChannelAddr { host: first.host().to_owned(), port: first.port() })
}

/// D: asks each bootstrap server the directory wants asked, on a task of
/// its own, and lets what waited for it go on.
fn spawn_lookups(shared: &Arc<Shared>) {
    for target in shared.lock_directory().take_lookups() {
        let tracker = shared.tracker.clone();
        let shared = shared.clone();
        let span = tracing::debug_span!("bootstrap_lookup", bootstrap = %target.url.escape_debug(), prefill_engine = %target.engine_id);
        let look_up = async move {
            let found = tokio::select! {
                () = shared.cancel.cancelled() => Err("decode worker shutting down".to_owned()),
                found = locate(&target, shared.config.bootstrap_timeout) => found,
            };
            if let Err(reason) = &found {
                tracing::warn!(%reason, "cannot learn the prefill engine from its bootstrap server; its pulls fail");
            }
            let now = Instant::now();
            let placed = shared.lock_directory().handle_found(&target, found, now);
            let (mut watches, mut pulls, mut releases, mut failed) = (
                BTreeMap::new(),
                BTreeMap::<Instant, BTreeMap<ReqId, RecvReqMeta>>::new(),
                BTreeMap::new(),
                Vec::new(),
            );
            for p in placed {
                match p {
                    Placed::Ready(Parked::Watch { req, remote }) => {
                        watches.insert(req, remote);
                    }
                    Placed::Ready(Parked::Pull { req, meta, at }) => {
                        pulls.entry(at).or_default().insert(req, meta);
                    }
                    Placed::Ready(Parked::Release { req, remote }) => {
                        releases.insert(req, remote);
                    }
                    Placed::Failed(parked, reason) => failed.push((parked, reason)),
                    Placed::Waiting => {}
                }
            }
            let pulled: BTreeMap<ReqId, RecvReqMeta> =
                pulls.values().flatten().map(|(r, m)| (r.clone(), m.clone())).collect();
            apply_watches(&shared, &watches, std::iter::empty(), &pulled);
            for (at, recvs) in &pulls {
                start_pulls(&shared, recvs, *at);
            }
            release(&shared, &releases, now);
            fail_unlocated(&shared, failed, now);
        };
        tracker.spawn(tracing::Instrument::instrument(look_up, span));
    }
}

fn spawn_discovery(shared: &Arc<Shared>, instance: SideChannelAddr) {
    let tracker = shared.tracker.clone();
    let shared = shared.clone();
    let span = tracing::debug_span!("discover", prefill = %instance);
    let discover = async move {
        let client = shared.client(&instance);
        let learned = tokio::select! {
            () = shared.cancel.cancelled() => Err(PullError::new(FailureCause::Shutdown, "decode worker shutting down")),
            info = client.peer_info(Instant::now()) => info,
        };
        let (batches, moved) = {
            let mut receiver = shared.lock_receiver();
            let batches =
                receiver.handle_discovered(&instance, learned.map_err(|e| (e.cause, e.reason)), Instant::now());
            shared.record_reports(&mut receiver);
            // Its watched requests are renewed where their pulls will go
            // (under the receiver's lock: see `start_load_kv`).
            let moved = shared.lock_watches().repoint(&instance, &receiver.renewal_peers(&instance));
            (batches, moved)
        };
        shared.finished_changed.signal();
        if moved > 0 {
            shared.watches_changed.notify_one();
        }
        for batch in batches {
            spawn_pull(&shared, batch);
        }
    };
    tracker.spawn(tracing::Instrument::instrument(discover, span));
}

/// The worker's place in its instance, checked against its cache and the
/// identity it declares.
fn worker_topology(config: &WorkerConfig, cache: &RegisteredCache) -> Result<RankTopology, WorkerError> {
    let layout = cache.layout();
    let declared_heads = config.identity.num_kv_heads;
    let num_kv_heads = if layout.kind == LayoutKind::Mla {
        1
    } else if declared_heads != 0 {
        declared_heads
    } else {
        // Undeclared: what the cache holds over every rank (no replication).
        layout.block_heads.saturating_mul(u32::from(config.tp_size))
    };
    let topology = RankTopology::new(
        u32::from(config.tp_size),
        u32::from(config.tp_rank),
        u32::from(config.pp_size),
        u32::from(config.pp_rank),
        num_kv_heads,
    )
    .map_err(|e| WorkerError::Topology(e.to_string()))?;
    if layout.block_heads != 0 && num_kv_heads != 0 && topology.heads.count != layout.block_heads {
        return Err(WorkerError::Topology(format!(
            "the cache holds {} heads per block, but tensor-parallel rank {} of {} holds {} of the model's {num_kv_heads}",
            layout.block_heads, config.tp_rank, config.tp_size, topology.heads.count
        )));
    }
    for (what, declared, configured) in [
        ("tensor-parallel size", config.identity.tp_size, config.tp_size),
        ("pipeline-parallel size", config.identity.pp_size, config.pp_size),
    ] {
        if declared != 0 && declared != u32::from(configured) {
            return Err(WorkerError::Topology(format!(
                "the identity declares {what} {declared}, the worker is configured with {configured}"
            )));
        }
    }
    Ok(topology)
}

/// A connector worker: serves pulls of this instance's KV (P) and pulls KV
/// from prefill instances (D), per its role.
///
/// Engine calls ([`Worker::start_load_kv`], [`Worker::get_finished`]) are
/// synchronous and never block on the network; the work runs on the tokio
/// runtime the worker was started in. Dropping the worker (or
/// [`Worker::shutdown`]) stops every task it started and closes its sockets.
pub struct Worker {
    shared: Arc<Shared>,
    side_channel: Option<SocketAddr>,
    endpoint: Endpoint,
    runtime: tokio::runtime::Handle,
    /// Whether `Drop` must shut the transport down (false once `shutdown` runs).
    shutdown_on_drop: bool,
}

impl Worker {
    /// Starts a worker over a cache the library allocated, with the transport
    /// `config.protocol` names.
    pub async fn start(config: WorkerConfig, cache: Arc<OwnedKvCache>) -> Result<Self, WorkerError> {
        let writer = crate::transport::open(&config).await?;
        let registered = cache.registered().clone();
        // SAFETY: the regions are `cache`'s own allocations, kept alive by the
        // worker's shared state, which the writer's tasks never outlive: the
        // writer was created here for this worker alone, and both `shutdown`
        // and `Drop` close it before the shared state can go.
        unsafe { Self::start_inner(config, registered, writer, Some(cache)).await }
    }

    /// Starts a worker over engine-owned memory and a given writer.
    ///
    /// # Safety
    ///
    /// The memory-lifetime rule of [`BatchWriter`] applies to every region of
    /// `cache`: valid until [`Worker::shutdown`]`.await` has returned
    /// (dropping the worker closes the writer synchronously, which ends all
    /// access too). The engine does not read a block of a pull before the
    /// worker reported it received or failed, and does not change a block
    /// while it is being sent (before it is reported finished sending).
    pub async unsafe fn start_with_writer(
        config: WorkerConfig,
        cache: RegisteredCache,
        writer: Arc<dyn BatchWriter>,
    ) -> Result<Self, WorkerError> {
        // SAFETY: forwarded from the caller.
        unsafe { Self::start_inner(config, cache, writer, None).await }
    }

    async unsafe fn start_inner(
        config: WorkerConfig,
        cache: RegisteredCache,
        writer: Arc<dyn BatchWriter>,
        owned_cache: Option<Arc<OwnedKvCache>>,
    ) -> Result<Self, WorkerError> {
        if writer.protocol() != config.protocol {
            return Err(WorkerError::ProtocolMismatch { configured: config.protocol, writer: writer.protocol() });
        }
        let topology = worker_topology(&config, &cache)?;
        // Least privilege: a worker that only sends registers no destination
        // (no peer can ever write into it); one that only receives, no source.
        if config.role.sends() {
            // SAFETY: the caller's contract covers the regions' validity.
            unsafe { writer.register_regions(cache.regions(), RegionAccess::Source) }
                .map_err(WorkerError::Transport)?;
        }
        if config.role.receives() {
            // SAFETY: as above.
            unsafe { writer.register_regions(cache.regions(), RegionAccess::Destination) }
                .map_err(WorkerError::Transport)?;
        }
        let endpoint = writer.endpoint();
        let runtime = tokio::runtime::Handle::current();
        let listener = if config.role.sends() {
            let place = crate::config::Placement {
                dp_rank: 0,
                tp_size: config.tp_size,
                tp_rank: config.tp_rank,
                pp_size: config.pp_size,
                pp_rank: config.pp_rank,
            };
            let port = kv_proto::topology::side_channel_port(config.side_channel_base_port, topology.global_rank())
                .ok_or(WorkerError::PortOverflow { bootstrap_port: config.side_channel_base_port, place })?;
            let addr = SocketAddr::new(config.side_channel_bind, port);
            Some(TcpListener::bind(addr).await.map_err(|cause| WorkerError::Bind { addr, cause })?)
        } else {
            None
        };
        let side_channel = listener.as_ref().map(TcpListener::local_addr).transpose().map_err(WorkerError::Io)?;
        let receiver = ReceiverCore::discovering(topology, cache.layout(), config.transfer_timeout);
        let shared = Arc::new(Shared {
            sender: Mutex::new(SenderCore::new(config.abort_request_timeout, config.lease_renewal)),
            send_names: Mutex::default(),
            sender_changed: Notify::new(),
            finished_changed: Arc::default(),
            receiver: Mutex::new(receiver),
            admission: Arc::new(Semaphore::new(config.queue_depth.max(1))),
            established: kv_net::EstablishedPlaces::new(&config.side_channel_limits),
            transfer_slots: Semaphore::new(config.num_workers.max(1)),
            clients: Mutex::new(HashMap::new()),
            directory: Mutex::default(),
            watches: Mutex::new(WatchList::new()),
            watches_changed: Notify::new(),
            refusal_log: kv_net::RefusalLog::new(),
            metrics: Metrics::default(),
            failure_log: FailureLog::default(),
            side_channel_counts: Arc::default(),
            landed: Mutex::new(None),
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
            config,
            topology,
            cache,
            writer,
            _owned_cache: owned_cache,
        });
        if let Some(listener) = listener {
            shared.tracker.spawn(server::run_listener(shared.clone(), listener));
        }
        if shared.config.role.receives() {
            shared.tracker.spawn(crate::renewal::run(shared.clone()));
        }
        tracing::info!(
            engine_id = %shared.config.engine_id,
            role = %shared.config.role,
            side_channel = ?side_channel,
            data_endpoint = %endpoint,
            regions = shared.cache.regions().len(),
            block_len = shared.cache.block_len(),
            tp = %format_args!("{}/{}", shared.topology.tp_rank, shared.topology.tp_size),
            pp = %format_args!("{}/{}", shared.topology.pp_rank, shared.topology.pp_size),
            heads = %shared.topology.heads,
            "kvlink worker started"
        );
        Ok(Self { shared, side_channel, endpoint, runtime, shutdown_on_drop: true })
    }

    /// Where D workers reach this worker's side channel (P roles only).
    pub fn side_channel_addr(&self) -> Option<SocketAddr> {
        self.side_channel
    }

    /// This worker's data-plane endpoint.
    pub fn data_endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The registered cache.
    pub fn cache(&self) -> &RegisteredCache {
        &self.shared.cache
    }

    /// Where this worker sits in its instance and the model's heads its
    /// cache holds (sent in its hellos).
    pub fn topology(&self) -> RankTopology {
        self.shared.topology
    }

    /// Transfer requests P has admitted and not yet answered (waiting for
    /// readiness or writing).
    pub fn transfers_in_progress(&self) -> usize {
        self.shared.config.queue_depth.max(1).saturating_sub(self.shared.admission.available_permits())
    }

    /// P: requests held for a decode instance that renews them (seen by it,
    /// not yet pulled); each is freed a renewal period after the last one.
    pub fn renewed_requests(&self) -> usize {
        self.shared.lock_sender().renewed()
    }

    /// D: requests whose hold on P this worker renews.
    pub fn watched_requests(&self) -> usize {
        self.shared.lock_watches().len()
    }

    /// Everything the worker counts, now (see [`MetricsSnapshot`]). Cheap:
    /// a few locks held for a count each; call it as often as a scraper likes.
    pub fn metrics(&self) -> MetricsSnapshot {
        let shared = &self.shared;
        let (held_requests, held_blocks, lease_expiries, renewals_received, renewals_refused) = {
            let sender = shared.lock_sender();
            let (reqs, blocks) = sender.held();
            (reqs as u64, blocks as u64, sender.lease_expiries(), sender.renewals(), sender.renewals_refused())
        };
        let gauges = Gauges {
            lease_expiries,
            renewals_received,
            renewals_refused,
            side_channel_auth_failures: shared.side_channel_counts.auth_failures(),
            side_channel_tag_failures: shared.side_channel_counts.tag_failures(),
            transport: shared.writer.stats(),
            pulls_in_flight: shared.lock_receiver().in_flight() as u64,
            watched_requests: self.watched_requests() as u64,
            held_requests,
            held_blocks,
            transfers_in_progress: self.transfers_in_progress() as u64,
            connections: shared.side_channel_counts.open(),
        };
        shared.metrics.snapshot(gauges)
    }

    /// Staging's figures now, for [`Worker::metrics`] (a staged worker
    /// publishes them after each call).
    pub fn publish_staging(&self, figures: crate::metrics::StagingFigures) {
        self.shared.metrics.set_staging(figures);
    }

    /// Blocks of one piece ([`WorkerConfig::piece_bytes`] over the bytes of
    /// a block in every region), or `None`: whole requests.
    pub fn piece_blocks(&self) -> Option<u32> {
        self.shared.piece_blocks()
    }

    /// D: P's progress on pulls since the last call (only kept for a
    /// staged worker, [`Worker::stage_pulls`]).
    pub fn take_progress(&self) -> Vec<PullProgress> {
        self.shared.lock_receiver().take_progress()
    }

    /// P, for a staged worker: the requests a pull asked for before they
    /// were ready, since the last call ([`SenderCore::take_pulled`]; kept
    /// once [`Worker::stage_pulls`] was called).
    pub fn take_pulled(&self) -> BTreeSet<ReqId> {
        self.shared.lock_sender().take_pulled()
    }

    /// D, for a staged worker: a pull reported received is counted
    /// received only once the engine holds it ([`Worker::settle_landed`]),
    /// so its duration covers the copy to the engine and a failed copy
    /// counts as a failed pull; and with [`WorkerConfig::piece_bytes`] set,
    /// P is asked for pieces and its progress kept for
    /// [`Worker::take_progress`]. P: the requests a pull asks for before
    /// they are ready are kept for [`Worker::take_pulled`].
    pub fn stage_pulls(&self) {
        self.shared.lock_sender().keep_pulled();
        self.shared.landed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert_with(HashMap::new);
        if self.piece_blocks().is_some() {
            self.shared.lock_receiver().keep_progress();
        }
    }

    /// D: how a pull this worker reported received ended for the engine
    /// (see [`Worker::stage_pulls`]): counted received,
    /// failed (`copy_failed`, logged) or cancelled. Unknown ids are ignored.
    pub fn settle_landed(&self, req: &ReqId, how: Settled) {
        let landed = self
            .shared
            .landed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_mut()
            .and_then(|l| l.remove(req));
        let Some((bytes, started)) = landed else { return };
        let now = Instant::now();
        match how {
            Settled::Copied => self.shared.metrics.pull_received(bytes, now.saturating_duration_since(started)),
            Settled::CopyFailed => {
                self.shared.metrics.pull_failed(FailureCause::CopyFailed);
                let reason = "the copy from staging into the engine's blocks failed";
                let _ = self.shared.failure_log.failed(FailureCause::CopyFailed, req, req, &"-", reason, now);
            }
            Settled::Cancelled => self.shared.metrics.pulls_cancelled(1),
        }
    }

    /// P: `req`'s KV is in the first `staged` of `block_ids` (more follow
    /// until all are): a pull may claim it and write what is staged
    /// ([`SenderCore::handle_staged`]).
    pub fn stage_sends(&self, staged: &[(ReqId, Vec<BlockId>, usize)]) {
        if staged.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut sender = self.shared.lock_sender();
        for (req, blocks, n) in staged {
            sender.handle_staged(req, blocks, *n, now);
        }
        drop(sender);
        self.shared.sender_changed.notify_waiters();
    }

    /// P: the engine could not make `reqs` ready to send (their KV found no
    /// staging room within its bound, or a copy of it failed): a pull for
    /// one fails with `cause`, one that waits for it now included; one being
    /// written fails once what was staged is (see [`SenderCore::fail`]).
    pub fn fail_sends<'a>(&self, reqs: impl IntoIterator<Item = &'a ReqId>, cause: FailureCause) {
        let now = Instant::now();
        let mut sender = self.shared.lock_sender();
        for req in reqs {
            sender.fail(req, cause, now);
        }
        drop(sender);
        self.shared.sender_changed.notify_waiters();
    }

    /// D: pulls that failed before they could start (no staging room
    /// within its bound): counted and logged as failed with `cause`, as if
    /// this worker had started them. The engine hears of them from whoever
    /// failed them.
    pub fn count_failed_pulls<'a>(&self, reqs: impl IntoIterator<Item = &'a ReqId>, cause: FailureCause) {
        let now = Instant::now();
        for req in reqs {
            self.shared.metrics.pulls_started(1);
            self.shared.metrics.pull_failed(cause);
            let _ = self.shared.failure_log.failed(cause, req, req, &"-", "no staging room within its bound", now);
        }
    }

    /// D, staged: a copy of what landed of these pulls into the engine's
    /// blocks failed while they were still out. Each ends as a cancelled
    /// pull does (its grant revoked before this returns, never reported:
    /// P's further writes are refused and its send ends) but counts failed
    /// (`copy_failed`); one that already ended counts as it ended (landed:
    /// failed `copy_failed`, as [`Worker::settle_landed`] counts it).
    pub fn fail_pulls<'a>(&self, reqs: impl IntoIterator<Item = &'a ReqId>) {
        if !self.shared.config.role.receives() {
            return;
        }
        let reason = "a copy of what landed into the engine's blocks failed; the pull was cut short";
        let cut = {
            let mut receiver = self.shared.lock_receiver();
            let cut = receiver.cut_short(reqs, FailureCause::CopyFailed, reason);
            self.shared.record_reports(&mut receiver);
            cut
        };
        self.fence_now(&cut.grants);
        self.shared.finished_changed.signal();
        for req in &cut.ended {
            self.settle_landed(req, Settled::CopyFailed);
        }
    }

    /// D: tells the prefill workers holding `reqs` to let go of them at once
    /// (this worker failed them before pulling): a pull of no blocks to
    /// each prefill worker a pull would go to (learning a prefill instance
    /// first if need be), never reported nor counted.
    pub fn release_on_prefill(&self, reqs: &BTreeMap<ReqId, kv_proto::RemotePrefill>) {
        if reqs.is_empty() || !self.shared.config.role.receives() {
            return;
        }
        let _guard = self.runtime.enter();
        let now = Instant::now();
        let mut known = BTreeMap::new();
        for (req, remote) in reqs {
            match &remote.bootstrap {
                None => {
                    known.insert(req.clone(), remote.clone());
                }
                Some(target) => {
                    let parked = Parked::Release { req: req.clone(), remote: remote.clone() };
                    if let Placed::Ready(Parked::Release { req, remote }) =
                        self.shared.lock_directory().place(target, parked, now)
                    {
                        known.insert(req, remote);
                    }
                }
            }
        }
        spawn_lookups(&self.shared);
        release(&self.shared, &known, now);
    }

    /// Applies one step's metadata: records send entries (P) and starts
    /// pulls (D). Returns at once.
    pub fn start_load_kv(&self, meta: &ConnectorMetadata) {
        let now = Instant::now();
        if self.shared.config.role.sends() && !(meta.reqs_to_send.is_empty() && meta.renewal_keys.is_empty()) {
            if !meta.send_names.is_empty() {
                self.shared.lock_send_names().record(&meta.send_names, &meta.reqs_to_send);
            }
            let mut sender = self.shared.lock_sender();
            for (req, update) in &meta.reqs_to_send {
                sender.handle_update(req, update, now);
            }
            for (req, key) in &meta.renewal_keys {
                sender.set_renewal_key(req, *key);
            }
            drop(sender);
            self.shared.sender_changed.notify_waiters();
        }
        if self.shared.config.role.receives() && !meta.reqs_to_cancel.is_empty() {
            let grants = {
                let mut receiver = self.shared.lock_receiver();
                let grants = receiver.cancel(&meta.reqs_to_cancel);
                self.shared.record_reports(&mut receiver);
                grants
            };
            self.fence_now(&grants);
            self.shared.finished_changed.signal();
        }
        if self.shared.config.role.receives() {
            let _guard = self.runtime.enter();
            let placed = place_bootstrapped(&self.shared, meta, now);
            let (watches, recvs) = placed.as_ref().map_or((&meta.reqs_to_watch, &meta.reqs_to_recv), |p| (&p.0, &p.1));
            apply_watches(&self.shared, watches, meta.reqs_to_unwatch.iter().chain(meta.reqs_to_recv.keys()), recvs);
            start_pulls(&self.shared, recvs, now);
        }
    }

    /// Revokes `grants` before returning (the engine frees their blocks
    /// right after): on the worker's runtime, blocking this thread, which
    /// may be an engine thread or a worker thread of a multi-threaded
    /// runtime. On a current-thread runtime a revocation that cannot finish
    /// at once is an error in the log, and the engine must not be run there.
    fn fence_now(&self, grants: &[GrantId]) {
        if grants.is_empty() {
            return;
        }
        let writer = &self.shared.writer;
        let revoke_all = async {
            for grant in grants {
                writer.revoke(grant).await;
            }
        };
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Err(_) => self.runtime.block_on(revoke_all),
            Ok(tokio::runtime::RuntimeFlavor::CurrentThread) => {
                if futures_util::FutureExt::now_or_never(revoke_all).is_none() {
                    tracing::error!(
                        grants = grants.len(),
                        "cannot wait for a revocation on a current-thread runtime; cancelled pulls are not fenced"
                    );
                }
            }
            Ok(_) => tokio::task::block_in_place(|| self.runtime.block_on(revoke_all)),
        }
    }

    /// Requests finished since the last call (the reference's `get_finished`,
    /// plus the failed pulls it never reported), by the engine's ids. Also
    /// frees P's entries whose lease ended.
    pub fn get_finished(&self) -> Finished {
        self.for_engine(self.finished_by_name())
    }

    /// `finished` with P's requests named as the engine names them (a send
    /// entry of the bootstrap flow is named by its transfer id).
    pub(crate) fn for_engine(&self, mut finished: Finished) -> Finished {
        if !finished.sending.is_empty() {
            finished.sending = self.shared.lock_send_names().for_engine(std::mem::take(&mut finished.sending));
        }
        finished
    }

    /// As [`Worker::get_finished`], P's requests by the names their send
    /// entries have (a staged worker's flow keeps them so).
    pub(crate) fn finished_by_name(&self) -> Finished {
        let now = Instant::now();
        let mut finished = Finished::default();
        if self.shared.config.role.sends() {
            let mut sender = self.shared.lock_sender();
            sender.handle_timeout(now);
            finished.sending = sender.poll_finished();
        }
        if self.shared.config.role.receives() {
            let mut receiver = self.shared.lock_receiver();
            let expired = receiver.handle_timeout(now);
            self.shared.record_reports(&mut receiver);
            let done = receiver.poll_finished();
            drop(receiver);
            // A pull past its deadline is normally ended by its own task; if
            // that task is late, fence it here. Either way it is reported
            // only once its grant is revoked.
            for (xfer_id, grant) in expired {
                let shared = self.shared.clone();
                let _guard = self.runtime.enter();
                self.shared.tracker.spawn(async move { fence(&shared, xfer_id, grant).await });
            }
            finished.receiving = done.received;
            finished.failed_receiving = done.failed;
        }
        finished
    }

    /// Waits until something finished or `timeout` passed, then returns what
    /// [`Worker::get_finished`] returns (possibly empty). For engine loops
    /// that have nothing else to do: no polling, no busy-waiting.
    pub async fn next_finished(&self, timeout: std::time::Duration) -> Finished {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.shared.finished_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let finished = self.get_finished();
            if !finished.is_empty() {
                return finished;
            }
            // A lease that ends is noticed by the clock, not by a task.
            let lease_end = self.shared.lock_sender().next_deadline().map(tokio::time::Instant::from_std);
            let wake = lease_end.map_or(deadline, |end| end.min(deadline));
            if tokio::time::timeout_at(wake, changed).await.is_err() && wake == deadline {
                return self.get_finished();
            }
        }
    }

    /// The signal [`Worker::next_finished`] waits on, for an engine thread
    /// that blocks for it instead ([`Changes::wait_past`]); it outlives the
    /// worker. [`Changes::signal`] wakes that thread from the engine's side.
    pub fn changes(&self) -> Arc<Changes> {
        self.shared.finished_changed.clone()
    }

    /// Stops every task, closes every socket and shuts the transport down;
    /// returns when all of it is done.
    pub async fn shutdown(mut self) {
        let shared = self.shared.clone();
        // This call waits for the tasks itself; `Drop` need not hand that to the runtime.
        self.shutdown_on_drop = false;
        drop(self);
        shared.tracker.wait().await;
        shared.writer.shutdown().await;
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
        self.shared.tracker.close();
        if !self.shutdown_on_drop {
            return;
        }
        // The memory-lifetime rule: once the drop returns, no byte of the
        // registered memory is touched (the engine may free it).
        self.shared.writer.close();
        // Sockets and tasks wind down in the background.
        let shared = self.shared.clone();
        self.runtime.spawn(async move {
            shared.tracker.wait().await;
            shared.writer.shutdown().await;
        });
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("engine_id", &self.shared.config.engine_id)
            .field("role", &self.shared.config.role)
            .field("side_channel", &self.side_channel)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}
