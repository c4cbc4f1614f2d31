//! KV-cache registration: turns the engine's per-layer cache tensors into the
//! memory regions a transport registers, and checks they are consistent.

use kv_proto::topology::regions_per_layer as layout_regions_per_layer;
use kv_proto::{BlockId, CacheLayout, LayoutKind, MemoryRegion, TokenLayout};

/// One cache tensor of a layer, as the engine allocated it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerTensor {
    /// Base address.
    pub addr: u64,
    /// Size in bytes.
    pub len: u64,
    /// Blocks in the tensor (its first dimension).
    pub num_blocks: u64,
    /// Tokens per block in the kernel's layout (the tensor's block dimension).
    pub kernel_block_size: u32,
}

/// A layer's cache: one tensor (fused K/V, or MLA) or two (K and V).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerCache {
    /// The layer's name, for errors and logs.
    pub name: String,
    /// Its tensors, K before V when split.
    pub tensors: Vec<LayerTensor>,
}

/// A registered cache that is inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// No layer was given.
    #[error("no KV cache layers to register")]
    NoLayers,
    /// A layer has the wrong number of tensors for the layout.
    #[error("layer {layer}: {got} tensors, layout {kind:?} needs {expected}")]
    TensorCount {
        /// The layer.
        layer: String,
        /// The layout.
        kind: LayoutKind,
        /// Tensors needed.
        expected: usize,
        /// Tensors given.
        got: usize,
    },
    /// Tensors differ in size (the reference requires equal sizes).
    #[error("layer {layer}: tensor of {got} bytes and {got_blocks} blocks, the first layer's has {expected} bytes and {expected_blocks} blocks; all KV cache tensors must have the same size")]
    SizeMismatch {
        /// The layer.
        layer: String,
        /// The first tensor's size.
        expected: u64,
        /// This tensor's size.
        got: u64,
        /// The first tensor's block count.
        expected_blocks: u64,
        /// This tensor's block count.
        got_blocks: u64,
    },
    /// The tensor size is not a whole number of blocks.
    #[error("layer {layer}: {len} bytes is not a whole number of {num_blocks} blocks")]
    RaggedBlocks {
        /// The layer.
        layer: String,
        /// Its size.
        len: u64,
        /// Its block count.
        num_blocks: u64,
    },
    /// The kernel's block dimension differs from the engine's block size.
    #[error("layer {layer}: kernel block size {kernel} tokens, engine block size {engine} tokens")]
    BlockSize {
        /// The layer.
        layer: String,
        /// The engine's block size.
        engine: u32,
        /// The tensor's block dimension.
        kernel: u32,
    },
    /// The declared heads do not divide a block evenly.
    #[error("a block of {block_len} bytes and {tokens} tokens does not hold {heads} heads of whole elements")]
    Heads {
        /// Bytes of a block in one region.
        block_len: u64,
        /// Tokens per block.
        tokens: u32,
        /// Heads declared.
        heads: u32,
    },
    /// The tensor wraps the address space.
    #[error("layer {layer}: tensor at {addr:#x} of {len} bytes wraps the address space")]
    Wraps {
        /// The layer.
        layer: String,
        /// Its address.
        addr: u64,
        /// Its size.
        len: u64,
    },
}

/// The registered KV cache: region base addresses in registration order and
/// the block geometry shared by every region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegisteredCache {
    kind: LayoutKind,
    regions: Vec<MemoryRegion>,
    num_blocks: u64,
    block_len: u64,
    block_tokens: u32,
    dtype_bytes: u32,
    token_layout: TokenLayout,
    block_heads: u32,
}

impl RegisteredCache {
    /// Validates the engine's cache tensors and derives regions and block
    /// geometry, as the reference's `register_kv_caches` does. A tensor whose
    /// base address was already seen is skipped (layers sharing a cache).
    ///
    /// Building the value is safe; registering its regions with a transport
    /// is where the memory contract (see [`kv_proto::BatchWriter::register_regions`]) applies.
    pub fn new(kind: LayoutKind, engine_block_size: u32, layers: &[LayerCache]) -> Result<Self, LayoutError> {
        let expected_tensors = match kind {
            LayoutKind::SplitKv => 2,
            LayoutKind::Fused | LayoutKind::Mla | LayoutKind::FusedRows => 1,
        };
        let mut regions: Vec<MemoryRegion> = Vec::new();
        let mut first: Option<LayerTensor> = None;
        for layer in layers {
            if layer.tensors.len() != expected_tensors {
                return Err(LayoutError::TensorCount {
                    layer: layer.name.clone(),
                    kind,
                    expected: expected_tensors,
                    got: layer.tensors.len(),
                });
            }
            for t in &layer.tensors {
                if regions.iter().any(|r| r.addr == t.addr) {
                    continue;
                }
                if t.addr.checked_add(t.len).is_none() {
                    return Err(LayoutError::Wraps { layer: layer.name.clone(), addr: t.addr, len: t.len });
                }
                let reference = *first.get_or_insert(*t);
                if t.len != reference.len || t.num_blocks != reference.num_blocks {
                    return Err(LayoutError::SizeMismatch {
                        layer: layer.name.clone(),
                        expected: reference.len,
                        got: t.len,
                        expected_blocks: reference.num_blocks,
                        got_blocks: t.num_blocks,
                    });
                }
                if t.num_blocks == 0 || t.len == 0 || t.len % t.num_blocks != 0 {
                    return Err(LayoutError::RaggedBlocks {
                        layer: layer.name.clone(),
                        len: t.len,
                        num_blocks: t.num_blocks,
                    });
                }
                if t.kernel_block_size != engine_block_size {
                    return Err(LayoutError::BlockSize {
                        layer: layer.name.clone(),
                        engine: engine_block_size,
                        kernel: t.kernel_block_size,
                    });
                }
                regions.push(MemoryRegion::new(t.addr, t.len));
            }
        }
        let first = first.ok_or(LayoutError::NoLayers)?;
        Ok(Self {
            kind,
            regions,
            num_blocks: first.num_blocks,
            block_len: first.len / first.num_blocks,
            block_tokens: engine_block_size,
            dtype_bytes: 0,
            token_layout: TokenLayout::Undeclared,
            block_heads: 0,
        })
    }

    /// Declares how a block is laid out inside: `block_heads` KV heads (1
    /// for MLA's latent) in `token_layout` order, so P and D can map heads
    /// and tokens between caches that differ (tensor-parallel size, block
    /// size, NHD or HND); undeclared, blocks are only copied whole between
    /// equal layouts.
    ///
    /// # Errors
    ///
    /// [`LayoutError::Heads`] when a block's K, V or latent plane is not a
    /// whole number of heads of whole tokens (with a declared dtype: of
    /// whole elements).
    pub fn with_heads(self, block_heads: u32, token_layout: TokenLayout) -> Result<Self, LayoutError> {
        if token_layout == TokenLayout::Undeclared || block_heads == 0 {
            return Ok(Self { block_heads: 0, token_layout: TokenLayout::Undeclared, ..self });
        }
        let bad = LayoutError::Heads { block_len: self.block_len, tokens: self.block_tokens, heads: block_heads };
        let declared = Self { block_heads, token_layout, ..self };
        let head_len = kv_proto::topology::head_bytes(&declared.layout()).ok_or(bad.clone())?;
        if declared.dtype_bytes != 0 && head_len % u64::from(declared.dtype_bytes) != 0 {
            return Err(bad);
        }
        Ok(declared)
    }

    /// Declares the bytes per element of the cache (2 for bf16), which P and
    /// D then also check at hello; 0 (the default) leaves it unchecked.
    pub fn with_dtype_bytes(self, dtype_bytes: u32) -> Self {
        Self { dtype_bytes, ..self }
    }

    /// A cache with no regions (placeholder while one is being built).
    pub(crate) fn empty() -> Self {
        Self {
            kind: LayoutKind::SplitKv,
            regions: Vec::new(),
            num_blocks: 0,
            block_len: 0,
            block_tokens: 0,
            dtype_bytes: 0,
            token_layout: TokenLayout::Undeclared,
            block_heads: 0,
        }
    }

    /// The regions to register, in registration order.
    pub fn regions(&self) -> &[MemoryRegion] {
        &self.regions
    }

    /// Base address of each region, in registration order.
    pub fn base_addrs(&self) -> Vec<u64> {
        self.regions.iter().map(|r| r.addr).collect()
    }

    /// Blocks per region.
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Bytes of one block in one region.
    pub fn block_len(&self) -> u64 {
        self.block_len
    }

    /// What P and D must agree on.
    pub fn layout(&self) -> CacheLayout {
        CacheLayout {
            kind: self.kind,
            // A cache of more than 4 billion regions cannot be allocated.
            region_count: u32::try_from(self.regions.len()).unwrap_or(u32::MAX),
            block_len: self.block_len,
            block_tokens: self.block_tokens,
            dtype_bytes: self.dtype_bytes,
            token_layout: self.token_layout,
            block_heads: self.block_heads,
        }
    }

    /// Whether `block` exists in every region.
    pub fn has_block(&self, block: BlockId) -> bool {
        u64::from(block) < self.num_blocks
    }
}

/// The dimensions of a model's KV cache as given, unchecked: what
/// [`CacheShape::try_new`] checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheDims {
    /// How layers map to regions.
    pub kind: LayoutKind,
    /// Attention layers.
    pub num_layers: u32,
    /// Blocks per region.
    pub num_blocks: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// KV heads (1 for MLA).
    pub num_kv_heads: u32,
    /// Head dimension (MLA: the latent width).
    pub head_dim: u32,
    /// Bytes per element (2 for bf16).
    pub dtype_bytes: u32,
}

/// Cache dimensions whose sizes cannot be computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// A size (named by `what`) does not fit in its integer type.
    #[error("cache shape {dims:?} is too large to address: its {what} overflow")]
    Overflow {
        /// Which size: `bytes per block`, `bytes per region`, `regions` or
        /// `total bytes`.
        what: &'static str,
        /// The dimensions refused.
        dims: CacheDims,
    },
}

/// The shape of a model's KV cache, to allocate one (tests, the CLI) or to
/// describe one (the bench): [`CacheDims`] whose every size was computed
/// with checked arithmetic.
///
/// A value only exists if its bytes per block, bytes per region, region
/// count and total bytes all fit their types, so the getters never wrap.
/// A shape may still have no bytes (a zero dimension, e.g. a template whose
/// `num_blocks` is set later with [`CacheShape::with_num_blocks`]);
/// allocating one is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    dims: CacheDims,
    token_layout: TokenLayout,
    block_len: u64,
    region_len: u64,
    region_count: u32,
    total_bytes: u64,
}

impl CacheShape {
    /// Checks `dims`: every size of the cache must fit (bytes in `u64`, the
    /// region count in `u32`).
    ///
    /// # Errors
    ///
    /// [`ShapeError::Overflow`] naming the first size that does not fit.
    pub fn try_new(dims: CacheDims) -> Result<Self, ShapeError> {
        let overflow = |what| ShapeError::Overflow { what, dims };
        let kv: u64 = if matches!(dims.kind, LayoutKind::Fused | LayoutKind::FusedRows) { 2 } else { 1 };
        let block_len = [
            u64::from(dims.num_kv_heads),
            u64::from(dims.head_dim),
            u64::from(dims.dtype_bytes),
            u64::from(dims.block_size),
            kv,
        ]
        .into_iter()
        .try_fold(1u64, u64::checked_mul)
        .ok_or(overflow("bytes per block"))?;
        let region_len = block_len.checked_mul(dims.num_blocks).ok_or(overflow("bytes per region"))?;
        let region_count = dims.num_layers.checked_mul(regions_per_layer(dims.kind)).ok_or(overflow("regions"))?;
        let total_bytes = region_len.checked_mul(u64::from(region_count)).ok_or(overflow("total bytes"))?;
        Ok(Self { dims, token_layout: TokenLayout::Nhd, block_len, region_len, region_count, total_bytes })
    }

    /// This shape with its blocks' heads and tokens in `order` (NHD, the
    /// default, or HND).
    pub fn with_token_layout(self, order: TokenLayout) -> Self {
        Self { token_layout: order, ..self }
    }

    /// How heads and tokens are ordered in a block.
    pub fn token_layout(&self) -> TokenLayout {
        self.token_layout
    }

    /// A llama-3-8B-shaped cache: 32 layers, 8 KV heads, head dim 128, bf16,
    /// 16-token blocks, K and V split.
    ///
    /// # Errors
    ///
    /// [`ShapeError::Overflow`] if `num_blocks` makes the cache too large to
    /// address.
    pub fn llama3_8b(num_blocks: u64) -> Result<Self, ShapeError> {
        Self::try_new(CacheDims {
            kind: LayoutKind::SplitKv,
            num_layers: 32,
            num_blocks,
            block_size: 16,
            num_kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
        })
    }

    /// This shape with `num_blocks` blocks per region.
    ///
    /// # Errors
    ///
    /// [`ShapeError::Overflow`] if the cache becomes too large to address.
    pub fn with_num_blocks(self, num_blocks: u64) -> Result<Self, ShapeError> {
        Ok(Self::try_new(CacheDims { num_blocks, ..self.dims })?.with_token_layout(self.token_layout))
    }

    /// The dimensions it was made from.
    pub fn dims(&self) -> CacheDims {
        self.dims
    }

    /// How layers map to regions.
    pub fn kind(&self) -> LayoutKind {
        self.dims.kind
    }

    /// Attention layers.
    pub fn num_layers(&self) -> u32 {
        self.dims.num_layers
    }

    /// Blocks per region.
    pub fn num_blocks(&self) -> u64 {
        self.dims.num_blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.dims.block_size
    }

    /// KV heads (1 for MLA).
    pub fn num_kv_heads(&self) -> u32 {
        self.dims.num_kv_heads
    }

    /// Head dimension (MLA: the latent width).
    pub fn head_dim(&self) -> u32 {
        self.dims.head_dim
    }

    /// Bytes per element.
    pub fn dtype_bytes(&self) -> u32 {
        self.dims.dtype_bytes
    }

    /// Regions per layer.
    pub fn regions_per_layer(&self) -> u32 {
        regions_per_layer(self.dims.kind)
    }

    /// Bytes of one block in one region (a fused block holds K and V).
    pub fn block_len(&self) -> u64 {
        self.block_len
    }

    /// Bytes of one region.
    pub fn region_len(&self) -> u64 {
        self.region_len
    }

    /// Number of regions.
    pub fn region_count(&self) -> u32 {
        self.region_count
    }

    /// Bytes of the whole cache.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }
}

impl TryFrom<CacheDims> for CacheShape {
    type Error = ShapeError;

    fn try_from(dims: CacheDims) -> Result<Self, ShapeError> {
        Self::try_new(dims)
    }
}

impl From<CacheShape> for CacheDims {
    fn from(shape: CacheShape) -> Self {
        shape.dims
    }
}

fn regions_per_layer(kind: LayoutKind) -> u32 {
    layout_regions_per_layer(kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(addr: u64, len: u64) -> LayerTensor {
        LayerTensor { addr, len, num_blocks: 4, kernel_block_size: 16 }
    }

    fn layer(name: &str, tensors: Vec<LayerTensor>) -> LayerCache {
        LayerCache { name: name.into(), tensors }
    }

    #[test]
    fn split_kv_registers_two_regions_per_layer() {
        let c = RegisteredCache::new(
            LayoutKind::SplitKv,
            16,
            &[
                layer("l0", vec![tensor(0x1000, 400), tensor(0x2000, 400)]),
                layer("l1", vec![tensor(0x3000, 400), tensor(0x4000, 400)]),
            ],
        )
        .unwrap();
        assert_eq!(c.base_addrs(), vec![0x1000, 0x2000, 0x3000, 0x4000]);
        assert_eq!(c.block_len(), 100);
        assert_eq!(
            c.layout(),
            CacheLayout {
                kind: LayoutKind::SplitKv,
                region_count: 4,
                block_len: 100,
                block_tokens: 16,
                dtype_bytes: 0,
                token_layout: TokenLayout::Undeclared,
                block_heads: 0,
            }
        );
    }

    #[test]
    fn declared_heads_must_divide_a_block() {
        let t = |addr| LayerTensor { addr, len: 4 * 160, num_blocks: 4, kernel_block_size: 16 };
        let c = RegisteredCache::new(LayoutKind::SplitKv, 16, &[layer("l0", vec![t(0x1000), t(0x2000)])])
            .unwrap()
            .with_dtype_bytes(2);
        let hnd = c.clone().with_heads(5, TokenLayout::Hnd).unwrap();
        assert_eq!((hnd.layout().token_layout, hnd.layout().block_heads), (TokenLayout::Hnd, 5));
        assert!(matches!(c.clone().with_heads(3, TokenLayout::Nhd), Err(LayoutError::Heads { heads: 3, .. })));
        // 160 bytes of 16 tokens and 10 heads: one byte per head, half an element.
        assert!(matches!(c.clone().with_heads(10, TokenLayout::Nhd), Err(LayoutError::Heads { heads: 10, .. })));
        assert_eq!(c.clone().with_heads(0, TokenLayout::Nhd).unwrap().layout().token_layout, TokenLayout::Undeclared);
    }

    #[test]
    fn shared_tensors_are_registered_once() {
        let c = RegisteredCache::new(
            LayoutKind::Mla,
            16,
            &[layer("a", vec![tensor(0x1000, 400)]), layer("b", vec![tensor(0x1000, 400)])],
        )
        .unwrap();
        assert_eq!(c.regions().len(), 1);
    }

    #[test]
    fn mismatches_name_the_layer() {
        let err = RegisteredCache::new(
            LayoutKind::Mla,
            16,
            &[layer("a", vec![tensor(0x1000, 400)]), layer("b", vec![tensor(0x2000, 800)])],
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("layer b:"), "{err}");
        let err =
            RegisteredCache::new(LayoutKind::SplitKv, 16, &[layer("k_only", vec![tensor(0x1000, 400)])]).unwrap_err();
        assert!(matches!(err, LayoutError::TensorCount { ref layer, .. } if layer == "k_only"));
        let err = RegisteredCache::new(LayoutKind::Mla, 32, &[layer("x", vec![tensor(0x1000, 400)])]).unwrap_err();
        assert_eq!(err, LayoutError::BlockSize { layer: "x".into(), engine: 32, kernel: 16 });
        let ragged = LayerTensor { addr: 0x1000, len: 401, num_blocks: 4, kernel_block_size: 16 };
        let err = RegisteredCache::new(LayoutKind::Mla, 16, &[layer("r", vec![ragged])]).unwrap_err();
        assert!(matches!(err, LayoutError::RaggedBlocks { .. }));
        assert_eq!(RegisteredCache::new(LayoutKind::Mla, 16, &[]).unwrap_err(), LayoutError::NoLayers);
    }

    #[test]
    fn llama_shape() {
        let s = CacheShape::llama3_8b(100).unwrap();
        assert_eq!(s.block_len(), 16 * 8 * 128 * 2);
        assert_eq!(s.region_len(), 100 * 16 * 8 * 128 * 2);
        assert_eq!(s.region_count(), 64);
        assert_eq!(s.total_bytes(), 64 * 100 * 16 * 8 * 128 * 2);
        assert_eq!(s.with_num_blocks(7).unwrap().num_blocks(), 7);
        assert_eq!(CacheShape::try_new(s.dims()), Ok(s));
    }

    #[test]
    fn overflow_names_the_size() {
        let dims = CacheDims {
            kind: LayoutKind::Mla,
            num_layers: 1,
            num_blocks: u64::MAX,
            block_size: 16,
            num_kv_heads: 1,
            head_dim: 64,
            dtype_bytes: 2,
        };
        let err = CacheShape::try_new(dims).unwrap_err();
        assert!(err.to_string().ends_with("is too large to address: its bytes per region overflow"), "{err}");
    }

    #[test]
    fn fused_blocks_hold_k_and_v() {
        let dims = CacheDims {
            kind: LayoutKind::Fused,
            num_layers: 3,
            num_blocks: 5,
            block_size: 16,
            num_kv_heads: 2,
            head_dim: 8,
            dtype_bytes: 2,
        };
        let s = CacheShape::try_new(dims).unwrap();
        assert_eq!((s.block_len(), s.region_count(), s.total_bytes()), (1024, 3, 3 * 5 * 1024));
    }
}
