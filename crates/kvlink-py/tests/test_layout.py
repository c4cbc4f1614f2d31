"""KV cache layouts read from tensor shapes and strides (no torch)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvsim import FakeTensor

from kvlink_vllm import ConfigError, adapter, layout

N, B, H, D, E = 10, 16, 4, 8, 2
BASE = 0x10000000


def t(shape, device="cpu", strides=None, addr=BASE):
    return FakeTensor(None, addr, shape, E, device, strides)


def test_cpu_backend_split_layout():
    # vLLM's CPU backend: (2, blocks, heads, block_size, head_dim).
    c = layout.describe({"l0": t((2, N, H, B, D)), "l1": t((2, N, H, B, D), addr=BASE + 10**8)}, B, num_blocks=N)
    assert c.kind == "split" and c.block_len == H * B * D * E
    (_, (k, v)), (_, (k1, _)) = c.layers
    assert (k.addr, v.addr, k1.addr) == (BASE, BASE + N * c.block_len, BASE + 10**8)
    assert k.num_blocks == N and k.length == N * c.block_len and k.block_size == B


def test_cuda_flash_attention_layout_and_hnd_strides():
    # FlashAttention: (2, blocks, block_size, heads, head_dim); block size is dim 2.
    c = layout.describe({"l0": t((2, N, B, H, D), device="cuda")}, B)
    assert c.kind == "split" and c.block_len == B * H * D * E
    # HND: same logical shape, physical order (2, blocks, heads, block_size, head_dim).
    hnd = (N * H * B * D, H * B * D, D, B * D, 1)
    c = layout.describe({"l0": t((2, N, B, H, D), device="cuda", strides=hnd)}, B)
    assert c.block_len == B * H * D * E


def test_flashinfer_fused_and_mla_layouts():
    c = layout.describe({"l0": t((N, 2, B, H, D), device="cuda")}, B, num_blocks=N)
    assert c.kind == "fused" and c.block_len == 2 * B * H * D * E and len(c.layers[0][1]) == 1
    c = layout.describe({"l0": t((N, B, 576))}, B, use_mla=True)
    assert c.kind == "mla" and c.block_len == B * 576 * E


def test_mla_as_later_releases_hand_it_over_with_one_head():
    # 0.29 and later: every layer as (blocks, heads, block_size, dim), MLA with one head.
    c = layout.describe({"l0": t((N, 1, B, 576)), "l1": t((N, 1, B, 576), addr=BASE + 10**8)}, B, use_mla=True)
    assert c.kind == "mla" and c.block_len == B * 576 * E
    (_, (r0,)), (_, (r1,)) = c.layers
    assert (r0.addr, r0.length, r0.num_blocks, r1.addr) == (BASE, N * B * 576 * E, N, BASE + 10**8)
    assert (c.token_layout, c.block_heads) == ("NHD", 1)
    # Kernel blocks of half the engine's block.
    c = layout.describe({"l0": t((N, 1, B, 576))}, 2 * B, use_mla=True)
    assert c.layers[0][1][0].num_blocks == N // 2 and c.block_len == 2 * B * 576 * E
    # More than one head is not MLA; nor is a block that is not one run.
    with pytest.raises(ConfigError, match="MLA cache is"):
        layout.describe({"l0": t((N, 2, B, 576))}, B, use_mla=True)
    with pytest.raises(ConfigError, match="contiguous"):
        layout.describe({"l0": t((N, 1, B, 576), strides=(576, N * B * 576, N * 576, 1))}, B, use_mla=True)


def test_later_releases_fused_kv_in_the_last_dimension():
    # vLLM 0.32's CPU backend: (blocks, heads, block_size, 2 * head_dim).
    c = layout.describe({"l0": t((N, H, B, 2 * D)), "l1": t((N, H, B, 2 * D), addr=BASE + 10**8)}, B, num_blocks=N)
    assert c.kind == "fused_rows" and c.block_len == H * B * 2 * D * E
    (_, (r0,)), (_, (r1,)) = c.layers
    assert (r0.addr, r1.addr) == (BASE, BASE + 10**8)
    assert r0.num_blocks == N and r0.length == N * c.block_len and r0.block_size == B
    # Kernel blocks of half the engine's block.
    c = layout.describe({"l0": t((N, H, B, 2 * D))}, 2 * B, num_blocks=N // 2)
    assert c.layers[0][1][0].num_blocks == N // 2 and c.block_len == 2 * H * B * 2 * D * E
    # A block dimension that does not hold the engine's blocks, and heads
    # outside blocks (physical (heads, blocks, block_size, 2 * head_dim)).
    with pytest.raises(ConfigError, match="multiple of the 3 blocks"):
        layout.describe({"l0": t((N, H, B, 2 * D))}, B, num_blocks=3)
    heads_outer = (B * 2 * D, N * B * 2 * D, 2 * D, 1)
    with pytest.raises(ConfigError, match="contiguous"):
        layout.describe({"l0": t((N, H, B, 2 * D), strides=heads_outer)}, B, num_blocks=N)


def test_kernel_blocks_smaller_than_engine_blocks_are_grouped():
    # vLLM splits each 32-token block into two 16-token kernel blocks: the
    # tensor holds twice kv_cache_config.num_blocks.
    c = layout.describe({"l0": t((2, N, H, B, D))}, 2 * B, num_blocks=N // 2)
    (_, (k, _)), = c.layers
    assert k.num_blocks == N // 2 and c.block_len == 2 * H * B * D * E and k.block_size == 2 * B


def test_unreadable_layouts_are_errors_naming_the_layer():
    # Heads outside blocks (physical (2, heads, blocks, block_size, head_dim)): a
    # block is not one contiguous run.
    heads_outer = (H * N * B * D, B * D, N * B * D, D, 1)
    with pytest.raises(ConfigError, match="layer 'l0'.*contiguous"):
        layout.describe({"l0": t((2, N, H, B, D), strides=heads_outer)}, B)
    with pytest.raises(ConfigError, match="kernel block"):
        layout.describe({"l0": t((2, N, H, 12, D))}, B)
    with pytest.raises(ConfigError, match="5 dimensions"):
        layout.describe({"l0": t((N, B, D))}, B)


@pytest.mark.parametrize(
    ("devices", "host_staging", "named"),
    [
        # Staging forbidden: a CUDA cache is out of the transport's reach.
        (["cuda"], "never", ["cuda", "host_staging", "CPU backend", "tcp"]),
        # A device kvlink does not stage.
        (["xpu"], "auto", ["xpu", "CUDA", "CPU backend"]),
        # CUDA memory that is not a torch tensor: nothing to copy it with.
        (["cuda"], "auto", ["cuda", "torch"]),
        # Layers on different devices.
        (["cpu", "cuda"], "auto", ["different devices", "cpu", "cuda"]),
    ],
)
def test_a_cache_kvlink_cannot_handle_is_a_startup_error_naming_the_device(devices, host_staging, named):
    settings = adapter.settings_from_transfer_config(
        SimpleNamespace(
            kv_role="kv_consumer",
            engine_id="d",
            kv_connector_extra_config={"mooncake_protocol": "tcp", "host_staging": host_staging},
        )
    )
    side = adapter.WorkerSide(settings, "127.0.0.1", block_size=B)
    caches = {f"model.layers.{i}.attn": t((2, N, B, H, D), device=d, addr=BASE + i * 10**8) for i, d in enumerate(devices)}
    with pytest.raises(ConfigError) as e:
        side.register_kv_caches(caches)
    text = str(e.value)
    assert "model.layers.0.attn" in text, text
    for word in named:
        assert word in text, (word, text)
    assert side._worker is None and side.stager is None


@pytest.mark.parametrize(
    "shape, device, strides, use_mla, block_size, expected",
    [
        # CPU backend (2, blocks, heads, block_size, head_size): head-major.
        ((2, N, H, B, D), "cpu", None, False, B, ("HND", "HND", H)),
        # FlashAttention (2, blocks, block_size, heads, head_size): token-major.
        ((2, N, B, H, D), "cuda", None, False, B, ("NHD", "NHD", H)),
        # The same logical shape laid out head-major by its strides.
        ((2, N, B, H, D), "cuda", (N * H * B * D, H * B * D, D, B * D, 1), False, B, ("HND", "HND", H)),
        # FlashInfer (blocks, 2, block_size, heads, head_size): K then V, token-major.
        ((N, 2, B, H, D), "cuda", None, False, B, ("NHD", "NHD", H)),
        # Later releases: K and V of a row side by side, head-major; a row
        # of K and V is one head row.
        ((N, H, B, 2 * D), "cpu", None, False, B, ("HND", "HND", H)),
        # The same with tokens outermost.
        ((N, H, B, 2 * D), "cpu", (H * B * 2 * D, 2 * D, H * 2 * D, 1), False, B, ("NHD", "NHD", H)),
        # MLA: one latent per token.
        ((N, B, 576), "cpu", None, True, B, ("NHD", "NHD", 1)),
        ((N, 1, B, 576), "cuda", None, True, B, ("NHD", "NHD", 1)),
        # Two kernel blocks per engine block: rows stay token-major (NHD), a
        # head's tokens are no longer one run (HND).
        ((2, N, B, H, D), "cuda", None, False, 2 * B, ("NHD", "NHD", H)),
        ((2, N, H, B, D), "cpu", None, False, 2 * B, ("HND", "", 0)),
        ((N, H, B, 2 * D), "cpu", None, False, 2 * B, ("HND", "", 0)),
    ],
)
def test_token_order_and_heads_are_read_from_the_strides(shape, device, strides, use_mla, block_size, expected):
    c = layout.describe({"l0": t(shape, device=device, strides=strides)}, block_size, use_mla=use_mla)
    assert (c.attention_layout, c.token_layout, c.block_heads) == expected
    assert c.dtype_bytes == E


def _permuted(logical: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a tensor allocated as ``logical`` permuted by ``order``
    (vLLM's stride order: the physical dimension order) and viewed back in
    the logical order."""
    physical = [logical[d] for d in order]
    strides_physical, acc = [0] * len(order), 1
    for i in reversed(range(len(order))):
        strides_physical[i] = acc
        acc *= physical[i]
    strides = [0] * len(order)
    for i, d in enumerate(order):
        strides[d] = strides_physical[i]
    return tuple(strides)


@pytest.mark.parametrize(
    "releases, backend, device, shape, order, use_mla, kind, attention",
    [
        ("0.14-0.22", "FlashAttention NHD", "cuda", (2, N, B, H, D), (0, 1, 2, 3, 4), False, "split", "NHD"),
        ("0.14-0.22", "FlashAttention HND", "cuda", (2, N, B, H, D), (0, 1, 3, 2, 4), False, "split", "HND"),
        ("0.14-0.22", "CPU", "cpu", (2, N, H, B, D), (0, 1, 2, 3, 4), False, "split", "HND"),
        ("0.14-0.25", "FlashInfer NHD", "cuda", (N, 2, B, H, D), (0, 1, 2, 3, 4), False, "fused", "NHD"),
        ("0.14-0.25", "FlashInfer HND", "cuda", (N, 2, B, H, D), (0, 1, 3, 2, 4), False, "fused", "HND"),
        ("0.23-0.25", "FlashAttention, Triton NHD", "cuda", (N, 2, B, H, D), (0, 1, 2, 3, 4), False, "fused", "NHD"),
        ("0.23-0.25", "FlashAttention, Triton HND", "cuda", (N, 2, B, H, D), (0, 1, 3, 2, 4), False, "fused", "HND"),
        ("0.23-0.34", "CPU", "cpu", (N, H, B, 2 * D), (0, 1, 2, 3), False, "fused_rows", "HND"),
        ("0.26-0.34", "FlashAttention, FlashInfer, Triton NHD", "cuda", (N, H, B, 2 * D), (0, 2, 1, 3), False,
         "fused_rows", "NHD"),
        ("0.26-0.34", "FlashInfer HND", "cuda", (N, H, B, 2 * D), (0, 1, 2, 3), False, "fused_rows", "HND"),
        ("0.14-0.28", "MLA", "cuda", (N, B, 576), (0, 1, 2), True, "mla", "NHD"),
        ("0.29-0.34", "MLA", "cuda", (N, 1, B, 576), (0, 1, 2, 3), True, "mla", "NHD"),
    ],
)  # fmt: skip
def test_each_releases_backend_layouts(releases, backend, device, shape, order, use_mla, kind, attention):
    """What ``register_kv_caches`` is handed by each attention backend, in
    the releases that use the shape (read in their sources): one layout
    each, the block contiguous, the order read from the strides."""
    tensor = t(shape, device=device, strides=_permuted(shape, order))
    c = layout.describe({"l0": tensor}, B, use_mla=use_mla, num_blocks=N)
    assert (c.kind, c.attention_layout) == (kind, attention), (releases, backend)
    assert c.token_layout == attention and c.layers[0][1][0].num_blocks == N
