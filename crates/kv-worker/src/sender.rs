//! The prefill side's bookkeeping (sans-IO): send entries, their leases, and
//! which requests are finished sending (their blocks may be freed).
//!
//! A finished request's blocks are held for the abort timeout (the
//! reference's lease) unless a decode instance renews it: from the first
//! renewal on, the request is held only a short renewal past the last one
//! (never past the abort timeout), so a decode instance that dies or
//! restarts before pulling strands P's blocks for seconds, not minutes.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kv_proto::{BlockId, EngineId, FailureCause, ReqId, SendUpdate};

/// The last renewal of a request: who renewed it and until when, and
/// whether another decode instance renewed it too.
#[derive(Debug, Clone)]
struct Renewal {
    until: Instant,
    by: EngineId,
    /// Two decode instances renewed it: P cannot tell which one the proxy
    /// chose, so it holds the request for its whole lease (as it would with
    /// renewals off) and renewals no longer count.
    contested: bool,
}

#[derive(Debug)]
enum SendEntry {
    /// Scheduled with `do_remote_decode`, not finished yet: D may already ask.
    Expected { renewed: Option<Renewal> },
    /// Finished by length cap; blocks held until D pulls, the lease ends, or
    /// (once renewed) the renewal runs out.
    Ready { block_ids: Vec<BlockId>, ready_at: Instant, lease_end: Instant, renewed: Option<Renewal> },
    /// A transfer is writing it (its blocks still held); it ends in `complete`.
    InFlight { blocks: usize },
    /// Not finished yet, and the pull that asked for it gave up (its decode
    /// instance went away or its wait budget passed): freed the moment it
    /// is ready instead of held for a lease no one will use.
    Abandoned,
    /// P could not make it ready (no staging room within the bound): the
    /// engine freed it; a pull for it fails with this cause, until `until`.
    Failed { cause: FailureCause, until: Instant },
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
    /// P gave up on it before it was ready ([`SenderCore::fail`]).
    Failed(FailureCause),
}

impl SendEntry {
    /// When a ready entry's blocks are freed unless a pull claims them.
    fn ready_until(&self) -> Option<Instant> {
        match self {
            SendEntry::Ready { lease_end, renewed, .. } => Some(match renewed {
                Some(r) if !r.contested => r.until.min(*lease_end),
                _ => *lease_end,
            }),
            _ => None,
        }
    }

    fn renewal_mut(&mut self) -> Option<&mut Option<Renewal>> {
        match self {
            SendEntry::Expected { renewed } | SendEntry::Ready { renewed, .. } => Some(renewed),
            _ => None,
        }
    }
}

/// P's send entries, driven with explicit time.
#[derive(Debug)]
pub struct SenderCore {
    lease: Duration,
    renewal: Duration,
    entries: HashMap<ReqId, SendEntry>,
    finished: BTreeSet<ReqId>,
    /// Requests freed because their lease or renewal ended, since start.
    lease_expiries: u64,
    /// Renewals applied, since start.
    renewals: u64,
}

impl SenderCore {
    /// Entries made ready hold their blocks for `lease` (the abort timeout);
    /// once renewed, for `renewal` past the last renewal, within `lease`.
    /// A zero `renewal` turns renewals off.
    pub fn new(lease: Duration, renewal: Duration) -> Self {
        Self { lease, renewal, entries: HashMap::new(), finished: BTreeSet::new(), lease_expiries: 0, renewals: 0 }
    }

    /// How long one renewal holds a request (zero: renewals are off).
    pub fn renewal(&self) -> Duration {
        self.renewal
    }

    /// Applies one scheduler update.
    pub fn handle_update(&mut self, req: &ReqId, update: &SendUpdate, now: Instant) {
        match update {
            SendUpdate::Expect => {
                self.entries.entry(req.clone()).or_insert(SendEntry::Expected { renewed: None });
            }
            SendUpdate::Ready { block_ids } => match self.entries.get(req) {
                Some(SendEntry::InFlight { .. }) => {
                    tracing::warn!(req_id = %req, "ready update for a request already being sent; ignored");
                }
                Some(SendEntry::Abandoned) => {
                    tracing::info!(req_id = %req, "request finished after its pull gave up; freeing its blocks now");
                    self.entries.remove(req);
                    self.finished.insert(req.clone());
                }
                entry => {
                    // A renewal seen while it was running carries over.
                    let renewed = match entry {
                        Some(SendEntry::Expected { renewed } | SendEntry::Ready { renewed, .. }) => renewed.clone(),
                        _ => None,
                    };
                    let lease_end = now + self.lease;
                    let ready = SendEntry::Ready { block_ids: block_ids.clone(), ready_at: now, lease_end, renewed };
                    self.entries.insert(req.clone(), ready);
                }
            },
            SendUpdate::Forget => match self.entries.get(req) {
                Some(SendEntry::InFlight { .. }) => {
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
            // The pull now waiting for it holds it: renewals no longer
            // count (it is claimed the moment it is ready; if the pull
            // gives up first, `abandon` frees it when ready).
            Some(SendEntry::Expected { .. }) | Some(SendEntry::Abandoned) => {
                self.entries.insert(req.clone(), SendEntry::Expected { renewed: None });
                Claim::NotReady
            }
            Some(SendEntry::InFlight { .. }) => Claim::InFlight,
            Some(&SendEntry::Failed { cause, .. }) => {
                self.entries.remove(req);
                Claim::Failed(cause)
            }
            Some(entry @ SendEntry::Ready { .. }) if entry.ready_until().is_some_and(|end| end <= now) => {
                self.expire(req);
                Claim::Expired
            }
            Some(SendEntry::Ready { block_ids, .. }) => {
                let blocks = block_ids.len();
                match self.entries.insert(req.clone(), SendEntry::InFlight { blocks }) {
                    Some(SendEntry::Ready { block_ids, .. }) => Claim::Ready(block_ids),
                    _ => Claim::Unknown,
                }
            }
        }
    }

    /// A transfer of a claimed request ended, written or not: P frees its blocks.
    pub fn complete(&mut self, req: &ReqId) {
        if let Some(SendEntry::InFlight { .. }) = self.entries.get(req) {
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
        if let Some(entry @ SendEntry::Expected { .. }) = self.entries.get_mut(req) {
            tracing::debug!(req_id = %req, "pull gave up before the request was ready");
            *entry = SendEntry::Abandoned;
        }
    }

    /// P cannot send `req` (it could not be staged): the engine has freed
    /// it, so it is not reported finished again; a pull that asks for it
    /// within the lease fails with `cause`, and it is forgotten after that.
    /// A request already being written is left to its transfer.
    pub fn fail(&mut self, req: &ReqId, cause: FailureCause, now: Instant) {
        if matches!(self.entries.get(req), Some(SendEntry::InFlight { .. })) {
            return;
        }
        self.entries.insert(req.clone(), SendEntry::Failed { cause, until: now + self.lease });
    }

    /// Decode instance `by` still means to pull `reqs`: each one P holds,
    /// not yet claimed by a pull, is held until `now` plus the renewal (the
    /// abort-timeout lease still caps a ready one). Returns how many were
    /// renewed; ids P does not hold are ignored (already pulled, forgotten,
    /// or never here).
    ///
    /// The first decode instance to renew a request owns its renewals, and
    /// a renewal never brings a hold's end closer. A renewal from a second
    /// instance makes the request contested: it is held for its whole lease
    /// from then on, whoever renews, so neither instance can cut the
    /// other's hold short (whichever renewed first), and the most a
    /// contender costs is the hold every request has with renewals off.
    /// Renewals name P's own id of a request, which only the proxy and the
    /// decode instance it chose have been told.
    pub fn renew<'a>(&mut self, reqs: impl IntoIterator<Item = &'a ReqId>, by: &EngineId, now: Instant) -> usize {
        if self.renewal.is_zero() {
            return 0;
        }
        let until = now + self.renewal;
        let mut renewed = 0;
        for req in reqs {
            if let Some(slot) = self.entries.get_mut(req).and_then(SendEntry::renewal_mut) {
                match slot {
                    Some(owner) if owner.contested => continue,
                    Some(owner) if &owner.by != by => {
                        tracing::debug!(req_id = %req, decode_engine = %by, owner = %owner.by, "two decode instances renew one request; holding it for its whole lease");
                        owner.contested = true;
                        continue;
                    }
                    Some(owner) => owner.until = owner.until.max(until),
                    None => {
                        tracing::debug!(req_id = %req, decode_engine = %by, "request held for a decode instance renewing it");
                        *slot = Some(Renewal { until, by: by.clone(), contested: false });
                    }
                }
                renewed += 1;
            }
        }
        self.renewals += renewed as u64;
        renewed
    }

    /// P cannot hear decode instance `by` right now through no fault of
    /// its own (its messages wait behind P's admission): every request it
    /// last renewed is renewed again, so P's own back-pressure never frees
    /// a request a live decode instance still wants.
    pub fn renew_all_by(&mut self, by: &EngineId, now: Instant) -> usize {
        if self.renewal.is_zero() {
            return 0;
        }
        let until = now + self.renewal;
        let mut renewed = 0;
        for slot in self.entries.values_mut().filter_map(SendEntry::renewal_mut) {
            if let Some(renewal) = slot.as_mut().filter(|r| &r.by == by && !r.contested) {
                renewal.until = renewal.until.max(until);
                renewed += 1;
            }
        }
        renewed
    }

    /// Frees every ready entry whose lease or renewal ended at `now` (and
    /// forgets failed ones past theirs).
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<ReqId> {
        self.entries.retain(|_, e| !matches!(e, SendEntry::Failed { until, .. } if *until <= now));
        let expired: Vec<ReqId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.ready_until().is_some_and(|end| end <= now))
            .map(|(r, _)| r.clone())
            .collect();
        for req in &expired {
            self.expire(req);
        }
        expired
    }

    fn expire(&mut self, req: &ReqId) {
        self.lease_expiries += 1;
        let renewed_by = match self.entries.remove(req) {
            Some(SendEntry::Ready { renewed: Some(r), .. }) => Some(r.by),
            _ => None,
        };
        match renewed_by {
            Some(by) => tracing::warn!(
                req_id = %req,
                decode_engine = %by,
                renewal_secs = self.renewal.as_secs_f64(),
                "decode instance stopped renewing the request before pulling it; freeing its blocks on the prefill side"
            ),
            None => tracing::warn!(
                req_id = %req,
                lease_secs = self.lease.as_secs_f64(),
                "request was not pulled before its lease ended; freeing its blocks on the prefill side"
            ),
        }
        self.finished.insert(req.clone());
    }

    /// Requests whose blocks may be freed, each reported once.
    pub fn poll_finished(&mut self) -> BTreeSet<ReqId> {
        std::mem::take(&mut self.finished)
    }

    /// The earliest end of a lease or renewal, for a driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries.values().filter_map(SendEntry::ready_until).min()
    }

    /// Entries held for a decode instance that renews them (not yet pulled).
    pub fn renewed(&self) -> usize {
        self.entries
            .values()
            .filter(|e| {
                matches!(e, SendEntry::Expected { renewed: Some(_) } | SendEntry::Ready { renewed: Some(_), .. })
            })
            .count()
    }

    /// When `req` became ready, while it waits for a pull (not yet claimed).
    pub fn ready_since(&self, req: &ReqId) -> Option<Instant> {
        match self.entries.get(req) {
            Some(SendEntry::Ready { ready_at, .. }) => Some(*ready_at),
            _ => None,
        }
    }

    /// Requests whose blocks are held now (ready or being written), and
    /// their blocks.
    pub fn held(&self) -> (usize, usize) {
        self.entries.values().fold((0, 0), |(reqs, blocks), e| match e {
            SendEntry::Ready { block_ids, .. } => (reqs + 1, blocks + block_ids.len()),
            SendEntry::InFlight { blocks: n } => (reqs + 1, blocks + n),
            _ => (reqs, blocks),
        })
    }

    /// Requests freed because their lease (or renewal) ended unpulled, since start.
    pub fn lease_expiries(&self) -> u64 {
        self.lease_expiries
    }

    /// Request renewals applied since start (a renewal of `n` requests counts `n`).
    pub fn renewals(&self) -> u64 {
        self.renewals
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
