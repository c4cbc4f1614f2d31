//! The only module of this crate that touches raw memory.
//!
//! Registered regions and grants live in a [`LocalMemory`]
//! ([`kv_proto::RegisteredMemory`], the one copy of the checks). Nothing
//! outside this module turns an address into memory: the sender gets a
//! [`Sources`] (every source range checked against the *source* regions) and
//! the receiver a [`Destinations`] (a peer's op list admitted against one
//! live grant, lengths summed against the header), and only those two types
//! move bytes, with `sendmsg`/`readv` over raw `iovec`s. No Rust reference
//! to registered memory is ever created: the kernel copies between the
//! socket and the memory, so the payload is never staged.
//!
//! Architecture Invariant: every read of a source happens inside
//! [`LocalMemory::read_sources`], and every write into a destination inside
//! [`GrantAccess::with`] of the grant that admitted it, one non-blocking
//! syscall per call. So once `revoke` of a grant returns, no `readv` under
//! it is in progress and none can start (the fence), and once
//! [`LocalMemory::close`] returns (called by `close`, `shutdown` and the
//! transport's `Drop`) no access at all is in progress or can start, and the
//! caller may free its regions.

use kv_proto::dataplane::{Cursor, Segments};
use kv_proto::receive::AdmittedBatch;
use kv_proto::session::StreamedFrame;
use kv_proto::{MemoryClosed, RegisteredMemory, Revoked};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

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

/// The transport's registered memory and grants.
pub(crate) type LocalMemory = RegisteredMemory;

/// Whether `error` reports an access after [`LocalMemory::close`].
pub(crate) fn is_closed_error(error: &io::Error) -> bool {
    error.get_ref().is_some_and(|inner| inner.is::<MemoryClosed>())
}

/// Progress through `prefix ++ payload`: the frame bytes sent in front of a
/// payload (the sender's header and op list), then the payload's segments
/// ([`kv_proto::dataplane::Cursor`]), with the size of the next call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Progress {
    prefix_len: usize,
    prefix_done: usize,
    payload: Cursor,
    /// Bytes the next call describes (see [`MIN_BYTES_PER_CALL`]).
    window: u64,
}

impl Progress {
    /// At the start of a prefix of `prefix_len` bytes and `total` payload bytes.
    pub(crate) fn new(prefix_len: usize, total: u64) -> Self {
        Self { prefix_len, prefix_done: 0, payload: Cursor::new(total), window: 4 * MIN_BYTES_PER_CALL }
    }

    /// Whether every byte has moved.
    pub(crate) fn is_done(&self) -> bool {
        self.prefix_done >= self.prefix_len && self.payload.is_done()
    }

    /// Payload bytes still to move.
    pub(crate) fn payload_remaining(&self) -> u64 {
        self.payload.remaining()
    }

    /// Fills `iov` from the current position (the rest of `prefix`, then
    /// payload pieces); returns how many entries.
    fn fill<S: Segments + ?Sized>(&self, prefix: &[u8], segs: &S, iov: &mut [libc::iovec; MAX_IOVECS]) -> usize {
        let mut n = 0;
        let mut bytes = 0u64;
        if let Some(rest) = prefix.get(self.prefix_done..self.prefix_len).filter(|r| !r.is_empty()) {
            iov[0] = libc::iovec { iov_base: rest.as_ptr().cast_mut().cast(), iov_len: rest.len() };
            n = 1;
            bytes = rest.len() as u64;
        }
        let budget = self.window.clamp(MIN_BYTES_PER_CALL, MAX_BYTES_PER_CALL).saturating_sub(bytes);
        self.payload.peek(segs, budget, MAX_IOVECS - n, |addr, len| {
            // Both fit in usize: the range was checked to lie inside a
            // registered region of this process's address space.
            let base = usize::try_from(addr).unwrap_or(0);
            if let Some(slot) = iov.get_mut(n) {
                *slot = libc::iovec {
                    iov_base: std::ptr::with_exposed_provenance_mut(base),
                    iov_len: usize::try_from(len).unwrap_or(0),
                };
                n += 1;
            }
        });
        n
    }

    /// Moves past `n` bytes (prefix first).
    fn advance<S: Segments + ?Sized>(&mut self, segs: &S, n: usize) {
        self.window = (n as u64).saturating_mul(4).clamp(MIN_BYTES_PER_CALL, MAX_BYTES_PER_CALL);
        let p = self.prefix_len.saturating_sub(self.prefix_done).min(n);
        self.prefix_done += p;
        self.payload.advance(segs, (n - p) as u64);
    }
}

/// Feeds the `len` bytes at `addr` to a payload's tag, copied straight into
/// the tag's own block ([`StreamedFrame::spare`]), which it hashes once
/// whole. No Rust reference to registered memory is made: a `&[u8]` over
/// it would assert that nothing writes it meanwhile, and a peer may (a
/// destination range can be named by two batches on two connections at
/// once). The copy costs far less than the hash.
///
/// # Safety
///
/// `[addr, addr + len)` must be valid for reads for the whole call.
unsafe fn feed_tag(tag: &mut StreamedFrame, addr: u64, len: u64) {
    let mut done = 0u64;
    while done < len {
        let spare = tag.spare();
        // At most the spare block's length, which fits usize.
        let n = (len - done).min(spare.len() as u64) as usize;
        let Ok(at) = usize::try_from(addr + done) else { return };
        // SAFETY: `[at, at + n)` is part of `[addr, addr + len)`, valid for
        // reads by the caller's contract; `spare` is a live buffer of the
        // tag's own, at least `n` bytes long, another allocation, so the
        // ranges cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(std::ptr::with_exposed_provenance::<u8>(at), spare.as_mut_ptr(), n) };
        tag.commit(n);
        done += n as u64;
    }
}

/// Source ranges checked against the source regions: the payload of one
/// outgoing batch, which [`send_to`] moves.
pub(crate) use kv_proto::CheckedSources as Sources;

/// One non-blocking `sendmsg` of `prefix` then the payload of `sources` from
/// `progress` on (up to [`MAX_IOVECS`] segments), advancing `progress`; the
/// payload bytes sent are fed to `tag`, if any, as they were sent.
/// `WouldBlock` when the socket buffer is full; an error for which
/// [`is_closed_error`] holds once the memory is closed.
pub(crate) fn send_to(
    sources: &Sources<'_, '_>,
    fd: BorrowedFd<'_>,
    prefix: &[u8],
    progress: &mut Progress,
    tag: Option<&mut StreamedFrame>,
) -> io::Result<usize> {
    let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
    let n = progress.fill(prefix, sources.ops(), &mut iov);
    if n == 0 {
        return Ok(0);
    }
    // SAFETY: `msghdr` is a plain C struct for which all-zero bytes are a
    // valid value (no name, no control data, no iovecs).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    // n <= MAX_IOVECS (1024), which fits every platform's msg_iovlen type.
    msg.msg_iovlen = n as _;
    let sent = sources
        .memory()
        .read_sources(|| {
            // SAFETY: `fd` is a live socket borrowed for this call. The
            // first `n` iovecs describe either the tail of `prefix` (a
            // live Rust slice) or source ranges that `Sources::check`
            // checked to lie inside source regions, which stay valid for
            // reads while `read_sources` runs this closure (the memory is
            // open and `close` waits for it). sendmsg only reads them.
            // MSG_NOSIGNAL: a closed peer is an EPIPE error, never a
            // SIGPIPE that would kill an embedding process.
            let sent = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
            if let (Some(tag), Ok(sent)) = (tag, usize::try_from(sent)) {
                let payload = sent.saturating_sub(progress.prefix_len.saturating_sub(progress.prefix_done));
                progress.payload.peek(sources.ops(), payload as u64, usize::MAX, |addr, len| {
                    // SAFETY: the piece is part of a source range that
                    // `Sources::check` found inside a source region,
                    // valid for reads while `read_sources` runs this
                    // closure; sendmsg has just read the same bytes.
                    unsafe { feed_tag(tag, addr, len) }
                });
            }
            sent
        })
        .map_err(io::Error::other)?;
    let sent = usize::try_from(sent).map_err(|_| io::Error::last_os_error())?;
    progress.advance(sources.ops(), sent);
    Ok(sent)
}

/// A peer's op list admitted under one live grant (the batch-receive
/// machine's [`AdmittedBatch`]): where one incoming batch's payload lands,
/// and the only way to write it.
#[derive(Debug)]
pub(crate) struct Destinations<'b> {
    batch: &'b AdmittedBatch,
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

    /// One non-blocking `readv` from the socket straight into the
    /// destinations from `progress` on, advancing `progress`, while the
    /// grant is live; the bytes that landed are fed to `tag`, if any, read
    /// back from the destinations inside the same hold of the grant.
    /// `Err(Revoked)`: the grant was revoked (or the memory closed) and
    /// nothing was read. Inside, `Ok(0)` means the peer closed and
    /// `WouldBlock` that no data is buffered.
    pub(crate) fn recv_from(
        &self,
        fd: BorrowedFd<'_>,
        progress: &mut Progress,
        tag: Option<&mut StreamedFrame>,
    ) -> Result<io::Result<usize>, Revoked> {
        let list = self.batch.entries();
        let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
        let n = progress.fill(&[], list, &mut iov);
        if n == 0 {
            return Ok(Ok(0));
        }
        // n <= MAX_IOVECS (1024), which fits in c_int.
        let count = n as libc::c_int;
        let got = self.batch.access().with(|| {
            // SAFETY: `fd` is a live socket borrowed for this call. The first
            // `n` iovecs describe destination ranges that `admit` checked to
            // lie inside the grant's ranges (themselves inside regions
            // registered as destinations), which stay valid for writes while
            // `with` runs this closure: the grant is live, and `revoke` and
            // `close` wait for the closure to return. The kernel writes at
            // most each iovec's length; no Rust reference to that memory
            // exists.
            let got = unsafe { libc::readv(fd.as_raw_fd(), iov.as_ptr(), count) };
            if let (Some(tag), Ok(landed)) = (tag, u64::try_from(got)) {
                progress.payload.peek(list, landed, usize::MAX, |addr, len| {
                    // SAFETY: the piece is part of a destination range that
                    // `admit` checked inside the live grant, valid for reads
                    // and writes while `with` runs this closure (`revoke`
                    // and `close` wait for it); readv has just written it.
                    // It is copied out, never referenced.
                    unsafe { feed_tag(tag, addr, len) }
                });
            }
            got
        })?;
        Ok(usize::try_from(got).map_err(|_| io::Error::last_os_error()).inspect(|&got| {
            progress.advance(list, got);
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};

    use kv_proto::dataplane::{encode_op, OpEntry};
    use kv_proto::{DestinationError, GrantId, MemoryRegion, RegionAccess, WriteOp};

    use super::*;

    const TTL: Duration = Duration::from_secs(60);

    fn mem_with(sources: &[MemoryRegion], destinations: &[MemoryRegion]) -> LocalMemory {
        let m = LocalMemory::new();
        // SAFETY: these tests never move bytes through these addresses; they are only checked.
        unsafe {
            m.register(sources, RegionAccess::Source).unwrap();
            m.register(destinations, RegionAccess::Destination).unwrap();
        }
        m
    }

    fn id(n: u8) -> GrantId {
        GrantId::from_bytes([n; 16])
    }

    #[test]
    fn destinations_are_admitted_against_the_grant_only() {
        let m = mem_with(&[MemoryRegion::new(0x9000, 0x100)], &[MemoryRegion::new(0x1000, 0x100)]);
        let now = Instant::now();
        m.issue_grant(id(1), &[MemoryRegion::new(0x1000, 0x80)], now, TTL).unwrap();
        let admit = |list: Vec<OpEntry>, declared| AdmittedBatch::admit(&m, &id(1), list, declared, now);
        let (list, err) = admit(vec![encode_op(0x1000, 0x10), encode_op(0x1078, 0x10)], 0x20).unwrap_err();
        assert_eq!(err, DestinationError::OutsideGrant { index: 1, dst: 0x1078, len: 0x10 }, "registered, not granted");
        let (_, err) = admit(list, 0x21).unwrap_err();
        assert_eq!(err, DestinationError::LengthMismatch { declared: 0x21, sum: Some(0x20) });
        let (_, err) = admit(vec![encode_op(0x9000, 0x10)], 0x10).unwrap_err();
        assert!(matches!(err, DestinationError::OutsideGrant { .. }), "a source is never writable");
        let (_, err) = AdmittedBatch::admit(&m, &id(2), vec![encode_op(0x1000, 1)], 1, now).unwrap_err();
        assert_eq!(err, DestinationError::UnknownGrant);
        let ok = admit(vec![encode_op(0x1000, 0x80), encode_op(0x1080, 0)], 0x80).unwrap();
        assert_eq!(ok.total(), 0x80);
        m.close();
        assert_eq!(admit(Vec::new(), 0).unwrap_err().1, DestinationError::Closed);
    }

    /// The fence at the lowest level: a `readv` under a revoked grant reads
    /// nothing, and the bytes stay in the socket.
    #[test]
    fn no_read_lands_after_the_grant_is_revoked() {
        let mut buf = vec![0u8; 64].into_boxed_slice();
        let base = buf.as_mut_ptr().expose_provenance() as u64;
        let m = mem_with(&[], &[MemoryRegion::new(base, 64)]);
        let now = Instant::now();
        m.issue_grant(id(1), &[MemoryRegion::new(base, 64)], now, TTL).unwrap();
        let batch = AdmittedBatch::admit(&m, &id(1), vec![encode_op(base, 64)], 64, now).unwrap();
        let dst = Destinations::new(&batch);
        let (mut tx, rx) = UnixStream::pair().unwrap();
        let mut progress = Progress::new(0, 64);
        tx.write_all(&[7u8; 16]).unwrap();
        assert_eq!(dst.recv_from(rx.as_fd(), &mut progress, None).unwrap().unwrap(), 16);
        assert_eq!(progress.payload_remaining(), 48);
        assert!(m.revoke(&id(1)));
        tx.write_all(&[9u8; 48]).unwrap();
        assert_eq!(dst.recv_from(rx.as_fd(), &mut progress, None).unwrap_err(), Revoked);
        assert_eq!(progress.payload_remaining(), 48, "nothing moved");
        drop(batch);
        assert!(buf[..16].iter().all(|&b| b == 7) && buf[16..].iter().all(|&b| b == 0));
    }

    #[test]
    fn progress_walks_prefix_segments_and_zero_lengths() {
        let ops = [
            WriteOp { src: 100, dst: 0, len: 10 },
            WriteOp { src: 500, dst: 0, len: 0 },
            WriteOp { src: 200, dst: 0, len: 5 },
        ];
        let prefix = [0u8; 4];
        let mut c = Progress::new(prefix.len(), 15);
        let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
        assert_eq!(c.fill(&prefix, &ops[..], &mut iov), 3, "the zero-length op gets no iovec");
        c.advance(&ops[..], 6);
        assert_eq!(c.fill(&prefix, &ops[..], &mut iov), 2);
        assert_eq!(iov[0].iov_base as usize, 102);
        assert_eq!(iov[0].iov_len, 8);
        c.advance(&ops[..], 9);
        assert_eq!(iov[1].iov_base as usize, 200);
        assert_eq!(c.fill(&prefix, &ops[..], &mut iov), 1);
        assert_eq!(iov[0].iov_base as usize, 201);
        assert!(!c.is_done());
        c.advance(&ops[..], 4);
        assert!(c.is_done());
        assert_eq!(c.fill(&prefix, &ops[..], &mut iov), 0);
    }

    #[test]
    fn the_window_follows_what_the_socket_moves() {
        let ops: Vec<WriteOp> = (0..4096).map(|i| WriteOp { src: i * 16384, dst: 0, len: 8192 }).collect();
        let mut c = Progress::new(0, 4096 * 8192);
        let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
        assert_eq!(c.fill(&[], &ops[..], &mut iov), 128, "starts at 1 MiB");
        c.advance(&ops[..], 16 * 1024);
        assert_eq!(c.fill(&[], &ops[..], &mut iov), 32, "shrinks to the 256 KiB floor");
        c.advance(&ops[..], 256 * 1024);
        assert_eq!(c.fill(&[], &ops[..], &mut iov), 128, "grows to four times the last call");
        c.advance(&ops[..], 8 << 20);
        assert_eq!(c.fill(&[], &ops[..], &mut iov), MAX_IOVECS, "capped at IOV_MAX");
    }

    #[test]
    fn fill_stops_at_iov_max_with_a_prefix() {
        let ops: Vec<WriteOp> = (0..3000).map(|i| WriteOp { src: i * 64, dst: 0, len: 8 }).collect();
        let prefix = [0u8; 16];
        let c = Progress::new(prefix.len(), 3000 * 8);
        let mut iov = [EMPTY_IOVEC; MAX_IOVECS];
        assert_eq!(c.fill(&prefix, &ops[..], &mut iov), MAX_IOVECS);
        assert_eq!(iov[0].iov_len, 16, "the prefix goes first");
    }
}
