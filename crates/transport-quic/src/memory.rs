//! The only module of this crate that touches raw memory.
//!
//! The bookkeeping is [`RegisteredMemory`]'s (kv-proto): sources and
//! destinations, grants, the revocation fence and the closed flag. This
//! module adds the two raw copies, each reachable only through a value that
//! proves its ranges were checked:
//! - the sender's [`Sources`] (every source range checked inside a source
//!   region by [`RegisteredMemory::check_sources`]) gathers payload into the
//!   chunk quinn then owns and sends (the one copy `SendStream::write` would
//!   make), inside [`RegisteredMemory::read_sources`];
//! - the receiver's [`Destinations`] (the op list admitted against one live
//!   grant by [`RegisteredMemory::admit`], and kept with its
//!   [`GrantAccess`]) copies each chunk quinn received straight into the
//!   destinations (the one copy `RecvStream::read` would make), inside
//!   [`GrantAccess::with`].
//!
//! No Rust reference to registered memory is ever created, and the payload
//! is never staged beyond those copies. Every copy is short and synchronous,
//! with no `.await` inside, so a revocation (which waits for the copy in
//! progress under its grant) and a close (which waits for every copy) return
//! promptly, and once they have returned no copy under that grant, or none
//! at all, starts.
//!
//! Why raw copies rather than a `&mut [u8]` handed to `RecvStream::read`: a
//! slice of registered memory would have to live across an `.await`, which
//! would hold the grant's lock across network waits (a revocation could
//! block for an I/O timeout); and peers write that memory while its owner
//! may read other parts of it, which a Rust reference must not observe.

use std::ptr;

use bytes::Bytes;
use kv_proto::dataplane::Cursor;
use kv_proto::receive::AdmittedBatch;
use kv_proto::{MemoryClosed, RegisteredMemory, Revoked};

/// The transport's registered memory: [`RegisteredMemory`]'s bookkeeping;
/// the raw accesses are below.
pub(crate) type LocalMemory = RegisteredMemory;

/// Source ranges checked against the source regions: the payload of one
/// outgoing batch, which [`gather`] copies out.
pub(crate) use kv_proto::CheckedSources as Sources;

/// Copies the next `min(max, remaining)` payload bytes of `sources` from
/// `cursor` on into a new chunk, advancing `cursor`.
pub(crate) fn gather(sources: &Sources<'_, '_>, cursor: &mut Cursor, max: usize) -> Result<Bytes, MemoryClosed> {
    let n = usize::try_from(cursor.remaining()).map_or(max, |r| r.min(max));
    let mut out: Vec<u8> = Vec::with_capacity(n);
    let filled = sources.memory().read_sources(|| {
        let spare = out.spare_capacity_mut();
        let mut filled = 0usize;
        // `n` fits usize, so does every piece (at most `n` bytes).
        cursor.walk(sources.ops(), n as u64, |addr, len| {
            let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else { return };
            let Some(slot) = spare.get_mut(filled..filled + len) else { return };
            // SAFETY: `[addr, addr + len)` is part of a source range that
            // `check_sources` found inside a region registered as a
            // source, which stays valid for reads while `read_sources`
            // runs this closure (the memory is open, and the caller of
            // `register_regions` guarantees validity until it is
            // closed). `slot` is `len` bytes of this fresh Vec's spare
            // capacity (bounds-checked by `get_mut`), a different
            // allocation, so the ranges cannot overlap. No reference to
            // the source is formed.
            unsafe {
                ptr::copy_nonoverlapping(ptr::with_exposed_provenance::<u8>(addr), slot.as_mut_ptr().cast::<u8>(), len);
            }
            filled += len;
        });
        filled
    })?;
    // SAFETY: the first `filled` bytes of the spare capacity were
    // initialized by the copies above, and `filled <= n <= capacity`.
    unsafe { out.set_len(filled) };
    Ok(Bytes::from(out))
}

/// A peer's op list admitted against one live grant (the batch-receive
/// machine's [`AdmittedBatch`]): where one incoming batch's payload lands,
/// and the only way to write it.
#[derive(Debug)]
pub(crate) struct Destinations<'b> {
    batch: &'b AdmittedBatch,
}

/// How much of the data handed to [`Destinations::scatter`] had a place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scattered {
    /// Bytes copied into the destinations.
    pub(crate) copied: u64,
    /// Bytes past the end of the payload (not copied).
    pub(crate) extra: u64,
}

impl<'b> Destinations<'b> {
    /// The destinations of an admitted batch.
    pub(crate) fn new(batch: &'b AdmittedBatch) -> Self {
        Self { batch }
    }

    /// The payload's length.
    pub(crate) fn total(&self) -> u64 {
        self.batch.total()
    }

    /// Copies `chunks`, in order, into the destinations from `cursor` on,
    /// advancing `cursor`, while the grant is live; `Err(Revoked)` copies
    /// nothing (the grant was revoked, or the memory closed).
    pub(crate) fn scatter(&self, cursor: &mut Cursor, chunks: &[Bytes]) -> Result<Scattered, Revoked> {
        let list = self.batch.entries();
        self.batch.access().with(|| {
            let mut done = Scattered { copied: 0, extra: 0 };
            for data in chunks {
                let mut taken = 0usize;
                cursor.walk(list, data.len() as u64, |addr, len| {
                    let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else { return };
                    let Some(src) = data.get(taken..taken + len) else { return };
                    // SAFETY: `[addr, addr + len)` is part of a destination
                    // range that `admit` found inside the live grant this
                    // `GrantAccess` holds, and grants cover only regions
                    // registered as destinations, valid for writes until the
                    // memory is closed. `with` runs this closure only while
                    // the grant is live, and a revocation or close waits for
                    // it to return. `src` is a live, bounds-checked slice of
                    // a quinn buffer, never registered memory, so the ranges
                    // cannot overlap. No reference to the destination is
                    // formed.
                    unsafe {
                        ptr::copy_nonoverlapping(src.as_ptr(), ptr::with_exposed_provenance_mut::<u8>(addr), len);
                    }
                    taken += len;
                });
                done.copied += taken as u64;
                done.extra += (data.len() - taken) as u64;
            }
            done
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use kv_proto::dataplane::{encode_op, OpEntry};
    use kv_proto::{DestinationError, GrantId, MemoryRegion, RegionAccess, WriteOp};

    fn addr_of(buf: &[u8]) -> u64 {
        buf.as_ptr().expose_provenance() as u64
    }

    fn addr_of_mut(buf: &mut [u8]) -> u64 {
        buf.as_mut_ptr().expose_provenance() as u64
    }

    fn id(n: u8) -> GrantId {
        GrantId::from_bytes([n; 16])
    }

    #[test]
    fn gather_then_scatter_moves_every_byte_across_chunk_boundaries() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; 2000];
        let (s, d) = (addr_of(&src), addr_of_mut(&mut dst));
        let m = LocalMemory::new();
        // SAFETY: both buffers outlive `m`'s use below (closed before they are read or dropped).
        unsafe {
            m.register(&[MemoryRegion::new(s, 1000)], RegionAccess::Source).unwrap();
            m.register(&[MemoryRegion::new(d, 2000)], RegionAccess::Destination).unwrap();
        }
        let ops = [
            WriteOp { src: s + 10, dst: d + 1500, len: 100 },
            WriteOp { src: s + 500, dst: d, len: 0 },
            WriteOp { src: s + 200, dst: d + 7, len: 333 },
            WriteOp { src: s, dst: d + 1000, len: 1 },
        ];
        let now = Instant::now();
        m.issue_grant(id(1), &[MemoryRegion::new(d, 2000)], now, Duration::from_secs(60)).unwrap();
        let sources = Sources::check(&m, &ops).unwrap();
        let list: Vec<OpEntry> = ops.iter().map(|op| encode_op(op.dst, op.len)).collect();
        let batch = AdmittedBatch::admit(&m, &id(1), list, sources.total(), now).unwrap();
        assert_eq!(batch.grant(), id(1));
        let dests = Destinations::new(&batch);
        let (mut out, mut inn) = (Cursor::new(sources.total()), Cursor::new(dests.total()));
        let mut chunks = 0;
        while !out.is_done() {
            let chunk = gather(&sources, &mut out, 37).unwrap();
            assert!(chunk.len() <= 37 && !chunk.is_empty());
            // Scatter in two uneven pieces.
            let (a, b) = (chunk.slice(..chunk.len() / 3), chunk.slice(chunk.len() / 3..));
            let got = dests.scatter(&mut inn, &[a, b]).unwrap();
            assert_eq!(got, Scattered { copied: chunk.len() as u64, extra: 0 });
            chunks += 1;
        }
        assert!(inn.is_done());
        assert_eq!(chunks, 434usize.div_ceil(37));
        let past = dests.scatter(&mut inn, &[Bytes::from_static(&[1, 2, 3])]).unwrap();
        assert_eq!(past, Scattered { copied: 0, extra: 3 }, "nothing past the total");
        m.revoke(&id(1));
        m.close();
        assert_eq!(&dst[1500..1600], &src[10..110]);
        assert_eq!(&dst[7..340], &src[200..533]);
        assert_eq!(dst[1000], src[0]);
        assert!(dst[..7].iter().chain(&dst[340..1000]).chain(&dst[1001..1500]).all(|&b| b == 0));
    }

    #[test]
    fn nothing_moves_after_a_revoke_or_close() {
        let src = vec![9u8; 64];
        let mut dst = vec![0u8; 64];
        let (s, d) = (addr_of(&src), addr_of_mut(&mut dst));
        let m = LocalMemory::new();
        // SAFETY: both buffers outlive `m`'s use below.
        unsafe {
            m.register(&[MemoryRegion::new(s, 64)], RegionAccess::Source).unwrap();
            m.register(&[MemoryRegion::new(d, 64)], RegionAccess::Destination).unwrap();
        }
        let now = Instant::now();
        m.issue_grant(id(1), &[MemoryRegion::new(d, 64)], now, Duration::from_secs(60)).unwrap();
        let batch = AdmittedBatch::admit(&m, &id(1), vec![encode_op(d, 64)], 64, now).unwrap();
        let dests = Destinations::new(&batch);
        let (_, err) = AdmittedBatch::admit(&m, &id(2), vec![encode_op(d, 64)], 64, now).unwrap_err();
        assert_eq!(err, DestinationError::UnknownGrant);
        m.revoke(&id(1));
        let mut cursor = Cursor::new(64);
        assert_eq!(dests.scatter(&mut cursor, &[Bytes::from_static(&[7; 64])]), Err(Revoked));
        assert_eq!(cursor.remaining(), 64);

        let ops = [WriteOp { src: s, dst: 0, len: 64 }];
        let sources = Sources::check(&m, &ops).unwrap();
        m.close();
        assert_eq!(gather(&sources, &mut cursor, 64).unwrap_err(), MemoryClosed);
        assert_eq!(cursor.remaining(), 64);
        assert!(dst.iter().all(|&b| b == 0));
    }
}
