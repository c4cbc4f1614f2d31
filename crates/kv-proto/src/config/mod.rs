//! `KvTransferConfig`: vLLM's `--kv-transfer-config` JSON as the connector
//! reads it, the one parser of `kv_connector_extra_config`: its serde shape
//! ([`json`]: every key a field, any other key refused unless one of vLLM's
//! own connectors reads it, [`FOREIGN_KEYS`]), then one validation pass
//! that turns each given value into a setting or into a [`ConfigError`]
//! naming the key and the value. No I/O: environment variables come in
//! through a lookup the caller passes, and a secret file's path is returned,
//! not read.

mod json;
mod keys;

use std::net::IpAddr;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};

use self::json::{ExtraConfig, Given, TopLevel};
pub use self::keys::{EXTRA_KEYS, FOREIGN_KEYS};
use crate::bootstrap::BootstrapUrl;
use crate::ids::{EngineId, KvRole};
use crate::writer::Protocol;

/// Default bootstrap port (`VLLM_MOONCAKE_BOOTSTRAP_PORT`): P's bootstrap
/// server listens there, its side channels from the port after it.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;
/// Default lease on blocks P holds for a request D never asks for (480 s).
pub const DEFAULT_ABORT_REQUEST_TIMEOUT: Duration = Duration::from_secs(480);
/// `bootstrap_timeout` when none is given (30 s).
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(30);
/// Default number of concurrent transfers on P (`num_workers`).
pub const DEFAULT_NUM_WORKERS: usize = 10;
/// Environment variable overriding the bootstrap port.
pub const ENV_BOOTSTRAP_PORT: &str = "VLLM_MOONCAKE_BOOTSTRAP_PORT";
/// Environment variable overriding the abort timeout, in seconds.
pub const ENV_ABORT_REQUEST_TIMEOUT: &str = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT";
/// `staging_bytes` when none is given: 4 GiB.
pub const DEFAULT_STAGING_BYTES: u64 = 4 << 30;
/// `staging_piece_bytes` when none is given: 32 MiB.
pub const DEFAULT_STAGING_PIECE_BYTES: u64 = 32 << 20;

/// The largest `staging_bytes` (and `staging_piece_bytes`) accepted (1 PiB).
pub const MAX_STAGING_BYTES: u64 = 1 << 50;

/// Bounds on what the numeric keys accept.
const WORKERS: RangeInclusive<u64> = 1..=4096;
const QUEUE_DEPTH: RangeInclusive<u64> = 1..=65_536;
const HANDSHAKES: RangeInclusive<u64> = 1..=65_536;
const CONNECTIONS: RangeInclusive<u64> = 0..=(1 << 20);
/// Seconds are positive (or zero where that turns a feature off), finite
/// and below this.
const MAX_SECONDS: f64 = 1e7;

/// `host_staging`: when a worker moves KV through host staging.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostStaging {
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
    pub fn as_str(self) -> &'static str {
        match self {
            HostStaging::Auto => "auto",
            HostStaging::Always => "always",
            HostStaging::Never => "never",
        }
    }
}

/// What `kv_connector_extra_config` sets of one listener's limits (`None`:
/// the worker's default); the worker applies them to its `ListenerLimits`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ListenerOverrides {
    /// Connections in their handshake at once.
    pub max_handshakes: Option<usize>,
    /// Of those, from one source address.
    pub max_handshakes_per_host: Option<usize>,
    /// Established connections (0 refuses every one).
    pub max_connections: Option<usize>,
    /// The one deadline on an incoming connection's handshake.
    pub handshake_timeout: Option<Duration>,
}

/// The connector settings kvlink takes from vLLM's `--kv-transfer-config`
/// and the reference's environment variables. `None` leaves a setting at
/// the worker's default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvTransferConfig {
    /// `kv_role`.
    pub kv_role: KvRole,
    /// `engine_id`.
    pub engine_id: EngineId,
    /// `kv_connector_extra_config.mooncake_protocol`, or `None` when unset:
    /// the worker then uses `rdma` if compiled in (the reference's default)
    /// and `tcp` otherwise (`kv_worker::transport::resolve_protocol`).
    pub protocol: Option<Protocol>,
    /// `num_workers`: concurrent transfers on P.
    pub num_workers: usize,
    /// The bootstrap port (`VLLM_MOONCAKE_BOOTSTRAP_PORT`): where P's
    /// bootstrap server listens (vLLM's Mooncake deployment contract, which
    /// routers read P's workers from); the side channels listen from the
    /// port after it ([`KvTransferConfig::side_channel_base_port`]).
    pub bootstrap_port: u16,
    /// P-side lease on finished requests' blocks (`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`).
    pub abort_request_timeout: Duration,
    /// `queue_depth`.
    pub queue_depth: Option<usize>,
    /// `transfer_timeout`.
    pub transfer_timeout: Option<Duration>,
    /// `connect_timeout`.
    pub connect_timeout: Option<Duration>,
    /// `bootstrap_timeout`.
    pub bootstrap_timeout: Option<Duration>,
    /// `bootstrap_server_address`: the host and port of a bootstrap server
    /// outside the instance, which its prefill workers register with (it
    /// then runs none of its own).
    pub bootstrap_server_address: Option<BootstrapUrl>,
    /// `lease_renewal` (zero: renewals off).
    pub lease_renewal: Option<Duration>,
    /// `auth_secret_file` (read by the caller).
    pub auth_secret_file: Option<PathBuf>,
    /// `tcp_authenticate_payloads` (only with `auth_secret_file`).
    pub tcp_authenticate_payloads: bool,
    /// `advertised_host`.
    pub advertised_host: Option<String>,
    /// `bind_host`.
    pub bind_host: Option<IpAddr>,
    /// `host_staging`.
    pub host_staging: HostStaging,
    /// `staging_bytes` ([`DEFAULT_STAGING_BYTES`] when unset).
    pub staging_bytes: u64,
    /// `staging_wait` (`None`: the worker's transfer timeout).
    pub staging_wait: Option<Duration>,
    /// `staging_piece_bytes` ([`DEFAULT_STAGING_PIECE_BYTES`] when unset; 0:
    /// whole requests).
    pub staging_piece_bytes: u64,
    /// `side_channel_max_handshakes`, `…_per_host`, `side_channel_max_connections`,
    /// `side_channel_handshake_timeout`.
    pub side_channel_limits: ListenerOverrides,
    /// `data_max_handshakes`, `…_per_host`, `data_max_connections`,
    /// `data_handshake_timeout`.
    pub data_limits: ListenerOverrides,
    /// Keys of other vLLM connectors that were given and are ignored, with
    /// the connector that reads each (the caller logs them once).
    pub ignored: Ignored,
}

/// An invalid `--kv-transfer-config`, naming the field and what is accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The text is not JSON.
    #[error("kv-transfer-config is not valid JSON: {0}")]
    Json(String),
    /// A required field is missing.
    #[error("kv-transfer-config: {field} is required ({accepted})")]
    Missing {
        /// Dotted path of the field.
        field: &'static str,
        /// What is accepted.
        accepted: &'static str,
    },
    /// A field has a value outside what is accepted.
    #[error("kv-transfer-config: {field} = {given} is invalid; accepted: {accepted}")]
    Invalid {
        /// Dotted path of the field (or the environment variable).
        field: String,
        /// What was given.
        given: String,
        /// What is accepted.
        accepted: &'static str,
    },
    /// A key is set that needs another one that is not.
    #[error("kv-transfer-config: {field} = {given} needs {needs}")]
    Needs {
        /// Dotted path of the key.
        field: String,
        /// What was given.
        given: String,
        /// Dotted path of the key it needs.
        needs: String,
    },
    /// A key of `kv_connector_extra_config` neither kvlink nor one of vLLM's
    /// own connectors reads (a typo, most likely).
    #[error("kv-transfer-config: unknown key {key} (kvlink knows: {known})")]
    UnknownKey {
        /// Dotted path of the key.
        key: String,
        /// kvlink's keys.
        known: String,
    },
}

const ROLES: &str = "\"kv_producer\", \"kv_consumer\", \"kv_both\"";
const EXTRA: &str = "kv_connector_extra_config";

fn extra_key(name: &str) -> String {
    format!("{EXTRA}.{name}")
}

fn invalid(name: &str, value: &Value) -> ConfigError {
    ConfigError::Invalid { field: extra_key(name), given: value.to_string(), accepted: keys::accepted(name) }
}

/// `given` as `check` reads it, or the error naming `name` and the value.
fn checked<T, U>(
    name: &str,
    given: Option<Given<T>>,
    check: impl FnOnce(T) -> Option<U>,
) -> Result<Option<U>, ConfigError> {
    let Some(given) = given else { return Ok(None) };
    match given.typed.and_then(check) {
        Some(value) => Ok(Some(value)),
        None => Err(invalid(name, &given.value)),
    }
}

/// A whole number in `range`.
fn count(name: &str, given: Option<Given<u64>>, range: RangeInclusive<u64>) -> Result<Option<usize>, ConfigError> {
    checked(name, given, |n| range.contains(&n).then(|| usize::try_from(n).ok()).flatten())
}

/// Positive seconds below [`MAX_SECONDS`] (zero too, where `zero` says
/// so); a positive number below a nanosecond, which would be no wait at
/// all, is refused.
fn seconds(name: &str, given: Option<Given<f64>>, zero: bool) -> Result<Option<Duration>, ConfigError> {
    checked(name, given, |s| {
        let positive = s > 0.0 || (zero && s == 0.0);
        (positive && s < MAX_SECONDS)
            .then(|| Duration::try_from_secs_f64(s).ok())
            .flatten()
            .filter(|d| !d.is_zero() || s == 0.0)
    })
}

/// Text that is not blank, trimmed.
fn nonblank(name: &str, given: Option<Given<String>>) -> Result<Option<String>, ConfigError> {
    checked(name, given, |s| {
        let trimmed = s.trim();
        (!trimmed.is_empty()).then(|| trimmed.to_owned())
    })
}

fn listener(
    prefix: &str,
    handshakes: Option<Given<u64>>,
    per_host: Option<Given<u64>>,
    connections: Option<Given<u64>>,
    handshake_timeout: Option<Given<f64>>,
) -> Result<ListenerOverrides, ConfigError> {
    Ok(ListenerOverrides {
        max_handshakes: count(&format!("{prefix}_max_handshakes"), handshakes, HANDSHAKES)?,
        max_handshakes_per_host: count(&format!("{prefix}_max_handshakes_per_host"), per_host, HANDSHAKES)?,
        max_connections: count(&format!("{prefix}_max_connections"), connections, CONNECTIONS)?,
        handshake_timeout: seconds(&format!("{prefix}_handshake_timeout"), handshake_timeout, false)?,
    })
}

/// Keys of other connectors, each with the connector that reads it.
type Ignored = Vec<(String, &'static str)>;

/// Sets aside the keys of other connectors (returned, in key order), and
/// refuses any other key kvlink does not know; reads the rest.
fn read_extra(map: Map<String, Value>) -> Result<(ExtraConfig, Ignored), ConfigError> {
    let mut ours = Map::new();
    let mut ignored = Vec::new();
    for (key, value) in map {
        if let Some(by) = keys::foreign(&key) {
            ignored.push((key, by));
        } else if keys::is_known(&key) {
            ours.insert(key, value);
        } else {
            let known: Vec<&str> = EXTRA_KEYS.iter().map(|(k, _)| *k).collect();
            return Err(ConfigError::UnknownKey { key: extra_key(&key), known: known.join(", ") });
        }
    }
    // Every key left is a field (the table and the struct agree, as a unit
    // test checks); `deny_unknown_fields` is the backstop.
    let extra = ExtraConfig::deserialize(Value::Object(ours)).map_err(|e| ConfigError::Json(e.to_string()))?;
    Ok((extra, ignored))
}

impl KvTransferConfig {
    /// Parses vLLM's `--kv-transfer-config` JSON. `env` looks up an environment
    /// variable (pass `|k| std::env::var(k).ok()`; this crate reads no
    /// environment itself) for the bootstrap port and abort timeout.
    pub fn from_json(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        if !value.is_object() {
            return Err(ConfigError::Invalid {
                field: "(top level)".to_owned(),
                given: value.to_string(),
                accepted: "a JSON object",
            });
        }
        let top = TopLevel::deserialize(value).map_err(|e| ConfigError::Json(e.to_string()))?;
        let kv_role = match top.kv_role {
            None => return Err(ConfigError::Missing { field: "kv_role", accepted: ROLES }),
            Some(given) => given.typed.and_then(|s| s.parse().ok()).ok_or_else(|| ConfigError::Invalid {
                field: "kv_role".to_owned(),
                given: given.value.to_string(),
                accepted: ROLES,
            })?,
        };
        let engine_id = match top.engine_id {
            None => return Err(ConfigError::Missing { field: "engine_id", accepted: "a non-empty string" }),
            Some(given) => match given.typed {
                Some(s) if !s.is_empty() => EngineId::new(s),
                _ => {
                    return Err(ConfigError::Invalid {
                        field: "engine_id".to_owned(),
                        given: given.value.to_string(),
                        accepted: "a non-empty string",
                    })
                }
            },
        };
        let (extra, ignored) = match top.kv_connector_extra_config {
            None => (ExtraConfig::default(), Vec::new()),
            Some(Value::Object(map)) => read_extra(map)?,
            Some(other) => {
                return Err(ConfigError::Invalid {
                    field: EXTRA.to_owned(),
                    given: other.to_string(),
                    accepted: "a JSON object",
                })
            }
        };
        let bootstrap_port = match env(ENV_BOOTSTRAP_PORT) {
            None => DEFAULT_BOOTSTRAP_PORT,
            Some(s) => s.trim().parse::<u16>().ok().filter(|p| *p != 0).ok_or(ConfigError::Invalid {
                field: ENV_BOOTSTRAP_PORT.to_owned(),
                given: s,
                accepted: "a port in 1..=65535",
            })?,
        };
        let abort_request_timeout = match env(ENV_ABORT_REQUEST_TIMEOUT) {
            None => DEFAULT_ABORT_REQUEST_TIMEOUT,
            Some(s) => s
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|secs| secs.is_finite() && *secs > 0.0 && *secs < 1e9)
                .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
                // A positive number below a nanosecond would be no wait at all.
                .filter(|d| !d.is_zero())
                .ok_or(ConfigError::Invalid {
                    field: ENV_ABORT_REQUEST_TIMEOUT.to_owned(),
                    given: s,
                    accepted: "a positive number of seconds",
                })?,
        };
        let bind_host = checked("bind_host", extra.bind_host, |s| s.trim().parse::<IpAddr>().ok())?;
        let host_staging = checked("host_staging", extra.host_staging, |s| match s.as_str() {
            "auto" => Some(HostStaging::Auto),
            "always" => Some(HostStaging::Always),
            "never" => Some(HostStaging::Never),
            _ => None,
        })?;
        let staging_bytes =
            checked("staging_bytes", extra.staging_bytes, |n| (1..=MAX_STAGING_BYTES).contains(&n).then_some(n))?;
        let staging_piece_bytes =
            checked("staging_piece_bytes", extra.staging_piece_bytes, |n| (n <= MAX_STAGING_BYTES).then_some(n))?;
        let auth_secret_file = nonblank("auth_secret_file", extra.auth_secret_file)?.map(PathBuf::from);
        let tcp_authenticate_payloads =
            checked("tcp_authenticate_payloads", extra.tcp_authenticate_payloads, Some)?.unwrap_or(false);
        // Payload tags are keyed by the session a shared secret makes.
        if tcp_authenticate_payloads && auth_secret_file.is_none() {
            return Err(ConfigError::Needs {
                field: extra_key("tcp_authenticate_payloads"),
                given: "true".to_owned(),
                needs: extra_key("auth_secret_file"),
            });
        }
        Ok(Self {
            kv_role,
            engine_id,
            protocol: checked("mooncake_protocol", extra.mooncake_protocol, |s| s.parse().ok())?,
            num_workers: count("num_workers", extra.num_workers, WORKERS)?.unwrap_or(DEFAULT_NUM_WORKERS),
            bootstrap_port,
            abort_request_timeout,
            queue_depth: count("queue_depth", extra.queue_depth, QUEUE_DEPTH)?,
            transfer_timeout: seconds("transfer_timeout", extra.transfer_timeout, false)?,
            connect_timeout: seconds("connect_timeout", extra.connect_timeout, false)?,
            bootstrap_timeout: seconds("bootstrap_timeout", extra.bootstrap_timeout, false)?,
            bootstrap_server_address: checked("bootstrap_server_address", extra.bootstrap_server_address, |s| {
                BootstrapUrl::from_authority(s.trim()).ok()
            })?,
            lease_renewal: seconds("lease_renewal", extra.lease_renewal, true)?,
            auth_secret_file,
            tcp_authenticate_payloads,
            advertised_host: nonblank("advertised_host", extra.advertised_host)?,
            bind_host,
            host_staging: host_staging.unwrap_or_default(),
            staging_bytes: staging_bytes.unwrap_or(DEFAULT_STAGING_BYTES),
            staging_wait: seconds("staging_wait", extra.staging_wait, false)?,
            staging_piece_bytes: staging_piece_bytes.unwrap_or(DEFAULT_STAGING_PIECE_BYTES),
            side_channel_limits: listener(
                "side_channel",
                extra.side_channel_max_handshakes,
                extra.side_channel_max_handshakes_per_host,
                extra.side_channel_max_connections,
                extra.side_channel_handshake_timeout,
            )?,
            data_limits: listener(
                "data",
                extra.data_max_handshakes,
                extra.data_max_handshakes_per_host,
                extra.data_max_connections,
                extra.data_handshake_timeout,
            )?,
            ignored,
        })
    }

    /// The side-channel base port of a data-parallel rank:
    /// `bootstrap_port + 1 + dp_rank * tp_size * pp_size` (the reference's
    /// rule, with room for every pipeline stage, past the bootstrap server's
    /// own port). Each worker listens on this plus `pp_rank * tp_size +
    /// tp_rank`, so no two workers of one host collide.
    pub fn side_channel_base_port(&self, dp_rank: u16, tp_size: u16, pp_size: u16) -> Option<u16> {
        self.bootstrap_port.checked_add(1)?.checked_add(dp_rank.checked_mul(tp_size)?.checked_mul(pp_size)?)
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn defaults_follow_the_reference() {
        let c = KvTransferConfig::from_json(
            r#"{"kv_connector":"MooncakeConnector","kv_role":"kv_producer","engine_id":"p0"}"#,
            no_env,
        )
        .unwrap();
        assert_eq!(c.kv_role, KvRole::Producer);
        assert_eq!(c.engine_id.as_str(), "p0");
        assert_eq!(c.protocol, None, "unset: the worker picks this build's default");
        assert_eq!(c.num_workers, 10);
        assert_eq!(c.bootstrap_port, 8998);
        assert_eq!(c.abort_request_timeout, Duration::from_secs(480));
        assert_eq!(c.side_channel_base_port(0, 4, 1), Some(8999), "the bootstrap server has the port itself");
        assert_eq!(c.side_channel_base_port(2, 4, 1), Some(9007));
        assert_eq!(c.side_channel_base_port(2, 4, 2), Some(9015), "two stages of four workers per data-parallel rank");
        assert_eq!(c.side_channel_base_port(1, 1024, 64), None);
    }

    #[test]
    fn extra_config_and_environment_are_honoured() {
        let c = KvTransferConfig::from_json(
            r#"{"kv_role":"kv_both","engine_id":"e","kv_connector_extra_config":{"mooncake_protocol":"quic","num_workers":3}}"#,
            |k| match k {
                ENV_BOOTSTRAP_PORT => Some("9100".into()),
                ENV_ABORT_REQUEST_TIMEOUT => Some("2.5".into()),
                _ => None,
            },
        )
        .unwrap();
        assert_eq!(c.protocol, Some(Protocol::Quic));
        assert_eq!(c.num_workers, 3);
        assert_eq!(c.bootstrap_port, 9100);
        assert_eq!(c.abort_request_timeout, Duration::from_millis(2500));
    }

    #[rstest]
    #[case::bad_role(
        r#"{"kv_role":"kv_sender","engine_id":"e"}"#,
        "kv_role = \"kv_sender\" is invalid; accepted: \"kv_producer\", \"kv_consumer\", \"kv_both\""
    )]
    #[case::missing_role(r#"{"engine_id":"e"}"#, "kv_role is required")]
    #[case::missing_engine(r#"{"kv_role":"kv_both"}"#, "engine_id is required")]
    #[case::bad_protocol(
        r#"{"kv_role":"kv_both","engine_id":"e","kv_connector_extra_config":{"mooncake_protocol":"nvlink"}}"#,
        "mooncake_protocol = \"nvlink\" is invalid; accepted: \"tcp\", \"quic\" or \"rdma\""
    )]
    #[case::bad_workers(
        r#"{"kv_role":"kv_both","engine_id":"e","kv_connector_extra_config":{"num_workers":0}}"#,
        "num_workers = 0 is invalid"
    )]
    #[case::workers_as_string(
        r#"{"kv_role":"kv_both","engine_id":"e","kv_connector_extra_config":{"num_workers":"4"}}"#,
        "num_workers = \"4\" is invalid"
    )]
    #[case::extra_not_object(
        r#"{"kv_role":"kv_both","engine_id":"e","kv_connector_extra_config":[]}"#,
        "kv_connector_extra_config = [] is invalid"
    )]
    #[case::not_json("{", "not valid JSON")]
    #[case::top_level_not_object("[1]", "(top level) = [1] is invalid")]
    #[case::empty_engine(r#"{"kv_role":"kv_both","engine_id":""}"#, "engine_id = \"\" is invalid")]
    #[case::unknown_key(
        r#"{"kv_role":"kv_both","engine_id":"e","kv_connector_extra_config":{"backends":[],"num_worker":4}}"#,
        "unknown key kv_connector_extra_config.num_worker (kvlink knows: mooncake_protocol, num_workers,"
    )]
    fn invalid_config_names_the_field(#[case] json: &str, #[case] expected: &str) {
        let err = KvTransferConfig::from_json(json, no_env).unwrap_err().to_string();
        assert!(err.contains(expected), "{err:?} does not contain {expected:?}");
    }

    #[rstest]
    #[case::port_not_a_number(ENV_BOOTSTRAP_PORT, "abc")]
    #[case::port_zero(ENV_BOOTSTRAP_PORT, "0")]
    #[case::port_too_big(ENV_BOOTSTRAP_PORT, "70000")]
    #[case::timeout_negative(ENV_ABORT_REQUEST_TIMEOUT, "-1")]
    #[case::timeout_nan(ENV_ABORT_REQUEST_TIMEOUT, "nan")]
    #[case::timeout_below_a_nanosecond(ENV_ABORT_REQUEST_TIMEOUT, "1e-250")]
    fn invalid_environment_names_the_variable(#[case] var: &'static str, #[case] value: &'static str) {
        let err = KvTransferConfig::from_json(r#"{"kv_role":"kv_both","engine_id":"e"}"#, |k| {
            (k == var).then(|| value.to_owned())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains(var), "{err}");
    }

    fn with_extra(extra: serde_json::Value) -> Result<KvTransferConfig, ConfigError> {
        let doc = serde_json::json!({"kv_role": "kv_both", "engine_id": "e", "kv_connector_extra_config": extra});
        KvTransferConfig::from_json(&doc.to_string(), no_env)
    }

    #[test]
    fn every_listed_key_is_a_field_of_the_parser() {
        for (key, accepted) in EXTRA_KEYS {
            assert!(!accepted.is_empty(), "{key} says what it accepts");
            let one = serde_json::json!({ *key: null });
            assert!(ExtraConfig::deserialize(one).is_ok(), "{key} is listed but not read");
            assert!(keys::foreign(key).is_none(), "{key} is kvlink's and another connector's");
        }
        assert!(ExtraConfig::deserialize(serde_json::json!({"not_a_key": 1})).is_err(), "unknown fields are refused");
    }

    #[test]
    fn every_key_is_read() {
        let c = with_extra(serde_json::json!({
            "mooncake_protocol": "tcp",
            "num_workers": 3,
            "queue_depth": 7,
            "transfer_timeout": 2.5,
            "connect_timeout": 1,
            "bootstrap_timeout": 12,
            "bootstrap_server_address": "[fd00::1]:8998",
            "lease_renewal": 0,
            "auth_secret_file": " /etc/kvlink/secret ",
            "tcp_authenticate_payloads": true,
            "advertised_host": "p.example",
            "bind_host": "127.0.0.1",
            "host_staging": "always",
            "staging_bytes": 1 << 20,
            "staging_wait": 1.5,
            "staging_piece_bytes": 0,
            "side_channel_max_handshakes": 10,
            "side_channel_max_handshakes_per_host": 5,
            "side_channel_max_connections": 0,
            "data_max_handshakes": 100,
            "data_max_handshakes_per_host": 40,
            "data_max_connections": 2000,
            "side_channel_handshake_timeout": 2,
            "data_handshake_timeout": 0.5,
        }))
        .unwrap();
        assert_eq!(c.protocol, Some(Protocol::Tcp));
        assert_eq!((c.num_workers, c.queue_depth), (3, Some(7)));
        assert_eq!(c.transfer_timeout, Some(Duration::from_millis(2500)));
        assert_eq!(c.connect_timeout, Some(Duration::from_secs(1)));
        assert_eq!(c.bootstrap_timeout, Some(Duration::from_secs(12)));
        assert_eq!(c.bootstrap_server_address, Some(BootstrapUrl::new("fd00::1", 8998).unwrap()));
        assert_eq!(c.lease_renewal, Some(Duration::ZERO), "zero turns renewals off");
        assert_eq!(c.auth_secret_file, Some(PathBuf::from("/etc/kvlink/secret")));
        assert!(c.tcp_authenticate_payloads);
        assert_eq!(c.advertised_host.as_deref(), Some("p.example"));
        assert_eq!(c.bind_host, Some(IpAddr::from([127, 0, 0, 1])));
        assert_eq!((c.host_staging, c.staging_bytes), (HostStaging::Always, 1 << 20));
        assert_eq!(c.staging_wait, Some(Duration::from_millis(1500)));
        assert_eq!(c.staging_piece_bytes, 0, "zero: whole requests");
        let overrides = |h, p, c, t| ListenerOverrides {
            max_handshakes: Some(h),
            max_handshakes_per_host: Some(p),
            max_connections: Some(c),
            handshake_timeout: Some(Duration::from_secs_f64(t)),
        };
        assert_eq!(c.side_channel_limits, overrides(10, 5, 0, 2.0));
        assert_eq!(c.data_limits, overrides(100, 40, 2000, 0.5));
        assert!(c.ignored.is_empty());
    }

    #[test]
    fn absent_and_null_keys_leave_the_defaults() {
        let absent = with_extra(serde_json::json!({})).unwrap();
        let nulls = with_extra(serde_json::Value::Object(
            EXTRA_KEYS.iter().map(|(k, _)| ((*k).to_owned(), serde_json::Value::Null)).collect(),
        ))
        .unwrap();
        assert_eq!(absent, nulls);
        assert_eq!((absent.host_staging, absent.staging_bytes), (HostStaging::Auto, DEFAULT_STAGING_BYTES));
        assert_eq!(absent.staging_piece_bytes, DEFAULT_STAGING_PIECE_BYTES);
        assert_eq!(absent.data_limits, ListenerOverrides::default());
        assert_eq!(absent.queue_depth, None);
        assert!(!absent.tcp_authenticate_payloads);
    }

    #[test]
    fn payload_tags_need_a_secret() {
        let err = with_extra(serde_json::json!({"tcp_authenticate_payloads": true})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "kv-transfer-config: kv_connector_extra_config.tcp_authenticate_payloads = true needs \
             kv_connector_extra_config.auth_secret_file"
        );
        let off = with_extra(serde_json::json!({"tcp_authenticate_payloads": false})).unwrap();
        assert!(!off.tcp_authenticate_payloads, "false needs nothing");
        let on = with_extra(serde_json::json!({"tcp_authenticate_payloads": true, "auth_secret_file": "/s"})).unwrap();
        assert!(on.tcp_authenticate_payloads);
    }

    #[test]
    fn other_connectors_keys_are_set_aside() {
        let c = with_extra(serde_json::json!({"backends": ["UCX"], "num_threads": 4, "num_workers": 3})).unwrap();
        assert_eq!(c.num_workers, 3);
        assert_eq!(
            c.ignored,
            vec![("backends".to_owned(), "NixlConnector"), ("num_threads".to_owned(), "NixlConnector")]
        );
    }

    #[rstest]
    #[case::queue_depth_as_text(serde_json::json!({"queue_depth": "8"}), "queue_depth = \"8\"")]
    #[case::negative_timeout(serde_json::json!({"transfer_timeout": -1}), "transfer_timeout = -1")]
    #[case::zero_timeout(serde_json::json!({"connect_timeout": 0}), "connect_timeout = 0")]
    #[case::timeout_as_text(serde_json::json!({"connect_timeout": "5s"}), "connect_timeout = \"5s\"")]
    #[case::huge_timeout(serde_json::json!({"staging_wait": 1e300}), "staging_wait = 1e+300")]
    #[case::negative_renewal(serde_json::json!({"lease_renewal": -3}), "lease_renewal = -3")]
    #[case::blank_host(serde_json::json!({"advertised_host": " "}), "advertised_host = \" \"")]
    #[case::bootstrap_no_port(serde_json::json!({"bootstrap_server_address": "h"}), "bootstrap_server_address = \"h\"")]
    #[case::bootstrap_port_zero(serde_json::json!({"bootstrap_server_address": "h:0"}), "bootstrap_server_address = \"h:0\"")]
    #[case::bootstrap_bare_v6(serde_json::json!({"bootstrap_server_address": "fd00::1:8998"}), "bootstrap_server_address = \"fd00::1:8998\"")]
    #[case::bind_host_not_ip(serde_json::json!({"bind_host": "not-an-ip"}), "bind_host = \"not-an-ip\"")]
    #[case::staging_mode(serde_json::json!({"host_staging": "sometimes"}), "host_staging = \"sometimes\"")]
    #[case::staging_flag(serde_json::json!({"host_staging": true}), "host_staging = true")]
    #[case::staging_zero(serde_json::json!({"staging_bytes": 0}), "staging_bytes = 0")]
    #[case::staging_fraction(serde_json::json!({"staging_bytes": 4.5e9}), "staging_bytes = 4500000000.0")]
    #[case::staging_too_big(serde_json::json!({"staging_bytes": 1u64 << 51}), "staging_bytes = 2251799813685248")]
    #[case::piece_negative(serde_json::json!({"staging_piece_bytes": -1}), "staging_piece_bytes = -1")]
    #[case::piece_too_big(serde_json::json!({"staging_piece_bytes": 1u64 << 51}), "staging_piece_bytes = 2251799813685248")]
    #[case::no_handshakes(serde_json::json!({"data_max_handshakes": 0}), "data_max_handshakes = 0")]
    #[case::per_host_as_text(
        serde_json::json!({"side_channel_max_handshakes_per_host": "16"}),
        "side_channel_max_handshakes_per_host = \"16\""
    )]
    #[case::payload_tags_as_text(
        serde_json::json!({"tcp_authenticate_payloads": "yes", "auth_secret_file": "/s"}),
        "tcp_authenticate_payloads = \"yes\""
    )]
    #[case::negative_connections(serde_json::json!({"data_max_connections": -1}), "data_max_connections = -1")]
    #[case::zero_handshake_timeout(serde_json::json!({"data_handshake_timeout": 0}), "data_handshake_timeout = 0")]
    #[case::timeout_below_a_nanosecond(serde_json::json!({"transfer_timeout": 1e-12}), "transfer_timeout = 1e-12")]
    fn a_bad_value_names_its_key_and_the_value(#[case] extra: serde_json::Value, #[case] expected: &str) {
        let err = with_extra(extra).unwrap_err().to_string();
        assert!(err.contains(&format!("kv_connector_extra_config.{expected} is invalid; accepted: ")), "{err}");
    }
}
