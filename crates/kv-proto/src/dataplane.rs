//! What every data-plane wire shares: the op-list entry, the walk of a
//! batch's payload through its ops, and the receiver's verdict with its
//! bounded reason, and the receiver's buffer for an op list
//! ([`OpListBuffer`]). Pure encode/decode (via `bytes`), no I/O; each
//! transport frames these its own way.

use bytes::{Buf, BufMut};

use crate::memory::WriteOp;

pub use crate::op_list::{OpListBuffer, OPS_PER_READ};

/// Bytes of one op-list entry on a wire: `dst u64 LE | len u64 LE`.
pub const OP_LEN: usize = 16;

/// One op-list entry as it travels (the receiver keeps the list in this
/// form: decoding is a shift, and the list is reused batch to batch).
pub type OpEntry = [u8; OP_LEN];

/// Bound on the reason text of a refusal (peer input on the sender side).
pub const MAX_REASON_LEN: usize = 1024;

/// The entry of a write to `dst` of `len` bytes.
pub fn encode_op(dst: u64, len: u64) -> OpEntry {
    let mut entry = [0u8; OP_LEN];
    let mut buf = &mut entry[..];
    buf.put_u64_le(dst);
    buf.put_u64_le(len);
    entry
}

/// `(dst, len)` of an entry.
pub fn decode_op(entry: &OpEntry) -> (u64, u64) {
    let mut buf = &entry[..];
    (buf.get_u64_le(), buf.get_u64_le())
}

/// Appends the op list of `ops` (their destinations and lengths) to `out`.
pub fn put_op_list(out: &mut impl BufMut, ops: &[WriteOp]) {
    for op in ops {
        out.put_u64_le(op.dst);
        out.put_u64_le(op.len);
    }
}

/// Where two of `(dst, len)` `ops` write the same bytes, if any do: the
/// later-starting one's address. Ops in ascending order (the common case)
/// cost one pass and no allocation; others are sorted. A sender checks its
/// batch with it where the receiver cannot (one-sided writes); a receiver
/// checks inside [`crate::RegisteredMemory::admit`].
pub fn first_overlap(ops: impl IntoIterator<Item = (u64, u64)> + Clone) -> Option<u64> {
    let mut end = 0u64;
    let mut ascending = true;
    for (dst, len) in ops.clone() {
        if len == 0 {
            continue;
        }
        if dst < end {
            ascending = false;
            break;
        }
        end = dst.saturating_add(len);
    }
    if ascending {
        return None;
    }
    let mut ranges: Vec<(u64, u64)> = ops.into_iter().filter(|&(_, len)| len > 0).collect();
    ranges.sort_unstable();
    ranges.windows(2).find(|pair| pair[1].0 < pair[0].0.saturating_add(pair[0].1)).map(|pair| pair[1].0)
}

/// A run of `(address, length)` segments a payload moves through, in order.
pub trait Segments {
    /// How many segments.
    fn count(&self) -> usize;
    /// Segment `i` (`(0, 0)` past the end).
    fn segment(&self, i: usize) -> (u64, u64);
}

/// A sender's payload: each op's source range.
impl Segments for [WriteOp] {
    fn count(&self) -> usize {
        self.len()
    }
    fn segment(&self, i: usize) -> (u64, u64) {
        self.get(i).map_or((0, 0), |op| (op.src, op.len))
    }
}

/// A receiver's payload: each entry's destination range.
impl Segments for [OpEntry] {
    fn count(&self) -> usize {
        self.len()
    }
    fn segment(&self, i: usize) -> (u64, u64) {
        self.get(i).map_or((0, 0), decode_op)
    }
}

/// Progress through the concatenation of a batch's segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    op: usize,
    off: u64,
    remaining: u64,
}

impl Cursor {
    /// At the start of a payload of `total` bytes.
    pub fn new(total: u64) -> Self {
        Self { op: 0, off: 0, remaining: total }
    }

    /// Whether every byte has moved.
    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// Bytes still to move.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Calls `f(address, length)` for the next pieces from here, at most
    /// `budget` bytes and `max_pieces` pieces in all, without moving; returns
    /// the bytes described. Zero-length segments are skipped.
    pub fn peek<S: Segments + ?Sized>(
        &self,
        segs: &S,
        budget: u64,
        max_pieces: usize,
        mut f: impl FnMut(u64, u64),
    ) -> u64 {
        let mut left = budget.min(self.remaining);
        let (mut op, mut off, mut pieces) = (self.op, self.off, 0);
        while left > 0 && pieces < max_pieces && op < segs.count() {
            let (addr, len) = segs.segment(op);
            let take = len.saturating_sub(off).min(left);
            if take > 0 {
                f(addr.saturating_add(off), take);
                left -= take;
                pieces += 1;
            }
            op += 1;
            off = 0;
        }
        budget.min(self.remaining) - left
    }

    /// Moves past `n` bytes.
    pub fn advance<S: Segments + ?Sized>(&mut self, segs: &S, n: u64) {
        let mut n = n.min(self.remaining);
        self.remaining -= n;
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

    /// Calls `f(address, length)` for the next pieces, at most `budget`
    /// bytes in all, and moves past them. The lengths add up to
    /// `min(budget, remaining)`.
    pub fn walk<S: Segments + ?Sized>(&mut self, segs: &S, budget: u64, mut f: impl FnMut(u64, u64)) {
        let moved = self.peek(segs, budget, usize::MAX, &mut f);
        self.advance(segs, moved);
    }
}

/// The receiver's verdict on a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyStatus {
    /// Every byte is in the receiver's memory (or, for a pre-check, the
    /// batch is admitted and its payload may follow).
    Ok,
    /// Refused whole, nothing written: an op outside the grant, or an
    /// unknown, expired or revoked grant.
    Refused,
    /// The sender broke the protocol.
    ProtocolError,
    /// A status this build does not know.
    Unknown(u32),
}

impl ReplyStatus {
    /// The status code on the wire.
    pub fn code(self) -> u32 {
        match self {
            ReplyStatus::Ok => 0,
            ReplyStatus::Refused => 1,
            ReplyStatus::ProtocolError => 2,
            ReplyStatus::Unknown(c) => c,
        }
    }

    /// The status of a wire code.
    pub fn from_code(code: u32) -> Self {
        match code {
            0 => ReplyStatus::Ok,
            1 => ReplyStatus::Refused,
            2 => ReplyStatus::ProtocolError,
            c => ReplyStatus::Unknown(c),
        }
    }
}

/// `reason` cut to at most [`MAX_REASON_LEN`] bytes on a character boundary.
pub fn bounded_reason(reason: &str) -> &str {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason.get(..end).unwrap_or_default()
}

/// Appends `status u32 LE | reason_len u32 LE | reason` (the reason bounded).
pub fn put_verdict(out: &mut impl BufMut, status: ReplyStatus, reason: &str) {
    let reason = bounded_reason(reason);
    out.put_u32_le(status.code());
    // At most MAX_REASON_LEN, which fits in u32.
    out.put_u32_le(reason.len() as u32);
    out.put_slice(reason.as_bytes());
}

/// Bytes of the fixed part of a verdict (`status | reason_len`).
pub const VERDICT_HEADER_LEN: usize = 8;

/// Parses a verdict's fixed part into `(status, reason_len)`.
pub fn decode_verdict_header(b: &[u8; VERDICT_HEADER_LEN]) -> (ReplyStatus, u32) {
    let mut buf = &b[..];
    (ReplyStatus::from_code(buf.get_u32_le()), buf.get_u32_le())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlaps_are_found_in_any_order() {
        assert_eq!(first_overlap([(0u64, 10u64), (10, 5), (20, 0), (20, 1)]), None);
        assert_eq!(first_overlap([(100u64, 10u64), (0, 10), (50, 10)]), None, "unsorted, disjoint");
        assert_eq!(first_overlap([(0u64, 10u64), (5, 10)]), Some(5));
        assert_eq!(first_overlap([(50u64, 1u64), (0, 100)]), Some(50));
        assert_eq!(first_overlap([(7u64, 1u64), (7, 1)]), Some(7));
    }

    #[test]
    fn ops_round_trip() {
        assert_eq!(decode_op(&encode_op(0xdead_beef, 8192)), (0xdead_beef, 8192));
        let mut list = Vec::new();
        put_op_list(&mut list, &[WriteOp { src: 1, dst: 2, len: 3 }, WriteOp { src: 4, dst: 5, len: 6 }]);
        assert_eq!(&list[..OP_LEN], &encode_op(2, 3));
        assert_eq!(&list[OP_LEN..], &encode_op(5, 6));
    }

    #[test]
    fn verdicts_round_trip_and_long_reasons_are_cut() {
        let mut out = Vec::new();
        put_verdict(&mut out, ReplyStatus::Refused, "op 1: outside");
        let mut h = [0u8; VERDICT_HEADER_LEN];
        h.copy_from_slice(&out[..VERDICT_HEADER_LEN]);
        assert_eq!(decode_verdict_header(&h), (ReplyStatus::Refused, 13));
        assert_eq!(&out[VERDICT_HEADER_LEN..], b"op 1: outside");
        let long = "é".repeat(MAX_REASON_LEN);
        assert!(bounded_reason(&long).len() <= MAX_REASON_LEN);
        for code in 0..5 {
            assert_eq!(ReplyStatus::from_code(code).code(), code);
        }
    }

    #[test]
    fn cursor_walks_segments_across_budgets_and_skips_empty_ones() {
        let ops = [
            WriteOp { src: 100, dst: 0, len: 10 },
            WriteOp { src: 500, dst: 0, len: 0 },
            WriteOp { src: 200, dst: 0, len: 5 },
        ];
        let mut c = Cursor::new(15);
        let mut seen = Vec::new();
        assert_eq!(c.peek(&ops[..], 100, 1, |a, l| seen.push((a, l))), 10, "one piece at most");
        seen.clear();
        c.walk(&ops[..], 6, |a, l| seen.push((a, l)));
        assert_eq!(seen, [(100, 6)]);
        seen.clear();
        c.walk(&ops[..], 100, |a, l| seen.push((a, l)));
        assert_eq!(seen, [(106, 4), (200, 5)]);
        assert!(c.is_done());
        assert_eq!(c.peek(&ops[..], 100, 10, |_, _| panic!("nothing left")), 0);
    }

    #[test]
    fn cursor_advance_matches_walk() {
        let entries: Vec<OpEntry> = (0..50u64).map(|i| encode_op(i * 1000, 1 + i % 7)).collect();
        let total: u64 = entries.iter().map(|e| decode_op(e).1).sum();
        for step in [1u64, 3, 8, 64] {
            let (mut a, mut b) = (Cursor::new(total), Cursor::new(total));
            while !a.is_done() {
                let mut first = None;
                b.peek(entries.as_slice(), step, usize::MAX, |addr, _| {
                    first.get_or_insert(addr);
                });
                let mut walked = None;
                a.walk(entries.as_slice(), step, |addr, _| {
                    walked.get_or_insert(addr);
                });
                assert_eq!(first, walked);
                b.advance(entries.as_slice(), step);
                assert_eq!(a, b);
            }
        }
    }
}
