//! Spreading one large batch over several connections: the ops are cut into
//! parts of about equal bytes, an op straddling a cut split in two.
//!
//! Each part travels on its own connection and the receiver admits each on
//! its own, so to keep "a batch with one op outside its grant is refused
//! whole, nothing written", the parts are pre-checked first: every part's
//! header and op list go out asking for an admission verdict, and payloads
//! follow only once every part was admitted (see `TcpTransport::write_split`
//! and its gate).

use kv_proto::WriteOp;

/// How many connections a batch of `total` payload bytes is spread over.
pub(crate) fn stream_count(total: u64, parallel_streams: usize, parallel_min_bytes: u64) -> usize {
    if parallel_streams <= 1 || total < parallel_min_bytes.max(1) {
        1
    } else {
        parallel_streams
    }
}

/// Cuts `ops` (whose lengths add up to `total`) into `parts` lists of about
/// `total / parts` bytes each, keeping op order; empty parts are dropped.
pub(crate) fn split_by_bytes(ops: &[WriteOp], total: u64, parts: usize) -> Vec<Vec<WriteOp>> {
    let parts = parts.max(1) as u64;
    let share = total.div_ceil(parts).max(1);
    let mut out: Vec<Vec<WriteOp>> = Vec::with_capacity(parts as usize);
    let mut current: Vec<WriteOp> = Vec::new();
    let mut room = share;
    for op in ops {
        let mut op = *op;
        while op.len > room {
            if room > 0 {
                current.push(WriteOp { src: op.src, dst: op.dst, len: room });
                op = WriteOp { src: op.src + room, dst: op.dst + room, len: op.len - room };
            }
            out.push(std::mem::take(&mut current));
            room = share;
        }
        room -= op.len;
        current.push(op);
    }
    out.push(current);
    out.retain(|part| part.iter().any(|op| op.len > 0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(part: &[WriteOp]) -> u64 {
        part.iter().map(|o| o.len).sum()
    }

    #[test]
    fn small_batches_use_one_stream() {
        assert_eq!(stream_count(10, 2, 16), 1);
        assert_eq!(stream_count(16, 2, 16), 2);
        assert_eq!(stream_count(1 << 30, 1, 16), 1);
    }

    #[test]
    fn one_big_op_is_cut_into_equal_parts() {
        let op = WriteOp { src: 1000, dst: 5000, len: 100 };
        let parts = split_by_bytes(&[op], 100, 2);
        assert_eq!(
            parts,
            vec![vec![WriteOp { src: 1000, dst: 5000, len: 50 }], vec![WriteOp { src: 1050, dst: 5050, len: 50 }]]
        );
    }

    #[test]
    fn parts_cover_every_byte_once_in_order() {
        let ops: Vec<WriteOp> =
            (0..97u64).map(|i| WriteOp { src: i * 1000, dst: 500_000 - i * 1000, len: 1 + (i * 37) % 700 }).collect();
        let total: u64 = ops.iter().map(|o| o.len).sum();
        for parts in 1..6 {
            let split = split_by_bytes(&ops, total, parts);
            assert!(split.len() <= parts);
            assert_eq!(split.iter().map(|p| bytes(p)).sum::<u64>(), total);
            let share = total.div_ceil(parts as u64);
            assert!(split.iter().all(|p| bytes(p) <= share), "no part exceeds its share");
            // Re-joining adjacent pieces gives back the original ops.
            let mut joined: Vec<WriteOp> = Vec::new();
            for op in split.into_iter().flatten() {
                match joined.last_mut() {
                    Some(last) if last.src + last.len == op.src && last.dst + last.len == op.dst && op.len > 0 => {
                        last.len += op.len
                    }
                    _ => joined.push(op),
                }
            }
            assert_eq!(joined, ops);
        }
    }

    #[test]
    fn zero_length_ops_do_not_make_parts() {
        let ops = [WriteOp { src: 0, dst: 0, len: 0 }, WriteOp { src: 8, dst: 8, len: 8 }];
        let parts = split_by_bytes(&ops, 8, 4);
        assert_eq!(parts.len(), 4);
        assert!(parts.iter().all(|p| bytes(p) == 2));
        assert!(split_by_bytes(&ops[..1], 0, 4).is_empty(), "nothing to send makes no part");
    }
}
