//! kvlink's settings as vLLM passes them: `--kv-transfer-config` (role,
//! engine id, `kv_connector_extra_config`) plus the reference's environment
//! variables. Every key of `kv_connector_extra_config` is known here: kvlink's
//! own, or one of vLLM's own connectors' (ignored); any other is an error
//! naming it.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use kv_proto::auth::AuthSecret;
use kv_proto::KvTransferConfig;
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The keys `kv_connector_extra_config` may hold, with what each accepts.
pub(crate) const EXTRA_KEYS: &[(&str, &str)] = &[
    ("mooncake_protocol", "\"tcp\", \"quic\" or \"rdma\" (default: \"rdma\" if compiled in, else \"tcp\")"),
    ("num_workers", "transfers a prefill worker runs at once, 1..=4096 (default 10)"),
    ("queue_depth", "transfer requests a prefill worker admits at once, 1..=65536 (default 4 x num_workers)"),
    ("transfer_timeout", "seconds a decode worker waits for one pull (default 60)"),
    ("connect_timeout", "seconds for connecting and the hello exchange (default 5)"),
    (
        "lease_renewal",
        "seconds a prefill worker holds a finished request past a decode instance's last renewal, capped by the abort timeout; 0 turns renewals off (default 10)",
    ),
    ("auth_secret_file", "path of a file holding the shared secret of the side channel and TCP data plane"),
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
];

/// `staging_bytes` when none is given: 4 GiB.
pub(crate) const DEFAULT_STAGING_BYTES: u64 = 4 << 30;

/// The largest `staging_bytes` accepted (1 PiB).
const MAX_STAGING_BYTES: u64 = 1 << 50;

/// `host_staging`: when a worker moves KV through host staging.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum HostStaging {
    /// Iff the KV cache is not in host memory.
    #[default]
    Auto,
    /// Always, a host cache too.
    Always,
    /// Never: a cache outside host memory is a start-up error.
    Never,
}

impl HostStaging {
    /// The setting's name in `kv_connector_extra_config`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            HostStaging::Auto => "auto",
            HostStaging::Always => "always",
            HostStaging::Never => "never",
        }
    }
}

/// Keys vLLM's own P/D connectors define in `kv_connector_extra_config`,
/// with the connector that reads each: accepted and ignored (the caller logs
/// them once), so a deployment switches connector by `kv_connector` alone.
/// `mooncake_protocol` and `num_workers`, `MooncakeConnector`'s, are kvlink's
/// own keys too (and `transfer_timeout`, also MoRIIO's). vLLM 0.14's and
/// 0.32's keys.
pub(crate) const FOREIGN_KEYS: &[(&str, &str)] = &[
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
    ("bootstrap_server_address", "MooncakeConnector"),
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

/// Parsed settings of one engine instance.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    /// Role, engine id, protocol, `num_workers`, bootstrap port, abort timeout.
    pub(crate) transfer: KvTransferConfig,
    /// `queue_depth`.
    pub(crate) queue_depth: Option<usize>,
    /// `transfer_timeout`.
    pub(crate) transfer_timeout: Option<Duration>,
    /// `connect_timeout`.
    pub(crate) connect_timeout: Option<Duration>,
    /// `lease_renewal` (zero: off).
    pub(crate) lease_renewal: Option<Duration>,
    /// The secret read from `auth_secret_file`.
    pub(crate) auth_secret: Option<AuthSecret>,
    /// `auth_secret_file` itself (for messages).
    pub(crate) auth_secret_file: Option<PathBuf>,
    /// `advertised_host`.
    pub(crate) advertised_host: Option<String>,
    /// `bind_host`.
    pub(crate) bind_host: Option<IpAddr>,
    /// `host_staging`.
    pub(crate) host_staging: HostStaging,
    /// `staging_bytes` (default applied).
    pub(crate) staging_bytes: u64,
    /// `staging_wait` (`None`: the worker's transfer timeout).
    pub(crate) staging_wait: Option<Duration>,
    /// Keys of other vLLM connectors that were given and are ignored, with
    /// the connector that reads each.
    pub(crate) ignored: Vec<(String, &'static str)>,
}

fn key(name: &str) -> String {
    format!("kv_connector_extra_config.{name}")
}

fn accepted(name: &str) -> &'static str {
    EXTRA_KEYS.iter().find(|(k, _)| *k == name).map_or("", |(_, a)| a)
}

fn invalid(name: &str, given: &Value) -> Error {
    Error::Config(format!("kv-transfer-config: {} = {given} is invalid; accepted: {}", key(name), accepted(name)))
}

fn seconds(extra: &Map<String, Value>, name: &str) -> Result<Option<Duration>> {
    match extra.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e7)
            .map(|s| Some(Duration::from_secs_f64(s)))
            .ok_or_else(|| invalid(name, v)),
    }
}

/// Like [`seconds`], but zero is accepted (it turns the feature off).
fn seconds_or_zero(extra: &Map<String, Value>, name: &str) -> Result<Option<Duration>> {
    match extra.get(name) {
        Some(v) if v.as_f64() == Some(0.0) => Ok(Some(Duration::ZERO)),
        _ => seconds(extra, name),
    }
}

fn text<'a>(extra: &'a Map<String, Value>, name: &str) -> Result<Option<&'a str>> {
    match extra.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_str() {
            Some(s) if !s.trim().is_empty() => Ok(Some(s.trim())),
            _ => Err(invalid(name, v)),
        },
    }
}

impl Settings {
    /// Parses the JSON object `{"kv_role", "engine_id", "kv_connector_extra_config"}`
    /// (the fields of vLLM's `KVTransferConfig` kvlink reads); `env` looks up
    /// the reference's environment variables.
    pub(crate) fn from_json(text_json: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let transfer = KvTransferConfig::from_json(text_json, env)?;
        let value: Value = serde_json::from_str(text_json).map_err(|e| Error::Config(e.to_string()))?;
        let empty = Map::new();
        let extra = value.get("kv_connector_extra_config").and_then(Value::as_object).unwrap_or(&empty);
        let foreign = |k: &str| FOREIGN_KEYS.iter().find(|(name, _)| *name == k).map(|(_, by)| *by);
        let ignored: Vec<(String, &'static str)> =
            extra.keys().filter_map(|k| foreign(k).map(|by| (k.clone(), by))).collect();
        let ours = |k: &String| EXTRA_KEYS.iter().any(|(known, _)| known == k);
        if let Some(unknown) = extra.keys().find(|k| !ours(k) && foreign(k).is_none()) {
            let known: Vec<&str> = EXTRA_KEYS.iter().map(|(k, _)| *k).collect();
            return Err(Error::Config(format!(
                "kv-transfer-config: unknown key {} (kvlink knows: {})",
                key(unknown),
                known.join(", ")
            )));
        }
        let queue_depth = match extra.get("queue_depth") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .filter(|n| (1..=65_536).contains(n))
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| invalid("queue_depth", v))?,
            ),
        };
        let auth_secret_file = text(extra, "auth_secret_file")?.map(PathBuf::from);
        let auth_secret = match &auth_secret_file {
            None => None,
            Some(path) => Some(read_secret(path)?),
        };
        let bind_host = match text(extra, "bind_host")? {
            None => None,
            Some(s) => Some(s.parse::<IpAddr>().map_err(|_| {
                Error::Config(format!(
                    "kv-transfer-config: {} = {s:?} is invalid; accepted: an IP address",
                    key("bind_host")
                ))
            })?),
        };
        let host_staging = match extra.get("host_staging") {
            None | Some(Value::Null) => HostStaging::Auto,
            Some(v) => match v.as_str() {
                Some("auto") => HostStaging::Auto,
                Some("always") => HostStaging::Always,
                Some("never") => HostStaging::Never,
                _ => return Err(invalid("host_staging", v)),
            },
        };
        let staging_bytes = match extra.get("staging_bytes") {
            None | Some(Value::Null) => DEFAULT_STAGING_BYTES,
            Some(v) => {
                v.as_u64().filter(|n| (1..=MAX_STAGING_BYTES).contains(n)).ok_or_else(|| invalid("staging_bytes", v))?
            }
        };
        Ok(Self {
            transfer,
            queue_depth,
            transfer_timeout: seconds(extra, "transfer_timeout")?,
            connect_timeout: seconds(extra, "connect_timeout")?,
            lease_renewal: seconds_or_zero(extra, "lease_renewal")?,
            auth_secret,
            auth_secret_file,
            advertised_host: text(extra, "advertised_host")?.map(str::to_owned),
            bind_host,
            host_staging,
            staging_bytes,
            staging_wait: seconds(extra, "staging_wait")?,
            ignored,
        })
    }

    /// The host peers are told to use: `advertised_host`, else `default_host`.
    pub(crate) fn host<'a>(&'a self, default_host: &'a str) -> &'a str {
        self.advertised_host.as_deref().unwrap_or(default_host)
    }

    /// The address listeners bind: `bind_host`, else the advertised host if
    /// it is an IP address, else every interface.
    pub(crate) fn bind_addr(&self, default_host: &str) -> IpAddr {
        self.bind_host
            .or_else(|| self.host(default_host).parse().ok())
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED))
    }

    /// The side-channel base port of data-parallel rank `dp_rank` (the
    /// reference's rule: bootstrap port + dp_rank * tp_size).
    pub(crate) fn side_channel_port(&self, dp_rank: u16, tp_size: u16) -> Result<u16> {
        self.transfer.side_channel_base_port(dp_rank, tp_size).ok_or_else(|| {
            Error::Config(format!(
                "side-channel port {} + {dp_rank} * {tp_size} exceeds 65535 ({})",
                self.transfer.bootstrap_port,
                kv_proto::ENV_BOOTSTRAP_PORT
            ))
        })
    }
}

/// Reads a shared secret from a file; surrounding whitespace is not part of it.
fn read_secret(path: &std::path::Path) -> Result<AuthSecret> {
    let bytes = std::fs::read(path).map_err(|e| {
        Error::Config(format!("{}: cannot read the secret file {}: {e}", key("auth_secret_file"), path.display()))
    })?;
    let secret = bytes.trim_ascii();
    if secret.is_empty() {
        return Err(Error::Config(format!("{}: the secret file {} is empty", key("auth_secret_file"), path.display())));
    }
    Ok(AuthSecret::new(secret))
}
