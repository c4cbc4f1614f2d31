//! Deterministic block contents, so a receiver can verify every byte of a
//! transfer without a copy of the sender's cache (tests, demo, bench).
//!
//! Two patterns: one per whole block ([`block_seed`]), for caches laid out
//! alike, and one per head row ([`RegionRows`]: a token's one head of one
//! layer's K, V or latent), which names the model's head and the prompt
//! token, so caches of another tensor-parallel size, block size or token
//! layout can still check every byte they received.

use kv_proto::topology::{planes_per_layer, regions_per_layer};
use kv_proto::{LayoutKind, TokenLayout};

use crate::layout::CacheShape;

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
        // As a word: a slice comparison of 8 bytes is a memcmp call each,
        // which the bench's check of head rows (short rows) pays per word.
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(chunk);
        if u64::from_le_bytes(bytes) != word(seed, i) {
            return false;
        }
    }
    let rest = chunks.remainder();
    rest.is_empty() || rest == &word(seed, buf.len() / 8).to_le_bytes()[..rest.len()]
}

/// Seed of one head row: the request, the layer, its plane (K 0, V 1, or
/// the latent 0), the prompt token and the model's head.
pub fn row_seed(request_seed: u64, layer: u32, plane: u32, token: u64, head: u32) -> u64 {
    row_seed_mixed(mix(request_seed), layer, plane, token, head)
}

/// [`row_seed`] of a request seed already mixed (once per block, not per row).
fn row_seed_mixed(mixed_request_seed: u64, layer: u32, plane: u32, token: u64, head: u32) -> u64 {
    let place = (u64::from(layer) << 48) ^ (u64::from(plane) << 40) ^ (u64::from(head) << 24) ^ token;
    mix(mixed_request_seed ^ place)
}

/// How one region's blocks hold head rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionRows {
    /// The layer the region belongs to.
    pub layer: u32,
    /// Its planes, each with the offset where it starts inside a block.
    pub planes: Vec<(u32, u64)>,
    /// Token order inside a plane.
    pub order: TokenLayout,
    /// Tokens per block.
    pub tokens: u32,
    /// Heads per block.
    pub heads: u32,
    /// The model's head the first one is.
    pub first_head: u32,
    /// Bytes of one head row.
    pub head_bytes: u64,
}

impl RegionRows {
    /// The regions of a cache of `shape` whose blocks hold the model's
    /// heads from `first_head` on and its layers from `first_layer` on (a
    /// pipeline stage's), in registration order.
    pub fn of_shape(shape: &CacheShape, first_head: u32, first_layer: u32) -> Vec<RegionRows> {
        let kind = shape.kind();
        let heads = if kind == LayoutKind::Mla { 1 } else { shape.num_kv_heads() };
        let per_region = planes_per_layer(kind) / regions_per_layer(kind);
        let head_bytes = shape.block_len() / u64::from(per_region * shape.block_size() * heads).max(1);
        let plane_len = shape.block_len() / u64::from(per_region);
        (0..shape.region_count())
            .map(|region| {
                let (layer, planes) = match kind {
                    LayoutKind::SplitKv => (region / 2, vec![(region % 2, 0)]),
                    LayoutKind::Fused => (region, vec![(0, 0), (1, plane_len)]),
                    LayoutKind::Mla | LayoutKind::FusedRows => (region, vec![(0, 0)]),
                };
                RegionRows {
                    layer: first_layer + layer,
                    planes,
                    order: shape.token_layout(),
                    tokens: shape.block_size(),
                    heads,
                    first_head,
                    head_bytes,
                }
            })
            .collect()
    }

    /// Where the row of (token in block, head in block) of plane `offset` starts.
    fn at(&self, offset: u64, token: u64, head: u64) -> usize {
        let (tokens, heads) = (u64::from(self.tokens), u64::from(self.heads));
        let row = match self.order {
            TokenLayout::Hnd => head * tokens + token,
            _ => token * heads + head,
        };
        (offset + row * self.head_bytes) as usize
    }

    /// Fills `block` (one block of this region holding prompt tokens from
    /// `block_first`) with its rows.
    pub fn fill(&self, block: &mut [u8], seed: u64, block_first: u64) {
        let seed = mix(seed);
        for &(plane, offset) in &self.planes {
            for token in 0..u64::from(self.tokens) {
                for head in 0..u64::from(self.heads) {
                    let start = self.at(offset, token, head);
                    let row = &mut block[start..start + self.head_bytes as usize];
                    let global = self.first_head + head as u32;
                    fill(row, row_seed_mixed(seed, self.layer, plane, block_first + token, global));
                }
            }
        }
    }

    /// Whether `block` (holding prompt tokens from `block_first`) holds
    /// the rows of the tokens in `from..to`; the others are not looked at.
    pub fn check(&self, block: &[u8], seed: u64, block_first: u64, from: u64, to: u64) -> bool {
        let lo = from.max(block_first) - block_first;
        let hi = to.min(block_first + u64::from(self.tokens)).saturating_sub(block_first);
        let seed = mix(seed);
        self.planes.iter().all(|&(plane, offset)| {
            (lo..hi).all(|token| {
                (0..u64::from(self.heads)).all(|head| {
                    let start = self.at(offset, token, head);
                    let row = &block[start..start + self.head_bytes as usize];
                    let global = self.first_head + head as u32;
                    matches(row, row_seed_mixed(seed, self.layer, plane, block_first + token, global))
                })
            })
        })
    }
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

    #[test]
    fn head_rows_name_their_head_and_token_whatever_the_layout() {
        use crate::layout::CacheDims;
        let dims = |heads, order| {
            let shape = CacheShape::try_new(CacheDims {
                kind: LayoutKind::SplitKv,
                num_layers: 1,
                num_blocks: 4,
                block_size: 4,
                num_kv_heads: heads,
                head_dim: 4,
                dtype_bytes: 2,
            })
            .unwrap();
            shape.with_token_layout(order)
        };
        let both = &RegionRows::of_shape(&dims(2, TokenLayout::Nhd), 0, 0)[1];
        let mut block = vec![0u8; 4 * 2 * 8];
        both.fill(&mut block, 9, 8);
        assert!(both.check(&block, 9, 8, 0, 100));
        // Head 1 alone, HND: its rows are the second half of NHD's every row.
        let one = &RegionRows::of_shape(&dims(1, TokenLayout::Hnd), 1, 0)[1];
        let mut slice = vec![0u8; 4 * 8];
        for token in 0..4 {
            slice[token * 8..token * 8 + 8].copy_from_slice(&block[token * 16 + 8..token * 16 + 16]);
        }
        assert!(one.check(&slice, 9, 8, 0, 100));
        assert!(!one.check(&slice, 9, 12, 0, 100), "another block's tokens");
        slice[31] ^= 1;
        assert!(!one.check(&slice, 9, 8, 0, 100));
        assert!(one.check(&slice, 9, 8, 0, 11), "the last token is not looked at");
    }
}
