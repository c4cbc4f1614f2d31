//! A KV cache the library allocates itself (tests, the CLI, the bench).
//!
//! Peers write its regions concurrently, so it never lends a Rust reference
//! to region bytes: blocks are copied in and out of the caller's buffers
//! with raw pointer copies, bounds-checked in every build.

use std::alloc::{self, Layout};
use std::ptr::{self, NonNull};

use kv_proto::{BlockId, MemoryRegion};

use crate::layout::{CacheShape, LayerCache, LayerTensor, LayoutError, RegisteredCache};

/// Alignment of every region (a page, as engines' allocators give).
const REGION_ALIGN: usize = 4096;

/// A cache could not be allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The shape has no bytes, or regions too large for the allocator.
    #[error("cannot allocate a cache of shape {0:?}")]
    BadShape(CacheShape),
    /// The allocator refused.
    #[error("out of memory allocating {bytes} bytes")]
    OutOfMemory {
        /// Bytes of the region that failed.
        bytes: u64,
    },
    /// The shape does not make a valid registered cache.
    #[error(transparent)]
    Layout(#[from] LayoutError),
}

/// A block access refused before any byte was touched (checked in every
/// build, release included).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// The region index is past the last region.
    #[error("region {region} does not exist: the cache has {region_count} regions")]
    NoSuchRegion {
        /// The region asked for.
        region: usize,
        /// Regions of the cache.
        region_count: usize,
    },
    /// The block id is past the last block.
    #[error("block {block} does not exist: each region has {num_blocks} blocks")]
    NoSuchBlock {
        /// The block asked for.
        block: BlockId,
        /// Blocks per region.
        num_blocks: u64,
    },
    /// The caller's buffer is not exactly one block long.
    #[error("a buffer of {got} bytes for a block of {block_len} bytes")]
    BufferLen {
        /// The buffer's length.
        got: usize,
        /// Bytes of one block.
        block_len: usize,
    },
}

/// A zero-initialised, page-aligned KV cache with one allocation per region.
///
/// Its regions are meant to be registered with a transport: peers write into
/// them concurrently. No Rust reference to region bytes is ever created;
/// blocks are copied in ([`write_block`](Self::write_block)) and out
/// ([`read_block`](Self::read_block)) of the caller's buffer with raw copies.
/// Both are `unsafe` because the engine's rule remains the caller's to keep:
/// a block is read only after the transfer that fills it has been reported
/// received, and written only while no transfer reads or writes it. Bounds
/// are checked in every build.
pub struct OwnedKvCache {
    shape: CacheShape,
    region_len: usize,
    block_len: usize,
    regions: Vec<NonNull<u8>>,
    registered: RegisteredCache,
}

// SAFETY: the cache owns its allocations; concurrent access goes through
// `unsafe` accessors whose contract excludes data races.
unsafe impl Send for OwnedKvCache {}
// SAFETY: as above; `&OwnedKvCache` hands out no safe access to region bytes.
unsafe impl Sync for OwnedKvCache {}

impl OwnedKvCache {
    /// Allocates a zeroed cache of `shape` (pages are mapped lazily by the OS).
    ///
    /// # Errors
    ///
    /// [`AllocError::BadShape`] for a shape with no bytes or with regions too
    /// large for this platform's allocator, [`AllocError::OutOfMemory`] if the
    /// allocator refuses.
    pub fn allocate(shape: CacheShape) -> Result<Self, AllocError> {
        let bad = || AllocError::BadShape(shape);
        let region_len = usize::try_from(shape.region_len()).map_err(|_| bad())?;
        let block_len = usize::try_from(shape.block_len()).map_err(|_| bad())?;
        let region_count = usize::try_from(shape.region_count()).map_err(|_| bad())?;
        // `region_len > 0` implies at least one block of at least one byte.
        if region_len == 0 || region_count == 0 {
            return Err(bad());
        }
        let layout = Layout::from_size_align(region_len, REGION_ALIGN).map_err(|_| bad())?;
        let mut cache = Self {
            shape,
            region_len,
            block_len,
            regions: Vec::with_capacity(region_count),
            registered: RegisteredCache::empty(),
        };
        for _ in 0..region_count {
            // SAFETY: `layout` has a non-zero size (checked above).
            let ptr = unsafe { alloc::alloc_zeroed(layout) };
            let ptr = NonNull::new(ptr).ok_or(AllocError::OutOfMemory { bytes: shape.region_len() })?;
            cache.regions.push(ptr);
        }
        let per_layer = shape.regions_per_layer() as usize;
        let layers: Vec<LayerCache> = cache
            .regions
            .chunks(per_layer)
            .enumerate()
            .map(|(i, chunk)| LayerCache {
                name: format!("model.layers.{i}.self_attn"),
                tensors: chunk
                    .iter()
                    .map(|p| LayerTensor {
                        addr: p.as_ptr() as u64,
                        len: shape.region_len(),
                        num_blocks: shape.num_blocks(),
                        kernel_block_size: shape.block_size(),
                    })
                    .collect(),
            })
            .collect();
        let heads = if shape.kind() == kv_proto::LayoutKind::Mla { 1 } else { shape.num_kv_heads() };
        cache.registered = RegisteredCache::new(shape.kind(), shape.block_size(), &layers)?
            .with_dtype_bytes(shape.dtype_bytes())
            .with_heads(heads, shape.token_layout())?;
        Ok(cache)
    }

    /// The shape it was allocated with.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    /// Its regions and geometry, to register with a worker.
    pub fn registered(&self) -> &RegisteredCache {
        &self.registered
    }

    /// Number of regions.
    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    /// Bytes of one block in one region: the length of the buffer
    /// [`read_block`](Self::read_block) and [`write_block`](Self::write_block)
    /// take.
    pub fn block_len(&self) -> usize {
        self.block_len
    }

    /// Where `block` of `region` lies in memory (address and length), checked
    /// against the cache's bounds in every build.
    ///
    /// # Errors
    ///
    /// [`BlockError::NoSuchRegion`] or [`BlockError::NoSuchBlock`].
    pub fn block_region(&self, region: usize, block: BlockId) -> Result<MemoryRegion, BlockError> {
        let (ptr, len) = self.block_ptr(region, block)?;
        Ok(MemoryRegion::new(ptr as u64, len as u64))
    }

    /// The start of `block` in `region` and its length; the range lies inside
    /// that region's allocation (checked, not assumed).
    fn block_ptr(&self, region: usize, block: BlockId) -> Result<(*mut u8, usize), BlockError> {
        let base =
            self.regions.get(region).ok_or(BlockError::NoSuchRegion { region, region_count: self.regions.len() })?;
        let no_such_block = BlockError::NoSuchBlock { block, num_blocks: self.shape.num_blocks() };
        let offset = usize::try_from(block)
            .ok()
            .and_then(|index| index.checked_mul(self.block_len))
            .filter(|offset| offset.checked_add(self.block_len).is_some_and(|end| end <= self.region_len))
            .ok_or(no_such_block)?;
        // SAFETY: `offset + block_len <= region_len` (checked above), so the
        // result stays inside the allocation of `region_len` bytes at `base`.
        Ok((unsafe { base.as_ptr().add(offset) }, self.block_len))
    }

    /// Copies `block` of `region` into `dst`, which must be exactly
    /// [`block_len`](Self::block_len) bytes.
    ///
    /// # Errors
    ///
    /// [`BlockError`] if the block or region does not exist or `dst` has
    /// the wrong length; nothing is copied then.
    ///
    /// # Safety
    ///
    /// No transfer may write this block while the call runs: the block is
    /// not part of a pull in flight (its pull was reported received or
    /// failed, or it was never asked for). `dst` is not memory of this cache.
    pub unsafe fn read_block(&self, region: usize, block: BlockId, dst: &mut [u8]) -> Result<(), BlockError> {
        let (src, len) = self.block_ptr(region, block)?;
        if dst.len() != len {
            return Err(BlockError::BufferLen { got: dst.len(), block_len: len });
        }
        // SAFETY: `src..src + len` is inside a live allocation of this cache
        // (block_ptr); `dst` is a caller buffer of `len` bytes outside the
        // cache (the caller guarantees it), so the two do not overlap. The
        // caller guarantees no concurrent writer, so the read does not race.
        unsafe { ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), len) };
        Ok(())
    }

    /// Copies `src`, which must be exactly [`block_len`](Self::block_len)
    /// bytes, into `block` of `region`.
    ///
    /// # Errors
    ///
    /// [`BlockError`] if the block or region does not exist or `src` has
    /// the wrong length; nothing is copied then.
    ///
    /// # Safety
    ///
    /// No transfer may read or write this block while the call runs: the
    /// block is neither being sent (its request was not yet handed to the
    /// scheduler's `request_finished`, or its send has completed) nor part of
    /// a pull in flight. `src` is not memory of this cache.
    pub unsafe fn write_block(&self, region: usize, block: BlockId, src: &[u8]) -> Result<(), BlockError> {
        let (dst, len) = self.block_ptr(region, block)?;
        if src.len() != len {
            return Err(BlockError::BufferLen { got: src.len(), block_len: len });
        }
        // SAFETY: `dst..dst + len` is inside a live allocation of this cache
        // (block_ptr), writable (allocated by us, never lent as a reference);
        // `src` is a caller buffer of `len` bytes outside the cache (the
        // caller guarantees it), so the two do not overlap. The caller
        // guarantees no concurrent reader or writer, so the write does not race.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), dst, len) };
        Ok(())
    }
}

impl Drop for OwnedKvCache {
    fn drop(&mut self) {
        if let Ok(layout) = Layout::from_size_align(self.region_len, REGION_ALIGN) {
            for ptr in &self.regions {
                // SAFETY: allocated in `allocate` with this very layout, freed once.
                unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
            }
        }
    }
}

impl std::fmt::Debug for OwnedKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedKvCache").field("shape", &self.shape).field("regions", &self.regions.len()).finish()
    }
}

#[cfg(test)]
mod tests {
    use kv_proto::LayoutKind;

    use super::*;
    use crate::layout::CacheDims;

    fn cache(num_blocks: u64) -> OwnedKvCache {
        let dims = CacheDims {
            kind: LayoutKind::SplitKv,
            num_layers: 2,
            num_blocks,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 4,
            dtype_bytes: 2,
        };
        OwnedKvCache::allocate(CacheShape::try_new(dims).unwrap()).unwrap()
    }

    fn read(c: &OwnedKvCache, region: usize, block: BlockId) -> Result<Vec<u8>, BlockError> {
        let mut buf = vec![0xAA; c.block_len()];
        // SAFETY: this cache is never registered with a transport.
        unsafe { c.read_block(region, block, &mut buf) }.map(|()| buf)
    }

    fn write(c: &OwnedKvCache, region: usize, block: BlockId, src: &[u8]) -> Result<(), BlockError> {
        // SAFETY: this cache is never registered with a transport.
        unsafe { c.write_block(region, block, src) }
    }

    #[test]
    fn every_block_round_trips_and_blocks_do_not_overlap() {
        let c = cache(3);
        assert_eq!((c.region_count(), c.block_len()), (4, 32));
        for region in 0..4 {
            for block in 0..3 {
                write(&c, region, block, &[(region * 3 + block as usize) as u8; 32]).unwrap();
            }
        }
        for region in 0..4 {
            for block in 0..3 {
                assert_eq!(read(&c, region, block).unwrap(), vec![(region * 3 + block as usize) as u8; 32]);
                let at = c.block_region(region, block).unwrap();
                let base = c.registered().regions()[region].addr;
                assert_eq!(at, MemoryRegion::new(base + u64::from(block) * 32, 32));
            }
        }
    }

    #[test]
    fn out_of_range_accesses_are_refused_and_touch_nothing() {
        let c = cache(3);
        let no_block = |block| BlockError::NoSuchBlock { block, num_blocks: 3 };
        let no_region = |region| BlockError::NoSuchRegion { region, region_count: 4 };
        for block in [3, 4, BlockId::MAX] {
            assert_eq!(read(&c, 0, block), Err(no_block(block)));
            assert_eq!(write(&c, 3, block, &[1; 32]), Err(no_block(block)));
            assert_eq!(c.block_region(1, block), Err(no_block(block)));
        }
        for region in [4, 5, usize::MAX] {
            assert_eq!(read(&c, region, 0), Err(no_region(region)));
            assert_eq!(write(&c, region, 2, &[1; 32]), Err(no_region(region)));
            assert_eq!(c.block_region(region, 0), Err(no_region(region)));
        }
        for len in [0, 31, 33] {
            assert_eq!(write(&c, 0, 0, &vec![1; len]), Err(BlockError::BufferLen { got: len, block_len: 32 }));
            let mut short = vec![0; len];
            // SAFETY: this cache is never registered with a transport.
            let got = unsafe { c.read_block(0, 0, &mut short) };
            assert_eq!(got, Err(BlockError::BufferLen { got: len, block_len: 32 }));
        }
        for region in 0..4 {
            for block in 0..3 {
                assert_eq!(read(&c, region, block).unwrap(), vec![0; 32], "nothing was written");
            }
        }
    }

    #[test]
    fn a_shape_without_bytes_is_not_allocated() {
        let shape = CacheShape::llama3_8b(0).unwrap();
        assert_eq!(OwnedKvCache::allocate(shape).unwrap_err(), AllocError::BadShape(shape));
    }
}
