//! The scheduler side for Python: `kv_sched::ConnectorScheduler` plus the
//! notify-only bookkeeping of [`crate::step`]. Sans-IO: no runtime, no
//! thread; safe in any process.

use std::collections::BTreeSet;
use std::sync::{Mutex, MutexGuard};

use kv_proto::{BlockId, KvTransferParams, ReqId};
use kv_sched::{ConnectorScheduler, EngineRequest, RequestStatus};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::{Error, Result};
use crate::settings::PySettings;
use crate::step::Envelope;

/// vLLM's `RequestStatus` names, mapped to what the connector distinguishes.
fn status(name: &str) -> Result<RequestStatus> {
    Ok(match name {
        "WAITING" | "WAITING_FOR_FSM" | "WAITING_FOR_REMOTE_KVS" => RequestStatus::Waiting,
        "RUNNING" => RequestStatus::Running,
        "PREEMPTED" => RequestStatus::Preempted,
        "FINISHED_STOPPED" => RequestStatus::FinishedStopped,
        "FINISHED_LENGTH_CAPPED" => RequestStatus::FinishedLengthCapped,
        "FINISHED_ABORTED" | "FINISHED_ERROR" => RequestStatus::FinishedAborted,
        "FINISHED_IGNORED" => RequestStatus::FinishedIgnored,
        other => return Err(Error::Config(format!("unknown request status {other:?}"))),
    })
}

fn request(request_id: &str, prompt_len: usize, status_name: &str, params: Option<&str>) -> Result<EngineRequest> {
    Ok(EngineRequest {
        request_id: ReqId::new(request_id),
        prompt_len,
        status: status(status_name)?,
        kv_transfer_params: params.map(KvTransferParams::from_json).transpose()?,
    })
}

fn cleared(req: &EngineRequest) -> bool {
    !req.kv_transfer_params.as_ref().is_some_and(|p| p.do_remote_prefill)
}

struct State {
    inner: ConnectorScheduler,
    /// Pulls recorded since the last build that vLLM will not wait for.
    notify_only: BTreeSet<ReqId>,
}

/// The scheduler-side connector of one engine instance.
///
/// Request parameters cross as JSON text of the four fields kvlink reads
/// (`do_remote_prefill`, `do_remote_decode`, `remote_host`, `remote_port`);
/// the Python layer applies the changes to vLLM's dict.
#[pyclass(name = "Scheduler", module = "kvlink_vllm._native", frozen)]
pub(crate) struct PyScheduler {
    state: Mutex<State>,
    host: String,
    port: u16,
}

impl PyScheduler {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[pymethods]
impl PyScheduler {
    /// A scheduler for `settings`, whose side channel peers reach at
    /// `default_host` (unless `advertised_host` is set) and the base port of
    /// data-parallel rank `dp_rank`.
    #[new]
    #[pyo3(signature = (settings, default_host, dp_rank = 0, tp_size = 1))]
    fn new(settings: &PySettings, default_host: &str, dp_rank: u16, tp_size: u16) -> Result<Self> {
        let s = settings.inner();
        let host = s.host(default_host).to_owned();
        let port = s.side_channel_port(dp_rank, tp_size)?;
        Ok(Self {
            state: Mutex::new(State {
                inner: ConnectorScheduler::new(s.transfer.kv_role, host.clone(), port),
                notify_only: BTreeSet::new(),
            }),
            host,
            port,
        })
    }

    /// Host a finished prefill tells the proxy (`remote_host`).
    #[getter]
    fn host(&self) -> &str {
        &self.host
    }

    /// Side-channel base port a finished prefill tells the proxy (`remote_port`).
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// `(tokens to load, asynchronously)`.
    fn get_num_new_matched_tokens(
        &self,
        request_id: &str,
        prompt_len: usize,
        params: Option<&str>,
        num_computed_tokens: usize,
    ) -> Result<(usize, bool)> {
        let req = request(request_id, prompt_len, "WAITING", params)?;
        Ok(self.lock().inner.get_num_new_matched_tokens(&req, num_computed_tokens))
    }

    /// Records the request's pull (decode) or send entry (prefill). Returns
    /// whether `do_remote_prefill` must now be cleared in vLLM's dict.
    fn update_state_after_alloc(
        &self,
        request_id: &str,
        prompt_len: usize,
        params: Option<&str>,
        unhashed_block_ids: Vec<BlockId>,
        num_external_tokens: usize,
    ) -> Result<bool> {
        let mut req = request(request_id, prompt_len, "WAITING", params)?;
        let was_pull = !cleared(&req);
        let mut state = self.lock();
        state.inner.update_state_after_alloc(&mut req, &unhashed_block_ids, num_external_tokens)?;
        if was_pull && num_external_tokens == 0 {
            state.notify_only.insert(req.request_id.clone());
        }
        Ok(was_pull && cleared(&req))
    }

    /// `(delay_free_blocks, params JSON for the proxy or None, clear do_remote_prefill)`.
    fn request_finished(
        &self,
        request_id: &str,
        prompt_len: usize,
        status: &str,
        params: Option<&str>,
        block_ids: Vec<BlockId>,
    ) -> Result<(bool, Option<String>, bool)> {
        let mut req = request(request_id, prompt_len, status, params)?;
        let was_pull = !cleared(&req);
        let mut state = self.lock();
        let (delay, out) = state.inner.request_finished(&mut req, &block_ids)?;
        if was_pull {
            // Aborted before it was scheduled: P is told to free, nobody waits.
            state.notify_only.insert(req.request_id.clone());
        }
        Ok((delay, out.map(|p| p.to_json()), was_pull && cleared(&req)))
    }

    /// This step's metadata, as bytes for the workers.
    fn build_connector_meta<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let mut state = self.lock();
        let meta = state.inner.build_connector_meta();
        let pending = std::mem::take(&mut state.notify_only);
        let notify_only = pending.into_iter().filter(|r| meta.reqs_to_recv.contains_key(r)).collect();
        drop(state);
        PyBytes::new(py, &Envelope::new(meta, notify_only).encode())
    }

    /// Send entries announced to the workers and not resolved yet.
    #[getter]
    fn live_send_entries(&self) -> usize {
        self.lock().inner.live_send_entries()
    }
}
