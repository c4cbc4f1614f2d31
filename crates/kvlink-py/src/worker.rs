//! The worker side for Python: one kv-worker over the engine's KV cache,
//! or over host staging in front of it.
//!
//! Python objects are touched only by the calling Python thread: the
//! runtime's tasks see plain integers (addresses, lengths, block ids) and
//! owned Rust values. Calls that may wait release the GIL.
//!
//! **Staged** (`staged=True`): the registered memory is host staging the
//! caller allocated, one region per region of the engine's cache with the
//! same block length and as many blocks as there are slots; kv-worker's
//! `StagedWorker` decides which request holds which slots and which copies
//! the engine runs between its blocks and the slots. The copies are the
//! caller's (`kvlink_vllm.staging`): every call queues the copies it
//! ordered for [`PyWorker::take_copies`], the caller runs them and reports
//! them with [`PyWorker::copies_done`]. The worker stays device-agnostic:
//! it registers, grants and writes staging memory only.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kv_proto::{BlockId, LayoutKind, ReqId, TokenLayout};
use kv_worker::staging::{CopyDirection, CopyOrder, CopyWork};
use kv_worker::Finished;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::engine::{self, BlockHeads, Engine, Placement, TensorDesc};
use crate::error::{Error, Result};
use crate::metrics::{self, Intervals};
use crate::runtime;
use crate::settings::PySettings;
use crate::step::{AbandonedPulls, Envelope, ReportFilter};

/// Bound on stopping a worker (its tasks are cancelled, then the transport closes).
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest one `wait_changed` blocks.
const MAX_CHANGE_WAIT: Duration = Duration::from_secs(60);

/// One tensor as `(address, bytes, blocks, tokens per block)`.
type TensorTuple = (u64, u64, u64, u32);

/// One copy order as Python sees it: `(id, request, "to_staging" |
/// "to_device", [(engine block, slot), ...])`.
type CopyTuple = (u64, String, &'static str, Vec<(BlockId, BlockId)>);

fn copy_tuple(order: CopyOrder) -> CopyTuple {
    let direction = match order.direction {
        CopyDirection::ToStaging => "to_staging",
        CopyDirection::ToDevice => "to_device",
    };
    (order.id, order.req.as_str().to_owned(), direction, order.pairs)
}

fn merge(into: &mut Finished, from: Finished) {
    into.sending.extend(from.sending);
    into.receiving.extend(from.receiving);
    into.failed_receiving.extend(from.failed_receiving);
}

struct Running {
    engine: Engine,
    filter: ReportFilter,
    /// Staged: copies ordered and not yet taken by [`PyWorker::take_copies`].
    copies: Vec<CopyOrder>,
    /// Staged: what [`PyWorker::pump`] collected for the engine's next
    /// `get_finished`.
    stash: Finished,
    /// What `metrics_since_last` reported last.
    intervals: Intervals,
    /// The Python objects owning the registered memory (vLLM's tensors),
    /// released only once no transfer can touch that memory any more.
    keepalive: Py<PyAny>,
}

impl Running {
    /// Queues the copies of `work`; returns what must be finished now.
    fn queue(&mut self, work: CopyWork) -> Vec<u64> {
        self.copies.extend(work.copies);
        work.wait_for
    }

    /// Stops the engine; releases the memory's owners only if it stopped.
    fn stop(self) -> bool {
        let Running { engine, keepalive, .. } = self;
        match engine.shutdown(SHUTDOWN_TIMEOUT) {
            Ok(()) => {
                drop(keepalive);
                true
            }
            Err(()) => {
                tracing::error!(
                    timeout = ?SHUTDOWN_TIMEOUT,
                    "kvlink worker did not stop in time; its KV cache memory is kept alive for the rest of the process"
                );
                std::mem::forget(keepalive);
                false
            }
        }
    }
}

fn layout_kind(name: &str) -> Result<LayoutKind> {
    match name {
        "split" => Ok(LayoutKind::SplitKv),
        "fused" => Ok(LayoutKind::Fused),
        "mla" => Ok(LayoutKind::Mla),
        "fused_rows" => Ok(LayoutKind::FusedRows),
        other => Err(Error::Config(format!(
            "unknown KV cache layout {other:?}; expected \"split\", \"fused\", \"fused_rows\" or \"mla\""
        ))),
    }
}

/// The worker-side connector of one model worker.
///
/// Constructing it registers raw memory: each tensor is passed as integers
/// `(address, bytes, blocks, tokens per block)`. The contract (kept by
/// `kvlink_vllm`, which is the intended caller): every address range lies
/// in memory owned by objects reachable from `keepalive`, which this worker
/// holds until it is shut down, and nothing frees, moves or resizes that
/// memory meanwhile. Blocks are read by peers only after vLLM finished
/// writing them, and written only into blocks vLLM allocated for a pull.
/// Staged, the memory is the staging, and the caller copies a slot only as
/// ordered (into slots before they are reported done, out of them after).
#[pyclass(name = "Worker", module = "kvlink_vllm._native", frozen)]
pub(crate) struct PyWorker {
    /// The process that started it.
    pid: u32,
    state: Mutex<Option<Running>>,
    /// The worker's change signal, outside `state`'s lock: a thread waits
    /// on it while the engine's calls go on.
    changes: Arc<kv_worker::Changes>,
    side_channel_port: Option<u16>,
    data_endpoint: String,
}

impl PyWorker {
    /// The running state, after checking this is the starting process.
    fn running(&self) -> Result<MutexGuard<'_, Option<Running>>> {
        runtime::check_pid(self.pid)?;
        Ok(self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

#[pymethods]
impl PyWorker {
    /// Starts the worker: binds its listeners and registers the cache.
    #[new]
    ///
    /// `report_abandoned_pulls`: whether vLLM waits to hear of a pull whose
    /// request it finished while the pull was in flight (it then holds the
    /// request's blocks until the pull is reported, after its fence);
    /// `kvlink_vllm.versions` decides it per vLLM release.
    ///
    /// `staged`: `layers` describe host staging (one region per region of
    /// the engine's cache, as many blocks as slots), not the engine's cache.
    ///
    /// `identity`: JSON of what must agree with the peer instance (kv-proto's
    /// `ModelIdentity`: model, dtypes, shape, topology, versions), sent in
    /// D's hello and compared by P; fields left empty or 0 are not compared.
    ///
    /// `pp_size`, `pp_rank`: the pipeline stage this worker holds the
    /// layers of. `block_heads`, `token_layout` (`"NHD"` or `"HND"`) and
    /// `dtype_bytes`: how a block holds its heads, so P and D of other
    /// tensor-parallel or block sizes can map heads and tokens (0 or `""`:
    /// undeclared, blocks only copy whole between equal layouts).
    #[pyo3(signature = (settings, default_host, layout, block_size, layers, keepalive, dp_rank = 0, tp_size = 1, tp_rank = 0, report_abandoned_pulls = false, staged = false, identity = None, pp_size = 1, pp_rank = 0, block_heads = 0, token_layout = "", dtype_bytes = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        settings: &PySettings,
        default_host: &str,
        layout: &str,
        block_size: u32,
        layers: Vec<(String, Vec<TensorTuple>)>,
        keepalive: Py<PyAny>,
        dp_rank: u16,
        tp_size: u16,
        tp_rank: u16,
        report_abandoned_pulls: bool,
        staged: bool,
        identity: Option<&str>,
        pp_size: u16,
        pp_rank: u16,
        block_heads: u32,
        token_layout: &str,
        dtype_bytes: u32,
    ) -> Result<Self> {
        let rt = runtime::runtime()?;
        let kind = layout_kind(layout)?;
        let order = match token_layout {
            "NHD" => TokenLayout::Nhd,
            "HND" => TokenLayout::Hnd,
            "" => TokenLayout::Undeclared,
            other => return Err(Error::Config(format!("token layout {other:?}: expected \"NHD\", \"HND\" or \"\""))),
        };
        let layers: Vec<(String, Vec<TensorDesc>)> = layers
            .into_iter()
            .map(|(name, tensors)| {
                let tensors = tensors
                    .into_iter()
                    .map(|(addr, len, num_blocks, block_size)| TensorDesc { addr, len, num_blocks, block_size })
                    .collect();
                (name, tensors)
            })
            .collect();
        let heads = BlockHeads { heads: block_heads, order, dtype_bytes };
        let cache = engine::registered_cache(kind, block_size, &layers, heads)?;
        let place = Placement { dp_rank, tp_size, tp_rank, pp_size, pp_rank };
        let mut config = engine::worker_config(settings.inner(), place, default_host)?;
        if let Some(identity) = identity {
            let declared: kv_proto::ModelIdentity = serde_json::from_str(identity)
                .map_err(|e| Error::Config(format!("the engine's model identity does not parse: {e}")))?;
            // kvlink's own version is this build's, whatever the caller says.
            config.identity = kv_proto::ModelIdentity { kvlink_version: config.identity.kvlink_version, ..declared };
        }
        let staging_wait = staged.then(|| settings.inner().transfer.staging_wait.unwrap_or(config.transfer_timeout));
        if staged {
            // Copies and the wire overlap within one request, in pieces.
            config.piece_bytes = settings.inner().transfer.staging_piece_bytes;
        }
        let engine = py.detach(|| {
            // SAFETY: the regions are the tensors owned by `keepalive` (this
            // type's documented contract with its caller); `keepalive` is
            // stored below and released only after `Engine::shutdown`
            // returned `Ok` (see `Running::stop`), else never.
            unsafe { Engine::start(rt, config, cache, staging_wait) }
        })?;
        let side_channel_port = engine.side_channel_port();
        let data_endpoint = engine.data_endpoint();
        let changes = engine.changes();
        let abandoned = if report_abandoned_pulls { AbandonedPulls::Reported } else { AbandonedPulls::Unreported };
        let intervals = Intervals::new(engine.metrics());
        Ok(Self {
            pid: std::process::id(),
            state: Mutex::new(Some(Running {
                engine,
                filter: ReportFilter::new(abandoned),
                copies: Vec::new(),
                stash: Finished::default(),
                intervals,
                keepalive,
            })),
            changes,
            side_channel_port,
            data_endpoint,
        })
    }

    /// Applies one step's metadata (bytes from `Scheduler.build_connector_meta`).
    ///
    /// Returns the ids of the copies the caller must finish, and report with
    /// [`PyWorker::copies_done`], before it returns to the engine (staged: a
    /// pull cancelled while its slots are copied to the engine's blocks;
    /// a copy not started yet may be dropped instead of run). The copies
    /// this step ordered wait in [`PyWorker::take_copies`].
    fn start_load_kv(&self, py: Python<'_>, payload: &[u8]) -> Result<Vec<u64>> {
        runtime::check_pid(self.pid)?;
        let envelope = Envelope::decode(payload)?;
        py.detach(|| {
            let mut guard = self.running()?;
            let running = guard.as_mut().ok_or(Error::ShutDown)?;
            running.filter.started(&envelope);
            // Fences this step's cancelled pulls (on the wire) before it returns.
            let work = running.engine.start_load_kv(&envelope.meta);
            running.filter.cancelled(&envelope.meta.reqs_to_cancel);
            Ok(running.queue(work))
        })
    }

    /// `(finished_sending, finished_recving)` of this step; `finished_req_ids`
    /// is vLLM's list of requests finished since the previous step. Failed
    /// pulls are in `finished_recving`; their blocks in `take_load_errors()`.
    /// Staged: in the engine's block ids, a pull reported once its copy to
    /// the engine's blocks is done; the copies that became due are queued.
    fn get_finished(&self, py: Python<'_>, finished_req_ids: Vec<String>) -> Result<(Vec<String>, Vec<String>)> {
        runtime::check_pid(self.pid)?;
        py.detach(|| {
            let mut guard = self.running()?;
            let running = guard.as_mut().ok_or(Error::ShutDown)?;
            let (mut finished, work) = running.engine.get_finished();
            running.queue(work);
            merge(&mut finished, std::mem::take(&mut running.stash));
            let report = running.filter.report(finished_req_ids.into_iter().map(ReqId::from), finished);
            let names =
                |set: std::collections::BTreeSet<ReqId>| set.into_iter().map(|r| r.as_str().to_owned()).collect();
            Ok((names(report.sending), names(report.recving)))
        })
    }

    /// Staged: the caller finished these copies (ids of
    /// [`PyWorker::take_copies`]); unknown ids are ignored. The copies that
    /// became due (slots freed for waiting requests) are queued.
    fn copies_done(&self, py: Python<'_>, ids: Vec<u64>) -> Result<()> {
        runtime::check_pid(self.pid)?;
        py.detach(|| {
            let mut guard = self.running()?;
            let running = guard.as_mut().ok_or(Error::ShutDown)?;
            let work = running.engine.copies_done(ids);
            running.queue(work);
            Ok(())
        })
    }

    /// Staged: these copies failed (the caller could not run them, or they
    /// ended in an error): their requests fail cleanly (`copy_failed`: P
    /// answers its pull failed and frees its blocks, D reports it failed
    /// once no other copy into its blocks runs); unknown ids are ignored.
    /// The copies that became due are queued.
    fn copies_failed(&self, py: Python<'_>, ids: Vec<u64>) -> Result<()> {
        runtime::check_pid(self.pid)?;
        py.detach(|| {
            let mut guard = self.running()?;
            let running = guard.as_mut().ok_or(Error::ShutDown)?;
            let work = running.engine.copies_failed(ids);
            running.queue(work);
            Ok(())
        })
    }

    /// Staged: what the worker finished since the last call, kept for the
    /// engine's next `get_finished`; slots of finished transfers come back
    /// and waiting requests get them or fail at their bound. Lets a
    /// background thread keep staging moving while the engine does not
    /// step (an idle prefill instance). Without staging it does nothing.
    fn pump(&self, py: Python<'_>) -> Result<()> {
        runtime::check_pid(self.pid)?;
        py.detach(|| {
            let mut guard = self.running()?;
            let running = guard.as_mut().ok_or(Error::ShutDown)?;
            if running.engine.staging_state().is_none() {
                return Ok(());
            }
            let (finished, work) = running.engine.get_finished();
            running.queue(work);
            merge(&mut running.stash, finished);
            Ok(())
        })
    }

    /// Staged: the copies ordered since the last call, as `(id, request,
    /// "to_staging" | "to_device", [(engine block, slot), ...])`, oldest
    /// first. `to_staging`: engine blocks into slots, then `copies_done`
    /// (the slots are sent from then on); `to_device`: slots into engine
    /// blocks, then `copies_done` (the pull is reported received after it).
    fn take_copies(&self) -> Result<Vec<CopyTuple>> {
        let mut guard = self.running()?;
        let running = guard.as_mut().ok_or(Error::ShutDown)?;
        Ok(std::mem::take(&mut running.copies).into_iter().map(copy_tuple).collect())
    }

    /// A count that moves on whenever something becomes available to
    /// `get_finished` or `pump` (a pull or a piece of one landed, a
    /// transfer ended) and at each [`PyWorker::wake`]. Read it before
    /// looking at the worker, then [`PyWorker::wait_changed`] past it.
    #[getter]
    fn change_count(&self) -> Result<u64> {
        runtime::check_pid(self.pid)?;
        Ok(self.changes.count())
    }

    /// Blocks (the GIL released) until the change count is no longer
    /// `seen`, or `timeout_s` seconds passed (at most a minute; a bad
    /// value waits not at all); whether it changed. For a staging thread
    /// between its pumps: a landed piece is copied on at once, not at its
    /// next poll. Works after shutdown too (then only `wake` moves it).
    fn wait_changed(&self, py: Python<'_>, seen: u64, timeout_s: f64) -> Result<bool> {
        runtime::check_pid(self.pid)?;
        let timeout = Duration::try_from_secs_f64(timeout_s).unwrap_or(Duration::ZERO).min(MAX_CHANGE_WAIT);
        Ok(py.detach(|| self.changes.wait_past(seen, timeout)) != seen)
    }

    /// Moves the change count on: wakes a thread in `wait_changed` (the
    /// engine's calls wake the staging thread this way).
    fn wake(&self) -> Result<()> {
        runtime::check_pid(self.pid)?;
        self.changes.signal();
        Ok(())
    }

    /// Staged: `(requests in staging, free slots, slots)`; `None` without staging.
    #[getter]
    fn staging_state(&self) -> Result<Option<(usize, usize, u64)>> {
        let guard = self.running()?;
        Ok(guard.as_ref().and_then(|r| r.engine.staging_state()))
    }

    /// Blocks of the failed pulls reported by `get_finished` since the last call.
    fn take_load_errors(&self) -> Result<Vec<BlockId>> {
        let mut guard = self.running()?;
        let running = guard.as_mut().ok_or(Error::ShutDown)?;
        Ok(running.filter.take_load_errors().into_iter().collect())
    }

    /// Every metric of this worker now, counters and histograms since it
    /// started: a list of family dicts `{"name", "kind", "labels", "help",
    /// "samples"}` (kv-worker's families; see the package's README).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let snapshot = py.detach(|| -> Result<_> {
            let guard = self.running()?;
            Ok(guard.as_ref().ok_or(Error::ShutDown)?.engine.metrics())
        })?;
        metrics::families_to_py(py, &snapshot)
    }

    /// The families of what changed since the previous call (the first
    /// call: since the worker started): counters and histograms as interval
    /// deltas, gauges as they are now. `None` when nothing changed (every
    /// counter, histogram and gauge as at the previous call); the first call
    /// always answers, so every family is known before the first event.
    fn metrics_since_last<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        let delta = py.detach(|| -> Result<_> {
            let mut guard = self.running()?;
            let running = guard.as_mut().ok_or(Error::ShutDown)?;
            let now = running.engine.metrics();
            Ok(running.intervals.next(now))
        })?;
        delta.map(|d| metrics::families_to_py(py, &d)).transpose()
    }

    /// Stops the worker; returns whether it stopped cleanly (if not, the
    /// cache's memory is kept alive for the rest of the process). A second
    /// call does nothing.
    fn shutdown(&self, py: Python<'_>) -> Result<bool> {
        runtime::check_pid(self.pid)?;
        let running = self.running()?.take();
        Ok(match running {
            None => true,
            Some(running) => py.detach(|| running.stop()),
        })
    }

    /// The side-channel port this (prefill) worker listens on.
    #[getter]
    fn side_channel_port(&self) -> Option<u16> {
        self.side_channel_port
    }

    /// The data-plane endpoint peers write to.
    #[getter]
    fn data_endpoint(&self) -> &str {
        &self.data_endpoint
    }

    /// The pid of the process that started this worker.
    #[getter]
    fn pid(&self) -> u32 {
        self.pid
    }

    /// Transfer requests this (prefill) worker admitted and has not answered.
    #[getter]
    fn transfers_in_progress(&self) -> Result<usize> {
        let guard = self.running()?;
        Ok(guard.as_ref().map_or(0, |r| r.engine.transfers_in_progress()))
    }
}

impl Drop for PyWorker {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let Some(running) = state else { return };
        if runtime::check_pid(self.pid).is_err() {
            // A forked child: the runtime's threads do not exist here, and
            // its locks may be held forever. Touch nothing.
            std::mem::forget(running);
            return;
        }
        running.stop();
    }
}
