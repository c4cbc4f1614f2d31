//! [`StagedWorker`]: a [`Worker`] over staging memory with a
//! [`StagingCore`] in front, for an engine whose KV cache the transport
//! cannot reach (a GPU cache): the engine talks in its own block ids and
//! runs the copies the core orders; the worker moves staging slots.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kv_proto::{ConnectorMetadata, FailureCause};

use super::flow::{CopyOrder, StagedStep, StagingCore};
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
    /// waits at most `wait` for slots.
    pub fn new(worker: Worker, wait: Duration) -> Self {
        let slots = u32::try_from(worker.cache().num_blocks()).unwrap_or(u32::MAX);
        Self { worker, core: Mutex::new(StagingCore::new(slots, wait)), pending: Mutex::new(Finished::default()) }
    }

    /// The worker moving the slots.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// One step's metadata, in the engine's block ids. Returns once the
    /// step's cancelled pulls are fenced on the wire (the copies in
    /// `wait_for` remain the engine's to finish).
    pub fn start_load_kv(&self, meta: &ConnectorMetadata) -> CopyWork {
        let step = self.lock_core().start_load_kv(meta, Instant::now());
        self.apply(step)
    }

    /// The engine finished these copies.
    pub fn copies_done(&self, ids: impl IntoIterator<Item = u64>) -> CopyWork {
        let step = self.lock_core().copies_done(ids, Instant::now());
        self.apply(step)
    }

    /// What finished since the last call, in the engine's block ids, and
    /// the copies that became due.
    pub fn get_finished(&self) -> (Finished, CopyWork) {
        let from_worker = self.worker.get_finished();
        let step = self.lock_core().worker_finished(from_worker, Instant::now());
        let work = self.apply(step);
        let finished = std::mem::take(&mut *self.lock_pending());
        (finished, work)
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

    fn apply(&self, step: StagedStep) -> CopyWork {
        let StagedStep { to_worker, fail_sends, failed_before_pull, copies, wait_for, finished } = step;
        if !fail_sends.is_empty() {
            self.worker.fail_sends(&fail_sends, FailureCause::StagingExhausted);
        }
        if !failed_before_pull.is_empty() {
            self.worker.count_failed_pulls(&failed_before_pull, FailureCause::StagingExhausted);
        }
        if to_worker != ConnectorMetadata::default() {
            self.worker.start_load_kv(&to_worker);
        }
        let mut pending = self.lock_pending();
        pending.sending.extend(finished.sending);
        pending.receiving.extend(finished.receiving);
        pending.failed_receiving.extend(finished.failed_receiving);
        CopyWork { copies, wait_for }
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
