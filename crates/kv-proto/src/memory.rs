//! Memory regions and write operations: what a [`crate::BatchWriter`] moves.

use serde::{Deserialize, Serialize};

/// A contiguous range of process memory registered with a transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryRegion {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl MemoryRegion {
    /// A region from a start address and a length.
    pub fn new(addr: u64, len: u64) -> Self {
        Self { addr, len }
    }

    /// One past the last byte, or `None` if the region wraps the address space.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }

    /// Whether `[addr, addr + len)` lies entirely inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        match (addr.checked_add(len), self.end()) {
            (Some(op_end), Some(end)) => addr >= self.addr && op_end <= end,
            _ => false,
        }
    }
}

/// One write of a batch: copy `len` bytes from local `src` to remote `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WriteOp {
    /// Local source address (inside a region registered on the writer).
    pub src: u64,
    /// Remote destination address (inside a region the receiver registered).
    pub dst: u64,
    /// Length in bytes.
    pub len: u64,
}

/// What peers may do with a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RegionAccess {
    /// Local memory this writer's batches read from. Never writable by a
    /// peer, grant or not.
    Source,
    /// Local memory peers write into, only inside a live grant.
    Destination,
}

/// A set of non-overlapping registered regions with bounds checks.
///
/// Transports use it twice: the receiver checks every destination range a
/// peer names before a byte is written, and the sender checks every source
/// range before it reads.
#[derive(Clone, Debug, Default)]
pub struct RegionSet {
    /// Sorted by address; no two overlap.
    sorted: Vec<MemoryRegion>,
}

/// Why a set of regions could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    /// A region has zero length or wraps the address space.
    #[error("region at {addr:#x} with length {len} is empty or wraps the address space")]
    Invalid {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// Two regions overlap.
    #[error("regions at {first:#x} and {second:#x} overlap")]
    Overlap {
        /// Start of the lower region.
        first: u64,
        /// Start of the higher region.
        second: u64,
    },
}

impl RegionSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds regions. Identical duplicates are ignored (a layer may be
    /// registered twice); overlapping, empty or wrapping regions are errors
    /// and leave the set unchanged.
    pub fn insert(&mut self, regions: &[MemoryRegion]) -> Result<(), RegionError> {
        if let Some(r) = regions.iter().find(|r| r.len == 0 || r.end().is_none()) {
            return Err(RegionError::Invalid { addr: r.addr, len: r.len });
        }
        let mut next = Vec::with_capacity(self.sorted.len() + regions.len());
        next.extend_from_slice(&self.sorted);
        next.extend_from_slice(regions);
        next.sort_unstable_by_key(|r| (r.addr, r.len));
        next.dedup();
        for pair in next.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            // `end()` is Some for every region admitted above.
            if a.end().is_none_or(|end| end > b.addr) {
                return Err(RegionError::Overlap { first: a.addr, second: b.addr });
            }
        }
        self.sorted = next;
        Ok(())
    }

    /// A set of `ranges` with touching ranges merged (fewer ranges to search
    /// per op); overlapping, empty or wrapping ranges are errors.
    pub fn coalesced(ranges: &[MemoryRegion]) -> Result<Self, RegionError> {
        let mut set = Self::new();
        set.insert(ranges)?;
        let mut merged: Vec<MemoryRegion> = Vec::with_capacity(set.sorted.len());
        for r in set.sorted {
            match merged.last_mut() {
                Some(last) if last.end() == Some(r.addr) => last.len += r.len,
                _ => merged.push(r),
            }
        }
        Ok(Self { sorted: merged })
    }

    /// Whether `[addr, addr + len)` lies entirely inside one registered region.
    /// A zero-length range is inside if its address is inside or at the end
    /// of a region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let idx = self.sorted.partition_point(|r| r.addr <= addr);
        idx > 0 && self.sorted[idx - 1].contains(addr, len)
    }

    /// The registered regions, sorted by address.
    pub fn regions(&self) -> &[MemoryRegion] {
        &self.sorted
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    fn set() -> RegionSet {
        let mut s = RegionSet::new();
        s.insert(&[MemoryRegion::new(1000, 100), MemoryRegion::new(0, 10)]).unwrap();
        s
    }

    #[rstest]
    #[case::inside(1000, 100, true)]
    #[case::inside_tail(1099, 1, true)]
    #[case::past_end(1099, 2, false)]
    #[case::before(999, 1, false)]
    #[case::gap(10, 1, false)]
    #[case::second_region(0, 10, true)]
    #[case::wraps(u64::MAX, 2, false)]
    #[case::zero_len_at_end(1100, 0, true)]
    #[case::zero_len_outside(500, 0, false)]
    fn bounds(#[case] addr: u64, #[case] len: u64, #[case] inside: bool) {
        assert_eq!(set().contains(addr, len), inside);
    }

    #[test]
    fn coalesced_merges_touching_ranges_only() {
        let s = RegionSet::coalesced(&[
            MemoryRegion::new(200, 100),
            MemoryRegion::new(100, 100),
            MemoryRegion::new(400, 10),
            MemoryRegion::new(100, 100),
        ])
        .unwrap();
        assert_eq!(s.regions(), &[MemoryRegion::new(100, 200), MemoryRegion::new(400, 10)]);
        assert!(s.contains(150, 100) && !s.contains(250, 100));
        assert!(RegionSet::coalesced(&[MemoryRegion::new(0, 10), MemoryRegion::new(5, 10)]).is_err());
    }

    #[test]
    fn overlap_and_empty_regions_are_refused() {
        let mut s = set();
        assert!(matches!(s.insert(&[MemoryRegion::new(1050, 100)]), Err(RegionError::Overlap { .. })));
        assert!(matches!(s.insert(&[MemoryRegion::new(5000, 0)]), Err(RegionError::Invalid { .. })));
        assert!(matches!(s.insert(&[MemoryRegion::new(u64::MAX, 2)]), Err(RegionError::Invalid { .. })));
        assert_eq!(s.regions().len(), 2, "a refused insert leaves the set unchanged");
        s.insert(&[MemoryRegion::new(1000, 100)]).unwrap();
        assert_eq!(s.regions().len(), 2, "identical duplicates are ignored");
    }
}
