"""What the run measured: per-phase timings and figures (TTFT), printed in
pytest's summary and written as JSON next to the engines' logs."""

from __future__ import annotations

import contextlib
import time

#: (phase, seconds), in the order run.
TIMINGS: list[tuple[str, float]] = []
#: Named figures (JSON-serialisable).
FIGURES: dict[str, object] = {}


@contextlib.contextmanager
def phase(name: str):
    started = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - started
        TIMINGS.append((name, seconds))
        print(f"engine-test: {name}: {seconds:.1f} s", flush=True)
