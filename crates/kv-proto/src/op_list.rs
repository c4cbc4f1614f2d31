//! The receiver's buffer for a peer's op list ([`OpListBuffer`]), shared by
//! every transport that reads one: the count a header announces is checked
//! against the receiver's limit before anything is allocated, and the buffer
//! grows only as the entries' bytes arrive, each growth reported before it
//! is made so the caller can charge it to its budget first.

use crate::dataplane::{OpEntry, OP_LEN};

/// Most entries read (and grown into) per step: memory follows the bytes
/// that actually arrive, not the count a peer announces.
pub const OPS_PER_READ: usize = 64 * 1024;

/// A peer's op list being read: `count` entries, grown geometrically (never
/// past `count`) in steps of at most [`OPS_PER_READ`] entries.
///
/// A read step: [`OpListBuffer::growth`] says how many bytes the next step
/// adds to the capacity (charge them first; 0 when the capacity suffices),
/// [`OpListBuffer::next_chunk`] makes that growth and hands out the bytes to
/// read the next entries into. After a failed read drop the buffer.
#[derive(Debug)]
pub struct OpListBuffer {
    list: Vec<OpEntry>,
    count: usize,
    /// Where the entries the last [`OpListBuffer::next_chunk`] handed out start.
    chunk_start: usize,
}

impl OpListBuffer {
    /// A buffer for an announced `count` of entries, or `None` when it is
    /// over `max` (or does not fit in memory's address space). Allocates
    /// nothing.
    pub fn within(count: u64, max: u64) -> Option<Self> {
        match usize::try_from(count) {
            Ok(count_usize) if count <= max => Some(Self { list: Vec::new(), count: count_usize, chunk_start: 0 }),
            _ => None,
        }
    }

    /// Entries announced.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Entries handed out for reading so far.
    pub fn filled(&self) -> usize {
        self.list.len()
    }

    /// Whether every announced entry was handed out.
    pub fn is_complete(&self) -> bool {
        self.list.len() >= self.count
    }

    /// Entries of the next step, and the capacity it needs.
    fn next_step(&self) -> (usize, usize) {
        let start = self.list.len();
        let end = start + (self.count - start).min(OPS_PER_READ);
        if end <= self.list.capacity() {
            return (end, self.list.capacity());
        }
        // Geometric growth, never past the announced count.
        (end, end.max(self.list.capacity().saturating_mul(2)).min(self.count))
    }

    /// Bytes the next [`OpListBuffer::next_chunk`] adds to the buffer's
    /// capacity (0 when it adds none).
    pub fn growth(&self) -> u64 {
        let (_, capacity) = self.next_step();
        ((capacity - self.list.capacity()) * OP_LEN) as u64
    }

    /// Bytes of memory the buffer holds.
    pub fn held(&self) -> u64 {
        (self.list.capacity() * OP_LEN) as u64
    }

    /// Grows the buffer by [`OpListBuffer::growth`] and hands out the next
    /// entries (at most [`OPS_PER_READ`]) to read into; empty once complete.
    pub fn next_chunk(&mut self) -> &mut [u8] {
        let start = self.list.len();
        let (end, capacity) = self.next_step();
        if capacity > self.list.capacity() {
            self.list.reserve_exact(capacity - start);
        }
        self.list.resize(end, [0; OP_LEN]);
        self.chunk_start = start;
        self.current_chunk()
    }

    /// The entries the last [`OpListBuffer::next_chunk`] handed out, again
    /// (empty before the first): a reader that hands them out in one step
    /// and reads into them in another.
    pub fn current_chunk(&mut self) -> &mut [u8] {
        self.list.get_mut(self.chunk_start..).unwrap_or_default().as_flattened_mut()
    }

    /// The entries handed out so far (all of them once complete).
    pub fn into_entries(self) -> Vec<OpEntry> {
        self.list
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_over_the_limit_gets_no_buffer() {
        assert!(OpListBuffer::within(11, 10).is_none());
        let b = OpListBuffer::within(10, 10).unwrap();
        assert_eq!((b.count(), b.filled(), b.held()), (10, 0, 0), "nothing allocated before a byte arrives");
    }

    #[test]
    fn the_buffer_grows_with_the_entries_read_never_past_the_count() {
        let count = 3 * OPS_PER_READ + 5;
        let mut b = OpListBuffer::within(count as u64, u64::MAX).unwrap();
        let mut charged = 0;
        let mut steps = Vec::new();
        while !b.is_complete() {
            charged += b.growth();
            let filled = b.filled();
            let chunk = b.next_chunk().len() / OP_LEN;
            assert_eq!(b.held(), charged, "every growth was reported before it was made");
            steps.push((filled, chunk, b.held() / OP_LEN as u64));
        }
        assert_eq!(
            steps,
            vec![
                (0, OPS_PER_READ, OPS_PER_READ as u64),
                (OPS_PER_READ, OPS_PER_READ, 2 * OPS_PER_READ as u64),
                (2 * OPS_PER_READ, OPS_PER_READ, count as u64),
                (3 * OPS_PER_READ, 5, count as u64),
            ]
        );
        assert_eq!(b.growth(), 0);
        assert_eq!(b.current_chunk().len(), 5 * OP_LEN, "the last chunk, again");
        assert!(b.next_chunk().is_empty());
        assert_eq!(b.into_entries().len(), count);
    }
}
