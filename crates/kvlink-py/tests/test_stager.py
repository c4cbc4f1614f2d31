"""``Stager``'s handling of copies that fail, with a stand-in worker and
copier (no torch, no native worker): a copy whose launch raises, whose
completion raises (an asynchronous device error surfacing at the event
query) or whose wait raises (a cancelled pull's copy) is reported to the
worker as failed, never raised at the engine; failures are logged at a
bounded rate."""

from __future__ import annotations

import logging
import threading

import pytest

from kvlink_vllm import staging


class Handle:
    """``raises_on``: "done" (its first query raises), "done_late" (a later
    query raises: it ran before it errored) or "wait"."""

    def __init__(self, raises_on: str | None = None):
        self.raises_on = raises_on
        self.finished = False
        self.queries = 0

    def done(self) -> bool:
        self.queries += 1
        if self.raises_on == "done" or (self.raises_on == "done_late" and self.queries > 1):
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


class Changes:
    """The native worker's change signal (``change_count``,
    ``wait_changed``, ``wake``), for a staging thread."""

    def __init__(self):
        self._count = 0
        self._changed = threading.Condition()

    @property
    def change_count(self) -> int:
        with self._changed:
            return self._count

    def wait_changed(self, seen: int, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._count != seen, timeout=timeout_s)

    def wake(self) -> None:
        with self._changed:
            self._count += 1
            self._changed.notify_all()


class Worker(Changes):
    """What ``Stager`` calls on the native worker, recorded."""

    def __init__(self):
        super().__init__()
        self.orders: list[tuple] = []
        self.done: list[int] = []
        self.failed: list[int] = []
        self.cancel_wait: list[int] = []
        self.staging_state = (0, 4, 4)
        #: Set when a copy is reported ended (done or failed).
        self.ended = threading.Event()

    def order(self, id_: int, req: str = "r") -> None:
        self.orders.append((id_, req, "to_device", [(1, 0)]))

    def start_load_kv(self, payload: bytes) -> list[int]:
        return list(self.cancel_wait)

    def take_copies(self) -> list[tuple]:
        out, self.orders = self.orders, []
        return out

    def copies_done(self, ids: list[int]) -> None:
        self.done += ids
        self.ended.set()

    def copies_failed(self, ids: list[int]) -> None:
        self.failed += ids
        self.ended.set()

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


# ---------------------------------------------------------------------- the step vs the staging thread



class Recorded:
    """Every method call, by name, with the thread it ran on."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def _note(self, name: str) -> None:
        self.calls.append((name, threading.get_ident()))

    def on(self, thread: int) -> list[str]:
        return [name for name, t in self.calls if t == thread]


class StepWorker(Recorded, Changes):
    """The native worker's staged calls: the copies a step's metadata
    orders appear at its ``start_load_kv`` (as the native worker's do)."""

    def __init__(self):
        Recorded.__init__(self)
        Changes.__init__(self)
        self.pending: list[tuple] = []
        self.orders: list[tuple] = []
        self.done: list[int] = []
        self.failed: list[int] = []
        self.cancel_wait: list[int] = []
        self.ended = threading.Condition()

    @property
    def staging_state(self):
        return (len(self.pending) + len(self.orders), 4, 4)

    def start_load_kv(self, payload: bytes) -> list[int]:
        self._note("start_load_kv")
        self.orders, self.pending = self.orders + self.pending, []
        return list(self.cancel_wait)

    def take_copies(self) -> list[tuple]:
        self._note("take_copies")
        out, self.orders = self.orders, []
        return out

    def copies_done(self, ids: list[int]) -> None:
        self._note("copies_done")
        with self.ended:
            self.done += ids
            self.ended.notify_all()

    def copies_failed(self, ids: list[int]) -> None:
        self._note("copies_failed")
        with self.ended:
            self.failed += ids
            self.ended.notify_all()

    def pump(self) -> None:
        self._note("pump")

    def get_finished(self, finished: list[str]) -> tuple[list[str], list[str]]:
        self._note("get_finished")
        return [], []

    def wait_ended(self, id_: int) -> None:
        with self.ended:
            assert self.ended.wait_for(lambda: id_ in self.done + self.failed, timeout=10), f"copy {id_} never reported"


class StreamCopier(Recorded):
    """A copier as ``TorchCopier`` on CUDA: ``note_forward`` records an
    event (a marker) on the engine's stream; a launch makes the copy
    stream wait on the latest one, then copies each region of each run of
    blocks; ``stream`` is what the copy stream was given, in order.
    ``gate``: a launch waits for it (a launch caught in progress)."""

    def __init__(self, regions: int = 64):
        super().__init__()
        self.regions = regions
        self.after = None
        self.events: list[object] = []
        self.stream: list[tuple] = []
        self.gate = threading.Event()
        self.gate.set()
        self.launching = threading.Event()
        self.handles: dict[int, Handle] = {}

    def note_forward(self) -> None:
        self._note("note_forward")
        self.after = object()
        self.events.append(self.after)

    def launch(self, order: staging.CopyOrder) -> Handle:
        self._note("launch")
        self.launching.set()
        assert self.gate.wait(timeout=10)
        self.stream.append(("wait", order.id, self.after))
        for _start, _n, _contiguous in staging.runs(order.pairs):
            for _ in range(self.regions):
                self._note("region_copy")
                self.stream.append(("copy", order.id))
        handle = self.handles.setdefault(order.id, Handle())
        handle.finished = True
        return handle

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        pass


def to_staging(id_: int, blocks: int) -> tuple:
    # Scattered blocks into consecutive slots: one index_select + copy_ per region.
    return (id_, f"r{id_}", "to_staging", [(2 * b, b) for b in range(blocks)])


def in_thread(fn, timeout: float = 5.0) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout)
    return t


def test_the_step_records_an_event_and_the_staging_thread_launches_the_copies():
    """A request of one block and one of 500: the step makes the same calls
    (records the event, hands the metadata over, polls, reports); every
    launch and region copy runs on the staging thread, its copy stream
    waiting first on the event that step recorded."""
    worker, copier = StepWorker(), StreamCopier(regions=64)
    s = staging.Stager(worker, copier)
    step = threading.get_ident()
    try:
        on_step: dict[int, list[str]] = {}
        for id_, blocks in ((1, 1), (2, 500)):
            worker.pending.append(to_staging(id_, blocks))
            before_w, before_c = len(worker.calls), len(copier.calls)
            s.start_load_kv(b"")
            worker.wait_ended(id_)  # the staging thread launched it and saw it done
            s.get_finished([])
            calls = worker.calls[before_w:] + copier.calls[before_c:]
            on_step[blocks] = sorted(name for name, t in calls if t == step)
        assert on_step[1] == on_step[500] == sorted(["note_forward", "start_load_kv", "pump", "get_finished"])
        assert worker.done == [1, 2] and worker.failed == []
        assert copier.on(step) == ["note_forward", "note_forward"], "no launch, no region copy on the step's thread"
        staging_thread = s._thread.ident
        assert copier.on(staging_thread).count("region_copy") == 64 * 1 + 64 * 1
        assert "take_copies" not in worker.on(step)
        for id_, event in ((1, copier.events[0]), (2, copier.events[1])):
            ops = [op for op in copier.stream if op[1] == id_]
            assert ops[0] == ("wait", id_, event), "the copy stream waits on the step's event before any copy"
            assert all(op[0] == "copy" for op in ops[1:]) and len(ops) == 1 + 64
    finally:
        s.stop()


def test_the_step_never_waits_behind_a_launch():
    """A launch in progress on the staging thread (held at its gate) holds
    no lock the engine's calls take: the next step runs to its end."""
    worker, copier = StepWorker(), StreamCopier(regions=2)
    copier.gate.clear()
    s = staging.Stager(worker, copier)
    try:
        worker.pending.append(to_staging(1, 3))
        s.start_load_kv(b"")
        assert copier.launching.wait(timeout=10), "the staging thread never launched"
        worker.pending.append(to_staging(2, 3))

        def step():
            s.start_load_kv(b"")
            s.get_finished([])
            s.state()

        assert not in_thread(step).is_alive(), "the step waited for the launch"
        assert worker.done == []
        copier.gate.set()
        worker.wait_ended(1)
        worker.wait_ended(2)
        assert sorted(worker.done) == [1, 2]
    finally:
        copier.gate.set()
        s.stop()


def test_a_pull_cancelled_while_its_copy_is_launched_is_fenced_before_the_step_returns():
    """The step that cancels a pull whose copy the staging thread is
    launching waits for that launch, then for the copy, and reports it
    once (done); no byte can land after it returns."""
    worker, copier = StepWorker(), StreamCopier(regions=2)
    copier.gate.clear()
    s = staging.Stager(worker, copier)
    try:
        worker.pending.append((7, "c", "to_device", [(1, 0), (2, 1)]))
        s.start_load_kv(b"")
        assert copier.launching.wait(timeout=10)
        worker.cancel_wait = [7]
        returned = threading.Event()
        fence = threading.Thread(target=lambda: (s.start_load_kv(b""), returned.set()), daemon=True)
        fence.start()
        assert not returned.wait(0.2), "the step returned while the cancelled copy was being launched"
        copier.gate.set()
        fence.join(10)
        assert returned.is_set()
        assert copier.handles[7].finished and worker.done == [7] and worker.failed == []
        worker.cancel_wait = []
        s.get_finished([])
        s.pump()  # one more poll of the copies: nothing more is reported
        assert worker.done == [7] and s.state()["copies_in_flight"] == 0
    finally:
        copier.gate.set()
        s.stop()


def test_a_cancelled_pulls_copy_not_yet_launched_is_dropped():
    worker, copier = StepWorker(), StreamCopier(regions=2)
    s = staging.Stager(worker, copier, thread=False)
    s.hold_copies(True)
    worker.pending.append((8, "c", "to_device", [(1, 0)]))
    s.start_load_kv(b"")
    assert s.state()["copies_held"] == 1
    worker.cancel_wait = [8]
    s.start_load_kv(b"")
    s.hold_copies(False)
    assert "launch" not in copier.on(threading.get_ident()) and worker.done == [8]
    assert s.state()["copies_held"] == s.state()["copies_in_flight"] == 0


def test_a_copy_erroring_after_its_launch_on_the_staging_thread_fails_once_and_the_thread_goes_on():
    """A piece of a pull still on the wire is copied on as it landed; its
    copy errors at a later query, on the staging thread: the worker hears
    that copy failed (the native core then cuts the pull short), once; the
    thread goes on (the next copy is reported done by it) and the engine's
    next call raises nothing."""
    worker, copier = Worker(), Copier()
    worker.staging_state = (1, 2, 4)  # busy: the thread polls its copies
    late = copier.handles[1] = Handle(raises_on="done_late")
    worker.order(1, "mid-pull")
    s = staging.Stager(worker, copier)
    try:
        s.start_load_kv(b"")
        assert worker.ended.wait(timeout=10), "the staging thread never reported the copy"
        assert (worker.done, worker.failed) == ([], [1])
        assert late.queries >= 2, "it ran before it errored"
        worker.ended.clear()
        copier.handles[2] = Handle()
        copier.handles[2].finished = True
        worker.order(2, "next")
        assert worker.ended.wait(timeout=10), "the staging thread stopped"
        assert (worker.done, worker.failed) == ([2], [1]), "each copy reported once"
        assert s._thread is not None and s._thread.is_alive() and s._error is None
        assert s.get_finished([]) == ([], [])
        assert s.state()["copies_failed"] == 1 and s.state()["copies_in_flight"] == 0
    finally:
        s.stop()
