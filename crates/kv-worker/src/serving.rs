//! One transfer request on P (sans-IO): which of its requests are refused
//! at once (meant for another prefill engine), which wait for the engine to
//! finish them, until when, what a wait that ends means for each, and the
//! one outcome per request of the reply. The side-channel server drives it
//! with the sender core and explicit time; it moves only bytes and time.

use std::time::{Duration, Instant};

use kv_proto::{BlockId, EngineId, FailureCause, Outcome, ReqId, RequestBlocks, RequestOutcome, XferReply};

use crate::sender::{Claim, SenderCore};

/// The longest wait budget taken from a transfer request (peer input).
pub const MAX_WAIT_BUDGET: Duration = Duration::from_secs(24 * 60 * 60);

/// A failed outcome with its cause and a bounded reason.
pub fn failed(cause: FailureCause, reason: impl AsRef<str>) -> Outcome {
    Outcome::Failed { cause, reason: kv_proto::bounded_text(reason.as_ref()) }
}

/// Why a claim gives no blocks to send, as the request's outcome.
pub fn claim_failure(claim: &Claim) -> Option<Outcome> {
    let (cause, reason) = match claim {
        Claim::Ready(_) | Claim::NotReady => return None,
        Claim::Unknown => (
            FailureCause::UnknownRequest,
            "request unknown to prefill (never scheduled there, aborted, or already sent)",
        ),
        Claim::Expired => (FailureCause::LeaseEnded, "request's lease on prefill had ended; its blocks were freed"),
        Claim::InFlight => (FailureCause::AlreadyInFlight, "request is already being sent to another pull"),
        Claim::Failed(cause) => (*cause, "prefill could not stage the request's KV; its blocks were freed"),
    };
    Some(failed(cause, reason))
}

/// Requests of a transfer request that named another prefill engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Misdirected {
    /// The first of them.
    pub req_id: ReqId,
    /// How many.
    pub refused: usize,
    /// Why (names both engines).
    pub reason: String,
}

/// A request claimed for writing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claimed {
    /// Its index in the transfer request.
    pub index: usize,
    /// P's blocks of it.
    pub blocks: Vec<BlockId>,
    /// How long it had been ready when claimed (`None`: unknown).
    pub ready_for: Option<Duration>,
}

/// Why a wait for unfinished requests ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitEnd {
    /// The prefill worker is shutting down.
    Shutdown,
    /// D's connection closed: D gave up for good.
    ConnectionClosed,
    /// The wait's bound ([`TransferCore::wait_end`]) passed.
    Deadline,
}

/// One transfer request's bookkeeping.
#[derive(Debug)]
pub struct TransferCore {
    xfer_id: u64,
    requests: Vec<RequestBlocks>,
    outcomes: Vec<Option<Outcome>>,
    pending: Vec<usize>,
    wait_budget: Duration,
    abort_timeout: Duration,
    budget_end: Instant,
    wait_end: Instant,
}

impl TransferCore {
    /// A transfer request received at `received_at` by prefill engine
    /// `ours`, which holds an unfinished request at most `abort_timeout`.
    /// Requests naming another prefill engine are refused at once.
    pub fn new(
        xfer_id: u64,
        requests: Vec<RequestBlocks>,
        wait_budget: Duration,
        received_at: Instant,
        abort_timeout: Duration,
        ours: &EngineId,
    ) -> (Self, Option<Misdirected>) {
        // Peer input: any duration decodes; one past a day means "no budget".
        let wait_budget = wait_budget.min(MAX_WAIT_BUDGET);
        let budget_end = received_at + wait_budget;
        let wait_end = budget_end.min(received_at + abort_timeout);
        let mut outcomes = vec![None; requests.len()];
        let mut pending = Vec::with_capacity(requests.len());
        let mut misdirected: Option<Misdirected> = None;
        for (index, r) in requests.iter().enumerate() {
            match &r.prefill_engine_id {
                // A pull meant for another prefill engine (a proxy that mixed
                // up instances) must not take, or write, a request of this one.
                Some(theirs) if theirs != ours => {
                    let reason = format!("the pull names prefill engine {theirs}, but this is prefill engine {ours}");
                    outcomes[index] = Some(failed(FailureCause::PeerRefused, &reason));
                    match &mut misdirected {
                        Some(m) => m.refused += 1,
                        None => misdirected = Some(Misdirected { req_id: r.req_id.clone(), refused: 1, reason }),
                    }
                }
                _ => pending.push(index),
            }
        }
        let core = Self { xfer_id, requests, outcomes, pending, wait_budget, abort_timeout, budget_end, wait_end };
        (core, misdirected)
    }

    /// Every request of `requests` refused with `cause` (e.g. an endpoint P
    /// will not write to).
    pub fn refuse_all(xfer_id: u64, requests: Vec<RequestBlocks>, cause: FailureCause, reason: &str) -> XferReply {
        let outcome = failed(cause, reason);
        let outcomes =
            requests.into_iter().map(|r| RequestOutcome { req_id: r.req_id, outcome: outcome.clone() }).collect();
        XferReply { xfer_id, outcomes }
    }

    /// The transfer request's requests, in order.
    pub fn requests(&self) -> &[RequestBlocks] {
        &self.requests
    }

    /// When D's wait budget ends: nothing may be written after it.
    pub fn budget_end(&self) -> Instant {
        self.budget_end
    }

    /// When the wait for unfinished requests ends (D's budget, or P's
    /// abort timeout if sooner).
    pub fn wait_end(&self) -> Instant {
        self.wait_end
    }

    /// Whether some requests still wait for the engine.
    pub fn is_waiting(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Claims every waiting request that is ready at `now`; those P cannot
    /// send get their outcome now, those not finished keep waiting.
    pub fn claim_ready(&mut self, sender: &mut SenderCore, now: Instant) -> Vec<Claimed> {
        let mut claimed = Vec::new();
        let (requests, outcomes) = (&self.requests, &mut self.outcomes);
        self.pending.retain(|&index| {
            let req_id = &requests[index].req_id;
            let ready_since = sender.ready_since(req_id);
            match sender.claim(req_id, now) {
                Claim::NotReady => true,
                Claim::Ready(blocks) => {
                    let ready_for = ready_since.map(|since| now.saturating_duration_since(since));
                    claimed.push(Claimed { index, blocks, ready_for });
                    false
                }
                other => {
                    outcomes[index] = claim_failure(&other);
                    false
                }
            }
        });
        claimed
    }

    /// The wait ended: every request still waiting fails. When D gave up
    /// for good (its connection closed, or the bound passed), they are
    /// abandoned on the sender (freed as soon as the engine finishes them,
    /// not leased for a pull that will not come).
    pub fn end_wait(&mut self, end: WaitEnd, sender: &mut SenderCore) {
        let (cause, reason, abandoned) = match end {
            WaitEnd::Shutdown => (FailureCause::Shutdown, "prefill worker shutting down".to_owned(), false),
            WaitEnd::ConnectionClosed => {
                (FailureCause::ConnectionLost, "decode's side-channel connection closed".to_owned(), true)
            }
            WaitEnd::Deadline if self.wait_end == self.budget_end => (
                FailureCause::NotReady,
                format!("request not finished on prefill within decode's wait budget of {:?}", self.wait_budget),
                true,
            ),
            WaitEnd::Deadline => (
                FailureCause::NotReady,
                format!("request not finished on prefill within {:?}", self.abort_timeout),
                true,
            ),
        };
        for index in self.pending.drain(..) {
            if abandoned {
                sender.abandon(&self.requests[index].req_id);
            }
            self.outcomes[index] = Some(failed(cause, &reason));
        }
    }

    /// Records the outcome of a claimed request (written, or why not).
    pub fn record(&mut self, index: usize, outcome: Outcome) {
        if let Some(slot) = self.outcomes.get_mut(index) {
            *slot = Some(outcome);
        }
    }

    /// The reply: one outcome per request, in order.
    pub fn reply(self) -> XferReply {
        let outcomes = self
            .requests
            .into_iter()
            .zip(self.outcomes)
            .map(|(r, outcome)| RequestOutcome {
                req_id: r.req_id,
                outcome: outcome.unwrap_or_else(|| failed(FailureCause::Other, "no outcome recorded")),
            })
            .collect();
        XferReply { xfer_id: self.xfer_id, outcomes }
    }
}
