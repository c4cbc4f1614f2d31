//! KV-cache registration: turns the engine's per-layer cache tensors into the
//! memory regions a transport registers, and checks they are consistent.

use kv_proto::{BlockId, CacheLayout, LayoutKind, MemoryRegion};

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
            LayoutKind::Fused | LayoutKind::Mla => 1,
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
        Ok(Self { kind, regions, num_blocks: first.num_blocks, block_len: first.len / first.num_blocks })
    }

    /// A cache with no regions (placeholder while one is being built).
    pub(crate) fn empty() -> Self {
        Self { kind: LayoutKind::SplitKv, regions: Vec::new(), num_blocks: 0, block_len: 0 }
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
        }
    }

    /// Whether `block` exists in every region.
    pub fn has_block(&self, block: BlockId) -> bool {
        u64::from(block) < self.num_blocks
    }
}

/// The shape of a model's KV cache, to allocate one (tests, the CLI) or to
/// describe one (the bench).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
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

impl CacheShape {
    /// A llama-3-8B-shaped cache: 32 layers, 8 KV heads, head dim 128, bf16,
    /// 16-token blocks, K and V split.
    pub fn llama3_8b(num_blocks: u64) -> Self {
        Self {
            kind: LayoutKind::SplitKv,
            num_layers: 32,
            num_blocks,
            block_size: 16,
            num_kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
        }
    }

    /// Regions per layer.
    pub fn regions_per_layer(&self) -> u32 {
        match self.kind {
            LayoutKind::SplitKv => 2,
            LayoutKind::Fused | LayoutKind::Mla => 1,
        }
    }

    /// Bytes of one block in one region (a fused block holds K and V).
    pub fn block_len(&self) -> u64 {
        let per_token = u64::from(self.num_kv_heads) * u64::from(self.head_dim) * u64::from(self.dtype_bytes);
        let kv = if self.kind == LayoutKind::Fused { 2 } else { 1 };
        per_token * u64::from(self.block_size) * kv
    }

    /// Bytes of one region.
    pub fn region_len(&self) -> u64 {
        self.block_len() * self.num_blocks
    }

    /// Number of regions.
    pub fn region_count(&self) -> u32 {
        self.num_layers * self.regions_per_layer()
    }

    /// Bytes of the whole cache.
    pub fn total_bytes(&self) -> u64 {
        self.region_len() * u64::from(self.region_count())
    }
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
        assert_eq!(c.layout(), CacheLayout { kind: LayoutKind::SplitKv, region_count: 4, block_len: 100 });
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
        let s = CacheShape::llama3_8b(100);
        assert_eq!(s.block_len(), 16 * 8 * 128 * 2);
        assert_eq!(s.region_count(), 64);
    }
}
