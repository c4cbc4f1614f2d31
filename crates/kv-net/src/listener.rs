//! What a data plane's listener shares among its incoming connections: its
//! places, the op-list budget, and the [`RefusalLog`] of each kind of log
//! line a peer can provoke. One copy for every data plane that receives
//! batches.

use std::time::Instant;

use kv_proto::HandshakePlaces;

use crate::{EstablishedPlaces, ListenerLimits, OpListBudget, OpListLimits, RefusalLog};

/// A kind of log line a peer can provoke on a data plane's listener; each
/// kind has its own [`RefusalLog`]: at most one line per
/// [`crate::LOG_INTERVAL`], with the count of those left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerLog {
    /// A connection refused for want of a handshake place (one refused an
    /// established place is [`EstablishedPlaces`]' own line).
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
    /// Places for established incoming connections, with the line about a
    /// peer refused one.
    pub established: EstablishedPlaces,
    /// Places for incoming connections in their handshake.
    pub handshakes: HandshakePlaces,
    /// Op lists all incoming connections (or streams) hold at once.
    pub op_lists: OpListBudget,
    logs: [RefusalLog; 4],
}

impl DataListener {
    /// The places `limits` allow and the op-list budget in force under
    /// `op_lists` (smaller unless peers must prove a secret).
    pub fn new(limits: &ListenerLimits, op_lists: &OpListLimits, secret_required: bool) -> Self {
        Self {
            established: EstablishedPlaces::new(limits),
            handshakes: limits.handshake_places(),
            op_lists: OpListBudget::new(op_lists.budget_in_force(secret_required)),
            logs: std::array::from_fn(|_| RefusalLog::new()),
        }
    }

    /// Whether a line of `kind` may be written now: `Some` with how many
    /// were left out since the last one, or `None` (leave it out).
    pub fn log_allowed(&self, kind: PeerLog) -> Option<u64> {
        self.log_allowed_at(kind, Instant::now())
    }

    /// [`Self::log_allowed`] at `now`.
    pub fn log_allowed_at(&self, kind: PeerLog, now: Instant) -> Option<u64> {
        let log = match kind {
            PeerLog::Busy => &self.logs[0],
            PeerLog::Budget => &self.logs[1],
            PeerLog::Batch => &self.logs[2],
            PeerLog::Fault => &self.logs[3],
        };
        log.allow(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LOG_INTERVAL;

    #[test]
    fn each_kind_of_line_has_its_own_throttle() {
        let t0 = Instant::now();
        let listener = DataListener::new(&ListenerLimits::default(), &OpListLimits::default(), true);
        assert_eq!(listener.log_allowed_at(PeerLog::Batch, t0), Some(0));
        assert_eq!(listener.log_allowed_at(PeerLog::Batch, t0), None, "a second line within the interval");
        for kind in [PeerLog::Busy, PeerLog::Budget, PeerLog::Fault] {
            assert_eq!(listener.log_allowed_at(kind, t0), Some(0), "{kind:?}: a kind of its own");
        }
        assert_eq!(listener.log_allowed_at(PeerLog::Batch, t0 + LOG_INTERVAL), Some(1), "the count held back");
        assert_eq!(listener.op_lists.limit(), OpListLimits::default().budget_in_force(true));
    }
}
