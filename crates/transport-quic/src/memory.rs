//! The only module of this crate that touches raw memory.
//!
//! Registered regions live in a [`LocalMemory`]. Nothing outside this module
//! turns an address into memory: the sender gets a [`Sources`] (every source
//! range checked) and the receiver a [`Destinations`] (every destination range
//! checked, lengths summed against the header), and only those two types move
//! bytes. They copy with `ptr::copy_nonoverlapping` between registered memory
//! and quinn's buffers ([`Bytes`]): the sender gathers source ranges into the
//! chunk quinn then owns and sends (the one copy `SendStream::write` would
//! make), the receiver copies each received chunk straight into its
//! destinations (the one copy `RecvStream::read` would make). No Rust
//! reference to registered memory is ever created, and the payload is never
//! staged beyond those copies.
//!
//! Why raw copies rather than a `&mut [u8]` handed to `RecvStream::read`: a
//! slice of registered memory would have to live across an `.await`, so the
//! lock below would be held across network waits and [`LocalMemory::close`]
//! (called from `Drop`) could block for an I/O timeout; and peers write into
//! that memory concurrently, which a Rust reference must not observe. Here
//! every access is a short synchronous copy with no `.await` inside.
//!
//! Architecture Invariant: every raw access happens while the state's read
//! lock is held and `closed` is false. [`LocalMemory::close`] (called by
//! `shutdown` and by the transport's `Drop`) takes the write lock, so once it
//! returns no access is in progress and none can start, and the caller may
//! free its regions. Regions are never removed before that, so a range checked
//! once stays valid for the whole batch.

use std::ptr;

use bytes::Bytes;
use kv_proto::{RegisteredMemory, WriteOp};

use crate::wire::{decode_op, OP_LEN};

/// The transport's registered memory: [`RegisteredMemory`]'s bookkeeping
/// (regions, closed flag, range checks); the raw accesses are below.
pub(crate) type LocalMemory = RegisteredMemory;

pub(crate) use kv_proto::{DestinationError, SourceError};

/// An access attempted after [`LocalMemory::close`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the transport's memory is closed (shut down)")]
pub(crate) struct MemoryClosed;

impl<'m, 'o> Sources<'m, 'o> {
    /// Checks every op's source range; the result can then move the payload.
    pub(crate) fn check(mem: &'m LocalMemory, ops: &'o [WriteOp]) -> Result<Self, SourceError> {
        let total = mem.check_sources(ops)?;
        Ok(Self { mem, ops, total })
    }
}

impl<'m> Destinations<'m> {
    /// Checks a peer's op list (lengths add up to `declared`, every
    /// destination inside one registered region); on error the list is
    /// handed back with the reason.
    pub(crate) fn check(
        mem: &'m LocalMemory,
        list: Vec<[u8; OP_LEN]>,
        declared: u64,
    ) -> Result<Self, (Vec<[u8; OP_LEN]>, DestinationError)> {
        match mem.check_destinations(list.iter().map(decode_op), declared) {
            Ok(()) => Ok(Self { mem, list, total: declared }),
            Err(e) => Err((list, e)),
        }
    }
}

/// A run of `(address, length)` segments the payload moves through.
trait Segments {
    fn count(&self) -> usize;
    fn segment(&self, i: usize) -> (u64, u64);
}

impl Segments for [WriteOp] {
    fn count(&self) -> usize {
        self.len()
    }
    fn segment(&self, i: usize) -> (u64, u64) {
        self.get(i).map_or((0, 0), |op| (op.src, op.len))
    }
}

impl Segments for [[u8; OP_LEN]] {
    fn count(&self) -> usize {
        self.len()
    }
    fn segment(&self, i: usize) -> (u64, u64) {
        self.get(i).map_or((0, 0), decode_op)
    }
}

/// Progress through the concatenation of a batch's segments.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cursor {
    op: usize,
    off: u64,
    remaining: u64,
}

impl Cursor {
    /// At the start of a payload of `total` bytes.
    pub(crate) fn new(total: u64) -> Self {
        Self { op: 0, off: 0, remaining: total }
    }

    /// Whether every byte has moved.
    pub(crate) fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// Bytes still to move.
    pub(crate) fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Calls `f(address, length)` for the next pieces of the segments, at
    /// most `budget` bytes in all, and moves past them. Zero-length segments
    /// are skipped. The lengths passed add up to `min(budget, remaining)`.
    fn walk<S: Segments + ?Sized>(&mut self, segs: &S, budget: u64, mut f: impl FnMut(u64, usize)) {
        let mut left = budget.min(self.remaining);
        while left > 0 && self.op < segs.count() {
            let (addr, len) = segs.segment(self.op);
            let take = len.saturating_sub(self.off).min(left);
            if take > 0 {
                // `take` fits usize: every segment length was checked to.
                f(addr.saturating_add(self.off), usize::try_from(take).unwrap_or(0));
                self.off += take;
                left -= take;
                self.remaining -= take;
            }
            if self.off >= len {
                self.op += 1;
                self.off = 0;
            }
        }
    }
}

/// Source ranges checked against the registered regions: the payload of one
/// outgoing batch.
#[derive(Debug)]
pub(crate) struct Sources<'m, 'o> {
    mem: &'m LocalMemory,
    ops: &'o [WriteOp],
    total: u64,
}

impl Sources<'_, '_> {
    /// The ops.
    pub(crate) fn ops(&self) -> &[WriteOp] {
        self.ops
    }

    /// The payload's length.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Copies the next `min(max, remaining)` payload bytes from `cursor` on
    /// into a new chunk, advancing `cursor`.
    pub(crate) fn gather(&self, cursor: &mut Cursor, max: usize) -> Result<Bytes, MemoryClosed> {
        let state = self.mem.read();
        if state.is_closed() {
            return Err(MemoryClosed);
        }
        let n = usize::try_from(cursor.remaining()).map_or(max, |r| r.min(max));
        let mut out: Vec<u8> = Vec::with_capacity(n);
        let spare = out.spare_capacity_mut();
        let mut filled = 0usize;
        cursor.walk(self.ops, n as u64, |addr, len| {
            let Some(slot) = spare.get_mut(filled..filled + len) else { return };
            let src = ptr::with_exposed_provenance::<u8>(usize::try_from(addr).unwrap_or(0));
            // SAFETY: `[addr, addr + len)` is part of a source range that
            // `Sources::check` checked to lie inside a registered
            // region, which stays valid for reads while the read lock is held
            // with `closed == false` (module invariant; the caller of
            // `register` guarantees validity until `close`). `slot` is `len`
            // bytes of this fresh Vec's spare capacity (bounds-checked by
            // `get_mut`), a different allocation, so the ranges cannot overlap.
            unsafe { ptr::copy_nonoverlapping(src, slot.as_mut_ptr().cast::<u8>(), len) };
            filled += len;
        });
        drop(state);
        // SAFETY: the first `filled` bytes of the spare capacity were
        // initialized by the copies above, and `filled <= n <= capacity`.
        unsafe { out.set_len(filled) };
        Ok(Bytes::from(out))
    }
}

/// A peer's op list, checked against the registered regions: where one
/// incoming batch's payload lands.
#[derive(Debug)]
pub(crate) struct Destinations<'m> {
    mem: &'m LocalMemory,
    list: Vec<[u8; OP_LEN]>,
    total: u64,
}

impl Destinations<'_> {
    /// The payload's length.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Copies the first `min(data.len(), remaining)` bytes of `data` into the
    /// destinations from `cursor` on, advancing `cursor`; returns how many.
    pub(crate) fn scatter(&self, cursor: &mut Cursor, data: &[u8]) -> Result<usize, MemoryClosed> {
        let state = self.mem.read();
        if state.is_closed() {
            return Err(MemoryClosed);
        }
        let mut taken = 0usize;
        cursor.walk(self.list.as_slice(), data.len() as u64, |addr, len| {
            let Some(src) = data.get(taken..taken + len) else { return };
            let dst = ptr::with_exposed_provenance_mut::<u8>(usize::try_from(addr).unwrap_or(0));
            // SAFETY: `[addr, addr + len)` is part of a destination range that
            // `Destinations::check` checked to lie inside a registered
            // region, which stays valid for writes while the read lock is held
            // with `closed == false` (module invariant). `src` is a live,
            // bounds-checked slice of a quinn buffer, never registered memory,
            // so the ranges cannot overlap. No Rust reference to the
            // destination exists; the caller of `register_regions` promised
            // not to read it while the transfer is in flight.
            unsafe { ptr::copy_nonoverlapping(src.as_ptr(), dst, len) };
            taken += len;
        });
        drop(state);
        Ok(taken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::encode_op;
    use kv_proto::MemoryRegion;

    fn mem_with(regions: &[MemoryRegion]) -> LocalMemory {
        let m = LocalMemory::new();
        // SAFETY: callers register either fake addresses they never move
        // bytes through, or buffers that outlive `m`.
        unsafe { m.register(regions) }.unwrap();
        m
    }

    fn addr_of(buf: &[u8]) -> u64 {
        buf.as_ptr().expose_provenance() as u64
    }

    fn addr_of_mut(buf: &mut [u8]) -> u64 {
        buf.as_mut_ptr().expose_provenance() as u64
    }

    #[test]
    fn destinations_check_sum_then_bounds() {
        let m = mem_with(&[MemoryRegion::new(0x1000, 0x100)]);
        let list = vec![encode_op(0x1000, 0x10), encode_op(0x10f8, 0x10)];
        let (list, err) = Destinations::check(&m, list, 0x20).unwrap_err();
        assert_eq!(err, DestinationError::Outside { index: 1, dst: 0x10f8, len: 0x10 });
        let (_, err) = Destinations::check(&m, list, 0x21).unwrap_err();
        assert_eq!(err, DestinationError::LengthMismatch { declared: 0x21, sum: Some(0x20) });
        let list = vec![encode_op(0x1000, u64::MAX), encode_op(0x1000, 2)];
        let (_, err) = Destinations::check(&m, list, 1).unwrap_err();
        assert_eq!(err, DestinationError::LengthMismatch { declared: 1, sum: None });
        let ok = Destinations::check(&m, vec![encode_op(0x1000, 0x100), encode_op(0x1100, 0)], 0x100).unwrap();
        assert_eq!(ok.total(), 0x100);
        m.close();
        assert_eq!(Destinations::check(&m, Vec::new(), 0).unwrap_err().1, DestinationError::Closed);
    }

    #[test]
    fn sources_are_checked() {
        let m = mem_with(&[MemoryRegion::new(0x1000, 0x100)]);
        let ops = [WriteOp { src: 0x1000, dst: 0, len: 0x100 }, WriteOp { src: 0x10ff, dst: 0, len: 2 }];
        assert_eq!(Sources::check(&m, &ops).unwrap_err(), SourceError::Outside { addr: 0x10ff, len: 2 });
        assert_eq!(Sources::check(&m, &ops[..1]).unwrap().total(), 0x100);
        m.close();
        assert_eq!(Sources::check(&m, &ops[..1]).unwrap_err(), SourceError::Closed);
    }

    #[test]
    fn gather_then_scatter_moves_every_byte_across_chunk_boundaries() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; 2000];
        let (s, d) = (addr_of(&src), addr_of_mut(&mut dst));
        let m = mem_with(&[MemoryRegion::new(s, 1000), MemoryRegion::new(d, 2000)]);
        let ops = [
            WriteOp { src: s + 10, dst: d + 1500, len: 100 },
            WriteOp { src: s + 500, dst: d, len: 0 },
            WriteOp { src: s + 200, dst: d + 7, len: 333 },
            WriteOp { src: s, dst: d + 1000, len: 1 },
        ];
        let sources = Sources::check(&m, &ops).unwrap();
        let list: Vec<[u8; OP_LEN]> = ops.iter().map(|op| encode_op(op.dst, op.len)).collect();
        let dests = Destinations::check(&m, list, sources.total()).unwrap();
        let (mut out, mut inn) = (Cursor::new(sources.total()), Cursor::new(dests.total()));
        let mut chunks = 0;
        while !out.is_done() {
            let chunk = sources.gather(&mut out, 37).unwrap();
            assert!(chunk.len() <= 37 && !chunk.is_empty());
            // Scatter in two uneven pieces.
            let (a, b) = chunk.split_at(chunk.len() / 3);
            assert_eq!(dests.scatter(&mut inn, a).unwrap(), a.len());
            assert_eq!(dests.scatter(&mut inn, b).unwrap(), b.len());
            chunks += 1;
        }
        assert!(inn.is_done());
        assert_eq!(chunks, 434usize.div_ceil(37));
        assert_eq!(dests.scatter(&mut inn, &[1, 2, 3]).unwrap(), 0, "nothing past the total");
        drop((sources, dests));
        m.close();
        assert_eq!(&dst[1500..1600], &src[10..110]);
        assert_eq!(&dst[7..340], &src[200..533]);
        assert_eq!(dst[1000], src[0]);
        assert!(dst[..7].iter().chain(&dst[340..1000]).chain(&dst[1001..1500]).all(|&b| b == 0));
        dst[0] = 1; // the buffer stays ours
    }

    #[test]
    fn closed_memory_moves_nothing() {
        let src = vec![9u8; 64];
        let m = mem_with(&[MemoryRegion::new(addr_of(&src), 64)]);
        let ops = [WriteOp { src: addr_of(&src), dst: 0, len: 64 }];
        let sources = Sources::check(&m, &ops).unwrap();
        let mut cursor = Cursor::new(64);
        m.close();
        assert_eq!(sources.gather(&mut cursor, 64).unwrap_err(), MemoryClosed);
        assert_eq!(cursor.remaining(), 64);
    }
}
