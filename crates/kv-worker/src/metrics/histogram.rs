//! A fixed-bucket histogram updated with relaxed atomics: no lock and no
//! allocation on the hot path, read as a consistent-enough snapshot (each
//! bucket is exact; a snapshot taken during an update may see the count
//! before the sum).

use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds of seconds buckets: 100 µs to about 100 s, ×√10 apart.
pub const SECONDS_BOUNDS: &[f64] = &[1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0];

/// Upper bounds of byte buckets: 4 KiB to 64 GiB, ×4 apart.
pub const BYTES_BOUNDS: &[f64] = &[
    4096.0,
    16384.0,
    65536.0,
    262144.0,
    1048576.0,
    4194304.0,
    16777216.0,
    67108864.0,
    268435456.0,
    1073741824.0,
    4294967296.0,
    17179869184.0,
    68719476736.0,
];

/// Upper bounds of count buckets (ops per batch): 1 to about a million, ×4 apart.
pub const COUNT_BOUNDS: &[f64] = &[1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0];

/// The most buckets any bound set above has.
const MAX_BUCKETS: usize = 13;

/// A histogram over one of the bound sets above (plus the `+Inf` bucket).
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); the last is `+Inf`.
    buckets: [AtomicU64; MAX_BUCKETS + 1],
    /// Sum of observed values, as `f64` bits.
    sum_bits: AtomicU64,
}

impl Histogram {
    pub(crate) const fn new(bounds: &'static [f64]) -> Self {
        assert!(bounds.len() <= MAX_BUCKETS);
        Self { bounds, buckets: [const { AtomicU64::new(0) }; MAX_BUCKETS + 1], sum_bits: AtomicU64::new(0) }
    }

    pub(crate) fn observe(&self, value: f64) {
        let index = self.bounds.iter().position(|&bound| value <= bound).unwrap_or(self.bounds.len());
        self.buckets[index].fetch_add(1, Ordering::Relaxed);
        // A CAS loop on the sum: rare contention (one observation per
        // transfer), and f64 has no atomic add.
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| Some((f64::from_bits(bits) + value).to_bits()));
    }

    pub(crate) fn snapshot(&self) -> HistogramSnapshot {
        let counts = self.buckets[..=self.bounds.len()].iter().map(|b| b.load(Ordering::Relaxed)).collect();
        HistogramSnapshot { bounds: self.bounds, counts, sum: f64::from_bits(self.sum_bits.load(Ordering::Relaxed)) }
    }
}

/// What a histogram held when read.
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramSnapshot {
    /// Upper bounds of the finite buckets, ascending.
    pub bounds: &'static [f64],
    /// Observations per bucket (not cumulative): one per bound, then `+Inf`.
    pub counts: Vec<u64>,
    /// Sum of all observed values.
    pub sum: f64,
}

impl HistogramSnapshot {
    /// Observations in all.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Cumulative counts per finite bound, as Prometheus' `le` buckets
    /// carry them (the `+Inf` bucket is [`HistogramSnapshot::count`]).
    pub fn cumulative(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        self.bounds
            .iter()
            .zip(self.counts.iter().scan(0u64, |acc, &c| {
                *acc += c;
                Some(*acc)
            }))
            .map(|(&bound, cum)| (bound, cum))
    }

    /// What was observed since `earlier` (a snapshot of the same histogram).
    pub fn since(&self, earlier: &HistogramSnapshot) -> HistogramSnapshot {
        let counts = self
            .counts
            .iter()
            .enumerate()
            .map(|(i, &c)| c.saturating_sub(earlier.counts.get(i).copied().unwrap_or(0)))
            .collect();
        HistogramSnapshot { bounds: self.bounds, counts, sum: (self.sum - earlier.sum).max(0.0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_land_in_the_first_bucket_that_holds_them() {
        let h = Histogram::new(COUNT_BOUNDS);
        for v in [0.0, 1.0, 2.0, 4.0, 5.0, 2e6] {
            h.observe(v);
        }
        let s = h.snapshot();
        assert_eq!(s.counts.len(), COUNT_BOUNDS.len() + 1);
        assert_eq!(&s.counts[..3], &[2, 2, 1]);
        assert_eq!(s.counts[COUNT_BOUNDS.len()], 1);
        assert_eq!(s.count(), 6);
        assert!((s.sum - 2_000_012.0).abs() < 1e-6);
        let cumulative: Vec<u64> = s.cumulative().map(|(_, c)| c).collect();
        assert_eq!(&cumulative[..3], &[2, 4, 5]);
        assert_eq!(cumulative.last(), Some(&5));
    }

    #[test]
    fn since_subtracts_an_earlier_snapshot() {
        let h = Histogram::new(SECONDS_BOUNDS);
        h.observe(0.5);
        let earlier = h.snapshot();
        h.observe(0.5);
        h.observe(50.0);
        let delta = h.snapshot().since(&earlier);
        assert_eq!(delta.count(), 2);
        assert!((delta.sum - 50.5).abs() < 1e-9);
    }
}
