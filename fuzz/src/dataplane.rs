//! `dataplane`: what every data-plane wire shares (op entries, the payload
//! cursor, verdicts) and the bounded texts.

use arbitrary::{Arbitrary, Unstructured};
use kv_proto::dataplane::{
    bounded_reason, decode_op, decode_verdict_header, encode_op, put_op_list, put_verdict, Cursor, OpEntry,
    ReplyStatus, Segments, MAX_REASON_LEN, OP_LEN, VERDICT_HEADER_LEN,
};
use kv_proto::{bounded_text, WriteOp, MAX_TEXT_LEN};

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Step {
    Walk { budget: u16 },
    WalkAll,
    Peek { budget: u16, max_pieces: u8 },
    Advance { n: u16 },
}

#[derive(Arbitrary, Debug)]
struct DataplaneInput {
    /// Raw op-list entries as a peer sends them.
    entries: Vec<OpEntry>,
    /// `(src, dst, len)`, lengths small enough to add up.
    ops: Vec<(u64, u64, u16)>,
    /// `None`: the cursor's total is the segments' sum; else a claimed total.
    claimed_total: Option<u32>,
    steps: Vec<Step>,
    status: u32,
    reason: String,
    /// How often to repeat `reason` (to pass the bounds).
    repeat: u16,
    verdict_header: [u8; VERDICT_HEADER_LEN],
}

/// Merges consecutive pieces that continue each other's addresses, so two
/// ways of cutting the same bytes compare equal.
fn merged(pieces: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(addr, len) in pieces.iter().filter(|p| p.1 > 0) {
        match out.last_mut() {
            Some(last) if last.0.checked_add(last.1) == Some(addr) => last.1 += len,
            _ => out.push((addr, len)),
        }
    }
    out
}

/// The first `n` bytes of `segs`, as pieces.
fn prefix(segs: &[(u64, u64)], mut n: u128) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(addr, len) in segs {
        if n == 0 {
            break;
        }
        let take = u128::from(len).min(n);
        // `take` <= `len`, a u64.
        out.push((addr, take as u64));
        n -= take;
    }
    out
}

/// Drives a cursor over `segs` (none wraps the address space) with `steps`.
///
/// Checks: every piece is non-empty and inside its segment; `walk` moves
/// `min(budget, remaining, bytes left in the segments)`; `peek` moves
/// nothing, yields at most `max_pieces` pieces and exactly the first pieces
/// `walk` would; `advance(n)` ends where `walk(n)` does; `remaining` and
/// `is_done` follow; all pieces walked, in order, are exactly the first bytes
/// of the segments; with a total no larger than the segments, walking to the
/// end finishes the cursor.
fn check_cursor<S: Segments + ?Sized>(segs: &S, list: &[(u64, u64)], total: u64, steps: &[Step]) {
    assert_eq!(segs.count(), list.len());
    let sum: u128 = list.iter().map(|s| u128::from(s.1)).sum();
    let mut cursor = Cursor::new(total);
    let mut consumed: u128 = 0;
    let mut walked: Vec<(u64, u64)> = Vec::new();
    let walk_on = |cursor: &mut Cursor, budget: u64| {
        let mut pieces = Vec::new();
        cursor.walk(segs, budget, |a, l| pieces.push((a, l)));
        pieces
    };
    let all_steps = steps.iter().copied().chain([Step::WalkAll]);
    for step in all_steps {
        let before = cursor;
        let left_in_segments = sum - consumed;
        match step {
            Step::Walk { .. } | Step::WalkAll | Step::Advance { .. } => {
                let budget = match step {
                    Step::Walk { budget } => u64::from(budget),
                    Step::Advance { n } => u64::from(n),
                    _ => u64::MAX,
                };
                let expected = u128::from(budget.min(before.remaining())).min(left_in_segments);
                let mut copy = before;
                let pieces = walk_on(&mut copy, budget);
                let moved: u128 = pieces.iter().map(|p| u128::from(p.1)).sum();
                assert_eq!(moved, expected, "walk({budget}) moved {moved} bytes, expected {expected}");
                assert!(pieces.iter().all(|p| p.1 > 0), "an empty piece");
                assert_eq!(u128::from(before.remaining() - copy.remaining()), moved);
                assert_eq!(copy.is_done(), copy.remaining() == 0);
                if let Step::Advance { n } = step {
                    cursor.advance(segs, u64::from(n));
                    // Past the segments' end, advance still counts bytes off
                    // the total; walk never moves past the segments.
                    if expected == u128::from(u64::from(n).min(before.remaining())) {
                        assert_eq!(cursor, copy, "advance({n}) and walk({n}) end apart");
                    }
                    consumed = (consumed + u128::from(before.remaining() - cursor.remaining())).min(sum);
                    let now_walked = sum.min(consumed);
                    walked = prefix(list, now_walked);
                } else {
                    cursor = copy;
                    consumed += moved;
                    walked.extend(pieces);
                }
            }
            Step::Peek { budget, max_pieces } => {
                let budget = u64::from(budget);
                let max_pieces = usize::from(max_pieces);
                let mut pieces = Vec::new();
                let described = cursor.peek(segs, budget, max_pieces, |a, l| pieces.push((a, l)));
                assert_eq!(cursor, before, "peek moved the cursor");
                assert!(pieces.len() <= max_pieces, "peek gave {} pieces, at most {max_pieces} asked", pieces.len());
                assert_eq!(u128::from(described), pieces.iter().map(|p| u128::from(p.1)).sum::<u128>());
                let mut copy = before;
                let full = walk_on(&mut copy, budget);
                assert_eq!(&full[..pieces.len()], &pieces[..], "peek and walk disagree on the pieces");
            }
        }
    }
    assert_eq!(merged(&walked), merged(&prefix(list, consumed)), "the walk did not follow the segments");
    if u128::from(total) <= sum {
        assert!(cursor.is_done(), "walking to the end left {} bytes", cursor.remaining());
    }
}

fn check_bounded(original: &str, bounded: &str, max: usize) {
    assert!(bounded.len() <= max, "{} bytes kept, at most {max}", bounded.len());
    assert!(original.starts_with(bounded), "not a prefix of the original");
    if original.len() <= max {
        assert_eq!(bounded, original, "a short text was cut");
    } else {
        assert!(bounded.len() > max - 4, "cut {} bytes more than the character boundary needs", max - bounded.len());
    }
}

/// Op entries, op lists, the payload cursor over both kinds of segment
/// lists, verdicts and bounded texts.
///
/// Checks: entries round-trip both ways; `put_op_list` is the entries of its
/// ops in order; the cursor checks of [`check_cursor`], over senders' ops
/// and receivers' entries, with the true total and with a claimed one; any
/// cursor steps over segments that wrap the address space do not panic; a
/// verdict's header decodes to its status and reason length, the reason is
/// `bounded_reason` of the given one, and both `bounded_reason` and
/// `bounded_text` keep the longest prefix within their bound that ends on a
/// character boundary.
pub fn dataplane(data: &[u8]) {
    let Ok(input) = DataplaneInput::arbitrary_take_rest(Unstructured::new(data)) else { return };

    for entry in &input.entries {
        let (dst, len) = decode_op(entry);
        assert_eq!(&encode_op(dst, len), entry);
    }
    let ops: Vec<WriteOp> =
        input.ops.iter().map(|&(src, dst, len)| WriteOp { src, dst, len: u64::from(len) }).collect();
    let mut list = Vec::new();
    put_op_list(&mut list, &ops);
    assert_eq!(list.len(), ops.len() * OP_LEN);
    for (op, entry) in ops.iter().zip(list.chunks_exact(OP_LEN)) {
        assert_eq!(entry, encode_op(op.dst, op.len));
        let mut e: OpEntry = [0; OP_LEN];
        e.copy_from_slice(entry);
        assert_eq!(decode_op(&e), (op.dst, op.len));
    }

    // Sender side: each op's source range; keep them from wrapping.
    let sources: Vec<WriteOp> = ops.iter().map(|op| WriteOp { src: op.src.min(u64::MAX - op.len), ..*op }).collect();
    let source_list: Vec<(u64, u64)> = sources.iter().map(|op| (op.src, op.len)).collect();
    // Receiver side: entries whose ranges do not wrap.
    let entries: Vec<OpEntry> = input
        .entries
        .iter()
        .map(|e| {
            let (dst, len) = decode_op(e);
            let len = len % 65_536;
            encode_op(dst.min(u64::MAX - len), len)
        })
        .collect();
    let entry_list: Vec<(u64, u64)> = entries.iter().map(decode_op).collect();
    for (segs_list, is_ops) in [(&source_list, true), (&entry_list, false)] {
        let sum: u64 = segs_list.iter().map(|s| s.1).sum();
        let total = input.claimed_total.map_or(sum, u64::from);
        if is_ops {
            check_cursor(&sources[..], segs_list, total, &input.steps);
        } else {
            check_cursor(&entries[..], segs_list, total, &input.steps);
        }
    }
    // Raw peer entries may wrap: only no panic is asked.
    let mut cursor = Cursor::new(input.entries.iter().fold(0u64, |s, e| s.saturating_add(decode_op(e).1)));
    for step in &input.steps {
        match *step {
            Step::Walk { budget } => cursor.walk(&input.entries[..], budget.into(), |_, _| {}),
            Step::WalkAll => cursor.walk(&input.entries[..], u64::MAX, |_, _| {}),
            Step::Peek { budget, max_pieces } => {
                cursor.peek(&input.entries[..], budget.into(), max_pieces.into(), |_, _| {});
            }
            Step::Advance { n } => cursor.advance(&input.entries[..], n.into()),
        }
    }

    // Verdicts.
    let reason = input.reason.repeat(usize::from(input.repeat % 600));
    let status = ReplyStatus::from_code(input.status);
    assert_eq!(status.code(), input.status);
    let mut verdict = Vec::new();
    put_verdict(&mut verdict, status, &reason);
    let mut header = [0u8; VERDICT_HEADER_LEN];
    header.copy_from_slice(&verdict[..VERDICT_HEADER_LEN]);
    let (got_status, reason_len) = decode_verdict_header(&header);
    assert_eq!(got_status, status);
    let kept = bounded_reason(&reason);
    assert_eq!(usize::try_from(reason_len).ok(), Some(kept.len()));
    assert_eq!(&verdict[VERDICT_HEADER_LEN..], kept.as_bytes());
    check_bounded(&reason, kept, MAX_REASON_LEN);
    check_bounded(&reason, &bounded_text(&reason), MAX_TEXT_LEN);
    let (status, len) = decode_verdict_header(&input.verdict_header);
    let mut again = Vec::new();
    again.extend_from_slice(&status.code().to_le_bytes());
    again.extend_from_slice(&len.to_le_bytes());
    assert_eq!(again, input.verdict_header, "a verdict header does not round-trip");
}
