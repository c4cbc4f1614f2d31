//! The test as the proxy of a disaggregated deployment: it drives a `kvlink
//! serve --role producer` (P) and a `kvlink serve --role consumer` (D) over
//! their control ports and hands P's transfer params to D, as vLLM's proxy
//! does. Either side can be replaced by a new session (a restarted process)
//! while the other keeps its own.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kv_proto::{KvTransferParams, LayoutKind, Protocol, ReqId};
use kv_worker::{AuthSecret, CacheDims, CacheShape};
use kvlink::control::{check_shape, ControlClient, RemoteDecode, RemotePrefill};
use kvlink::{BlockPattern, Completion, PromptSpec, PullSpec};

/// Blocks of each request.
pub const BLOCKS_PER_REQUEST: usize = 16;
/// Requests of one step (one transfer request, one batch).
pub const BATCH: usize = 8;

/// 4 layers, K/V split, 8 heads x 128 dims, bf16, 16-token blocks: 256 KiB
/// per block over the 8 regions, 4 MiB per request, 32 MiB per batch (more
/// than loopback's socket buffers hold, so a batch is still moving when a
/// fault strikes); room for two batches.
pub fn shape() -> CacheShape {
    let dims = CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers: 4,
        num_blocks: (2 * BATCH * BLOCKS_PER_REQUEST) as u64 + 1,
        block_size: 16,
        num_kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
    };
    check_shape(dims, u64::MAX).unwrap()
}

/// A runtime for the control sessions; the test thread blocks on it step by
/// step and does its process work (signals, log waits) in between.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// A control session with the `kvlink serve` at `control`, opened with
/// [`shape`], contiguous block ids (a later request reuses a failed one's
/// blocks: a late write into them would show) and verification on.
pub async fn session(control: SocketAddr) -> ControlClient {
    session_with(control, None).await
}

/// Like [`session`], proving `secret` to a server that has one.
pub async fn session_with(control: SocketAddr, secret: Option<&AuthSecret>) -> ControlClient {
    let bound = super::BOUND;
    let mut client = ControlClient::connect(&control.to_string(), bound, bound).await.unwrap();
    client.hello(shape(), BlockPattern::Contiguous, Protocol::Tcp, true, secret).await.unwrap();
    client
}

/// How one request ended on D.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// Every byte arrived and matched what P computed.
    Received,
    /// D reported the pull failed.
    Failed,
    /// D reported it received, but a byte is wrong (a late or stray write).
    Corrupt,
}

/// P and D sessions and the requests moved between them.
pub struct Proxy {
    pub p: RemotePrefill,
    pub d: RemoteDecode,
    tag: String,
    next: u64,
}

impl Proxy {
    pub async fn start(p: SocketAddr, d: SocketAddr, tag: &str) -> Self {
        Self::start_with(p, None, d, None, tag).await
    }

    /// Like [`Proxy::start`], proving `p_secret` to P and `d_secret` to D.
    pub async fn start_with(
        p: SocketAddr,
        p_secret: Option<&AuthSecret>,
        d: SocketAddr,
        d_secret: Option<&AuthSecret>,
        tag: &str,
    ) -> Self {
        Self {
            p: RemotePrefill::new(session_with(p, p_secret).await),
            d: RemoteDecode::new(session_with(d, d_secret).await),
            tag: format!("{tag}-{}", std::process::id()),
            next: 0,
        }
    }

    /// A new P session (a restarted P); D keeps its own.
    pub async fn reconnect_p(&mut self, p: SocketAddr) {
        self.p = RemotePrefill::new(session(p).await);
    }

    /// A new D session (another D); P keeps its own.
    pub async fn reconnect_d(&mut self, d: SocketAddr) {
        self.d = RemoteDecode::new(session(d).await);
    }

    /// Prefills [`BATCH`] requests on P in one step, then starts their pulls
    /// on D in one step (one transfer request); returns their ids.
    pub async fn send(&mut self) -> Vec<ReqId> {
        let prompts = self.prompts();
        let pulls = self.prefilled(&prompts).await;
        self.d.schedule(&pulls).await.unwrap();
        prompts.into_iter().map(|p| p.id).collect()
    }

    /// The next [`BATCH`] prompts.
    fn prompts(&mut self) -> Vec<PromptSpec> {
        let block_size = shape().block_size() as usize;
        (0..BATCH)
            .map(|_| {
                self.next += 1;
                PromptSpec {
                    id: ReqId::new(format!("{}-{}", self.tag, self.next)),
                    prompt_len: BLOCKS_PER_REQUEST * block_size,
                    seed: self.next,
                }
            })
            .collect()
    }

    /// Prefills `prompts` on P in one step; the pulls that point D at them.
    async fn prefilled(&mut self, prompts: &[PromptSpec]) -> Vec<PullSpec> {
        self.p
            .prefill(prompts)
            .await
            .unwrap()
            .into_iter()
            .map(|(spec, params, _)| PullSpec {
                id: spec.id,
                prompt_len: spec.prompt_len,
                seed: spec.seed,
                params,
                prefix_hit_tokens: 0,
            })
            .collect()
    }

    /// Prefills [`BATCH`] requests on P in one step, then has D see them
    /// without pulling yet (no room: they wait in its queue); returns the
    /// pulls to come.
    pub async fn send_to_watch(&mut self) -> Vec<PullSpec> {
        let prompts = self.prompts();
        let pulls = self.prefilled(&prompts).await;
        self.d.watch(&pulls).await.unwrap();
        pulls
    }

    /// Starts [`BATCH`] pulls on D in one step from a side channel at
    /// `host:port` that is not P's (a silent or unreachable peer); returns
    /// their ids.
    pub async fn pull_from(&mut self, host: &str, port: u16) -> Vec<ReqId> {
        let block_size = shape().block_size() as usize;
        let params = KvTransferParams {
            do_remote_prefill: true,
            remote_host: Some(host.to_owned()),
            remote_port: Some(port),
            ..KvTransferParams::default()
        };
        let pulls: Vec<PullSpec> = (0..BATCH)
            .map(|_| {
                self.next += 1;
                PullSpec {
                    id: ReqId::new(format!("{}-{}", self.tag, self.next)),
                    prompt_len: BLOCKS_PER_REQUEST * block_size,
                    seed: self.next,
                    params: params.clone(),
                    prefix_hit_tokens: 0,
                }
            })
            .collect();
        self.d.schedule(&pulls).await.unwrap();
        pulls.into_iter().map(|p| p.id).collect()
    }

    /// How each of `ids` ended on D, waiting up to `within` for all of
    /// them; panics naming those still without an outcome.
    pub async fn outcomes(&mut self, ids: &[ReqId], within: Duration) -> HashMap<ReqId, Ended> {
        let deadline = Instant::now() + within;
        let mut ended = HashMap::new();
        while ids.iter().any(|id| !ended.contains_key(id)) {
            let left = deadline.saturating_duration_since(Instant::now());
            let missing: Vec<&ReqId> = ids.iter().filter(|id| !ended.contains_key(*id)).collect();
            assert!(!left.is_zero(), "no outcome within {within:?} for {missing:?}");
            for c in self.d.complete(left).await.unwrap() {
                let (id, how) = match c {
                    Completion::Received { id, verified, .. } => {
                        assert!(verified, "{id} was not verified");
                        (id, Ended::Received)
                    }
                    Completion::Failed { id, .. } => (id, Ended::Failed),
                    Completion::Corrupt { id, at } => {
                        eprintln!("{id}: wrong bytes at (region, block) {at:?}");
                        (id, Ended::Corrupt)
                    }
                };
                assert!(ended.insert(id.clone(), how).is_none(), "{id} reported twice");
            }
        }
        ended
    }

    /// One batch moved with nothing in the way: every request received and
    /// verified within `within`.
    pub async fn round(&mut self, within: Duration) {
        let ids = self.send().await;
        let ended = self.outcomes(&ids, within).await;
        assert!(ended.values().all(|e| *e == Ended::Received), "{ended:?}");
    }

    /// Waits (bounded) until P holds no request; panics with how many it
    /// still holds.
    pub async fn assert_p_drained(&mut self, within: Duration) {
        let held = self.p.drain(within).await.unwrap();
        assert_eq!(held, 0, "P still holds {held} requests after {within:?}");
    }
}

/// Counts of each outcome.
pub fn tally(ended: &HashMap<ReqId, Ended>) -> (usize, usize, usize) {
    let count = |e: Ended| ended.values().filter(|x| **x == e).count();
    (count(Ended::Received), count(Ended::Failed), count(Ended::Corrupt))
}
