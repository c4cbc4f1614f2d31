//! A bound on memory that many holders share (e.g. the op lists every
//! connection of one transport buffers for peers): an atomic count of bytes
//! held, and [`Charge`]s that grow only while the total stays within the
//! limit and give their bytes back when dropped. When the budget is full,
//! [`Charge::holds_fair_share`] says which holder should give way (one that
//! holds at least an equal part of it), so holders that each wait for the
//! others cannot lock it up until they all time out.
//!
//! Pure: nothing here waits or reads a clock. A caller that must wait for
//! room does it with its own runtime (retrying [`Charge::try_grow`] when
//! charges are given back), with its own bound.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Bytes held at once by all the [`Charge`]s of one budget, bounded by its
/// limit.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: u64,
    used: AtomicU64,
    peak: AtomicU64,
    /// Charges holding any bytes.
    holders: AtomicU64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes, none held.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self { limit, used: AtomicU64::new(0), peak: AtomicU64::new(0), holders: AtomicU64::new(0) })
    }

    /// The bound, bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The most bytes ever held at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Charges holding any bytes now.
    pub fn holders(&self) -> u64 {
        self.holders.load(Ordering::Acquire)
    }

    /// A charge of no bytes against this budget, to grow.
    pub fn charge(self: &Arc<Self>) -> Charge {
        Charge { budget: Arc::clone(self), bytes: 0 }
    }

    /// Takes `bytes` if the total stays within the limit.
    fn take(&self, bytes: u64) -> bool {
        let taken = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(bytes).filter(|&total| total <= self.limit)
        });
        match taken {
            Ok(before) => {
                self.peak.fetch_max(before + bytes, Ordering::AcqRel);
                true
            }
            Err(_) => false,
        }
    }

    fn give_back(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// Bytes one holder has taken from a [`MemoryBudget`]; given back on drop.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Charge {
    /// Bytes this charge holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The budget charged.
    pub fn budget(&self) -> &Arc<MemoryBudget> {
        &self.budget
    }

    /// Takes `more` bytes if the budget has room; otherwise takes nothing
    /// and returns `false`.
    pub fn try_grow(&mut self, more: u64) -> bool {
        if more == 0 {
            return true;
        }
        let grown = self.budget.take(more);
        if grown {
            if self.bytes == 0 {
                self.budget.holders.fetch_add(1, Ordering::AcqRel);
            }
            self.bytes += more;
        }
        grown
    }

    /// Whether this charge holds at least an equal part of the budget among
    /// the charges that hold any: when the budget is full, such a holder
    /// should give way (give its bytes back) rather than wait for others
    /// that may be waiting for it.
    pub fn holds_fair_share(&self) -> bool {
        let holders = self.budget.holders().max(1);
        self.bytes > 0 && u128::from(self.bytes) * u128::from(holders) >= u128::from(self.budget.limit)
    }

    /// Gives every byte back now (the charge stays usable, empty); returns
    /// how many.
    pub fn release(&mut self) -> u64 {
        let bytes = std::mem::take(&mut self.bytes);
        if bytes > 0 {
            self.budget.holders.fetch_sub(1, Ordering::AcqRel);
            self.budget.give_back(bytes);
        }
        bytes
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release();
    }
}

/// Why a charge could not grow: what a caller that waits for room (with
/// its own runtime and bound) reports when it gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRoom {
    /// The budget stayed full until the deadline.
    Timeout,
    /// The budget is full and this holder holds an equal share of it or
    /// more (`held` bytes, among `holders`): it gives way
    /// ([`Charge::holds_fair_share`]).
    GiveWay {
        /// Bytes this holder holds.
        held: u64,
        /// Holders holding any bytes.
        holders: u64,
    },
}

impl NoRoom {
    /// Why a batch of `ops` ops is refused for want of room in an op-list
    /// budget of `limit` bytes, waited on for at most `timeout`, for its
    /// sender.
    pub fn reason(self, ops: u64, limit: u64, timeout: std::time::Duration) -> String {
        match self {
            NoRoom::Timeout => format!(
                "no room for the op list of {ops} ops within {timeout:?}: the receiver's op-list budget of {limit} \
                 bytes is held by other batches; try again"
            ),
            NoRoom::GiveWay { held, holders } => format!(
                "no room for the op list of {ops} ops: the receiver's op-list budget of {limit} bytes is full and \
                 this batch holds {held} bytes of it, an equal share or more among {holders} batches; try again"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_grow_within_the_limit_and_give_back_on_drop() {
        let budget = MemoryBudget::new(100);
        let mut a = budget.charge();
        let mut b = budget.charge();
        assert!(a.try_grow(60));
        assert!(!b.try_grow(41), "past the limit");
        assert_eq!((b.bytes(), budget.used()), (0, 60), "a refused growth takes nothing");
        assert!(b.try_grow(40));
        assert!(!a.try_grow(1));
        assert!(a.try_grow(0));
        drop(b);
        assert_eq!(budget.used(), 60);
        assert!(a.try_grow(40));
        assert_eq!((a.release(), budget.used(), a.bytes()), (100, 0, 0));
        assert!(!a.try_grow(u64::MAX), "no overflow");
        assert_eq!(budget.peak(), 100);
        drop(a);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn the_holder_of_an_equal_share_gives_way() {
        let budget = MemoryBudget::new(90);
        let (mut a, mut b, mut c) = (budget.charge(), budget.charge(), budget.charge());
        assert!(!a.holds_fair_share(), "an empty charge holds nothing");
        assert!(a.try_grow(50) && b.try_grow(30));
        assert_eq!(budget.holders(), 2);
        assert!(a.holds_fair_share() && !b.holds_fair_share(), "50 of 90 between two: a gives way");
        assert!(c.try_grow(10));
        assert!(!c.try_grow(1) && !c.holds_fair_share(), "c (10 of 90 among three) waits");
        assert!(b.holds_fair_share(), "30 of 90 among three is an equal share");
        a.release();
        assert_eq!(budget.holders(), 2);
        assert!(c.try_grow(1));
        drop((b, c));
        assert_eq!((budget.holders(), budget.used()), (0, 0));
    }

    #[test]
    fn concurrent_holders_never_exceed_the_limit() {
        let budget = MemoryBudget::new(1000);
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let budget = Arc::clone(&budget);
                std::thread::spawn(move || {
                    for i in 0..2000u64 {
                        let mut charge = budget.charge();
                        while charge.try_grow(1 + (i * 7 + t) % 97) {}
                        assert!(budget.used() <= budget.limit());
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(budget.used(), 0);
        assert!(budget.peak() <= 1000 && budget.peak() > 900, "peak {}", budget.peak());
    }
}
