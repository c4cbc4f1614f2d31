//! What a data plane's listener shares among its incoming connections: its
//! places, the op-list budget, and the throttles of the log lines a peer
//! can provoke. One copy for every data plane that receives batches.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use kv_proto::{HandshakePlaces, LogThrottle};
use tokio::sync::Semaphore;

use crate::{ListenerLimits, OpListBudget, OpListLimits, LOG_INTERVAL};

/// A kind of log line a peer can provoke on a data plane's listener; each
/// kind is written at most once per [`LOG_INTERVAL`], with the count of
/// those left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerLog {
    /// A connection refused for want of a place.
    Busy,
    /// A batch refused for want of op-list room.
    Budget,
    /// A batch refused by its grant or its ops (a peer can send them as
    /// fast as it likes: an unknown grant costs it a header).
    Batch,
    /// A connection or stream a peer ended badly (a failed handshake, a
    /// protocol error).
    Fault,
}

/// The state a data plane's listener shares among its connections.
#[derive(Debug)]
pub struct DataListener {
    /// Places for established incoming connections.
    pub established: Arc<Semaphore>,
    /// Places for incoming connections in their handshake.
    pub handshakes: HandshakePlaces,
    /// Op lists all incoming connections (or streams) hold at once.
    pub op_lists: OpListBudget,
    logs: [Mutex<LogThrottle>; 4],
}

impl DataListener {
    /// The places `limits` allow and the op-list budget in force under
    /// `op_lists` (smaller unless peers must prove a secret).
    pub fn new(limits: &ListenerLimits, op_lists: &OpListLimits, secret_required: bool) -> Self {
        Self {
            established: limits.established_places(),
            handshakes: limits.handshake_places(),
            op_lists: OpListBudget::new(op_lists.budget_in_force(secret_required)),
            logs: std::array::from_fn(|_| Mutex::new(LogThrottle::new(LOG_INTERVAL))),
        }
    }

    /// Whether a line of `kind` may be written now: `Some` with how many
    /// were left out since the last one, or `None` (leave it out).
    pub fn log_allowed(&self, kind: PeerLog) -> Option<u64> {
        let throttle = match kind {
            PeerLog::Busy => &self.logs[0],
            PeerLog::Budget => &self.logs[1],
            PeerLog::Batch => &self.logs[2],
            PeerLog::Fault => &self.logs[3],
        };
        throttle.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_line_has_its_own_throttle() {
        let listener = DataListener::new(&ListenerLimits::default(), &OpListLimits::default(), true);
        assert_eq!(listener.log_allowed(PeerLog::Batch), Some(0));
        assert_eq!(listener.log_allowed(PeerLog::Batch), None, "a second line within the interval");
        assert_eq!(listener.log_allowed(PeerLog::Busy), Some(0), "another kind");
        assert_eq!(listener.op_lists.limit(), OpListLimits::default().budget_in_force(true));
    }
}
