//! Errors of the scheduler side.

use kv_proto::{KvRole, ReqId};

/// A call the scheduler refuses: the request asks for something this
/// instance's role cannot do. The reference `assert`s these; here they are
/// values, and the refused call leaves the scheduler and the request unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    /// A request asks to pull its KV from a prefill instance
    /// (`do_remote_prefill`) on an instance that only produces KV.
    #[error("request {request_id} has do_remote_prefill set, but this instance is {role} and never receives KV")]
    RemotePrefillOnProducer {
        /// This instance's role (always [`KvRole::Producer`]).
        role: KvRole,
        /// The offending request.
        request_id: ReqId,
    },
    /// A request asks to be prefilled here and decoded elsewhere
    /// (`do_remote_decode`) on an instance that only consumes KV.
    #[error("request {request_id} has do_remote_decode set, but this instance is {role} and never sends KV")]
    RemoteDecodeOnConsumer {
        /// This instance's role (always [`KvRole::Consumer`]).
        role: KvRole,
        /// The offending request.
        request_id: ReqId,
    },
}

impl SchedError {
    /// The request the refused call was about.
    pub fn request_id(&self) -> &ReqId {
        match self {
            SchedError::RemotePrefillOnProducer { request_id, .. }
            | SchedError::RemoteDecodeOnConsumer { request_id, .. } => request_id,
        }
    }
}
