//! Byte patterns that say which op wrote them: op `k` of a batch writes
//! pattern `k`, so a byte that landed in the wrong place, or not at all,
//! shows.

use kv_proto::{MemoryRegion, WriteOp};

use crate::TestBuf;

/// The pattern's period: a prime, so ops of power-of-two lengths do not
/// line up with it.
const PERIOD: usize = 251;
/// A whole number of periods, filled once and copied for long ranges.
const BLOCK: usize = PERIOD * 256;
/// Up to this many bytes are filled and checked byte by byte.
const SHORT: usize = 4096;

/// Byte `i` of pattern `seed`.
pub fn byte(seed: u64, i: usize) -> u8 {
    let shift = (seed % PERIOD as u64) as usize;
    let tag = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8;
    (((i + shift) % PERIOD) as u8) ^ tag
}

fn block(seed: u64) -> Vec<u8> {
    (0..BLOCK).map(|i| byte(seed, i)).collect()
}

/// Fills `buf` with pattern `seed`.
pub fn fill_slice(buf: &mut [u8], seed: u64) {
    if buf.len() <= SHORT {
        buf.iter_mut().enumerate().for_each(|(i, b)| *b = byte(seed, i));
        return;
    }
    let block = block(seed);
    for chunk in buf.chunks_mut(BLOCK) {
        chunk.copy_from_slice(&block[..chunk.len()]);
    }
}

/// Whether `buf` holds pattern `seed`.
pub fn holds(buf: &[u8], seed: u64) -> bool {
    if buf.len() <= SHORT {
        return buf.iter().enumerate().all(|(i, &b)| b == byte(seed, i));
    }
    let block = block(seed);
    buf.chunks(BLOCK).all(|chunk| chunk == &block[..chunk.len()])
}

/// Fills the source range of each op of `ops` (inside `src`) with the
/// pattern of its index.
pub fn fill(src: &mut TestBuf, ops: &[WriteOp]) {
    let base = src.addr();
    for (k, op) in ops.iter().enumerate() {
        let off = (op.src - base) as usize;
        fill_slice(&mut src.bytes_mut()[off..off + op.len as usize], k as u64);
    }
}

/// Checks the destination range of each op of `ops` (inside `dst`) holds
/// the pattern of its index.
pub fn check(dst: &TestBuf, ops: &[WriteOp]) {
    let base = dst.addr();
    for (k, op) in ops.iter().enumerate() {
        let off = (op.dst - base) as usize;
        assert!(holds(&dst.bytes()[off..off + op.len as usize], k as u64), "op {k} ({op:?}) landed wrong");
    }
}

/// `count` ops of `len` bytes, packed from the start of `src` to the
/// start of `dst`.
pub fn packed_ops(src: &TestBuf, dst: &TestBuf, count: usize, len: usize) -> Vec<WriteOp> {
    (0..count).map(|k| WriteOp { src: src.at(k * len), dst: dst.at(k * len), len: len as u64 }).collect()
}

/// The destination ranges of `ops`, merged where they touch or overlap
/// (zero-length ops add nothing): what a grant covering exactly them names.
pub fn covering(ops: &[WriteOp]) -> Vec<MemoryRegion> {
    let mut ranges: Vec<(u64, u64)> = ops.iter().filter(|op| op.len > 0).map(|op| (op.dst, op.dst + op.len)).collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (start, end) in ranges {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged.into_iter().map(|(start, end)| MemoryRegion::new(start, end - start)).collect()
}
