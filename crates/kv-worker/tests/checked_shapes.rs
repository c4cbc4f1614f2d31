//! Shape arithmetic and block bounds are checked in every build: CI runs
//! this file with `--release` too (`cargo xtask ci`, step `release-checks`),
//! where a `debug_assert!` or an unchecked multiplication would not stop a
//! wrapped size or an access past the end. Needs no transport feature.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kv_proto::{BlockId, LayoutKind};
use kv_worker::{AllocError, BlockError, CacheDims, CacheShape, OwnedKvCache, ShapeError};
use rstest::rstest;

const fn dims(
    kind: LayoutKind,
    num_layers: u32,
    num_blocks: u64,
    block_size: u32,
    num_kv_heads: u32,
    head_dim: u32,
    dtype_bytes: u32,
) -> CacheDims {
    CacheDims { kind, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype_bytes }
}

/// 17 × 858001 × 308761441 × 4 = 2^54 + 4 bytes per block fits in 64 bits;
/// times 1024 blocks it is 2^64 + 4096, which wraps to a 4096-byte region of
/// 4-byte blocks. Unchecked, such a cache allocates and registers fine, and
/// its block 0 came back as a slice of 2^54 + 4 bytes in release builds.
const WRAPPING: CacheDims = dims(LayoutKind::SplitKv, 1, 1024, 17, 858_001, 308_761_441, 4);

#[test]
fn the_wrapping_shape_is_refused() {
    assert_eq!(CacheShape::try_new(WRAPPING), Err(ShapeError::Overflow { what: "bytes per region", dims: WRAPPING }));
    // Half as many blocks fit (in both regions): the check is exact, not a
    // coarse limit.
    let fits = CacheShape::try_new(CacheDims { num_blocks: 511, ..WRAPPING }).unwrap();
    assert_eq!(fits.block_len(), (1 << 54) + 4);
    assert_eq!(fits.total_bytes(), 2 * 511 * ((1 << 54) + 4));
    assert_eq!(
        fits.with_num_blocks(512),
        Err(ShapeError::Overflow { what: "total bytes", dims: CacheDims { num_blocks: 512, ..WRAPPING } })
    );
    assert_eq!(fits.with_num_blocks(1024), Err(ShapeError::Overflow { what: "bytes per region", dims: WRAPPING }));
}

#[rstest]
#[case::bytes_per_block(dims(LayoutKind::Mla, 1, 1, u32::MAX, u32::MAX, u32::MAX, 2), "bytes per block")]
#[case::fused_k_and_v_double_the_block(dims(LayoutKind::Fused, 1, 1, 1 << 16, 1 << 16, 1 << 16, 1 << 16), "bytes per block")]
#[case::bytes_per_region(dims(LayoutKind::Mla, 1, u64::MAX, 16, 1, 64, 2), "bytes per region")]
#[case::regions(dims(LayoutKind::SplitKv, u32::MAX, 1, 16, 1, 64, 2), "regions")]
#[case::total_bytes(dims(LayoutKind::Fused, u32::MAX, 1 << 32, 16, 1, 64, 2), "total bytes")]
fn overflowing_shapes_are_refused(#[case] given: CacheDims, #[case] what: &'static str) {
    assert_eq!(CacheShape::try_new(given), Err(ShapeError::Overflow { what, dims: given }));
    assert_eq!(CacheShape::try_from(given), Err(ShapeError::Overflow { what, dims: given }));
}

#[test]
fn llama_shapes_too_large_to_address_are_refused() {
    assert!(CacheShape::llama3_8b(1 << 40).is_ok());
    for num_blocks in [1 << 44, u64::MAX] {
        assert!(matches!(CacheShape::llama3_8b(num_blocks), Err(ShapeError::Overflow { .. })), "{num_blocks}");
    }
}

#[test]
fn a_shape_whose_regions_the_allocator_cannot_hold_is_refused() {
    // Fits in 64 bits, but no allocator hands out 2^63 bytes in one piece.
    let shape = CacheShape::try_new(dims(LayoutKind::Mla, 1, 1 << 47, 16, 1, 256, 16)).unwrap();
    assert_eq!(shape.region_len(), 1 << 63);
    assert_eq!(OwnedKvCache::allocate(shape).unwrap_err(), AllocError::BadShape(shape));
}

fn small_cache() -> OwnedKvCache {
    let shape = CacheShape::try_new(dims(LayoutKind::SplitKv, 2, 8, 16, 1, 8, 2)).unwrap();
    OwnedKvCache::allocate(shape).unwrap()
}

#[rstest]
#[case::block_past_the_end(0, 8, BlockError::NoSuchBlock { block: 8, num_blocks: 8 })]
#[case::largest_block_id(3, BlockId::MAX, BlockError::NoSuchBlock { block: BlockId::MAX, num_blocks: 8 })]
#[case::region_past_the_end(4, 0, BlockError::NoSuchRegion { region: 4, region_count: 4 })]
#[case::largest_region_index(usize::MAX, 7, BlockError::NoSuchRegion { region: usize::MAX, region_count: 4 })]
fn out_of_range_blocks_are_refused(#[case] region: usize, #[case] block: BlockId, #[case] expected: BlockError) {
    let cache = small_cache();
    let mut buf = vec![0u8; cache.block_len()];
    assert_eq!(cache.block_region(region, block), Err(expected.clone()));
    // SAFETY: this cache is never registered with a transport: nothing else
    // reads or writes it.
    assert_eq!(unsafe { cache.read_block(region, block, &mut buf) }, Err(expected.clone()));
    // SAFETY: as above.
    assert_eq!(unsafe { cache.write_block(region, block, &buf) }, Err(expected));
}

#[test]
fn the_last_block_of_the_last_region_is_in_range() {
    let cache = small_cache();
    let last = cache.block_region(3, 7).unwrap();
    let region = cache.registered().regions()[3];
    assert_eq!(last.end(), region.end());
    let pattern: Vec<u8> = (0..cache.block_len()).map(|i| i as u8).collect();
    let mut back = vec![0u8; cache.block_len()];
    // SAFETY: this cache is never registered with a transport.
    unsafe { cache.write_block(3, 7, &pattern) }.unwrap();
    // SAFETY: as above.
    unsafe { cache.read_block(3, 7, &mut back) }.unwrap();
    assert_eq!(back, pattern);
}
