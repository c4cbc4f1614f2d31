//! A KV cache the library allocates itself (tests, the CLI, the bench), and
//! the only module of this crate with `unsafe` code.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use kv_proto::BlockId;

use crate::layout::{CacheShape, LayerCache, LayerTensor, LayoutError, RegisteredCache};

/// Alignment of every region (a page, as engines' allocators give).
const REGION_ALIGN: usize = 4096;

/// A cache could not be allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The shape has no bytes, or too many to address.
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

/// A zero-initialised, page-aligned KV cache with one allocation per region.
///
/// Its regions are meant to be registered with a transport: peers write into
/// them concurrently, so block access is `unsafe` and follows the engine's
/// rule: a block is read only after the transfer that fills it has been
/// reported received, and written only while no transfer reads it.
pub struct OwnedKvCache {
    shape: CacheShape,
    region_len: usize,
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
    pub fn allocate(shape: CacheShape) -> Result<Self, AllocError> {
        let region_len = usize::try_from(shape.region_len()).map_err(|_| AllocError::BadShape(shape))?;
        let layout = Layout::from_size_align(region_len, REGION_ALIGN).map_err(|_| AllocError::BadShape(shape))?;
        if region_len == 0 || shape.region_count() == 0 {
            return Err(AllocError::BadShape(shape));
        }
        let mut cache = Self {
            shape,
            region_len,
            regions: Vec::with_capacity(shape.region_count() as usize),
            registered: RegisteredCache::empty(),
        };
        for _ in 0..shape.region_count() {
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
        cache.registered = RegisteredCache::new(shape.kind(), shape.block_size(), &layers)?;
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

    fn block_ptr(&self, region: usize, block: BlockId) -> Option<(*mut u8, usize)> {
        let block_len = self.shape.block_len() as usize;
        if !self.registered.has_block(block) {
            return None;
        }
        let base = self.regions.get(region)?;
        let offset = block as usize * block_len;
        debug_assert!(offset + block_len <= self.region_len);
        // SAFETY: `offset + block_len <= region_len` because `block < num_blocks`
        // and `region_len = num_blocks * block_len`; the pointer stays inside
        // the allocation.
        Some((unsafe { base.as_ptr().add(offset) }, block_len))
    }

    /// The bytes of `block` in `region`, or `None` if either is out of range.
    ///
    /// # Safety
    ///
    /// No transfer may write this block while the returned slice lives: the
    /// block is not part of a pull that is in flight.
    pub unsafe fn block(&self, region: usize, block: BlockId) -> Option<&[u8]> {
        let (ptr, len) = self.block_ptr(region, block)?;
        // SAFETY: in bounds of a live allocation (block_ptr); the caller
        // guarantees no concurrent writer.
        Some(unsafe { std::slice::from_raw_parts(ptr, len) })
    }

    /// The bytes of `block` in `region`, writable.
    ///
    /// # Safety
    ///
    /// No transfer may read or write this block, and no other slice of it may
    /// exist, while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn block_mut(&self, region: usize, block: BlockId) -> Option<&mut [u8]> {
        let (ptr, len) = self.block_ptr(region, block)?;
        // SAFETY: in bounds of a live allocation (block_ptr); the caller
        // guarantees exclusive access.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
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
