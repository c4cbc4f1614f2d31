//! `registered_memory`: operation sequences against `RegisteredMemory`,
//! checked against a model kept as plain lists.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use kv_proto::{
    DestinationError, GrantAccess, GrantError, GrantId, MemoryRegion, RegionAccess, RegionError, RegisteredMemory,
    SourceError, WriteOp,
};

/// An address: small ones collide often, ones near the top wrap.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Addr {
    Small(u8),
    Mid(u16),
    NearTop(u8),
    Any(u64),
}

impl Addr {
    fn get(self) -> u64 {
        match self {
            Addr::Small(a) => u64::from(a) * 16,
            Addr::Mid(a) => u64::from(a),
            Addr::NearTop(a) => u64::MAX - u64::from(a),
            Addr::Any(a) => a,
        }
    }
}

/// A length: mostly small, sometimes huge.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Len {
    Small(u8),
    Mid(u16),
    Any(u64),
}

impl Len {
    fn get(self) -> u64 {
        match self {
            Len::Small(l) => u64::from(l) * 4,
            Len::Mid(l) => u64::from(l),
            Len::Any(l) => l,
        }
    }
}

#[derive(Arbitrary, Clone, Copy, Debug)]
struct Range(Addr, Len);

impl Range {
    fn get(self) -> (u64, u64) {
        (self.0.get(), self.1.get())
    }
}

/// The header total of a batch: right, or whatever the peer claims.
#[derive(Arbitrary, Debug)]
enum Declared {
    Sum,
    Claimed(u64),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Register {
        source: bool,
        regions: Vec<Range>,
    },
    Issue {
        id: u8,
        ranges: Vec<Range>,
        valid_ms: u16,
        huge_validity: bool,
    },
    Admit {
        id: u8,
        ops: Vec<Range>,
        declared: Declared,
    },
    Revoke {
        id: u8,
    },
    Close,
    /// Run a write under the `n`th admitted batch's access.
    With {
        n: u8,
    },
    CheckSources {
        ops: Vec<Range>,
    },
    ReadSources,
    /// Time passes (admission and issuance take time as an argument).
    Advance {
        ms: u16,
    },
    /// Time given to the next calls goes back (callers' clocks are not
    /// trusted to be monotonic here).
    Rewind {
        ms: u16,
    },
}

#[derive(Debug)]
struct ModelGrant {
    generation: u64,
    /// Coalesced: touching ranges merged.
    ranges: Vec<(u64, u64)>,
    expires_at: Instant,
}

#[derive(Debug, Default)]
struct Model {
    sources: Vec<(u64, u64)>,
    destinations: Vec<(u64, u64)>,
    closed: bool,
    grants: HashMap<u8, ModelGrant>,
    next_generation: u64,
}

fn end(r: (u64, u64)) -> Option<u64> {
    r.0.checked_add(r.1)
}

/// `[addr, addr + len)` inside `r` (a zero-length range at either end counts).
fn inside(r: (u64, u64), addr: u64, len: u64) -> bool {
    match (addr.checked_add(len), end(r)) {
        (Some(op_end), Some(r_end)) => addr >= r.0 && op_end <= r_end,
        _ => false,
    }
}

/// Whether two non-empty ranges share a byte.
fn intersect(a: (u64, u64), b: (u64, u64)) -> bool {
    let (a_end, b_end) = (u128::from(a.0) + u128::from(a.1), u128::from(b.0) + u128::from(b.1));
    a.1 > 0 && b.1 > 0 && u128::from(a.0) < b_end && u128::from(b.0) < a_end
}

/// The set after adding `new`: empty or wrapping ranges are invalid (the
/// first such is named), distinct ranges may not share a byte, identical ones
/// count once.
fn model_insert(set: &[(u64, u64)], new: &[(u64, u64)]) -> Result<Vec<(u64, u64)>, RegionError> {
    if let Some(&(addr, len)) = new.iter().find(|r| r.1 == 0 || end(**r).is_none()) {
        return Err(RegionError::Invalid { addr, len });
    }
    let mut all: Vec<(u64, u64)> = set.iter().chain(new).copied().collect();
    all.sort_unstable();
    all.dedup();
    for (i, a) in all.iter().enumerate() {
        if all[i + 1..].iter().any(|b| intersect(*a, *b)) {
            return Err(RegionError::Overlap { first: 0, second: 0 });
        }
    }
    Ok(all)
}

/// Ranges with touching neighbours merged (the input holds no overlap).
fn coalesce(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for r in ranges {
        match out.last_mut() {
            Some(last) if end(*last) == Some(r.0) => last.1 += r.1,
            _ => out.push(r),
        }
    }
    out
}

/// Whether every byte of `[addr, addr + len)` lies in one of `ranges`
/// (which may touch: a write may span adjacent regions).
fn covered(ranges: &[(u64, u64)], addr: u64, len: u64) -> bool {
    inside_any(&coalesce(ranges.to_vec()), addr, len)
}

fn inside_any(ranges: &[(u64, u64)], addr: u64, len: u64) -> bool {
    ranges.iter().any(|r| inside(*r, addr, len))
}

fn same_kind<T, U, E>(a: &Result<T, E>, b: &Result<U, E>) -> bool {
    match (a, b) {
        (Ok(_), Ok(_)) => true,
        (Err(x), Err(y)) => std::mem::discriminant(x) == std::mem::discriminant(y),
        _ => false,
    }
}

fn grant_id(id: u8) -> GrantId {
    GrantId::from_bytes([id; 16])
}

impl Model {
    /// Removes (fences) every grant expired at `now`.
    fn purge(&mut self, now: Instant) {
        self.grants.retain(|_, g| g.expires_at > now);
    }

    fn issue(&mut self, id: u8, ranges: &[(u64, u64)], now: Instant, valid_for: Duration) -> Result<(), GrantError> {
        if self.closed {
            return Err(GrantError::Closed);
        }
        if let Some(&(addr, len)) =
            ranges.iter().find(|r| r.1 == 0 || !self.destinations.iter().any(|d| inside(*d, r.0, r.1)))
        {
            return Err(GrantError::OutsideDestinations { addr, len });
        }
        let merged = match model_insert(&[], ranges) {
            Ok(set) => coalesce(set),
            Err(_) => return Err(GrantError::Overlap { first: 0, second: 0 }),
        };
        if self.grants.contains_key(&id) {
            return Err(GrantError::Duplicate(grant_id(id)));
        }
        self.purge(now);
        let expires_at = now.checked_add(valid_for).unwrap_or(now + Duration::from_secs(365 * 24 * 3600));
        self.next_generation += 1;
        self.grants.insert(id, ModelGrant { generation: self.next_generation, ranges: merged, expires_at });
        Ok(())
    }

    fn admit(&mut self, id: u8, ops: &[(u64, u64)], declared: u64, now: Instant) -> Result<u64, DestinationError> {
        let sum = ops.iter().try_fold(0u64, |s, op| s.checked_add(op.1));
        if sum != Some(declared) {
            return Err(DestinationError::LengthMismatch { declared, sum });
        }
        if self.closed {
            return Err(DestinationError::Closed);
        }
        let Some(grant) = self.grants.get(&id) else { return Err(DestinationError::UnknownGrant) };
        if grant.expires_at <= now {
            self.grants.remove(&id);
            return Err(DestinationError::ExpiredGrant);
        }
        if let Some((index, &(dst, len))) =
            ops.iter().enumerate().find(|(_, op)| !inside_any(&grant.ranges, op.0, op.1))
        {
            return Err(DestinationError::OutsideGrant { index, dst, len });
        }
        for (i, a) in ops.iter().enumerate() {
            if ops[i + 1..].iter().any(|b| intersect(*a, *b)) {
                return Err(DestinationError::OverlappingOps { dst: 0 });
            }
        }
        Ok(grant.generation)
    }

    fn check_sources(&self, ops: &[(u64, u64)]) -> Result<u64, SourceError> {
        if self.closed {
            return Err(SourceError::Closed);
        }
        let mut total = 0u64;
        for &(addr, len) in ops {
            // One registered region must hold the whole range.
            if !inside_any(&self.sources, addr, len) {
                return Err(SourceError::Outside { addr, len });
            }
            total = total.checked_add(len).ok_or(SourceError::TotalOverflows { addr, len })?;
        }
        Ok(total)
    }
}

/// What an admitted batch was allowed to do, kept to check its access later.
struct Admitted {
    access: GrantAccess,
    id: u8,
    generation: u64,
}

/// Sequences of operations on one `RegisteredMemory`: register sources and
/// destinations, issue grants, admit batches with arbitrary op lists and
/// totals at arbitrary times, revoke, close, write under earlier admissions.
///
/// Every result must equal the model's (error kinds exactly; the addresses
/// an error names where the first offending range is meant). Independently
/// of the model, an admitted batch must have every op inside the ranges
/// issued for its grant, inside destination memory and so never in memory
/// registered only as a source, with no two ops sharing a byte, under a
/// grant neither revoked, expired nor closed; a write under an admission
/// runs only while its grant is still the one admitted (not revoked, purged
/// after expiry, replaced, or closed).
pub fn registered_memory(data: &[u8]) {
    let Ok(ops) = Vec::<Op>::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let mem = RegisteredMemory::new();
    let mut model = Model::default();
    let start = Instant::now() + Duration::from_secs(24 * 3600);
    let mut now = start;
    let mut admitted: Vec<Admitted> = Vec::new();
    // Ranges each live generation was issued with, as given (for the
    // model-independent checks).
    let mut issued: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();

    for op in ops {
        match op {
            Op::Register { source, regions } => {
                let regions: Vec<(u64, u64)> = regions.iter().map(|r| r.get()).collect();
                let as_regions: Vec<MemoryRegion> = regions.iter().map(|&(a, l)| MemoryRegion::new(a, l)).collect();
                let (access, set) = if source {
                    (RegionAccess::Source, &mut model.sources)
                } else {
                    (RegionAccess::Destination, &mut model.destinations)
                };
                // SAFETY: these addresses are never dereferenced: nothing
                // here reads or writes memory through `mem`, which only
                // checks ranges.
                let got = unsafe { mem.register(&as_regions, access) };
                let expected = model_insert(set, &regions);
                assert!(same_kind(&got, &expected), "register {regions:?}: got {got:?}, model {expected:?}");
                if let (Err(RegionError::Invalid { addr, len }), Err(RegionError::Invalid { addr: a, len: l })) =
                    (&got, &expected)
                {
                    assert_eq!((addr, len), (a, l), "a different region was named invalid");
                }
                if let Ok(new_set) = expected {
                    *set = new_set;
                }
                let listed: Vec<(u64, u64)> = mem.regions(access).iter().map(|r| (r.addr, r.len)).collect();
                assert_eq!(&listed, set, "the registered regions differ from the model's");
            }
            Op::Issue { id, ranges, valid_ms, huge_validity } => {
                let ranges: Vec<(u64, u64)> = ranges.iter().map(|r| r.get()).collect();
                let valid_for =
                    if huge_validity { Duration::from_secs(u64::MAX) } else { Duration::from_millis(valid_ms.into()) };
                let as_regions: Vec<MemoryRegion> = ranges.iter().map(|&(a, l)| MemoryRegion::new(a, l)).collect();
                let got = mem.issue_grant(grant_id(id), &as_regions, now, valid_for);
                let expected = model.issue(id, &ranges, now, valid_for);
                assert!(same_kind(&got, &expected), "issue {id} {ranges:?}: got {got:?}, model {expected:?}");
                if !matches!(expected, Err(GrantError::Overlap { .. })) {
                    assert_eq!(got, expected);
                }
                if got.is_ok() {
                    issued.insert(model.next_generation, ranges);
                }
            }
            Op::Admit { id, ops, declared } => {
                let ops: Vec<(u64, u64)> = ops.iter().map(|r| r.get()).collect();
                let declared = match declared {
                    Declared::Sum => ops.iter().fold(0u64, |s, op| s.wrapping_add(op.1)),
                    Declared::Claimed(d) => d,
                };
                let got = mem.admit(&grant_id(id), ops.iter().copied(), declared, now);
                let expected = model.admit(id, &ops, declared, now);
                match (got, expected) {
                    (Ok(access), Ok(generation)) => {
                        assert_eq!(access.id(), grant_id(id));
                        let ranges = issued.get(&generation).map(Vec::as_slice).unwrap_or_default();
                        for (i, &(dst, len)) in ops.iter().enumerate() {
                            assert!(covered(ranges, dst, len), "admitted op {i} {dst:#x}+{len} outside the grant");
                            assert!(
                                covered(&model.destinations, dst, len),
                                "admitted op {i} {dst:#x}+{len} outside destination memory"
                            );
                            for (j, other) in ops.iter().enumerate().skip(i + 1) {
                                assert!(!intersect((dst, len), *other), "admitted ops {i} and {j} overlap");
                            }
                        }
                        assert!(!model.closed);
                        admitted.push(Admitted { access, id, generation });
                    }
                    (got, expected) => {
                        let got = got.map(|_| ());
                        let expected = expected.map(|_| ());
                        assert!(same_kind(&got, &expected), "admit {id} {ops:?}: got {got:?}, model {expected:?}");
                        if !matches!(expected, Err(DestinationError::OverlappingOps { .. })) {
                            assert_eq!(got, expected);
                        }
                    }
                }
            }
            Op::Revoke { id } => {
                // `revoke` fences the grant before it forgets it, and `admit`
                // refuses a grant whose fence has started (as unknown): both
                // matter only to a revocation racing another or an admission
                // on another thread. Driven from one thread, as here, a
                // revoked grant is gone when `revoke` returns: unknown to
                // `admit`, dead to every earlier admission, and a second
                // revocation finds nothing.
                let was_live = model.grants.remove(&id).is_some();
                assert_eq!(mem.revoke(&grant_id(id)), was_live, "revoke {id}");
            }
            Op::Close => {
                mem.close();
                model.closed = true;
                model.grants.clear();
                assert!(mem.is_closed());
            }
            Op::With { n } => {
                if admitted.is_empty() {
                    continue;
                }
                let a = &admitted[usize::from(n) % admitted.len()];
                let live = model.grants.get(&a.id).is_some_and(|g| g.generation == a.generation);
                let mut ran = false;
                let got = a.access.with(|| ran = true);
                assert_eq!(got.is_ok(), live, "a write under grant {} ran: {}, model says live: {live}", a.id, ran);
                assert_eq!(ran, live);
                assert_eq!(a.access.is_live(), live);
            }
            Op::CheckSources { ops } => {
                let ops: Vec<(u64, u64)> = ops.iter().map(|r| r.get()).collect();
                let write_ops: Vec<WriteOp> = ops.iter().map(|&(src, len)| WriteOp { src, dst: 0, len }).collect();
                let got = mem.check_sources(&write_ops);
                assert_eq!(got, model.check_sources(&ops), "check_sources {ops:?}");
            }
            Op::ReadSources => {
                assert_eq!(mem.read_sources(|| ()).is_ok(), !model.closed);
            }
            Op::Advance { ms } => now += Duration::from_millis(ms.into()),
            Op::Rewind { ms } => now = now.checked_sub(Duration::from_millis(ms.into())).unwrap_or(start),
        }
        assert_eq!(mem.live_grants(), model.grants.len(), "live grant count differs from the model's");
        assert_eq!(mem.is_closed(), model.closed);
    }
}
