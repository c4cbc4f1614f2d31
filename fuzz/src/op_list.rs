//! What the TCP and QUIC receivers share when a batch arrives: the
//! batch-receive machine (`kv_proto::receive`) both servers run, driven
//! over a fuzz input instead of a socket, with the checks a batch must pass
//! whatever its bytes.

use std::time::{Duration, Instant};

use kv_proto::dataplane::{decode_op, first_overlap, ReplyStatus, OPS_PER_READ, OP_LEN};
use kv_proto::receive::{
    BatchReceiver, DecodeHeader, Fault, Framing, HeaderFields, PayloadEnd, ReceiveLimits, Refusal, Step,
};
use kv_proto::{DestinationError, GrantId, MemoryBudget, MemoryRegion, NoRoom, RegionAccess, RegisteredMemory};

use crate::alloc_meter;

/// Where the one destination region lies (never touched: admission only
/// checks numbers).
pub(crate) const REGION: MemoryRegion = MemoryRegion { addr: 0x10_0000, len: 0x10_0000 };
/// The id of the grant live in [`receiver_memory`], over the region's first half.
pub(crate) const GRANT_BYTES: [u8; 16] = [0x5a; 16];
/// The live grant's range.
pub(crate) const GRANT_RANGE: MemoryRegion = MemoryRegion { addr: 0x10_0000, len: 0x8_0000 };
/// Heap an op-list read may take beyond its buffer: the admission's sort
/// of an unordered list is charged apart (at most the list again).
const SLACK: usize = 64 * 1024;

/// A fuzz input read as a byte stream.
#[derive(Clone, Copy)]
pub(crate) struct Stream<'a> {
    bytes: &'a [u8],
}

impl<'a> Stream<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes }
    }

    /// The next `n` bytes, or `None` (the stream ends inside them).
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.bytes.split_at_checked(n)?;
        self.bytes = rest;
        Some(head)
    }

    /// The next `N` bytes as an array.
    pub(crate) fn array<const N: usize>(&mut self) -> Option<&'a [u8; N]> {
        self.take(N).and_then(|b| b.try_into().ok())
    }

    /// Fills `out` from the stream; `false` if the stream ended first.
    pub(crate) fn read_into(&mut self, out: &mut [u8]) -> bool {
        match self.take(out.len()) {
            Some(bytes) => {
                out.copy_from_slice(bytes);
                true
            }
            None => false,
        }
    }

    /// Skips `n` bytes (a discarded op list or payload); `false` if the
    /// stream ended first.
    pub(crate) fn skip(&mut self, n: u64) -> bool {
        match usize::try_from(n).ok().and_then(|n| self.take(n)) {
            Some(_) => true,
            None => {
                self.bytes = &[];
                false
            }
        }
    }
}

/// A receiver's registered memory: one destination region, [`GRANT`] live
/// over its first half.
fn receiver_memory(now: Instant) -> RegisteredMemory {
    let memory = RegisteredMemory::new();
    // SAFETY: nothing is ever written through these addresses: the targets
    // only admit op lists, which checks numbers.
    let registered = unsafe { memory.register(&[REGION], RegionAccess::Destination) };
    assert!(registered.is_ok(), "one region registers");
    let issued = memory.issue_grant(GrantId::from_bytes(GRANT_BYTES), &[GRANT_RANGE], now, Duration::from_secs(60));
    assert!(issued.is_ok(), "the grant is issued");
    memory
}

/// A receiver's state for the batches of one input: its memory (see
/// [`receiver_memory`]), op limit and op-list budget.
pub(crate) struct Receiver {
    memory: RegisteredMemory,
    max_ops: u64,
    budget: u64,
    /// Whether other batches hold half the budget.
    others: bool,
    now: Instant,
}

impl Receiver {
    /// A receiver with this op limit and budget in force (as its
    /// configuration computes them).
    pub(crate) fn new(max_ops: u64, budget: u64, others: bool) -> Self {
        assert!(max_ops.saturating_mul(OP_LEN as u64) <= budget, "the op limit in force does not fit the budget");
        let now = Instant::now();
        Self { memory: receiver_memory(now), max_ops, budget, others, now }
    }
}

/// How the batches of one input ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The stream ran out where the receiver waited for more.
    Truncated,
    /// The receiver would wait for the next batch, and there is none.
    Idle,
    /// The stream's one batch is done.
    Done,
    /// The connection (or stream) ends for this fault.
    Failed(Fault),
}

/// What one batch showed, for the checks at its end.
#[derive(Default)]
struct Batch {
    /// Where the batch started in the stream.
    start: usize,
    header: Option<(GrantId, u64, u64, bool, bool)>,
    /// The op list's bytes as read.
    list: Vec<u8>,
    /// The most the batch held of the budget.
    held: u64,
    refused: Option<Refusal>,
    landed: bool,
    replies: Vec<ReplyStatus>,
    stopped: bool,
}

/// Drives the batch-receive machine (`kv_proto::receive::BatchReceiver`,
/// which the TCP and QUIC receivers run) over `stream` as `framing` says,
/// with `receiver`'s memory, op limit and budget (half of it held by other
/// batches if the receiver says so), landing admitted payloads by skipping
/// them, until the stream runs out, the machine fails, or it is done.
///
/// Checks, per batch: a count over the limit fails before anything is
/// buffered, and only such a count; a header that is not well formed fails
/// at once, and only such a one; a grant not live is refused before its op
/// list is read; a list within the limit always finds room in a budget it
/// has alone; what the batch holds of the budget never exceeds its
/// announced entries, nor twice what arrived or one read step, and its heap
/// stays within twice that plus a slack; an admitted list's lengths add up
/// and every op lies in the grant, no two overlapping; a length mismatch is
/// one; a refusal for an op is for one outside the grant or overlapping;
/// every refusal is answered `Refused` and only after it, `Ok` only for a
/// pre-checked batch or a payload that landed; the op-list budget is given
/// back before the reply; and, on a connection, what is left of a batch is
/// read to its end, so the next batch starts where the sender put it.
pub(crate) fn receive_batches<H: Copy + Into<HeaderFields>, const N: usize>(
    stream: &mut Stream<'_>,
    receiver: &Receiver,
    framing: Framing,
    decode: DecodeHeader<H, N>,
) -> Ended {
    let Receiver { memory, max_ops, budget, others, now } = receiver;
    let (max_ops, now, others) = (*max_ops, *now, *others);
    let connection = matches!(framing, Framing::Connection { .. });
    let limits = ReceiveLimits { max_ops, op_list_budget: *budget, op_list_timeout: Duration::from_secs(10) };
    let mut rx = BatchReceiver::new(memory, limits, framing, decode);
    let budget = MemoryBudget::new(*budget);
    let mut other = budget.charge();
    if others {
        assert!(other.try_grow(budget.limit() / 2));
    }
    let mut share = budget.charge();
    let total_len = stream.bytes.len();
    let mut batch = Batch::default();
    let mut heap_bound = SLACK;
    let (ended, heap) = alloc_meter::measure(|| loop {
        let position = total_len - stream.bytes.len();
        match rx.next_step() {
            Step::AwaitBatch => {
                assert!(connection, "a stream's batch waits for no other");
                if position > 0 {
                    end_of_batch(&batch, position - batch.start, N);
                }
                if stream.bytes.is_empty() {
                    return Ended::Idle;
                }
                batch = Batch { start: position, ..Batch::default() };
                rx.advance(now);
            }
            Step::Read { what, into, by } => {
                let chunk_len = into.len();
                if !stream.read_into(into) {
                    return Ended::Truncated;
                }
                if what == "op list" {
                    assert!(by.is_some(), "the op list has its deadline");
                    let step_bound = (2 * (batch.list.len() / OP_LEN)).max(batch.list.len() / OP_LEN + OPS_PER_READ);
                    assert!(share.bytes() <= (step_bound * OP_LEN) as u64, "{} bytes held", share.bytes());
                    assert!(chunk_len > 0 && chunk_len <= OPS_PER_READ * OP_LEN && chunk_len % OP_LEN == 0);
                    batch.list.extend_from_slice(into);
                }
                rx.advance(now);
                if what == "batch header" {
                    let header = rx.header().map(|&h| {
                        let h: HeaderFields = h.into();
                        (h.grant, h.op_count, h.total_bytes, h.precheck, h.well_formed)
                    });
                    batch.header = header;
                }
            }
            Step::Charge { bytes, .. } => {
                let Some((_, count, ..)) = batch.header else { panic!("a charge before a header") };
                assert!(count <= max_ops, "a count of {count} over the limit of {max_ops} is charged");
                if share.try_grow(bytes) {
                    batch.held = batch.held.max(share.bytes());
                    heap_bound = heap_bound.max(2 * usize::try_from(batch.held).unwrap_or(usize::MAX) + SLACK);
                    assert!(share.bytes() <= count * OP_LEN as u64, "more held than the {count} entries announced");
                    rx.advance(now);
                } else {
                    assert!(others, "a list within the op limit found no room in a budget it has alone");
                    let no_room = if share.holds_fair_share() {
                        NoRoom::GiveWay { held: share.bytes(), holders: budget.holders() }
                    } else {
                        NoRoom::Timeout
                    };
                    rx.no_room(no_room);
                }
            }
            Step::Refused { refusal, reason } => {
                assert!(!reason.is_empty() && batch.refused.is_none() && batch.replies.is_empty());
                let (grant, ..) = batch.header.unwrap_or((GrantId::from_bytes([0; 16]), 0, 0, false, true));
                match refusal {
                    Refusal::Grant(DestinationError::UnknownGrant | DestinationError::ExpiredGrant) => {
                        assert_ne!(grant, GrantId::from_bytes(GRANT_BYTES), "the live grant was refused");
                        assert!(batch.list.is_empty(), "a dead grant's op list was read");
                    }
                    Refusal::Grant(DestinationError::OutsideGrant { .. } | DestinationError::OverlappingOps { .. }) => {
                        let ops: Vec<(u64, u64)> = entries(&batch.list).collect();
                        let outside = ops.iter().any(|&(dst, len)| !GRANT_RANGE.contains(dst, len));
                        assert!(outside || first_overlap(ops.iter().copied()).is_some(), "refused a list in its grant");
                    }
                    Refusal::NoRoom(_) => assert!(others),
                    other => panic!("refused for {other:?}"),
                }
                batch.refused = Some(*refusal);
                rx.advance(now);
            }
            Step::Discard { bytes } => {
                assert!(connection && batch.refused.is_some(), "only a refused batch is dropped");
                if !stream.skip(bytes) {
                    return Ended::Truncated;
                }
                rx.advance(now);
            }
            Step::Stop => {
                assert!(!connection && batch.refused.is_some(), "only a refused stream is stopped");
                batch.stopped = true;
                rx.advance(now);
            }
            Step::Payload { batch: admitted, .. } => {
                let Some((grant, count, total, ..)) = batch.header else { panic!("a payload before a header") };
                assert_eq!(admitted.grant(), grant);
                assert_eq!(grant, GrantId::from_bytes(GRANT_BYTES));
                assert!(admitted.access().is_live());
                assert_eq!(admitted.entries().len() as u64, count);
                assert_eq!(admitted.total(), total);
                let ops: Vec<(u64, u64)> = admitted.entries().iter().map(decode_op).collect();
                let sum = ops.iter().try_fold(0u64, |sum, &(_, len)| sum.checked_add(len));
                assert_eq!(sum, Some(total), "admitted with lengths that do not add up");
                for &(dst, len) in &ops {
                    assert!(len == 0 || GRANT_RANGE.contains(dst, len), "admitted an op at {dst:#x}+{len:#x}");
                }
                assert_eq!(first_overlap(ops.iter().copied()), None, "admitted overlapping ops");
                if !stream.skip(total) {
                    return Ended::Truncated;
                }
                batch.landed = true;
                rx.payload_end(PayloadEnd::Complete);
            }
            Step::Release => {
                share.release();
                rx.advance(now);
            }
            Step::Reply { status, .. } => {
                let admission = status == ReplyStatus::Ok && !batch.landed;
                assert!(admission || share.bytes() == 0, "the budget is given back before the reply");
                match status {
                    ReplyStatus::Refused => assert!(batch.refused.is_some(), "refused without a refusal"),
                    ReplyStatus::Ok => {
                        let precheck = batch.header.is_some_and(|(.., precheck, _)| precheck);
                        assert!(batch.landed || (precheck && batch.replies.is_empty()), "Ok before the payload");
                    }
                    other => panic!("the machine replied {other:?}"),
                }
                batch.replies.push(status);
                rx.advance(now);
            }
            Step::Done => {
                assert!(!connection);
                assert!(batch.landed || batch.stopped, "a stream done without its payload or a stop");
                return Ended::Done;
            }
            Step::Fail(fault) => {
                let (_, count, total, _, well_formed) =
                    batch.header.unwrap_or((GrantId::from_bytes([0; 16]), 0, 0, false, true));
                match fault {
                    Fault::Malformed => assert!(!well_formed),
                    Fault::TooManyOps { count: c, max } => {
                        assert!(well_formed && c == count && count > max && max == max_ops);
                        assert!(batch.list.is_empty());
                    }
                    Fault::LengthMismatch { declared, sum } => {
                        assert_eq!(declared, total);
                        assert_eq!(entries(&batch.list).map(|(_, len)| len).try_fold(0u64, u64::checked_add), sum);
                        assert_ne!(sum, Some(total), "a length mismatch where the lengths add up");
                    }
                    other => panic!("the machine failed with {other:?}"),
                }
                return Ended::Failed(fault);
            }
        }
    });
    assert!(heap <= heap_bound, "receiving took {heap} bytes of heap, the op list {} at most", batch.held);
    ended
}

fn entries(list: &[u8]) -> impl Iterator<Item = (u64, u64)> + '_ {
    list.chunks_exact(OP_LEN).map(|entry| decode_op(entry.try_into().unwrap_or(&[0; OP_LEN])))
}

/// Checks at the end of a batch on a connection, which read `read` bytes:
/// exactly its header, op list and (unless it was refused before its
/// payload was sent) payload, so the next one starts in step; it was
/// answered.
fn end_of_batch(batch: &Batch, read: usize, header_len: usize) {
    let Some((_, count, total, precheck, _)) = batch.header else { panic!("a batch ended without a header") };
    assert!(!batch.replies.is_empty(), "a batch ended without a reply");
    let payload = if precheck && batch.refused.is_some() { 0 } else { total };
    let expected = (count * OP_LEN as u64).saturating_add(payload).saturating_add(header_len as u64);
    assert_eq!(read as u64, expected, "the batch read {read} bytes, not its header, list and payload");
}
