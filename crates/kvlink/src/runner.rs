//! The transfer loop shared by `kvlink demo`, `kvlink bench` and `kvlink
//! bench --connect`: requests pipelined through the full flow with a bounded
//! number in flight, between a prefill and a decode side that are both in
//! this process, or one here and one on a `kvlink serve` host.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use kv_proto::{BlockId, KvRole, KvTransferParams, Protocol, ReqId};
use kv_worker::{plan::contiguous_runs, AuthSecret, CacheShape, ShapeError, WorkerConfig};
use serde::Serialize;

use crate::blocks::BlockPattern;
use crate::control::{ControlClient, ControlError, RemoteDecode, RemotePrefill};
use crate::engine::{Completion, DecodeInstance, EngineError, PrefillInstance, PromptSpec, PullSpec};
use crate::stats::{peak_rss_bytes, process_cpu_time, Latencies};

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
    /// `HOST[:PORT]` of a `kvlink serve`: run the other side there.
    pub connect: Option<String>,
    /// Shared secret of the side channel and TCP data plane of both sides.
    pub auth_secret: Option<AuthSecret>,
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
}

impl RunReport {
    /// Whether the run did everything it was asked: every measured request
    /// received (and verified, if on), nothing failed, warm-up included.
    pub fn complete(&self) -> bool {
        self.failed == 0 && self.corrupt == 0 && self.warmup_failed == 0 && self.received == self.requests
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
    /// Write ops per request's batch (mean).
    pub ops_per_batch: f64,
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
    /// The server's peak resident set, bytes (remote runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_peak_rss_bytes: Option<u64>,
}

/// The prefill side of a run.
enum PrefillSide {
    Local(PrefillInstance),
    Remote(RemotePrefill),
}

impl PrefillSide {
    /// One step prefilling `prompts`: each with its params and P's blocks.
    async fn prefill(
        &mut self,
        prompts: &[PromptSpec],
    ) -> Result<Vec<(PromptSpec, KvTransferParams, Vec<BlockId>)>, RunError> {
        match self {
            PrefillSide::Local(p) => {
                let done = p.prefill(prompts)?;
                Ok(done
                    .into_iter()
                    .map(|(spec, params)| {
                        let blocks = p.blocks_of(&spec.id).map(<[_]>::to_vec).unwrap_or_default();
                        (spec, params, blocks)
                    })
                    .collect())
            }
            PrefillSide::Remote(r) => Ok(r.prefill(prompts).await?),
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
            PrefillSide::Local(p) => {
                while p.held() > 0 && !p.reap_wait(timeout).await.is_empty() {}
                Ok(p.held())
            }
            PrefillSide::Remote(r) => Ok(r.drain(timeout).await?),
        }
    }

    fn remote(&mut self) -> Option<&mut ControlClient> {
        match self {
            PrefillSide::Local(_) => None,
            PrefillSide::Remote(r) => Some(r.client()),
        }
    }

    async fn shutdown(self) -> Result<(), RunError> {
        match self {
            PrefillSide::Local(p) => p.shutdown().await,
            PrefillSide::Remote(r) => r.into_client().bye().await?,
        }
        Ok(())
    }
}

/// The decode side of a run.
enum DecodeSide {
    Local(DecodeInstance),
    Remote(RemoteDecode),
}

impl DecodeSide {
    /// One step starting `pulls`: D's blocks per pull.
    async fn schedule(&mut self, pulls: &[PullSpec]) -> Result<Vec<Vec<BlockId>>, RunError> {
        match self {
            DecodeSide::Local(d) => {
                d.schedule(pulls)?;
                Ok(pulls.iter().map(|p| d.blocks_of(&p.id).map(<[_]>::to_vec).unwrap_or_default()).collect())
            }
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
            DecodeSide::Remote(r) => r.into_client().bye().await?,
        }
        Ok(())
    }
}

/// The two sides of a run, at most one of them remote.
struct Sides {
    prefill: PrefillSide,
    decode: DecodeSide,
}

impl Sides {
    /// Waits up to `timeout` for pulls to finish. While decode waits here
    /// for a remote prefill, the control connection is silent: it is kept
    /// alive with pings, or the server would end the session as idle.
    async fn complete(&mut self, timeout: Duration) -> Result<Vec<Completion>, RunError> {
        let (DecodeSide::Local(d), PrefillSide::Remote(r)) = (&mut self.decode, &mut self.prefill) else {
            return self.decode.complete(timeout).await;
        };
        let every = r.client().keepalive_interval();
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let done = d.complete(left.min(every)).await;
            if !done.is_empty() || left <= every {
                return Ok(done);
            }
            r.client().ping().await?;
        }
    }

    /// The server's CPU time and peak RSS, on a remote run.
    async fn peer_stats(&mut self) -> Result<Option<(Duration, u64)>, RunError> {
        let client = match self.prefill.remote() {
            Some(c) => Some(c),
            None => self.decode.remote(),
        };
        match client {
            Some(c) => Ok(Some(c.stats().await?)),
            None => Ok(None),
        }
    }
}

fn worker_config(role: KvRole, engine_id: &str, opts: &RunOptions, bind: Option<IpAddr>) -> WorkerConfig {
    let mut config = WorkerConfig::loopback(role, engine_id);
    config.protocol = opts.protocol;
    config.auth_secret = opts.auth_secret.clone();
    if let Some(ip) = bind {
        config.side_channel_bind = ip;
        config.data_listen = SocketAddr::new(ip, 0);
    }
    config
}

/// Starts both sides: here, or one here and one on the `kvlink serve` at
/// `opts.connect` (whose role decides which runs here).
async fn start_sides(opts: &RunOptions, shape: CacheShape, report: &mut RunReport) -> Result<Sides, RunError> {
    let Some(target) = &opts.connect else {
        let p_config = worker_config(KvRole::Producer, "kvlink-prefill", opts, None);
        let d_config = worker_config(KvRole::Consumer, "kvlink-decode", opts, None);
        let mut prefill = PrefillInstance::start(p_config, shape, opts.pattern, 1).await?;
        let mut decode = DecodeInstance::start(d_config, shape, opts.pattern, 2).await?;
        prefill.set_write_patterns(opts.verify);
        decode.set_verify(opts.verify);
        report.side = "both".to_owned();
        report.cache_bytes = 2 * shape.total_bytes();
        return Ok(Sides { prefill: PrefillSide::Local(prefill), decode: DecodeSide::Local(decode) });
    };
    let call_timeout = opts.stall_timeout + Duration::from_secs(10);
    let mut client = ControlClient::connect(target, CONNECT_TIMEOUT, call_timeout).await?;
    let server_role = client.hello(shape, opts.pattern, opts.protocol, opts.verify, opts.auth_secret.as_ref()).await?;
    // Listen where the server reached us: the address it can reach back.
    let here = Some(client.local_addr().ip());
    report.peer = Some(client.peer_addr().to_string());
    report.cache_bytes = shape.total_bytes();
    if server_role == KvRole::Consumer {
        let config = worker_config(KvRole::Producer, "kvlink-bench-prefill", opts, here);
        let mut prefill = PrefillInstance::start(config, shape, opts.pattern, 1).await?;
        prefill.set_write_patterns(opts.verify);
        report.side = "prefill".to_owned();
        Ok(Sides { prefill: PrefillSide::Local(prefill), decode: DecodeSide::Remote(RemoteDecode::new(client)) })
    } else {
        let config = worker_config(KvRole::Consumer, "kvlink-bench-decode", opts, here);
        let mut decode = DecodeInstance::start(config, shape, opts.pattern, 2).await?;
        decode.set_verify(opts.verify);
        report.side = "decode".to_owned();
        Ok(Sides { prefill: PrefillSide::Remote(RemotePrefill::new(client)), decode: DecodeSide::Local(decode) })
    }
}

/// Runs the loop; `progress` ticks once per measured request.
pub async fn run(opts: &RunOptions, progress: &ProgressBar) -> Result<RunReport, RunError> {
    let window = opts.in_flight.max(1);
    // Scattered and random ids need free blocks between the allocated ones:
    // twice the blocks in flight, so a scattered request really is one op per
    // block rather than falling back to adjacent blocks.
    let slack = if opts.pattern == BlockPattern::Contiguous { 1 } else { 2 };
    let shape = opts.shape.with_num_blocks((opts.blocks_per_request * window * slack) as u64 + 1)?;
    let mut report = RunReport {
        protocol: opts.protocol.to_string(),
        requests: opts.requests,
        verified: opts.verify,
        ..RunReport::default()
    };
    let mut sides = start_sides(opts, shape, &mut report).await?;

    let block_size = shape.block_size() as usize;
    let bytes_per_block = shape.block_len() * u64::from(shape.region_count());
    let total = opts.warmup + opts.requests;
    let mut latencies = Latencies::default();
    let mut ops_total = 0u64;
    let (mut next, mut finished) = (0usize, 0usize);
    let mut measure_start: Option<(Instant, Duration)> = None;
    let mut peer_start = None;
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
                measure_start = Some((Instant::now(), process_cpu_time()));
            }
            let spec = PromptSpec {
                id: ReqId::new(format!("req-{run_tag}-{next}")),
                prompt_len: opts.blocks_per_request * block_size,
                seed: next as u64,
            };
            let prefix_hit = opts.prefix_hit_every > 0 && next % opts.prefix_hit_every == opts.prefix_hit_every - 1;
            let prefix_hit_tokens = if prefix_hit { (opts.blocks_per_request / 4) * block_size } else { 0 };
            for (spec, params, local) in sides.prefill.prefill(std::slice::from_ref(&spec)).await? {
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
        let completions = sides.complete(opts.stall_timeout).await?;
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
    let peer_end = sides.peer_stats().await?;
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
    report.ops_per_batch = ops_total as f64 / opts.requests.max(1) as f64;
    report.cpu_seconds_per_gb = cpu.as_secs_f64() / gb.max(1e-9);
    report.peak_rss_bytes = peak_rss_bytes();
    if let (Some((start, _)), Some((end, rss))) = (peer_start.or(peer_end), peer_end) {
        report.peer_cpu_seconds_per_gb = Some(end.saturating_sub(start).as_secs_f64() / gb.max(1e-9));
        report.peer_peak_rss_bytes = Some(rss);
    }
    let Sides { prefill, decode } = sides;
    prefill.shutdown().await?;
    decode.shutdown().await?;
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
