//! The decode side's bookkeeping (sans-IO): pulls in flight grouped by
//! prefill side channel, their deadlines, and each request's outcome.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::{Duration, Instant};

use kv_proto::{BlockId, Outcome, RecvReqMeta, ReqId, RequestBlocks, XferReply};

/// A prefill worker's side-channel address (its base port plus our tp rank).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SideChannelAddr {
    /// Host.
    pub host: String,
    /// Port.
    pub port: u16,
}

impl fmt::Display for SideChannelAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// One transfer request to send to one prefill worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullBatch {
    /// Id echoed by P's reply.
    pub xfer_id: u64,
    /// Where to send it.
    pub peer: SideChannelAddr,
    /// The requests and their local blocks.
    pub requests: Vec<RequestBlocks>,
}

#[derive(Debug)]
struct Batch {
    deadline: Instant,
    peer: SideChannelAddr,
    reqs: Vec<(ReqId, Vec<BlockId>)>,
}

/// What finished on the decode side since the last poll.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecvFinished {
    /// Requests whose KV is entirely in local memory.
    pub received: BTreeSet<ReqId>,
    /// Requests whose pull failed, with the local blocks that hold no valid KV.
    pub failed: BTreeMap<ReqId, Vec<BlockId>>,
}

/// D's pulls, driven with explicit time.
#[derive(Debug)]
pub struct ReceiverCore {
    tp_rank: u16,
    timeout: Duration,
    next_xfer_id: u64,
    batches: HashMap<u64, Batch>,
    in_flight: BTreeSet<ReqId>,
    done: RecvFinished,
}

impl ReceiverCore {
    /// Pulls are sent to `remote_port + tp_rank` and fail after `timeout`.
    pub fn new(tp_rank: u16, timeout: Duration) -> Self {
        Self {
            tp_rank,
            timeout,
            next_xfer_id: 1,
            batches: HashMap::new(),
            in_flight: BTreeSet::new(),
            done: RecvFinished::default(),
        }
    }

    /// Starts this step's pulls: one batch per prefill side channel.
    pub fn start(&mut self, reqs: &BTreeMap<ReqId, RecvReqMeta>, now: Instant) -> Vec<PullBatch> {
        let mut groups: BTreeMap<SideChannelAddr, Vec<(ReqId, Vec<BlockId>)>> = BTreeMap::new();
        for (req, meta) in reqs {
            if self.in_flight.contains(req) {
                tracing::warn!(req_id = %req, "pull requested twice while in flight; the second is ignored");
                continue;
            }
            let Some(port) = meta.remote_port.checked_add(self.tp_rank) else {
                tracing::warn!(req_id = %req, remote_port = meta.remote_port, tp_rank = self.tp_rank, "side-channel port overflows");
                self.done.failed.insert(req.clone(), meta.local_block_ids.clone());
                continue;
            };
            self.in_flight.insert(req.clone());
            let peer = SideChannelAddr { host: meta.remote_host.clone(), port };
            groups.entry(peer).or_default().push((req.clone(), meta.local_block_ids.clone()));
        }
        groups
            .into_iter()
            .map(|(peer, reqs)| {
                let xfer_id = self.next_xfer_id;
                self.next_xfer_id += 1;
                let requests =
                    reqs.iter().map(|(r, b)| RequestBlocks { req_id: r.clone(), block_ids: b.clone() }).collect();
                self.batches.insert(xfer_id, Batch { deadline: now + self.timeout, peer: peer.clone(), reqs });
                PullBatch { xfer_id, peer, requests }
            })
            .collect()
    }

    /// P answered a batch: each request is received or failed by its outcome;
    /// a request the reply leaves out has failed. Late replies are ignored.
    pub fn handle_reply(&mut self, reply: &XferReply) {
        let Some(batch) = self.batches.remove(&reply.xfer_id) else {
            tracing::debug!(xfer_id = reply.xfer_id, "reply for a transfer already resolved; ignored");
            return;
        };
        let mut outcomes: HashMap<&ReqId, &Outcome> = HashMap::with_capacity(reply.outcomes.len());
        for o in &reply.outcomes {
            outcomes.insert(&o.req_id, &o.outcome);
        }
        for (req, blocks) in batch.reqs {
            self.in_flight.remove(&req);
            match outcomes.get(&req) {
                Some(Outcome::Done) => {
                    tracing::debug!(req_id = %req, peer = %batch.peer, blocks = blocks.len(), "KV received");
                    self.done.received.insert(req);
                }
                Some(Outcome::Failed { reason }) => {
                    tracing::warn!(req_id = %req, peer = %batch.peer, %reason, "prefill failed to send KV");
                    self.done.failed.insert(req, blocks);
                }
                None => {
                    tracing::warn!(req_id = %req, peer = %batch.peer, "prefill's reply has no outcome for the request");
                    self.done.failed.insert(req, blocks);
                }
            }
        }
    }

    /// A batch could not be completed (connection failure, hello rejected).
    pub fn handle_batch_failed(&mut self, xfer_id: u64, reason: &str) {
        if let Some(batch) = self.batches.remove(&xfer_id) {
            self.fail_batch(batch, reason);
        }
    }

    /// Fails every batch whose deadline passed at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<u64> = self.batches.iter().filter(|(_, b)| b.deadline <= now).map(|(id, _)| *id).collect();
        for id in expired {
            if let Some(batch) = self.batches.remove(&id) {
                let reason = format!("no reply within {:?}", self.timeout);
                self.fail_batch(batch, &reason);
            }
        }
    }

    fn fail_batch(&mut self, batch: Batch, reason: &str) {
        for (req, blocks) in batch.reqs {
            tracing::warn!(req_id = %req, peer = %batch.peer, %reason, "KV pull failed");
            self.in_flight.remove(&req);
            self.done.failed.insert(req, blocks);
        }
    }

    /// Outcomes since the last poll, each request reported once.
    pub fn poll_finished(&mut self) -> RecvFinished {
        std::mem::take(&mut self.done)
    }

    /// The earliest batch deadline, for a driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.batches.values().map(|b| b.deadline).min()
    }

    /// Requests being pulled.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}
