//! [`StagedWorker`]: a [`Worker`] over staging memory with a
//! [`StagingCore`] in front, for an engine whose KV cache the transport
//! cannot reach (a GPU cache): the engine talks in its own block ids and
//! runs the copies the core orders; the worker moves staging slots.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_proto::{ConnectorMetadata, FailureCause, ReqId};

use super::flow::{CopyOrder, StagedStep, StagingCore};
use crate::metrics::StagingFigures;
use crate::worker::{Finished, Worker};

/// What the engine must do after a call: start these copies, and finish
/// (and report done) those in `wait_for` before freeing any block of the
/// requests it just cancelled.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CopyWork {
    /// Copies to start now.
    pub copies: Vec<CopyOrder>,
    /// Copies to finish before this step's cancelled blocks are freed.
    pub wait_for: Vec<u64>,
}

impl CopyWork {
    /// Adds `more`'s copies and waits after these.
    fn append(&mut self, more: CopyWork) {
        self.copies.extend(more.copies);
        self.wait_for.extend(more.wait_for);
    }
}

/// A worker whose registered cache is host staging memory of `slots`
/// blocks, shaped like the engine's cache.
pub struct StagedWorker {
    worker: Worker,
    core: Mutex<StagingCore>,
    /// What the engine hears at its next [`StagedWorker::get_finished`].
    pending: Mutex<Finished>,
}

impl StagedWorker {
    /// Stages through `worker`'s cache (its blocks are the slots); a request
    /// waits at most `wait` for slots. With the worker's
    /// [`crate::WorkerConfig::piece_bytes`] set, requests are copied in
    /// pieces, and each piece of a pull is copied on as it lands.
    pub fn new(worker: Worker, wait: Duration) -> Self {
        let slots = u32::try_from(worker.cache().num_blocks()).unwrap_or(u32::MAX);
        let core = StagingCore::new(slots, wait).with_pieces(worker.piece_blocks());
        // A pull counts received once its copy into the engine's blocks is
        // done, and its pieces are copied on as they land.
        worker.stage_pulls();
        let staged = Self { worker, core: Mutex::new(core), pending: Mutex::new(Finished::default()) };
        staged.publish(&staged.lock_core());
        staged
    }

    /// The worker moving the slots.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// One step's metadata, in the engine's block ids. Returns once the
    /// step's cancelled pulls are fenced on the wire (the copies in
    /// `wait_for` remain the engine's to finish).
    pub fn start_load_kv(&self, meta: &ConnectorMetadata) -> CopyWork {
        let mut core = self.lock_core();
        let step = core.start_load_kv(meta, Instant::now());
        self.apply(&mut core, step)
    }

    /// The engine finished these copies.
    pub fn copies_done(&self, ids: impl IntoIterator<Item = u64>) -> CopyWork {
        let mut core = self.lock_core();
        let step = core.copies_done(ids, Instant::now());
        self.apply(&mut core, step)
    }

    /// These copies failed (the engine could not run them): their requests
    /// fail cleanly (`copy_failed`), and every slot comes back. A pull
    /// still out is fenced before this returns (P stops writing it).
    pub fn copies_failed(&self, ids: impl IntoIterator<Item = u64>) -> CopyWork {
        let mut core = self.lock_core();
        let step = core.copies_failed(ids, Instant::now());
        self.apply(&mut core, step)
    }

    /// What finished since the last call, in the engine's block ids, and
    /// the copies that became due.
    pub fn get_finished(&self) -> (Finished, CopyWork) {
        let mut core = self.lock_core();
        // Pulls waiting for requests staged ahead go first.
        let pulled = self.worker.take_pulled();
        let step = core.pulls_arrived(pulled, Instant::now());
        let mut work = self.apply(&mut core, step);
        // Progress first: P said it before the report of the same pull.
        let progress = self.worker.take_progress();
        let from_worker = self.worker.finished_by_name();
        let step = core.worker_progress(progress);
        work.append(self.apply(&mut core, step));
        let step = core.worker_finished(from_worker, Instant::now());
        work.append(self.apply(&mut core, step));
        drop(core);
        let finished = std::mem::take(&mut *self.lock_pending());
        (self.worker.for_engine(finished), work)
    }

    /// Stops the worker (see [`Worker::shutdown`]).
    pub async fn shutdown(self) {
        self.worker.shutdown().await;
    }

    /// Requests in any stage of staging, and the slots free now.
    pub fn staging_state(&self) -> (usize, usize) {
        let core = self.lock_core();
        (core.len(), core.pool().free())
    }

    fn apply(&self, core: &mut StagingCore, step: StagedStep) -> CopyWork {
        let StagedStep {
            to_worker,
            staged_sends,
            fail_sends,
            failed_before_pull,
            release_on_prefill,
            fail_pulls,
            settled,
            copies,
            wait_for,
            finished,
        } = step;
        let mut by_cause: BTreeMap<FailureCause, Vec<ReqId>> = BTreeMap::new();
        for (req, cause) in fail_sends {
            by_cause.entry(cause).or_default().push(req);
        }
        for (cause, reqs) in &by_cause {
            self.worker.fail_sends(reqs, *cause);
        }
        if !failed_before_pull.is_empty() {
            self.worker.count_failed_pulls(&failed_before_pull, FailureCause::StagingExhausted);
        }
        if !fail_pulls.is_empty() {
            // Fenced first: this step may hand their slots to other pulls.
            self.worker.fail_pulls(&fail_pulls);
        }
        if to_worker != ConnectorMetadata::default() {
            self.worker.start_load_kv(&to_worker);
        }
        self.worker.stage_sends(&staged_sends);
        self.worker.release_on_prefill(&release_on_prefill);
        for (req, how) in &settled {
            self.worker.settle_landed(req, *how);
        }
        let mut pending = self.lock_pending();
        pending.sending.extend(finished.sending);
        pending.receiving.extend(finished.receiving);
        pending.failed_receiving.extend(finished.failed_receiving);
        drop(pending);
        self.publish(core);
        CopyWork { copies, wait_for }
    }

    /// Staging's figures, for the worker's metrics.
    fn publish(&self, core: &StagingCore) {
        let counts = core.counts();
        let pool = core.pool();
        self.worker.publish_staging(StagingFigures {
            slots: pool.capacity() as u64,
            free_slots: pool.free() as u64,
            requests: core.len() as u64,
            waiting: pool.waiting() as u64,
            waits: counts.waits,
            exhausted: counts.exhausted,
            copies_failed_to_staging: counts.copies_failed_to_staging,
            copies_failed_to_device: counts.copies_failed_to_device,
        });
    }

    fn lock_core(&self) -> MutexGuard<'_, StagingCore> {
        self.core.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_pending(&self) -> MutexGuard<'_, Finished> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl std::fmt::Debug for StagedWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedWorker").field("worker", &self.worker).finish_non_exhaustive()
    }
}
