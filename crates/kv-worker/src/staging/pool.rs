//! Host staging slots (sans-IO): a fixed number of blocks of page-locked
//! host memory that KV of a device cache passes through, handed to
//! requests and taken back, with a bounded wait when none are free.
//!
//! The engine side (the vLLM package) copies device blocks into a request's
//! slots (P) or out of them (D); the worker only ever registers, grants and
//! writes staging memory, so it stays device-agnostic. Every slot a request
//! takes comes back when it ends, for whatever reason
//! ([`StagingPool::release`]): the pool checks that, and tests prove it for
//! every failure path.
//!
//! Waiters are served first come, first served: a large request at the
//! head is not starved by small ones behind it, and waits at most its
//! bound, after which it fails (the caller then fails the pull cleanly).
//!
//! A request staged *ahead* of its pull (P copies a finished request into
//! staging before any decode instance asks for it,
//! [`StagingPool::reserve_ahead`]) is served after every request a pull
//! waits for, and only while it leaves room for the largest request the
//! pool has seen: slots held ahead can only come back once their own pull
//! comes, which may wait for the decode instance's staging, which may wait
//! for this pool; the room kept back lets a pull that waits here always be
//! served by the pulls ahead of it ending, never by pulls yet to come.
//! [`StagingPool::demand`] moves such a request among those a pull waits
//! for when its pull arrives.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use kv_proto::{BlockId, ReqId};

/// What [`StagingPool::reserve`] says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// These slots are the request's now.
    Granted(Vec<BlockId>),
    /// None free yet: it waits, until [`StagingPool::poll`] grants it or
    /// its bound passes.
    Waiting,
    /// It needs more slots than the pool has: it can never be staged.
    TooLarge {
        /// Slots asked for.
        wanted: usize,
        /// Slots the pool has in all.
        capacity: usize,
    },
    /// The request already holds slots or waits for them.
    Duplicate,
}

/// What became of waiting requests at a [`StagingPool::poll`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StagingEvents {
    /// Requests granted their slots, in the order they asked.
    pub granted: Vec<(ReqId, Vec<BlockId>)>,
    /// Requests whose wait bound passed with no room: they get no slots.
    pub expired: Vec<ReqId>,
}

#[derive(Debug)]
struct Waiter {
    req: ReqId,
    wanted: usize,
    deadline: Instant,
}

impl Waiter {
    fn new(req: &ReqId, wanted: usize, now: Instant, wait: Duration) -> Self {
        // A bound too far to represent is no bound: the request is then
        // served or released, never expired.
        let deadline = now.checked_add(wait).unwrap_or(now + Duration::from_secs(u32::MAX.into()));
        Self { req: req.clone(), wanted, deadline }
    }
}

/// The staging slots of one worker, driven with explicit time.
#[derive(Debug)]
pub struct StagingPool {
    capacity: usize,
    /// Free slots, lowest first (so a request's slots tend to be contiguous
    /// and the planner coalesces them).
    free: Vec<BlockId>,
    held: HashMap<ReqId, Vec<BlockId>>,
    /// Requests a pull waits for, in the order they asked.
    waiting: VecDeque<Waiter>,
    /// Requests staged ahead of their pull, waiting, in the order they asked.
    ahead: VecDeque<Waiter>,
    /// The most slots one request has asked for: room a request staged
    /// ahead must leave free.
    largest: usize,
}

impl StagingPool {
    /// A pool of slots `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity: capacity as usize,
            free: (0..capacity).rev().collect(),
            held: HashMap::new(),
            waiting: VecDeque::new(),
            ahead: VecDeque::new(),
            largest: 0,
        }
    }

    /// Asks for `wanted` slots for `req`; if none are free now (or someone
    /// asked first and still waits), `req` waits until `now + wait`.
    /// (A request a pull waits for: it goes ahead of those staged ahead.)
    pub fn reserve(&mut self, req: &ReqId, wanted: usize, now: Instant, wait: Duration) -> Reservation {
        if let Some(refused) = self.refusal(req, wanted) {
            return refused;
        }
        if self.waiting.is_empty() && wanted <= self.free.len() {
            return Reservation::Granted(self.take(req, wanted));
        }
        self.waiting.push_back(Waiter::new(req, wanted, now, wait));
        Reservation::Waiting
    }

    /// Asks for `wanted` slots for `req`, staged ahead of its pull: granted
    /// now only if nobody waits and the largest request the pool has seen
    /// still fits in what is left; else `req` waits behind every request a
    /// pull waits for, until `now + wait` (or until [`StagingPool::demand`]).
    pub fn reserve_ahead(&mut self, req: &ReqId, wanted: usize, now: Instant, wait: Duration) -> Reservation {
        if let Some(refused) = self.refusal(req, wanted) {
            return refused;
        }
        if self.waiting.is_empty() && self.ahead.is_empty() && self.leaves_room(wanted) {
            return Reservation::Granted(self.take(req, wanted));
        }
        self.ahead.push_back(Waiter::new(req, wanted, now, wait));
        Reservation::Waiting
    }

    /// A pull for `req` arrived while it waits, staged ahead: it now waits
    /// as a pull's request (behind those already waiting so, ahead of every
    /// request staged ahead), at most until `now + wait`. Whether it was
    /// waiting ahead. Call [`StagingPool::poll`] after it.
    pub fn demand(&mut self, req: &ReqId, now: Instant, wait: Duration) -> bool {
        let Some(at) = self.ahead.iter().position(|w| &w.req == req) else { return false };
        if let Some(waiter) = self.ahead.remove(at) {
            self.waiting.push_back(Waiter::new(req, waiter.wanted, now, wait));
        }
        true
    }

    /// Why `req` cannot ask for `wanted` slots at all, if it cannot; else
    /// notes the size.
    fn refusal(&mut self, req: &ReqId, wanted: usize) -> Option<Reservation> {
        let asked = |w: &Waiter| &w.req == req;
        if self.held.contains_key(req) || self.waiting.iter().any(asked) || self.ahead.iter().any(asked) {
            return Some(Reservation::Duplicate);
        }
        if wanted > self.capacity {
            return Some(Reservation::TooLarge { wanted, capacity: self.capacity });
        }
        self.largest = self.largest.max(wanted);
        None
    }

    /// Whether `wanted` slots staged ahead leave room for the largest request.
    fn leaves_room(&self, wanted: usize) -> bool {
        wanted.saturating_add(self.largest) <= self.free.len()
    }

    /// `req` ended (done, failed, cancelled, or gave up waiting): its slots
    /// are free again, or it stops waiting. Returns how many slots it gave
    /// back. Call [`StagingPool::poll`] after it to grant waiters.
    pub fn release(&mut self, req: &ReqId) -> usize {
        self.waiting.retain(|w| &w.req != req);
        self.ahead.retain(|w| &w.req != req);
        let Some(slots) = self.held.remove(req) else { return 0 };
        let n = slots.len();
        self.free.extend(slots);
        // Lowest first from the end of the vector.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        n
    }

    /// Grants waiters that fit now, in order (those a pull waits for
    /// first, then those staged ahead, while they leave room), and expires
    /// those whose bound passed at `now`.
    pub fn poll(&mut self, now: Instant) -> StagingEvents {
        let mut events = StagingEvents::default();
        let waiting = std::mem::take(&mut self.waiting);
        let still = self.serve(waiting, false, now, &mut events);
        self.waiting = still;
        let ahead = std::mem::take(&mut self.ahead);
        let still = self.serve(ahead, true, now, &mut events);
        self.ahead = still;
        events
    }

    /// Serves `queue` in order (`ahead`: requests staged ahead, which must
    /// leave room, and none of which overtakes a pull's request still
    /// waiting); returns who still waits.
    fn serve(
        &mut self,
        queue: VecDeque<Waiter>,
        ahead: bool,
        now: Instant,
        events: &mut StagingEvents,
    ) -> VecDeque<Waiter> {
        let mut blocked = ahead && !self.waiting.is_empty();
        let mut still = VecDeque::with_capacity(queue.len());
        for waiter in queue {
            let fits = if ahead { self.leaves_room(waiter.wanted) } else { waiter.wanted <= self.free.len() };
            if !blocked && fits {
                let slots = self.take(&waiter.req, waiter.wanted);
                events.granted.push((waiter.req, slots));
            } else if waiter.deadline <= now {
                events.expired.push(waiter.req);
            } else {
                // First come, first served: nobody overtakes the head.
                blocked = true;
                still.push_back(waiter);
            }
        }
        still
    }

    /// The earliest wait bound, for a driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiting.iter().chain(&self.ahead).map(|w| w.deadline).min()
    }

    /// The slots `req` holds.
    pub fn slots_of(&self, req: &ReqId) -> Option<&[BlockId]> {
        self.held.get(req).map(Vec::as_slice)
    }

    /// Slots in all.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Requests waiting for slots now.
    pub fn waiting(&self) -> usize {
        self.waiting.len() + self.ahead.len()
    }

    /// Requests holding slots now, and how many each.
    pub fn holders(&self) -> BTreeMap<ReqId, usize> {
        self.held.iter().map(|(r, s)| (r.clone(), s.len())).collect()
    }

    fn take(&mut self, req: &ReqId, wanted: usize) -> Vec<BlockId> {
        let at = self.free.len() - wanted;
        let mut slots = self.free.split_off(at);
        slots.reverse();
        self.held.insert(req.clone(), slots.clone());
        slots
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rstest::rstest;

    use super::*;

    fn r(s: &str) -> ReqId {
        ReqId::new(s)
    }

    const WAIT: Duration = Duration::from_secs(5);

    #[test]
    fn slots_are_granted_lowest_first_and_come_back_on_release() {
        let t0 = Instant::now();
        let mut pool = StagingPool::new(8);
        assert_eq!(pool.reserve(&r("a"), 3, t0, WAIT), Reservation::Granted(vec![0, 1, 2]));
        assert_eq!(pool.reserve(&r("b"), 2, t0, WAIT), Reservation::Granted(vec![3, 4]));
        assert_eq!(pool.free(), 3);
        assert_eq!(pool.release(&r("a")), 3);
        assert_eq!(pool.reserve(&r("c"), 4, t0, WAIT), Reservation::Granted(vec![0, 1, 2, 5]));
        assert_eq!(pool.release(&r("nobody")), 0);
    }

    /// (request, slots wanted) asked in order at t0 on a pool of 4; then
    /// `release` frees one, then `poll` at `after`: who is granted, who expired.
    #[rstest]
    #[case::waits_then_granted_on_release(&[("a", 4), ("b", 2)], "a", 1, &["b"], &[])]
    #[case::head_blocks_smaller_behind_it(&[("a", 3), ("b", 4), ("c", 1)], "nobody", 1, &[], &[])]
    #[case::head_served_then_the_next(&[("a", 4), ("b", 2), ("c", 2)], "a", 1, &["b", "c"], &[])]
    #[case::expired_at_the_bound(&[("a", 4), ("b", 1)], "nobody", 5, &[], &["b"])]
    #[case::expired_head_unblocks_the_rest(&[("a", 3), ("b", 4), ("c", 1)], "nobody", 5, &["c"], &["b"])]
    #[case::a_waiter_that_gives_up_is_forgotten(&[("a", 4), ("b", 1)], "b", 5, &[], &[])]
    fn waiters(
        #[case] asks: &[(&str, usize)],
        #[case] release: &str,
        #[case] after_secs: u64,
        #[case] granted: &[&str],
        #[case] expired: &[&str],
    ) {
        let t0 = Instant::now();
        let mut pool = StagingPool::new(4);
        for (req, n) in asks {
            let _ = pool.reserve(&r(req), *n, t0, WAIT);
        }
        pool.release(&r(release));
        let events = pool.poll(t0 + Duration::from_secs(after_secs));
        let got: Vec<&str> = events.granted.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(got, granted);
        let gone: Vec<&str> = events.expired.iter().map(ReqId::as_str).collect();
        assert_eq!(gone, expired);
        for (req, slots) in &events.granted {
            assert_eq!(pool.slots_of(req), Some(slots.as_slice()));
        }
    }

    #[test]
    fn a_request_larger_than_the_pool_or_asked_twice_is_refused_at_once() {
        let t0 = Instant::now();
        let mut pool = StagingPool::new(4);
        assert_eq!(pool.reserve(&r("a"), 5, t0, WAIT), Reservation::TooLarge { wanted: 5, capacity: 4 });
        assert_eq!(pool.reserve(&r("a"), 4, t0, WAIT), Reservation::Granted(vec![0, 1, 2, 3]));
        assert_eq!(pool.reserve(&r("a"), 1, t0, WAIT), Reservation::Duplicate);
        assert_eq!(pool.reserve(&r("b"), 1, t0, WAIT), Reservation::Waiting);
        assert_eq!(pool.reserve(&r("b"), 1, t0, WAIT), Reservation::Duplicate);
        assert_eq!(pool.next_deadline(), Some(t0 + WAIT));
    }

    /// On a pool of 4: `(request, slots, staged ahead?)` asked in order at
    /// t0 (what each was told), then the pulls of `demanded` arrive at t1
    /// and the pool is polled at t1: who is granted.
    #[rstest]
    #[case::ahead_leaves_room_for_the_largest(&[("a", 2, true, "granted"), ("b", 1, true, "waiting")], &[], &[])]
    #[case::ahead_alone_needs_twice_its_size(&[("a", 3, true, "waiting")], &[], &[])]
    #[case::a_pull_takes_what_ahead_must_leave(&[("a", 2, true, "granted"), ("b", 2, false, "granted")], &[], &[])]
    #[case::a_pulled_request_overtakes_those_ahead(
        &[("a", 2, true, "granted"), ("b", 2, true, "waiting"), ("c", 2, true, "waiting")], &["c"], &["c"])]
    #[case::ahead_waits_behind_a_pull(
        &[("big", 4, false, "granted"), ("a", 1, true, "waiting")], &[], &[])]
    #[case::a_pull_not_waiting_ahead_changes_nothing(&[("a", 2, true, "granted"), ("b", 3, true, "waiting")], &["x"], &[])]
    fn staged_ahead(#[case] asks: &[(&str, usize, bool, &str)], #[case] demanded: &[&str], #[case] granted: &[&str]) {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut pool = StagingPool::new(4);
        for (req, n, ahead, told) in asks {
            let got =
                if *ahead { pool.reserve_ahead(&r(req), *n, t0, WAIT) } else { pool.reserve(&r(req), *n, t0, WAIT) };
            let said = match got {
                Reservation::Granted(_) => "granted",
                Reservation::Waiting => "waiting",
                other => panic!("{req}: {other:?}"),
            };
            assert_eq!(said, *told, "{req}");
        }
        for req in demanded {
            pool.demand(&r(req), t1, WAIT);
        }
        let got: Vec<String> = pool.poll(t1).granted.into_iter().map(|(r, _)| r.as_str().to_owned()).collect();
        assert_eq!(got, granted.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
    }

    #[test]
    fn a_pulled_request_waits_its_whole_bound_from_the_pull() {
        let t0 = Instant::now();
        let mut pool = StagingPool::new(4);
        assert!(matches!(pool.reserve_ahead(&r("a"), 2, t0, WAIT), Reservation::Granted(_)));
        assert!(matches!(pool.reserve_ahead(&r("b"), 4, t0, WAIT), Reservation::Waiting));
        let pulled = t0 + WAIT - Duration::from_secs(1);
        assert!(pool.demand(&r("b"), pulled, WAIT));
        assert!(!pool.demand(&r("b"), pulled, WAIT), "once");
        assert_eq!(pool.poll(t0 + WAIT).expired, Vec::<ReqId>::new(), "not at the bound from its ask");
        assert_eq!(pool.poll(pulled + WAIT).expired, vec![r("b")]);
    }

    proptest! {
        /// Whatever the order of asks, releases and polls, no slot is lost
        /// or handed out twice, and once every request ended all are free.
        #[test]
        fn no_slot_leaks(ops in proptest::collection::vec((0u8..5, 0usize..6, 0usize..7, 0u64..8), 0..200)) {
            let t0 = Instant::now();
            let mut pool = StagingPool::new(6);
            let mut seen = std::collections::BTreeSet::new();
            for (op, req, n, secs) in ops {
                let req = ReqId::new(format!("r{req}"));
                let now = t0 + Duration::from_secs(secs);
                match op {
                    0 => { let _ = pool.reserve(&req, n, now, Duration::from_secs(2)); }
                    1 => { pool.release(&req); }
                    2 => { let _ = pool.reserve_ahead(&req, n, now, Duration::from_secs(2)); }
                    3 => { pool.demand(&req, now, Duration::from_secs(2)); }
                    _ => { pool.poll(now); }
                }
                seen.insert(req);
                let mut held: Vec<BlockId> = pool.held.values().flatten().copied().chain(pool.free.iter().copied()).collect();
                held.sort_unstable();
                prop_assert_eq!(held, (0..6).collect::<Vec<_>>());
            }
            for req in &seen {
                pool.release(req);
            }
            prop_assert_eq!(pool.free(), 6);
            prop_assert_eq!(pool.waiting(), 0);
        }
    }
}
