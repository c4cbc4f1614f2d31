"""The CUDA branch of ``staging.TorchCopier`` (gathers into pinned
staging, scatters back, one event per copy, every copy after the engine's
stream) driven with CPU tensors: streams, events and pinning are stand-ins,
the indexing and the copies are torch's own. What a GPU adds (asynchrony,
DMA) is ``python -m kvlink_vllm.gpu_check``'s to show.

Needs PyTorch: skipped where torch is absent (the ``python`` CI step); the
``vllm-check:<release>`` steps run it (vllm_check/test_vllm_scheduler.py
imports it).
"""

from __future__ import annotations

import contextlib
import random

import pytest


class FakeEvent:
    recorded: list = []

    def record(self, stream=None):
        FakeEvent.recorded.append(stream)

    def query(self):
        return True

    def synchronize(self):
        pass


class FakeStream:
    def __init__(self, device=None):
        self.waited: list = []

    def wait_event(self, event):
        self.waited.append(event)

    def synchronize(self):
        pass


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((2, 20, 2, 16, 8), id="split"),
        pytest.param((20, 2, 16, 16), id="fused"),
        pytest.param((20, 16, 24), id="mla"),
    ],
)
def test_torch_copier_cuda_path_on_cpu_tensors(monkeypatch, shape):
    torch = pytest.importorskip("torch")
    from kvlink_vllm import layout, staging

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: "engine stream")
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    blocks_in_cache, block = 20, 16
    caches = {f"l{i}": torch.randn(shape, dtype=torch.float16) for i in range(3)}
    cache = layout.describe(caches, block, use_mla=len(shape) == 3, num_blocks=blocks_in_cache)
    regions = sum(len(r) for _, r in cache.layers)
    plan = staging.plan(cache, 6 * cache.block_len * regions)
    assert plan.slots == 6
    copier = staging.TorchCopier(caches, cache, plan, torch)
    copier.cuda, copier.stream = True, FakeStream()  # the CUDA branch, on CPU tensors
    copier.note_forward()
    assert FakeEvent.recorded[-1] == "engine stream"
    rng = random.Random(5)
    for trial in range(40):
        n = rng.randint(1, plan.slots)
        blocks = rng.sample(range(blocks_in_cache), n)
        # Contiguous slots (one run) and scattered ones (runs of one).
        slots = list(range(n)) if trial % 2 == 0 else sorted(rng.sample(range(plan.slots), n))
        if trial % 5 == 0:
            start = rng.randint(0, blocks_in_cache - n)
            blocks = list(range(start, start + n))  # consecutive blocks: plain slices
        handle = copier.launch(staging.CopyOrder(2 * trial, "r", "to_staging", tuple(zip(blocks, slots))))
        assert handle.done()
        for view, staged in zip(copier.views, copier.staging):
            assert torch.equal(staged[slots], view[blocks])
        into = rng.sample(range(blocks_in_cache), n)
        before = [v.clone() for v in copier.views]
        handle = copier.launch(staging.CopyOrder(2 * trial + 1, "r", "to_device", tuple(zip(into, slots))))
        handle.wait()
        for view, old, staged in zip(copier.views, before, copier.staging):
            assert torch.equal(view[into], staged[slots])
            others = [b for b in range(blocks_in_cache) if b not in into]
            assert torch.equal(view[others], old[others]), "no other block written"
    # Every copy waited for the engine's stream first.
    assert len(copier.stream.waited) == 80
    with pytest.raises(Exception, match="out of range"):
        copier.launch(staging.CopyOrder(999, "r", "to_device", ((blocks_in_cache, 0),)))


def test_index_buffers_are_pinned_once_and_reused(monkeypatch):
    """A launch gathering scattered blocks uploads their ids from a pinned
    buffer of the copier's pool (one pinned allocation, reused once each
    copy completed, grown for a longer order), not a ``pin_memory()`` per
    launch; consecutive blocks need no index at all. Every copy waits on
    the event the step recorded last."""
    torch = pytest.importorskip("torch")
    from kvlink_vllm import layout, staging

    pinned: list[int] = []

    def pin(self):
        pinned.append(self.numel())
        return self

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: "engine stream")
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    caches = {f"l{i}": torch.randn((2, 20, 2, 16, 8), dtype=torch.float16) for i in range(2)}
    cache = layout.describe(caches, 16, use_mla=False, num_blocks=20)
    regions = sum(len(r) for _, r in cache.layers)
    plan = staging.plan(cache, 12 * cache.block_len * regions)
    copier = staging.TorchCopier(caches, cache, plan, torch)
    copier.cuda, copier.stream = True, FakeStream()
    copier.note_forward()
    step_event = copier._after_forward
    scattered = ((5, 0), (2, 1), (9, 2))
    for id_ in range(4):
        handle = copier.launch(staging.CopyOrder(id_, "r", "to_staging", scattered))
        assert handle.done()
        for view, staged in zip(copier.views, copier.staging):
            assert torch.equal(staged[[0, 1, 2]], view[[5, 2, 9]])
    assert pinned == [staging.INDEX_MIN_LEN] and copier.index_buffers_allocated == 1, "one pinned buffer, reused"
    copier.launch(staging.CopyOrder(10, "r", "to_staging", ((3, 0), (4, 1)))).wait()
    assert copier.index_buffers_allocated == 1, "consecutive blocks: no index"
    long = tuple((b, s) for s, b in enumerate(reversed(range(12))))
    copier.launch(staging.CopyOrder(11, "r", "to_staging", long)).wait()
    assert copier.index_buffers_allocated == 1, "still fits"
    assert copier.stream.waited == [step_event] * 6, "every copy after the step's event"
