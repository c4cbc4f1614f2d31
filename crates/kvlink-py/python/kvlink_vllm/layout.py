"""KV cache layout: from vLLM's per-layer cache tensors to memory regions.

Pure Python over duck-typed tensors: anything with ``data_ptr()``,
``shape``, ``stride()``, ``element_size()`` and ``device.type`` (a
``torch.Tensor`` has them all). No torch import.

The layouts vLLM's attention backends allocate, per layer (logical
shape; the physical order may differ, which the strides reveal):

=====================  ===================================  ===============
backend                shape                                kvlink layout
=====================  ===================================  ===============
FlashAttention (0.14)  ``(2, blocks, block_size, H, D)``    split K/V
CPU (0.14)             ``(2, blocks, H, block_size, D)``    split K/V
FlashInfer (0.14)      ``(blocks, 2, block_size, H, D)``    fused
later releases         ``(blocks, H, block_size, 2 * D)``   fused rows
MLA backends           ``(blocks, block_size, D)``          mla
MLA, 0.29 and later    ``(blocks, 1, block_size, D)``       mla
=====================  ===================================  ===============

Later releases (0.32) keep K and V of a block together in the last
dimension (the logical ``[blocks, heads, tokens, content]`` of vLLM's
``KVCacheLayout``): one region per layer, a block being K and V of all
its heads and tokens, each head's K and V of one token side by side in
one row ("fused rows").

A block must be one contiguous run of bytes inside each region (the block
dimension is outermost after K/V); a region is ``blocks x block bytes``.
When the kernel's block is smaller than the engine's (``block_size`` a
multiple of it), consecutive kernel blocks form one engine block.

Where the strides show how a block orders its tokens and heads (NHD:
``[tokens][heads][head_size]``, HND: ``[heads][tokens][head_size]``, in
each K, V or latent plane), the layout declares it with the heads per
block, so a peer of another tensor-parallel size, block size or order can
map heads and tokens (fused rows map as whole rows, K and V together, so
only to a peer with fused rows too); otherwise blocks are only copied
whole between equal layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ._native import ConfigError

#: Memory the host-memory transports (tcp, quic) can reach; other memory
#: (CUDA) moves through host staging (:mod:`kvlink_vllm.staging`).
HOST_DEVICES = ("cpu",)


@dataclass(frozen=True)
class Region:
    """One registered memory region: a K, V, fused or MLA tensor of a layer."""

    addr: int
    length: int
    num_blocks: int
    block_size: int

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.addr, self.length, self.num_blocks, self.block_size)


@dataclass(frozen=True)
class CacheLayout:
    """The regions of every layer, in registration order."""

    kind: str  # "split" | "fused" | "fused_rows" | "mla"
    layers: list[tuple[str, list[Region]]]
    block_len: int
    #: "NHD" or "HND" where a peer can map heads and tokens by it, else "".
    token_layout: str = ""
    #: KV heads in a block (MLA: 1); 0 when undeclared.
    block_heads: int = 0
    #: Bytes per element.
    dtype_bytes: int = 0
    #: How heads and tokens are ordered ("NHD", "HND"; "" if unknown), for
    #: the model identity even where it cannot be mapped.
    attention_layout: str = ""

    def native_layers(self) -> list[tuple[str, list[tuple[int, int, int, int]]]]:
        return [(name, [r.as_tuple() for r in regions]) for name, regions in self.layers]


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _strides(t: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in t.stride())


def _device(t: Any) -> str:
    device = getattr(t, "device", "cpu")
    return str(getattr(device, "type", device))


def _dense_bytes(shape: tuple[int, ...], strides: tuple[int, ...], elem: int) -> int | None:
    """Bytes spanned by dims that tile their span without gaps or overlap
    (in any order), else None."""
    expected = 1
    for size, stride in sorted(zip(shape, strides), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return None
        expected *= size
    return expected * elem


def describe(
    kv_caches: Mapping[str, Any],
    block_size: int,
    use_mla: bool = False,
    num_blocks: int | None = None,
) -> CacheLayout:
    """The layout of ``kv_caches`` (layer name -> tensor), checked.

    ``block_size`` is the engine's (``cache_config.block_size``);
    ``num_blocks`` (``kv_cache_config.num_blocks``), when known, settles
    which leading dimension is the block one.
    """
    if not kv_caches:
        raise ConfigError("no KV cache layers to register")
    kinds = set()
    orders = set()
    layers = []
    block_len = None
    for name, t in kv_caches.items():
        kind, regions = _layer(name, t, block_size, use_mla, num_blocks)
        kinds.add(kind)
        orders.add(_order(t, kind, use_mla, block_size))
        layers.append((name, regions))
        for r in regions:
            this = r.length // r.num_blocks
            if block_len is None:
                block_len = this
    if len(kinds) != 1:
        raise ConfigError(f"KV cache layers mix layouts {sorted(kinds)}; kvlink needs one layout for all layers")
    assert block_len is not None
    # Layers that disagree on their order (never seen) are only copied whole.
    (attention, mapped, heads), *others = sorted(orders)
    if others:
        attention, mapped, heads = "", "", 0
    elem = int(next(iter(kv_caches.values())).element_size())
    return CacheLayout(
        kind=kinds.pop(),
        layers=layers,
        block_len=block_len,
        token_layout=mapped,
        block_heads=heads if mapped else 0,
        dtype_bytes=elem,
        attention_layout=attention,
    )


def _order(t: Any, kind: str, use_mla: bool, block_size: int) -> tuple[str, str, int]:
    """How a layer's blocks order tokens and heads: (the attention layout,
    the same where heads and tokens can be mapped by it else "", heads per
    block)."""
    shape, strides = _shape(t), _strides(t)
    if use_mla:
        # (blocks, [1,] block_size, latent): one head, token-major.
        return ("NHD", "NHD", 1) if strides[-1] == 1 else ("", "", 0)
    if len(shape) == 5 and kind == "split":
        # CPU: (2, blocks, heads, block_size, head_size); CUDA: (2, blocks,
        # block_size, heads, head_size) (as `_layer` reads them).
        tokens = 3 if _device(t) == "cpu" else 2
        plane = (tokens, 5 - tokens, 4)
    elif len(shape) == 5:
        # FlashInfer: (blocks, 2, block_size, heads, head_size), K then V.
        plane = (2, 3, 4)
    else:
        # (blocks, heads, block_size, 2 * head_size): K and V of a head and
        # token side by side in one row, a row being one "head row" of
        # twice the head size (one plane, not two).
        plane = (2, 1, 3)
    tokens, heads, head = plane
    n_tokens, n_heads, n_head = shape[tokens], shape[heads], shape[head]
    if strides[head] != 1:
        return ("", "", 0)
    if strides[heads] == n_head and strides[tokens] == n_heads * n_head:
        order = "NHD"
    elif strides[tokens] == n_head and strides[heads] == n_tokens * n_head:
        order = "HND"
    else:
        return ("", "", 0)
    # Kernel blocks smaller than the engine's stack whole kernel blocks: a
    # head's tokens are then no longer one run (HND), rows still are (NHD).
    mapped = order if (order == "NHD" or n_tokens == block_size) else ""
    return (order, mapped, n_heads)



def _layer(name: str, t: Any, block_size: int, use_mla: bool, num_blocks: int | None):
    shape, strides = _shape(t), _strides(t)
    elem = int(t.element_size())
    base = int(t.data_ptr())
    cpu = _device(t) == "cpu"

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"KV cache layer {name!r}: shape {shape} strides {strides}: {why} "
            "(kvlink reads the layouts of vLLM 0.14's FlashAttention, FlashInfer, CPU and MLA backends, "
            "and later releases' (blocks, heads, block_size, 2 x head_size) and (blocks, 1, block_size, head_size) "
            "with MLA)"
        )

    if use_mla:
        if len(shape) == 3:
            kind, kv_dim, block_dim, kernel_dim = "mla", None, 0, 1
        elif len(shape) == 4 and shape[1] == 1:
            # 0.29 and later hand every layer over as (blocks, heads,
            # block_size, dim); an MLA layer has one head.
            kind, kv_dim, block_dim, kernel_dim = "mla", None, 0, 2
        else:
            raise bad("an MLA cache is (blocks, block_size, head_size), or (blocks, 1, block_size, head_size)")
    elif len(shape) == 5:
        # With kernel blocks smaller than the engine's, a tensor holds a
        # multiple of the engine's block count.
        split = shape[0] == 2 and (not num_blocks or shape[1] % num_blocks == 0)
        fused = shape[1] == 2 and (not num_blocks or shape[0] % num_blocks == 0)
        if split:
            # CPU: (2, blocks, H, block_size, D); CUDA: (2, blocks, block_size, H, D).
            kind, kv_dim, block_dim, kernel_dim = "split", 0, 1, (3 if cpu else 2)
        elif fused:
            kind, kv_dim, block_dim, kernel_dim = "fused", None, 0, 2
        else:
            raise bad("no K/V dimension of size 2 in front" + (f" of {num_blocks} blocks" if num_blocks else ""))
    elif len(shape) == 4:
        # Later releases: (blocks, H, block_size, 2 * D), K and V fused in
        # the last dimension.
        if num_blocks and shape[0] % num_blocks:
            raise bad(f"the first dimension is not a multiple of the {num_blocks} blocks")
        kind, kv_dim, block_dim, kernel_dim = "fused_rows", None, 0, 2
    else:
        raise bad("expected 5 dimensions, or 4 (K and V fused in the last), or 3 with MLA")

    kernel_block = shape[kernel_dim]
    blocks = shape[block_dim]
    inner = [d for d in range(len(shape)) if d not in (kv_dim, block_dim)]
    if kind in ("fused", "fused_rows"):
        inner = [d for d in range(len(shape)) if d != block_dim]
    block_bytes = strides[block_dim] * elem
    dense = _dense_bytes(tuple(shape[d] for d in inner), tuple(strides[d] for d in inner), elem)
    if dense is None or dense != block_bytes:
        raise bad("a block is not one contiguous run of bytes (the block dimension must be outermost after K/V)")
    if blocks == 0:
        raise bad("no blocks")
    region_len = blocks * block_bytes

    if kernel_block != block_size:
        if kernel_block == 0 or block_size % kernel_block or blocks % (block_size // kernel_block):
            raise bad(f"kernel block of {kernel_block} tokens does not divide the engine block of {block_size}")
        ratio = block_size // kernel_block
        blocks //= ratio
    regions = []
    if kv_dim is None:
        regions.append(Region(base, region_len, blocks, block_size))
    else:
        kv_bytes = strides[kv_dim] * elem
        if kv_bytes < region_len:
            raise bad("K and V overlap")
        for i in range(shape[kv_dim]):
            regions.append(Region(base + i * kv_bytes, region_len, blocks, block_size))
    return kind, regions
