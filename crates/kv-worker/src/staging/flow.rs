//! A device cache's KV through host staging (sans-IO): which request holds
//! which slots, which copies the engine must run between its device blocks
//! and the slots, and what the worker and the engine hear when.
//!
//! The worker only ever sees staging slots (its registered cache is the
//! staging memory); the engine only ever hears of its own device blocks.
//!
//! - **P**: a request finished with its KV on the device is copied into
//!   slots ([`CopyOrder`] `ToStaging`), in pieces when pieces are set; as
//!   each piece is done (in order), the worker hears how much of it is in
//!   the slots ([`StagedStep::staged_sends`]) and may write that much while
//!   the rest is copied. Once every piece is done the engine hears it
//!   finished sending (its device blocks are free: the slots hold its KV
//!   for the pull). The slots come back when the worker is done with it
//!   (sent, failed, lease ended) and no copy into them runs.
//! - **D**: a pull gets slots before it starts; the worker pulls into them.
//!   Each piece P says landed is copied into the engine's blocks
//!   (`ToDevice`) at once, while the rest is on the wire (a request pulled
//!   in parts from several prefill workers: once every part landed it, as
//!   the receiver core's [`PullProgress`] says); the rest is
//!   copied once the worker reports the pull received (its grant fenced) or
//!   P said it is done. Only when every copy of it is done does the engine
//!   hear the request received. A failed pull is reported failed with the
//!   device blocks once no copy into them runs. Its slots come back once
//!   the worker reported it (no peer can write them any more) and no copy
//!   out of them runs.
//! - A request that finds no free slots waits, at most the pool's bound,
//!   then fails cleanly: on P its pull is answered `staging_exhausted` and
//!   its blocks freed, on D it is reported failed (the engine recomputes).
//! - A copy that fails fails its request the same way (`copy_failed`): on P
//!   its pull is answered failed (what was staged may have been written);
//!   on D the engine hears it failed once no other copy of it runs, and a
//!   pull still out is cut short ([`StagedStep::fail_pulls`]: fenced, so P
//!   stops writing and lets go of it; its slots come back after the fence).
//! - A pull the engine cancels while its slots are being copied to the
//!   device is one the engine must wait for before it frees the blocks
//!   ([`StagedStep::wait_for`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kv_proto::{BlockId, ConnectorMetadata, FailureCause, RecvReqMeta, RemotePrefill, ReqId, SendUpdate};

use super::pool::{Reservation, StagingPool};
use crate::receiver::PullProgress;
use crate::worker::{Finished, Settled};

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    /// Device blocks into staging slots (P).
    ToStaging,
    /// Staging slots into device blocks (D).
    ToDevice,
}

/// A copy the engine runs between its blocks and the staging slots, and
/// reports done with [`StagingCore::copies_done`] (or failed with
/// [`StagingCore::copies_failed`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyOrder {
    /// Names the copy in [`StagingCore::copies_done`].
    pub id: u64,
    /// The request it is for.
    pub req: ReqId,
    /// Which way.
    pub direction: CopyDirection,
    /// `(device block, staging slot)`, in prompt order.
    pub pairs: Vec<(BlockId, BlockId)>,
}

/// P: at most this many requests remembered as pulled before they were
/// ready (each is a request the engine expects to finish).
const MAX_PULLED_EARLY: usize = 65_536;

/// What one call of the core asks of its driver.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StagedStep {
    /// Metadata for [`crate::Worker::start_load_kv`] (staging slots for block ids).
    pub to_worker: ConnectorMetadata,
    /// P: requests whose KV is (now) in the first `n` of their slots
    /// ([`crate::Worker::stage_sends`]); after the driver applied
    /// `to_worker`.
    pub staged_sends: Vec<(ReqId, Vec<BlockId>, usize)>,
    /// P: requests the worker must fail ([`crate::Worker::fail_sends`]):
    /// no slots within the bound (`staging_exhausted`), or a copy into its
    /// slots failed (`copy_failed`).
    pub fail_sends: Vec<(ReqId, FailureCause)>,
    /// D: pulls that failed before they started (no slots within the
    /// bound), for the worker's failure count.
    pub failed_before_pull: Vec<ReqId>,
    /// D: the prefill instances holding those, told to let go of them at
    /// once ([`crate::Worker::release_on_prefill`]).
    pub release_on_prefill: BTreeMap<ReqId, RemotePrefill>,
    /// D: pulls still out whose copy into the engine's blocks failed: the
    /// worker fences them before anything else of this step is applied and
    /// never reports them; they count failed, `copy_failed`
    /// ([`crate::Worker::fail_pulls`]).
    pub fail_pulls: Vec<ReqId>,
    /// D: pulls the worker reported received, now settled for the engine
    /// ([`crate::Worker::settle_landed`]).
    pub settled: Vec<(ReqId, Settled)>,
    /// Copies the engine starts now.
    pub copies: Vec<CopyOrder>,
    /// Copies the engine must finish (and report done) before it frees the
    /// blocks of the requests it just cancelled.
    pub wait_for: Vec<u64>,
    /// What the engine hears, in its own block ids.
    pub finished: Finished,
}

/// A piece of a copy into slots (P).
#[derive(Debug)]
struct SendPiece {
    copy: u64,
    /// The request's blocks in the slots once it and those before it are done.
    end: usize,
    /// `None`: running; `Some(true)`: done; `Some(false)`: failed.
    done: Option<bool>,
}

/// P: a request copied into its slots, then sent from them.
#[derive(Debug)]
struct Send {
    slots: Vec<BlockId>,
    pieces: Vec<SendPiece>,
    /// Its first `staged` blocks are in the slots, and the worker knows.
    staged: usize,
    /// The worker has it (it reports it finished sending, at the latest at
    /// its lease's end).
    given: bool,
    /// The worker reported it finished: done with its slots.
    worker_done: bool,
    /// The engine heard its device blocks are free.
    told: bool,
    /// The scheduler withdrew it before it was given to the worker.
    forgotten: bool,
    /// A copy of it failed.
    failed: bool,
}

impl Send {
    fn copying(&self) -> bool {
        self.pieces.iter().any(|p| p.done.is_none())
    }

    /// The blocks in slots: those of the done pieces before the first that is not.
    fn done_prefix(&self) -> usize {
        self.pieces.iter().take_while(|p| p.done == Some(true)).last().map_or(0, |p| p.end)
    }
}

/// D: how a pull ends for the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Pending,
    Received,
    Failed,
}

/// D: a request pulled into its slots and copied on into the engine's blocks.
#[derive(Debug)]
struct Recv {
    device: Vec<BlockId>,
    slots: Vec<BlockId>,
    /// Copies ordered so far cover its first `ordered` blocks.
    ordered: usize,
    /// Copies into the engine's blocks running now.
    running: BTreeSet<u64>,
    verdict: Verdict,
    /// The engine heard it (received or failed).
    told: bool,
    /// The worker reported it: no peer can write its slots any more.
    fenced: bool,
    /// The worker reported it received (its count waits for the engine).
    landed: bool,
    /// A copy of it failed.
    copy_failed: bool,
    /// The engine cancelled it: never reported.
    cancelled: bool,
}

#[derive(Debug)]
enum Flow {
    /// P: waiting for slots to copy `device` into.
    SendWaiting { device: Vec<BlockId> },
    /// P: being copied into its slots, then sent from them.
    Sending(Send),
    /// D: waiting for slots to pull into.
    RecvWaiting { meta: RecvReqMeta },
    /// D: being pulled into its slots and copied on.
    Pulling(Recv),
}

/// What the core counted since it was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingCounts {
    /// Requests that found no free slots and waited.
    pub waits: u64,
    /// Requests that found no room within the bound, or needed more slots
    /// than there are.
    pub exhausted: u64,
    /// Copies into slots that failed.
    pub copies_failed_to_staging: u64,
    /// Copies into the engine's blocks that failed.
    pub copies_failed_to_device: u64,
}

/// The staging bookkeeping of one worker, driven with explicit time.
#[derive(Debug)]
pub struct StagingCore {
    pool: StagingPool,
    wait: Duration,
    /// Blocks per copy into slots (P); `usize::MAX`: whole requests.
    piece: usize,
    flows: HashMap<ReqId, Flow>,
    /// P: requests a pull asked for before they were ready: staged as a
    /// pull's request, not ahead, once they are.
    pulled_early: BTreeSet<ReqId>,
    copies: HashMap<u64, ReqId>,
    next_copy: u64,
    counts: StagingCounts,
}

impl StagingCore {
    /// `slots` staging slots; a request waits at most `wait` for its own.
    pub fn new(slots: u32, wait: Duration) -> Self {
        Self {
            pool: StagingPool::new(slots),
            wait,
            piece: usize::MAX,
            flows: HashMap::new(),
            pulled_early: BTreeSet::new(),
            copies: HashMap::new(),
            next_copy: 1,
            counts: StagingCounts::default(),
        }
    }

    /// P copies a request into its slots in pieces of at most `blocks`
    /// (`None` or 0: whole); D copies what P says landed as it lands.
    pub fn with_pieces(mut self, blocks: Option<u32>) -> Self {
        self.piece = blocks.filter(|&b| b > 0).map_or(usize::MAX, |b| b as usize);
        self
    }

    /// One step's metadata from the engine (device block ids).
    pub fn start_load_kv(&mut self, meta: &ConnectorMetadata, now: Instant) -> StagedStep {
        let mut step = StagedStep::default();
        step.to_worker.reqs_to_watch = meta.reqs_to_watch.clone();
        step.to_worker.reqs_to_unwatch = meta.reqs_to_unwatch.clone();
        step.to_worker.renewal_keys = meta.renewal_keys.clone();
        for (req, update) in &meta.reqs_to_send {
            match update {
                SendUpdate::Expect => {
                    step.to_worker.reqs_to_send.insert(req.clone(), SendUpdate::Expect);
                }
                SendUpdate::Ready { block_ids } => self.stage_send(req, block_ids, now, &mut step),
                SendUpdate::Forget => self.forget_send(req, &mut step),
            }
        }
        for (req, meta) in &meta.reqs_to_recv {
            self.stage_recv(req, meta, now, &mut step);
        }
        for req in &meta.reqs_to_cancel {
            self.cancel_recv(req, &mut step);
        }
        step
    }

    /// The engine finished these copies (at `now`).
    pub fn copies_done(&mut self, ids: impl IntoIterator<Item = u64>, now: Instant) -> StagedStep {
        self.copies_ended(ids, true, now)
    }

    /// These copies failed (at `now`): their requests fail (`copy_failed`).
    pub fn copies_failed(&mut self, ids: impl IntoIterator<Item = u64>, now: Instant) -> StagedStep {
        self.copies_ended(ids, false, now)
    }

    /// P's progress on pulls, as the worker kept it
    /// ([`crate::Worker::take_progress`]): what landed is copied on at once.
    /// Give it before the [`StagingCore::worker_finished`] of the same poll.
    pub fn worker_progress(&mut self, progress: Vec<PullProgress>) -> StagedStep {
        let mut step = StagedStep::default();
        for p in progress {
            self.pull_progress(p, &mut step);
        }
        step
    }

    /// P: pulls arrived for these requests while they were not in their
    /// slots yet ([`crate::Worker::take_pulled`]): one waiting for slots,
    /// staged ahead of its pull, now waits as a pull's request (ahead of
    /// those staged ahead, its bound from `now`); one not ready yet will.
    pub fn pulls_arrived(&mut self, reqs: impl IntoIterator<Item = ReqId>, now: Instant) -> StagedStep {
        let mut step = StagedStep::default();
        for req in reqs {
            match self.flows.get(&req) {
                Some(Flow::SendWaiting { .. }) => {
                    self.pool.demand(&req, now, self.wait);
                }
                Some(_) => {}
                // Bounded: past it, such a request is only staged ahead.
                None if self.pulled_early.len() < MAX_PULLED_EARLY => {
                    self.pulled_early.insert(req);
                }
                None => {}
            }
        }
        self.grant_waiters(now, &mut step);
        step
    }

    /// What the worker reported (in staging slots), and the waits that
    /// ended at `now`.
    pub fn worker_finished(&mut self, finished: Finished, now: Instant) -> StagedStep {
        let mut step = StagedStep::default();
        for req in finished.sending {
            self.pulled_early.remove(&req);
            if let Some(Flow::Sending(send)) = self.flows.get_mut(&req) {
                send.worker_done = true;
                self.settle_send(&req, &mut step);
            }
        }
        for req in finished.receiving {
            match self.flows.get_mut(&req) {
                Some(Flow::Pulling(recv)) => {
                    recv.fenced = true;
                    recv.landed = true;
                    if recv.verdict == Verdict::Pending {
                        recv.verdict = Verdict::Received;
                    }
                    self.settle_recv(&req, &mut step);
                }
                // A pull of no blocks (notify-only): nothing was staged.
                None => {
                    step.settled.push((req.clone(), Settled::Copied));
                    step.finished.receiving.insert(req);
                }
                Some(_) => {}
            }
        }
        for (req, blocks) in finished.failed_receiving {
            match self.flows.get_mut(&req) {
                Some(Flow::Pulling(recv)) => {
                    recv.fenced = true;
                    if recv.verdict == Verdict::Pending {
                        recv.verdict = Verdict::Failed;
                    }
                    self.settle_recv(&req, &mut step);
                }
                None if blocks.is_empty() => {
                    step.finished.failed_receiving.insert(req, blocks);
                }
                _ => {}
            }
        }
        self.grant_waiters(now, &mut step);
        step
    }

    /// The earliest end of a wait for slots, for a driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pool.next_deadline()
    }

    /// The pool (for gauges and tests).
    pub fn pool(&self) -> &StagingPool {
        &self.pool
    }

    /// What the core counted since it was made.
    pub fn counts(&self) -> StagingCounts {
        self.counts
    }

    /// Requests in any stage of staging.
    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// Whether no request is being staged.
    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }

    fn copies_ended(&mut self, ids: impl IntoIterator<Item = u64>, ok: bool, now: Instant) -> StagedStep {
        let mut step = StagedStep::default();
        for id in ids {
            let Some(req) = self.copies.remove(&id) else { continue };
            match self.flows.get_mut(&req) {
                Some(Flow::Sending(send)) => {
                    if let Some(piece) = send.pieces.iter_mut().find(|p| p.copy == id) {
                        piece.done = Some(ok);
                    }
                    if !ok {
                        self.counts.copies_failed_to_staging += 1;
                        if !send.failed {
                            send.failed = true;
                            tracing::warn!(req_id = %req, copy = id, "copying the request's KV into staging failed; its pull will fail");
                            if !send.forgotten {
                                step.fail_sends.push((req.clone(), FailureCause::CopyFailed));
                            }
                            // Not given: the worker never reports it (the
                            // failure leaves no entry it would end).
                            if !send.given {
                                send.worker_done = true;
                            }
                        }
                    }
                    self.settle_send(&req, &mut step);
                }
                Some(Flow::Pulling(recv)) => {
                    recv.running.remove(&id);
                    if !ok {
                        self.counts.copies_failed_to_device += 1;
                        if !recv.copy_failed {
                            tracing::warn!(req_id = %req, copy = id, "copying the pull from staging into the engine's blocks failed; it fails");
                        }
                        recv.copy_failed = true;
                        if !recv.fenced && !recv.cancelled && recv.verdict == Verdict::Pending {
                            // Still being pulled: cut it short, so P stops
                            // writing and lets go of it now. The driver
                            // fences it before its slots can be reused.
                            tracing::info!(req_id = %req, copy = id, "cancelling the pull whose copy failed");
                            step.fail_pulls.push(req.clone());
                            recv.fenced = true;
                        }
                        if !recv.told {
                            recv.verdict = Verdict::Failed;
                        }
                    }
                    self.settle_recv(&req, &mut step);
                }
                _ => {}
            }
        }
        self.grant_waiters(now, &mut step);
        step
    }

    /// P: tells the worker what is newly staged, the engine when its device
    /// blocks are free, and frees the slots once nothing uses them.
    fn settle_send(&mut self, req: &ReqId, step: &mut StagedStep) {
        let Some(Flow::Sending(send)) = self.flows.get_mut(req) else { return };
        let prefix = send.done_prefix();
        if prefix > send.staged && !send.failed && !send.forgotten && !send.worker_done {
            send.staged = prefix;
            send.given = true;
            step.staged_sends.push((req.clone(), send.slots.clone(), prefix));
        }
        let copying = send.copying();
        if !copying && !send.told && !send.forgotten {
            // No copy reads its device blocks any more.
            send.told = true;
            step.finished.sending.insert(req.clone());
        }
        if !copying && (send.worker_done || (send.forgotten && !send.given)) {
            self.flows.remove(req);
            self.pool.release(req);
        }
    }

    /// D: orders the copies that became due, tells the engine once every
    /// copy into its blocks ended, frees the slots once nothing uses them.
    fn settle_recv(&mut self, req: &ReqId, step: &mut StagedStep) {
        let Some(Flow::Pulling(recv)) = self.flows.get_mut(req) else { return };
        if recv.verdict == Verdict::Received && !recv.cancelled && recv.ordered < recv.device.len() {
            let (from, to) = (recv.ordered, recv.device.len());
            recv.ordered = to;
            let (device, slots) = (recv.device[from..to].to_vec(), recv.slots[from..to].to_vec());
            let copy = self.order(req, CopyDirection::ToDevice, &device, &slots, step);
            if let Some(Flow::Pulling(recv)) = self.flows.get_mut(req) {
                recv.running.insert(copy);
            }
        }
        let Some(Flow::Pulling(recv)) = self.flows.get_mut(req) else { return };
        if !recv.told && !recv.cancelled && recv.running.is_empty() {
            match recv.verdict {
                Verdict::Received if recv.ordered == recv.device.len() => {
                    recv.told = true;
                    step.finished.receiving.insert(req.clone());
                }
                Verdict::Failed => {
                    recv.told = true;
                    step.finished.failed_receiving.insert(req.clone(), recv.device.clone());
                }
                _ => {}
            }
        }
        if recv.fenced && recv.running.is_empty() && (recv.told || recv.cancelled) {
            if recv.landed {
                let how = match (recv.cancelled, recv.verdict) {
                    (true, _) => Settled::Cancelled,
                    (false, Verdict::Received) => Settled::Copied,
                    (false, _) => Settled::CopyFailed,
                };
                step.settled.push((req.clone(), how));
            }
            self.flows.remove(req);
            self.pool.release(req);
        }
    }

    /// D: P said how far a pull got: what landed is copied on at once.
    fn pull_progress(&mut self, progress: PullProgress, step: &mut StagedStep) {
        let PullProgress { req, landed, ended } = progress;
        let Some(Flow::Pulling(recv)) = self.flows.get_mut(&req) else { return };
        if recv.cancelled || recv.told || recv.verdict == Verdict::Failed {
            return;
        }
        let landed = (landed as usize).min(recv.device.len());
        if landed > recv.ordered {
            let from = recv.ordered;
            recv.ordered = landed;
            let (device, slots) = (recv.device[from..landed].to_vec(), recv.slots[from..landed].to_vec());
            let copy = self.order(&req, CopyDirection::ToDevice, &device, &slots, step);
            if let Some(Flow::Pulling(recv)) = self.flows.get_mut(&req) {
                recv.running.insert(copy);
            }
        }
        if let (Some(Flow::Pulling(recv)), Some(ended)) = (self.flows.get_mut(&req), ended) {
            recv.verdict = if ended.is_ok() { Verdict::Received } else { Verdict::Failed };
        }
        self.settle_recv(&req, step);
    }

    fn stage_send(&mut self, req: &ReqId, device: &[BlockId], now: Instant, step: &mut StagedStep) {
        if self.flows.contains_key(req) {
            tracing::warn!(req_id = %req, "ready update for a request already being staged; ignored");
            return;
        }
        // D may ask before the copy is done: the worker holds its pull.
        step.to_worker.reqs_to_send.insert(req.clone(), SendUpdate::Expect);
        // Copied ahead of its pull, unless the pull is here already (see
        // `StagingPool::reserve_ahead`: a pool full of requests no pull
        // asks for yet would stall the pulls that wait).
        let reservation = if self.pulled_early.remove(req) {
            self.pool.reserve(req, device.len(), now, self.wait)
        } else {
            self.pool.reserve_ahead(req, device.len(), now, self.wait)
        };
        match reservation {
            Reservation::Granted(slots) => self.start_send(req, device, slots, step),
            Reservation::Waiting => {
                self.counts.waits += 1;
                self.flows.insert(req.clone(), Flow::SendWaiting { device: device.to_vec() });
            }
            Reservation::TooLarge { wanted, capacity } => {
                tracing::warn!(req_id = %req, wanted, capacity, "request needs more staging slots than there are; its pull will fail");
                self.counts.exhausted += 1;
                self.fail_send(req, step);
            }
            Reservation::Duplicate => {}
        }
    }

    /// P: orders the copies of `req` into `slots`, piece by piece.
    fn start_send(&mut self, req: &ReqId, device: &[BlockId], slots: Vec<BlockId>, step: &mut StagedStep) {
        let mut pieces = Vec::new();
        let mut from = 0;
        while from < device.len() {
            let to = from.saturating_add(self.piece).min(device.len());
            let copy = self.order(req, CopyDirection::ToStaging, &device[from..to], &slots[from..to], step);
            pieces.push(SendPiece { copy, end: to, done: None });
            from = to;
        }
        let given = pieces.is_empty();
        if given {
            // Nothing to copy (no blocks): ready at once.
            step.staged_sends.push((req.clone(), Vec::new(), 0));
        }
        let send =
            Send { slots, pieces, staged: 0, given, worker_done: false, told: false, forgotten: false, failed: false };
        self.flows.insert(req.clone(), Flow::Sending(send));
        self.settle_send(req, step);
    }

    fn forget_send(&mut self, req: &ReqId, step: &mut StagedStep) {
        self.pulled_early.remove(req);
        match self.flows.get_mut(req) {
            Some(Flow::SendWaiting { .. }) => {
                self.flows.remove(req);
                self.pool.release(req);
            }
            // The worker holds it already: it ends there (pulled, failed or
            // its lease ended), never by a withdrawal after it was ready.
            Some(Flow::Sending(send)) if send.given => {
                tracing::warn!(req_id = %req, "forget update for a request already staged; it ends with its pull or lease");
                return;
            }
            // The copy reads blocks the engine freed: its slots come back when it is done.
            Some(Flow::Sending(send)) => {
                send.forgotten = true;
                self.settle_send(req, step);
            }
            _ => {}
        }
        step.to_worker.reqs_to_send.insert(req.clone(), SendUpdate::Forget);
    }

    fn fail_send(&mut self, req: &ReqId, step: &mut StagedStep) {
        step.to_worker.reqs_to_send.remove(req);
        step.fail_sends.push((req.clone(), FailureCause::StagingExhausted));
        // The engine frees its blocks; the worker answers its pull failed.
        step.finished.sending.insert(req.clone());
    }

    fn stage_recv(&mut self, req: &ReqId, meta: &RecvReqMeta, now: Instant, step: &mut StagedStep) {
        if self.flows.contains_key(req) {
            tracing::warn!(req_id = %req, "pull requested again while it is being staged; ignored");
            return;
        }
        if meta.local_block_ids.is_empty() {
            // Nothing lands (notify-only): no slots, nothing to copy.
            step.to_worker.reqs_to_recv.insert(req.clone(), meta.clone());
            return;
        }
        match self.pool.reserve(req, meta.local_block_ids.len(), now, self.wait) {
            Reservation::Granted(slots) => self.start_pull(req, meta, slots, step),
            Reservation::Waiting => {
                self.counts.waits += 1;
                // Still wanted: P keeps holding it while it waits here.
                step.to_worker.reqs_to_unwatch.remove(req);
                step.to_worker.reqs_to_watch.insert(req.clone(), meta.remote.clone());
                self.flows.insert(req.clone(), Flow::RecvWaiting { meta: meta.clone() });
            }
            Reservation::TooLarge { wanted, capacity } => {
                tracing::warn!(req_id = %req, wanted, capacity, "pull needs more staging slots than there are; it fails");
                self.counts.exhausted += 1;
                self.fail_before_pull(req, meta, step);
            }
            Reservation::Duplicate => {}
        }
    }

    /// D: the pull fails without starting; P hears it at once (a pull of
    /// no blocks frees the request there, as for a full prefix hit).
    fn fail_before_pull(&mut self, req: &ReqId, meta: &RecvReqMeta, step: &mut StagedStep) {
        step.to_worker.reqs_to_watch.remove(req);
        step.to_worker.reqs_to_unwatch.insert(req.clone());
        step.failed_before_pull.push(req.clone());
        step.release_on_prefill.insert(req.clone(), meta.remote.clone());
        step.finished.failed_receiving.insert(req.clone(), meta.local_block_ids.clone());
    }

    fn start_pull(&mut self, req: &ReqId, meta: &RecvReqMeta, slots: Vec<BlockId>, step: &mut StagedStep) {
        let staged =
            RecvReqMeta { local_block_ids: slots.clone(), first_token: meta.first_token, remote: meta.remote.clone() };
        step.to_worker.reqs_to_watch.remove(req);
        step.to_worker.reqs_to_recv.insert(req.clone(), staged);
        let recv = Recv {
            device: meta.local_block_ids.clone(),
            slots,
            ordered: 0,
            running: BTreeSet::new(),
            verdict: Verdict::Pending,
            told: false,
            fenced: false,
            landed: false,
            copy_failed: false,
            cancelled: false,
        };
        self.flows.insert(req.clone(), Flow::Pulling(recv));
    }

    fn cancel_recv(&mut self, req: &ReqId, step: &mut StagedStep) {
        step.to_worker.reqs_to_cancel.insert(req.clone());
        match self.flows.get_mut(req) {
            Some(Flow::RecvWaiting { .. }) => {
                self.flows.remove(req);
                self.pool.release(req);
                step.to_worker.reqs_to_watch.remove(req);
                step.to_worker.reqs_to_unwatch.insert(req.clone());
            }
            Some(Flow::Pulling(recv)) => {
                recv.cancelled = true;
                // The worker fences a pull still out before `start_load_kv`
                // returns, and never reports it.
                recv.fenced = true;
                step.wait_for.extend(recv.running.iter().copied());
                self.settle_recv(req, step);
            }
            _ => {}
        }
    }

    /// Grants slots to waiters that fit now, and fails those whose wait
    /// ended at `now`.
    fn grant_waiters(&mut self, now: Instant, step: &mut StagedStep) {
        let events = self.pool.poll(now);
        for (req, slots) in events.granted {
            match self.flows.remove(&req) {
                Some(Flow::SendWaiting { device }) => self.start_send(&req, &device, slots, step),
                Some(Flow::RecvWaiting { meta }) => self.start_pull(&req, &meta, slots, step),
                other => {
                    // Not waiting any more (cannot happen: release removes waiters).
                    if let Some(flow) = other {
                        self.flows.insert(req.clone(), flow);
                    }
                    self.pool.release(&req);
                }
            }
        }
        for req in events.expired {
            match self.flows.remove(&req) {
                Some(Flow::SendWaiting { .. }) => {
                    tracing::warn!(req_id = %req, wait = ?self.wait, "no staging slots for the request within the bound; its pull will fail");
                    self.counts.exhausted += 1;
                    self.fail_send(&req, step);
                }
                Some(Flow::RecvWaiting { meta }) => {
                    tracing::warn!(req_id = %req, wait = ?self.wait, "no staging slots for the pull within the bound; it fails");
                    self.counts.exhausted += 1;
                    self.fail_before_pull(&req, &meta, step);
                }
                Some(other) => {
                    self.flows.insert(req, other);
                }
                None => {}
            }
        }
    }

    fn order(
        &mut self,
        req: &ReqId,
        direction: CopyDirection,
        device: &[BlockId],
        slots: &[BlockId],
        step: &mut StagedStep,
    ) -> u64 {
        let id = self.next_copy;
        self.next_copy += 1;
        self.copies.insert(id, req.clone());
        let pairs = device.iter().copied().zip(slots.iter().copied()).collect();
        step.copies.push(CopyOrder { id, req: req.clone(), direction, pairs });
        id
    }
}

/// Requests of a step by stage, for logs and tests.
pub fn stages(core: &StagingCore) -> BTreeMap<&'static str, BTreeSet<ReqId>> {
    let mut out: BTreeMap<&'static str, BTreeSet<ReqId>> = BTreeMap::new();
    for (req, flow) in &core.flows {
        let stage = match flow {
            Flow::SendWaiting { .. } => "send_waiting",
            Flow::Sending(send) if send.copying() => "send_copying",
            Flow::Sending(_) => "send_staged",
            Flow::RecvWaiting { .. } => "recv_waiting",
            Flow::Pulling(recv) if recv.running.is_empty() && !recv.fenced => "pulling",
            Flow::Pulling(_) => "recv_copying",
        };
        out.entry(stage).or_default().insert(req.clone());
    }
    out
}
