//! The transfer loop shared by `kvlink demo`, `kvlink bench` and `kvlink
//! bench --connect`: requests pipelined through the full flow with a bounded
//! number in flight, between a prefill and a decode side that are both in
//! this process, or one here and one on a `kvlink serve` host, or decode
//! here pulling from several `kvlink serve` producers (requests spread over
//! them in turn).
//!
//! When a remote prefill server goes away mid-run (its control connection
//! fails), the run stops issuing, lets the pulls in flight on the decode
//! side here end (they fail) and reports them, with the error; a remote
//! decode server that goes away ends the run with the error, as its pulls'
//! outcomes went with it.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use kv_proto::{BlockId, KvRole, KvTransferParams, Protocol, ReqId};
use kv_worker::{plan::contiguous_runs, AuthSecret, CacheShape, ShapeError, WorkerConfig};
use serde::Serialize;

use crate::blocks::BlockPattern;
use crate::control::{ControlClient, ControlError, PeerStats, RemoteDecode, RemotePrefill};
use crate::engine::{Completion, EngineError, PromptSpec, PullSpec};
use crate::metrics::MetricsHub;
use crate::ranks::{LocalDecode, LocalPrefill, Split};
use crate::stats::{peak_rss_bytes, process_cpu_time, Latencies, ProcessFigures};

/// Bound on waiting for the tasks of shut-down sides to be released before
/// sampling the process's figures after a run.
const SETTLE_BOUND: Duration = Duration::from_secs(1);

/// Bound on connecting to a `kvlink serve`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// What to run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Data-plane transport.
    pub protocol: Protocol,
    /// Cache shape of both instances (`num_blocks` is derived).
    pub shape: CacheShape,
    /// Blocks of each request's prompt.
    pub blocks_per_request: usize,
    /// Measured requests.
    pub requests: usize,
    /// Unmeasured requests run first.
    pub warmup: usize,
    /// Requests in flight at once.
    pub in_flight: usize,
    /// Block-id pattern of both instances' allocators.
    pub pattern: BlockPattern,
    /// Every n-th request has a partial prefix-cache hit on D (0: none).
    pub prefix_hit_every: usize,
    /// Verify every received byte.
    pub verify: bool,
    /// Bound on waiting for any request to finish.
    pub stall_timeout: Duration,
    /// `HOST[:PORT]` of `kvlink serve`s: none runs both sides here; one runs
    /// the other side there; several must all be producers, and decode here
    /// pulls from each in turn.
    pub connect: Vec<String>,
    /// Shared secret of the side channel and TCP data plane of both sides.
    pub auth_secret: Option<AuthSecret>,
    /// The TCP data plane tags every payload too (needs the secret): see
    /// `WorkerConfig::tcp_authenticate_payloads`. Applies to the workers
    /// of this process.
    pub tcp_authenticate_payloads: bool,
    /// Where this process's workers are shown (a metrics endpoint's hub).
    pub metrics: Option<MetricsHub>,
    /// The bounds of the instances run here (their listeners' limits among
    /// them).
    pub worker_bounds: crate::serve::WorkerBounds,
    /// How the prefill instance is split over workers (both sides here only).
    pub prefill_split: Split,
    /// How the decode instance is split over workers (both sides here only).
    pub decode_split: Split,
    /// Tokens per block of the decode instance (`None`: the shape's, as
    /// prefill's).
    pub decode_block_size: Option<u32>,
}

impl RunOptions {
    /// Options for `protocol` and `shape` with everything else at the
    /// demo's defaults: one worker per side, nothing remote.
    pub fn new(protocol: Protocol, shape: CacheShape) -> Self {
        Self {
            protocol,
            shape,
            blocks_per_request: 64,
            requests: 100,
            warmup: 0,
            in_flight: 4,
            pattern: BlockPattern::Contiguous,
            prefix_hit_every: 0,
            verify: true,
            stall_timeout: Duration::from_secs(60),
            connect: Vec::new(),
            auth_secret: None,
            tcp_authenticate_payloads: false,
            metrics: None,
            worker_bounds: crate::serve::WorkerBounds::default(),
            prefill_split: Split::ONE,
            decode_split: Split::ONE,
            decode_block_size: None,
        }
    }

    /// Whether the two sides are laid out alike (one worker each, one
    /// block size): what a run with a remote side needs.
    fn plain(&self) -> bool {
        self.prefill_split == Split::ONE
            && self.decode_split == Split::ONE
            && self.decode_block_size.is_none_or(|b| b == self.shape.block_size())
    }
}

/// Why a run stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A local instance failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The session with the remote side failed.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The caches sized for the requests in flight are too large to address.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// The OS random source failed (request ids must be unguessable).
    #[error("no OS randomness for request ids")]
    NoRandomness,
    /// Several servers, one of them not a producer.
    #[error("{target} serves decode: several --connect servers must all be producers (kvlink serve --role producer)")]
    NotAllProducers {
        /// The consumer server, as given.
        target: String,
    },
    /// The sides cannot be split as asked.
    #[error("{0}")]
    Topology(String),
    /// Several servers reach this host at different addresses; decode here
    /// listens on one.
    #[error("the --connect servers reach this host at different addresses ({first} and {other}); connect them over one network")]
    ManyLocalAddresses {
        /// Where the first server reaches this host.
        first: IpAddr,
        /// Where another does.
        other: IpAddr,
    },
}

impl RunReport {
    /// Whether the run did everything it was asked: every measured request
    /// received (and verified, if on), nothing failed, warm-up included, no
    /// server went away, and the workers counted what the bench saw.
    pub fn complete(&self) -> bool {
        self.failed == 0
            && self.corrupt == 0
            && self.warmup_failed == 0
            && self.received == self.requests
            && self.error.is_none()
            && self.metrics_mismatch.is_empty()
    }
}

/// What happened.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunReport {
    /// Protocol used.
    pub protocol: String,
    /// Measured requests.
    pub requests: usize,
    /// Requests received (and verified, if on).
    pub received: usize,
    /// Requests reported failed.
    pub failed: usize,
    /// Requests whose bytes were wrong.
    pub corrupt: usize,
    /// Warm-up requests that failed or arrived wrong (not measured, but a
    /// run with any is not a success).
    pub warmup_failed: usize,
    /// Whether bytes were verified.
    pub verified: bool,
    /// KV bytes moved (measured requests).
    pub bytes: u64,
    /// Wall time of the measured part, seconds.
    pub seconds: f64,
    /// Throughput, 10^9 bytes per second.
    pub gbytes_per_sec: f64,
    /// Requests per second.
    pub requests_per_sec: f64,
    /// Per-request latency (pull start to received), milliseconds.
    pub latency_ms_p50: f64,
    /// 90th percentile.
    pub latency_ms_p90: f64,
    /// 99th percentile.
    pub latency_ms_p99: f64,
    /// Write ops per request's batch (mean): per request, over every
    /// prefill worker.
    pub ops_per_batch: f64,
    /// Tensor-parallel sizes of prefill and decode.
    pub tp: (u16, u16),
    /// Tokens per block of prefill and decode.
    pub block_sizes: (u32, u32),
    /// CPU seconds (user + system) of this process per GB moved.
    pub cpu_seconds_per_gb: f64,
    /// Peak resident set of this process, bytes.
    pub peak_rss_bytes: u64,
    /// The caches in this process, bytes (registered memory, part of the
    /// RSS when touched).
    pub cache_bytes: u64,
    /// The `kvlink serve` that ran the other side (remote runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// The side this process ran: `prefill`, `decode` or `both`.
    pub side: String,
    /// The server's CPU seconds per GB moved (remote runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_cpu_seconds_per_gb: Option<f64>,
    /// The server's peak resident set, bytes (remote runs; the largest of
    /// several servers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_peak_rss_bytes: Option<u64>,
    /// Each server of a remote run.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerReport>,
    /// What this process held: before the run, after the warm-up, at the end
    /// of the measured part and after every side was shut down.
    pub figures: RunFigures,
    /// Pulls that failed on the decode worker here, by cause (warm-up
    /// included; causes with a count only; empty when decode ran remotely).
    pub failures: BTreeMap<String, u64>,
    /// Requests the prefill worker here failed to send, by cause (warm-up
    /// included; empty when prefill ran remotely).
    pub send_failures: BTreeMap<String, u64>,
    /// Where the bench's own totals and its decode worker's counters
    /// disagree (none when they agree).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub metrics_mismatch: Vec<String>,
    /// Why the run ended early: a remote server went away mid-run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One server of a remote run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PeerReport {
    /// Its control address.
    pub addr: String,
    /// Its CPU seconds over the measured part, per GB moved (all servers).
    pub cpu_seconds_per_gb: f64,
    /// Its peak resident set, bytes.
    pub peak_rss_bytes: u64,
    /// What it held after the warm-up (`None` from servers that do not say).
    pub warm: Option<ProcessFigures>,
    /// What it held at the end of the measured part.
    pub end: Option<ProcessFigures>,
}

/// What this process held at the points of a run.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct RunFigures {
    /// Before any side started.
    pub baseline: ProcessFigures,
    /// After the warm-up, as the measured part starts.
    pub warm: ProcessFigures,
    /// When the measured part ended, sides still up.
    pub end: ProcessFigures,
    /// After every side was shut down (sessions ended).
    pub after: ProcessFigures,
}

/// The prefill side of a run.
enum PrefillSide {
    Local(Box<LocalPrefill>),
    /// One or more producer servers; request `n` goes to server `n % len`.
    Remote(Vec<RemotePrefill>),
}

impl PrefillSide {
    /// One step prefilling `prompts` (on server `turn % len` when remote):
    /// each with its params and P's blocks.
    async fn prefill(
        &mut self,
        prompts: &[PromptSpec],
        turn: usize,
    ) -> Result<Vec<(PromptSpec, KvTransferParams, Vec<BlockId>)>, RunError> {
        match self {
            PrefillSide::Local(p) => Ok(p.prefill(prompts)?),
            PrefillSide::Remote(servers) => {
                let n = servers.len().max(1);
                match servers.get_mut(turn % n) {
                    Some(r) => Ok(r.prefill(prompts).await?),
                    None => Ok(Vec::new()),
                }
            }
        }
    }

    /// Frees what finished sending (the server does it on its own).
    fn reap(&mut self) {
        if let PrefillSide::Local(p) = self {
            p.reap();
        }
    }

    /// Waits (bounded) until every held request is freed; returns how many are still held.
    async fn drain(&mut self, timeout: Duration) -> Result<usize, RunError> {
        match self {
            PrefillSide::Local(p) => Ok(p.drain(timeout).await),
            PrefillSide::Remote(servers) => {
                let mut held = 0;
                for r in servers {
                    held += r.drain(timeout).await?;
                }
                Ok(held)
            }
        }
    }

    fn remotes(&mut self) -> Vec<&mut ControlClient> {
        match self {
            PrefillSide::Local(_) => Vec::new(),
            PrefillSide::Remote(servers) => servers.iter_mut().map(RemotePrefill::client).collect(),
        }
    }

    async fn shutdown(self) -> Result<(), RunError> {
        match self {
            PrefillSide::Local(p) => p.shutdown().await,
            PrefillSide::Remote(servers) => {
                for r in servers {
                    r.into_client().bye().await?;
                }
            }
        }
        Ok(())
    }
}

/// The decode side of a run.
enum DecodeSide {
    Local(LocalDecode),
    Remote(Box<RemoteDecode>),
}

impl DecodeSide {
    /// One step starting `pulls`: D's blocks per pull.
    async fn schedule(&mut self, pulls: &[PullSpec]) -> Result<Vec<Vec<BlockId>>, RunError> {
        match self {
            DecodeSide::Local(d) => Ok(d.schedule(pulls)?),
            DecodeSide::Remote(r) => Ok(r.schedule(pulls).await?),
        }
    }

    fn pulling(&self) -> usize {
        match self {
            DecodeSide::Local(d) => d.pulling(),
            DecodeSide::Remote(r) => r.pulling(),
        }
    }

    async fn complete(&mut self, timeout: Duration) -> Result<Vec<Completion>, RunError> {
        match self {
            DecodeSide::Local(d) => Ok(d.complete(timeout).await),
            DecodeSide::Remote(r) => Ok(r.complete(timeout).await?),
        }
    }

    fn remote(&mut self) -> Option<&mut ControlClient> {
        match self {
            DecodeSide::Local(_) => None,
            DecodeSide::Remote(r) => Some(r.client()),
        }
    }

    async fn shutdown(self) -> Result<(), RunError> {
        match self {
            DecodeSide::Local(d) => d.shutdown().await,
            DecodeSide::Remote(r) => (*r).into_client().bye().await?,
        }
        Ok(())
    }
}

/// The two sides of a run, at most one of them remote.
struct Sides {
    prefill: PrefillSide,
    decode: DecodeSide,
    /// Why a remote prefill server is taken as gone: no further call goes
    /// to any server.
    lost: Option<String>,
}

impl Sides {
    /// Whether a failed call to a remote prefill server is survivable: the
    /// decode side is here, so the pulls in flight still end and are told.
    fn may_lose_prefill(&self) -> bool {
        matches!((&self.prefill, &self.decode), (PrefillSide::Remote(_), DecodeSide::Local(_)))
    }

    /// Takes `error` of a call to a remote prefill server as the end of
    /// it, where that is survivable; otherwise hands it back.
    fn lose(&mut self, error: RunError) -> Result<(), RunError> {
        match error {
            RunError::Control(e) if self.may_lose_prefill() => {
                tracing::error!(error = %e, "a prefill server went away; the pulls in flight end, no more are issued");
                self.lost.get_or_insert_with(|| e.to_string());
                Ok(())
            }
            e => Err(e),
        }
    }

    /// Waits up to `timeout` for pulls to finish. While decode waits here
    /// for remote prefills, their control connections are silent: they are
    /// kept alive with pings, or the servers would end the sessions as idle.
    async fn complete(&mut self, timeout: Duration) -> Result<Vec<Completion>, RunError> {
        let (DecodeSide::Local(d), PrefillSide::Remote(servers)) = (&mut self.decode, &mut self.prefill) else {
            return self.decode.complete(timeout).await;
        };
        let every = servers.iter_mut().map(|r| r.client().keepalive_interval()).min();
        let Some(every) = every.filter(|_| self.lost.is_none()) else {
            return Ok(d.complete(timeout).await);
        };
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let done = d.complete(left.min(every)).await;
            if !done.is_empty() || left <= every {
                return Ok(done);
            }
            for r in servers.iter_mut() {
                if let Err(e) = r.client().ping().await {
                    self.lost.get_or_insert_with(|| e.to_string());
                    tracing::error!(error = %e, "a prefill server went away; the pulls in flight end, no more are issued");
                    // Wait on the decode side alone from now on.
                    let left = deadline.saturating_duration_since(Instant::now());
                    return Ok(d.complete(left).await);
                }
            }
        }
    }

    /// Each server's address and figures, on a remote run (empty otherwise,
    /// and once a server is gone).
    async fn peer_stats(&mut self) -> Result<Vec<(String, PeerStats)>, RunError> {
        if self.lost.is_some() {
            return Ok(Vec::new());
        }
        let mut clients = self.prefill.remotes();
        clients.extend(self.decode.remote());
        let mut out = Vec::with_capacity(clients.len());
        let mut failed = None;
        for c in clients {
            match c.stats().await {
                Ok(stats) => out.push((c.peer_addr().to_string(), stats)),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        match failed {
            None => Ok(out),
            Some(e) => self.lose(e.into()).map(|()| Vec::new()),
        }
    }

    /// The failures by cause of the workers here, and where each decode
    /// worker's counters disagree with what the bench saw of it.
    fn failures(&self, report: &mut RunReport) {
        if let DecodeSide::Local(d) = &self.decode {
            (report.failures, report.metrics_mismatch) = d.failures();
            for mismatch in &report.metrics_mismatch {
                tracing::error!(%mismatch, "the bench and its decode worker disagree");
            }
        }
        if let PrefillSide::Local(p) = &self.prefill {
            report.send_failures = p.send_failures();
        }
    }

    /// Write ops of every batch the prefill workers here wrote so far
    /// (`None` when prefill runs remotely).
    fn ops_written(&self) -> Option<f64> {
        match &self.prefill {
            PrefillSide::Local(p) => Some(p.ops_written()),
            PrefillSide::Remote(_) => None,
        }
    }

    /// Shuts both sides down; a server that is gone is not called.
    async fn shutdown(self) -> Result<(), RunError> {
        let Sides { prefill, decode, lost } = self;
        match (prefill, lost) {
            (PrefillSide::Remote(servers), Some(_)) => drop(servers),
            (prefill, _) => prefill.shutdown().await?,
        }
        decode.shutdown().await
    }
}

fn worker_config(role: KvRole, engine_id: &str, opts: &RunOptions, bind: Option<IpAddr>) -> WorkerConfig {
    let mut config = WorkerConfig::loopback(role, engine_id);
    config.protocol = opts.protocol;
    config.auth_secret = opts.auth_secret.clone();
    config.tcp_authenticate_payloads = opts.tcp_authenticate_payloads;
    opts.worker_bounds.apply_to(&mut config);
    if let Some(ip) = bind {
        config.side_channel_bind = ip;
        config.data_listen = SocketAddr::new(ip, 0);
    }
    config
}

/// Starts both sides: here, or one here and one on the `kvlink serve` at
/// `opts.connect` (whose role decides which runs here), or decode here and
/// prefill on every `kvlink serve` producer named.
async fn start_sides(
    opts: &RunOptions,
    shape: CacheShape,
    decode_shape: CacheShape,
    report: &mut RunReport,
) -> Result<Sides, RunError> {
    if opts.connect.is_empty() {
        let p_config = worker_config(KvRole::Producer, "kvlink-prefill", opts, None);
        let d_config = worker_config(KvRole::Consumer, "kvlink-decode", opts, None);
        let mut prefill = LocalPrefill::start(&p_config, shape, opts.prefill_split, opts.pattern, None).await?;
        let mut decode = LocalDecode::start(&d_config, decode_shape, opts.decode_split, opts.pattern).await?;
        prefill.set_write_patterns(opts.verify);
        decode.set_verify(opts.verify);
        if let Some(hub) = &opts.metrics {
            prefill.expose(hub);
            decode.expose(hub);
        }
        report.side = "both".to_owned();
        report.cache_bytes = prefill.cache_bytes() + decode.cache_bytes();
        return Ok(Sides {
            prefill: PrefillSide::Local(Box::new(prefill)),
            decode: DecodeSide::Local(decode),
            lost: None,
        });
    }
    if !opts.plain() {
        return Err(RunError::Topology(
            "--tp-prefill, --tp-decode, --pp-* and per-side block sizes run both sides here (no --connect)".to_owned(),
        ));
    }
    let call_timeout = opts.stall_timeout + Duration::from_secs(10);
    let mut clients = Vec::with_capacity(opts.connect.len());
    for target in &opts.connect {
        let mut client = ControlClient::connect(target, CONNECT_TIMEOUT, call_timeout).await?;
        let role = client.hello(shape, opts.pattern, opts.protocol, opts.verify, opts.auth_secret.as_ref()).await?;
        if opts.connect.len() > 1 && role != KvRole::Producer {
            return Err(RunError::NotAllProducers { target: target.clone() });
        }
        clients.push((client, role));
    }
    // Listen where the servers reached us: the address they can reach back.
    let here = clients[0].0.local_addr().ip();
    if let Some(other) = clients.iter().map(|(c, _)| c.local_addr().ip()).find(|ip| *ip != here) {
        return Err(RunError::ManyLocalAddresses { first: here, other });
    }
    report.peer = Some(clients.iter().map(|(c, _)| c.peer_addr().to_string()).collect::<Vec<_>>().join(", "));
    report.cache_bytes = shape.total_bytes();
    if clients.len() == 1 && clients[0].1 == KvRole::Consumer {
        let (client, _) = clients.remove(0);
        let config = worker_config(KvRole::Producer, "kvlink-bench-prefill", opts, Some(here));
        let mut prefill = LocalPrefill::start(&config, shape, Split::ONE, opts.pattern, None).await?;
        prefill.set_write_patterns(opts.verify);
        if let Some(hub) = &opts.metrics {
            prefill.expose(hub);
        }
        report.side = "prefill".to_owned();
        return Ok(Sides {
            prefill: PrefillSide::Local(Box::new(prefill)),
            decode: DecodeSide::Remote(Box::new(RemoteDecode::new(client))),
            lost: None,
        });
    }
    let config = worker_config(KvRole::Consumer, "kvlink-bench-decode", opts, Some(here));
    let mut decode = LocalDecode::start(&config, shape, Split::ONE, opts.pattern).await?;
    decode.set_verify(opts.verify);
    if let Some(hub) = &opts.metrics {
        decode.expose(hub);
    }
    report.side = "decode".to_owned();
    let servers = clients.into_iter().map(|(c, _)| RemotePrefill::new(c)).collect();
    Ok(Sides { prefill: PrefillSide::Remote(servers), decode: DecodeSide::Local(decode), lost: None })
}

/// Runs the loop; `progress` ticks once per measured request.
pub async fn run(opts: &RunOptions, progress: &ProgressBar) -> Result<RunReport, RunError> {
    let window = opts.in_flight.max(1);
    // Scattered and random ids need free blocks between the allocated ones:
    // twice the blocks in flight, so a scattered request really is one op per
    // block rather than falling back to adjacent blocks.
    let slack = if opts.pattern == BlockPattern::Contiguous { 1 } else { 2 };
    if opts.prefill_split.pp != opts.decode_split.pp {
        return Err(RunError::Topology(format!(
            "pipeline-parallel size {} on prefill and {} on decode: pipeline parallelism must be the same on both sides",
            opts.prefill_split.pp, opts.decode_split.pp
        )));
    }
    let shape = opts.shape.with_num_blocks((opts.blocks_per_request * window * slack) as u64 + 1)?;
    let block_size = shape.block_size() as usize;
    let prompt_len = opts.blocks_per_request * block_size;
    let decode_block = opts.decode_block_size.unwrap_or(shape.block_size()).max(1);
    let decode_blocks = prompt_len.div_ceil(decode_block as usize);
    let decode_shape = kv_worker::CacheShape::try_new(kv_worker::CacheDims {
        block_size: decode_block,
        num_blocks: (decode_blocks * window * slack) as u64 + 1,
        ..shape.dims()
    })?
    .with_token_layout(shape.token_layout());
    let mut report = RunReport {
        protocol: opts.protocol.to_string(),
        requests: opts.requests,
        verified: opts.verify,
        tp: (opts.prefill_split.tp, opts.decode_split.tp),
        block_sizes: (shape.block_size(), decode_block),
        ..RunReport::default()
    };
    report.figures.baseline = ProcessFigures::sample();
    let mut sides = start_sides(opts, shape, decode_shape, &mut report).await?;

    let bytes_per_block = match &sides.decode {
        DecodeSide::Local(d) => d.bytes_per_block(),
        DecodeSide::Remote(_) => decode_shape.block_len() * u64::from(decode_shape.region_count()),
    };
    let total = opts.warmup + opts.requests;
    let mut latencies = Latencies::default();
    let mut ops_total = 0u64;
    let mut ops_at_start: Option<f64> = None;
    let (mut next, mut finished) = (0usize, 0usize);
    let mut measure_start: Option<(Instant, Duration)> = None;
    let mut peer_start = Vec::new();
    let mut failing = false;
    // Request ids no one can guess (a peer of an unauthenticated side channel
    // must not be able to claim another request's KV by naming it).
    let run_tag: String =
        kv_proto::random::array::<8>().ok_or(RunError::NoRandomness)?.iter().map(|b| format!("{b:02x}")).collect();
    while finished < next || next < total {
        // After a failed or corrupt pull, stop issuing: the prefill side holds
        // failed requests' blocks until their lease ends, and the run's
        // verdict is known. Requests in flight still finish.
        if failing && finished == next {
            break;
        }
        // Fill the window, one request per engine step on each side: its
        // pull starts while the next one is prefilled (pulls of one decode
        // step would go to P as one transfer request and finish together).
        while !failing && next < total && sides.decode.pulling() < window {
            if next == opts.warmup {
                if finished < opts.warmup {
                    break; // drain the warm-up before measuring
                }
                peer_start = sides.peer_stats().await?;
                if sides.lost.is_some() {
                    failing = true;
                    break;
                }
                report.figures.warm = ProcessFigures::sample();
                ops_at_start = sides.ops_written();
                measure_start = Some((Instant::now(), process_cpu_time()));
            }
            let spec = PromptSpec { id: ReqId::new(format!("req-{run_tag}-{next}")), prompt_len, seed: next as u64 };
            let prefix_hit = opts.prefix_hit_every > 0 && next % opts.prefix_hit_every == opts.prefix_hit_every - 1;
            // Whole decode blocks: what a prefix cache holds.
            let prefix_hit_tokens = if prefix_hit { (decode_blocks / 4) * decode_block as usize } else { 0 };
            let prefilled = match sides.prefill.prefill(std::slice::from_ref(&spec), next).await {
                Ok(prefilled) => prefilled,
                Err(e) => {
                    sides.lose(e)?;
                    failing = true;
                    break;
                }
            };
            for (spec, params, local) in prefilled {
                let pull =
                    PullSpec { id: spec.id, prompt_len: spec.prompt_len, seed: spec.seed, params, prefix_hit_tokens };
                for remote in sides.decode.schedule(std::slice::from_ref(&pull)).await? {
                    // D pulls the tail of P's blocks its prefix cache lacks.
                    if let (true, Some(skip)) = (next >= opts.warmup, local.len().checked_sub(remote.len())) {
                        ops_total +=
                            contiguous_runs(&local[skip..], &remote).len() as u64 * u64::from(shape.region_count());
                    }
                }
            }
            next += 1;
        }
        if finished == next {
            break; // nothing in flight and nothing more to issue
        }
        let completions = sides.complete(opts.stall_timeout).await?;
        failing |= sides.lost.is_some();
        if completions.is_empty() {
            return Err(EngineError::Stalled { waited: opts.stall_timeout, in_flight: sides.decode.pulling() }.into());
        }
        for c in completions {
            // The warm-up drains before the first measured request starts, so
            // the first `warmup` completions are exactly the warm-up's.
            let is_warmup = finished < opts.warmup;
            finished += 1;
            if !matches!(c, Completion::Received { .. }) {
                failing = true;
            }
            if is_warmup {
                if let Completion::Failed { id, .. } | Completion::Corrupt { id, .. } = &c {
                    tracing::error!(req_id = %id, "warm-up request failed");
                    report.warmup_failed += 1;
                }
                continue;
            }
            progress.inc(1);
            match c {
                Completion::Received { blocks, latency, .. } => {
                    report.received += 1;
                    report.bytes += blocks as u64 * bytes_per_block;
                    latencies.record(latency);
                }
                Completion::Corrupt { id, at } => {
                    tracing::error!(req_id = %id, region = at.0, block = at.1, "received KV does not match what prefill computed");
                    report.corrupt += 1;
                }
                Completion::Failed { id, blocks } => {
                    tracing::error!(req_id = %id, blocks = blocks.len(), "pull failed");
                    report.failed += 1;
                }
            }
        }
        sides.prefill.reap();
    }
    let (start, cpu_start) = measure_start.unwrap_or((Instant::now(), process_cpu_time()));
    let elapsed = start.elapsed();
    let cpu = process_cpu_time().saturating_sub(cpu_start);
    report.figures.end = ProcessFigures::sample();
    if measure_start.is_none() {
        report.figures.warm = report.figures.end;
    }
    let peer_end = sides.peer_stats().await?;
    let ops_measured = sides.ops_written().zip(ops_at_start.or(Some(0.0))).map(|(end, start)| end - start);
    sides.failures(&mut report);
    report.error = sides.lost.clone();
    failing |= sides.lost.is_some();
    // Let P's last frees arrive, so nothing is left held. After failed
    // pulls P may hold those requests until its lease ends: don't wait for it.
    if !failing {
        let held = sides.prefill.drain(opts.stall_timeout).await?;
        if held > 0 {
            tracing::warn!(held, "prefill still holds requests after the run");
        }
    } else {
        tracing::warn!(failed = report.failed, "prefill frees the failed requests' blocks when their lease ends");
    }
    let gb = report.bytes as f64 / 1e9;
    report.seconds = elapsed.as_secs_f64();
    report.gbytes_per_sec = gb / report.seconds.max(1e-9);
    report.requests_per_sec = report.received as f64 / report.seconds.max(1e-9);
    report.latency_ms_p50 = latencies.quantile(0.50).as_secs_f64() * 1e3;
    report.latency_ms_p90 = latencies.quantile(0.90).as_secs_f64() * 1e3;
    report.latency_ms_p99 = latencies.quantile(0.99).as_secs_f64() * 1e3;
    report.ops_per_batch = ops_measured.unwrap_or(ops_total as f64) / opts.requests.max(1) as f64;
    report.cpu_seconds_per_gb = cpu.as_secs_f64() / gb.max(1e-9);
    report.peak_rss_bytes = peak_rss_bytes();
    // No measured part started (every request failed in the warm-up): the
    // end figures serve as the start.
    let peer_start = if peer_start.is_empty() { peer_end.clone() } else { peer_start };
    for ((addr, start), (_, end)) in peer_start.into_iter().zip(peer_end) {
        report.peers.push(PeerReport {
            addr,
            cpu_seconds_per_gb: end.cpu.saturating_sub(start.cpu).as_secs_f64() / gb.max(1e-9),
            peak_rss_bytes: end.peak_rss_bytes,
            warm: start.figures,
            end: end.figures,
        });
    }
    if !report.peers.is_empty() {
        report.peer_cpu_seconds_per_gb = Some(report.peers.iter().map(|p| p.cpu_seconds_per_gb).sum());
        report.peer_peak_rss_bytes = report.peers.iter().map(|p| p.peak_rss_bytes).max();
    }
    sides.shutdown().await?;
    // Everything this run spawned is shut down: as many tasks as before it.
    report.figures.after = ProcessFigures::settled(report.figures.baseline.tokio_tasks, SETTLE_BOUND).await;
    Ok(report)
}

#[cfg(test)]
mod report_tests {
    use super::RunReport;

    #[test]
    fn a_run_is_complete_only_when_every_request_arrived_warm_up_included() {
        let all = RunReport { requests: 10, received: 10, ..RunReport::default() };
        assert!(all.complete());
        assert!(!RunReport { received: 0, ..all.clone() }.complete(), "nothing moved is no success");
        assert!(!RunReport { warmup_failed: 1, ..all.clone() }.complete(), "a failed warm-up is no success");
        assert!(!RunReport { failed: 1, received: 9, ..all.clone() }.complete());
        assert!(!RunReport { corrupt: 1, received: 9, ..all }.complete());
    }
}
