//! What crosses from the scheduler process to the workers each step, and the
//! worker-side rules for what may be reported back to vLLM.
//!
//! The scheduler's [`ConnectorMetadata`] is wrapped in an [`Envelope`] that
//! also names the pulls vLLM does not wait for (`notify_only`): a pull with
//! no block recorded for a full prefix-cache hit, or for a request aborted
//! before it was scheduled. Their only purpose is to let the prefill
//! instance free its blocks; vLLM's scheduler never expects them in
//! `finished_recving`, so the worker does not report them.
//!
//! A pull whose request vLLM finished (aborted) while it was in flight is
//! fenced by the worker in the step that cancels it (`reqs_to_cancel`):
//! once that step's `start_load_kv` returns, no byte of it can land. What
//! vLLM expects to hear of it then depends on the release (chosen by
//! `kvlink_vllm.versions`): vLLM 0.14 freed the request's blocks when it
//! finished it and must never hear of it again; later releases hold the
//! blocks until the pull is reported in `finished_recving`, so it is
//! reported there, once, after the fence.

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

/// What vLLM expects to hear of a pull whose request it finished while the
/// pull was in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum AbandonedPulls {
    /// Nothing: vLLM freed the blocks when it finished the request (0.14).
    #[default]
    Unreported,
    /// `finished_recving`, once no byte of the pull can land any more: vLLM
    /// holds the request's blocks until then (later releases).
    Reported,
}

/// The worker-side filter between kv-worker's outcomes and vLLM.
///
/// vLLM may only hear of a request it handed to this worker and is waiting
/// for: notify-only pulls are dropped. A pull whose request vLLM finished
/// (aborted) while it was in flight is never reported as a load error (its
/// blocks hold nothing vLLM will read), and is reported in
/// `finished_recving` only under [`AbandonedPulls::Reported`], after its
/// fence. A request is reported at most once.
#[derive(Debug, Default)]
pub(crate) struct ReportFilter {
    abandoned: AbandonedPulls,
    notify_only: HashSet<ReqId>,
    /// Pulls vLLM waits for, in flight.
    awaited: HashSet<ReqId>,
    /// Of `awaited`, the requests vLLM finished meanwhile.
    finished_by_engine: HashSet<ReqId>,
    /// Fenced pulls of requests vLLM finished, to report once
    /// ([`AbandonedPulls::Reported`] only).
    fenced: BTreeSet<ReqId>,
    /// Blocks of failed pulls, for `get_block_ids_with_load_errors`.
    load_errors: BTreeSet<BlockId>,
}

impl ReportFilter {
    /// A filter for a vLLM that expects `abandoned` of abandoned pulls.
    pub(crate) fn new(abandoned: AbandonedPulls) -> Self {
        Self { abandoned, ..Self::default() }
    }

    /// Records the pulls a step cancels; call it only once the worker has
    /// fenced them (kv-worker's `start_load_kv` has returned), since from
    /// then on vLLM may be told. Pulls already reported, or never awaited,
    /// are ignored (vLLM no longer holds anything for them).
    pub(crate) fn cancelled<'a>(&mut self, reqs: impl IntoIterator<Item = &'a ReqId>) {
        for req in reqs {
            if !self.awaited.remove(req) {
                continue;
            }
            self.finished_by_engine.remove(req);
            if self.abandoned == AbandonedPulls::Reported {
                tracing::debug!(req_id = %req, "pull fenced after the engine finished the request; reporting it so the engine frees its blocks");
                self.fenced.insert(req.clone());
            } else {
                tracing::debug!(req_id = %req, "pull fenced after the engine finished the request; not reported");
            }
        }
    }

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
        let mut report = Report { sending: finished.sending, recving: std::mem::take(&mut self.fenced) };
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
                // Ended on its own (no cancellation reached the worker first):
                // no byte of it can land any more either.
                if self.abandoned == AbandonedPulls::Reported {
                    tracing::debug!(req_id = %req, failed = failed_blocks.is_some(), "pull ended after the engine finished the request; reported without load errors");
                    report.recving.insert(req);
                } else {
                    tracing::debug!(req_id = %req, failed = failed_blocks.is_some(), "pull ended after the engine finished the request; not reported");
                }
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
