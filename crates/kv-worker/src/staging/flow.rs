//! A device cache's KV through host staging (sans-IO): which request holds
//! which slots, which copies the engine must run between its device blocks
//! and the slots, and what the worker and the engine hear when.
//!
//! The worker only ever sees staging slots (its registered cache is the
//! staging memory); the engine only ever hears of its own device blocks.
//!
//! - **P**: a request finished with its KV on the device is copied into
//!   slots ([`CopyOrder`] `ToStaging`); once the engine says the copy is
//!   done, the worker gets it ready to send from the slots and the engine
//!   hears it finished sending (its device blocks are free at once: the
//!   slots now hold its KV for the pull). The slots come back when the
//!   worker is done with it (sent, failed, lease ended).
//! - **D**: a pull gets slots before it starts; the worker pulls into them,
//!   then, once its grant is fenced and it reports the pull received, the
//!   engine copies the slots into its blocks (`ToDevice`); only when that
//!   copy is done does the engine hear the request received. A failed pull
//!   is reported failed with the device blocks at once.
//! - A request that finds no free slots waits, at most the pool's bound,
//!   then fails cleanly: on P its pull is answered `staging_exhausted` and
//!   its blocks freed, on D it is reported failed (the engine recomputes).
//! - A pull the engine cancels while its slots are being copied to the
//!   device is one the engine must wait for before it frees the blocks
//!   ([`StagedStep::wait_for`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kv_proto::{BlockId, ConnectorMetadata, RecvReqMeta, ReqId, SendUpdate};

use super::pool::{Reservation, StagingPool};
use crate::worker::Finished;

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyDirection {
    /// Device blocks into staging slots (P).
    ToStaging,
    /// Staging slots into device blocks (D).
    ToDevice,
}

/// A copy the engine runs between its blocks and the staging slots, and
/// reports done with [`StagingCore::copies_done`].
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

/// What one call of the core asks of its driver.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StagedStep {
    /// Metadata for [`crate::Worker::start_load_kv`] (staging slots for block ids).
    pub to_worker: ConnectorMetadata,
    /// P: requests the worker must fail ([`crate::Worker::fail_sends`],
    /// `staging_exhausted`): no slots within the bound.
    pub fail_sends: Vec<ReqId>,
    /// D: pulls that failed before they started (no slots within the
    /// bound), for the worker's failure count.
    pub failed_before_pull: Vec<ReqId>,
    /// Copies the engine starts now.
    pub copies: Vec<CopyOrder>,
    /// Copies the engine must finish (and report done) before it frees the
    /// blocks of the requests it just cancelled.
    pub wait_for: Vec<u64>,
    /// What the engine hears, in its own block ids.
    pub finished: Finished,
}

#[derive(Debug)]
enum Flow {
    /// P: waiting for slots to copy `device` into.
    SendWaiting { device: Vec<BlockId> },
    /// P: being copied into its slots.
    SendCopying { forgotten: bool },
    /// P: in its slots; the worker has it.
    SendStaged,
    /// D: waiting for slots to pull into.
    RecvWaiting { meta: RecvReqMeta },
    /// D: being pulled into its slots.
    Pulling { device: Vec<BlockId> },
    /// D: pulled; its slots being copied into its device blocks.
    RecvCopying { copy: u64, cancelled: bool },
}

/// The staging bookkeeping of one worker, driven with explicit time.
#[derive(Debug)]
pub struct StagingCore {
    pool: StagingPool,
    wait: Duration,
    flows: HashMap<ReqId, Flow>,
    copies: HashMap<u64, ReqId>,
    next_copy: u64,
}

impl StagingCore {
    /// `slots` staging slots; a request waits at most `wait` for its own.
    pub fn new(slots: u32, wait: Duration) -> Self {
        Self { pool: StagingPool::new(slots), wait, flows: HashMap::new(), copies: HashMap::new(), next_copy: 1 }
    }

    /// One step's metadata from the engine (device block ids).
    pub fn start_load_kv(&mut self, meta: &ConnectorMetadata, now: Instant) -> StagedStep {
        let mut step = StagedStep::default();
        step.to_worker.reqs_to_watch = meta.reqs_to_watch.clone();
        step.to_worker.reqs_to_unwatch = meta.reqs_to_unwatch.clone();
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
        let mut step = StagedStep::default();
        for id in ids {
            let Some(req) = self.copies.remove(&id) else { continue };
            match self.flows.remove(&req) {
                Some(Flow::SendCopying { forgotten: false, .. }) => {
                    let slots = self.pool.slots_of(&req).map(<[BlockId]>::to_vec).unwrap_or_default();
                    step.to_worker.reqs_to_send.insert(req.clone(), SendUpdate::Ready { block_ids: slots });
                    // Its KV is in the slots: the device blocks are free now.
                    step.finished.sending.insert(req.clone());
                    self.flows.insert(req, Flow::SendStaged);
                }
                Some(Flow::SendCopying { forgotten: true, .. }) => {
                    self.pool.release(&req);
                }
                Some(Flow::RecvCopying { cancelled, .. }) => {
                    self.pool.release(&req);
                    if !cancelled {
                        step.finished.receiving.insert(req);
                    }
                }
                Some(other) => {
                    self.flows.insert(req, other);
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
            // Reported to the engine when its copy was done.
            if matches!(self.flows.remove(&req), Some(Flow::SendStaged)) {
                self.pool.release(&req);
            }
        }
        for req in finished.receiving {
            match self.flows.remove(&req) {
                Some(Flow::Pulling { device }) => {
                    let slots = self.pool.slots_of(&req).map(<[BlockId]>::to_vec).unwrap_or_default();
                    let copy = self.order(&req, CopyDirection::ToDevice, &device, &slots, &mut step);
                    self.flows.insert(req, Flow::RecvCopying { copy, cancelled: false });
                }
                Some(other) => {
                    self.flows.insert(req, other);
                }
                None => {}
            }
        }
        for (req, _) in finished.failed_receiving {
            if let Some(Flow::Pulling { device }) = self.flows.remove(&req) {
                self.pool.release(&req);
                step.finished.failed_receiving.insert(req, device);
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

    /// Requests in any stage of staging.
    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// Whether no request is being staged.
    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }

    fn stage_send(&mut self, req: &ReqId, device: &[BlockId], now: Instant, step: &mut StagedStep) {
        if self.flows.contains_key(req) {
            tracing::warn!(req_id = %req, "ready update for a request already being staged; ignored");
            return;
        }
        // D may ask before the copy is done: the worker holds its pull.
        step.to_worker.reqs_to_send.insert(req.clone(), SendUpdate::Expect);
        match self.pool.reserve(req, device.len(), now, self.wait) {
            Reservation::Granted(slots) => {
                self.order(req, CopyDirection::ToStaging, device, &slots, step);
                self.flows.insert(req.clone(), Flow::SendCopying { forgotten: false });
            }
            Reservation::Waiting => {
                self.flows.insert(req.clone(), Flow::SendWaiting { device: device.to_vec() });
            }
            Reservation::TooLarge { wanted, capacity } => {
                tracing::warn!(req_id = %req, wanted, capacity, "request needs more staging slots than there are; its pull will fail");
                self.fail_send(req, step);
            }
            Reservation::Duplicate => {}
        }
    }

    fn forget_send(&mut self, req: &ReqId, step: &mut StagedStep) {
        step.to_worker.reqs_to_send.insert(req.clone(), SendUpdate::Forget);
        match self.flows.get_mut(req) {
            Some(Flow::SendWaiting { .. }) => {
                self.flows.remove(req);
                self.pool.release(req);
            }
            // The copy reads blocks the engine freed: its slots come back when it is done.
            Some(Flow::SendCopying { forgotten, .. }) => *forgotten = true,
            _ => {}
        }
    }

    fn fail_send(&mut self, req: &ReqId, step: &mut StagedStep) {
        step.to_worker.reqs_to_send.remove(req);
        step.fail_sends.push(req.clone());
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
                // Still wanted: P keeps holding it while it waits here.
                step.to_worker.reqs_to_unwatch.remove(req);
                step.to_worker.reqs_to_watch.insert(req.clone(), meta.remote.clone());
                self.flows.insert(req.clone(), Flow::RecvWaiting { meta: meta.clone() });
            }
            Reservation::TooLarge { wanted, capacity } => {
                tracing::warn!(req_id = %req, wanted, capacity, "pull needs more staging slots than there are; it fails");
                step.failed_before_pull.push(req.clone());
                step.finished.failed_receiving.insert(req.clone(), meta.local_block_ids.clone());
            }
            Reservation::Duplicate => {}
        }
    }

    fn start_pull(&mut self, req: &ReqId, meta: &RecvReqMeta, slots: Vec<BlockId>, step: &mut StagedStep) {
        let staged = RecvReqMeta { local_block_ids: slots, remote: meta.remote.clone() };
        step.to_worker.reqs_to_watch.remove(req);
        step.to_worker.reqs_to_recv.insert(req.clone(), staged);
        self.flows.insert(req.clone(), Flow::Pulling { device: meta.local_block_ids.clone() });
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
            // The worker fences its grant before `start_load_kv` returns;
            // its slots are free once it has.
            Some(Flow::Pulling { .. }) => {
                self.flows.remove(req);
                self.pool.release(req);
            }
            Some(Flow::RecvCopying { copy, cancelled, .. }) => {
                *cancelled = true;
                step.wait_for.push(*copy);
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
                Some(Flow::SendWaiting { device }) => {
                    self.order(&req, CopyDirection::ToStaging, &device, &slots, step);
                    self.flows.insert(req, Flow::SendCopying { forgotten: false });
                }
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
                    self.fail_send(&req, step);
                }
                Some(Flow::RecvWaiting { meta }) => {
                    tracing::warn!(req_id = %req, wait = ?self.wait, "no staging slots for the pull within the bound; it fails");
                    step.to_worker.reqs_to_watch.remove(&req);
                    step.to_worker.reqs_to_unwatch.insert(req.clone());
                    step.failed_before_pull.push(req.clone());
                    step.finished.failed_receiving.insert(req, meta.local_block_ids);
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
            Flow::SendCopying { .. } => "send_copying",
            Flow::SendStaged => "send_staged",
            Flow::RecvWaiting { .. } => "recv_waiting",
            Flow::Pulling { .. } => "pulling",
            Flow::RecvCopying { .. } => "recv_copying",
        };
        out.entry(stage).or_default().insert(req.clone());
    }
    out
}
