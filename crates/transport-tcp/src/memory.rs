//! The only module of this crate that touches raw memory.
//!
//! Registered regions live in a [`LocalMemory`]. Nothing outside this module
//! turns an address into memory: the sender gets a [`Sources`] (every source
//! range checked) and the receiver a [`Destinations`] (every destination range
//! checked, lengths summed against the header), and only those two types move
//! bytes, with `sendmsg`/`readv` over raw `iovec`s. No Rust reference to
//! registered memory is ever created: the kernel copies between the socket and
//! the memory, so the payload is never staged.
//!
//! Architecture Invariant: every raw access happens while the state's read
//! lock is held and `closed` is false. [`LocalMemory::close`] (called by
//! `shutdown` and by the transport's `Drop`) takes the write lock, so once it
//! returns no access is in progress and none can start, and the caller may
//! free its regions. Regions are never removed before that, so a range checked
//! once stays valid for the whole batch.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use kv_proto::{RegisteredMemory, WriteOp};

use crate::wire::{decode_op, OP_LEN};

/// Most `iovec`s handed to one syscall (Linux's `IOV_MAX`).
pub(crate) const MAX_IOVECS: usize = 1024;
/// Most bytes described to one syscall (well below `ssize_t` and Linux's
/// per-call cap of about 2 GiB).
const MAX_BYTES_PER_CALL: u64 = 1 << 30;
/// Fewest bytes described to one syscall. Between the two, a call describes
/// four times what the previous one moved: a socket moves at most what its
/// buffer holds, and describing far more (up to 1024 iovecs of small ops,
/// rebuilt on every call) would make the per-op cost visible again.
const MIN_BYTES_PER_CALL: u64 = 256 * 1024;

const EMPTY_IOVEC: libc::iovec = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };

/// The transport's registered memory: [`RegisteredMemory`]'s bookkeeping
/// (regions, closed flag, range checks); the raw accesses are below.
pub(crate) type LocalMemory = RegisteredMemory;

pub(crate) use kv_proto::{DestinationError, SourceError};

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

/// Progress through `prefix ++ segment 0 ++ segment 1 ++ ...`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cursor {
    prefix_done: usize,
    op: usize,
    off: u64,
    remaining: u64,
    /// Bytes the next call describes (see [`MIN_BYTES_PER_CALL`]).
    window: u64,
}

impl Cursor {
    /// At the start of a prefix of `prefix_len` bytes and `total` payload bytes.
    pub(crate) fn new(prefix_len: usize, total: u64) -> Self {
        Self {
            prefix_done: 0,
            op: 0,
            off: 0,
            remaining: total.saturating_add(prefix_len as u64),
            window: 4 * MIN_BYTES_PER_CALL,
        }
    }

    /// Whether every byte has moved.
    pub(crate) fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// Fills `iov` from the current position; returns how many entries.
    fn fill<S: Segments + ?Sized>(&self, prefix: &[u8], segs: &S, iov: &mut [libc::iovec; MAX_IOVECS]) -> usize {
        let mut n = 0;
        let mut bytes = 0u64;
        if let Some(rest) = prefix.get(self.prefix_done..).filter(|r| !r.is_empty()) {
            iov[0] = libc::iovec { iov_base: rest.as_ptr().cast_mut().cast(), iov_len: rest.len() };
            n = 1;
            bytes = rest.len() as u64;
        }
        let mut i = self.op;
        let mut off = self.off;
        let limit = self.window.clamp(MIN_BYTES_PER_CALL, MAX_BYTES_PER_CALL);
        while n < MAX_IOVECS && i < segs.count() && bytes < limit {
            let (addr, len) = segs.segment(i);
            let rest = len.saturating_sub(off);
            if rest > 0 {
                let take = rest.min(limit - bytes);
                // Both fit in usize: the range was checked to lie inside a
                // registered region of this process's address space.
                let base = usize::try_from(addr.saturating_add(off)).unwrap_or(0);
                iov[n] = libc::iovec {
                    iov_base: std::ptr::with_exposed_provenance_mut(base),
                    iov_len: usize::try_from(take).unwrap_or(0),
                };
                n += 1;
                bytes += take;
            }
            i += 1;
            off = 0;
        }
        n
    }

    /// Moves past `n` bytes.
    fn advance<S: Segments + ?Sized>(&mut self, prefix_len: usize, segs: &S, n: usize) {
        let mut n = n as u64;
        self.remaining = self.remaining.saturating_sub(n);
        self.window = n.saturating_mul(4).clamp(MIN_BYTES_PER_CALL, MAX_BYTES_PER_CALL);
        let p = (prefix_len.saturating_sub(self.prefix_done) as u64).min(n);
        self.prefix_done += p as usize;
        n -= p;
        while n > 0 && self.op < segs.count() {
            let (_, len) = segs.segment(self.op);
            let rest = len.saturating_sub(self.off);
            if n >= rest {
                n -= rest;
                self.op += 1;
                self.off = 0;
            } else {
                self.off += n;
                n = 0;
            }
        }
    }
}

/// The error payload of an access attempted after [`LocalMemory::close`].
#[derive(Debug, thiserror::Error)]
#[error("the transport's memory is closed (shut down)")]
struct MemoryClosed;

fn closed_error() -> io::Error {
    io::Error::other(MemoryClosed)
}

/// Whether `error` reports an access after [`LocalMemory::close`].
pub(crate) fn is_closed_error(error: &io::Error) -> bool {
    error.get_ref().is_some_and(|inner| inner.is::<MemoryClosed>())
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

    /// One non-blocking `sendmsg` of `prefix` then the payload from
    /// `cursor` on (up to [`MAX_IOVECS`] segments), advancing `cursor`.
    /// `WouldBlock` when the socket buffer is full.
    pub(crate) fn send_to(&self, fd: BorrowedFd<'_>, prefix: &[u8], cursor: &mut Cursor) -> io::Result<usize> {
        let state = self.mem.read();
        if state.is_closed() {
            return Err(closed_error());
        }
        let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
        let n = cursor.fill(prefix, self.ops, &mut iov);
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: `msghdr` is a plain C struct for which all-zero bytes are a
        // valid value (no name, no control data, no iovecs).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        // n <= MAX_IOVECS (1024), which fits every platform's msg_iovlen type.
        msg.msg_iovlen = n as _;
        // SAFETY: `fd` is a live socket borrowed for this call. The first `n`
        // iovecs describe either the tail of `prefix` (a live Rust slice) or
        // source ranges that `Sources::check` checked to lie inside
        // registered regions, which stay valid for reads while the read lock
        // is held with `closed == false` (module invariant). sendmsg only
        // reads them. MSG_NOSIGNAL: a closed peer is an EPIPE error, never a
        // SIGPIPE that would kill an embedding process.
        let sent = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        drop(state);
        let sent = usize::try_from(sent).map_err(|_| io::Error::last_os_error())?;
        cursor.advance(prefix.len(), self.ops, sent);
        Ok(sent)
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

    /// The op list, for reuse by the next batch.
    pub(crate) fn into_list(self) -> Vec<[u8; OP_LEN]> {
        self.list
    }

    /// One non-blocking `readv` from the socket straight into the
    /// destinations from `cursor` on, advancing `cursor`. `Ok(0)` means the
    /// peer closed; `WouldBlock` that no data is buffered.
    pub(crate) fn recv_from(&self, fd: BorrowedFd<'_>, cursor: &mut Cursor) -> io::Result<usize> {
        let state = self.mem.read();
        if state.is_closed() {
            return Err(closed_error());
        }
        let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
        let n = cursor.fill(&[], self.list.as_slice(), &mut iov);
        if n == 0 {
            return Ok(0);
        }
        // n <= MAX_IOVECS (1024), which fits in c_int.
        let count = n as libc::c_int;
        // SAFETY: `fd` is a live socket borrowed for this call. The first `n`
        // iovecs describe destination ranges that `Destinations::check`
        // checked to lie inside registered regions, which stay valid for
        // writes while the read lock is held with `closed == false` (module
        // invariant). The kernel writes at most each iovec's length; no Rust
        // reference to that memory exists.
        let got = unsafe { libc::readv(fd.as_raw_fd(), iov.as_ptr(), count) };
        drop(state);
        let got = usize::try_from(got).map_err(|_| io::Error::last_os_error())?;
        cursor.advance(0, self.list.as_slice(), got);
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::encode_op;
    use kv_proto::MemoryRegion;

    fn mem_with(regions: &[MemoryRegion]) -> LocalMemory {
        let m = LocalMemory::new();
        // SAFETY: these tests never move bytes; the addresses are only checked.
        unsafe { m.register(regions) }.unwrap();
        m
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
        let (_, err) = Destinations::check(&m, vec![encode_op(0x1000, u64::MAX)], u64::MAX).unwrap_err();
        assert_eq!(err, DestinationError::Outside { index: 0, dst: 0x1000, len: u64::MAX });
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
    }

    #[test]
    fn cursor_walks_prefix_segments_and_zero_lengths() {
        let ops = [
            WriteOp { src: 100, dst: 0, len: 10 },
            WriteOp { src: 500, dst: 0, len: 0 },
            WriteOp { src: 200, dst: 0, len: 5 },
        ];
        let prefix = [0u8; 4];
        let mut c = Cursor::new(prefix.len(), 15);
        let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
        assert_eq!(c.fill(&prefix, &ops[..], &mut iov), 3, "the zero-length op gets no iovec");
        c.advance(prefix.len(), &ops[..], 6);
        assert_eq!(c.fill(&prefix, &ops[..], &mut iov), 2);
        assert_eq!(iov[0].iov_base as usize, 102);
        assert_eq!(iov[0].iov_len, 8);
        c.advance(prefix.len(), &ops[..], 9);
        assert_eq!(iov[1].iov_base as usize, 200);
        assert_eq!(c.fill(&prefix, &ops[..], &mut iov), 1);
        assert_eq!(iov[0].iov_base as usize, 201);
        c.advance(prefix.len(), &ops[..], 4);
        assert!(c.is_done());
        assert_eq!(c.fill(&prefix, &ops[..], &mut iov), 0);
    }

    #[test]
    fn the_window_follows_what_the_socket_moves() {
        let ops: Vec<WriteOp> = (0..4096).map(|i| WriteOp { src: i * 16384, dst: 0, len: 8192 }).collect();
        let mut c = Cursor::new(0, 4096 * 8192);
        let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
        assert_eq!(c.fill(&[], &ops[..], &mut iov), 128, "starts at 1 MiB");
        c.advance(0, &ops[..], 16 * 1024);
        assert_eq!(c.fill(&[], &ops[..], &mut iov), 32, "shrinks to the 256 KiB floor");
        c.advance(0, &ops[..], 256 * 1024);
        assert_eq!(c.fill(&[], &ops[..], &mut iov), 128, "grows to four times the last call");
        c.advance(0, &ops[..], 8 << 20);
        assert_eq!(c.fill(&[], &ops[..], &mut iov), MAX_IOVECS, "capped at IOV_MAX");
    }

    #[test]
    fn fill_stops_at_iov_max() {
        let ops: Vec<WriteOp> = (0..3000).map(|i| WriteOp { src: i * 64, dst: 0, len: 8 }).collect();
        let c = Cursor::new(0, 3000 * 8);
        let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
        assert_eq!(c.fill(&[], &ops[..], &mut iov), MAX_IOVECS);
    }
}
