//! Memory regions and write operations: what a [`crate::BatchWriter`] moves.

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

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
        let mut next = self.sorted.clone();
        for r in regions {
            if r.len == 0 || r.end().is_none() {
                return Err(RegionError::Invalid { addr: r.addr, len: r.len });
            }
            if !next.contains(r) {
                next.push(*r);
            }
        }
        next.sort_by_key(|r| r.addr);
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

/// A transport's registered memory, shared by its tasks: the regions, and the
/// flag that ends all access to them.
///
/// This type touches no memory itself; it is the bookkeeping every
/// transport's one raw-memory module builds on. The invariant it carries:
/// every raw access happens while [`RegisteredMemory::read`]'s guard is held
/// and [`RegisteredState::is_closed`] is false. [`RegisteredMemory::close`]
/// takes the write lock, so once it returns no access is in progress and none
/// can start, and the owner may free its regions. Regions are never removed
/// before that, so a range checked once stays valid while the guard is held.
#[derive(Debug, Default)]
pub struct RegisteredMemory {
    state: RwLock<RegisteredState>,
}

/// What [`RegisteredMemory::read`] guards.
#[derive(Debug, Default)]
pub struct RegisteredState {
    regions: RegionSet,
    closed: bool,
}

impl RegisteredState {
    /// Whether access has ended.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The registered regions.
    pub fn regions(&self) -> &RegionSet {
        &self.regions
    }
}

/// Why a batch's sources cannot be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceError {
    /// A source range is outside every region (or longer than `usize`).
    Outside {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The lengths, up to this op's, add up to more than `u64::MAX`.
    TotalOverflows {
        /// Start address of the op that overflows the total.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// The memory is closed (the transport is shut down).
    Closed,
}

/// Why a peer's op list cannot be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DestinationError {
    /// The ops' lengths do not add up to the header's total (`None`: the sum
    /// overflows `u64`): a protocol error.
    LengthMismatch {
        /// The header's total.
        declared: u64,
        /// The ops' sum.
        sum: Option<u64>,
    },
    /// Op `index` falls outside every region: the batch is refused whole.
    Outside {
        /// Index of the first such op.
        index: usize,
        /// Its destination.
        dst: u64,
        /// Its length.
        len: u64,
    },
    /// The memory is closed (the transport is shut down).
    Closed,
}

impl RegisteredMemory {
    /// No regions, open.
    pub fn new() -> Self {
        Self::default()
    }

    /// The state, read-locked: hold the guard across every raw access.
    pub fn read(&self) -> RwLockReadGuard<'_, RegisteredState> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, RegisteredState> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds regions.
    ///
    /// # Safety
    ///
    /// Each region must be valid for reads and writes until
    /// [`RegisteredMemory::close`] has returned: the transport relies on it
    /// for every range this type admits.
    pub unsafe fn register(&self, regions: &[MemoryRegion]) -> Result<(), RegionError> {
        self.write().regions.insert(regions)
    }

    /// The registered regions, sorted by address.
    pub fn regions(&self) -> Vec<MemoryRegion> {
        self.read().regions.regions().to_vec()
    }

    /// Ends all access; once this returns no admitted access is in progress.
    pub fn close(&self) {
        self.write().closed = true;
    }

    /// Checks every op's source range; returns the payload's total length.
    pub fn check_sources(&self, ops: &[WriteOp]) -> Result<u64, SourceError> {
        let state = self.read();
        if state.closed {
            return Err(SourceError::Closed);
        }
        let mut total = 0u64;
        for op in ops {
            if !state.regions.contains(op.src, op.len) || usize::try_from(op.len).is_err() {
                return Err(SourceError::Outside { addr: op.src, len: op.len });
            }
            total = total.checked_add(op.len).ok_or(SourceError::TotalOverflows { addr: op.src, len: op.len })?;
        }
        Ok(total)
    }

    /// Checks a peer's `(dst, len)` list: the lengths must add up to
    /// `declared` and every destination must lie inside one region.
    pub fn check_destinations(
        &self,
        ops: impl IntoIterator<Item = (u64, u64)>,
        declared: u64,
    ) -> Result<(), DestinationError> {
        let state = self.read();
        if state.closed {
            return Err(DestinationError::Closed);
        }
        let mut sum = Some(0u64);
        let mut outside = None;
        for (index, (dst, len)) in ops.into_iter().enumerate() {
            sum = sum.and_then(|s| s.checked_add(len));
            if outside.is_none() && (!state.regions.contains(dst, len) || usize::try_from(len).is_err()) {
                outside = Some(DestinationError::Outside { index, dst, len });
            }
        }
        if sum != Some(declared) {
            return Err(DestinationError::LengthMismatch { declared, sum });
        }
        outside.map_or(Ok(()), Err)
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
    fn registered_memory_checks_sources_and_destinations_until_closed() {
        let mem = RegisteredMemory::new();
        // SAFETY: these addresses are never dereferenced; this type only checks ranges.
        unsafe { mem.register(&[MemoryRegion::new(1000, 100)]) }.unwrap();
        let ops = [WriteOp { src: 1000, dst: 1050, len: 50 }, WriteOp { src: 1050, dst: 1000, len: 50 }];
        assert_eq!(mem.check_sources(&ops), Ok(100));
        assert_eq!(
            mem.check_sources(&[WriteOp { src: 1090, dst: 0, len: 20 }]),
            Err(SourceError::Outside { addr: 1090, len: 20 })
        );
        assert_eq!(mem.check_destinations([(1000, 60), (1060, 40)], 100), Ok(()));
        assert_eq!(
            mem.check_destinations([(1000, 60), (1090, 40)], 100),
            Err(DestinationError::Outside { index: 1, dst: 1090, len: 40 })
        );
        assert_eq!(
            mem.check_destinations([(1000, 60)], 100),
            Err(DestinationError::LengthMismatch { declared: 100, sum: Some(60) })
        );
        assert_eq!(
            mem.check_destinations([(1000, u64::MAX), (1000, 1)], 0),
            Err(DestinationError::LengthMismatch { declared: 0, sum: None })
        );
        mem.close();
        assert!(mem.read().is_closed());
        assert_eq!(mem.check_sources(&ops), Err(SourceError::Closed));
        assert_eq!(mem.check_destinations([(1000, 1)], 1), Err(DestinationError::Closed));
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
