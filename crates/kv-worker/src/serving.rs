//! One transfer request on P (sans-IO): which of its requests are refused
//! at once (meant for another prefill engine), which wait for the engine to
//! finish them, until when, whether a batch may still be written, what a
//! wait that ends means for each, which pieces of the claimed ones are
//! written in which batch, what D is told as they land, and the one outcome
//! per request of the reply; and, while a decode instance's transfer
//! request waits for admission, the renewals P makes on its behalf
//! ([`AdmissionWait`]). The side-channel server drives both with the sender
//! core and explicit time; it moves only bytes and time.
//!
//! A claimed request is written as its KV is staged on P (all at once when
//! it was ready whole), in pieces of at most D's piece size when D asked
//! for pieces; then D hears, after each batch, how far each request landed
//! and, as soon as it is known, each request's outcome.

use std::time::{Duration, Instant};

use kv_proto::{
    BlockId, EngineId, FailureCause, Outcome, ReqId, RequestBlocks, RequestOutcome, XferProgress, XferReply,
};

use crate::sender::{Claim, Puller, SenderCore};

/// How long before D's wait budget ends P stops waiting for a request it
/// has not got yet, at most (an eighth of the budget if that is less), so
/// its reply, which says why (not finished, never seen), reaches D before
/// D gives up on its own and can only say it heard nothing.
pub const REPLY_MARGIN: Duration = Duration::from_secs(1);

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

/// A piece of a claimed request to write: P's blocks and D's, in D's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The request's index in the transfer request.
    pub index: usize,
    /// P's blocks of the piece ([`BlockMap::Tokens`]: every block P holds of
    /// the request; the planner maps the piece's tokens onto them).
    pub local: Vec<BlockId>,
    /// D's blocks of the piece.
    pub remote: Vec<BlockId>,
    /// D's blocks of the request that have landed once this piece has.
    pub landed_after: usize,
}

impl Piece {
    /// Where the piece lies among D's blocks of the request.
    pub fn remote_range(&self) -> std::ops::Range<usize> {
        self.landed_after.saturating_sub(self.remote.len())..self.landed_after
    }
}

/// How D's blocks of a request map onto P's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockMap {
    /// Block for block: D's blocks are P's last ones.
    Whole,
    /// By token (another block size, head slice or token layout): P's
    /// blocks hold `local` tokens each, D's `remote`, and D's start at the
    /// request's [`RequestBlocks::first_token`] (P's last blocks without it).
    Tokens {
        /// Tokens per block on P.
        local: u32,
        /// Tokens per block on D.
        remote: u32,
    },
}

/// Of D's `remote_blocks` blocks, how many lie wholly in P's first `staged`
/// of `local_blocks` blocks (every token of them P holds), mapped by token.
/// Where the mapping is unknown (no first token and block sizes differ, a
/// size of 0), none until P's blocks are all staged: the planner then says
/// why it cannot map them.
pub fn remote_blocks_staged(
    staged: usize,
    local_blocks: usize,
    remote_blocks: usize,
    first_token: Option<u64>,
    local_tokens: u32,
    remote_tokens: u32,
) -> usize {
    if staged >= local_blocks {
        return remote_blocks;
    }
    let (lt, rt) = (u64::from(local_tokens), u64::from(remote_tokens));
    let first = match first_token {
        Some(first) => first,
        None if lt == rt => (local_blocks.saturating_sub(remote_blocks) as u64).saturating_mul(lt),
        None => return 0,
    };
    if rt == 0 {
        return 0;
    }
    let origin = first - first % rt;
    let staged_tokens = (staged as u64).saturating_mul(lt);
    let whole = staged_tokens.saturating_sub(origin) / rt;
    usize::try_from(whole).unwrap_or(usize::MAX).min(remote_blocks)
}

/// A claimed request being written.
#[derive(Debug)]
struct Writing {
    index: usize,
    /// P's blocks of it (all it holds; D may ask for its last ones only).
    local: Vec<BlockId>,
    /// D's blocks handed out in pieces so far.
    planned: usize,
    /// D's blocks written so far (with remote completion).
    landed: usize,
}

/// One transfer request's bookkeeping.
#[derive(Debug)]
pub struct TransferCore {
    xfer_id: u64,
    requests: Vec<RequestBlocks>,
    outcomes: Vec<Option<Outcome>>,
    pending: Vec<usize>,
    writing: Vec<Writing>,
    /// D's piece size in blocks (`None`: D asked for no pieces).
    piece_blocks: Option<usize>,
    /// What D is told next (only when it asked for pieces).
    progress: Vec<XferProgress>,
    wait_budget: Duration,
    abort_timeout: Duration,
    budget_end: Instant,
    wait_end: Instant,
    /// The wait ends for D's budget (not P's abort timeout).
    wait_ends_with_budget: bool,
    puller: Puller,
    map: BlockMap,
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
        let answer_by = budget_end - REPLY_MARGIN.min(wait_budget / 8);
        let wait_end = answer_by.min(received_at + abort_timeout);
        let wait_ends_with_budget = answer_by <= received_at + abort_timeout;
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
        let core = Self {
            xfer_id,
            requests,
            outcomes,
            pending,
            writing: Vec::new(),
            piece_blocks: None,
            progress: Vec::new(),
            wait_budget,
            abort_timeout,
            budget_end,
            wait_end,
            wait_ends_with_budget,
            puller: Puller::ONLY,
            map: BlockMap::Whole,
        };
        (core, misdirected)
    }

    /// The decode rank this transfer request comes from, where several pull
    /// each request from this worker (see [`SenderCore::claim_by`]).
    pub fn with_puller(self, puller: Puller) -> Self {
        Self { puller, ..self }
    }

    /// How D's blocks of each request map onto P's (default
    /// [`BlockMap::Whole`]): what of a request partly staged on P may be
    /// written, and what P's blocks a piece needs.
    pub fn with_block_map(self, map: BlockMap) -> Self {
        Self { map, ..self }
    }

    /// D asked for pieces of at most `piece_blocks` blocks (0: none): each
    /// request is written in such pieces, and D hears how far each landed
    /// and each outcome as soon as it is known
    /// ([`TransferCore::take_progress`]). Refusals made at construction are
    /// told too.
    pub fn with_pieces(mut self, piece_blocks: u32) -> Self {
        if piece_blocks > 0 {
            self.piece_blocks = Some(piece_blocks as usize);
            for index in 0..self.requests.len() {
                if let Some(outcome) = self.outcomes[index].clone() {
                    self.tell(index, 0, Some(outcome));
                }
            }
        }
        self
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

    /// Why nothing more may be written at `now`, if D's wait budget has
    /// passed (D has revoked the grant by then anyway): the cause and reason
    /// of each request not yet written.
    pub fn out_of_budget(&self, now: Instant) -> Option<(FailureCause, String)> {
        (now >= self.budget_end).then(Self::budget_passed)
    }

    /// The cause and reason of a request whose write D's wait budget cut
    /// short.
    pub fn budget_passed() -> (FailureCause, String) {
        (FailureCause::Timeout, "decode's wait budget passed before the KV was written".to_owned())
    }

    /// When the wait for unfinished requests ends: a little before D's
    /// budget ([`REPLY_MARGIN`]), or at P's abort timeout if sooner.
    pub fn wait_end(&self) -> Instant {
        self.wait_end
    }

    /// Whether some requests still wait for the engine to finish them.
    pub fn is_waiting(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether some claimed requests are not written whole yet.
    pub fn is_writing(&self) -> bool {
        !self.writing.is_empty()
    }

    /// Whether some request has no outcome yet (waiting or being written).
    pub fn is_open(&self) -> bool {
        self.is_waiting() || self.is_writing()
    }

    /// Claims every waiting request that is ready at `now` (to be written
    /// by [`TransferCore::next_batches`]); those P cannot send get their
    /// outcome now, those not finished keep waiting.
    pub fn claim_ready(&mut self, sender: &mut SenderCore, now: Instant) -> Vec<Claimed> {
        let mut claimed = Vec::new();
        let mut refused = Vec::new();
        // Kept a little past the wait's end (so the wait's end finds it
        // unseen and says so), never past P's own bound: a decode instance
        // cannot hold P's awaited places for a day-long budget.
        let awaited_until = self.wait_end + REPLY_MARGIN;
        let (requests, puller) = (&self.requests, self.puller);
        self.pending.retain(|&index| {
            let request = &requests[index];
            let req_id = &request.req_id;
            let ready_since = sender.ready_since(req_id);
            let claim = if request.may_precede_prefill {
                sender.claim_or_await(req_id, puller, awaited_until, now)
            } else {
                sender.claim_by(req_id, puller, now)
            };
            match claim {
                Claim::NotReady => true,
                Claim::Ready(blocks) => {
                    let ready_for = ready_since.map(|since| now.saturating_duration_since(since));
                    claimed.push(Claimed { index, blocks, ready_for });
                    false
                }
                other => {
                    refused.push((index, claim_failure(&other)));
                    false
                }
            }
        });
        for (index, outcome) in refused {
            self.finish(index, 0, outcome);
        }
        for c in &claimed {
            self.writing.push(Writing { index: c.index, local: c.blocks.clone(), planned: 0, landed: 0 });
        }
        claimed
    }

    /// What to write now, as batches of pieces, in order: of each request
    /// being written, its blocks staged on P and not handed out yet, cut
    /// into pieces of at most D's piece size (a shorter piece only at the
    /// end of the request, so D's pieces stay whole); consecutive pieces
    /// share a batch up to that size. Without pieces, all that is staged
    /// goes at once, in one batch. Requests P gave up on, or that cannot be
    /// written (D asks for more blocks than P holds), get their outcome.
    /// Mapped by token ([`BlockMap::Tokens`]), a block of D's is staged once
    /// every token of it that P holds is.
    pub fn next_batches(&mut self, sender: &mut SenderCore) -> Vec<Vec<Piece>> {
        let piece = self.piece_blocks.unwrap_or(usize::MAX);
        let mut pieces: Vec<Piece> = Vec::new();
        let mut ended: Vec<(usize, Outcome)> = Vec::new();
        for w in &mut self.writing {
            let request = &self.requests[w.index];
            let remote = &request.block_ids;
            if self.map == BlockMap::Whole && remote.len() > w.local.len() {
                let e = crate::plan::PlanError::TooManyBlocks { local: w.local.len(), remote: remote.len() };
                ended.push((w.index, failed(FailureCause::PlanFailed, e.to_string())));
                continue;
            }
            let staged = match sender.writable(&request.req_id) {
                Some(Ok(staged)) => staged,
                Some(Err(cause)) => {
                    let reason = "prefill could not stage the request's KV whole";
                    ended.push((w.index, failed(cause, reason)));
                    continue;
                }
                None => {
                    ended.push((w.index, failed(FailureCause::Other, "prefill no longer holds the request")));
                    continue;
                }
            };
            if remote.is_empty() {
                ended.push((w.index, Outcome::Done));
                continue;
            }
            // D may ask for P's last blocks only (a partial prefix hit).
            let skip = w.local.len().saturating_sub(remote.len());
            let ready = match self.map {
                BlockMap::Whole => staged.saturating_sub(skip).min(remote.len()),
                BlockMap::Tokens { local, remote: tokens } => {
                    let first = request.first_token;
                    remote_blocks_staged(staged, w.local.len(), remote.len(), first, local, tokens)
                }
            };
            while w.planned < ready {
                let end = w.planned.saturating_add(piece).min(ready);
                if end - w.planned < piece && end < remote.len() && self.piece_blocks.is_some() {
                    break; // wait for a whole piece
                }
                let local = match self.map {
                    BlockMap::Whole => w.local[skip + w.planned..skip + end].to_vec(),
                    // The planner maps the piece's tokens onto P's blocks.
                    BlockMap::Tokens { .. } => w.local.clone(),
                };
                pieces.push(Piece {
                    index: w.index,
                    local,
                    remote: remote[w.planned..end].to_vec(),
                    landed_after: end,
                });
                w.planned = end;
            }
        }
        for (index, outcome) in ended {
            self.end_writing(index, outcome, sender);
        }
        let mut batches: Vec<Vec<Piece>> = Vec::new();
        let mut size = 0usize;
        for p in pieces {
            let n = p.remote.len();
            match batches.last_mut() {
                Some(batch) if size.saturating_add(n) <= piece => {
                    size += n;
                    batch.push(p);
                }
                _ => {
                    size = n;
                    batches.push(vec![p]);
                }
            }
        }
        batches
    }

    /// Whether request `index` is still being written (a piece of a request
    /// that failed meanwhile is not written).
    pub fn is_being_written(&self, index: usize) -> bool {
        self.writing.iter().any(|w| w.index == index)
    }

    /// A batch of pieces was written (`Ok`) or not: each request whose last
    /// piece landed is done, each of a failed batch fails; D hears either.
    /// A request that ends is released on the sender.
    pub fn batch_written(
        &mut self,
        pieces: &[Piece],
        result: &Result<(), (FailureCause, String)>,
        sender: &mut SenderCore,
    ) {
        for p in pieces {
            if !self.is_being_written(p.index) {
                continue;
            }
            match result {
                Ok(()) if p.landed_after == self.requests[p.index].block_ids.len() => {
                    self.end_writing(p.index, Outcome::Done, sender);
                }
                Ok(()) => {
                    if let Some(w) = self.writing.iter_mut().find(|w| w.index == p.index) {
                        w.landed = w.landed.max(p.landed_after);
                    }
                    self.tell(p.index, p.landed_after, None);
                }
                Err((cause, reason)) => self.end_writing(p.index, failed(*cause, reason), sender),
            }
        }
    }

    /// A request being written ends with `outcome`: released on the
    /// sender; D hears it with what landed of it.
    pub fn end_writing(&mut self, index: usize, outcome: Outcome, sender: &mut SenderCore) {
        let Some(at) = self.writing.iter().position(|w| w.index == index) else { return };
        let w = self.writing.swap_remove(at);
        let landed = match &outcome {
            Outcome::Done => self.requests.get(index).map_or(0, |r| r.block_ids.len()),
            Outcome::Failed { .. } => w.landed,
        };
        sender.complete(&self.requests[index].req_id);
        self.finish(index, landed, Some(outcome));
    }

    /// What D is told now (empty unless it asked for pieces).
    pub fn take_progress(&mut self) -> Vec<XferProgress> {
        std::mem::take(&mut self.progress)
    }

    fn finish(&mut self, index: usize, landed: usize, outcome: Option<Outcome>) {
        if let Some(slot) = self.outcomes.get_mut(index) {
            *slot = outcome.clone();
        }
        self.tell(index, landed, outcome);
    }

    fn tell(&mut self, index: usize, landed: usize, outcome: Option<Outcome>) {
        if self.piece_blocks.is_none() {
            return;
        }
        let Some(request) = self.requests.get(index) else { return };
        self.progress.push(XferProgress {
            xfer_id: self.xfer_id,
            req_id: request.req_id.clone(),
            landed: u32::try_from(landed).unwrap_or(u32::MAX),
            outcome,
        });
    }

    /// The wait ended: every request still waiting fails, and so does every
    /// one not written whole (released on the sender). When D gave up for
    /// good (its connection closed, or the bound passed), the waiting ones
    /// are abandoned on the sender (freed as soon as the engine finishes
    /// them, not leased for a pull that will not come).
    pub fn end_wait(&mut self, end: WaitEnd, sender: &mut SenderCore) {
        let (cause, reason, abandoned) = match end {
            WaitEnd::Shutdown => (FailureCause::Shutdown, "prefill worker shutting down".to_owned(), false),
            WaitEnd::ConnectionClosed => {
                (FailureCause::ConnectionLost, "decode's side-channel connection closed".to_owned(), true)
            }
            WaitEnd::Deadline if self.wait_ends_with_budget => (
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
        for index in std::mem::take(&mut self.pending) {
            let req_id = &self.requests[index].req_id;
            let outcome = if sender.never_seen(req_id) && end != WaitEnd::Shutdown {
                let reason = format!(
                    "{reason}: the prefill engine never saw the request (its prefill leg failed or never came)"
                );
                failed(FailureCause::PrefillNeverSeen, reason)
            } else {
                failed(cause, &reason)
            };
            if abandoned {
                sender.abandon(req_id);
            }
            self.finish(index, 0, Some(outcome));
        }
        let writing: Vec<usize> = self.writing.iter().map(|w| w.index).collect();
        for index in writing {
            self.end_writing(index, failed(cause, &reason), sender);
        }
    }

    /// Records the outcome of a claimed request (written, or why not),
    /// without the sender (tests, and callers that release it themselves).
    pub fn record(&mut self, index: usize, outcome: Outcome) {
        self.writing.retain(|w| w.index != index);
        let landed = match &outcome {
            Outcome::Done => self.requests.get(index).map_or(0, |r| r.block_ids.len()),
            Outcome::Failed { .. } => 0,
        };
        self.finish(index, landed, Some(outcome));
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

/// The most often P renews on a decode instance's behalf while it makes
/// that instance's messages wait.
pub const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(100);

/// How often a renewal is sent for a hold of `renewal`: a third of it
/// (three chances before the hold runs out), never more often than
/// [`MIN_RENEW_INTERVAL`] (the period comes from the peer's hello).
pub fn renew_every(renewal: Duration) -> Duration {
    (renewal / 3).max(MIN_RENEW_INTERVAL)
}

/// P makes decode instance `by`'s messages wait: a transfer request of its
/// waits for admission, and its later messages, renewals included, wait
/// unread behind it. So that P's own back-pressure never frees a request a
/// live decode instance still wants, P renews on its behalf what it last
/// renewed, every third of the renewal period (at most every
/// [`MIN_RENEW_INTERVAL`]), until the wait ends.
#[derive(Debug)]
pub struct AdmissionWait {
    by: EngineId,
    /// `None`: P takes no renewals, so there is nothing to keep.
    every: Option<Duration>,
    next: Instant,
}

impl AdmissionWait {
    /// A wait that began at `now` for a message of `by`, on a P whose
    /// renewals hold a request `renewal` long (zero: renewals are off).
    pub fn new(by: EngineId, renewal: Duration, now: Instant) -> Self {
        let every = (!renewal.is_zero()).then(|| renew_every(renewal));
        Self { by, every, next: now + every.unwrap_or_default() }
    }

    /// When P renews on `by`'s behalf next (`None`: never).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.every.map(|_| self.next)
    }

    /// Renews on `by`'s behalf on `sender` if that is due at `now`; returns
    /// how many requests it renewed.
    pub fn handle_timeout(&mut self, sender: &mut SenderCore, now: Instant) -> usize {
        let Some(every) = self.every else { return 0 };
        if now < self.next {
            return 0;
        }
        self.next = now + every;
        sender.renew_all_by(&self.by, now)
    }
}
