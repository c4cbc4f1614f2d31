//! Where a worker sits in its instance (tensor- and pipeline-parallel rank
//! and size, the KV heads its cache holds) and the pure rules both sides
//! derive the pairing from: which prefill ranks hold a decode rank's heads,
//! how many pulls each prefill rank gets for a request, which ports the
//! ranks listen on, and whether two ranks' caches can be mapped at all.
//!
//! Heads are split across tensor-parallel ranks as vLLM splits them: with
//! `tp <= heads`, rank `r` holds `heads / tp` consecutive heads from
//! `r * heads / tp`; with `tp > heads`, each head is replicated on
//! `tp / heads` consecutive ranks (rank `r` holds head `r / (tp / heads)`).
//! MLA's latent is one head every rank holds.

use serde::{Deserialize, Serialize};

use crate::wire::{CacheLayout, LayoutKind};

/// Largest tensor- or pipeline-parallel size a peer may declare (bounds
/// the work the pairing rules do for a peer's hello).
pub const MAX_PARALLEL_SIZE: u32 = 1024;
/// Most KV heads a model may declare (same reason).
pub const MAX_KV_HEADS: u32 = 4096;

/// A run of the model's KV heads: `first..first + count`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HeadRange {
    /// The first head (an index among the model's KV heads).
    pub first: u32,
    /// How many.
    pub count: u32,
}

impl HeadRange {
    /// `first..first + count`.
    pub const fn new(first: u32, count: u32) -> Self {
        Self { first, count }
    }

    /// One past the last head (saturating: a peer's range never wraps here).
    pub fn end(&self) -> u32 {
        self.first.saturating_add(self.count)
    }

    /// Whether no head is in it.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Whether every head of `other` is in this range (an empty range is in
    /// every range).
    pub fn covers(&self, other: &HeadRange) -> bool {
        other.is_empty() || (other.first >= self.first && other.end() <= self.end())
    }
}

impl std::fmt::Display for HeadRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "heads {}..{}", self.first, self.end())
    }
}

/// How tokens and heads are ordered inside one block of one K, V or latent
/// plane.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TokenLayout {
    /// Not declared: blocks can only be copied whole, between equal layouts.
    #[default]
    Undeclared,
    /// Token-major: `[tokens][heads][head bytes]` (vLLM's default).
    Nhd,
    /// Head-major: `[heads][tokens][head bytes]`.
    Hnd,
}

impl std::fmt::Display for TokenLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenLayout::Undeclared => "undeclared",
            TokenLayout::Nhd => "NHD",
            TokenLayout::Hnd => "HND",
        })
    }
}

/// One worker's place in its instance, carried by the hello both ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RankTopology {
    /// Tensor-parallel size of the instance.
    pub tp_size: u32,
    /// This worker's tensor-parallel rank.
    pub tp_rank: u32,
    /// Pipeline-parallel size of the instance.
    pub pp_size: u32,
    /// This worker's pipeline stage.
    pub pp_rank: u32,
    /// The model's KV heads before splitting (0: undeclared; then the
    /// worker's heads cannot be mapped onto another tensor-parallel size).
    pub num_kv_heads: u32,
    /// The model's KV heads this worker's cache holds (empty when
    /// undeclared).
    pub heads: HeadRange,
}

impl RankTopology {
    /// The only worker of an instance, heads undeclared.
    pub const fn single() -> Self {
        Self { tp_size: 1, tp_rank: 0, pp_size: 1, pp_rank: 0, num_kv_heads: 0, heads: HeadRange::new(0, 0) }
    }

    /// Rank `tp_rank` of `tp_size` in stage `pp_rank` of `pp_size`, holding
    /// its share of `num_kv_heads` (0: undeclared).
    ///
    /// # Errors
    ///
    /// The sizes are out of bounds, a rank is not below its size, or the
    /// heads cannot be split over `tp_size` ranks.
    pub fn new(
        tp_size: u32,
        tp_rank: u32,
        pp_size: u32,
        pp_rank: u32,
        num_kv_heads: u32,
    ) -> Result<Self, TopologyError> {
        check_parallel("tensor", tp_size, tp_rank)?;
        check_parallel("pipeline", pp_size, pp_rank)?;
        let heads = if num_kv_heads == 0 { HeadRange::default() } else { rank_heads(num_kv_heads, tp_size, tp_rank)? };
        Ok(Self { tp_size, tp_rank, pp_size, pp_rank, num_kv_heads, heads })
    }

    /// Checks a peer's declared topology: sizes in bounds, ranks below them,
    /// and its heads the ones its rank holds.
    ///
    /// # Errors
    ///
    /// What is wrong, for the refusal.
    pub fn validate(&self) -> Result<(), TopologyError> {
        let expected = Self::new(self.tp_size, self.tp_rank, self.pp_size, self.pp_rank, self.num_kv_heads)?;
        if expected.heads != self.heads {
            return Err(TopologyError::Heads { declared: self.heads, expected: expected.heads, tp_rank: self.tp_rank });
        }
        Ok(())
    }

    /// The worker's place among all of its instance's workers:
    /// `pp_rank * tp_size + tp_rank` (what its side-channel port adds).
    pub fn global_rank(&self) -> u32 {
        self.pp_rank.saturating_mul(self.tp_size).saturating_add(self.tp_rank)
    }
}

impl Default for RankTopology {
    fn default() -> Self {
        Self::single()
    }
}

/// A topology that cannot be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// A size is zero or too large, or a rank is not below its size.
    #[error("{what}-parallel rank {rank} of size {size} (sizes 1..={MAX_PARALLEL_SIZE}, ranks below the size)")]
    Parallel {
        /// `tensor` or `pipeline`.
        what: &'static str,
        /// The size.
        size: u32,
        /// The rank.
        rank: u32,
    },
    /// The heads cannot be split over the tensor-parallel ranks.
    #[error("{heads} KV heads cannot be split over {tp_size} tensor-parallel ranks (one must divide the other, at most {MAX_KV_HEADS} heads)")]
    Split {
        /// The model's KV heads.
        heads: u32,
        /// The tensor-parallel size.
        tp_size: u32,
    },
    /// A rank declares other heads than its rank holds.
    #[error("tensor-parallel rank {tp_rank} declares {declared}, but holds {expected}")]
    Heads {
        /// What it declared.
        declared: HeadRange,
        /// What its rank holds.
        expected: HeadRange,
        /// Its rank.
        tp_rank: u32,
    },
}

fn check_parallel(what: &'static str, size: u32, rank: u32) -> Result<(), TopologyError> {
    if size == 0 || size > MAX_PARALLEL_SIZE || rank >= size {
        return Err(TopologyError::Parallel { what, size, rank });
    }
    Ok(())
}

/// The heads tensor-parallel rank `tp_rank` of `tp_size` holds of a model
/// with `num_kv_heads` KV heads, as vLLM splits them (replicated when
/// `tp_size > num_kv_heads`).
///
/// # Errors
///
/// [`TopologyError::Split`] unless one of the two divides the other (and
/// the heads are within [`MAX_KV_HEADS`]); [`TopologyError::Parallel`] for
/// a rank not below its size.
pub fn rank_heads(num_kv_heads: u32, tp_size: u32, tp_rank: u32) -> Result<HeadRange, TopologyError> {
    check_parallel("tensor", tp_size, tp_rank)?;
    let split = TopologyError::Split { heads: num_kv_heads, tp_size };
    if num_kv_heads == 0 || num_kv_heads > MAX_KV_HEADS {
        return Err(split);
    }
    if tp_size <= num_kv_heads {
        if num_kv_heads % tp_size != 0 {
            return Err(split);
        }
        let per_rank = num_kv_heads / tp_size;
        Ok(HeadRange::new(tp_rank * per_rank, per_rank))
    } else {
        if tp_size % num_kv_heads != 0 {
            return Err(split);
        }
        Ok(HeadRange::new(tp_rank / (tp_size / num_kv_heads), 1))
    }
}

/// One part of a decode rank's pull of a request: the prefill rank (of the
/// same pipeline stage) it asks, and the heads that rank writes. A part
/// with no heads only tells that rank the request is done with (so it frees
/// it), as a pull of no blocks does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Part {
    /// The prefill worker's tensor-parallel rank.
    pub prefill_rank: u32,
    /// The heads it writes (empty: notify only).
    pub heads: HeadRange,
}

/// The prefill rank decode rank `decode_rank` pulls head `head` from: the
/// one rank holding it, or, where it is replicated, one of its replicas
/// chosen by `decode_rank` (so the decode ranks spread over them).
fn source_rank(num_kv_heads: u32, tp_prefill: u32, head: u32, decode_rank: u32) -> u32 {
    if tp_prefill <= num_kv_heads {
        head / (num_kv_heads / tp_prefill)
    } else {
        let replicas = tp_prefill / num_kv_heads;
        head * replicas + decode_rank % replicas
    }
}

/// Which prefill ranks decode rank `decode_rank` (of `tp_decode`) asks for
/// a request, and for which heads, with `num_kv_heads` split over
/// `tp_prefill` prefill ranks: each of its heads from exactly one prefill
/// rank, consecutive heads of one rank as one part, in head order; then
/// the prefill ranks no decode rank pulls from, each told by decode rank
/// `prefill_rank % tp_decode` with a part of no heads, so every prefill
/// rank hears of every request and frees it at once.
///
/// # Errors
///
/// Either side's heads cannot be split (see [`rank_heads`]).
pub fn decode_parts(
    num_kv_heads: u32,
    tp_prefill: u32,
    tp_decode: u32,
    decode_rank: u32,
) -> Result<Vec<Part>, TopologyError> {
    rank_heads(num_kv_heads, tp_prefill, 0)?;
    let mine = rank_heads(num_kv_heads, tp_decode, decode_rank)?;
    let mut parts: Vec<Part> = Vec::new();
    for head in mine.first..mine.end() {
        let prefill_rank = source_rank(num_kv_heads, tp_prefill, head, decode_rank);
        match parts.last_mut() {
            Some(last) if last.prefill_rank == prefill_rank && last.heads.end() == head => last.heads.count += 1,
            _ => parts.push(Part { prefill_rank, heads: HeadRange::new(head, 1) }),
        }
    }
    for prefill_rank in (0..tp_prefill).filter(|p| p % tp_decode == decode_rank) {
        if data_pullers(num_kv_heads, tp_prefill, prefill_rank, tp_decode)? == 0 {
            parts.push(Part { prefill_rank, heads: HeadRange::default() });
        }
    }
    Ok(parts)
}

/// How many decode ranks pull data from prefill rank `prefill_rank`.
fn data_pullers(num_kv_heads: u32, tp_prefill: u32, prefill_rank: u32, tp_decode: u32) -> Result<u32, TopologyError> {
    let held = rank_heads(num_kv_heads, tp_prefill, prefill_rank)?;
    let mut pullers = 0;
    for decode_rank in 0..tp_decode {
        let theirs = rank_heads(num_kv_heads, tp_decode, decode_rank)?;
        let overlap = held.first.max(theirs.first)..held.end().min(theirs.end());
        if overlap.clone().any(|head| source_rank(num_kv_heads, tp_prefill, head, decode_rank) == prefill_rank) {
            pullers += 1;
        }
    }
    Ok(pullers)
}

/// How many decode ranks ask prefill rank `prefill_rank` for each request
/// ([`decode_parts`] summed over every decode rank): it frees a request
/// once that many pulls of it have ended.
///
/// # Errors
///
/// Either side's heads cannot be split (see [`rank_heads`]).
pub fn pulls_expected(
    num_kv_heads: u32,
    tp_prefill: u32,
    prefill_rank: u32,
    tp_decode: u32,
) -> Result<u32, TopologyError> {
    rank_heads(num_kv_heads, tp_decode, 0)?;
    let pullers = data_pullers(num_kv_heads, tp_prefill, prefill_rank, tp_decode)?;
    Ok(if pullers == 0 { 1 } else { pullers })
}

/// The side-channel port of the worker at `global_rank` (see
/// [`RankTopology::global_rank`]) of an instance whose data-parallel rank
/// listens from `base`, or `None` past 65535.
pub fn side_channel_port(base: u16, global_rank: u32) -> Option<u16> {
    u16::try_from(global_rank).ok().and_then(|rank| base.checked_add(rank))
}

/// Regions one layer of a cache of `kind` registers.
pub fn regions_per_layer(kind: LayoutKind) -> u32 {
    match kind {
        LayoutKind::SplitKv => 2,
        LayoutKind::Fused | LayoutKind::Mla | LayoutKind::FusedRows => 1,
    }
}

/// K/V (or latent) planes in one block of one layer (rows of K and V side
/// by side are one plane, each row a head's K and V of one token).
pub fn planes_per_layer(kind: LayoutKind) -> u32 {
    match kind {
        LayoutKind::SplitKv | LayoutKind::Fused => 2,
        LayoutKind::Mla | LayoutKind::FusedRows => 1,
    }
}

/// Bytes of one head of one token in a cache, when its heads and token
/// layout are declared and its block divides evenly; `None` otherwise.
pub fn head_bytes(layout: &CacheLayout) -> Option<u64> {
    if layout.token_layout == TokenLayout::Undeclared || layout.block_heads == 0 || layout.block_tokens == 0 {
        return None;
    }
    let planes_in_region = u64::from(planes_per_layer(layout.kind) / regions_per_layer(layout.kind));
    // A peer's hello declares these: checked, as two planes of u32::MAX
    // tokens and heads overflow u64.
    let per_head =
        planes_in_region.checked_mul(u64::from(layout.block_tokens))?.checked_mul(u64::from(layout.block_heads))?;
    (layout.block_len % per_head == 0 && layout.block_len > 0).then(|| layout.block_len / per_head)
}

/// Whether two ranks belong to the same pipeline stage (and so hold the
/// same layers): only then does one pull from the other.
pub fn same_stage(a: &RankTopology, b: &RankTopology) -> bool {
    a.pp_size == b.pp_size && a.pp_rank == b.pp_rank
}

/// Whether blocks can be copied whole between the two ranks: equal
/// layouts and equal tensor-parallel sizes (so each rank's heads are its
/// peer's). What kvlink did before it mapped heads and tokens.
pub fn copies_whole_blocks(ours: (&CacheLayout, &RankTopology), theirs: (&CacheLayout, &RankTopology)) -> bool {
    ours.1.tp_size == theirs.1.tp_size && ours.0.mismatches("", theirs.0, "").is_empty()
}

/// What keeps a decode rank (`decode`, named `decode_name`) from pulling
/// from a prefill rank (`prefill`): each difference names both values;
/// empty when every request can be mapped.
///
/// Blocks copy whole where both ranks' layouts and tensor-parallel sizes
/// agree. Otherwise heads and tokens are mapped, which needs each side's
/// heads and token layout declared and everything else to agree: layers,
/// bytes per head, the model's KV heads, MLA on both sides or neither, and
/// rows of K and V side by side ([`LayoutKind::FusedRows`]) on both sides
/// or neither. Tokens per block, NHD or HND, and split or fused K/V planes
/// may differ (the mapping is a permutation of whole head rows). Pipeline parallelism must
/// be the same on both sides; ranks of different stages hold different
/// layers, so only that is compared between them (a decode worker may ask
/// any prefill worker what its instance looks like, but pulls only from
/// its own stage: see [`same_stage`]).
pub fn mismatches(
    decode: (&CacheLayout, &RankTopology),
    decode_name: &str,
    prefill: (&CacheLayout, &RankTopology),
    prefill_name: &str,
) -> Vec<String> {
    let (d_layout, d_topo) = decode;
    let (p_layout, p_topo) = prefill;
    let mut out = Vec::new();
    let names = (decode_name, prefill_name);
    differ(&mut out, names, "pipeline-parallel size", d_topo.pp_size, p_topo.pp_size);
    if !same_stage(d_topo, p_topo) || copies_whole_blocks(decode, prefill) {
        return out;
    }
    let (d_bytes, p_bytes) = (head_bytes(d_layout), head_bytes(p_layout));
    let (Some(d_head), Some(p_head)) = (d_bytes, p_bytes) else {
        // Nothing to map by: only whole blocks, so everything must agree.
        out.extend(d_layout.mismatches(decode_name, p_layout, prefill_name));
        differ(&mut out, names, "tensor-parallel size", d_topo.tp_size, p_topo.tp_size);
        let undeclared = [(decode_name, d_bytes), (prefill_name, p_bytes)]
            .into_iter()
            .filter(|(_, bytes)| bytes.is_none())
            .map(|(name, _)| name)
            .collect::<Vec<_>>()
            .join(" and ");
        out.push(format!(
            "heads and token layout per block: undeclared by {undeclared}, so blocks can only be copied whole"
        ));
        return out;
    };
    let mla = |layout: &CacheLayout| if layout.kind == LayoutKind::Mla { "MLA" } else { "K and V" };
    differ(&mut out, names, "attention kind", mla(d_layout), mla(p_layout));
    if d_layout.kind != LayoutKind::Mla && p_layout.kind != LayoutKind::Mla {
        // A row of K and V side by side cannot be cut into planes.
        let rows = |layout: &CacheLayout| {
            if layout.kind == LayoutKind::FusedRows {
                "side by side in each row"
            } else {
                "apart"
            }
        };
        differ(&mut out, names, "K and V", rows(d_layout), rows(p_layout));
    }
    let layers = |layout: &CacheLayout| layout.region_count / regions_per_layer(layout.kind);
    differ(&mut out, names, "layers", layers(d_layout), layers(p_layout));
    differ(&mut out, names, "bytes per head and token", d_head, p_head);
    if d_layout.dtype_bytes != 0 && p_layout.dtype_bytes != 0 {
        differ(&mut out, names, "bytes per element", d_layout.dtype_bytes, p_layout.dtype_bytes);
    }
    differ(&mut out, names, "model KV heads", d_topo.num_kv_heads, p_topo.num_kv_heads);
    for (name, layout, topo) in [(decode_name, d_layout, d_topo), (prefill_name, p_layout, p_topo)] {
        if layout.block_heads != topo.heads.count {
            out.push(format!("heads: {name} has {} per block but {} of the model", layout.block_heads, topo.heads));
        }
    }
    out
}

/// Pushes "`what`: decode has `ours`, prefill has `theirs`" when they differ.
fn differ(out: &mut Vec<String>, names: (&str, &str), what: &str, ours: impl ToString, theirs: impl ToString) {
    let (ours, theirs) = (ours.to_string(), theirs.to_string());
    if ours != theirs {
        out.push(format!("{what}: {} has {ours}, {} has {theirs}", names.0, names.1));
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case::one_rank(8, 1, 0, (0, 8))]
    #[case::split(8, 4, 3, (6, 2))]
    #[case::one_each(4, 4, 2, (2, 1))]
    #[case::replicated_first(2, 4, 1, (0, 1))]
    #[case::replicated_second(2, 4, 2, (1, 1))]
    #[case::mla_on_every_rank(1, 4, 3, (0, 1))]
    fn heads_split_as_vllm_splits_them(
        #[case] heads: u32,
        #[case] tp: u32,
        #[case] rank: u32,
        #[case] want: (u32, u32),
    ) {
        assert_eq!(rank_heads(heads, tp, rank), Ok(HeadRange::new(want.0, want.1)));
    }

    #[rstest]
    #[case::uneven(6, 4, 0)]
    #[case::uneven_replicas(4, 6, 0)]
    #[case::no_heads(0, 1, 0)]
    #[case::rank_past_size(8, 2, 2)]
    #[case::zero_size(8, 0, 0)]
    fn unsplittable_heads_are_errors(#[case] heads: u32, #[case] tp: u32, #[case] rank: u32) {
        assert!(rank_heads(heads, tp, rank).is_err());
    }

    fn part(prefill_rank: u32, first: u32, count: u32) -> Part {
        Part { prefill_rank, heads: HeadRange::new(first, count) }
    }

    #[rstest]
    #[case::same_size(8, 2, 2, 1, vec![part(1, 4, 4)])]
    #[case::decode_smaller(8, 4, 1, 0, vec![part(0, 0, 2), part(1, 2, 2), part(2, 4, 2), part(3, 6, 2)])]
    #[case::decode_larger(8, 1, 4, 2, vec![part(0, 4, 2)])]
    #[case::prefill_replicates_decode_first(2, 4, 1, 0, vec![part(0, 0, 1), part(2, 1, 1), part(1, 0, 0), part(3, 0, 0)])]
    #[case::prefill_replicates_spread(2, 4, 2, 1, vec![part(3, 1, 1), part(1, 0, 0)])]
    #[case::both_replicate(2, 4, 4, 3, vec![part(3, 1, 1)])]
    #[case::mla_one_prefill_rank(1, 2, 1, 0, vec![part(0, 0, 1), part(1, 0, 0)])]
    #[case::mla_spread(1, 4, 2, 1, vec![part(1, 0, 1), part(3, 0, 0)])]
    fn parts_of_a_decode_rank(
        #[case] heads: u32,
        #[case] tp_p: u32,
        #[case] tp_d: u32,
        #[case] rank: u32,
        #[case] want: Vec<Part>,
    ) {
        assert_eq!(decode_parts(heads, tp_p, tp_d, rank).unwrap(), want);
    }

    /// Over every decode rank: each of its heads comes from exactly one
    /// prefill rank that holds it, and each prefill rank is asked exactly
    /// as often as it expects.
    #[rstest]
    fn every_pairing_is_consistent(
        #[values(1, 2, 4, 8)] heads: u32,
        #[values(1, 2, 4, 8)] tp_p: u32,
        #[values(1, 2, 4, 8)] tp_d: u32,
    ) {
        let mut asked = vec![0u32; tp_p as usize];
        for d in 0..tp_d {
            let parts = decode_parts(heads, tp_p, tp_d, d).unwrap();
            let mine = rank_heads(heads, tp_d, d).unwrap();
            let mut covered = Vec::new();
            for p in &parts {
                assert!(rank_heads(heads, tp_p, p.prefill_rank).unwrap().covers(&p.heads), "{p:?}");
                covered.extend(p.heads.first..p.heads.end());
                asked[p.prefill_rank as usize] += 1;
            }
            covered.sort_unstable();
            assert_eq!(covered, (mine.first..mine.end()).collect::<Vec<_>>(), "decode rank {d}");
        }
        for (p, &n) in asked.iter().enumerate() {
            assert_eq!(pulls_expected(heads, tp_p, p as u32, tp_d), Ok(n), "prefill rank {p}");
        }
    }

    #[test]
    fn ports_add_the_global_rank() {
        let topo = RankTopology::new(4, 3, 2, 1, 8).unwrap();
        assert_eq!(topo.global_rank(), 7);
        assert_eq!(side_channel_port(9000, topo.global_rank()), Some(9007));
        assert_eq!(side_channel_port(65535, 1), None);
        assert_eq!(side_channel_port(0, 1 << 16), None);
    }

    #[test]
    fn a_declared_topology_is_validated() {
        let good = RankTopology::new(2, 1, 1, 0, 8).unwrap();
        assert_eq!(good.heads, HeadRange::new(4, 4));
        assert_eq!(good.validate(), Ok(()));
        let wrong = RankTopology { heads: HeadRange::new(0, 4), ..good };
        assert!(matches!(wrong.validate(), Err(TopologyError::Heads { .. })));
        assert!(RankTopology { tp_size: MAX_PARALLEL_SIZE + 1, ..good }.validate().is_err());
        assert!(RankTopology { pp_rank: 1, ..good }.validate().is_err());
    }

    fn layout(kind: LayoutKind, token_layout: TokenLayout, tokens: u32, heads: u32) -> CacheLayout {
        let planes = planes_per_layer(kind) / regions_per_layer(kind);
        CacheLayout {
            kind,
            region_count: 4 * regions_per_layer(kind),
            block_len: u64::from(planes * tokens * heads) * 64,
            block_tokens: tokens,
            dtype_bytes: 2,
            token_layout,
            block_heads: heads,
        }
    }

    fn rank(tp: u32, r: u32) -> RankTopology {
        RankTopology::new(tp, r, 1, 0, 4).unwrap()
    }

    #[rstest]
    #[case::same(layout(LayoutKind::SplitKv, TokenLayout::Nhd, 16, 4), rank(1, 0))]
    #[case::other_tp(layout(LayoutKind::SplitKv, TokenLayout::Nhd, 16, 2), rank(2, 1))]
    #[case::other_block_size(layout(LayoutKind::SplitKv, TokenLayout::Nhd, 32, 4), rank(1, 0))]
    #[case::hnd(layout(LayoutKind::SplitKv, TokenLayout::Hnd, 16, 4), rank(1, 0))]
    #[case::fused(layout(LayoutKind::Fused, TokenLayout::Nhd, 16, 4), rank(1, 0))]
    fn mappable_caches_agree(#[case] d_layout: CacheLayout, #[case] d_topo: RankTopology) {
        let p = (&layout(LayoutKind::SplitKv, TokenLayout::Nhd, 16, 4), &rank(1, 0));
        assert_eq!(mismatches((&d_layout, &d_topo), "d", p, "p"), Vec::<String>::new());
    }

    /// Rows of K and V side by side map between two such caches, whatever
    /// their tensor-parallel sizes, block sizes and orders.
    #[rstest]
    #[case::other_tp(layout(LayoutKind::FusedRows, TokenLayout::Hnd, 16, 2), rank(2, 1))]
    #[case::other_block_size(layout(LayoutKind::FusedRows, TokenLayout::Hnd, 32, 4), rank(1, 0))]
    #[case::nhd(layout(LayoutKind::FusedRows, TokenLayout::Nhd, 16, 4), rank(1, 0))]
    fn rows_of_k_and_v_map_to_rows_of_k_and_v(#[case] d_layout: CacheLayout, #[case] d_topo: RankTopology) {
        let p = (&layout(LayoutKind::FusedRows, TokenLayout::Hnd, 16, 4), &rank(1, 0));
        assert_eq!(mismatches((&d_layout, &d_topo), "d", p, "p"), Vec::<String>::new());
    }

    #[rstest]
    #[case::mla(
        layout(LayoutKind::Mla, TokenLayout::Nhd, 16, 4),
        rank(1, 0),
        "attention kind: d has MLA, p has K and V"
    )]
    #[case::head_bytes(CacheLayout { block_len: 16 * 4 * 32, ..layout(LayoutKind::SplitKv, TokenLayout::Nhd, 16, 4) }, rank(1, 0), "bytes per head and token: d has 32, p has 64")]
    #[case::layers(CacheLayout { region_count: 6, ..layout(LayoutKind::SplitKv, TokenLayout::Nhd, 32, 4) }, rank(1, 0), "layers: d has 3, p has 4")]
    #[case::pp(layout(LayoutKind::SplitKv, TokenLayout::Nhd, 16, 4), RankTopology { pp_size: 2, ..rank(1, 0) }, "pipeline-parallel size: d has 2, p has 1")]
    #[case::undeclared(CacheLayout { token_layout: TokenLayout::Undeclared, ..layout(LayoutKind::SplitKv, TokenLayout::Nhd, 32, 4) }, rank(1, 0), "tokens per block: d has 32, p has 16")]
    #[case::undeclared_tp(CacheLayout { token_layout: TokenLayout::Undeclared, ..layout(LayoutKind::SplitKv, TokenLayout::Nhd, 16, 2) }, rank(2, 0), "tensor-parallel size: d has 2, p has 1")]
    #[case::overflowing_declaration(
        CacheLayout { block_tokens: u32::MAX, block_heads: u32::MAX, ..layout(LayoutKind::Fused, TokenLayout::Nhd, 16, 4) },
        rank(1, 0),
        "heads and token layout per block: undeclared by d, so blocks can only be copied whole"
    )]
    #[case::heads_per_block(
        layout(LayoutKind::SplitKv, TokenLayout::Nhd, 16, 4),
        rank(2, 0),
        "heads: d has 4 per block but heads 0..2 of the model"
    )]
    #[case::rows_of_k_and_v(
        layout(LayoutKind::FusedRows, TokenLayout::Hnd, 16, 2),
        rank(2, 0),
        "K and V: d has side by side in each row, p has apart"
    )]
    fn unmappable_caches_name_both_values(
        #[case] d_layout: CacheLayout,
        #[case] d_topo: RankTopology,
        #[case] expected: &str,
    ) {
        let p = (&layout(LayoutKind::SplitKv, TokenLayout::Nhd, 16, 4), &rank(1, 0));
        let found = mismatches((&d_layout, &d_topo), "d", p, "p");
        assert!(found.iter().any(|m| m == expected), "{found:?}");
    }
}
