"""pytest plugin: writes what the run counted, one ``name=N`` per line
(passed, failed, error, skipped, deselected), to ``$KVLINK_PYTEST_COUNTS``
at the end of the session; ``cargo xtask vllm-matrix`` builds its table
from these files. Without the variable it does nothing."""

from __future__ import annotations

import os

import pytest

COUNTED = ("passed", "failed", "error", "skipped", "deselected")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    path = os.environ.get("KVLINK_PYTEST_COUNTS")
    if not path:
        return
    # The categories of pytest's own closing line ("3 passed, 2 deselected").
    counts = {name: len(terminalreporter.stats.get(name, [])) for name in COUNTED}
    with open(path, "w") as f:
        f.write("".join(f"{name}={n}\n" for name, n in counts.items()))
