//! Registered regions as the planner sees them: plain numbers, no device.
//!
//! A [`LocalRegion`] is memory this side registered (its lkey goes into the
//! scatter-gather entries); a [`RemoteRegion`] is what the peer advertised
//! (its rkey goes into the work request). [`RegionTable`] finds the region
//! that holds a whole range, or none.

/// A range of this process's memory registered with the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalRegion {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The memory region's local key.
    pub lkey: u32,
}

/// A range of the peer's memory it registered for remote writes, as it
/// advertised it in the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// First byte, in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The memory region's remote key.
    pub rkey: u32,
}

/// A region of either kind, as a range of addresses.
pub trait Region: Copy {
    /// First byte.
    fn base(&self) -> u64;
    /// Length in bytes.
    fn size(&self) -> u64;
}

impl Region for LocalRegion {
    fn base(&self) -> u64 {
        self.addr
    }
    fn size(&self) -> u64 {
        self.len
    }
}

impl Region for RemoteRegion {
    fn base(&self) -> u64 {
        self.addr
    }
    fn size(&self) -> u64 {
        self.len
    }
}

/// Why a set of regions was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionTableError {
    /// A region is empty or runs past the end of the address space.
    #[error("region {index} ({addr:#x}, {len} bytes) is empty or wraps the address space")]
    Invalid {
        /// Position in the list given.
        index: usize,
        /// Its first byte.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// Two regions share bytes.
    #[error("regions at {first:#x} and {second:#x} overlap")]
    Overlap {
        /// The lower region's first byte.
        first: u64,
        /// The higher region's first byte.
        second: u64,
    },
}

/// Non-overlapping regions sorted by address, for range lookups in
/// `O(log n)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionTable<R> {
    sorted: Vec<R>,
}

impl<R> Default for RegionTable<R> {
    fn default() -> Self {
        Self { sorted: Vec::new() }
    }
}

impl<R: Region> RegionTable<R> {
    /// Sorts and checks `regions`: none empty, none wrapping, none overlapping.
    pub fn new(mut regions: Vec<R>) -> Result<Self, RegionTableError> {
        for (index, region) in regions.iter().enumerate() {
            if region.size() == 0 || region.base().checked_add(region.size()).is_none() {
                return Err(RegionTableError::Invalid { index, addr: region.base(), len: region.size() });
            }
        }
        regions.sort_by_key(Region::base);
        for pair in regions.windows(2) {
            if let [lower, higher] = pair {
                if lower.base() + lower.size() > higher.base() {
                    return Err(RegionTableError::Overlap { first: lower.base(), second: higher.base() });
                }
            }
        }
        Ok(Self { sorted: regions })
    }

    /// The region holding all of `[addr, addr + len)`, with its position in
    /// address order; `None` if no single region does (or the range wraps).
    pub fn find(&self, addr: u64, len: u64) -> Option<(usize, R)> {
        let end = addr.checked_add(len)?;
        // The last region starting at or below `addr` is the only candidate.
        let index = self.sorted.partition_point(|region| region.base() <= addr).checked_sub(1)?;
        let region = *self.sorted.get(index)?;
        (end <= region.base() + region.size()).then_some((index, region))
    }

    /// The regions, in address order.
    pub fn regions(&self) -> &[R] {
        &self.sorted
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    fn remote(addr: u64, len: u64, rkey: u32) -> RemoteRegion {
        RemoteRegion { addr, len, rkey }
    }

    fn table() -> RegionTable<RemoteRegion> {
        RegionTable::new(vec![remote(0x3000, 0x1000, 3), remote(0x1000, 0x1000, 1), remote(0x2000, 0x800, 2)]).unwrap()
    }

    #[rstest]
    #[case::first_byte(0x1000, 1, Some(1))]
    #[case::whole_region(0x1000, 0x1000, Some(1))]
    #[case::last_byte(0x3fff, 1, Some(3))]
    #[case::middle(0x3100, 0x100, Some(3))]
    #[case::before_all(0xfff, 1, None)]
    #[case::straddles_two(0x1f00, 0x200, None)]
    #[case::runs_past_end(0x2700, 0x200, None)]
    #[case::in_the_gap(0x2900, 1, None)]
    #[case::after_all(0x4000, 1, None)]
    #[case::wraps(u64::MAX, 2, None)]
    fn finds_the_one_region_holding_a_range(#[case] addr: u64, #[case] len: u64, #[case] rkey: Option<u32>) {
        assert_eq!(table().find(addr, len).map(|(_, region)| region.rkey), rkey);
    }

    #[test]
    fn empty_wrapping_and_overlapping_regions_are_refused() {
        assert!(matches!(
            RegionTable::new(vec![remote(0x1000, 0, 1)]),
            Err(RegionTableError::Invalid { index: 0, .. })
        ));
        assert!(matches!(
            RegionTable::new(vec![remote(u64::MAX - 1, 4, 1)]),
            Err(RegionTableError::Invalid { index: 0, .. })
        ));
        assert_eq!(
            RegionTable::new(vec![remote(0x1800, 0x1000, 2), remote(0x1000, 0x1000, 1)]).unwrap_err(),
            RegionTableError::Overlap { first: 0x1000, second: 0x1800 }
        );
    }
}
