//! The scheduler side for Python: `kv_sched::ConnectorScheduler` plus the
//! notify-only bookkeeping of [`crate::step`]. Sans-IO: no runtime, no
//! thread; safe in any process.
//!
//! Everything here runs inside vLLM's scheduler, which has no `try` around
//! connector calls: an exception kills the engine for every user. The
//! request parameters come from the client, so nothing about them may
//! raise: params that do not parse, or that ask this instance for what its
//! role cannot do, make that request an ordinary local one (no pull, no held
//! blocks), with one warning per request naming the reason.

use std::collections::{BTreeSet, HashSet};
use std::num::NonZeroUsize;
use std::sync::{Mutex, MutexGuard};

use kv_proto::{BlockId, EngineId, KvTransferParams, RenewalSecret, ReqId};
use kv_sched::{ConnectorScheduler, EngineRequest, RequestStatus};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::{Error, Result};
use crate::settings::PySettings;
use crate::step::Envelope;

/// Requests remembered as already warned about; past this the set starts
/// afresh (a request may then be warned about twice, never unboundedly).
const MAX_WARNED: usize = 64 * 1024;

/// vLLM's `RequestStatus` names (0.14 and later releases), mapped to what
/// the connector distinguishes; `None` for a name this build does not know.
fn status(name: &str) -> Option<RequestStatus> {
    Some(match name {
        // 0.14 names the grammar wait WAITING_FOR_FSM, later releases
        // WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR; WAITING_FOR_STREAMING_REQ
        // (a streamed request waiting for more input) is new.
        "WAITING"
        | "WAITING_FOR_FSM"
        | "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
        | "WAITING_FOR_REMOTE_KVS"
        | "WAITING_FOR_STREAMING_REQ" => RequestStatus::Waiting,
        "RUNNING" => RequestStatus::Running,
        "PREEMPTED" => RequestStatus::Preempted,
        // FINISHED_REPETITION (later releases): stopped by repetition
        // detection, an early stop like any other, not a prefill's end.
        "FINISHED_STOPPED" | "FINISHED_REPETITION" => RequestStatus::FinishedStopped,
        "FINISHED_LENGTH_CAPPED" => RequestStatus::FinishedLengthCapped,
        "FINISHED_ABORTED" | "FINISHED_ERROR" => RequestStatus::FinishedAborted,
        "FINISHED_IGNORED" => RequestStatus::FinishedIgnored,
        _ => return None,
    })
}

fn cleared(req: &EngineRequest) -> bool {
    !req.kv_transfer_params.as_ref().is_some_and(|p| p.do_remote_prefill)
}

struct State {
    inner: ConnectorScheduler,
    /// Pulls recorded since the last build that vLLM will not wait for.
    notify_only: BTreeSet<ReqId>,
    /// Requests whose params were refused and already warned about.
    warned: HashSet<ReqId>,
    /// Status names not known to this build, already warned about.
    unknown_statuses: HashSet<String>,
}

impl State {
    /// The request as the scheduler sees it: params that do not parse are
    /// dropped (the request is served locally), warned about once.
    fn request(
        &mut self,
        request_id: &str,
        prompt_len: usize,
        status: RequestStatus,
        params: Option<&str>,
    ) -> EngineRequest {
        let request_id = ReqId::new(request_id);
        let kv_transfer_params = match params.map(KvTransferParams::from_json).transpose() {
            Ok(params) => params,
            Err(e) => {
                self.refused(&request_id, &e);
                None
            }
        };
        EngineRequest { request_id, prompt_len, status, kv_transfer_params }
    }

    /// One warning per request whose params cannot be served as asked.
    fn refused(&mut self, request_id: &ReqId, reason: &dyn std::fmt::Display) {
        if self.warned.len() >= MAX_WARNED {
            self.warned.clear();
        }
        if self.warned.insert(request_id.clone()) {
            tracing::warn!(
                req_id = %request_id,
                %reason,
                "ignoring this request's kv_transfer_params: it is served as an ordinary local request (no KV transfer)"
            );
        }
    }

    /// A finished request's status; an unknown name (a newer vLLM) counts as
    /// aborted: its blocks are freed now, never held.
    fn finished_status(&mut self, name: &str) -> RequestStatus {
        status(name).unwrap_or_else(|| {
            if self.unknown_statuses.len() < 64 && self.unknown_statuses.insert(name.to_owned()) {
                tracing::warn!(status = name, "unknown request status; treating it as aborted");
            }
            RequestStatus::FinishedAborted
        })
    }
}

/// The scheduler-side connector of one engine instance.
///
/// Request parameters cross as JSON text of the fields kvlink reads
/// (`do_remote_prefill`, `do_remote_decode`, `remote_host`, `remote_port`,
/// `remote_request_id`, `remote_engine_id`); the Python layer applies the
/// changes to vLLM's dict. No method raises on a request's params.
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
    /// data-parallel rank `dp_rank` (of `tp_size * pp_size` workers each).
    /// `block_size` is the engine's tokens per block: block lists are cut to
    /// the blocks holding prompt tokens (0: unknown, lists are taken whole).
    #[new]
    #[pyo3(signature = (settings, default_host, dp_rank = 0, tp_size = 1, pp_size = 1, block_size = 0))]
    fn new(
        settings: &PySettings,
        default_host: &str,
        dp_rank: u16,
        tp_size: u16,
        pp_size: u16,
        block_size: usize,
    ) -> Result<Self> {
        crate::logging::init();
        let s = settings.inner();
        let host = s.host(default_host).to_owned();
        let port = s.side_channel_port(dp_rank, tp_size, pp_size)?;
        let engine_id: EngineId = s.transfer.engine_id.clone();
        // Fresh per engine: the keys of its requests are minted from it.
        let secret = RenewalSecret::fresh().ok_or(Error::NoRandom)?;
        let mut inner = ConnectorScheduler::new(s.transfer.kv_role, engine_id, host.clone(), port, secret);
        if let Some(block_tokens) = NonZeroUsize::new(block_size) {
            inner = inner.with_block_tokens(block_tokens);
        }
        Ok(Self {
            state: Mutex::new(State {
                inner,
                notify_only: BTreeSet::new(),
                warned: HashSet::new(),
                unknown_statuses: HashSet::new(),
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
    ) -> (usize, bool) {
        let mut state = self.lock();
        let req = state.request(request_id, prompt_len, RequestStatus::Waiting, params);
        state.inner.get_num_new_matched_tokens(&req, num_computed_tokens)
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
    ) -> bool {
        let mut state = self.lock();
        let mut req = state.request(request_id, prompt_len, RequestStatus::Waiting, params);
        let was_pull = !cleared(&req);
        if let Err(e) = state.inner.update_state_after_alloc(&mut req, &unhashed_block_ids, num_external_tokens) {
            // Mis-targeted (e.g. do_remote_decode sent to a consumer): the
            // scheduler recorded nothing; the request runs locally.
            state.refused(&req.request_id, &e);
            return false;
        }
        if was_pull && num_external_tokens == 0 {
            state.notify_only.insert(req.request_id.clone());
        }
        was_pull && cleared(&req)
    }

    /// `(delay_free_blocks, params JSON for the proxy or None, clear do_remote_prefill)`.
    fn request_finished(
        &self,
        request_id: &str,
        prompt_len: usize,
        status: &str,
        params: Option<&str>,
        block_ids: Vec<BlockId>,
    ) -> (bool, Option<String>, bool) {
        let mut state = self.lock();
        let status = state.finished_status(status);
        let mut req = state.request(request_id, prompt_len, status, params);
        // The request is gone from the engine: forget it was warned about.
        let warned = state.warned.remove(&req.request_id);
        let was_pull = !cleared(&req);
        let (delay, out) = match state.inner.request_finished(&mut req, &block_ids) {
            Ok(decided) => decided,
            Err(e) => {
                // Mis-targeted params: its blocks are freed now.
                if !warned {
                    state.refused(&req.request_id, &e);
                    state.warned.remove(&req.request_id);
                }
                return (false, None, false);
            }
        };
        if was_pull {
            // Aborted before it was scheduled: P is told to free, nobody waits.
            state.notify_only.insert(req.request_id.clone());
        }
        (delay, out.map(|p| p.to_json()), was_pull && cleared(&req))
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

    /// The engine reports these requests sent (vLLM's `finished_sending`):
    /// the transfer ids naming them may name another request again.
    fn sending_finished(&self, request_ids: Vec<String>) {
        let ids: Vec<ReqId> = request_ids.into_iter().map(ReqId::new).collect();
        self.lock().inner.sending_finished(&ids);
    }

    /// Requests named by a transfer id whose send is not yet reported.
    #[getter]
    fn live_transfer_names(&self) -> usize {
        self.lock().inner.live_transfer_names()
    }

    /// Send entries announced to the workers and not resolved yet.
    #[getter]
    fn live_send_entries(&self) -> usize {
        self.lock().inner.live_send_entries()
    }
}
