//! Writing and checking request KV in an owned cache: the only `unsafe`
//! in this crate, under the engine's rule that a block is touched only
//! while no transfer uses it.

use kv_proto::BlockId;
use kv_worker::pattern;
use kv_worker::OwnedKvCache;

/// "Computes" a request's KV on P: block at prompt position `p` of every
/// region gets the pattern of (seed, region, p).
///
/// The caller owns `blocks` (allocated to this request, not yet handed to
/// the scheduler's `request_finished`, so no transfer reads them).
pub(crate) fn fill_request(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) {
    for region in 0..cache.shape().region_count() {
        for (position, &block) in blocks.iter().enumerate() {
            // SAFETY: see the function's contract: no transfer touches these
            // blocks while P computes them, and no other slice of them lives.
            if let Some(buf) = unsafe { cache.block_mut(region as usize, block) } {
                pattern::fill(buf, pattern::block_seed(seed, region, position as u32));
            }
        }
    }
}

/// Checks a request's KV on D: `blocks` hold prompt positions
/// `first_position..`. Returns the first (region, block) that is wrong.
///
/// The caller guarantees the pull into `blocks` was reported received, so
/// no transfer writes them.
pub(crate) fn verify_request(
    cache: &OwnedKvCache,
    seed: u64,
    blocks: &[BlockId],
    first_position: u32,
) -> Result<(), (u32, BlockId)> {
    for region in 0..cache.shape().region_count() {
        for (i, &block) in blocks.iter().enumerate() {
            let position = first_position + i as u32;
            // SAFETY: see the function's contract: the pull that filled the
            // block has completed, and nothing writes it while we read.
            let ok = unsafe { cache.block(region as usize, block) }
                .is_some_and(|buf| pattern::matches(buf, pattern::block_seed(seed, region, position)));
            if !ok {
                return Err((region, block));
            }
        }
    }
    Ok(())
}
