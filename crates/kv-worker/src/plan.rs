//! Transfer planning: which bytes of P's cache go where in D's.

use kv_proto::{BlockId, MemoryRegion, WriteOp};

/// A transfer that cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// D asked for more blocks than P holds for the request.
    #[error("decode asked for {remote} blocks, prefill holds {local}")]
    TooManyBlocks {
        /// Blocks P holds.
        local: usize,
        /// Blocks D asked for.
        remote: usize,
    },
    /// P and D register different numbers of regions.
    #[error("decode registered {remote} regions, prefill {local}")]
    RegionCount {
        /// P's regions.
        local: usize,
        /// D's regions.
        remote: usize,
    },
    /// A block id lies outside P's cache.
    #[error("prefill block {block} is outside its cache of {num_blocks} blocks")]
    LocalBlockOutOfRange {
        /// The block.
        block: BlockId,
        /// Blocks in the cache.
        num_blocks: u64,
    },
    /// A destination address overflows.
    #[error("decode block {block} overflows the address space")]
    RemoteAddressOverflow {
        /// The block.
        block: BlockId,
    },
    /// The two caches cannot be mapped onto each other.
    #[error("the caches cannot be mapped: {0}")]
    Unmappable(String),
    /// A side does not hold the heads to write.
    #[error("{side} holds {held}, not all of the {wanted} asked for")]
    HeadsNotHeld {
        /// `prefill` or `decode`.
        side: &'static str,
        /// The heads asked for.
        wanted: kv_proto::HeadRange,
        /// The heads that side holds.
        held: kv_proto::HeadRange,
    },
    /// Block sizes differ and D did not say which token its blocks start at.
    #[error(
        "blocks of {local} tokens here and {remote} on decode, and decode did not say which token its blocks start at"
    )]
    FirstTokenNeeded {
        /// P's tokens per block.
        local: u32,
        /// D's tokens per block.
        remote: u32,
    },
    /// D asks for tokens P does not hold.
    #[error("decode's {blocks} blocks from token {first_token} reach past the {held} tokens prefill holds")]
    TokensOutOfRange {
        /// The token D's blocks start at.
        first_token: u64,
        /// D's blocks.
        blocks: usize,
        /// Tokens P's blocks hold.
        held: u64,
    },
}

/// The geometry a plan needs: both sides' region bases and the block length.
#[derive(Clone, Copy, Debug)]
pub struct PlanGeometry<'a> {
    /// P's region base addresses.
    pub local_bases: &'a [u64],
    /// D's region base addresses, in the same order.
    pub remote_bases: &'a [u64],
    /// Bytes of a block in a region (equal on both sides; checked at hello).
    pub block_len: u64,
    /// Blocks per region on P.
    pub local_num_blocks: u64,
}

/// Appends the writes that move a request's KV to `ops`.
///
/// On a partial prefix-cache hit D asks for fewer blocks than P holds: P's
/// last blocks are sent. Runs where both P's and D's block ids are
/// consecutive are coalesced into one op per region.
pub fn plan_request(
    geometry: &PlanGeometry<'_>,
    local_blocks: &[BlockId],
    remote_blocks: &[BlockId],
    ops: &mut Vec<WriteOp>,
) -> Result<(), PlanError> {
    if remote_blocks.is_empty() {
        return Ok(());
    }
    if remote_blocks.len() > local_blocks.len() {
        return Err(PlanError::TooManyBlocks { local: local_blocks.len(), remote: remote_blocks.len() });
    }
    if geometry.local_bases.len() != geometry.remote_bases.len() {
        return Err(PlanError::RegionCount { local: geometry.local_bases.len(), remote: geometry.remote_bases.len() });
    }
    let local_blocks = &local_blocks[local_blocks.len() - remote_blocks.len()..];
    if let Some(&block) = local_blocks.iter().find(|&&b| u64::from(b) >= geometry.local_num_blocks) {
        return Err(PlanError::LocalBlockOutOfRange { block, num_blocks: geometry.local_num_blocks });
    }
    let runs = contiguous_runs(local_blocks, remote_blocks);
    ops.reserve(runs.len() * geometry.local_bases.len());
    for (&local_base, &remote_base) in geometry.local_bases.iter().zip(geometry.remote_bases) {
        for &(local_start, remote_start, count) in &runs {
            let len = geometry.block_len * count;
            // Local offsets are in range (checked above); remote ones are D's
            // word, bounds-checked by D's transport, but no op may wrap here:
            // neither its start nor its end.
            let dst = u64::from(remote_start)
                .checked_mul(geometry.block_len)
                .and_then(|off| remote_base.checked_add(off))
                .filter(|dst| dst.checked_add(len).is_some())
                .ok_or(PlanError::RemoteAddressOverflow { block: remote_start })?;
            ops.push(WriteOp { src: local_base + u64::from(local_start) * geometry.block_len, dst, len });
        }
    }
    Ok(())
}

/// The destination ranges of a pull into `blocks` (D's own block ids, of
/// every request of the pull): one range per run of consecutive ids per
/// region, what D grants P. Ids at or past `num_blocks` are refused, and so
/// is an id listed twice (two requests would write one block).
pub fn grant_ranges(
    bases: &[u64],
    block_len: u64,
    num_blocks: u64,
    blocks: impl IntoIterator<Item = BlockId>,
) -> Result<Vec<MemoryRegion>, GrantPlanError> {
    let mut ids: Vec<BlockId> = blocks.into_iter().collect();
    ids.sort_unstable();
    if let Some(pair) = ids.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(GrantPlanError::DuplicateBlock(pair[0]));
    }
    if let Some(&block) = ids.iter().find(|&&b| u64::from(b) >= num_blocks) {
        return Err(GrantPlanError::BlockOutOfRange { block, num_blocks });
    }
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for id in ids.into_iter().map(u64::from) {
        match runs.last_mut() {
            Some((start, count)) if *start + *count == id => *count += 1,
            _ => runs.push((id, 1)),
        }
    }
    let mut ranges = Vec::with_capacity(runs.len() * bases.len());
    for &base in bases {
        for &(start, count) in &runs {
            // In range: start + count <= num_blocks, and the region (base,
            // num_blocks * block_len) was checked not to wrap at registration.
            ranges.push(MemoryRegion::new(base + start * block_len, count * block_len));
        }
    }
    Ok(ranges)
}

/// A pull whose destination ranges cannot be granted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantPlanError {
    /// A block id is listed twice in one pull.
    #[error("block {0} is listed twice in one pull")]
    DuplicateBlock(BlockId),
    /// A block id lies outside the cache.
    #[error("block {block} is outside the cache of {num_blocks} blocks")]
    BlockOutOfRange {
        /// The block.
        block: BlockId,
        /// Blocks in the cache.
        num_blocks: u64,
    },
}

/// Splits paired block lists into runs `(local_start, remote_start, len)`
/// where both sides advance by one (the reference's
/// `group_concurrent_contiguous`).
pub fn contiguous_runs(local: &[BlockId], remote: &[BlockId]) -> Vec<(BlockId, BlockId, u64)> {
    let mut runs: Vec<(BlockId, BlockId, u64)> = Vec::new();
    for (&l, &r) in local.iter().zip(remote) {
        match runs.last_mut() {
            Some((ls, rs, n)) if u64::from(*ls) + *n == u64::from(l) && u64::from(*rs) + *n == u64::from(r) => *n += 1,
            _ => runs.push((l, r, 1)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case::empty(&[], &[], &[])]
    #[case::one_run(&[3, 4, 5], &[10, 11, 12], &[(3, 10, 3)])]
    #[case::break_on_local(&[3, 5, 6], &[10, 11, 12], &[(3, 10, 1), (5, 11, 2)])]
    #[case::break_on_remote(&[3, 4, 5], &[10, 12, 13], &[(3, 10, 1), (4, 12, 2)])]
    #[case::descending(&[5, 4], &[1, 0], &[(5, 1, 1), (4, 0, 1)])]
    fn runs(#[case] local: &[u32], #[case] remote: &[u32], #[case] expected: &[(u32, u32, u64)]) {
        assert_eq!(contiguous_runs(local, remote), expected);
    }

    fn geometry<'a>(local: &'a [u64], remote: &'a [u64]) -> PlanGeometry<'a> {
        PlanGeometry { local_bases: local, remote_bases: remote, block_len: 100, local_num_blocks: 10 }
    }

    #[test]
    fn one_op_per_region_and_run() {
        let mut ops = Vec::new();
        plan_request(&geometry(&[1000, 5000], &[20000, 30000]), &[1, 2, 7], &[4, 5, 6], &mut ops).unwrap();
        assert_eq!(
            ops,
            vec![
                WriteOp { src: 1100, dst: 20400, len: 200 },
                WriteOp { src: 1700, dst: 20600, len: 100 },
                WriteOp { src: 5100, dst: 30400, len: 200 },
                WriteOp { src: 5700, dst: 30600, len: 100 },
            ]
        );
    }

    #[test]
    fn partial_prefix_hit_sends_the_last_blocks() {
        let mut ops = Vec::new();
        plan_request(&geometry(&[0], &[0]), &[1, 2, 3, 4], &[8, 9], &mut ops).unwrap();
        assert_eq!(ops, vec![WriteOp { src: 300, dst: 800, len: 200 }]);
    }

    #[test]
    fn full_prefix_hit_plans_nothing() {
        let mut ops = Vec::new();
        plan_request(&geometry(&[0], &[0]), &[1, 2], &[], &mut ops).unwrap();
        assert!(ops.is_empty());
    }

    #[rstest]
    #[case::more_remote_than_local(&[1], &[1, 2], PlanError::TooManyBlocks { local: 1, remote: 2 })]
    #[case::local_block_out_of_range(&[10], &[1], PlanError::LocalBlockOutOfRange { block: 10, num_blocks: 10 })]
    #[case::remote_overflow(&[1], &[u32::MAX], PlanError::RemoteAddressOverflow { block: u32::MAX })]
    // Starts at base + 900 (no wrap) but ends 100 bytes past 2^64.
    #[case::remote_end_wraps(&[1, 2], &[9, 10], PlanError::RemoteAddressOverflow { block: 9 })]
    fn refused(#[case] local: &[u32], #[case] remote: &[u32], #[case] err: PlanError) {
        let mut ops = Vec::new();
        let g =
            PlanGeometry { local_bases: &[0], remote_bases: &[u64::MAX - 1000], block_len: 100, local_num_blocks: 10 };
        assert_eq!(plan_request(&g, local, remote, &mut ops), Err(err));
    }

    #[test]
    fn grant_ranges_merge_runs_per_region() {
        let ranges = grant_ranges(&[1000, 9000], 10, 8, [5, 1, 2, 3, 7]).unwrap();
        assert_eq!(
            ranges,
            vec![
                MemoryRegion::new(1010, 30),
                MemoryRegion::new(1050, 10),
                MemoryRegion::new(1070, 10),
                MemoryRegion::new(9010, 30),
                MemoryRegion::new(9050, 10),
                MemoryRegion::new(9070, 10),
            ]
        );
        assert!(grant_ranges(&[0], 10, 8, []).unwrap().is_empty());
        assert_eq!(grant_ranges(&[0], 10, 8, [1, 2, 1]), Err(GrantPlanError::DuplicateBlock(1)));
        assert_eq!(grant_ranges(&[0], 10, 8, [8]), Err(GrantPlanError::BlockOutOfRange { block: 8, num_blocks: 8 }));
    }

    #[test]
    fn region_count_mismatch_is_refused() {
        let mut ops = Vec::new();
        assert_eq!(
            plan_request(&geometry(&[0, 1], &[0]), &[1], &[1], &mut ops),
            Err(PlanError::RegionCount { local: 2, remote: 1 })
        );
    }
}
