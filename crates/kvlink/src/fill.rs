//! Writing and checking request KV in an owned cache: the only `unsafe`
//! in this crate besides `getrusage`, under the engine's rule that a block
//! is touched only while no transfer uses it.
//!
//! Blocks are copied through one scratch buffer per call
//! ([`OwnedKvCache::write_block`], [`OwnedKvCache::read_block`]): no Rust
//! reference to memory a peer may write is ever made.

use kv_proto::BlockId;
use kv_worker::pattern::RegionRows;
use kv_worker::{BlockError, OwnedKvCache};

/// "Computes" a request's KV on P: every head row of block `i` (prompt
/// tokens from `i` times the block size) of every region gets the pattern
/// of (seed, layer, K/V, token, the model's head), so a decode instance
/// of another tensor-parallel size, block size or token layout can check
/// the rows it holds.
///
/// The caller owns `blocks` (allocated to this request, not yet handed to
/// the scheduler's `request_finished`, so no transfer reads them).
///
/// # Errors
///
/// The first block that is not in the cache; the blocks before it (in
/// region order) were written.
pub(crate) fn fill_request(
    cache: &OwnedKvCache,
    rows: &[RegionRows],
    seed: u64,
    blocks: &[BlockId],
) -> Result<(), BlockError> {
    let mut scratch = vec![0u8; cache.block_len()];
    let tokens = u64::from(cache.shape().block_size());
    for (region, rows) in rows.iter().enumerate() {
        for (position, &block) in blocks.iter().enumerate() {
            rows.fill(&mut scratch, seed, position as u64 * tokens);
            // SAFETY: see the function's contract: no transfer touches these
            // blocks while P computes them; `scratch` is not cache memory.
            unsafe { cache.write_block(region, block, &scratch) }?;
        }
    }
    Ok(())
}

/// Checks a request's KV on D: `blocks` hold the prompt from token
/// `first_token` (rounded down to a block) on; every head row of tokens
/// `first_token..end_token` must be what P computed. Returns the first
/// (region, block) that is wrong or not in the cache.
///
/// The caller guarantees the pull into `blocks` was reported received, so
/// no transfer writes them.
pub(crate) fn verify_request(
    cache: &OwnedKvCache,
    rows: &[RegionRows],
    seed: u64,
    blocks: &[BlockId],
    first_token: u64,
    end_token: u64,
) -> Result<(), (u32, BlockId)> {
    let mut scratch = vec![0u8; cache.block_len()];
    let tokens = u64::from(cache.shape().block_size());
    let origin = first_token - first_token % tokens.max(1);
    for (region, rows) in rows.iter().enumerate() {
        for (i, &block) in blocks.iter().enumerate() {
            let block_first = origin + i as u64 * tokens;
            // SAFETY: see the function's contract: the pull that filled the
            // block has completed, and nothing writes it while we read;
            // `scratch` is not cache memory.
            let ok = unsafe { cache.read_block(region, block, &mut scratch) }.is_ok()
                && rows.check(&scratch, seed, block_first, first_token, end_token);
            if !ok {
                return Err((region as u32, block));
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

    fn rows(c: &OwnedKvCache) -> Vec<RegionRows> {
        RegionRows::of_shape(&c.shape(), 0, 0)
    }

    #[test]
    fn verify_accepts_what_fill_wrote_and_names_the_first_wrong_block() {
        let c = cache();
        let r = rows(&c);
        fill_request(&c, &r, 7, &[5, 2, 6]).unwrap();
        assert_eq!(verify_request(&c, &r, 7, &[5, 2, 6], 0, 48), Ok(()));
        // D with a one-block prefix hit holds tokens 16.. only.
        assert_eq!(verify_request(&c, &r, 7, &[2, 6], 16, 48), Ok(()));
        assert_eq!(verify_request(&c, &r, 8, &[5, 2, 6], 0, 48), Err((0, 5)), "another request's seed");
        assert_eq!(verify_request(&c, &r, 7, &[5, 6, 2], 0, 48), Err((0, 6)), "blocks out of order");

        let mut block = vec![0u8; c.block_len()];
        // SAFETY: this cache is never registered with a transport.
        unsafe { c.read_block(3, 6, &mut block) }.unwrap();
        block[c.block_len() - 1] ^= 1;
        // SAFETY: as above.
        unsafe { c.write_block(3, 6, &block) }.unwrap();
        assert_eq!(verify_request(&c, &r, 7, &[5, 2, 6], 0, 48), Err((3, 6)));
        assert_eq!(verify_request(&c, &r, 7, &[5, 2, 6], 0, 47), Ok(()), "past the prompt is not looked at");
    }

    #[test]
    fn blocks_outside_the_cache_are_errors() {
        let c = cache();
        let r = rows(&c);
        assert_eq!(fill_request(&c, &r, 7, &[1, 8]), Err(BlockError::NoSuchBlock { block: 8, num_blocks: 8 }));
        assert_eq!(verify_request(&c, &r, 7, &[BlockId::MAX], 0, 16), Err((0, BlockId::MAX)));
    }
}
