//! Simulated prefill and decode instances: each is a scheduler
//! (`kv-sched`), a worker (`kv-worker`) and a block pool, driven through the
//! flow of a disaggregated server step by step.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_proto::{BlockId, KvRole, KvTransferParams, LayoutKind, RenewalSecret, ReqId};
use kv_sched::{ConnectorScheduler, EngineRequest, RequestStatus, SchedError};
use kv_worker::pattern::RegionRows;
use kv_worker::{AllocError, BlockError, CacheShape, OwnedKvCache, Placement, Worker, WorkerConfig, WorkerError};
use serde::{Deserialize, Serialize};

use crate::blocks::{BlockPattern, BlockPool};
use crate::fill;
use crate::metrics::{Exposed, MetricsHub};

/// Why the simulated engine could not go on.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The scheduler refused a call.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// The worker could not start.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// The cache could not be allocated.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A block the pool handed out is not in the cache.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// Not enough free blocks.
    #[error("{instance}: no room for {needed} blocks ({free} free)")]
    OutOfBlocks {
        /// Which instance.
        instance: &'static str,
        /// Blocks asked for.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// A P worker has no side channel (not a producer).
    #[error("prefill worker has no side channel")]
    NoSideChannel,
    /// The OS random source failed: no renewal key can be minted.
    #[error("the operating system's random source failed; no renewal key can be minted")]
    NoRandom,
    /// Nothing finished within the bound while requests were in flight.
    #[error("no request finished within {waited:?} ({in_flight} in flight)")]
    Stalled {
        /// The bound.
        waited: Duration,
        /// Requests in flight.
        in_flight: usize,
    },
    /// The scheduler did not return transfer params for a finished request.
    #[error("request {0}: prefill returned no transfer params")]
    NoParams(ReqId),
    /// A pull names no prefill side channel (no remote host or port).
    #[error("request {0}: its transfer params name no prefill side channel to pull from")]
    NoRemote(ReqId),
    /// The model cannot be split over the instance's workers.
    #[error("{0}")]
    Topology(String),
}

/// The cache of the worker at `place` of an instance of a model whose
/// whole cache is `model`: its share of the KV heads (as vLLM splits them;
/// MLA's latent on every worker) and its stage's share of the layers.
///
/// # Errors
///
/// [`EngineError::Topology`] when the heads or layers do not split evenly.
pub fn rank_shape(model: CacheShape, place: Placement) -> Result<CacheShape, EngineError> {
    let (tp, pp) = (u32::from(place.tp_size), u32::from(place.pp_size));
    let layers = model.num_layers();
    if pp == 0 || layers % pp != 0 {
        return Err(EngineError::Topology(format!("{layers} layers cannot be split over {pp} pipeline stages")));
    }
    let heads = if model.kind() == LayoutKind::Mla {
        model.num_kv_heads()
    } else {
        kv_proto::topology::rank_heads(model.num_kv_heads(), tp, u32::from(place.tp_rank))
            .map_err(|e| EngineError::Topology(e.to_string()))?
            .count
    };
    let dims = kv_worker::CacheDims { num_kv_heads: heads, num_layers: layers / pp, ..model.dims() };
    let shape = CacheShape::try_new(dims).map_err(|e| EngineError::Topology(e.to_string()))?;
    Ok(shape.with_token_layout(model.token_layout()))
}

/// `config` for the worker at `place` of an instance of `model`: its
/// ranks, and the model's KV heads (what its heads are a share of).
pub fn rank_config(mut config: WorkerConfig, model: &CacheShape, place: Placement) -> WorkerConfig {
    config.tp_size = place.tp_size;
    config.tp_rank = place.tp_rank;
    config.pp_size = place.pp_size;
    config.pp_rank = place.pp_rank;
    config.identity.num_kv_heads = if model.kind() == LayoutKind::Mla { 1 } else { model.num_kv_heads() };
    config
}

/// The head rows of each region of `worker`'s cache of `shape` (its
/// heads, its stage's layers).
fn rows_of(worker: &Worker, shape: &CacheShape) -> Vec<RegionRows> {
    let topology = worker.topology();
    RegionRows::of_shape(shape, topology.heads.first, topology.pp_rank * shape.num_layers())
}

/// A request to prefill on P.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptSpec {
    /// Request id.
    pub id: ReqId,
    /// Prompt length in tokens.
    pub prompt_len: usize,
    /// Seed of its KV pattern.
    pub seed: u64,
}

/// A request to decode on D, with what P returned for it.
#[derive(Clone, Debug)]
pub struct PullSpec {
    /// Request id.
    pub id: ReqId,
    /// Prompt length in tokens.
    pub prompt_len: usize,
    /// Seed of its KV pattern (to verify).
    pub seed: u64,
    /// The params P returned (`do_remote_prefill`, host, port).
    pub params: KvTransferParams,
    /// Tokens D already has in its prefix cache (block-aligned).
    pub prefix_hit_tokens: usize,
}

/// The shape's tokens per block, as the scheduler takes it (a cache has at least one).
fn block_tokens(shape: &CacheShape) -> NonZeroUsize {
    NonZeroUsize::new(shape.block_size() as usize).unwrap_or(NonZeroUsize::MIN)
}

fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

/// Allocates a cache of `shape` and starts a worker on it. The worker is
/// shared only with a metrics hub, which holds it weakly (see
/// [`crate::metrics::MetricsHub`]).
async fn start_worker(
    config: WorkerConfig,
    shape: CacheShape,
) -> Result<(Arc<OwnedKvCache>, Arc<Worker>), EngineError> {
    let cache = Arc::new(OwnedKvCache::allocate(shape)?);
    let worker = Worker::start(config, cache.clone()).await?;
    Ok((cache, Arc::new(worker)))
}

/// A worker on a metrics hub (at most one hub per instance).
struct Shown {
    role: KvRole,
    engine_id: String,
    exposed: Option<Exposed>,
}

impl Shown {
    fn new(role: KvRole, engine_id: &str) -> Self {
        Self { role, engine_id: engine_id.to_owned(), exposed: None }
    }

    fn expose(&mut self, worker: &Arc<Worker>, hub: &MetricsHub) {
        self.exposed = Some(hub.expose(worker, self.role, &self.engine_id));
    }
}

/// Takes the worker off its hub (keeping what it counted), then shuts it
/// down.
async fn stop_worker(shown: Shown, worker: Arc<Worker>) {
    drop(shown);
    match Arc::try_unwrap(worker) {
        Ok(worker) => worker.shutdown().await,
        // Not reached: the hub holds workers weakly and never past the drop
        // above. Dropping this handle still closes the worker (its `Drop`).
        Err(_) => tracing::error!("a worker is still shared at shutdown; it closes when the last handle goes"),
    }
}

/// A prefill instance: computes requests' KV and holds it for D.
///
/// Like a vLLM engine, it gives each request its own internal id (the
/// client's id plus a suffix), so D must pull by the `remote_request_id`
/// this instance returns, never by the id it was handed.
pub struct PrefillInstance {
    /// Declared first so it drops first: off the hub before the worker goes.
    shown: Shown,
    sched: ConnectorScheduler,
    worker: Arc<Worker>,
    cache: Arc<OwnedKvCache>,
    pool: BlockPool,
    /// The head rows of each region (what prefill writes).
    rows: Vec<RegionRows>,
    /// Held blocks, by the client's id.
    held: HashMap<ReqId, Vec<BlockId>>,
    /// The client's id of each request scheduled here, by internal id.
    clients: HashMap<ReqId, ReqId>,
    write_patterns: bool,
}

impl PrefillInstance {
    /// Allocates a cache of `shape`, starts a producer worker on it. The
    /// params it returns name the side channel's bound address.
    pub async fn start(
        config: WorkerConfig,
        shape: CacheShape,
        pattern: BlockPattern,
        seed: u64,
    ) -> Result<Self, EngineError> {
        Self::start_advertising(config, shape, pattern, seed, None).await
    }

    /// Like [`PrefillInstance::start`], but the params it returns name
    /// `host` (when given) instead of the side channel's bound address: for a
    /// side channel bound to a wildcard address, the address D reaches it at.
    pub async fn start_advertising(
        config: WorkerConfig,
        shape: CacheShape,
        pattern: BlockPattern,
        seed: u64,
        host: Option<IpAddr>,
    ) -> Result<Self, EngineError> {
        let engine_id = config.engine_id.clone();
        let (cache, worker) = start_worker(config, shape).await?;
        let addr = worker.side_channel_addr().ok_or(EngineError::NoSideChannel)?;
        let host = host.unwrap_or(addr.ip());
        let shown = Shown::new(KvRole::Producer, engine_id.as_str());
        let secret = RenewalSecret::fresh().ok_or(EngineError::NoRandom)?;
        let sched = ConnectorScheduler::new(KvRole::Producer, engine_id, host.to_string(), addr.port(), secret)
            .with_block_tokens(block_tokens(&shape));
        let rows = rows_of(&worker, &shape);
        Ok(Self {
            shown,
            sched,
            worker,
            cache,
            rows,
            pool: BlockPool::new(shape.num_blocks(), pattern, seed),
            held: HashMap::new(),
            clients: HashMap::new(),
            write_patterns: true,
        })
    }

    /// This engine's internal id of the client's request `id` (what its
    /// params return as `remote_request_id`), for a D that pulls before the
    /// request finished here.
    pub fn internal_id(id: &ReqId) -> ReqId {
        ReqId::new(format!("{id}-prefill"))
    }

    /// Where D reaches this instance's side channel.
    pub fn side_channel(&self) -> Option<SocketAddr> {
        self.worker.side_channel_addr()
    }

    /// The worker (for inspection).
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Shows this instance's worker on `hub` until it shuts down (what it
    /// counted stays on the hub after that).
    pub fn expose(&mut self, hub: &MetricsHub) {
        self.shown.expose(&self.worker, hub);
    }

    /// Whether prefill writes each request's KV pattern (off for a bench
    /// that does not verify).
    pub fn set_write_patterns(&mut self, on: bool) {
        self.write_patterns = on;
    }

    /// The blocks held for a request.
    pub fn blocks_of(&self, id: &ReqId) -> Option<&[BlockId]> {
        self.held.get(id).map(Vec::as_slice)
    }

    /// Requests whose blocks are held for D.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Free blocks.
    pub fn free_blocks(&self) -> usize {
        self.pool.free_count()
    }

    /// Schedules one request with `do_remote_decode`: blocks allocated, the
    /// scheduler told (its metadata goes out with the step).
    fn admit(&mut self, p: &PromptSpec) -> Result<(EngineRequest, Vec<BlockId>), EngineError> {
        let request_id = Self::internal_id(&p.id);
        self.clients.insert(request_id.clone(), p.id.clone());
        let mut req = EngineRequest {
            request_id,
            prompt_len: p.prompt_len,
            status: RequestStatus::Running,
            kv_transfer_params: Some(KvTransferParams { do_remote_decode: true, ..Default::default() }),
        };
        let (external, _) = self.sched.get_num_new_matched_tokens(&req, 0);
        let needed = blocks_for(p.prompt_len, self.cache.shape().block_size() as usize);
        let free = self.pool.free_count();
        let blocks = self.pool.alloc(needed).ok_or(EngineError::OutOfBlocks { instance: "prefill", needed, free })?;
        self.sched.update_state_after_alloc(&mut req, &blocks, external)?;
        Ok((req, blocks))
    }

    /// One engine step in which `prompts` are scheduled, prefilled (KV
    /// written) and finish by length cap; returns the params the proxy hands
    /// to D for each.
    pub fn prefill(&mut self, prompts: &[PromptSpec]) -> Result<Vec<(PromptSpec, KvTransferParams)>, EngineError> {
        let mut running = Vec::with_capacity(prompts.len());
        for p in prompts {
            let (req, blocks) = self.admit(p)?;
            running.push((p.clone(), req, blocks));
        }
        self.worker.start_load_kv(&self.sched.build_connector_meta());
        let mut out = Vec::with_capacity(running.len());
        for (spec, mut req, blocks) in running {
            if self.write_patterns {
                fill::fill_request(&self.cache, &self.rows, spec.seed, &blocks)?;
            }
            req.status = RequestStatus::FinishedLengthCapped;
            let (delay_free, params) = self.sched.request_finished(&mut req, &blocks)?;
            if delay_free {
                self.held.insert(spec.id.clone(), blocks);
            } else {
                self.clients.remove(&req.request_id);
                self.pool.free(&blocks);
            }
            let params = params.ok_or_else(|| EngineError::NoParams(spec.id.clone()))?;
            out.push((spec, params));
        }
        self.worker.start_load_kv(&self.sched.build_connector_meta());
        Ok(out)
    }

    /// One engine step in which `prompts` are scheduled with remote decode
    /// and still running (not finished): D may already ask for them.
    pub fn schedule_only(&mut self, prompts: &[PromptSpec]) -> Result<(), EngineError> {
        for p in prompts {
            let (_, blocks) = self.admit(p)?;
            self.held.insert(p.id.clone(), blocks);
        }
        self.worker.start_load_kv(&self.sched.build_connector_meta());
        Ok(())
    }

    /// Waits (bounded by `timeout`) until the worker has admitted a pull;
    /// returns whether it did.
    pub async fn wait_for_pull_waiting(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.worker.transfers_in_progress() == 0 {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::task::yield_now().await;
        }
        true
    }

    /// One engine step in which `prompts` are scheduled with remote decode
    /// but then aborted (no delay-free): the worker must forget them.
    pub fn schedule_then_abort(&mut self, prompts: &[PromptSpec]) -> Result<(), EngineError> {
        let mut running = Vec::with_capacity(prompts.len());
        for p in prompts {
            running.push(self.admit(p)?);
        }
        self.worker.start_load_kv(&self.sched.build_connector_meta());
        for (mut req, blocks) in running {
            req.status = RequestStatus::FinishedAborted;
            let (delay_free, _) = self.sched.request_finished(&mut req, &blocks)?;
            debug_assert!(!delay_free);
            self.clients.remove(&req.request_id);
            self.pool.free(&blocks);
        }
        self.worker.start_load_kv(&self.sched.build_connector_meta());
        Ok(())
    }

    /// Frees the blocks of requests the worker reports finished sending;
    /// returns them (by the client's id).
    pub fn reap(&mut self) -> Vec<ReqId> {
        let finished = self.worker.get_finished();
        self.release(finished.sending)
    }

    /// Like [`PrefillInstance::reap`], waiting up to `timeout` for something to finish.
    pub async fn reap_wait(&mut self, timeout: Duration) -> Vec<ReqId> {
        let finished = self.worker.next_finished(timeout).await;
        self.release(finished.sending)
    }

    fn release(&mut self, sending: impl IntoIterator<Item = ReqId>) -> Vec<ReqId> {
        let mut freed = Vec::new();
        for internal in sending {
            let req = self.clients.remove(&internal).unwrap_or(internal);
            if let Some(blocks) = self.held.remove(&req) {
                self.pool.free(&blocks);
            }
            freed.push(req);
        }
        freed
    }

    /// Stops the worker and waits for its tasks.
    pub async fn shutdown(self) {
        stop_worker(self.shown, self.worker).await;
    }
}

/// How a pull ended on D.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Completion {
    /// Received, and every byte verified unless verification is off.
    Received {
        /// The request.
        id: ReqId,
        /// Blocks received.
        blocks: usize,
        /// Whether the bytes were checked.
        verified: bool,
        /// Time from the pull's start to its report.
        latency: Duration,
    },
    /// Reported received but a block holds wrong bytes.
    Corrupt {
        /// The request.
        id: ReqId,
        /// First wrong (region, block).
        at: (u32, BlockId),
    },
    /// Reported failed by the worker (the engine would recompute).
    Failed {
        /// The request.
        id: ReqId,
        /// Blocks that hold no valid KV.
        blocks: Vec<BlockId>,
    },
}

struct Pulling {
    seed: u64,
    blocks: Vec<BlockId>,
    /// The prompt token the blocks start at (the prefix-cache hit).
    first_token: u64,
    /// The prompt's length: rows past it are not checked.
    end_token: u64,
    started: Instant,
}

/// A decode instance: pulls requests' KV from prefill instances and
/// verifies it.
pub struct DecodeInstance {
    /// Declared first so it drops first: off the hub before the worker goes.
    shown: Shown,
    sched: ConnectorScheduler,
    worker: Arc<Worker>,
    cache: Arc<OwnedKvCache>,
    /// The head rows of each region (what decode checks).
    rows: Vec<RegionRows>,
    pool: BlockPool,
    pulling: HashMap<ReqId, Pulling>,
    verify: bool,
}

impl DecodeInstance {
    /// Allocates a cache of `shape`, starts a consumer worker on it.
    pub async fn start(
        config: WorkerConfig,
        shape: CacheShape,
        pattern: BlockPattern,
        seed: u64,
    ) -> Result<Self, EngineError> {
        let shown = Shown::new(KvRole::Consumer, config.engine_id.as_str());
        let secret = RenewalSecret::fresh().ok_or(EngineError::NoRandom)?;
        let sched = ConnectorScheduler::new(KvRole::Consumer, config.engine_id.clone(), "127.0.0.1", 0, secret)
            .with_block_tokens(block_tokens(&shape));
        let (cache, worker) = start_worker(config, shape).await?;
        let rows = rows_of(&worker, &shape);
        Ok(Self {
            shown,
            sched,
            worker,
            cache,
            rows,
            pool: BlockPool::new(shape.num_blocks(), pattern, seed),
            pulling: HashMap::new(),
            verify: true,
        })
    }

    /// The worker (for inspection).
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Shows this instance's worker on `hub` until it shuts down (what it
    /// counted stays on the hub after that).
    pub fn expose(&mut self, hub: &MetricsHub) {
        self.shown.expose(&self.worker, hub);
    }

    /// Whether received KV is verified byte by byte (on by default).
    pub fn set_verify(&mut self, on: bool) {
        self.verify = on;
    }

    /// The blocks a pull in flight lands in.
    pub fn blocks_of(&self, id: &ReqId) -> Option<&[BlockId]> {
        self.pulling.get(id).map(|p| p.blocks.as_slice())
    }

    /// Pulls in flight.
    pub fn pulling(&self) -> usize {
        self.pulling.len()
    }

    /// Free blocks.
    pub fn free_blocks(&self) -> usize {
        self.pool.free_count()
    }

    /// One engine step in which `pulls` are seen and wait (no room yet): the
    /// scheduler counts their external tokens, and the worker renews P's
    /// hold on them until [`DecodeInstance::schedule`] pulls them.
    pub fn watch(&mut self, pulls: &[PullSpec]) -> Result<(), EngineError> {
        refuse_without_remote(pulls)?;
        for p in pulls {
            self.sched.get_num_new_matched_tokens(&engine_request(p, RequestStatus::Waiting), p.prefix_hit_tokens);
        }
        self.worker.start_load_kv(&self.sched.build_connector_meta());
        Ok(())
    }

    /// One engine step in which `pulls` are scheduled: blocks allocated for
    /// what the prefix cache lacks, pulls started.
    pub fn schedule(&mut self, pulls: &[PullSpec]) -> Result<(), EngineError> {
        let block_size = self.cache.shape().block_size() as usize;
        refuse_without_remote(pulls)?;
        let mut started = Vec::with_capacity(pulls.len());
        for p in pulls {
            let mut req = engine_request(p, RequestStatus::Waiting);
            let (external, _load_async) = self.sched.get_num_new_matched_tokens(&req, p.prefix_hit_tokens);
            let total_blocks = blocks_for(p.prompt_len, block_size);
            let cached_blocks = (p.prefix_hit_tokens / block_size).min(total_blocks);
            let needed = if external > 0 { total_blocks - cached_blocks } else { 0 };
            let free = self.pool.free_count();
            let blocks =
                self.pool.alloc(needed).ok_or(EngineError::OutOfBlocks { instance: "decode", needed, free })?;
            self.sched.update_state_after_alloc(&mut req, &blocks, external)?;
            let pulling = Pulling {
                seed: p.seed,
                blocks,
                first_token: (cached_blocks * block_size) as u64,
                end_token: p.prompt_len as u64,
                started: Instant::now(),
            };
            started.push((p.id.clone(), pulling));
        }
        self.pulling.extend(started);
        self.worker.start_load_kv(&self.sched.build_connector_meta());
        Ok(())
    }

    /// One engine step in which requests are aborted before they were
    /// scheduled: P is told (empty block list) so it frees.
    pub fn abort_unscheduled(&mut self, pulls: &[PullSpec]) -> Result<(), EngineError> {
        for p in pulls {
            let mut req = engine_request(p, RequestStatus::FinishedAborted);
            self.sched.request_finished(&mut req, &[])?;
            let pulling =
                Pulling { seed: p.seed, blocks: Vec::new(), first_token: 0, end_token: 0, started: Instant::now() };
            self.pulling.insert(p.id.clone(), pulling);
        }
        self.worker.start_load_kv(&self.sched.build_connector_meta());
        Ok(())
    }

    /// Waits up to `timeout` for pulls to finish; verifies and frees what did.
    pub async fn complete(&mut self, timeout: Duration) -> Vec<Completion> {
        let finished = self.worker.next_finished(timeout).await;
        let mut out = Vec::with_capacity(finished.receiving.len() + finished.failed_receiving.len());
        for id in finished.receiving {
            let Some(p) = self.pulling.remove(&id) else { continue };
            let latency = p.started.elapsed();
            let checked = if self.verify {
                fill::verify_request(&self.cache, &self.rows, p.seed, &p.blocks, p.first_token, p.end_token)
            } else {
                Ok(())
            };
            match checked {
                Ok(()) => out.push(Completion::Received { id, blocks: p.blocks.len(), verified: self.verify, latency }),
                Err(at) => out.push(Completion::Corrupt { id, at }),
            }
            self.pool.free(&p.blocks);
        }
        for (id, blocks) in finished.failed_receiving {
            if let Some(p) = self.pulling.remove(&id) {
                self.pool.free(&p.blocks);
            }
            out.push(Completion::Failed { id, blocks });
        }
        out
    }

    /// Stops the worker and waits for its tasks.
    pub async fn shutdown(self) {
        stop_worker(self.shown, self.worker).await;
    }
}

/// The engine's view of pull `p` in `status`.
fn engine_request(p: &PullSpec, status: RequestStatus) -> EngineRequest {
    EngineRequest {
        request_id: p.id.clone(),
        prompt_len: p.prompt_len,
        status,
        kv_transfer_params: Some(p.params.clone()),
    }
}

/// The scheduler records no pull for params without a side channel (the
/// engine computes such a request itself): refuse them here rather than
/// wait for a report that never comes.
fn refuse_without_remote(pulls: &[PullSpec]) -> Result<(), EngineError> {
    match pulls.iter().find(|p| p.params.remote_host.is_none() || p.params.remote_port.is_none()) {
        Some(p) => Err(EngineError::NoRemote(p.id.clone())),
        None => Ok(()),
    }
}
