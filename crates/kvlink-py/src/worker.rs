//! The worker side for Python: one kv-worker over the engine's KV cache.
//!
//! Python objects are touched only by the calling Python thread: the
//! runtime's tasks see plain integers (addresses, lengths, block ids) and
//! owned Rust values. Calls that may wait release the GIL.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use kv_proto::{BlockId, LayoutKind, ReqId};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::engine::{self, Engine, Placement, TensorDesc};
use crate::error::{Error, Result};
use crate::metrics::{self, Intervals};
use crate::runtime;
use crate::settings::PySettings;
use crate::step::{AbandonedPulls, Envelope, ReportFilter};

/// Bound on stopping a worker (its tasks are cancelled, then the transport closes).
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// One tensor as `(address, bytes, blocks, tokens per block)`.
type TensorTuple = (u64, u64, u64, u32);

struct Running {
    engine: Engine,
    filter: ReportFilter,
    /// What `metrics_since_last` reported last.
    intervals: Intervals,
    /// The Python objects owning the registered memory (vLLM's tensors),
    /// released only once no transfer can touch that memory any more.
    keepalive: Py<PyAny>,
}

impl Running {
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
        other => {
            Err(Error::Config(format!("unknown KV cache layout {other:?}; expected \"split\", \"fused\" or \"mla\"")))
        }
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
#[pyclass(name = "Worker", module = "kvlink_vllm._native", frozen)]
pub(crate) struct PyWorker {
    /// The process that started it.
    pid: u32,
    state: Mutex<Option<Running>>,
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
    #[pyo3(signature = (settings, default_host, layout, block_size, layers, keepalive, dp_rank = 0, tp_size = 1, tp_rank = 0, report_abandoned_pulls = false))]
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
    ) -> Result<Self> {
        let rt = runtime::runtime()?;
        let kind = layout_kind(layout)?;
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
        let cache = engine::registered_cache(kind, block_size, &layers)?;
        let config = engine::worker_config(settings.inner(), Placement { dp_rank, tp_size, tp_rank }, default_host)?;
        let engine = py.detach(|| {
            // SAFETY: the regions are the tensors owned by `keepalive` (this
            // type's documented contract with its caller); `keepalive` is
            // stored below and released only after `Engine::shutdown`
            // returned `Ok` (see `Running::stop`), else never.
            unsafe { Engine::start(rt, config, cache) }
        })?;
        let side_channel_port = engine.side_channel_port();
        let data_endpoint = engine.data_endpoint();
        let abandoned = if report_abandoned_pulls { AbandonedPulls::Reported } else { AbandonedPulls::Unreported };
        let intervals = Intervals::new(engine.metrics());
        Ok(Self {
            pid: std::process::id(),
            state: Mutex::new(Some(Running { engine, filter: ReportFilter::new(abandoned), intervals, keepalive })),
            side_channel_port,
            data_endpoint,
        })
    }

    /// Applies one step's metadata (bytes from `Scheduler.build_connector_meta`).
    fn start_load_kv(&self, py: Python<'_>, payload: &[u8]) -> Result<()> {
        runtime::check_pid(self.pid)?;
        let envelope = Envelope::decode(payload)?;
        py.detach(|| {
            let mut guard = self.running()?;
            let running = guard.as_mut().ok_or(Error::ShutDown)?;
            running.filter.started(&envelope);
            // Fences this step's cancelled pulls before it returns.
            running.engine.start_load_kv(&envelope.meta);
            running.filter.cancelled(&envelope.meta.reqs_to_cancel);
            Ok(())
        })
    }

    /// `(finished_sending, finished_recving)` of this step; `finished_req_ids`
    /// is vLLM's list of requests finished since the previous step. Failed
    /// pulls are in `finished_recving`; their blocks in `take_load_errors()`.
    fn get_finished(&self, py: Python<'_>, finished_req_ids: Vec<String>) -> Result<(Vec<String>, Vec<String>)> {
        runtime::check_pid(self.pid)?;
        py.detach(|| {
            let mut guard = self.running()?;
            let running = guard.as_mut().ok_or(Error::ShutDown)?;
            let finished = running.engine.get_finished();
            let report = running.filter.report(finished_req_ids.into_iter().map(ReqId::from), finished);
            let names =
                |set: std::collections::BTreeSet<ReqId>| set.into_iter().map(|r| r.as_str().to_owned()).collect();
            Ok((names(report.sending), names(report.recving)))
        })
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
