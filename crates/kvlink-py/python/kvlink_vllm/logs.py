"""Where the package's own log lines go (logger ``kvlink_vllm``).

vLLM configures only its ``vllm`` logger (a handler of its own, its format,
``VLLM_LOGGING_LEVEL``) and leaves the root logger bare, so a plugin's
logger reaches no handler inside an engine: its INFO lines (the worker's
start-up line, what its staging holds, the extra-config keys it ignores)
were lost, and its warnings printed bare through Python's last resort.
:func:`follow_vllm` sends them through vLLM's handlers instead. kvlink's
Rust core logs on its own (stderr, ``KVLINK_LOG``).
"""

from __future__ import annotations

import logging

#: The package's logger.
LOGGER = "kvlink_vllm"
#: vLLM's logger, whose handlers the package's lines go through.
VLLM_LOGGER = "vllm"


def follow_vllm() -> None:
    """Inside a vLLM process: the package's lines go through vLLM's own
    handlers, at vLLM's level, and not on to the root logger (no line
    twice). Where vLLM installed no handler (``VLLM_CONFIGURE_LOGGING=0``,
    or no vLLM), nothing changes: lines propagate to whatever the
    application configured. Idempotent."""
    ours = logging.getLogger(LOGGER)
    theirs = logging.getLogger(VLLM_LOGGER)
    if not theirs.handlers:
        return
    for handler in theirs.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False
