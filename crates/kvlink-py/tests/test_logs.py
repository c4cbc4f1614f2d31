"""The package's log lines inside a vLLM process (``kvlink_vllm.logs``):
each case runs in a fresh interpreter, as an engine's process is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: What vLLM's logging set-up leaves: a handler on "vllm" only (marked
#: VLLM on stdout), and here a root handler too (ROOT on stderr), so a
#: line printed twice would show.
VLLM_LIKE = """
import logging, sys
vllm = logging.getLogger("vllm")
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("VLLM %(levelname)s %(message)s"))
vllm.addHandler(handler)
vllm.setLevel(logging.INFO)
vllm.propagate = False
logging.basicConfig(stream=sys.stderr, format="ROOT %(message)s")
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=True
    )


def test_lines_go_through_vllms_handlers_once_followed():
    out = run(
        VLLM_LIKE
        + """
from kvlink_vllm import logs
logging.getLogger("kvlink_vllm").info("info before")
logs.follow_vllm()
logs.follow_vllm()
logging.getLogger("kvlink_vllm").info("info after")
logging.getLogger("kvlink_vllm").debug("debug after")
"""
    )
    # Before: an INFO line reached no handler at all (what vLLM's log lost).
    assert "info before" not in out.stdout + out.stderr
    assert out.stdout.splitlines() == ["VLLM INFO info after"], out.stdout
    assert "info after" not in out.stderr and "debug after" not in out.stdout + out.stderr


def test_a_connector_follows_vllms_logging_when_it_is_created():
    out = run(
        VLLM_LIKE
        + """
import kvlink_vllm
try:
    kvlink_vllm.KvlinkConnector(object(), None)
except Exception:
    pass  # a config this bare is refused; the logging was set up first
logging.getLogger("kvlink_vllm").info("from the package")
"""
    )
    assert out.stdout.splitlines() == ["VLLM INFO from the package"], out.stdout


def test_without_vllms_handlers_lines_propagate_as_before():
    out = run(
        """
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="ROOT %(message)s")
from kvlink_vllm import logs
logs.follow_vllm()
logging.getLogger("kvlink_vllm").info("to the root")
"""
    )
    assert out.stdout.splitlines() == ["ROOT to the root"], out.stdout
