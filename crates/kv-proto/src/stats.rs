//! What a transport counts about the peers that write into it: batches it
//! refused, by reason, peers that failed to authenticate, and frames that
//! failed their tag after the handshake. Relaxed atomics, bumped on refusal
//! paths only (never per op or per byte).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::registered::DestinationError;

macro_rules! refusals {
    ($($(#[$doc:meta])* $name:ident = $label:literal;)*) => {
        /// Why a receiver refused a peer's batch.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum BatchRefusal {
            $($(#[$doc])* $name,)*
        }

        impl BatchRefusal {
            /// Every reason, in a fixed order.
            pub const ALL: &'static [BatchRefusal] = &[$(BatchRefusal::$name,)*];

            /// The label metrics use (`snake_case`, stable).
            pub fn as_str(self) -> &'static str {
                match self { $(BatchRefusal::$name => $label,)* }
            }
        }
    };
}

refusals! {
    /// The grant was never issued here, or was revoked.
    UnknownGrant = "unknown_grant";
    /// The grant's time ran out.
    ExpiredGrant = "expired_grant";
    /// An op lies outside the grant's ranges.
    OutsideGrant = "outside_grant";
    /// Two ops overlap.
    OverlappingOps = "overlapping_ops";
    /// The ops' lengths do not add up to what the batch declared.
    LengthMismatch = "length_mismatch";
    /// The memory is closed (the worker is shutting down).
    Closed = "closed";
    /// The op list did not fit the receiver's memory budget.
    OpBudget = "op_budget";
}

impl From<&DestinationError> for BatchRefusal {
    fn from(error: &DestinationError) -> Self {
        match error {
            DestinationError::UnknownGrant => BatchRefusal::UnknownGrant,
            DestinationError::ExpiredGrant => BatchRefusal::ExpiredGrant,
            DestinationError::OutsideGrant { .. } => BatchRefusal::OutsideGrant,
            DestinationError::OverlappingOps { .. } => BatchRefusal::OverlappingOps,
            DestinationError::LengthMismatch { .. } => BatchRefusal::LengthMismatch,
            DestinationError::Closed => BatchRefusal::Closed,
        }
    }
}

/// A transport's counters; one per registered memory, shared by its tasks.
#[derive(Debug, Default)]
pub struct TransportCounters {
    refused: [AtomicU64; BatchRefusal::ALL.len()],
    auth_failures: AtomicU64,
    tag_failures: AtomicU64,
}

impl TransportCounters {
    /// A batch was refused.
    pub fn refused(&self, why: BatchRefusal) {
        self.refused[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A peer failed the data plane's authentication.
    pub fn auth_failed(&self) {
        self.auth_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// A frame on an authenticated connection failed its tag ([`crate::session`]):
    /// altered or injected on the path after the handshake; the connection
    /// ended.
    pub fn tag_failed(&self) {
        self.tag_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts now, with `grants_live` as the caller read it.
    pub fn snapshot(&self, grants_live: usize) -> TransportStats {
        TransportStats {
            grants_live: grants_live as u64,
            batches_refused: BatchRefusal::ALL
                .iter()
                .map(|&why| (why, self.refused[why as usize].load(Ordering::Relaxed)))
                .collect(),
            auth_failures: self.auth_failures.load(Ordering::Relaxed),
            tag_failures: self.tag_failures.load(Ordering::Relaxed),
        }
    }
}

/// What [`crate::BatchWriter::stats`] reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Grants issued and not yet revoked or expired (a gauge).
    pub grants_live: u64,
    /// Peers' batches refused since start, per reason (every reason listed).
    pub batches_refused: Vec<(BatchRefusal, u64)>,
    /// Peers that failed the data plane's authentication since start.
    pub auth_failures: u64,
    /// Frames (headers, op lists, payloads, replies, control frames) that
    /// failed their tag since start, each ending its connection.
    pub tag_failures: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_count_per_reason() {
        let counters = TransportCounters::default();
        counters.refused(BatchRefusal::OpBudget);
        counters.refused(BatchRefusal::from(&DestinationError::UnknownGrant));
        counters.refused(BatchRefusal::UnknownGrant);
        counters.auth_failed();
        counters.tag_failed();
        counters.tag_failed();
        let stats = counters.snapshot(3);
        assert_eq!(stats.grants_live, 3);
        assert_eq!(stats.auth_failures, 1);
        assert_eq!(stats.tag_failures, 2);
        assert_eq!(stats.batches_refused.len(), BatchRefusal::ALL.len());
        let count = |why| stats.batches_refused.iter().find(|(w, _)| *w == why).map(|(_, n)| *n);
        assert_eq!(count(BatchRefusal::UnknownGrant), Some(2));
        assert_eq!(count(BatchRefusal::OpBudget), Some(1));
        assert_eq!(count(BatchRefusal::Closed), Some(0));
    }
}
