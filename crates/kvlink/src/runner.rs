//! The transfer loop shared by `kvlink demo` and `kvlink bench`: a prefill
//! and a decode instance in this process, requests pipelined through the
//! full flow with a bounded number in flight.

use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use kv_proto::{KvRole, Protocol, ReqId};
use kv_worker::{plan::contiguous_runs, CacheShape, WorkerConfig};
use serde::Serialize;

use crate::blocks::BlockPattern;
use crate::engine::{Completion, DecodeInstance, EngineError, PrefillInstance, PromptSpec, PullSpec};
use crate::stats::{peak_rss_bytes, process_cpu_time, Latencies};

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
    /// Process CPU seconds (user + system) per GB moved.
    pub cpu_seconds_per_gb: f64,
    /// Peak resident set of the process, bytes.
    pub peak_rss_bytes: u64,
    /// Both caches, bytes (registered memory, part of the RSS when touched).
    pub cache_bytes: u64,
}

/// Runs the loop; `progress` ticks once per measured request.
pub async fn run(opts: &RunOptions, progress: &ProgressBar) -> Result<RunReport, EngineError> {
    let mut shape = opts.shape;
    let window = opts.in_flight.max(1);
    shape.num_blocks = (opts.blocks_per_request * window) as u64 + 1;
    let mut p_config = WorkerConfig::loopback(KvRole::Producer, "kvlink-prefill");
    p_config.protocol = opts.protocol;
    let mut d_config = WorkerConfig::loopback(KvRole::Consumer, "kvlink-decode");
    d_config.protocol = opts.protocol;
    let mut prefill = PrefillInstance::start(p_config, shape, opts.pattern, 1).await?;
    let mut decode = DecodeInstance::start(d_config, shape, opts.pattern, 2).await?;
    prefill.set_write_patterns(opts.verify);
    decode.set_verify(opts.verify);

    let block_size = shape.block_size as usize;
    let bytes_per_block = shape.block_len() * u64::from(shape.region_count());
    let total = opts.warmup + opts.requests;
    let mut report = RunReport {
        protocol: opts.protocol.to_string(),
        requests: opts.requests,
        verified: opts.verify,
        cache_bytes: 2 * shape.total_bytes(),
        ..RunReport::default()
    };
    let mut latencies = Latencies::default();
    let mut ops_total = 0u64;
    let (mut next, mut finished) = (0usize, 0usize);
    let mut measure_start: Option<(Instant, std::time::Duration)> = None;
    while finished < total {
        while next < total && decode.pulling() < window {
            if next == opts.warmup {
                if finished < opts.warmup {
                    break; // drain the warm-up before measuring
                }
                measure_start = Some((Instant::now(), process_cpu_time()));
            }
            let spec = PromptSpec {
                id: ReqId::new(format!("req-{next}")),
                prompt_len: opts.blocks_per_request * block_size,
                seed: next as u64,
            };
            let prefix_hit = opts.prefix_hit_every > 0 && next % opts.prefix_hit_every == opts.prefix_hit_every - 1;
            let prefix_hit_tokens = if prefix_hit { (opts.blocks_per_request / 4) * block_size } else { 0 };
            for (spec, params) in prefill.prefill(&[spec])? {
                let pull = PullSpec {
                    id: spec.id.clone(),
                    prompt_len: spec.prompt_len,
                    seed: spec.seed,
                    params,
                    prefix_hit_tokens,
                };
                decode.schedule(std::slice::from_ref(&pull))?;
                if next >= opts.warmup {
                    if let (Some(local), Some(remote)) = (prefill.blocks_of(&spec.id), decode.blocks_of(&spec.id)) {
                        let local = &local[local.len() - remote.len()..];
                        ops_total += contiguous_runs(local, remote).len() as u64 * u64::from(shape.region_count());
                    }
                }
            }
            next += 1;
        }
        let completions = decode.complete(opts.stall_timeout).await;
        if completions.is_empty() {
            return Err(EngineError::Stalled { waited: opts.stall_timeout, in_flight: decode.pulling() });
        }
        for c in completions {
            // The warm-up drains before the first measured request starts, so
            // the first `warmup` completions are exactly the warm-up's.
            let is_warmup = finished < opts.warmup;
            finished += 1;
            if is_warmup {
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
        prefill.reap();
    }
    let (start, cpu_start) = measure_start.unwrap_or((Instant::now(), process_cpu_time()));
    let elapsed = start.elapsed();
    let cpu = process_cpu_time().saturating_sub(cpu_start);
    // Let P's last frees arrive, so nothing is left held.
    while prefill.held() > 0 && !prefill.reap_wait(opts.stall_timeout).await.is_empty() {}
    report.seconds = elapsed.as_secs_f64();
    report.gbytes_per_sec = report.bytes as f64 / 1e9 / report.seconds.max(1e-9);
    report.requests_per_sec = report.received as f64 / report.seconds.max(1e-9);
    report.latency_ms_p50 = latencies.quantile(0.50).as_secs_f64() * 1e3;
    report.latency_ms_p90 = latencies.quantile(0.90).as_secs_f64() * 1e3;
    report.latency_ms_p99 = latencies.quantile(0.99).as_secs_f64() * 1e3;
    report.ops_per_batch = ops_total as f64 / opts.requests.max(1) as f64;
    report.cpu_seconds_per_gb = cpu.as_secs_f64() / (report.bytes as f64 / 1e9).max(1e-9);
    report.peak_rss_bytes = peak_rss_bytes();
    prefill.shutdown().await;
    decode.shutdown().await;
    Ok(report)
}
