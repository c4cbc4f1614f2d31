//! The grant fence's bookkeeping, as plain data: which memory windows a
//! grant needs ([`window_specs`]), which are bound for which grant on which
//! connection ([`FenceBook`]), the receiver's free windows ([`WindowPool`]),
//! and the sender's cache of opened grants ([`GrantCache`]).
//!
//! Generic over the window type, so it is tested here with plain numbers;
//! the transport stores verbs memory windows in it. Nothing here waits or
//! touches a device: the transport serialises the steps of one grant (open
//! and revoke) with a per-grant lock it keeps in the book, and does the
//! binding and invalidating itself.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use kv_proto::{GrantId, MemoryRegion};

/// Identifies one control connection (and its queue pair) of a transport.
pub type LinkId = u64;

/// One window a grant needs: a range inside one destination region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSpec {
    /// The region's position in the list given to [`window_specs`].
    pub region: usize,
    /// First byte.
    pub addr: u64,
    /// Length in bytes (never 0).
    pub len: u64,
}

/// Why a grant's ranges cannot be covered by windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A range is not inside one of the regions.
    #[error("range {addr:#x}+{len} is not inside one registered destination region")]
    Outside {
        /// Its first byte.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// Two ranges overlap.
    #[error("ranges at {first:#x} and {second:#x} overlap")]
    Overlap {
        /// The lower one's first byte.
        first: u64,
        /// The higher one's first byte.
        second: u64,
    },
}

/// The windows that cover exactly `ranges`: sorted by address, ranges that
/// touch merged while they stay inside one region (a window is bound over one
/// memory region), empty ranges dropped. `regions` (the destination
/// registrations, which never overlap) need not be sorted.
pub fn window_specs(ranges: &[MemoryRegion], regions: &[MemoryRegion]) -> Result<Vec<WindowSpec>, SpecError> {
    let mut sorted: Vec<MemoryRegion> = ranges.iter().copied().filter(|r| r.len > 0).collect();
    sorted.sort_unstable_by_key(|r| r.addr);
    // Regions by address, for a binary search per range.
    let mut by_addr: Vec<usize> = (0..regions.len()).collect();
    by_addr.sort_unstable_by_key(|&index| regions[index].addr);
    let holder = |range: &MemoryRegion| {
        // Destination regions never overlap: only the last one starting at
        // or below the range can hold it.
        let candidates = by_addr.partition_point(|&index| regions[index].addr <= range.addr);
        let index = *by_addr.get(candidates.checked_sub(1)?)?;
        regions[index].contains(range.addr, range.len).then_some(index)
    };
    let mut specs: Vec<WindowSpec> = Vec::with_capacity(sorted.len());
    for range in sorted {
        let region = holder(&range).ok_or(SpecError::Outside { addr: range.addr, len: range.len })?;
        match specs.last_mut() {
            Some(last) if last.addr + last.len > range.addr => {
                return Err(SpecError::Overlap { first: last.addr, second: range.addr });
            }
            Some(last) if last.region == region && last.addr + last.len == range.addr => last.len += range.len,
            _ => specs.push(WindowSpec { region, addr: range.addr, len: range.len }),
        }
    }
    Ok(specs)
}

/// One issued grant: its windows' specs, the lock that serialises its
/// opens and its revocation, and the windows bound for it per connection.
#[derive(Debug)]
struct Entry<W, K> {
    specs: Arc<[WindowSpec]>,
    key: K,
    bound: Vec<(LinkId, Vec<W>)>,
}

/// Which windows are bound for which live grant on which connection (the
/// receiver's side of the fence).
///
/// Lifecycle of a grant: [`insert`](Self::insert) when issued; per
/// connection that opens it, [`record`](Self::record) the windows bound
/// there; [`remove`](Self::remove) when revoked or expired, which hands back
/// every bound window to invalidate. A connection that ends hands back its
/// windows with [`unlink`](Self::unlink); [`close`](Self::close) hands back
/// all of them and refuses everything after.
#[derive(Debug)]
pub struct FenceBook<W, K> {
    grants: HashMap<GrantId, Entry<W, K>>,
    by_link: HashMap<LinkId, HashSet<GrantId>>,
    closed: bool,
}

impl<W, K> Default for FenceBook<W, K> {
    fn default() -> Self {
        Self { grants: HashMap::new(), by_link: HashMap::new(), closed: false }
    }
}

/// The book is closed (the transport is shut down).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the fence book is closed")]
pub struct BookClosed;

impl<W, K: Clone> FenceBook<W, K> {
    /// An empty, open book.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an issued grant with no window bound yet. An id already present
    /// keeps its entry (ids are random; the grant table refuses duplicates).
    pub fn insert(&mut self, grant: GrantId, specs: Vec<WindowSpec>, key: K) -> Result<(), BookClosed> {
        if self.closed {
            return Err(BookClosed);
        }
        self.grants.entry(grant).or_insert_with(|| Entry { specs: specs.into(), key, bound: Vec::new() });
        Ok(())
    }

    /// The grant's window specs and lock key, if it is in the book.
    pub fn get(&self, grant: &GrantId) -> Option<(Arc<[WindowSpec]>, K)> {
        self.grants.get(grant).map(|entry| (Arc::clone(&entry.specs), entry.key.clone()))
    }

    /// The windows bound for `grant` on `link`, if any.
    pub fn bound(&self, grant: &GrantId, link: LinkId) -> Option<&[W]> {
        let entry = self.grants.get(grant)?;
        entry.bound.iter().find(|(id, _)| *id == link).map(|(_, windows)| windows.as_slice())
    }

    /// Records `windows`, just bound for `grant` on `link`. Gives them back
    /// (to be invalidated or freed) if the grant is no longer in the book,
    /// the book is closed, or windows are already recorded there.
    pub fn record(&mut self, grant: GrantId, link: LinkId, windows: Vec<W>) -> Result<(), Vec<W>> {
        if self.closed {
            return Err(windows);
        }
        let Some(entry) = self.grants.get_mut(&grant) else { return Err(windows) };
        if entry.bound.iter().any(|(id, _)| *id == link) {
            return Err(windows);
        }
        entry.bound.push((link, windows));
        self.by_link.entry(link).or_default().insert(grant);
        Ok(())
    }

    /// Takes `grant` out of the book (revoked or expired) with every window
    /// bound for it, per connection. Later [`get`](Self::get)s miss.
    pub fn remove(&mut self, grant: &GrantId) -> Vec<(LinkId, Vec<W>)> {
        let Some(entry) = self.grants.remove(grant) else { return Vec::new() };
        for (link, _) in &entry.bound {
            self.unindex(*link, grant);
        }
        entry.bound
    }

    /// Takes every window bound on `link` (a connection that ended); the
    /// grants stay live for the other connections.
    pub fn unlink(&mut self, link: LinkId) -> Vec<W> {
        let Some(grants) = self.by_link.remove(&link) else { return Vec::new() };
        let mut windows = Vec::new();
        for grant in grants {
            if let Some(entry) = self.grants.get_mut(&grant) {
                if let Some(at) = entry.bound.iter().position(|(id, _)| *id == link) {
                    windows.extend(entry.bound.swap_remove(at).1);
                }
            }
        }
        windows
    }

    /// Takes every window and grant out and refuses everything after.
    pub fn close(&mut self) -> Vec<W> {
        self.closed = true;
        self.by_link.clear();
        self.grants.drain().flat_map(|(_, entry)| entry.bound).flat_map(|(_, windows)| windows).collect()
    }

    /// Whether any window is bound on `link`.
    pub fn has_windows_on(&self, link: LinkId) -> bool {
        self.by_link.get(&link).is_some_and(|grants| !grants.is_empty())
    }

    /// Grants in the book.
    pub fn grants(&self) -> usize {
        self.grants.len()
    }

    /// Windows bound, over all grants and connections.
    pub fn windows(&self) -> usize {
        self.grants.values().flat_map(|entry| &entry.bound).map(|(_, windows)| windows.len()).sum()
    }

    fn unindex(&mut self, link: LinkId, grant: &GrantId) {
        if let Some(grants) = self.by_link.get_mut(&link) {
            grants.remove(grant);
            if grants.is_empty() {
                self.by_link.remove(&link);
            }
        }
    }
}

/// Free (unbound) windows kept for reuse, at most `capacity`: allocating a
/// window is a system call, binding a free one is only a work request.
#[derive(Debug)]
pub struct WindowPool<W> {
    free: Vec<W>,
    capacity: usize,
}

impl<W> WindowPool<W> {
    /// An empty pool keeping at most `capacity` windows.
    pub fn new(capacity: usize) -> Self {
        Self { free: Vec::new(), capacity }
    }

    /// Up to `count` free windows (fewer if the pool has fewer).
    pub fn take(&mut self, count: usize) -> Vec<W> {
        let keep = self.free.len().saturating_sub(count);
        self.free.split_off(keep)
    }

    /// Returns free windows; those past the capacity are handed back (to be
    /// deallocated).
    pub fn give(&mut self, windows: impl IntoIterator<Item = W>) -> Vec<W> {
        let mut extra = Vec::new();
        for window in windows {
            if self.free.len() < self.capacity {
                self.free.push(window);
            } else {
                extra.push(window);
            }
        }
        extra
    }

    /// Takes every window out and keeps none after (shut down).
    pub fn drain(&mut self) -> Vec<W> {
        self.capacity = 0;
        std::mem::take(&mut self.free)
    }

    /// Free windows held.
    pub fn len(&self) -> usize {
        self.free.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.free.is_empty()
    }
}

/// The sender's opened grants on one connection, most recently used last,
/// at most `capacity` (a grant serves one pull: old ones are never needed
/// again, and one evicted too early costs only a new open request).
#[derive(Debug)]
pub struct GrantCache<T> {
    entries: VecDeque<(GrantId, T)>,
    capacity: usize,
}

impl<T: Clone> GrantCache<T> {
    /// An empty cache of at most `capacity` grants (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self { entries: VecDeque::new(), capacity: capacity.max(1) }
    }

    /// The grant's windows, if cached (it becomes the most recent).
    pub fn get(&mut self, grant: &GrantId) -> Option<T> {
        let at = self.entries.iter().position(|(id, _)| id == grant)?;
        let entry = self.entries.remove(at)?;
        let value = entry.1.clone();
        self.entries.push_back(entry);
        Some(value)
    }

    /// Caches the grant's windows, evicting the least recent past the capacity.
    pub fn insert(&mut self, grant: GrantId, value: T) {
        self.remove(&grant);
        if self.entries.len() >= self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back((grant, value));
    }

    /// Forgets the grant (its windows failed).
    pub fn remove(&mut self, grant: &GrantId) {
        self.entries.retain(|(id, _)| id != grant);
    }

    /// Grants cached.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    fn id(n: u8) -> GrantId {
        GrantId::from_bytes([n; 16])
    }

    fn r(addr: u64, len: u64) -> MemoryRegion {
        MemoryRegion::new(addr, len)
    }

    fn spec(region: usize, addr: u64, len: u64) -> WindowSpec {
        WindowSpec { region, addr, len }
    }

    /// Two destination regions that touch: 0x1000..0x2000 and 0x2000..0x3000.
    fn regions() -> Vec<MemoryRegion> {
        vec![r(0x2000, 0x1000), r(0x1000, 0x1000)]
    }

    #[rstest]
    #[case::one_range(vec![r(0x1100, 0x10)], vec![spec(1, 0x1100, 0x10)])]
    #[case::sorted_by_address(vec![r(0x2100, 0x10), r(0x1100, 0x10)], vec![spec(1, 0x1100, 0x10), spec(0, 0x2100, 0x10)])]
    #[case::touching_ranges_merge(vec![r(0x1110, 0x10), r(0x1100, 0x10)], vec![spec(1, 0x1100, 0x20)])]
    #[case::not_across_regions(vec![r(0x1f00, 0x100), r(0x2000, 0x100)], vec![spec(1, 0x1f00, 0x100), spec(0, 0x2000, 0x100)])]
    #[case::gaps_stay(vec![r(0x1100, 0x10), r(0x1120, 0x10)], vec![spec(1, 0x1100, 0x10), spec(1, 0x1120, 0x10)])]
    #[case::empty_ranges_dropped(vec![r(0x1100, 0), r(0x1200, 0x10)], vec![spec(1, 0x1200, 0x10)])]
    #[case::whole_regions(vec![r(0x1000, 0x1000), r(0x2000, 0x1000)], vec![spec(1, 0x1000, 0x1000), spec(0, 0x2000, 0x1000)])]
    #[case::nothing(vec![], vec![])]
    fn specs_cover_exactly_the_ranges(#[case] ranges: Vec<MemoryRegion>, #[case] expected: Vec<WindowSpec>) {
        assert_eq!(window_specs(&ranges, &regions()), Ok(expected));
    }

    #[rstest]
    #[case::outside(vec![r(0x3000, 1)], SpecError::Outside { addr: 0x3000, len: 1 })]
    #[case::straddles_two_regions(vec![r(0x1ff0, 0x20)], SpecError::Outside { addr: 0x1ff0, len: 0x20 })]
    #[case::overlap(vec![r(0x1100, 0x20), r(0x1110, 0x20)], SpecError::Overlap { first: 0x1100, second: 0x1110 })]
    #[case::wraps(vec![r(u64::MAX, 2)], SpecError::Outside { addr: u64::MAX, len: 2 })]
    fn specs_refuse_bad_ranges(#[case] ranges: Vec<MemoryRegion>, #[case] expected: SpecError) {
        assert_eq!(window_specs(&ranges, &regions()), Err(expected));
    }

    type Book = FenceBook<u32, &'static str>;

    #[test]
    fn a_grant_is_opened_per_link_and_revoked_with_every_window() {
        let mut book = Book::new();
        book.insert(id(1), vec![spec(0, 0x2000, 8)], "lock-1").unwrap();
        let (specs, key) = book.get(&id(1)).unwrap();
        assert_eq!((&specs[..], key), (&[spec(0, 0x2000, 8)][..], "lock-1"));
        assert_eq!(book.bound(&id(1), 7), None);
        book.record(id(1), 7, vec![70]).unwrap();
        book.record(id(1), 8, vec![80]).unwrap();
        assert_eq!(book.bound(&id(1), 7), Some(&[70][..]));
        assert_eq!(book.record(id(1), 7, vec![71]), Err(vec![71]), "one binding per link");
        assert_eq!(book.windows(), 2);
        let mut revoked = book.remove(&id(1));
        revoked.sort_unstable();
        assert_eq!(revoked, vec![(7, vec![70]), (8, vec![80])]);
        assert!(book.get(&id(1)).is_none());
        assert_eq!(book.record(id(1), 9, vec![90]), Err(vec![90]), "a revoked grant binds nothing");
        assert!(book.remove(&id(1)).is_empty(), "revoking twice is harmless");
        assert!(book.unlink(7).is_empty(), "the link index forgot the revoked grant");
    }

    #[test]
    fn a_link_that_ends_gives_back_only_its_windows() {
        let mut book = Book::new();
        book.insert(id(1), vec![], "a").unwrap();
        book.insert(id(2), vec![], "b").unwrap();
        book.record(id(1), 7, vec![10, 11]).unwrap();
        book.record(id(2), 7, vec![20]).unwrap();
        book.record(id(2), 8, vec![21]).unwrap();
        let mut gone = book.unlink(7);
        gone.sort_unstable();
        assert_eq!(gone, vec![10, 11, 20]);
        assert_eq!(book.grants(), 2, "grants outlive a connection");
        assert_eq!(book.bound(&id(2), 8), Some(&[21][..]));
        assert_eq!(book.remove(&id(2)), vec![(8, vec![21])]);
        assert!(book.unlink(7).is_empty());
    }

    #[test]
    fn close_gives_back_everything_and_refuses_after() {
        let mut book = Book::new();
        book.insert(id(1), vec![], "a").unwrap();
        book.record(id(1), 7, vec![1, 2]).unwrap();
        book.record(id(1), 8, vec![3]).unwrap();
        let mut all = book.close();
        all.sort_unstable();
        assert_eq!(all, vec![1, 2, 3]);
        assert_eq!(book.insert(id(2), vec![], "b"), Err(BookClosed));
        assert_eq!(book.record(id(1), 9, vec![4]), Err(vec![4]));
        assert_eq!(book.grants(), 0);
    }

    #[test]
    fn the_pool_keeps_at_most_its_capacity() {
        let mut pool = WindowPool::new(3);
        assert!(pool.take(2).is_empty());
        assert_eq!(pool.give([1, 2, 3, 4, 5]), vec![4, 5]);
        assert_eq!(pool.take(2), vec![2, 3]);
        assert_eq!(pool.take(5), vec![1]);
        assert!(pool.is_empty());
        pool.give([6]);
        assert_eq!(pool.drain(), vec![6]);
        assert_eq!(pool.give([7]), vec![7], "a drained pool keeps nothing");
    }

    #[test]
    fn the_grant_cache_evicts_the_least_recently_used() {
        let mut cache = GrantCache::new(2);
        cache.insert(id(1), "one");
        cache.insert(id(2), "two");
        assert_eq!(cache.get(&id(1)), Some("one"));
        cache.insert(id(3), "three");
        assert_eq!(cache.get(&id(2)), None, "two was the least recent");
        assert_eq!(cache.get(&id(1)), Some("one"));
        assert_eq!(cache.get(&id(3)), Some("three"));
        cache.insert(id(3), "three again");
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&id(3)), Some("three again"));
        cache.remove(&id(3));
        assert_eq!(cache.get(&id(3)), None);
        assert_eq!(cache.len(), 1);
    }
}
