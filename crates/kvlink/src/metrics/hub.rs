//! The workers one metrics endpoint shows: each exposed worker is read at
//! scrape time ([`kv_worker::Worker::metrics`]); what a worker counted is
//! kept when it shuts down, under its role and engine id, so totals only go
//! up while workers come and go.
//!
//! The hub holds workers weakly and reads them only under its lock, and a
//! worker leaves the hub (its [`Exposed`] dropped) before its owner shuts it
//! down: once that drop returns, no scrape holds the worker, and the owner
//! gets it back whole (`Arc::try_unwrap`) to shut it down.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use kv_proto::KvRole;
use kv_worker::metrics::Family;
use kv_worker::Worker;
use tokio::sync::watch;

use super::totals;

/// The labels every sample of a worker carries, besides its family's own.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct WorkerLabels {
    /// `prefill`, `decode` or `both`.
    pub role: &'static str,
    /// The worker's engine id.
    pub engine_id: String,
}

impl WorkerLabels {
    /// The labels of a worker of `role` in engine `engine_id`.
    pub fn new(role: KvRole, engine_id: &str) -> Self {
        let role = match role {
            KvRole::Producer => "prefill",
            KvRole::Consumer => "decode",
            KvRole::Both => "both",
        };
        Self { role, engine_id: engine_id.to_owned() }
    }
}

/// A worker being shown.
#[derive(Debug)]
struct Live {
    id: u64,
    labels: WorkerLabels,
    worker: Weak<Worker>,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    live: Vec<Live>,
    /// What workers that are gone counted, by labels.
    retired: Vec<(WorkerLabels, Vec<Family>)>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    /// How many workers were exposed so far (for a caller that announces
    /// the endpoint once its workers are up).
    exposed: watch::Sender<usize>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves counts, not
        // broken invariants: go on with them.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The workers one endpoint shows. Cheap to clone (one shared list).
#[derive(Clone, Debug)]
pub struct MetricsHub {
    inner: Arc<Inner>,
}

impl Default for MetricsHub {
    fn default() -> Self {
        Self::new()
    }
}

impl MetricsHub {
    /// An empty hub.
    pub fn new() -> Self {
        let (exposed, _) = watch::channel(0);
        Self { inner: Arc::new(Inner { state: Mutex::default(), exposed }) }
    }

    /// Shows `worker` (of `role`, in engine `engine_id`) until the returned
    /// guard is dropped; then what it counted is kept.
    pub fn expose(&self, worker: &Arc<Worker>, role: KvRole, engine_id: &str) -> Exposed {
        let id = {
            let mut state = self.inner.lock();
            let id = state.next_id;
            state.next_id += 1;
            state.live.push(Live { id, labels: WorkerLabels::new(role, engine_id), worker: Arc::downgrade(worker) });
            id
        };
        self.inner.exposed.send_modify(|n| *n += 1);
        Exposed { id, hub: Arc::downgrade(&self.inner) }
    }

    /// Counts the workers exposed so far (it never goes down).
    pub fn exposed(&self) -> watch::Receiver<usize> {
        self.inner.exposed.subscribe()
    }

    /// Every worker's families now, by labels (sorted): what retired
    /// workers of those labels counted plus what live ones count.
    pub fn families(&self) -> Vec<(WorkerLabels, Vec<Family>)> {
        let state = self.inner.lock();
        let mut out = state.retired.clone();
        for live in &state.live {
            // Read under the lock: see the module comment.
            let Some(worker) = live.worker.upgrade() else { continue };
            let families = worker.metrics().families();
            drop(worker);
            match out.iter_mut().find(|(labels, _)| *labels == live.labels) {
                Some((_, totals)) => totals::add(totals, &families),
                None => out.push((live.labels.clone(), families)),
            }
        }
        drop(state);
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// A worker shown by a [`MetricsHub`]; dropping it takes the worker off
/// the hub and keeps what it counted. Drop it before the worker.
#[derive(Debug)]
pub struct Exposed {
    id: u64,
    hub: Weak<Inner>,
}

impl Drop for Exposed {
    fn drop(&mut self) {
        let Some(hub) = self.hub.upgrade() else { return };
        let mut state = hub.lock();
        let Some(at) = state.live.iter().position(|live| live.id == self.id) else { return };
        let live = state.live.swap_remove(at);
        // A worker dropped before its guard took its last counts with it.
        let Some(worker) = live.worker.upgrade() else { return };
        let last = totals::retired(worker.metrics().families());
        drop(worker);
        match state.retired.iter_mut().find(|(labels, _)| *labels == live.labels) {
            Some((_, kept)) => totals::add(kept, &last),
            None => state.retired.push((live.labels, last)),
        }
    }
}
