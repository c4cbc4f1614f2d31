//! Instances of several workers (tensor- and pipeline-parallel ranks) in
//! this process: one simulated engine per rank, each with its own
//! scheduler, block pool and cache share, all fed the same steps, as the
//! ranks of one engine see the same scheduler output.
//!
//! A prefill instance's requests are prefilled on every rank (each writes
//! the head rows it holds); the proxy hands out the params of rank 0 (the
//! instance's base side-channel port). A decode instance's pull is started
//! on every rank and ends when every rank reported it: received when all
//! did (each checked the rows it holds), corrupt or failed when one was.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use kv_proto::{BlockId, KvTransferParams, ReqId};
use kv_worker::{CacheShape, Placement, WorkerConfig};

use crate::blocks::BlockPattern;
use crate::engine::{
    rank_config, rank_shape, Completion, DecodeInstance, EngineError, PrefillInstance, PromptSpec, PullSpec,
};
use crate::metrics::agreement::{self, Tally};
use crate::metrics::MetricsHub;

/// How an instance is split over workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// Tensor-parallel size.
    pub tp: u16,
    /// Pipeline-parallel size.
    pub pp: u16,
}

impl Split {
    /// One worker.
    pub const ONE: Split = Split { tp: 1, pp: 1 };

    /// Every worker's place, stage by stage.
    pub fn places(&self) -> impl Iterator<Item = Placement> + '_ {
        (0..self.pp).flat_map(move |pp_rank| {
            (0..self.tp).map(move |tp_rank| Placement {
                dp_rank: 0,
                tp_size: self.tp,
                tp_rank,
                pp_size: self.pp,
                pp_rank,
            })
        })
    }

    /// Workers in all.
    pub fn workers(&self) -> usize {
        usize::from(self.tp) * usize::from(self.pp)
    }
}

/// Starts every worker of an instance with side-channel ports from a base
/// the OS leaves free: worker 0 binds a free port, the others follow it
/// (tried again from another base if one of them is taken).
async fn start_ranks<T, F, Fut>(split: Split, mut start: F) -> Result<Vec<T>, EngineError>
where
    F: FnMut(Placement, u16) -> Fut,
    Fut: std::future::Future<Output = Result<(T, Option<u16>), EngineError>>,
{
    let mut last = None;
    for _ in 0..16 {
        let mut ranks = Vec::with_capacity(split.workers());
        let mut base = 0u16;
        let mut taken = false;
        for place in split.places() {
            let first = ranks.is_empty();
            match start(place, base).await {
                Ok((rank, bound)) => {
                    if first {
                        base = bound.unwrap_or(0);
                    }
                    ranks.push(rank);
                }
                Err(EngineError::Worker(kv_worker::WorkerError::Bind { addr, cause })) if !first => {
                    tracing::debug!(%addr, %cause, "side-channel port taken; trying another base");
                    last = Some(EngineError::Worker(kv_worker::WorkerError::Bind { addr, cause }));
                    taken = true;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if !taken {
            return Ok(ranks);
        }
    }
    Err(last.unwrap_or_else(|| EngineError::Topology("no free run of side-channel ports".to_owned())))
}

/// A prefill instance of one worker per rank.
pub struct LocalPrefill {
    ranks: Vec<PrefillInstance>,
}

impl LocalPrefill {
    /// Starts one worker per rank of `split` with a cache share of `model`;
    /// `config` is every worker's, with its ranks set.
    pub async fn start(
        config: &WorkerConfig,
        model: CacheShape,
        split: Split,
        pattern: BlockPattern,
        advertise: Option<IpAddr>,
    ) -> Result<Self, EngineError> {
        let ranks = start_ranks(split, |place, base| {
            let mut config = rank_config(config.clone(), &model, place);
            config.side_channel_base_port = base;
            async move {
                let shape = rank_shape(model, place)?;
                let p = PrefillInstance::start_advertising(config, shape, pattern, 1, advertise).await?;
                let port = p.side_channel().map(|a| a.port());
                Ok((p, port))
            }
        })
        .await?;
        Ok(Self { ranks })
    }

    /// Whether prefill writes KV patterns.
    pub fn set_write_patterns(&mut self, on: bool) {
        self.ranks.iter_mut().for_each(|p| p.set_write_patterns(on));
    }

    /// Shows every worker on `hub`.
    pub fn expose(&mut self, hub: &MetricsHub) {
        self.ranks.iter_mut().for_each(|p| p.expose(hub));
    }

    /// Bytes of every worker's cache.
    pub fn cache_bytes(&self) -> u64 {
        self.ranks.iter().map(|p| p.worker().cache().regions().iter().map(|r| r.len).sum::<u64>()).sum()
    }

    /// One step prefilling `prompts` on every rank: rank 0's params and
    /// blocks for each (its side channel is the instance's base port).
    pub fn prefill(
        &mut self,
        prompts: &[PromptSpec],
    ) -> Result<Vec<(PromptSpec, KvTransferParams, Vec<BlockId>)>, EngineError> {
        let mut first = None;
        for p in &mut self.ranks {
            let done = p.prefill(prompts)?;
            if first.is_none() {
                first = Some(
                    done.into_iter()
                        .map(|(spec, params)| {
                            let blocks = p.blocks_of(&spec.id).map(<[_]>::to_vec).unwrap_or_default();
                            (spec, params, blocks)
                        })
                        .collect(),
                );
            }
        }
        Ok(first.unwrap_or_default())
    }

    /// Frees what finished sending on each rank.
    pub fn reap(&mut self) {
        self.ranks.iter_mut().for_each(|p| {
            p.reap();
        });
    }

    /// Requests held, over every rank.
    pub fn held(&self) -> usize {
        self.ranks.iter().map(PrefillInstance::held).sum()
    }

    /// Waits (each rank bounded by `timeout`) until every rank freed what it
    /// holds; returns what is still held.
    pub async fn drain(&mut self, timeout: Duration) -> usize {
        for p in &mut self.ranks {
            while p.held() > 0 && !p.reap_wait(timeout).await.is_empty() {}
        }
        self.held()
    }

    /// Requests the workers failed to send, by cause, over every rank.
    pub fn send_failures(&self) -> std::collections::BTreeMap<String, u64> {
        let mut out = std::collections::BTreeMap::new();
        for p in &self.ranks {
            for (cause, n) in agreement::nonzero(&p.worker().metrics().sends_failed) {
                *out.entry(cause).or_default() += n;
            }
        }
        out
    }

    /// Write ops of every batch every rank wrote so far.
    pub fn ops_written(&self) -> f64 {
        self.ranks.iter().map(|p| p.worker().metrics().ops_per_batch.sum).sum()
    }

    /// Stops every worker.
    pub async fn shutdown(self) {
        for p in self.ranks {
            p.shutdown().await;
        }
    }
}

/// A decode instance of one worker per rank.
pub struct LocalDecode {
    ranks: Vec<DecodeInstance>,
    /// Bytes of one block of every region of each rank.
    block_bytes: Vec<u64>,
    /// Requests some ranks reported: how many, and the worst so far.
    partial: HashMap<ReqId, (usize, Completion)>,
    /// Requests started and not yet reported by every rank (ranks report
    /// in their own order: none of them alone counts what is in flight).
    in_flight: std::collections::HashSet<ReqId>,
    /// What each rank reported (for its counters).
    tallies: Vec<Tally>,
}

impl LocalDecode {
    /// Starts one worker per rank of `split` with a cache share of `model`.
    pub async fn start(
        config: &WorkerConfig,
        model: CacheShape,
        split: Split,
        pattern: BlockPattern,
    ) -> Result<Self, EngineError> {
        let ranks = start_ranks(split, |place, _| {
            let config = rank_config(config.clone(), &model, place);
            async move {
                let shape = rank_shape(model, place)?;
                Ok((DecodeInstance::start(config, shape, pattern, 2).await?, None))
            }
        })
        .await?;
        let block_bytes =
            ranks.iter().map(|d| d.worker().cache().block_len() * d.worker().cache().regions().len() as u64).collect();
        let tallies = vec![Tally::default(); ranks.len()];
        Ok(Self { ranks, block_bytes, partial: HashMap::new(), in_flight: Default::default(), tallies })
    }

    /// Whether each rank checks every byte it receives.
    pub fn set_verify(&mut self, on: bool) {
        self.ranks.iter_mut().for_each(|d| d.set_verify(on));
    }

    /// Shows every worker on `hub`.
    pub fn expose(&mut self, hub: &MetricsHub) {
        self.ranks.iter_mut().for_each(|d| d.expose(hub));
    }

    /// Bytes of every worker's cache.
    pub fn cache_bytes(&self) -> u64 {
        self.ranks.iter().map(|d| d.worker().cache().regions().iter().map(|r| r.len).sum::<u64>()).sum()
    }

    /// Bytes one decode block holds over every rank.
    pub fn bytes_per_block(&self) -> u64 {
        self.block_bytes.iter().sum()
    }

    /// One step starting `pulls` on every rank: rank 0's blocks per pull.
    pub fn schedule(&mut self, pulls: &[PullSpec]) -> Result<Vec<Vec<BlockId>>, EngineError> {
        let mut first = None;
        self.in_flight.extend(pulls.iter().map(|p| p.id.clone()));
        for d in &mut self.ranks {
            d.schedule(pulls)?;
            if first.is_none() {
                first = Some(pulls.iter().map(|p| d.blocks_of(&p.id).map(<[_]>::to_vec).unwrap_or_default()).collect());
            }
        }
        Ok(first.unwrap_or_default())
    }

    /// Pulls not yet reported by every rank.
    pub fn pulling(&self) -> usize {
        self.in_flight.len()
    }

    /// Waits up to `timeout` for pulls every rank has reported; each
    /// request once, with its worst outcome.
    pub async fn complete(&mut self, timeout: Duration) -> Vec<Completion> {
        let deadline = Instant::now() + timeout;
        let workers = self.ranks.len();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // Only ranks with pulls out are asked (the others would wait out
            // the whole bound).
            let asked: Vec<usize> = (0..workers).filter(|&rank| self.ranks[rank].pulling() > 0).collect();
            if asked.is_empty() {
                return Vec::new();
            }
            let waits = self.ranks.iter_mut().filter(|d| d.pulling() > 0).map(|d| d.complete(left));
            let reported = futures_util::future::join_all(waits).await;
            let mut out = Vec::new();
            for (rank, completions) in asked.into_iter().zip(reported) {
                for c in completions {
                    self.count(rank, &c);
                    if let Some(done) = self.merge(c, workers) {
                        out.push(done);
                    }
                }
            }
            if !out.is_empty() || deadline <= Instant::now() {
                return out;
            }
        }
    }

    /// Counts one rank's report for its worker's counters.
    fn count(&mut self, rank: usize, c: &Completion) {
        let tally = &mut self.tallies[rank];
        match c {
            Completion::Received { blocks, .. } => {
                tally.received += 1;
                tally.bytes += *blocks as u64 * self.block_bytes[rank];
            }
            Completion::Corrupt { .. } => tally.corrupt += 1,
            Completion::Failed { .. } => tally.failed += 1,
        }
    }

    /// One rank's report of a request; the request's, once every rank's is in.
    fn merge(&mut self, c: Completion, workers: usize) -> Option<Completion> {
        let id = match &c {
            Completion::Received { id, .. } | Completion::Corrupt { id, .. } | Completion::Failed { id, .. } => {
                id.clone()
            }
        };
        let (seen, worst) = match self.partial.remove(&id) {
            None => (1, c),
            Some((seen, worst)) => (seen + 1, worse(worst, c)),
        };
        if seen < workers {
            self.partial.insert(id, (seen, worst));
            return None;
        }
        self.in_flight.remove(&id);
        Some(worst)
    }

    /// Failures by cause over every rank, and where a rank's counters
    /// disagree with what the bench saw of it.
    pub fn failures(&self) -> (std::collections::BTreeMap<String, u64>, Vec<String>) {
        let mut by_cause = std::collections::BTreeMap::new();
        let mut mismatches = Vec::new();
        for (rank, (d, tally)) in self.ranks.iter().zip(&self.tallies).enumerate() {
            let counted = d.worker().metrics();
            for (cause, n) in agreement::nonzero(&counted.pulls_failed) {
                *by_cause.entry(cause).or_default() += n;
            }
            let prefix = if self.ranks.len() > 1 { format!("decode worker {rank}: ") } else { String::new() };
            mismatches.extend(agreement::disagreements(tally, &counted).into_iter().map(|m| format!("{prefix}{m}")));
        }
        (by_cause, mismatches)
    }

    /// Stops every worker.
    pub async fn shutdown(self) {
        for d in self.ranks {
            d.shutdown().await;
        }
    }
}

/// The worse of two reports of one request: corrupt over failed over
/// received; of two receipts, the later.
fn worse(a: Completion, b: Completion) -> Completion {
    let rank = |c: &Completion| match c {
        Completion::Received { .. } => 0,
        Completion::Failed { .. } => 1,
        Completion::Corrupt { .. } => 2,
    };
    match (&a, &b) {
        (Completion::Received { latency: la, .. }, Completion::Received { latency: lb, .. }) => {
            if lb >= la {
                b
            } else {
                a
            }
        }
        _ if rank(&b) > rank(&a) => b,
        _ => a,
    }
}
