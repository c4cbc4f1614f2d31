//! The prefill side's bookkeeping (sans-IO): send entries, their leases, and
//! which requests are finished sending (their blocks may be freed).
//!
//! A finished request's blocks are held for the abort timeout (the
//! reference's lease) unless a decode instance renews it: from the first
//! renewal on, the request is held only a short renewal past the last one
//! (never past the abort timeout), so a decode instance that dies or
//! restarts before pulling strands P's blocks for seconds, not minutes. A
//! renewal counts only naming the request's renewal key
//! ([`kv_proto::RenewalKey`]), which only the decode instance given the
//! request's params has.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use kv_proto::{BlockId, EngineId, FailureCause, RenewalKey, Renewing, ReqId, SendUpdate};

/// What renews a request P holds for a pull: its renewal key (the one
/// its params carry, from P's scheduler) and its last renewal.
#[derive(Debug, Clone, Default)]
struct Hold {
    /// `None`: P's scheduler gave none (yet); nothing renews it.
    key: Option<RenewalKey>,
    renewed: Option<Renewal>,
}

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
    Expected { hold: Hold },
    /// Finished by length cap; blocks held until D pulls, the lease ends, or
    /// (once renewed) the renewal runs out. Only the first `staged` blocks
    /// hold its KV yet (all of them unless staged in pieces,
    /// [`SenderCore::handle_staged`]).
    Ready { block_ids: Vec<BlockId>, staged: usize, ready_at: Instant, lease_end: Instant, hold: Hold },
    /// A transfer is writing it (its blocks still held); it ends in
    /// `complete`. The first `staged` of its blocks may be written; `failed`:
    /// the rest never will be (the transfer fails it).
    InFlight { blocks: usize, staged: usize, failed: Option<FailureCause> },
    /// Several decode ranks pull it, each its own heads: held until every
    /// one of them has pulled it, or until its lease ends while none writes.
    /// Each claimant's transfer writes its first `staged` blocks, as
    /// [`SendEntry::InFlight`]'s does; once P gives up on it (`failed`,
    /// with the end of the failed entry it leaves), no one claims it any
    /// more, and it is freed as soon as none writes.
    Shared {
        block_ids: Vec<BlockId>,
        staged: usize,
        failed: Option<(FailureCause, Instant)>,
        lease_end: Instant,
        expected: u32,
        claimed: BTreeSet<u32>,
        writing: u32,
    },
    /// Not finished yet, and the pull that asked for it gave up (its decode
    /// instance went away or its wait budget passed): freed the moment it
    /// is ready instead of held for a lease no one will use.
    Abandoned,
    /// P could not make it ready (no staging room within the bound): the
    /// engine freed it; a pull for it fails with this cause, until `until`.
    Failed { cause: FailureCause, until: Instant },
    /// Named by a pull before P's engine ever did (the bootstrap flow,
    /// where the router sends D its leg at once): P holds no block for it;
    /// the pull waits for the engine to see it, and the entry is dropped
    /// at `until` if the engine never does. Once the pull gave up
    /// (`abandoned`), a request the engine then finishes is freed at once.
    Awaited { until: Instant, abandoned: bool },
}

/// Who pulls a request from this prefill worker: decode rank `rank`, one
/// of `of` decode ranks that each pull it (their own heads) from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Puller {
    /// The decode worker's tensor-parallel rank.
    pub rank: u32,
    /// How many decode ranks pull each request from this worker.
    pub of: u32,
}

impl Puller {
    /// The one decode worker that pulls each request from here.
    pub const ONLY: Puller = Puller { rank: 0, of: 1 };
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
            SendEntry::Shared { lease_end, writing: 0, failed: None, .. } => Some(*lease_end),
            SendEntry::Ready { lease_end, hold, .. } => Some(match &hold.renewed {
                Some(r) if !r.contested => r.until.min(*lease_end),
                _ => *lease_end,
            }),
            _ => None,
        }
    }

    fn hold_mut(&mut self) -> Option<&mut Hold> {
        match self {
            SendEntry::Expected { hold } | SendEntry::Ready { hold, .. } => Some(hold),
            _ => None,
        }
    }
}

/// How many requests pulls may name before P's engine saw them, per
/// prefill worker, by default: a pull past it is refused at once as for an
/// unknown request (a decode instance cannot make P hold unbounded state).
pub const MAX_AWAITED: usize = 4096;

/// P's send entries, driven with explicit time.
#[derive(Debug)]
pub struct SenderCore {
    lease: Duration,
    /// Entries a pull made before the engine saw their request
    /// ([`SendEntry::Awaited`]), and how many may be at once.
    awaited: usize,
    max_awaited: usize,
    renewal: Duration,
    entries: HashMap<ReqId, SendEntry>,
    finished: BTreeSet<ReqId>,
    /// Requests a pull claimed before they were ready, since the last
    /// [`SenderCore::take_pulled`] (each one the engine expects to finish);
    /// kept only once [`SenderCore::keep_pulled`] asked for them.
    pulled: BTreeSet<ReqId>,
    keep_pulled: bool,
    /// Requests freed because their lease or renewal ended, since start.
    lease_expiries: u64,
    /// Renewals applied, since start.
    renewals: u64,
    /// Renewals of requests P holds that named the wrong key (or none was
    /// known), since start.
    renewals_refused: u64,
}

impl SenderCore {
    /// Entries made ready hold their blocks for `lease` (the abort timeout);
    /// once renewed, for `renewal` past the last renewal, within `lease`.
    /// A zero `renewal` turns renewals off.
    pub fn new(lease: Duration, renewal: Duration) -> Self {
        Self {
            lease,
            awaited: 0,
            max_awaited: MAX_AWAITED,
            renewal,
            entries: HashMap::new(),
            finished: BTreeSet::new(),
            pulled: BTreeSet::new(),
            keep_pulled: false,
            lease_expiries: 0,
            renewals: 0,
            renewals_refused: 0,
        }
    }

    /// How long one renewal holds a request (zero: renewals are off).
    pub fn renewal(&self) -> Duration {
        self.renewal
    }

    /// Applies one scheduler update.
    pub fn handle_update(&mut self, req: &ReqId, update: &SendUpdate, now: Instant) {
        match update {
            SendUpdate::Expect => {
                let seen = match self.entries.get(req) {
                    Some(SendEntry::Awaited { abandoned: true, .. }) => Some(SendEntry::Abandoned),
                    Some(SendEntry::Awaited { abandoned: false, .. }) => {
                        Some(SendEntry::Expected { hold: Hold::default() })
                    }
                    _ => None,
                };
                match seen {
                    Some(entry) => {
                        self.awaited = self.awaited.saturating_sub(1);
                        self.entries.insert(req.clone(), entry);
                    }
                    None => {
                        self.entries.entry(req.clone()).or_insert(SendEntry::Expected { hold: Hold::default() });
                    }
                }
            }
            SendUpdate::Ready { .. } if matches!(self.entries.get(req), Some(SendEntry::Awaited { .. })) => {
                // Seen and finished in one step: as if expected first.
                self.handle_update(req, &SendUpdate::Expect, now);
                self.handle_update(req, update, now);
            }
            SendUpdate::Ready { block_ids } => match self.entries.get(req) {
                Some(SendEntry::InFlight { .. } | SendEntry::Shared { .. }) => {
                    tracing::warn!(req_id = %req, "ready update for a request already being sent; ignored");
                }
                Some(SendEntry::Abandoned) => {
                    tracing::info!(req_id = %req, "request finished after its pull gave up; freeing its blocks now");
                    self.entries.remove(req);
                    self.finished.insert(req.clone());
                }
                entry => {
                    // A renewal seen while it was running carries over.
                    let hold = match entry {
                        Some(SendEntry::Expected { hold } | SendEntry::Ready { hold, .. }) => hold.clone(),
                        _ => Hold::default(),
                    };
                    let lease_end = now + self.lease;
                    let staged = block_ids.len();
                    let ready =
                        SendEntry::Ready { block_ids: block_ids.clone(), staged, ready_at: now, lease_end, hold };
                    self.entries.insert(req.clone(), ready);
                }
            },
            SendUpdate::Forget => match self.entries.get(req) {
                Some(SendEntry::InFlight { .. } | SendEntry::Shared { .. }) => {
                    tracing::warn!(req_id = %req, "forget update for a request being sent; it ends with its transfer");
                }
                Some(_) => {
                    self.remove(req);
                    tracing::debug!(req_id = %req, "send entry dropped: request finished without delay-free");
                }
                None => {}
            },
        }
    }

    /// `req` is ready in pieces: its KV is in the first `staged` of
    /// `block_ids` (more follow, in order, until all are). On an expected
    /// request it acts as [`SendUpdate::Ready`] does (a pull may claim it
    /// and write what is staged); on a ready or in-flight one it lets the
    /// transfer write more (counts that go back are ignored). A request P
    /// no longer holds (sent, failed, freed) is not made ready again.
    pub fn handle_staged(&mut self, req: &ReqId, block_ids: &[BlockId], staged: usize, now: Instant) {
        let staged = staged.min(block_ids.len());
        match self.entries.get_mut(req) {
            Some(
                SendEntry::Ready { staged: have, .. }
                | SendEntry::InFlight { staged: have, .. }
                | SendEntry::Shared { staged: have, .. },
            ) => {
                *have = (*have).max(staged);
            }
            Some(SendEntry::Expected { .. } | SendEntry::Abandoned | SendEntry::Awaited { .. }) => {
                self.handle_update(req, &SendUpdate::Ready { block_ids: block_ids.to_vec() }, now);
                if let Some(SendEntry::Ready { staged: have, .. }) = self.entries.get_mut(req) {
                    *have = staged;
                }
            }
            Some(SendEntry::Failed { .. }) | None => {
                tracing::debug!(req_id = %req, "staged pieces of a request no longer held; ignored");
            }
        }
    }

    /// What the transfer writing `req` may write now: `Ok(n)`, its first
    /// `n` blocks; `Err(cause)`, it failed (P gave up staging the rest).
    /// `None`: not being written. Every decode rank writing a shared
    /// request is told the same.
    pub fn writable(&self, req: &ReqId) -> Option<Result<usize, FailureCause>> {
        match self.entries.get(req) {
            Some(
                SendEntry::InFlight { failed: Some(cause), .. } | SendEntry::Shared { failed: Some((cause, _)), .. },
            ) => Some(Err(*cause)),
            Some(SendEntry::InFlight { staged, .. } | SendEntry::Shared { staged, .. }) => Some(Ok(*staged)),
            _ => None,
        }
    }

    /// A pull for `req` that may come before P's engine saw it (named by a
    /// transfer id) arrived: as [`SenderCore::claim_by`], but a request P
    /// does not know yet is awaited until `until` (at most
    /// [`MAX_AWAITED`] at once; past that it is unknown) instead of being
    /// unknown at once.
    pub fn claim_or_await(&mut self, req: &ReqId, puller: Puller, until: Instant, now: Instant) -> Claim {
        match self.entries.get(req) {
            None if self.awaited < self.max_awaited => {
                self.awaited += 1;
                self.entries.insert(req.clone(), SendEntry::Awaited { until, abandoned: false });
                Claim::NotReady
            }
            Some(SendEntry::Awaited { abandoned: false, .. }) => Claim::NotReady,
            Some(SendEntry::Awaited { abandoned: true, .. }) => {
                // A new pull takes it up again.
                self.entries.insert(req.clone(), SendEntry::Awaited { until, abandoned: false });
                Claim::NotReady
            }
            _ => self.claim_by(req, puller, now),
        }
    }

    /// Whether P's engine has not seen `req`, which a pull named first
    /// ([`SenderCore::claim_or_await`]).
    pub fn never_seen(&self, req: &ReqId) -> bool {
        matches!(self.entries.get(req), Some(SendEntry::Awaited { .. }))
    }

    /// Removes `req`'s entry, keeping the count of awaited ones.
    fn remove(&mut self, req: &ReqId) -> Option<SendEntry> {
        let entry = self.entries.remove(req);
        if matches!(entry, Some(SendEntry::Awaited { .. })) {
            self.awaited = self.awaited.saturating_sub(1);
        }
        entry
    }

    /// A pull for `req` arrived: take its blocks if it is ready.
    pub fn claim(&mut self, req: &ReqId, now: Instant) -> Claim {
        self.claim_by(req, Puller::ONLY, now)
    }

    /// A pull for `req` from `puller` arrived: take its blocks if it is
    /// ready. Where several decode ranks pull it, each may claim it once
    /// (at once or one after another); it is freed when the last of them
    /// has completed, or when its lease ends while none is writing. The
    /// first claim sets how many are awaited.
    pub fn claim_by(&mut self, req: &ReqId, puller: Puller, now: Instant) -> Claim {
        if let Some(SendEntry::Shared { block_ids, lease_end, claimed, writing, failed, .. }) =
            self.entries.get_mut(req)
        {
            if claimed.contains(&puller.rank) {
                return Claim::InFlight;
            }
            if let Some((cause, _)) = failed {
                return Claim::Failed(*cause);
            }
            if *writing == 0 && *lease_end <= now {
                self.expire(req);
                return Claim::Expired;
            }
            claimed.insert(puller.rank);
            *writing += 1;
            return Claim::Ready(block_ids.clone());
        }
        let live = self.entries.get(req).and_then(SendEntry::ready_until).is_some_and(|end| end > now);
        if let (true, true, Some(&SendEntry::Ready { ref block_ids, staged, lease_end, .. })) =
            (puller.of > 1, live, self.entries.get(req))
        {
            let blocks = block_ids.clone();
            let shared = SendEntry::Shared {
                block_ids: blocks.clone(),
                staged,
                failed: None,
                lease_end,
                expected: puller.of.min(kv_proto::topology::MAX_PARALLEL_SIZE),
                claimed: BTreeSet::from([puller.rank]),
                writing: 1,
            };
            self.entries.insert(req.clone(), shared);
            return Claim::Ready(blocks);
        }
        match self.entries.get(req) {
            None => Claim::Unknown,
            // The pull now waiting for it holds it: renewals no longer
            // count (it is claimed the moment it is ready; if the pull
            // gives up first, `abandon` frees it when ready).
            Some(entry @ (SendEntry::Expected { .. } | SendEntry::Abandoned)) => {
                // Its key stays: if this pull gives up, the decode
                // instance that has it may renew it again.
                let key = match entry {
                    SendEntry::Expected { hold } => hold.key,
                    _ => None,
                };
                self.entries.insert(req.clone(), SendEntry::Expected { hold: Hold { key, renewed: None } });
                if self.keep_pulled {
                    self.pulled.insert(req.clone());
                }
                Claim::NotReady
            }
            Some(SendEntry::InFlight { .. } | SendEntry::Shared { .. }) => Claim::InFlight,
            Some(SendEntry::Awaited { .. }) => Claim::NotReady,
            Some(&SendEntry::Failed { cause, .. }) => {
                self.entries.remove(req);
                Claim::Failed(cause)
            }
            Some(entry @ SendEntry::Ready { .. }) if entry.ready_until().is_some_and(|end| end <= now) => {
                self.expire(req);
                Claim::Expired
            }
            Some(&SendEntry::Ready { ref block_ids, staged, .. }) => {
                let blocks = block_ids.len();
                match self.entries.insert(req.clone(), SendEntry::InFlight { blocks, staged, failed: None }) {
                    Some(SendEntry::Ready { block_ids, .. }) => Claim::Ready(block_ids),
                    _ => Claim::Unknown,
                }
            }
        }
    }

    /// From now on, keeps the requests a pull claims before they are ready
    /// for [`SenderCore::take_pulled`] (a staged worker's, which takes them).
    pub fn keep_pulled(&mut self) {
        self.keep_pulled = true;
    }

    /// Whether a pull claimed a request before it was ready since the last
    /// [`SenderCore::take_pulled`].
    pub fn has_pulled(&self) -> bool {
        !self.pulled.is_empty()
    }

    /// The requests a pull claimed before they were ready, since the last
    /// call (a staged worker copies those into staging first).
    pub fn take_pulled(&mut self) -> BTreeSet<ReqId> {
        std::mem::take(&mut self.pulled)
    }

    /// A transfer of a claimed request ended, written or not: P frees its
    /// blocks (where several decode ranks pull it, once the last has).
    pub fn complete(&mut self, req: &ReqId) {
        match self.entries.get_mut(req) {
            Some(SendEntry::InFlight { .. }) => {}
            Some(SendEntry::Shared { expected, claimed, writing, failed, .. }) => {
                *writing = writing.saturating_sub(1);
                if let (0, Some((cause, until))) = (*writing, *failed) {
                    // The last writer of a request P gave up on: later
                    // claimants hear why until the failed entry ends.
                    self.entries.insert(req.clone(), SendEntry::Failed { cause, until });
                    self.finished.insert(req.clone());
                    return;
                }
                if *writing > 0 || (claimed.len() as u64) < u64::from(*expected) {
                    return;
                }
            }
            _ => return,
        }
        self.entries.remove(req);
        self.finished.insert(req.clone());
    }

    /// The pull that asked for `req` gave up before it was ready (its
    /// connection closed, or its wait budget passed): no one will pull it,
    /// so once the engine finishes it its blocks are freed at once, without
    /// a lease. A ready or in-flight request is left to its lease or its
    /// transfer.
    pub fn abandon(&mut self, req: &ReqId) {
        match self.entries.get_mut(req) {
            Some(entry @ SendEntry::Expected { .. }) => {
                tracing::debug!(req_id = %req, "pull gave up before the request was ready");
                *entry = SendEntry::Abandoned;
            }
            Some(SendEntry::Awaited { abandoned, .. }) => {
                // Kept to its bound: should the engine see it after all,
                // it is freed at once, not held for a pull that will not come.
                tracing::debug!(req_id = %req, "pull gave up before the engine saw the request");
                *abandoned = true;
            }
            _ => {}
        }
    }

    /// P cannot send `req` (it could not be staged, or not whole): a pull
    /// that asks for it within the lease fails with `cause`, and it is
    /// forgotten after that. A request not ready yet is not reported
    /// finished (its owner freed it); a ready one is, at once (its owner
    /// takes its blocks back); one being written fails with `cause` once its
    /// transfer wrote what was staged, and is reported when it ends. One
    /// several decode ranks pull is reported once none of them writes it
    /// (at once if none does), and no rank claims it after.
    pub fn fail(&mut self, req: &ReqId, cause: FailureCause, now: Instant) {
        match self.entries.get_mut(req) {
            Some(SendEntry::InFlight { failed, .. }) => {
                *failed = Some(cause);
                return;
            }
            Some(SendEntry::Shared { failed, writing, .. }) if *writing > 0 => {
                *failed = Some((cause, now + self.lease));
                return;
            }
            Some(SendEntry::Ready { .. } | SendEntry::Shared { .. }) => {
                self.finished.insert(req.clone());
            }
            _ => {}
        }
        self.entries.insert(req.clone(), SendEntry::Failed { cause, until: now + self.lease });
    }

    /// `req`'s renewal key, from P's scheduler (with the update that made
    /// it ready): renewals of it count only when they name this key. A
    /// request P holds no entry for, or no longer waits to be pulled, is
    /// ignored.
    pub fn set_renewal_key(&mut self, req: &ReqId, key: RenewalKey) {
        if let Some(hold) = self.entries.get_mut(req).and_then(SendEntry::hold_mut) {
            hold.key = Some(key);
        }
    }

    /// Decode instance `by` still means to pull `reqs`: each one P holds,
    /// not yet claimed by a pull, and named with its renewal key
    /// ([`Self::set_renewal_key`]), is held until `now` plus the renewal
    /// (the abort-timeout lease still caps a ready one). Returns how many
    /// were renewed; the rest are ignored (already pulled, forgotten, never
    /// here, or named without their key: counted in
    /// [`Self::renewals_refused`]).
    ///
    /// The key is what makes a renewal come from the decode instance P
    /// will serve: P's scheduler gave it only to the proxy, in the
    /// request's params, for the decode instance it chooses. The first
    /// decode instance to renew a request owns its renewals, and a renewal
    /// never brings a hold's end closer. Should a second instance renew it
    /// too (a leaked key, or a proxy that sent the request to two), the
    /// request is contested: it is held for its whole lease from then on,
    /// whoever renews, so neither can cut the other's hold short, and the
    /// most a contender costs is the hold every request has with renewals
    /// off.
    pub fn renew<'a>(&mut self, reqs: impl IntoIterator<Item = &'a Renewing>, by: &EngineId, now: Instant) -> usize {
        if self.renewal.is_zero() {
            return 0;
        }
        let until = now + self.renewal;
        let mut renewed = 0;
        for Renewing { req_id: req, key } in reqs {
            let Some(hold) = self.entries.get_mut(req).and_then(SendEntry::hold_mut) else { continue };
            if hold.key != Some(*key) {
                self.renewals_refused += 1;
                continue;
            }
            match &mut hold.renewed {
                Some(owner) if owner.contested => continue,
                Some(owner) if &owner.by != by => {
                    tracing::debug!(req_id = %req, decode_engine = %by, owner = %owner.by, "two decode instances renew one request; holding it for its whole lease");
                    owner.contested = true;
                    continue;
                }
                Some(owner) => owner.until = owner.until.max(until),
                None => {
                    tracing::debug!(req_id = %req, decode_engine = %by, "request held for a decode instance renewing it");
                    hold.renewed = Some(Renewal { until, by: by.clone(), contested: false });
                }
            }
            renewed += 1;
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
        for hold in self.entries.values_mut().filter_map(SendEntry::hold_mut) {
            if let Some(renewal) = hold.renewed.as_mut().filter(|r| &r.by == by && !r.contested) {
                renewal.until = renewal.until.max(until);
                renewed += 1;
            }
        }
        renewed
    }

    /// Frees every ready entry whose lease or renewal ended at `now` (and
    /// forgets failed ones past theirs).
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<ReqId> {
        let before = self.entries.len();
        self.entries.retain(|_, e| !matches!(e, SendEntry::Awaited { until, .. } if *until <= now));
        self.awaited = self.awaited.saturating_sub(before - self.entries.len());
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
            Some(SendEntry::Ready { hold: Hold { renewed: Some(r), .. }, .. }) => Some(r.by),
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
                matches!(
                    e,
                    SendEntry::Expected { hold: Hold { renewed: Some(_), .. } }
                        | SendEntry::Ready { hold: Hold { renewed: Some(_), .. }, .. }
                )
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
            SendEntry::Ready { block_ids, .. } | SendEntry::Shared { block_ids, .. } => {
                (reqs + 1, blocks + block_ids.len())
            }
            SendEntry::InFlight { blocks: n, .. } => (reqs + 1, blocks + n),
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

    /// Renewals refused since start: they named a request P holds without
    /// its renewal key.
    pub fn renewals_refused(&self) -> u64 {
        self.renewals_refused
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
