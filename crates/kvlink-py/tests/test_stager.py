"""``Stager``'s handling of copies that fail, with a stand-in worker and
copier (no torch, no native worker): a copy whose launch raises, whose
completion raises (an asynchronous device error surfacing at the event
query) or whose wait raises (a cancelled pull's copy) is reported to the
worker as failed, never raised at the engine; failures are logged at a
bounded rate."""

from __future__ import annotations

import logging

import pytest

from kvlink_vllm import staging


class Handle:
    def __init__(self, raises_on: str | None = None):
        self.raises_on = raises_on
        self.finished = False

    def done(self) -> bool:
        if self.raises_on == "done":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.finished

    def wait(self) -> None:
        if self.raises_on == "wait":
            raise RuntimeError("CUDA error: device-side assert triggered")
        self.finished = True


class Copier:
    """Launches copies as told: ``raises`` makes a launch raise,
    ``handles`` maps a copy id to the handle its launch returns."""

    def __init__(self):
        self.raises: set[int] = set()
        self.handles: dict[int, Handle] = {}
        self.launched: list[int] = []

    def note_forward(self) -> None:
        pass

    def launch(self, order: staging.CopyOrder) -> Handle:
        if order.id in self.raises:
            raise RuntimeError("CUDA error: out of memory")
        self.launched.append(order.id)
        return self.handles.setdefault(order.id, Handle())

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        pass


class Worker:
    """What ``Stager`` calls on the native worker, recorded."""

    def __init__(self):
        self.orders: list[tuple] = []
        self.done: list[int] = []
        self.failed: list[int] = []
        self.cancel_wait: list[int] = []
        self.staging_state = (0, 4, 4)

    def order(self, id_: int, req: str = "r") -> None:
        self.orders.append((id_, req, "to_device", [(1, 0)]))

    def start_load_kv(self, payload: bytes) -> list[int]:
        return list(self.cancel_wait)

    def take_copies(self) -> list[tuple]:
        out, self.orders = self.orders, []
        return out

    def copies_done(self, ids: list[int]) -> None:
        self.done += ids

    def copies_failed(self, ids: list[int]) -> None:
        self.failed += ids

    def pump(self) -> None:
        pass

    def get_finished(self, finished: list[str]) -> tuple[list[str], list[str]]:
        return [], []


def stager() -> tuple[staging.Stager, Worker, Copier]:
    worker, copier = Worker(), Copier()
    return staging.Stager(worker, copier, thread=False), worker, copier


def test_a_launch_that_raises_fails_the_copy_not_the_step():
    s, worker, copier = stager()
    copier.raises.add(1)
    worker.order(1)
    worker.order(2)
    s.start_load_kv(b"")
    assert (worker.failed, copier.launched) == ([1], [2]), "the next copy still runs"
    copier.handles[2].finished = True
    s.get_finished([])
    assert worker.done == [2]
    assert s.state()["copies_failed"] == 1 and s.state()["copies_in_flight"] == 0


def test_a_copy_whose_completion_raises_is_reported_failed():
    s, worker, copier = stager()
    copier.handles[3] = Handle(raises_on="done")
    worker.order(3)
    s.start_load_kv(b"")
    s.pump()
    assert worker.failed == [3] and worker.done == []
    assert s.state()["copies_in_flight"] == 0


def test_a_cancelled_pulls_copy_that_fails_while_waited_for_is_reported_failed():
    s, worker, copier = stager()
    copier.handles[4] = Handle(raises_on="wait")
    copier.handles[5] = Handle()
    worker.order(4)
    worker.order(5)
    s.start_load_kv(b"")
    worker.cancel_wait = [4, 5]
    s.start_load_kv(b"")
    assert (worker.failed, worker.done) == ([4], [5]), "each reported once, the failed one as failed"


def test_an_injected_failure_fails_exactly_that_many_copies():
    s, worker, copier = stager()
    s.fail_copies(2)
    for id_ in (1, 2, 3):
        worker.order(id_)
    s.start_load_kv(b"")
    assert worker.failed == [1, 2] and copier.launched == [3]


def test_failed_copies_are_logged_at_a_bounded_rate(caplog, monkeypatch):
    s, worker, copier = stager()
    copier.raises.update(range(1, 6))
    clock = [1000.0]
    monkeypatch.setattr(staging.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="kvlink_vllm"):
        for id_ in range(1, 5):
            worker.order(id_)
        s.start_load_kv(b"")
        clock[0] += staging.COPY_FAILURE_LOG_S
        worker.order(5)
        s.start_load_kv(b"")
    lines = [r.getMessage() for r in caplog.records if "staging copy failed" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "1 failed copies since the last line" in lines[0]
    assert "4 failed copies since the last line" in lines[1], "the held-back ones are counted"
    assert worker.failed == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("held", [True, False])
def test_nothing_is_raised_at_the_engine(held):
    s, worker, copier = stager()
    s.hold_copies(held)
    copier.raises.add(1)
    worker.order(1)
    s.start_load_kv(b"")
    s.hold_copies(False)
    s.get_finished([])
    assert worker.failed == [1]
