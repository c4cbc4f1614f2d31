//! A transport's registered memory and its grants: the one copy of the
//! checks that keep peers out of memory, which every transport's raw-memory
//! module builds on.
//!
//! This type touches no memory itself. What it guarantees, given that every
//! raw access goes through it:
//! - sources ([`RegionAccess::Source`]) are only ever read, and only while
//!   the memory is open ([`RegisteredMemory::read_sources`]);
//! - destinations are written only through a [`GrantAccess`], which
//!   [`RegisteredMemory::admit`] hands out for a batch whose every op lies
//!   inside one live grant, and only while that grant is live
//!   ([`GrantAccess::with`]);
//! - [`RegisteredMemory::revoke`] is a fence: it takes the grant's write
//!   lock, so once it returns no access under that grant is in progress and
//!   none can start;
//! - [`RegisteredMemory::close`] ends every access (sources and all grants)
//!   the same way, after which the owner may free its regions.
//!
//! Time enters as an argument (`now`); nothing here reads a clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use crate::grant::{GrantError, GrantId};
use crate::memory::{MemoryRegion, RegionAccess, RegionError, RegionSet, WriteOp};
use crate::stats::{BatchRefusal, TransportCounters, TransportStats};
use crate::writer::TransportError;

/// A transport's registered regions, their grants, and the flag that ends
/// all access. Shared by the transport's tasks.
#[derive(Debug, Default)]
pub struct RegisteredMemory {
    state: RwLock<State>,
    grants: Mutex<HashMap<GrantId, Arc<GrantEntry>>>,
    counters: TransportCounters,
}

#[derive(Debug, Default)]
struct State {
    sources: RegionSet,
    destinations: RegionSet,
    closed: bool,
}

impl State {
    fn insert(&mut self, regions: &[MemoryRegion], access: RegionAccess) -> Result<(), RegionError> {
        match access {
            RegionAccess::Source => self.sources.insert(regions),
            RegionAccess::Destination => self.destinations.insert(regions),
        }
    }
}

#[derive(Debug)]
struct GrantEntry {
    id: GrantId,
    ranges: RegionSet,
    expires_at: Instant,
    /// Read-locked across every access under the grant; `false` once revoked.
    live: RwLock<bool>,
}

impl GrantEntry {
    /// Ends the grant; returns once no access under it is in progress.
    fn fence(&self) {
        *self.live.write().unwrap_or_else(PoisonError::into_inner) = false;
    }
}

/// Why a batch's sources cannot be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceError {
    /// A source range is outside every source region (or longer than `usize`).
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

/// Why a peer's batch cannot be written.
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
    /// No live grant has this id (never issued, revoked, or expired and
    /// purged): the batch is refused whole.
    UnknownGrant,
    /// The grant's validity ran out: the batch is refused whole.
    ExpiredGrant,
    /// Op `index` is not inside the grant's ranges: the batch is refused whole.
    OutsideGrant {
        /// Index of the first such op.
        index: usize,
        /// Its destination.
        dst: u64,
        /// Its length.
        len: u64,
    },
    /// Two ops of the batch write the same bytes (always a sender's bug):
    /// the batch is refused whole.
    OverlappingOps {
        /// Where the later-starting of the two begins.
        dst: u64,
    },
    /// The memory is closed (the transport is shut down).
    Closed,
}

impl std::fmt::Display for DestinationError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DestinationError::LengthMismatch { declared, sum: Some(sum) } => {
                write!(f, "op lengths add up to {sum}, the header says {declared}")
            }
            DestinationError::LengthMismatch { declared, sum: None } => {
                write!(f, "op lengths add up to more than u64::MAX, the header says {declared}")
            }
            DestinationError::UnknownGrant => f.write_str("no live grant has this id (unknown or revoked)"),
            DestinationError::ExpiredGrant => f.write_str("the grant has expired"),
            DestinationError::OutsideGrant { index, dst, len } => {
                write!(f, "op {index}: destination {dst:#x}+{len} is outside the grant")
            }
            DestinationError::OverlappingOps { dst } => {
                write!(f, "two ops of the batch write the bytes at {dst:#x}")
            }
            DestinationError::Closed => f.write_str("the transport's memory is closed"),
        }
    }
}

/// An access attempted after the grant was revoked (or the memory closed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the grant was revoked")]
pub struct Revoked;

/// An access attempted after [`RegisteredMemory::close`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the transport's memory is closed (shut down)")]
pub struct MemoryClosed;

/// Permission to write one admitted batch: every op was checked inside the
/// grant. Raw writes happen only inside [`GrantAccess::with`].
#[derive(Debug)]
pub struct GrantAccess {
    entry: Arc<GrantEntry>,
}

impl GrantAccess {
    /// The grant the batch names.
    pub fn id(&self) -> GrantId {
        self.entry.id
    }

    /// Runs `f` (a short, non-blocking raw write into the admitted ranges)
    /// while the grant is live; `Err(Revoked)` without running it otherwise.
    /// A revocation waits for `f` to return.
    pub fn with<R>(&self, f: impl FnOnce() -> R) -> Result<R, Revoked> {
        let live = self.entry.live.read().unwrap_or_else(PoisonError::into_inner);
        if *live {
            Ok(f())
        } else {
            Err(Revoked)
        }
    }

    /// Whether the grant is still live.
    pub fn is_live(&self) -> bool {
        *self.entry.live.read().unwrap_or_else(PoisonError::into_inner)
    }
}

impl RegisteredMemory {
    /// No regions, no grants, open.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_grants(&self) -> MutexGuard<'_, HashMap<GrantId, Arc<GrantEntry>>> {
        self.grants.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds regions with the given access.
    ///
    /// # Safety
    ///
    /// Each region must be valid for reads (sources) or reads and writes
    /// (destinations) until [`RegisteredMemory::close`] has returned: the
    /// transport relies on it for every range this type admits.
    pub unsafe fn register(&self, regions: &[MemoryRegion], access: RegionAccess) -> Result<(), RegionError> {
        self.write().insert(regions, access)
    }

    /// [`Self::register`] as a transport's `BatchWriter::register_regions`
    /// does it: refused with [`TransportError::Shutdown`] once the memory is
    /// closed, checked under the same lock as the insert so a racing close
    /// cannot slip between them.
    ///
    /// # Safety
    ///
    /// As for [`Self::register`].
    pub unsafe fn register_while_open(
        &self,
        regions: &[MemoryRegion],
        access: RegionAccess,
    ) -> Result<(), TransportError> {
        let mut state = self.write();
        if state.closed {
            return Err(TransportError::Shutdown);
        }
        Ok(state.insert(regions, access)?)
    }

    /// The regions registered with `access`, sorted by address.
    pub fn regions(&self, access: RegionAccess) -> Vec<MemoryRegion> {
        let state = self.read();
        match access {
            RegionAccess::Source => state.sources.regions().to_vec(),
            RegionAccess::Destination => state.destinations.regions().to_vec(),
        }
    }

    /// Whether [`RegisteredMemory::close`] has run.
    pub fn is_closed(&self) -> bool {
        self.read().closed
    }

    /// Issues a grant with a fresh random id over `ranges` (each inside one
    /// destination region), valid for `valid_for` from `now`: what every
    /// transport's `grant` does. Returns the id.
    pub fn grant(&self, ranges: &[MemoryRegion], now: Instant, valid_for: Duration) -> Result<GrantId, GrantError> {
        let id = GrantId::random().ok_or(GrantError::NoRandomness)?;
        self.issue_grant(id, ranges, now, valid_for)?;
        Ok(id)
    }

    /// Issues grant `id` over `ranges` (each inside one destination region),
    /// valid for `valid_for` from `now`. Grants that expired by `now` are
    /// purged (and fenced) on the way.
    pub fn issue_grant(
        &self,
        id: GrantId,
        ranges: &[MemoryRegion],
        now: Instant,
        valid_for: Duration,
    ) -> Result<(), GrantError> {
        {
            let state = self.read();
            if state.closed {
                return Err(GrantError::Closed);
            }
            if let Some(r) = ranges.iter().find(|r| !state.destinations.contains(r.addr, r.len) || r.len == 0) {
                return Err(GrantError::OutsideDestinations { addr: r.addr, len: r.len });
            }
        }
        let ranges = RegionSet::coalesced(ranges).map_err(|e| match e {
            RegionError::Overlap { first, second } => GrantError::Overlap { first, second },
            RegionError::Invalid { addr, len } => GrantError::OutsideDestinations { addr, len },
        })?;
        let expires_at = now.checked_add(valid_for).unwrap_or(now + Duration::from_secs(365 * 24 * 3600));
        let entry = Arc::new(GrantEntry { id, ranges, expires_at, live: RwLock::new(true) });
        let expired: Vec<Arc<GrantEntry>> = {
            let mut grants = self.lock_grants();
            if grants.contains_key(&id) {
                return Err(GrantError::Duplicate(id));
            }
            let expired: Vec<GrantId> = grants.values().filter(|g| g.expires_at <= now).map(|g| g.id).collect();
            let expired = expired.iter().filter_map(|id| grants.remove(id)).collect();
            grants.insert(id, entry);
            expired
        };
        expired.iter().for_each(|g| g.fence());
        // A close that ran meanwhile drained the map before this insert:
        // fence the new grant too, so nothing outlives the close.
        if self.is_closed() {
            self.revoke(&id);
            return Err(GrantError::Closed);
        }
        Ok(())
    }

    /// Revokes grant `id`: once this returns no access under it is in
    /// progress and none can start, also when another revocation of it is
    /// racing this one. Returns whether it was still known.
    pub fn revoke(&self, id: &GrantId) -> bool {
        // Fence first, then forget: a second revoker that races this one
        // finds the entry and waits on the same fence, so neither returns
        // while an access under the grant is still in progress.
        let Some(entry) = self.lock_grants().get(id).cloned() else { return false };
        entry.fence();
        let mut grants = self.lock_grants();
        if grants.get(id).is_some_and(|e| Arc::ptr_eq(e, &entry)) {
            grants.remove(id);
        }
        true
    }

    /// Grants issued and neither revoked nor purged.
    pub fn live_grants(&self) -> usize {
        self.lock_grants().len()
    }

    /// Whether `grant` is live at `now` (issued here, neither revoked nor
    /// expired, the memory not closed): what a receiver asks before it
    /// buffers a batch's op list. Admitting the ops is [`Self::admit`].
    pub fn check_grant(&self, grant: &GrantId, now: Instant) -> Result<(), DestinationError> {
        self.live_entry(grant, now).map(drop).inspect_err(|e| self.counters.refused(BatchRefusal::from(e)))
    }

    /// The counters of refusals and failed authentications (this type
    /// counts the refusals of [`Self::check_grant`] and [`Self::admit`]; the
    /// transport counts the rest).
    pub fn counters(&self) -> &TransportCounters {
        &self.counters
    }

    /// What the transport's `stats` reports: live grants and the counters.
    pub fn stats(&self) -> TransportStats {
        self.counters.snapshot(self.live_grants())
    }

    /// The entry of `grant` if it is live at `now`; an expired one is
    /// purged (and fenced) on the way.
    fn live_entry(&self, grant: &GrantId, now: Instant) -> Result<Arc<GrantEntry>, DestinationError> {
        if self.is_closed() {
            return Err(DestinationError::Closed);
        }
        let mut grants = self.lock_grants();
        let Some(entry) = grants.get(grant).cloned() else { return Err(DestinationError::UnknownGrant) };
        if !*entry.live.read().unwrap_or_else(PoisonError::into_inner) {
            return Err(DestinationError::UnknownGrant);
        }
        if entry.expires_at <= now {
            grants.remove(grant);
            drop(grants);
            entry.fence();
            return Err(DestinationError::ExpiredGrant);
        }
        Ok(entry)
    }

    /// Checks a peer's batch: the ops' lengths must add up to `declared`, the
    /// grant must be live at `now`, and every op must lie inside one of its
    /// ranges. The result is the only way to write the batch.
    pub fn admit(
        &self,
        grant: &GrantId,
        ops: impl IntoIterator<Item = (u64, u64)> + Clone,
        declared: u64,
        now: Instant,
    ) -> Result<GrantAccess, DestinationError> {
        self.admit_uncounted(grant, ops, declared, now).inspect_err(|e| self.counters.refused(BatchRefusal::from(e)))
    }

    fn admit_uncounted(
        &self,
        grant: &GrantId,
        ops: impl IntoIterator<Item = (u64, u64)> + Clone,
        declared: u64,
        now: Instant,
    ) -> Result<GrantAccess, DestinationError> {
        let mut sum = Some(0u64);
        for (_, len) in ops.clone() {
            sum = sum.and_then(|s| s.checked_add(len));
        }
        if sum != Some(declared) {
            return Err(DestinationError::LengthMismatch { declared, sum });
        }
        let entry = self.live_entry(grant, now)?;
        // One pass checks the grant and, for ops in ascending order (the
        // common case), that none overlaps the previous one.
        let mut ascending_end = Some(0u64);
        for (index, (dst, len)) in ops.clone().into_iter().enumerate() {
            if !entry.ranges.contains(dst, len) || usize::try_from(len).is_err() {
                return Err(DestinationError::OutsideGrant { index, dst, len });
            }
            if len > 0 {
                // `dst + len` fits: the range lies inside a grant range.
                ascending_end = ascending_end.filter(|&end| dst >= end).map(|_| dst + len);
            }
        }
        if ascending_end.is_none() {
            crate::dataplane::first_overlap(ops).map_or(Ok(()), |dst| Err(DestinationError::OverlappingOps { dst }))?;
        }
        Ok(GrantAccess { entry })
    }

    /// Checks every op's source range against the source regions; returns
    /// the payload's total length.
    pub fn check_sources(&self, ops: &[WriteOp]) -> Result<u64, SourceError> {
        let state = self.read();
        if state.closed {
            return Err(SourceError::Closed);
        }
        let mut total = 0u64;
        for op in ops {
            if !state.sources.contains(op.src, op.len) || usize::try_from(op.len).is_err() {
                return Err(SourceError::Outside { addr: op.src, len: op.len });
            }
            total = total.checked_add(op.len).ok_or(SourceError::TotalOverflows { addr: op.src, len: op.len })?;
        }
        Ok(total)
    }

    /// Runs `f` (a short, non-blocking raw read of checked source ranges)
    /// while the memory is open; [`RegisteredMemory::close`] waits for it.
    pub fn read_sources<R>(&self, f: impl FnOnce() -> R) -> Result<R, MemoryClosed> {
        let state = self.read();
        if state.closed {
            Err(MemoryClosed)
        } else {
            Ok(f())
        }
    }

    /// Ends all access: once this returns no read of a source and no write
    /// under any grant is in progress, none can start, and no grant can be
    /// issued. The owner may then free its regions.
    pub fn close(&self) {
        self.write().closed = true;
        let grants: Vec<Arc<GrantEntry>> = self.lock_grants().drain().map(|(_, g)| g).collect();
        grants.iter().for_each(|g| g.fence());
    }
}

/// A batch's source ranges, each checked inside a source region
/// ([`RegisteredMemory::check_sources`]): the payload a transport may read
/// (inside [`RegisteredMemory::read_sources`]) to send it.
#[derive(Debug, Clone, Copy)]
pub struct CheckedSources<'m, 'o> {
    memory: &'m RegisteredMemory,
    ops: &'o [WriteOp],
    total: u64,
}

impl<'m, 'o> CheckedSources<'m, 'o> {
    /// Checks every op's source range in `memory`.
    pub fn check(memory: &'m RegisteredMemory, ops: &'o [WriteOp]) -> Result<Self, SourceError> {
        let total = memory.check_sources(ops)?;
        Ok(Self { memory, ops, total })
    }

    /// The memory the sources were checked in.
    pub fn memory(&self) -> &'m RegisteredMemory {
        self.memory
    }

    /// The ops.
    pub fn ops(&self) -> &'o [WriteOp] {
        self.ops
    }

    /// The payload's length.
    pub fn total(&self) -> u64 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory() -> RegisteredMemory {
        let mem = RegisteredMemory::new();
        // SAFETY: these addresses are never dereferenced; this type only checks ranges.
        unsafe {
            mem.register(&[MemoryRegion::new(1000, 100)], RegionAccess::Source).unwrap();
            mem.register(&[MemoryRegion::new(5000, 1000)], RegionAccess::Destination).unwrap();
        }
        mem
    }

    fn id(n: u8) -> GrantId {
        GrantId::from_bytes([n; 16])
    }

    #[test]
    fn checked_sources_keep_the_ops_and_their_total() {
        let mem = memory();
        let ops = [WriteOp { src: 1000, dst: 0, len: 60 }, WriteOp { src: 1099, dst: 0, len: 2 }];
        assert_eq!(CheckedSources::check(&mem, &ops).unwrap_err(), SourceError::Outside { addr: 1099, len: 2 });
        let checked = CheckedSources::check(&mem, &ops[..1]).unwrap();
        assert_eq!((checked.ops(), checked.total()), (&ops[..1], 60));
        assert!(std::ptr::eq(checked.memory(), &mem));
        mem.close();
        assert_eq!(CheckedSources::check(&mem, &ops[..1]).unwrap_err(), SourceError::Closed);
    }

    #[test]
    fn sources_are_checked_against_source_regions_only() {
        let mem = memory();
        let ops = [WriteOp { src: 1000, dst: 0, len: 50 }, WriteOp { src: 1050, dst: 0, len: 50 }];
        assert_eq!(mem.check_sources(&ops), Ok(100));
        assert_eq!(
            mem.check_sources(&[WriteOp { src: 5000, dst: 0, len: 1 }]),
            Err(SourceError::Outside { addr: 5000, len: 1 }),
            "a destination is not a source"
        );
        assert_eq!(
            mem.check_sources(&[WriteOp { src: 1000, dst: 0, len: 100 }, WriteOp { src: 1000, dst: 0, len: u64::MAX }]),
            Err(SourceError::Outside { addr: 1000, len: u64::MAX })
        );
    }

    #[test]
    fn the_grant_check_sees_live_grants_only() {
        let mem = memory();
        let now = Instant::now();
        let ttl = Duration::from_secs(10);
        mem.issue_grant(id(1), &[MemoryRegion::new(5100, 100)], now, ttl).unwrap();
        mem.issue_grant(id(2), &[MemoryRegion::new(5300, 100)], now, ttl).unwrap();
        assert_eq!(mem.check_grant(&id(1), now), Ok(()));
        assert_eq!(mem.check_grant(&id(9), now), Err(DestinationError::UnknownGrant));
        assert_eq!(mem.check_grant(&id(1), now + ttl), Err(DestinationError::ExpiredGrant));
        assert_eq!(mem.check_grant(&id(1), now), Err(DestinationError::UnknownGrant), "an expired grant is purged");
        assert_eq!(mem.live_grants(), 1);
        mem.revoke(&id(2));
        assert_eq!(mem.check_grant(&id(2), now), Err(DestinationError::UnknownGrant));
        mem.close();
        assert_eq!(mem.check_grant(&id(2), now), Err(DestinationError::Closed));
    }

    #[test]
    fn grants_cover_only_their_ranges_of_destination_memory() {
        let mem = memory();
        let now = Instant::now();
        let ttl = Duration::from_secs(10);
        assert_eq!(
            mem.issue_grant(id(1), &[MemoryRegion::new(1000, 10)], now, ttl),
            Err(GrantError::OutsideDestinations { addr: 1000, len: 10 }),
            "sources can never be granted"
        );
        assert!(matches!(
            mem.issue_grant(id(1), &[MemoryRegion::new(5000, 10), MemoryRegion::new(5005, 10)], now, ttl),
            Err(GrantError::Overlap { .. })
        ));
        mem.issue_grant(id(1), &[MemoryRegion::new(5100, 100), MemoryRegion::new(5200, 100)], now, ttl).unwrap();
        assert_eq!(mem.issue_grant(id(1), &[MemoryRegion::new(5500, 1)], now, ttl), Err(GrantError::Duplicate(id(1))));
        let access = mem.admit(&id(1), [(5100, 150), (5250, 50)], 200, now).unwrap();
        assert_eq!(access.id(), id(1));
        assert_eq!(
            mem.admit(&id(1), [(5100, 50), (5000, 50)], 100, now).unwrap_err(),
            DestinationError::OutsideGrant { index: 1, dst: 5000, len: 50 },
            "registered but not granted"
        );
        assert_eq!(mem.admit(&id(2), [(5100, 1)], 1, now).unwrap_err(), DestinationError::UnknownGrant);
        assert_eq!(
            mem.admit(&id(1), [(5100, 1)], 2, now).unwrap_err(),
            DestinationError::LengthMismatch { declared: 2, sum: Some(1) }
        );
        assert_eq!(
            mem.admit(&id(1), [(5100, u64::MAX), (5100, 2)], 1, now).unwrap_err(),
            DestinationError::LengthMismatch { declared: 1, sum: None }
        );
    }

    #[test]
    fn overlapping_ops_are_refused_in_any_order() {
        let mem = memory();
        let now = Instant::now();
        mem.issue_grant(id(1), &[MemoryRegion::new(5000, 1000)], now, Duration::from_secs(10)).unwrap();
        assert!(mem.admit(&id(1), [(5000, 10), (5010, 10), (5100, 0), (5100, 5)], 25, now).is_ok());
        assert!(mem.admit(&id(1), [(5500, 10), (5000, 10), (5020, 10)], 30, now).is_ok(), "unsorted, disjoint");
        assert_eq!(
            mem.admit(&id(1), [(5000, 10), (5005, 10)], 20, now).unwrap_err(),
            DestinationError::OverlappingOps { dst: 5005 }
        );
        assert_eq!(
            mem.admit(&id(1), [(5500, 10), (5000, 100), (5050, 1)], 111, now).unwrap_err(),
            DestinationError::OverlappingOps { dst: 5050 }
        );
        assert_eq!(
            mem.admit(&id(1), [(5000, 10), (5000, 10)], 20, now).unwrap_err(),
            DestinationError::OverlappingOps { dst: 5000 }
        );
    }

    #[test]
    fn revoke_is_a_fence_and_expiry_refuses() {
        let mem = memory();
        let now = Instant::now();
        mem.issue_grant(id(1), &[MemoryRegion::new(5000, 100)], now, Duration::from_secs(1)).unwrap();
        let access = mem.admit(&id(1), [(5000, 10)], 10, now).unwrap();
        assert_eq!(access.with(|| 7), Ok(7));
        assert!(mem.revoke(&id(1)));
        assert!(!mem.revoke(&id(1)), "revoking twice is harmless");
        assert_eq!(access.with(|| 7), Err(Revoked), "an admitted batch stops at the fence");
        assert_eq!(mem.admit(&id(1), [(5000, 10)], 10, now).unwrap_err(), DestinationError::UnknownGrant);

        mem.issue_grant(id(2), &[MemoryRegion::new(5000, 100)], now, Duration::from_secs(1)).unwrap();
        let later = now + Duration::from_secs(1);
        assert_eq!(mem.admit(&id(2), [(5000, 10)], 10, later).unwrap_err(), DestinationError::ExpiredGrant);
        assert_eq!(mem.live_grants(), 0, "an expired grant is purged");
        mem.issue_grant(id(3), &[MemoryRegion::new(5000, 100)], now, Duration::from_secs(1)).unwrap();
        mem.issue_grant(id(4), &[MemoryRegion::new(5000, 100)], later, Duration::from_secs(1)).unwrap();
        assert_eq!(mem.live_grants(), 1, "issuing purges grants expired by then");
    }

    #[test]
    fn close_ends_every_access() {
        let mem = memory();
        let now = Instant::now();
        mem.issue_grant(id(1), &[MemoryRegion::new(5000, 100)], now, Duration::from_secs(10)).unwrap();
        let access = mem.admit(&id(1), [(5000, 10)], 10, now).unwrap();
        mem.close();
        assert!(mem.is_closed());
        assert_eq!(access.with(|| ()), Err(Revoked));
        assert_eq!(mem.read_sources(|| ()), Err(MemoryClosed));
        assert_eq!(mem.check_sources(&[WriteOp { src: 1000, dst: 0, len: 1 }]), Err(SourceError::Closed));
        assert_eq!(mem.admit(&id(1), [(5000, 10)], 10, now).unwrap_err(), DestinationError::Closed);
        assert_eq!(
            mem.issue_grant(id(2), &[MemoryRegion::new(5000, 1)], now, Duration::from_secs(1)),
            Err(GrantError::Closed)
        );
    }

    #[test]
    fn a_revocation_waits_for_an_access_in_progress() {
        let mem = Arc::new(memory());
        let now = Instant::now();
        mem.issue_grant(id(1), &[MemoryRegion::new(5000, 100)], now, Duration::from_secs(10)).unwrap();
        let access = mem.admit(&id(1), [(5000, 10)], 10, now).unwrap();
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let (revoked_tx, revoked_rx) = std::sync::mpsc::channel();
        let access = &access;
        std::thread::scope(|s| {
            s.spawn(move || {
                access
                    .with(|| {
                        entered_tx.send(()).unwrap();
                        release_rx.recv().unwrap();
                    })
                    .unwrap();
            });
            entered_rx.recv().unwrap();
            let mem = Arc::clone(&mem);
            s.spawn(move || {
                mem.revoke(&id(1));
                revoked_tx.send(()).unwrap();
            });
            // The revocation cannot complete while the access is in progress.
            assert!(revoked_rx.recv_timeout(Duration::from_millis(50)).is_err());
            release_tx.send(()).unwrap();
            revoked_rx.recv().unwrap();
        });
        assert_eq!(access.with(|| ()), Err(Revoked));
    }
}
