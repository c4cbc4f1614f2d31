"""P's bootstrap server: where the routers of vLLM's Mooncake deployment
(since vLLM 0.16; ``vllm-router --kv-connector mooncake``, vLLM's proxy)
and decode instances in that flow learn a prefill instance's workers.

One server per prefill instance, on the worker vLLM's own connector
chooses (tensor- and pipeline-parallel rank 0 of the first data-parallel
engine, or of each instance's first local engine when every instance
balances its own engines), listening on the bootstrap port
(``VLLM_MOONCAKE_BOOTSTRAP_PORT``, 8998 by default) on every address;
every prefill worker registers its side channel there, where vLLM's do
(or, with ``bootstrap_server_address``, with a server outside the
instance, which then runs none).
It answers ``/query`` only once every worker has registered (503 before),
so a router never caches an empty answer. It hands out addresses, never
secrets; with a shared secret, a registration must prove it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from . import _native, logs

logger = logging.getLogger(logs.LOGGER)

#: Where the server listens: every address, as vLLM's does (routers reach
#: it at the instance's own address).
LISTEN_HOST = "0.0.0.0"


@dataclass(frozen=True)
class Placement:
    """Where a prefill worker's registration goes, as vLLM decides it."""

    #: This worker runs the instance's bootstrap server.
    hosts_server: bool
    #: The data-parallel rank its engine is listed under.
    dp_rank: int
    #: How many data-parallel engines the server lists.
    dp_size: int
    #: The host of the server this worker registers with.
    server_host: str
    #: Its port (``None``: the bootstrap port).
    server_port: int | None = None


def _local_engines_only(parallel: Any) -> bool:
    # A property of later releases; the two flags it reads exist in every
    # supported one.
    flag = getattr(type(parallel), "local_engines_only", None)
    if flag is not None:
        return bool(parallel.local_engines_only)
    return bool(getattr(parallel, "data_parallel_external_lb", False) or getattr(parallel, "data_parallel_hybrid_lb", False))


def placement(vllm_config: Any, tp_rank: int, pp_rank: int, settings: _native.Settings) -> Placement:
    """Where this worker's engine is listed and its server runs: with
    ``bootstrap_server_address`` set, every worker registers there and the
    instance runs no server of its own (as vLLM 0.32 and later do)."""
    parallel = vllm_config.parallel_config
    local = _local_engines_only(parallel)
    if local:
        dp_rank = int(getattr(parallel, "data_parallel_rank_local", 0) or 0)
        dp_size = int(getattr(parallel, "data_parallel_size_local", 1) or 1)
        host = "127.0.0.1"
    else:
        index = getattr(parallel, "data_parallel_index", None)
        dp_rank = int(index if index is not None else getattr(parallel, "data_parallel_rank", 0) or 0)
        dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
        # One engine over several nodes registers where its first rank is.
        if int(getattr(parallel, "nnodes_within_dp", 1) or 1) > 1:
            host = str(parallel.master_addr)
        else:
            host = str(getattr(parallel, "data_parallel_master_ip", "127.0.0.1"))
    external = settings.bootstrap_server_address
    if external is not None:
        return Placement(False, dp_rank, max(dp_size, 1), external[0], external[1])
    return Placement(tp_rank == 0 and pp_rank == 0 and dp_rank == 0, dp_rank, max(dp_size, 1), host)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Registrar:
    """A prefill worker's part: the server (on the worker that runs it) and
    the worker's registration."""

    def __init__(self, settings: _native.Settings, place: Placement, tp_size: int, pp_size: int):
        self.settings = settings
        self.place = place
        self.server: _native.BootstrapServer | None = None
        if place.hosts_server:
            self.server = _native.BootstrapServer(
                settings, LISTEN_HOST, settings.bootstrap_port, place.dp_size, tp_size, pp_size
            )

    def register(self, tp_rank: int, pp_rank: int, host: str, port: int) -> None:
        """Registers this worker's side channel (``host:port``): in process
        on the server's own worker, over HTTP (retried while the server is
        not up, within ``bootstrap_timeout``) from every other."""
        engine_id, dp_rank = self.settings.engine_id, self.place.dp_rank
        if self.server is not None:
            self.server.register(engine_id, dp_rank, tp_rank, pp_rank, host, port)
            return
        server_port = self.place.server_port
        url = _url(self.place.server_host, server_port if server_port is not None else self.settings.bootstrap_port)
        _native.register_with_bootstrap(
            self.settings, url, engine_id, dp_rank, tp_rank, pp_rank, host, port, self.settings.bootstrap_timeout
        )
        logger.info("kvlink worker registered with the bootstrap server %s", url)

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()
