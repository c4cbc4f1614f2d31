//! The keys `kv_connector_extra_config` may hold: kvlink's own, each with
//! what it accepts (the one list the docs, the errors and the vLLM
//! package's `known_keys` read), and those vLLM's own P/D connectors read,
//! which kvlink accepts and ignores.

/// kvlink's keys of `kv_connector_extra_config`, with what each accepts.
/// Each is a field of the parser's `ExtraConfig` (a unit test keeps the two
/// in step); any other key that is not in [`FOREIGN_KEYS`] is refused.
pub const EXTRA_KEYS: &[(&str, &str)] = &[
    ("mooncake_protocol", "\"tcp\", \"quic\" or \"rdma\" (default: \"rdma\" if compiled in, else \"tcp\")"),
    ("num_workers", "transfers a prefill worker runs at once, 1..=4096 (default 10)"),
    ("queue_depth", "transfer requests a prefill worker admits at once, 1..=65536 (default 4 x num_workers)"),
    ("transfer_timeout", "seconds a decode worker waits for one pull (default 60)"),
    ("connect_timeout", "seconds for connecting and the hello exchange (default 5)"),
    (
        "bootstrap_server_address",
        "\"host:port\" of a bootstrap server a prefill instance's workers register with, instead of the one it runs itself on the bootstrap port (vLLM 0.32's key for its external bootstrap server)",
    ),
    (
        "bootstrap_timeout",
        "seconds a prefill worker tries to register its side channel with its instance's bootstrap server, and a decode worker waits for a bootstrap server's answer (default 30)",
    ),
    (
        "lease_renewal",
        "seconds a prefill worker holds a finished request past a decode instance's last renewal, capped by the abort timeout; 0 turns renewals off (default 10)",
    ),
    ("auth_secret_file", "path of a file holding the shared secret of the side channel and the data plane"),
    (
        "tcp_authenticate_payloads",
        "true or false: on the TCP data plane, tag every batch's payload too, and require it of senders; needs auth_secret_file (QUIC's TLS covers its payloads already; RDMA's are not tagged) (default false)",
    ),
    ("advertised_host", "host name or address peers use to reach this instance (default: this host's IP)"),
    ("bind_host", "address the listeners bind (default: advertised_host if it is an IP address, else 0.0.0.0)"),
    (
        "host_staging",
        "\"auto\" (KV of a cache outside host memory, a CUDA cache, moves through pinned host staging), \"always\" (a host cache too) or \"never\" (default \"auto\")",
    ),
    (
        "staging_bytes",
        "bytes of pinned host staging per worker, a whole number from 1 to 2^50, at least one block of every layer; capped at the cache's own size (default 4294967296, 4 GiB)",
    ),
    ("staging_wait", "seconds a transfer waits for free staging slots before it fails (default: transfer_timeout)"),
    (
        "staging_piece_bytes",
        "bytes of KV per piece a staged request is copied and sent in, so the copies and the wire overlap within one request; 0: whole requests, a whole number up to 2^50 (default 33554432, 32 MiB)",
    ),
    (
        "side_channel_max_handshakes",
        "side-channel connections a prefill worker holds in their hello at once, 1..=65536 (default 64)",
    ),
    (
        "side_channel_max_handshakes_per_host",
        "of those, from one source address, 1..=65536 (default 16); every peer behind one NAT or pod address shares them",
    ),
    (
        "side_channel_max_connections",
        "established side-channel connections a prefill worker serves, 0..=1048576; 0 refuses every decode instance (default 512)",
    ),
    (
        "data_max_handshakes",
        "data-plane connections (TCP, QUIC, RDMA control) a worker holds in their handshake at once, 1..=65536 (default 64)",
    ),
    (
        "data_max_handshakes_per_host",
        "of those, from one source address, 1..=65536 (default 16); every peer behind one NAT or pod address shares them",
    ),
    (
        "data_max_connections",
        "established data-plane connections a worker serves, 0..=1048576; 0 refuses every sender (default 1024)",
    ),
    (
        "side_channel_handshake_timeout",
        "seconds an incoming side-channel connection has for its whole hello (and authentication), from accept, > 0 (default 10)",
    ),
    (
        "data_handshake_timeout",
        "seconds an incoming data-plane connection has for its whole handshake (and authentication), from accept, > 0 (default 10)",
    ),
];

/// Keys vLLM's own P/D connectors define in `kv_connector_extra_config`,
/// with the connector that reads each: accepted and ignored (the caller
/// logs them once), so a deployment switches connector by `kv_connector`
/// alone. `mooncake_protocol` and `num_workers`, `MooncakeConnector`'s, are
/// kvlink's own keys too (and `transfer_timeout`, also MoRIIO's). vLLM
/// 0.14's and 0.32's keys.
pub const FOREIGN_KEYS: &[(&str, &str)] = &[
    ("backends", "NixlConnector"),
    ("num_threads", "NixlConnector"),
    ("enforce_handshake_compat", "NixlConnector"),
    ("kv_lease_duration", "NixlConnector"),
    ("kv_recompute_threshold", "NixlConnector"),
    ("bidirectional_kv_xfer", "NixlConnector"),
    ("decoder_kv_blocks_ttl", "NixlConnector"),
    ("push_registration_timeout", "NixlConnector"),
    ("engine_ttl", "NixlConnector"),
    ("device_name", "MooncakeConnector"),
    ("proxy_ip", "P2pNcclConnector, MoRIIOConnector"),
    ("proxy_port", "P2pNcclConnector"),
    ("http_port", "P2pNcclConnector, MoRIIOConnector"),
    ("send_type", "P2pNcclConnector"),
    ("mem_pool_size_gb", "P2pNcclConnector"),
    ("nccl_num_channels", "P2pNcclConnector"),
    ("proxy_ping_port", "MoRIIOConnector"),
    ("handshake_port", "MoRIIOConnector"),
    ("notify_port", "MoRIIOConnector"),
    ("backend", "MoRIIOConnector"),
    ("host_ip", "MoRIIOConnector"),
    ("defer_timeout", "MoRIIOConnector"),
    ("post_batch_size", "MoRIIOConnector"),
    ("qp_per_transfer", "MoRIIOConnector"),
    ("read_mode", "MoRIIOConnector"),
    ("recv_abort_timeout", "MoRIIOConnector"),
];

/// What [`EXTRA_KEYS`] says `key` accepts ("" for a key it does not list).
pub(super) fn accepted(key: &str) -> &'static str {
    EXTRA_KEYS.iter().find(|(k, _)| *k == key).map_or("", |(_, a)| a)
}

/// The connector that reads `key`, if it is one of [`FOREIGN_KEYS`].
pub(super) fn foreign(key: &str) -> Option<&'static str> {
    FOREIGN_KEYS.iter().find(|(k, _)| *k == key).map(|(_, by)| *by)
}

/// Whether `key` is one of kvlink's [`EXTRA_KEYS`].
pub(super) fn is_known(key: &str) -> bool {
    EXTRA_KEYS.iter().any(|(k, _)| *k == key)
}
