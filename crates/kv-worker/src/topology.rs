//! Planning a transfer between caches laid out differently (sans-IO):
//! another tensor-parallel size (P writes only the heads D's rank holds,
//! into their place in D's blocks), another block size (tokens are mapped,
//! not block ids), NHD against HND, split against fused K/V planes; rows
//! of K and V side by side map as whole rows between two such caches.
//!
//! The request's tokens are cut into segments that lie in one block on
//! both sides; each segment of each layer's K and V (or latent) plane
//! becomes the largest runs contiguous on both sides: a token row of the
//! heads written where heads are not outermost (NHD), a head's tokens where
//! they are (HND), one head of one token where the two orders differ. Runs
//! that continue one another are coalesced, so whole blocks of every head
//! between equal layouts still make one op per run of consecutive blocks.

use kv_proto::topology::{head_bytes, planes_per_layer, regions_per_layer};
use kv_proto::{BlockId, CacheLayout, HeadRange, LayoutKind, TokenLayout, WriteOp};

use crate::plan::PlanError;

/// One side of a transfer as the planner sees it.
#[derive(Clone, Copy, Debug)]
pub struct CacheSide<'a> {
    /// Its cache's layout (heads and token layout declared).
    pub layout: &'a CacheLayout,
    /// The model's KV heads its blocks hold.
    pub heads: HeadRange,
    /// Its region base addresses, in registration order.
    pub bases: &'a [u64],
}

/// What a head-mapped transfer needs besides the blocks.
#[derive(Clone, Copy, Debug)]
pub struct HeadPlan<'a> {
    /// P's cache.
    pub local: CacheSide<'a>,
    /// D's cache (peer input: every destination is computed with checked
    /// arithmetic).
    pub remote: CacheSide<'a>,
    /// Blocks per region on P.
    pub local_num_blocks: u64,
    /// The heads to write.
    pub heads: HeadRange,
}

/// A run of tokens lying in one block on each side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Segment {
    local_block: BlockId,
    local_offset: u64,
    remote_block: BlockId,
    remote_offset: u64,
    tokens: u64,
}

/// Where one plane (K, V or latent) of a layer lies: its region and its
/// offset inside a block.
fn locate(kind: LayoutKind, block_len: u64, layer: usize, plane: u32) -> (usize, u64) {
    match kind {
        LayoutKind::SplitKv => (2 * layer + plane as usize, 0),
        LayoutKind::Fused => (layer, u64::from(plane) * (block_len / 2)),
        LayoutKind::Mla | LayoutKind::FusedRows => (layer, 0),
    }
}

/// The geometry of one side's plane.
#[derive(Clone, Copy, Debug)]
struct Plane {
    order: TokenLayout,
    tokens: u64,
    heads: u64,
    head_bytes: u64,
}

impl Plane {
    /// Byte offset of (token, head) inside the plane; in range for a token
    /// below `tokens` and a head below `heads` (both checked by the caller).
    fn offset(&self, token: u64, head: u64) -> u64 {
        match self.order {
            TokenLayout::Hnd => (head * self.tokens + token) * self.head_bytes,
            _ => (token * self.heads + head) * self.head_bytes,
        }
    }
}

/// Appends `op` to `ops`, extending the last op instead where it continues
/// it on both sides (never past `merge_from`: runs of another plane stay
/// apart, so no op spans two regions).
fn push(ops: &mut Vec<WriteOp>, merge_from: usize, op: WriteOp) {
    if ops.len() > merge_from {
        if let Some(last) = ops.last_mut() {
            if last.src + last.len == op.src && last.dst + last.len == op.dst {
                last.len += op.len;
                return;
            }
        }
    }
    ops.push(op);
}

/// Appends the writes that move `heads` of a request's KV from P's blocks
/// into D's, mapped by token.
///
/// D's blocks start at prompt token `first_token` (its first block holds
/// the tokens from `first_token` rounded down to D's block size); without
/// it, D's blocks are P's last ones, which needs equal block sizes. Tokens
/// past what P's blocks hold are not written (they lie past the prompt).
///
/// # Errors
///
/// The two caches cannot be mapped, a side does not hold the heads, D asks
/// for tokens P does not hold, or a destination overflows.
pub fn plan_heads(
    plan: &HeadPlan<'_>,
    local_blocks: &[BlockId],
    remote_blocks: &[BlockId],
    first_token: Option<u64>,
    ops: &mut Vec<WriteOp>,
) -> Result<(), PlanError> {
    plan_heads_range(plan, local_blocks, remote_blocks, first_token, 0..remote_blocks.len(), ops)
}

/// As [`plan_heads`], for the tokens of D's blocks `pieces` only (a piece
/// of the request: D's blocks `remote_blocks[pieces]`, the tokens of them
/// P holds); the whole request is checked as [`plan_heads`] checks it.
///
/// # Errors
///
/// As [`plan_heads`]; also a range past D's blocks.
pub fn plan_heads_range(
    plan: &HeadPlan<'_>,
    local_blocks: &[BlockId],
    remote_blocks: &[BlockId],
    first_token: Option<u64>,
    pieces: std::ops::Range<usize>,
    ops: &mut Vec<WriteOp>,
) -> Result<(), PlanError> {
    if pieces.end > remote_blocks.len() {
        return Err(PlanError::TooManyBlocks { local: remote_blocks.len(), remote: pieces.end });
    }
    if pieces.is_empty() || plan.heads.is_empty() {
        return Ok(());
    }
    let (local, remote) = (&plan.local, &plan.remote);
    let unmappable = |why: String| PlanError::Unmappable(why);
    let (Some(head_len), Some(remote_head_len)) = (head_bytes(local.layout), head_bytes(remote.layout)) else {
        return Err(unmappable("heads or token layout undeclared".to_owned()));
    };
    if head_len != remote_head_len {
        return Err(unmappable(format!("{head_len} bytes per head and token here, {remote_head_len} on decode")));
    }
    let planes = planes_per_layer(local.layout.kind);
    if planes != planes_per_layer(remote.layout.kind) {
        let (here, there) = (local.layout.kind, remote.layout.kind);
        return Err(unmappable(format!("{here:?} here, {there:?} on decode: the planes of a layer differ")));
    }
    let layers = local.bases.len() / regions_per_layer(local.layout.kind) as usize;
    let remote_regions = layers * regions_per_layer(remote.layout.kind) as usize;
    if remote.bases.len() != remote_regions || local.bases.len() % regions_per_layer(local.layout.kind) as usize != 0 {
        return Err(PlanError::RegionCount { local: local.bases.len(), remote: remote.bases.len() });
    }
    for (side, held) in [("prefill", local), ("decode", remote)] {
        if !held.heads.covers(&plan.heads) || held.heads.count != held.layout.block_heads {
            return Err(PlanError::HeadsNotHeld { side, wanted: plan.heads, held: held.heads });
        }
    }
    if let Some(&block) = local_blocks.iter().find(|&&b| u64::from(b) >= plan.local_num_blocks) {
        return Err(PlanError::LocalBlockOutOfRange { block, num_blocks: plan.local_num_blocks });
    }
    let segments = segments(local.layout, remote.layout, local_blocks, remote_blocks, first_token, pieces)?;
    let plane_of = |layout: &CacheLayout| Plane {
        order: layout.token_layout,
        tokens: u64::from(layout.block_tokens),
        heads: u64::from(layout.block_heads),
        head_bytes: head_len,
    };
    let (lp, rp) = (plane_of(local.layout), plane_of(remote.layout));
    let local_head = u64::from(plan.heads.first - local.heads.first);
    let remote_head = u64::from(plan.heads.first - remote.heads.first);
    let count = u64::from(plan.heads.count);
    for layer in 0..layers {
        for plane in 0..planes {
            let (lr, loff) = locate(local.layout.kind, local.layout.block_len, layer, plane);
            let (rr, roff) = locate(remote.layout.kind, remote.layout.block_len, layer, plane);
            let merge_from = ops.len();
            for seg in &segments {
                // P's blocks are in its registered regions (checked above).
                let src_base = local.bases[lr] + u64::from(seg.local_block) * local.layout.block_len + loff;
                let overflow = PlanError::RemoteAddressOverflow { block: seg.remote_block };
                let dst_base = u64::from(seg.remote_block)
                    .checked_mul(remote.layout.block_len)
                    .and_then(|off| remote.bases[rr].checked_add(off))
                    .and_then(|addr| addr.checked_add(roff))
                    .ok_or(overflow.clone())?;
                let mut run = |token: u64, head: u64, tokens: u64, heads: u64| -> Result<(), PlanError> {
                    let src = src_base + lp.offset(seg.local_offset + token, local_head + head);
                    let len = tokens * heads * head_len;
                    let dst = dst_base
                        .checked_add(rp.offset(seg.remote_offset + token, remote_head + head))
                        .filter(|dst| dst.checked_add(len).is_some())
                        .ok_or(overflow.clone())?;
                    push(ops, merge_from, WriteOp { src, dst, len });
                    Ok(())
                };
                match (lp.order, rp.order) {
                    (TokenLayout::Nhd, TokenLayout::Nhd) if count == lp.heads && count == rp.heads => {
                        run(0, 0, seg.tokens, count)?;
                    }
                    (TokenLayout::Nhd, TokenLayout::Nhd) => {
                        for token in 0..seg.tokens {
                            run(token, 0, 1, count)?;
                        }
                    }
                    (TokenLayout::Hnd, TokenLayout::Hnd) => {
                        for head in 0..count {
                            run(0, head, seg.tokens, 1)?;
                        }
                    }
                    _ => {
                        for token in 0..seg.tokens {
                            for head in 0..count {
                                run(token, head, 1, 1)?;
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Cuts the tokens D asks for, of D's blocks `pieces`, into runs that lie
/// in one block on each side.
fn segments(
    local: &CacheLayout,
    remote: &CacheLayout,
    local_blocks: &[BlockId],
    remote_blocks: &[BlockId],
    first_token: Option<u64>,
    pieces: std::ops::Range<usize>,
) -> Result<Vec<Segment>, PlanError> {
    let (lt, rt) = (u64::from(local.block_tokens), u64::from(remote.block_tokens));
    let held = local_blocks.len() as u64 * lt;
    let first = match first_token {
        Some(first) => first,
        None if lt == rt => {
            let skipped = local_blocks
                .len()
                .checked_sub(remote_blocks.len())
                .ok_or(PlanError::TooManyBlocks { local: local_blocks.len(), remote: remote_blocks.len() })?;
            skipped as u64 * lt
        }
        None => return Err(PlanError::FirstTokenNeeded { local: local.block_tokens, remote: remote.block_tokens }),
    };
    // D's first block holds the tokens from `origin`; every block D asks
    // for must hold at least one token P holds.
    let origin = first - first % rt;
    let last_start = (remote_blocks.len() as u64 - 1).checked_mul(rt).and_then(|off| origin.checked_add(off));
    if first >= held || last_start.is_none_or(|start| start >= held) {
        return Err(PlanError::TokensOutOfRange { first_token: first, blocks: remote_blocks.len(), held });
    }
    let end = held.min(origin + pieces.end as u64 * rt);
    let mut out = Vec::with_capacity(local_blocks.len() + pieces.len());
    let mut token = first.max(origin + pieces.start as u64 * rt);
    while token < end {
        let (local_index, local_offset) = (token / lt, token % lt);
        let (remote_index, remote_offset) = ((token - origin) / rt, (token - origin) % rt);
        let tokens = (lt - local_offset).min(rt - remote_offset).min(end - token);
        out.push(Segment {
            local_block: local_blocks[local_index as usize],
            local_offset,
            remote_block: remote_blocks[remote_index as usize],
            remote_offset,
            tokens,
        });
        token += tokens;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    /// A layout of `layers` layers, `heads` heads of 2 bytes, `tokens` per block.
    fn layout(kind: LayoutKind, order: TokenLayout, tokens: u32, heads: u32, layers: u32) -> CacheLayout {
        let per_region = planes_per_layer(kind) / regions_per_layer(kind);
        CacheLayout {
            kind,
            region_count: layers * regions_per_layer(kind),
            block_len: u64::from(per_region * tokens * heads) * 2,
            block_tokens: tokens,
            dtype_bytes: 2,
            token_layout: order,
            block_heads: heads,
        }
    }

    fn bases(layout: &CacheLayout, at: u64) -> Vec<u64> {
        (0..u64::from(layout.region_count)).map(|r| at.wrapping_add(r * 1_000_000)).collect()
    }

    struct Case {
        local: CacheLayout,
        local_heads: HeadRange,
        remote: CacheLayout,
        remote_heads: HeadRange,
        heads: HeadRange,
    }

    fn plan(
        case: &Case,
        local_blocks: &[u32],
        remote_blocks: &[u32],
        first: Option<u64>,
    ) -> Result<Vec<WriteOp>, PlanError> {
        plan_at(case, local_blocks, remote_blocks, first, 1 << 40)
    }

    fn plan_at(
        case: &Case,
        local_blocks: &[u32],
        remote_blocks: &[u32],
        first: Option<u64>,
        remote_at: u64,
    ) -> Result<Vec<WriteOp>, PlanError> {
        let (lb, rb) = (bases(&case.local, 0), bases(&case.remote, remote_at));
        let p = HeadPlan {
            local: CacheSide { layout: &case.local, heads: case.local_heads, bases: &lb },
            remote: CacheSide { layout: &case.remote, heads: case.remote_heads, bases: &rb },
            local_num_blocks: 64,
            heads: case.heads,
        };
        let mut ops = Vec::new();
        plan_heads(&p, local_blocks, remote_blocks, first, &mut ops).map(|()| ops)
    }

    fn same(order: TokenLayout) -> Case {
        let l = layout(LayoutKind::SplitKv, order, 4, 2, 1);
        Case {
            local: l,
            local_heads: HeadRange::new(0, 2),
            remote: l,
            remote_heads: HeadRange::new(0, 2),
            heads: HeadRange::new(0, 2),
        }
    }

    /// Equal layouts coalesce consecutive blocks into one op per region
    /// (NHD and HND alike), as the whole-block planner does.
    #[rstest]
    #[case::nhd(TokenLayout::Nhd)]
    #[case::hnd(TokenLayout::Hnd)]
    fn equal_layouts_coalesce_like_whole_blocks(#[case] order: TokenLayout) {
        let ops = plan(&same(order), &[3, 4, 9], &[10, 11, 12], None).unwrap();
        let block = 4 * 2 * 2;
        assert_eq!(
            ops,
            vec![
                WriteOp { src: 3 * block, dst: (1 << 40) + 10 * block, len: 2 * block },
                WriteOp { src: 9 * block, dst: (1 << 40) + 12 * block, len: block },
                WriteOp { src: 1_000_000 + 3 * block, dst: (1 << 40) + 1_000_000 + 10 * block, len: 2 * block },
                WriteOp { src: 1_000_000 + 9 * block, dst: (1 << 40) + 1_000_000 + 12 * block, len: block },
            ]
        );
    }

    /// One head of two, from a rank holding both into a rank holding one:
    /// NHD is one op per token row, HND one per block (the head's tokens).
    #[rstest]
    #[case::nhd(TokenLayout::Nhd, 4)]
    #[case::hnd(TokenLayout::Hnd, 1)]
    fn a_head_slice_costs_a_row_per_token_in_nhd_and_one_run_in_hnd(
        #[case] order: TokenLayout,
        #[case] per_block: usize,
    ) {
        let case = Case {
            local: layout(LayoutKind::SplitKv, order, 4, 2, 1),
            local_heads: HeadRange::new(0, 2),
            remote: layout(LayoutKind::SplitKv, order, 4, 1, 1),
            remote_heads: HeadRange::new(1, 1),
            heads: HeadRange::new(1, 1),
        };
        let ops = plan(&case, &[0], &[5], None).unwrap();
        assert_eq!(ops.len(), 2 * per_block, "K and V");
        assert!(ops.iter().all(|op| op.len as usize == 2 * 4 / per_block));
        let first = ops[0];
        let expect_src = if order == TokenLayout::Nhd { 2 } else { 4 * 2 };
        assert_eq!((first.src, first.dst), (expect_src, (1 << 40) + 5 * 4 * 2));
    }

    #[rstest]
    #[case::to_larger(4, 8, &[0, 1, 2], &[7, 8], Some(0), &[(0, 7, 4), (1, 7, 4), (2, 8, 4)])]
    #[case::to_smaller(8, 4, &[0, 1], &[7, 8, 9, 10], Some(0), &[(0, 7, 4), (0, 8, 4), (1, 9, 4), (1, 10, 4)])]
    #[case::prefix_hit_mid_block(4, 8, &[0, 1, 2], &[7], Some(8), &[(2, 7, 4)])]
    #[case::prefix_hit_of_one_small_block(8, 4, &[0, 1], &[9, 10], Some(8), &[(1, 9, 4), (1, 10, 4)])]
    fn block_sizes_map_by_token(
        #[case] lt: u32,
        #[case] rt: u32,
        #[case] local_blocks: &[u32],
        #[case] remote_blocks: &[u32],
        #[case] first: Option<u64>,
        // (local block, remote block, tokens) of each segment, in order.
        #[case] want: &[(u32, u32, u64)],
    ) {
        let local = layout(LayoutKind::Mla, TokenLayout::Nhd, lt, 1, 1);
        let remote = layout(LayoutKind::Mla, TokenLayout::Nhd, rt, 1, 1);
        let segs = segments(&local, &remote, local_blocks, remote_blocks, first, 0..remote_blocks.len()).unwrap();
        let got: Vec<(u32, u32, u64)> = segs.iter().map(|s| (s.local_block, s.remote_block, s.tokens)).collect();
        assert_eq!(got, want);
    }

    /// A request planned piece by piece (D's blocks in runs of `piece`)
    /// cuts exactly the segments the whole request does: pieces neither
    /// skip nor repeat a token.
    #[rstest]
    #[case::to_larger(4, 8, 3, 2, Some(0))]
    #[case::to_smaller(8, 4, 2, 4, Some(0))]
    #[case::to_much_larger(16, 128, 9, 2, Some(0))]
    #[case::from_much_larger(128, 16, 1, 8, Some(0))]
    #[case::prefix_hit(4, 8, 5, 2, Some(8))]
    #[case::last_blocks(16, 16, 5, 3, None)]
    fn pieces_cut_the_segments_of_the_whole(
        #[case] lt: u32,
        #[case] rt: u32,
        #[case] local_count: u32,
        #[case] remote_count: u32,
        #[case] first: Option<u64>,
    ) {
        let local = layout(LayoutKind::Mla, TokenLayout::Nhd, lt, 1, 1);
        let remote = layout(LayoutKind::Mla, TokenLayout::Nhd, rt, 1, 1);
        let local_blocks: Vec<u32> = (0..local_count).collect();
        let remote_blocks: Vec<u32> = (100..100 + remote_count).collect();
        let n = remote_blocks.len();
        let whole = segments(&local, &remote, &local_blocks, &remote_blocks, first, 0..n).unwrap();
        for piece in 1..=n {
            let mut cut = Vec::new();
            for start in (0..n).step_by(piece) {
                let range = start..(start + piece).min(n);
                cut.extend(segments(&local, &remote, &local_blocks, &remote_blocks, first, range).unwrap());
            }
            assert_eq!(cut, whole, "pieces of {piece}");
        }
    }

    #[test]
    fn contiguous_runs_still_coalesce_across_block_sizes() {
        let case = Case {
            local: layout(LayoutKind::Mla, TokenLayout::Nhd, 16, 1, 1),
            local_heads: HeadRange::new(0, 1),
            remote: layout(LayoutKind::Mla, TokenLayout::Nhd, 32, 1, 1),
            remote_heads: HeadRange::new(0, 1),
            heads: HeadRange::new(0, 1),
        };
        // P's blocks 4, 5 and D's block 2 are one run; P's 9 then 3 are two.
        let ops = plan(&case, &[4, 5, 9, 3], &[2, 3], Some(0)).unwrap();
        assert_eq!(ops.len(), 3, "{ops:?}");
        assert_eq!(ops[0], WriteOp { src: 4 * 32, dst: (1 << 40) + 2 * 64, len: 64 });
    }

    #[test]
    fn nhd_to_hnd_is_one_op_per_head_row_and_fused_maps_to_split() {
        let case = Case {
            local: layout(LayoutKind::Fused, TokenLayout::Nhd, 4, 2, 1),
            local_heads: HeadRange::new(0, 2),
            remote: layout(LayoutKind::SplitKv, TokenLayout::Hnd, 4, 2, 1),
            remote_heads: HeadRange::new(0, 2),
            heads: HeadRange::new(0, 2),
        };
        let ops = plan(&case, &[0], &[0], None).unwrap();
        // V of token 1, head 0: fused block's second half, row 1; D's V
        // region, head 0, token 1. Head 1 of tokens 0 then 1 follow one
        // another in D, not in P: never coalesced.
        assert_eq!(ops.len(), 2 * 4 * 2);
        assert!(ops.contains(&WriteOp { src: 16 + 4, dst: (1 << 40) + 1_000_000 + 2, len: 2 }), "{ops:?}");
    }

    #[rstest]
    #[case::too_many_blocks(&[1], &[1, 2], None, PlanError::TooManyBlocks { local: 1, remote: 2 })]
    #[case::past_what_p_holds(&[1], &[1], Some(4), PlanError::TokensOutOfRange { first_token: 4, blocks: 1, held: 4 })]
    #[case::a_block_past_it(&[1, 2], &[1, 2, 3], Some(0), PlanError::TokensOutOfRange { first_token: 0, blocks: 3, held: 8 })]
    #[case::local_out_of_range(&[64], &[1], None, PlanError::LocalBlockOutOfRange { block: 64, num_blocks: 64 })]
    fn refused(#[case] local: &[u32], #[case] remote: &[u32], #[case] first: Option<u64>, #[case] err: PlanError) {
        assert_eq!(plan(&same(TokenLayout::Nhd), local, remote, first), Err(err));
    }

    /// D's region bases are peer input: no destination may wrap, neither
    /// where it starts nor where it ends.
    #[rstest]
    #[case::start_wraps(&[u32::MAX], u64::MAX - 1000)]
    #[case::end_wraps(&[1], u64::MAX - 20)]
    fn remote_addresses_never_wrap(#[case] remote: &[u32], #[case] at: u64) {
        let got = plan_at(&same(TokenLayout::Nhd), &[1], remote, None, at);
        assert_eq!(got, Err(PlanError::RemoteAddressOverflow { block: remote[0] }));
    }

    #[test]
    fn heads_a_side_does_not_hold_are_refused() {
        let case = Case { heads: HeadRange::new(1, 2), ..same(TokenLayout::Nhd) };
        assert!(matches!(plan(&case, &[0], &[0], None), Err(PlanError::HeadsNotHeld { side: "prefill", .. })));
        let mut other = same(TokenLayout::Nhd);
        other.remote.block_tokens = 8;
        other.remote.block_len *= 2;
        assert_eq!(plan(&other, &[0, 1], &[0], None), Err(PlanError::FirstTokenNeeded { local: 4, remote: 8 }));
    }
}
