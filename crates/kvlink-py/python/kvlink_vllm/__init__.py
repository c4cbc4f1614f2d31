"""kvlink as an out-of-tree KV connector for vLLM.

Select it with::

    --kv-transfer-config '{"kv_connector": "KvlinkConnector",
                           "kv_connector_module_path": "kvlink_vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}'

Importing this package starts no thread and does not import vLLM or torch;
``KvlinkConnector`` and ``KvlinkConnectorMetadata`` (from
:mod:`kvlink_vllm.connector`, which imports vLLM if it is installed) load on
first access.
"""

from __future__ import annotations

from typing import Any

from ._native import ConfigError, ForkError, KvlinkError, __version__

__all__ = [
    "ConfigError",
    "ForkError",
    "KvlinkConnector",
    "KvlinkConnectorMetadata",
    "KvlinkError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in ("KvlinkConnector", "KvlinkConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvlink_vllm' has no attribute {name!r}")
