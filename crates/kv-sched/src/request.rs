//! The engine's request as the connector sees it.

use kv_proto::{KvTransferParams, ReqId};

/// Where a request is in the engine's life cycle (vLLM's `RequestStatus`,
/// reduced to what the connector distinguishes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    /// Queued, not scheduled yet (or waiting for its remote KV).
    Waiting,
    /// Scheduled and computing.
    Running,
    /// Preempted; its blocks were freed and it will be rescheduled.
    Preempted,
    /// Finished on a stop condition (stop token or string).
    FinishedStopped,
    /// Finished because it reached its length cap (`max_tokens`). On a
    /// prefill instance (`max_tokens = 1`) this is the normal end of a
    /// prefill whose KV goes to a decode instance.
    FinishedLengthCapped,
    /// Aborted (client gone, engine shutdown, ...).
    FinishedAborted,
    /// Never run (e.g. the prompt is longer than the model allows).
    FinishedIgnored,
}

impl RequestStatus {
    /// Whether the request has finished, whatever the reason.
    pub fn is_finished(self) -> bool {
        matches!(
            self,
            RequestStatus::FinishedStopped
                | RequestStatus::FinishedLengthCapped
                | RequestStatus::FinishedAborted
                | RequestStatus::FinishedIgnored
        )
    }
}

/// The engine's request as the connector sees it (input type, not a vLLM object).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineRequest {
    /// The engine's id of the request.
    pub request_id: ReqId,
    /// Number of prompt tokens (`len(request.prompt_token_ids)`).
    pub prompt_len: usize,
    /// Where the request is in its life cycle.
    pub status: RequestStatus,
    /// The transfer parameters the proxy attached, if any. The scheduler
    /// clears `do_remote_prefill` once it has recorded the request's (single)
    /// pull, exactly as the reference mutates vLLM's dict.
    pub kv_transfer_params: Option<KvTransferParams>,
}
