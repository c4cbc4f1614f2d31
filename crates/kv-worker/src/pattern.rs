//! Deterministic block contents, so a receiver can verify every byte of a
//! transfer without a copy of the sender's cache (tests, demo, bench).

/// Seed of one block's pattern: derived from the request, the region and the
/// block's position in the request's prompt (not its block id, which
/// differs between P and D).
pub fn block_seed(request_seed: u64, region: u32, position: u32) -> u64 {
    mix(request_seed ^ (u64::from(region) << 32) ^ u64::from(position))
}

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser.
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn word(seed: u64, index: usize) -> u64 {
    seed.wrapping_add((index as u64).wrapping_mul(0x2545_f491_4f6c_dd1d))
}

/// Fills `buf` with the pattern of `seed`.
pub fn fill(buf: &mut [u8], seed: u64) {
    let mut chunks = buf.chunks_exact_mut(8);
    for (i, chunk) in chunks.by_ref().enumerate() {
        chunk.copy_from_slice(&word(seed, i).to_le_bytes());
    }
    let tail_index = buf.len() / 8;
    let tail = word(seed, tail_index).to_le_bytes();
    let rest = buf.len() % 8;
    let start = buf.len() - rest;
    buf[start..].copy_from_slice(&tail[..rest]);
}

/// Whether `buf` holds exactly the pattern of `seed`.
pub fn matches(buf: &[u8], seed: u64) -> bool {
    let mut chunks = buf.chunks_exact(8);
    for (i, chunk) in chunks.by_ref().enumerate() {
        if chunk != word(seed, i).to_le_bytes() {
            return false;
        }
    }
    let rest = chunks.remainder();
    rest == &word(seed, buf.len() / 8).to_le_bytes()[..rest.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_match_and_detect_one_flipped_byte() {
        for len in [0usize, 1, 7, 8, 9, 4096, 4099] {
            let mut buf = vec![0u8; len];
            fill(&mut buf, 42);
            assert!(matches(&buf, 42));
            if len > 0 {
                assert!(!matches(&buf, 43));
                buf[len - 1] ^= 1;
                assert!(!matches(&buf, 42));
            }
        }
        assert_ne!(block_seed(1, 0, 1), block_seed(1, 1, 0));
    }
}
