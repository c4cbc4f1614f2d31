//! The decode side's bookkeeping (sans-IO): pulls in flight grouped by
//! prefill side channel, their deadlines and grants, and each request's
//! outcome, reported only once the pull's grant is fenced.
//!
//! A request has two names here: D's own id, under which the engine handed
//! it over and hears its outcome, and P's id (`remote_request_id`), the only
//! one that goes to P and that P's reply names.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::{Duration, Instant};

use kv_proto::{BlockId, EngineId, FailureCause, GrantId, Outcome, RecvReqMeta, ReqId, RequestBlocks, XferReply};

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
    /// When D gives up on it.
    pub deadline: Instant,
}

/// Where a pull stands.
#[derive(Debug)]
enum Stage {
    /// The transfer request is out (or about to be); no outcome yet.
    Pulling,
    /// Its outcome is known, but the grant may still let bytes land: not
    /// reported until [`ReceiverCore::handle_fenced`].
    Fencing(BatchOutcome),
}

#[derive(Debug)]
enum BatchOutcome {
    Replied(XferReply),
    Failed(FailureCause, String),
}

/// One request of a pull: D's id, P's id, D's blocks.
#[derive(Debug)]
struct Pulled {
    req: ReqId,
    remote: ReqId,
    blocks: Vec<BlockId>,
}

#[derive(Debug)]
struct Batch {
    started: Instant,
    deadline: Instant,
    peer: SideChannelAddr,
    reqs: Vec<Pulled>,
    grant: Option<GrantId>,
    stage: Stage,
    /// A request of it was cancelled: its grant covers freed blocks.
    lost_requests: bool,
}

/// What finished on the decode side since the last poll.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecvFinished {
    /// Requests whose KV is entirely in local memory.
    pub received: BTreeSet<ReqId>,
    /// Requests whose pull failed, with the local blocks that hold no valid KV.
    pub failed: BTreeMap<ReqId, Vec<BlockId>>,
}

/// How one request's pull ended, for the driver's metrics and log (the
/// engine hears the outcome through [`ReceiverCore::poll_finished`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullReport {
    /// D's id.
    pub req: ReqId,
    /// P's id.
    pub remote: ReqId,
    /// The prefill worker pulled from (`None`: the pull never got one).
    pub peer: Option<SideChannelAddr>,
    /// The transfer request it was part of.
    pub xfer_id: Option<u64>,
    /// The grant it was pulled under.
    pub grant: Option<GrantId>,
    /// D's blocks of it.
    pub blocks: usize,
    /// When its pull started.
    pub started: Instant,
    /// `None`: received; else why it failed.
    pub failure: Option<(FailureCause, String)>,
}

/// What ended since the driver last asked ([`ReceiverCore::take_reports`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PullReports {
    /// One per request reported received or failed.
    pub ended: Vec<PullReport>,
    /// Requests cancelled by the engine while pulling.
    pub cancelled: u64,
}

/// Reports kept for a driver that never takes them, at most; older ones
/// are dropped (they feed metrics, not the engine).
const MAX_UNTAKEN_REPORTS: usize = 1 << 16;

/// D's pulls, driven with explicit time.
///
/// A pull ends by P's reply, a failure of its connection, or its deadline;
/// whichever comes first decides its outcome and later ones are ignored. An
/// ended pull is not reported until the driver confirms its grant is fenced
/// ([`ReceiverCore::handle_fenced`], after `BatchWriter::revoke` returned),
/// so the engine never reuses a block a late writer could still reach.
#[derive(Debug)]
pub struct ReceiverCore {
    tp_rank: u16,
    timeout: Duration,
    next_xfer_id: u64,
    batches: HashMap<u64, Batch>,
    in_flight: BTreeSet<ReqId>,
    done: RecvFinished,
    reports: PullReports,
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
            reports: PullReports::default(),
        }
    }

    /// Starts this step's pulls: one batch per prefill side channel. Each
    /// must be granted ([`ReceiverCore::handle_granted`]) before its transfer
    /// request goes out.
    ///
    /// Each request is named to P by its `remote_request_id`; two requests
    /// naming the same one of the same P in one step cannot both be served
    /// (P's reply could not tell them apart): the later one fails at once.
    pub fn start(&mut self, reqs: &BTreeMap<ReqId, RecvReqMeta>, now: Instant) -> Vec<PullBatch> {
        let mut groups: BTreeMap<SideChannelAddr, Vec<(Pulled, Option<EngineId>)>> = BTreeMap::new();
        for (req, meta) in reqs {
            if self.in_flight.contains(req) || self.done.received.contains(req) || self.done.failed.contains_key(req) {
                tracing::warn!(req_id = %req, "pull requested again before its first was reported; the second is ignored");
                continue;
            }
            let remote = &meta.remote;
            let Some(port) = remote.remote_port.checked_add(self.tp_rank) else {
                let reason = format!("side-channel port {} + tp rank {} overflows", remote.remote_port, self.tp_rank);
                self.fail_at_start(req, meta, None, FailureCause::Other, reason, now);
                continue;
            };
            let peer = SideChannelAddr { host: remote.remote_host.clone(), port };
            let group = groups.entry(peer.clone()).or_default();
            if let Some((other, _)) = group.iter().find(|(p, _)| p.remote == remote.remote_request_id) {
                let reason = format!("request {} of this step names the same prefill request", other.req);
                self.fail_at_start(req, meta, Some(peer), FailureCause::DuplicateRequest, reason, now);
                continue;
            }
            self.in_flight.insert(req.clone());
            let pulled = Pulled {
                req: req.clone(),
                remote: remote.remote_request_id.clone(),
                blocks: meta.local_block_ids.clone(),
            };
            group.push((pulled, remote.remote_engine_id.clone()));
        }
        groups
            .into_iter()
            .map(|(peer, group)| {
                let xfer_id = self.next_xfer_id;
                self.next_xfer_id += 1;
                let requests = group
                    .iter()
                    .map(|(p, engine)| RequestBlocks {
                        req_id: p.remote.clone(),
                        decode_req_id: Some(p.req.clone()),
                        prefill_engine_id: engine.clone(),
                        block_ids: p.blocks.clone(),
                    })
                    .collect();
                let reqs = group.into_iter().map(|(p, _)| p).collect();
                let batch = Batch {
                    started: now,
                    deadline: now + self.timeout,
                    peer: peer.clone(),
                    reqs,
                    grant: None,
                    stage: Stage::Pulling,
                    lost_requests: false,
                };
                self.batches.insert(xfer_id, batch);
                PullBatch { xfer_id, peer, requests, deadline: now + self.timeout }
            })
            .collect()
    }

    /// The pull's grant was issued: it must be fenced before the pull is
    /// reported. Returns whether the pull may go ahead: `false` if it ended
    /// meanwhile or one of its requests was cancelled after the grant was
    /// computed (the driver then revokes the grant and lets it fail).
    pub fn handle_granted(&mut self, xfer_id: u64, grant: GrantId) -> bool {
        match self.batches.get_mut(&xfer_id) {
            Some(batch) => {
                batch.grant = Some(grant);
                matches!(batch.stage, Stage::Pulling) && !batch.lost_requests
            }
            None => false,
        }
    }

    /// The engine gave up on these requests (aborted while pulling): they
    /// are never reported. Returns the grants the driver must revoke before
    /// the engine may reuse their blocks; the other requests of those pulls
    /// end as P reports them (bytes that landed before the revocation are
    /// whole), failed otherwise. Unknown requests are ignored.
    pub fn cancel<'a>(&mut self, reqs: impl IntoIterator<Item = &'a ReqId>) -> Vec<GrantId> {
        let mut grants = Vec::new();
        for req in reqs {
            if !self.in_flight.remove(req) {
                if self.done.received.contains(req) || self.done.failed.contains_key(req) {
                    self.reports.cancelled += 1;
                }
                // Ended and fenced already, maybe not polled yet: never
                // report it now either.
                self.done.received.remove(req);
                self.done.failed.remove(req);
                continue;
            }
            for batch in self.batches.values_mut() {
                let before = batch.reqs.len();
                batch.reqs.retain(|p| &p.req != req);
                if batch.reqs.len() == before {
                    continue;
                }
                tracing::debug!(req_id = %req, peer = %batch.peer, "pull cancelled by the engine");
                self.reports.cancelled += 1;
                // Not granted yet: the transfer request has not gone out,
                // and the driver revokes the grant it is about to issue.
                batch.lost_requests = true;
                if let Some(grant) = batch.grant {
                    if !grants.contains(&grant) {
                        grants.push(grant);
                    }
                }
            }
        }
        grants
    }

    /// P answered a pull: each request will be received or failed by its
    /// outcome (a request the reply leaves out has failed), once fenced.
    /// Replies for pulls that already ended are ignored.
    pub fn handle_reply(&mut self, reply: XferReply) {
        match self.batches.get_mut(&reply.xfer_id) {
            Some(batch) if matches!(batch.stage, Stage::Pulling) => {
                batch.stage = Stage::Fencing(BatchOutcome::Replied(reply));
            }
            _ => tracing::debug!(xfer_id = reply.xfer_id, "reply for a transfer already ended; ignored"),
        }
    }

    /// A pull could not be completed (no grant, connection failure, hello
    /// rejected, shutdown): every request of it will fail, once fenced.
    pub fn handle_batch_failed(&mut self, xfer_id: u64, cause: FailureCause, reason: &str) {
        if let Some(batch) = self.batches.get_mut(&xfer_id) {
            if matches!(batch.stage, Stage::Pulling) {
                batch.stage = Stage::Fencing(BatchOutcome::Failed(cause, reason.to_owned()));
            }
        }
    }

    /// Ends every pull whose deadline passed at `now` (failed, once fenced);
    /// returns the grants the driver must revoke (then call
    /// [`ReceiverCore::handle_fenced`]) for them.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<(u64, Option<GrantId>)> {
        let reason = format!("no reply within {:?}", self.timeout);
        let mut to_fence = Vec::new();
        for (id, batch) in &mut self.batches {
            if batch.deadline <= now && matches!(batch.stage, Stage::Pulling) {
                batch.stage = Stage::Fencing(BatchOutcome::Failed(FailureCause::Timeout, reason.clone()));
                to_fence.push((*id, batch.grant));
            }
        }
        to_fence
    }

    /// The pull's grant is revoked (or it never had one): no byte of it can
    /// land any more, so its outcome is reported. A pull that had not ended
    /// yet fails. Later calls are ignored.
    pub fn handle_fenced(&mut self, xfer_id: u64) {
        let Some(batch) = self.batches.remove(&xfer_id) else { return };
        let Batch { started, peer, reqs, grant, stage, .. } = batch;
        let ended = |cause_reason: Option<(FailureCause, String)>, p: &Pulled| PullReport {
            req: p.req.clone(),
            remote: p.remote.clone(),
            peer: Some(peer.clone()),
            xfer_id: Some(xfer_id),
            grant,
            blocks: p.blocks.len(),
            started,
            failure: cause_reason,
        };
        let outcomes: HashMap<ReqId, Outcome> = match stage {
            Stage::Fencing(BatchOutcome::Replied(reply)) => {
                reply.outcomes.into_iter().map(|o| (o.req_id, o.outcome)).collect()
            }
            Stage::Pulling => HashMap::new(),
            Stage::Fencing(BatchOutcome::Failed(cause, reason)) => {
                for pulled in reqs {
                    let report = ended(Some((cause, reason.clone())), &pulled);
                    self.end(pulled, report);
                }
                return;
            }
        };
        for pulled in reqs {
            let failure = match outcomes.get(&pulled.remote) {
                Some(Outcome::Done) => None,
                Some(Outcome::Failed { cause, reason }) => Some((*cause, format!("prefill failed to send: {reason}"))),
                None if outcomes.is_empty() => {
                    Some((FailureCause::Other, "the pull ended before an outcome".to_owned()))
                }
                None => Some((FailureCause::Other, "prefill's reply has no outcome for the request".to_owned())),
            };
            let report = ended(failure, &pulled);
            self.end(pulled, report);
        }
    }

    /// Reports one request of a fenced pull to the engine and the driver.
    fn end(&mut self, pulled: Pulled, report: PullReport) {
        let Pulled { req, remote, blocks } = pulled;
        self.in_flight.remove(&req);
        match &report.failure {
            None => {
                tracing::debug!(req_id = %req, remote_req_id = %remote, peer = ?report.peer, blocks = blocks.len(), "KV received");
                self.done.received.insert(req);
            }
            Some((cause, reason)) => {
                tracing::debug!(req_id = %req, remote_req_id = %remote, peer = ?report.peer, %cause, %reason, "KV pull failed");
                self.done.failed.insert(req, blocks);
            }
        }
        self.report(report);
    }

    fn fail_at_start(
        &mut self,
        req: &ReqId,
        meta: &RecvReqMeta,
        peer: Option<SideChannelAddr>,
        cause: FailureCause,
        reason: String,
        now: Instant,
    ) {
        tracing::debug!(req_id = %req, %cause, %reason, "pull not started");
        self.done.failed.insert(req.clone(), meta.local_block_ids.clone());
        self.report(PullReport {
            req: req.clone(),
            remote: meta.remote.remote_request_id.clone(),
            peer,
            xfer_id: None,
            grant: None,
            blocks: meta.local_block_ids.len(),
            started: now,
            failure: Some((cause, reason)),
        });
    }

    fn report(&mut self, report: PullReport) {
        if self.reports.ended.len() >= MAX_UNTAKEN_REPORTS {
            // Drop the older half at once: a driver that never takes them
            // pays a shift once per many reports, not once per report.
            self.reports.ended.drain(..MAX_UNTAKEN_REPORTS / 2);
        }
        self.reports.ended.push(report);
    }

    /// How each request ended since the last call, and how many the engine
    /// cancelled: what the driver counts and logs. Kept (a bounded number)
    /// until taken.
    pub fn take_reports(&mut self) -> PullReports {
        std::mem::take(&mut self.reports)
    }

    /// Outcomes since the last poll, each request reported once.
    pub fn poll_finished(&mut self) -> RecvFinished {
        std::mem::take(&mut self.done)
    }

    /// The earliest deadline of a pull still waiting, for a driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.batches.values().filter(|b| matches!(b.stage, Stage::Pulling)).map(|b| b.deadline).min()
    }

    /// Requests being pulled (their outcome not yet reported).
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}
