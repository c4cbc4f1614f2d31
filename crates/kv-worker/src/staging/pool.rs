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

/// The staging slots of one worker, driven with explicit time.
#[derive(Debug)]
pub struct StagingPool {
    capacity: usize,
    /// Free slots, lowest first (so a request's slots tend to be contiguous
    /// and the planner coalesces them).
    free: Vec<BlockId>,
    held: HashMap<ReqId, Vec<BlockId>>,
    waiting: VecDeque<Waiter>,
}

impl StagingPool {
    /// A pool of slots `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity: capacity as usize,
            free: (0..capacity).rev().collect(),
            held: HashMap::new(),
            waiting: VecDeque::new(),
        }
    }

    /// Asks for `wanted` slots for `req`; if none are free now (or someone
    /// asked first and still waits), `req` waits until `now + wait`.
    pub fn reserve(&mut self, req: &ReqId, wanted: usize, now: Instant, wait: Duration) -> Reservation {
        if self.held.contains_key(req) || self.waiting.iter().any(|w| &w.req == req) {
            return Reservation::Duplicate;
        }
        if wanted > self.capacity {
            return Reservation::TooLarge { wanted, capacity: self.capacity };
        }
        if self.waiting.is_empty() && wanted <= self.free.len() {
            return Reservation::Granted(self.take(req, wanted));
        }
        self.waiting.push_back(Waiter { req: req.clone(), wanted, deadline: now + wait });
        Reservation::Waiting
    }

    /// `req` ended (done, failed, cancelled, or gave up waiting): its slots
    /// are free again, or it stops waiting. Returns how many slots it gave
    /// back. Call [`StagingPool::poll`] after it to grant waiters.
    pub fn release(&mut self, req: &ReqId) -> usize {
        self.waiting.retain(|w| &w.req != req);
        let Some(slots) = self.held.remove(req) else { return 0 };
        let n = slots.len();
        self.free.extend(slots);
        // Lowest first from the end of the vector.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        n
    }

    /// Grants waiters that fit now, in order, and expires those whose
    /// bound passed at `now`.
    pub fn poll(&mut self, now: Instant) -> StagingEvents {
        let mut events = StagingEvents::default();
        let mut still = VecDeque::with_capacity(self.waiting.len());
        let mut blocked = false;
        while let Some(waiter) = self.waiting.pop_front() {
            if !blocked && waiter.wanted <= self.free.len() {
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
        self.waiting = still;
        events
    }

    /// The earliest wait bound, for a driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.waiting.iter().map(|w| w.deadline).min()
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
        self.waiting.len()
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

    proptest! {
        /// Whatever the order of asks, releases and polls, no slot is lost
        /// or handed out twice, and once every request ended all are free.
        #[test]
        fn no_slot_leaks(ops in proptest::collection::vec((0u8..3, 0usize..6, 0usize..7, 0u64..8), 0..200)) {
            let t0 = Instant::now();
            let mut pool = StagingPool::new(6);
            let mut seen = std::collections::BTreeSet::new();
            for (op, req, n, secs) in ops {
                let req = ReqId::new(format!("r{req}"));
                let now = t0 + Duration::from_secs(secs);
                match op {
                    0 => { let _ = pool.reserve(&req, n, now, Duration::from_secs(2)); }
                    1 => { pool.release(&req); }
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
