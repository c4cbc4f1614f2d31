//! Writing and checking request KV in an owned cache: the only `unsafe`
//! in this crate besides `getrusage`, under the engine's rule that a block
//! is touched only while no transfer uses it.
//!
//! Blocks are copied through one scratch buffer per call
//! ([`OwnedKvCache::write_block`], [`OwnedKvCache::read_block`]): no Rust
//! reference to memory a peer may write is ever made.

use kv_proto::BlockId;
use kv_worker::pattern;
use kv_worker::{BlockError, OwnedKvCache};

/// "Computes" a request's KV on P: block at prompt position `p` of every
/// region gets the pattern of (seed, region, p).
///
/// The caller owns `blocks` (allocated to this request, not yet handed to
/// the scheduler's `request_finished`, so no transfer reads them).
///
/// # Errors
///
/// The first block that is not in the cache; the blocks before it (in
/// region order) were written.
pub(crate) fn fill_request(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) -> Result<(), BlockError> {
    let mut scratch = vec![0u8; cache.block_len()];
    for region in 0..cache.shape().region_count() {
        for (position, &block) in blocks.iter().enumerate() {
            pattern::fill(&mut scratch, pattern::block_seed(seed, region, position as u32));
            // SAFETY: see the function's contract: no transfer touches these
            // blocks while P computes them; `scratch` is not cache memory.
            unsafe { cache.write_block(region as usize, block, &scratch) }?;
        }
    }
    Ok(())
}

/// Checks a request's KV on D: `blocks` hold prompt positions
/// `first_position..`. Returns the first (region, block) that is wrong or
/// not in the cache.
///
/// The caller guarantees the pull into `blocks` was reported received, so
/// no transfer writes them.
pub(crate) fn verify_request(
    cache: &OwnedKvCache,
    seed: u64,
    blocks: &[BlockId],
    first_position: u32,
) -> Result<(), (u32, BlockId)> {
    let mut scratch = vec![0u8; cache.block_len()];
    for region in 0..cache.shape().region_count() {
        for (i, &block) in blocks.iter().enumerate() {
            let position = first_position + i as u32;
            // SAFETY: see the function's contract: the pull that filled the
            // block has completed, and nothing writes it while we read;
            // `scratch` is not cache memory.
            let ok = unsafe { cache.read_block(region as usize, block, &mut scratch) }.is_ok()
                && pattern::matches(&scratch, pattern::block_seed(seed, region, position));
            if !ok {
                return Err((region, block));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use kv_proto::LayoutKind;
    use kv_worker::{CacheDims, CacheShape};

    use super::*;

    fn cache() -> OwnedKvCache {
        let dims = CacheDims {
            kind: LayoutKind::SplitKv,
            num_layers: 2,
            num_blocks: 8,
            block_size: 16,
            num_kv_heads: 1,
            head_dim: 8,
            dtype_bytes: 2,
        };
        OwnedKvCache::allocate(CacheShape::try_new(dims).unwrap()).unwrap()
    }

    #[test]
    fn verify_accepts_what_fill_wrote_and_names_the_first_wrong_block() {
        let c = cache();
        fill_request(&c, 7, &[5, 2, 6]).unwrap();
        assert_eq!(verify_request(&c, 7, &[5, 2, 6], 0), Ok(()));
        // D with a one-block prefix hit holds positions 1.. only.
        assert_eq!(verify_request(&c, 7, &[2, 6], 1), Ok(()));
        assert_eq!(verify_request(&c, 8, &[5, 2, 6], 0), Err((0, 5)), "another request's seed");
        assert_eq!(verify_request(&c, 7, &[5, 6, 2], 0), Err((0, 6)), "blocks out of order");

        let mut block = vec![0u8; c.block_len()];
        // SAFETY: this cache is never registered with a transport.
        unsafe { c.read_block(3, 6, &mut block) }.unwrap();
        block[c.block_len() - 1] ^= 1;
        // SAFETY: as above.
        unsafe { c.write_block(3, 6, &block) }.unwrap();
        assert_eq!(verify_request(&c, 7, &[5, 2, 6], 0), Err((3, 6)));
    }

    #[test]
    fn blocks_outside_the_cache_are_errors() {
        let c = cache();
        assert_eq!(fill_request(&c, 7, &[1, 8]), Err(BlockError::NoSuchBlock { block: 8, num_blocks: 8 }));
        assert_eq!(verify_request(&c, 7, &[BlockId::MAX], 0), Err((0, BlockId::MAX)));
    }
}
