//! The prefill side's bookkeeping (sans-IO): send entries, their leases, and
//! which requests are finished sending (their blocks may be freed).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kv_proto::{BlockId, ReqId, SendUpdate};

#[derive(Debug)]
enum SendEntry {
    /// Scheduled with `do_remote_decode`, not finished yet: D may already ask.
    Expected,
    /// Finished by length cap; blocks held until D pulls or the lease ends.
    Ready { block_ids: Vec<BlockId>, lease_end: Instant },
    /// A transfer is writing it; it ends in `complete`.
    InFlight,
    /// Not finished yet, and the pull that asked for it gave up (its decode
    /// instance went away or its wait budget passed): freed the moment it
    /// is ready instead of held for a lease no one will use.
    Abandoned,
}

/// What a pull for a request finds on P.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Ready: the transfer may start; the entry is now in flight.
    Ready(Vec<BlockId>),
    /// Known but not finished yet: wait for an update, within a bound.
    NotReady,
    /// P has no entry for it (never scheduled here, forgotten, or already sent).
    Unknown,
    /// Its lease had ended: the blocks are freed.
    Expired,
    /// Another pull is already transferring it.
    InFlight,
}

/// P's send entries, driven with explicit time.
#[derive(Debug)]
pub struct SenderCore {
    lease: Duration,
    entries: HashMap<ReqId, SendEntry>,
    finished: BTreeSet<ReqId>,
}

impl SenderCore {
    /// Entries made ready hold their blocks for `lease` (the abort timeout).
    pub fn new(lease: Duration) -> Self {
        Self { lease, entries: HashMap::new(), finished: BTreeSet::new() }
    }

    /// Applies one scheduler update.
    pub fn handle_update(&mut self, req: &ReqId, update: &SendUpdate, now: Instant) {
        match update {
            SendUpdate::Expect => {
                self.entries.entry(req.clone()).or_insert(SendEntry::Expected);
            }
            SendUpdate::Ready { block_ids } => match self.entries.get(req) {
                Some(SendEntry::InFlight) => {
                    tracing::warn!(req_id = %req, "ready update for a request already being sent; ignored");
                }
                Some(SendEntry::Abandoned) => {
                    tracing::info!(req_id = %req, "request finished after its pull gave up; freeing its blocks now");
                    self.entries.remove(req);
                    self.finished.insert(req.clone());
                }
                _ => {
                    let lease_end = now + self.lease;
                    self.entries.insert(req.clone(), SendEntry::Ready { block_ids: block_ids.clone(), lease_end });
                }
            },
            SendUpdate::Forget => match self.entries.get(req) {
                Some(SendEntry::InFlight) => {
                    tracing::warn!(req_id = %req, "forget update for a request being sent; it ends with its transfer");
                }
                Some(_) => {
                    self.entries.remove(req);
                    tracing::debug!(req_id = %req, "send entry dropped: request finished without delay-free");
                }
                None => {}
            },
        }
    }

    /// A pull for `req` arrived: take its blocks if it is ready.
    pub fn claim(&mut self, req: &ReqId, now: Instant) -> Claim {
        match self.entries.get(req) {
            None => Claim::Unknown,
            Some(SendEntry::Expected) => Claim::NotReady,
            // A new pull for it: wait for it again.
            Some(SendEntry::Abandoned) => {
                self.entries.insert(req.clone(), SendEntry::Expected);
                Claim::NotReady
            }
            Some(SendEntry::InFlight) => Claim::InFlight,
            Some(SendEntry::Ready { lease_end, .. }) if *lease_end <= now => {
                self.expire(req);
                Claim::Expired
            }
            Some(SendEntry::Ready { .. }) => match self.entries.insert(req.clone(), SendEntry::InFlight) {
                Some(SendEntry::Ready { block_ids, .. }) => Claim::Ready(block_ids),
                _ => Claim::Unknown,
            },
        }
    }

    /// A transfer of a claimed request ended, written or not: P frees its blocks.
    pub fn complete(&mut self, req: &ReqId) {
        if let Some(SendEntry::InFlight) = self.entries.get(req) {
            self.entries.remove(req);
            self.finished.insert(req.clone());
        }
    }

    /// The pull that asked for `req` gave up before it was ready (its
    /// connection closed, or its wait budget passed): no one will pull it,
    /// so once the engine finishes it its blocks are freed at once, without
    /// a lease. A ready or in-flight request is left to its lease or its
    /// transfer.
    pub fn abandon(&mut self, req: &ReqId) {
        if let Some(entry @ SendEntry::Expected) = self.entries.get_mut(req) {
            tracing::debug!(req_id = %req, "pull gave up before the request was ready");
            *entry = SendEntry::Abandoned;
        }
    }

    /// Frees every ready entry whose lease ended at `now`.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<ReqId> {
        let expired: Vec<ReqId> = self
            .entries
            .iter()
            .filter(|(_, e)| matches!(e, SendEntry::Ready { lease_end, .. } if *lease_end <= now))
            .map(|(r, _)| r.clone())
            .collect();
        for req in &expired {
            self.expire(req);
        }
        expired
    }

    fn expire(&mut self, req: &ReqId) {
        self.entries.remove(req);
        tracing::warn!(
            req_id = %req,
            lease_secs = self.lease.as_secs_f64(),
            "request was not pulled before its lease ended; freeing its blocks on the prefill side"
        );
        self.finished.insert(req.clone());
    }

    /// Requests whose blocks may be freed, each reported once.
    pub fn poll_finished(&mut self) -> BTreeSet<ReqId> {
        std::mem::take(&mut self.finished)
    }

    /// The earliest lease end, for a driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter_map(|e| match e {
                SendEntry::Ready { lease_end, .. } => Some(*lease_end),
                _ => None,
            })
            .min()
    }

    /// Live entries (expected, ready or in flight).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is live.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
