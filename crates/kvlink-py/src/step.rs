//! What crosses from the scheduler process to the workers each step, and the
//! worker-side rules for what may be reported back to vLLM.
//!
//! The scheduler's [`ConnectorMetadata`] is wrapped in an [`Envelope`] that
//! also names the pulls vLLM does not wait for (`notify_only`): a pull with
//! no block recorded for a full prefix-cache hit, or for a request aborted
//! before it was scheduled. Their only purpose is to let the prefill
//! instance free its blocks; vLLM's scheduler never expects them in
//! `finished_recving`, so the worker does not report them.

use std::collections::{BTreeSet, HashSet};

use kv_proto::{BlockId, ConnectorMetadata, ReqId};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Version of the envelope's encoding.
const ENVELOPE_VERSION: u32 = 1;

/// One step's metadata as it crosses the process boundary (JSON bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Envelope {
    /// Encoding version.
    pub(crate) v: u32,
    /// The scheduler's metadata.
    pub(crate) meta: ConnectorMetadata,
    /// Pulls in `meta` whose outcome vLLM does not wait for.
    pub(crate) notify_only: BTreeSet<ReqId>,
}

impl Envelope {
    /// Wraps a step's metadata.
    pub(crate) fn new(meta: ConnectorMetadata, notify_only: BTreeSet<ReqId>) -> Self {
        Self { v: ENVELOPE_VERSION, meta, notify_only }
    }

    /// The bytes handed to the workers.
    pub(crate) fn encode(&self) -> Vec<u8> {
        // Plain maps of strings and integers always serialize.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes what [`Envelope::encode`] produced.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self> {
        let envelope: Self = serde_json::from_slice(bytes).map_err(|e| Error::Metadata(e.to_string()))?;
        if envelope.v != ENVELOPE_VERSION {
            return Err(Error::Metadata(format!(
                "encoding version {} (this kvlink reads {ENVELOPE_VERSION}); scheduler and workers must run the same kvlink",
                envelope.v
            )));
        }
        Ok(envelope)
    }
}

/// What one worker reports to vLLM for one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Report {
    /// `finished_sending`.
    pub(crate) sending: BTreeSet<ReqId>,
    /// `finished_recving`, failed pulls included.
    pub(crate) recving: BTreeSet<ReqId>,
}

/// The worker-side filter between kv-worker's outcomes and vLLM.
///
/// vLLM may only hear of a request it handed to this worker and has not
/// finished: notify-only pulls are dropped, and so is the outcome of a pull
/// whose request vLLM finished (aborted) while it was in flight: its blocks
/// may already belong to another request, so they are not reported as load
/// errors either.
#[derive(Debug, Default)]
pub(crate) struct ReportFilter {
    notify_only: HashSet<ReqId>,
    /// Pulls vLLM waits for, in flight.
    awaited: HashSet<ReqId>,
    /// Of `awaited`, the requests vLLM finished meanwhile.
    finished_by_engine: HashSet<ReqId>,
    /// Blocks of failed pulls, for `get_block_ids_with_load_errors`.
    load_errors: BTreeSet<BlockId>,
}

impl ReportFilter {
    /// Records the pulls a step starts.
    pub(crate) fn started(&mut self, envelope: &Envelope) {
        for req in envelope.meta.reqs_to_recv.keys() {
            if envelope.notify_only.contains(req) {
                self.notify_only.insert(req.clone());
            } else {
                self.awaited.insert(req.clone());
            }
        }
    }

    /// Applies one step's outcomes; `finished_by_engine` is vLLM's
    /// `finished_req_ids` of the step.
    pub(crate) fn report(
        &mut self,
        finished_by_engine: impl IntoIterator<Item = ReqId>,
        finished: kv_worker::Finished,
    ) -> Report {
        for req in finished_by_engine {
            if self.awaited.contains(&req) {
                self.finished_by_engine.insert(req);
            }
        }
        let mut report = Report { sending: finished.sending, recving: BTreeSet::new() };
        let outcomes = finished
            .receiving
            .into_iter()
            .map(|r| (r, None))
            .chain(finished.failed_receiving.into_iter().map(|(r, blocks)| (r, Some(blocks))));
        for (req, failed_blocks) in outcomes {
            if self.notify_only.remove(&req) {
                if failed_blocks.is_some() {
                    tracing::warn!(req_id = %req, "could not tell the prefill instance to free the blocks of a request this instance will not pull; they are freed at its lease end");
                }
                continue;
            }
            self.awaited.remove(&req);
            if self.finished_by_engine.remove(&req) {
                tracing::debug!(req_id = %req, failed = failed_blocks.is_some(), "pull ended after the engine finished the request; not reported");
                continue;
            }
            if let Some(blocks) = failed_blocks {
                self.load_errors.extend(blocks);
            }
            report.recving.insert(req);
        }
        report
    }

    /// Blocks of failed pulls reported since the last call.
    pub(crate) fn take_load_errors(&mut self) -> BTreeSet<BlockId> {
        std::mem::take(&mut self.load_errors)
    }
}
