//! When D renews its watched requests on each prefill worker (sans-IO,
//! explicit time): every third of the renewal period P announced, a second
//! after a renewal that failed, a minute after a P that takes none; never
//! twice at once on one prefill worker; a worker whose requests are no
//! longer watched is forgotten.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kv_proto::Renewing;

use crate::receiver::SideChannelAddr;
use crate::watch::WatchList;

/// How one renewal on a prefill worker ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewed {
    /// Sent; P holds the requests this long past each renewal (zero: P
    /// takes no renewals, and nothing was sent).
    Held(Duration),
    /// Not sent (P unreachable, the connection lost, too slow).
    Failed,
}

/// D's renewals by prefill worker: which are due, which are under way.
#[derive(Debug, Default)]
pub struct RenewalSchedule {
    /// When each prefill worker renewed before is due again.
    next_due: HashMap<SideChannelAddr, Instant>,
    /// Prefill workers being renewed now.
    renewing: HashSet<SideChannelAddr>,
}

impl RenewalSchedule {
    /// Next try after a failed renewal (P unreachable, connection refused).
    pub const RETRY_AFTER: Duration = Duration::from_secs(1);
    /// Next look at a prefill worker that takes no renewals (its settings
    /// may change with a restart).
    pub const UNRENEWED_RECHECK: Duration = Duration::from_secs(60);

    /// A schedule with nothing renewed yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The renewals due at `now`, with the requests each renews (P's ids
    /// and their renewal keys):
    /// every prefill worker with watched requests that is not being renewed
    /// and was never renewed or is due. Each is under way from now until
    /// [`RenewalSchedule::handle_done`]. Prefill workers with nothing
    /// watched any more are forgotten.
    pub fn poll_due(&mut self, watches: &WatchList, now: Instant) -> Vec<(SideChannelAddr, Vec<Renewing>)> {
        self.next_due.retain(|peer, _| watches.watches_on(peer));
        let due: Vec<(SideChannelAddr, Vec<Renewing>)> = watches
            .by_peer()
            .filter(|(peer, _)| !self.renewing.contains(*peer))
            .filter(|(peer, _)| self.next_due.get(*peer).is_none_or(|due| *due <= now))
            .map(|(peer, reqs)| (peer.clone(), reqs))
            .collect();
        for (peer, _) in &due {
            self.renewing.insert(peer.clone());
            self.next_due.remove(peer);
        }
        due
    }

    /// The renewal on `peer` ended at `now` as `renewed`: the next one is
    /// due a third of P's renewal period later (three chances before P's
    /// hold runs out; at least [`crate::serving::MIN_RENEW_INTERVAL`], as
    /// P announces the period), [`Self::UNRENEWED_RECHECK`] later if P takes none,
    /// or [`Self::RETRY_AFTER`] later if it failed.
    pub fn handle_done(&mut self, peer: &SideChannelAddr, renewed: Renewed, now: Instant) {
        self.renewing.remove(peer);
        let after = match renewed {
            Renewed::Held(renewal) if renewal.is_zero() => Self::UNRENEWED_RECHECK,
            Renewed::Held(renewal) => crate::serving::renew_every(renewal),
            Renewed::Failed => Self::RETRY_AFTER,
        };
        self.next_due.insert(peer.clone(), now + after);
    }

    /// When the next renewal is due (`None`: none is scheduled; one that
    /// is under way is not waited for).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_due.values().min().copied()
    }
}
