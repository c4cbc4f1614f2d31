//! What the TCP and QUIC receivers share when a batch arrives: its op list
//! read into `OpListBuffer` under a budget, then admitted against the grant
//! (`RegisteredMemory::admit`), as both servers do it, with the byte source
//! a fuzz input instead of a socket.

use std::time::{Duration, Instant};

use kv_proto::dataplane::{decode_op, OpListBuffer, OPS_PER_READ, OP_LEN};
use kv_proto::{DestinationError, GrantId, MemoryBudget, MemoryRegion, RegionAccess, RegisteredMemory};

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

/// How a batch's op list ended on the receiver.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ListOutcome {
    /// More ops than the limit: a protocol error.
    TooManyOps,
    /// The grant is not live: refused before the list is read.
    DeadGrant,
    /// The budget had no room for the list: refused, `unread` entries left.
    NoRoom { unread: u64 },
    /// The stream ended inside the list.
    Truncated,
    /// The lengths do not add up to the header's total: a protocol error.
    LengthMismatch,
    /// Refused by the grant check (outside the grant, overlapping).
    Refused,
    /// Admitted: the payload of `total` bytes follows.
    Admitted,
}

/// Reads a batch's op list of `op_count` entries from `stream` under
/// `grant`, as the TCP and QUIC receivers do: the count against the op limit,
/// the grant's liveness, the list grown in `OpListBuffer`'s steps each
/// charged to the budget first (half of it held by other batches if the
/// receiver says so), then the grant check.
///
/// Checks: a count over the limit gets no buffer, one within does; a list
/// within the limit always finds room in a budget it has alone; the
/// buffer never holds more than it reported and was charged, never more
/// entries than announced, and at most twice the entries that arrived or
/// one read step; the heap the read takes stays within the buffer plus a
/// slack; an admitted list's lengths add up to `total_bytes` and every op
/// lies in the grant; a length mismatch is one.
pub(crate) fn receive_op_list(
    stream: &mut Stream<'_>,
    receiver: &Receiver,
    grant: &GrantId,
    op_count: u64,
    total_bytes: u64,
) -> ListOutcome {
    let Receiver { memory, max_ops, budget, others, now } = receiver;
    let (memory, max_ops, budget, others, now) = (memory, *max_ops, *budget, *others, *now);
    let Some(mut buffer) = OpListBuffer::within(op_count, max_ops) else {
        assert!(op_count > max_ops, "a count of {op_count} within the limit of {max_ops} got no buffer");
        return ListOutcome::TooManyOps;
    };
    assert!(op_count <= max_ops, "a count of {op_count} over the limit of {max_ops} got a buffer");
    assert_eq!(buffer.count() as u64, op_count);
    match memory.check_grant(grant, now) {
        Ok(()) => {}
        Err(DestinationError::UnknownGrant | DestinationError::ExpiredGrant) => {
            assert_ne!(grant, &GrantId::from_bytes(GRANT_BYTES), "the live grant was refused");
            return ListOutcome::DeadGrant;
        }
        Err(e) => panic!("the grant check failed with {e}"),
    }

    let budget = MemoryBudget::new(budget);
    let mut other = budget.charge();
    if others {
        assert!(other.try_grow(budget.limit() / 2));
    }
    let mut charge = budget.charge();
    let (outcome, heap) = alloc_meter::measure(|| {
        while !buffer.is_complete() {
            let filled = buffer.filled();
            let more = buffer.growth();
            if more > 0 && !charge.try_grow(more) {
                assert!(others, "a list within the op limit found no room in a budget it has alone");
                return (ListOutcome::NoRoom { unread: (buffer.count() - filled) as u64 }, buffer.held());
            }
            let chunk = buffer.next_chunk();
            let chunk_len = chunk.len();
            let read = stream.read_into(chunk);
            let held = buffer.held();
            assert_eq!(held, charge.bytes(), "the buffer grew by more than it reported");
            assert!(held <= op_count * OP_LEN as u64, "the buffer holds more than the {op_count} entries announced");
            let step_bound = (2 * filled).max(filled + OPS_PER_READ) as u64 * OP_LEN as u64;
            assert!(held <= step_bound, "{held} bytes held after {filled} entries arrived");
            assert!(chunk_len > 0 && chunk_len <= OPS_PER_READ * OP_LEN && chunk_len % OP_LEN == 0);
            if !read {
                return (ListOutcome::Truncated, held);
            }
        }
        let held = buffer.held();
        let list = buffer.into_entries();
        assert_eq!(list.len() as u64, op_count);
        let sum = list.iter().try_fold(0u64, |sum, entry| sum.checked_add(decode_op(entry).1));
        let outcome = match memory.admit(grant, list.iter().map(decode_op), total_bytes, now) {
            Ok(access) => {
                assert!(access.is_live());
                assert_eq!(sum, Some(total_bytes), "admitted with lengths that do not add up");
                for (dst, len) in list.iter().map(decode_op) {
                    let inside = len == 0 || GRANT_RANGE.contains(dst, len);
                    assert!(inside, "admitted an op at {dst:#x}+{len:#x} outside the grant");
                }
                ListOutcome::Admitted
            }
            Err(DestinationError::LengthMismatch { declared, sum: got }) => {
                assert_eq!((declared, got), (total_bytes, sum));
                assert_ne!(sum, Some(total_bytes), "a length mismatch where the lengths add up");
                ListOutcome::LengthMismatch
            }
            Err(DestinationError::OutsideGrant { .. } | DestinationError::OverlappingOps { .. }) => {
                assert_eq!(sum, Some(total_bytes));
                ListOutcome::Refused
            }
            Err(e) => panic!("admission of a live grant failed with {e}"),
        };
        (outcome, held)
    });
    let (outcome, held) = outcome;
    let bound = 2 * usize::try_from(held).unwrap_or(usize::MAX) + SLACK;
    assert!(heap <= bound, "reading an op list took {heap} bytes of heap, its buffer {held}");
    outcome
}
