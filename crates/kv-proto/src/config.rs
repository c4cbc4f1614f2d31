//! `KvTransferConfig`: vLLM's `--kv-transfer-config` JSON, as the connector reads it.

use std::time::Duration;

use serde_json::{Map, Value};

use crate::ids::{EngineId, KvRole};
use crate::writer::Protocol;

/// Default side-channel bootstrap port (the reference's `VLLM_MOONCAKE_BOOTSTRAP_PORT`).
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;
/// Default lease on blocks P holds for a request D never asks for (480 s).
pub const DEFAULT_ABORT_REQUEST_TIMEOUT: Duration = Duration::from_secs(480);
/// Default number of concurrent transfers on P (`num_workers`).
pub const DEFAULT_NUM_WORKERS: usize = 10;
/// Environment variable overriding the bootstrap port.
pub const ENV_BOOTSTRAP_PORT: &str = "VLLM_MOONCAKE_BOOTSTRAP_PORT";
/// Environment variable overriding the abort timeout, in seconds.
pub const ENV_ABORT_REQUEST_TIMEOUT: &str = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT";

/// The connector settings kvlink takes from vLLM's `--kv-transfer-config`.
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
    /// `kv_connector_extra_config.num_workers`: concurrent transfers on P.
    pub num_workers: usize,
    /// Side-channel bootstrap port (`VLLM_MOONCAKE_BOOTSTRAP_PORT`).
    pub bootstrap_port: u16,
    /// P-side lease on finished requests' blocks (`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`).
    pub abort_request_timeout: Duration,
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
        field: &'static str,
        /// What was given.
        given: String,
        /// What is accepted.
        accepted: &'static str,
    },
}

const ROLES: &str = "\"kv_producer\", \"kv_consumer\", \"kv_both\"";
const PROTOCOLS: &str = "\"tcp\", \"quic\", \"rdma\"";

impl KvTransferConfig {
    /// Parses vLLM's `--kv-transfer-config` JSON. `env` looks up an environment
    /// variable (pass `|k| std::env::var(k).ok()`; this crate reads no
    /// environment itself) for the bootstrap port and abort timeout.
    pub fn from_json(text: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let obj = value.as_object().ok_or_else(|| ConfigError::Invalid {
            field: "(top level)",
            given: value.to_string(),
            accepted: "a JSON object",
        })?;
        let empty = Map::new();
        let extra = match obj.get("kv_connector_extra_config") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(other) => {
                return Err(ConfigError::Invalid {
                    field: "kv_connector_extra_config",
                    given: other.to_string(),
                    accepted: "a JSON object",
                })
            }
        };

        let kv_role = match obj.get("kv_role") {
            None | Some(Value::Null) => return Err(ConfigError::Missing { field: "kv_role", accepted: ROLES }),
            Some(v) => v.as_str().and_then(|s| s.parse().ok()).ok_or_else(|| ConfigError::Invalid {
                field: "kv_role",
                given: v.to_string(),
                accepted: ROLES,
            })?,
        };
        let engine_id = match obj.get("engine_id") {
            None | Some(Value::Null) => {
                return Err(ConfigError::Missing { field: "engine_id", accepted: "a non-empty string" })
            }
            Some(v) => match v.as_str() {
                Some(s) if !s.is_empty() => EngineId::new(s),
                _ => {
                    return Err(ConfigError::Invalid {
                        field: "engine_id",
                        given: v.to_string(),
                        accepted: "a non-empty string",
                    })
                }
            },
        };
        let protocol = match extra.get("mooncake_protocol") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_str().and_then(|s| s.parse().ok()).ok_or_else(|| ConfigError::Invalid {
                field: "kv_connector_extra_config.mooncake_protocol",
                given: v.to_string(),
                accepted: PROTOCOLS,
            })?),
        };
        let num_workers = match extra.get("num_workers") {
            None | Some(Value::Null) => DEFAULT_NUM_WORKERS,
            Some(v) => v.as_u64().filter(|n| (1..=4096).contains(n)).and_then(|n| usize::try_from(n).ok()).ok_or_else(
                || ConfigError::Invalid {
                    field: "kv_connector_extra_config.num_workers",
                    given: v.to_string(),
                    accepted: "an integer in 1..=4096",
                },
            )?,
        };
        let bootstrap_port = match env(ENV_BOOTSTRAP_PORT) {
            None => DEFAULT_BOOTSTRAP_PORT,
            Some(s) => s.trim().parse::<u16>().ok().filter(|p| *p != 0).ok_or(ConfigError::Invalid {
                field: ENV_BOOTSTRAP_PORT,
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
                .map(Duration::from_secs_f64)
                .ok_or(ConfigError::Invalid {
                    field: ENV_ABORT_REQUEST_TIMEOUT,
                    given: s,
                    accepted: "a positive number of seconds",
                })?,
        };
        Ok(Self { kv_role, engine_id, protocol, num_workers, bootstrap_port, abort_request_timeout })
    }

    /// The side-channel base port of a data-parallel rank:
    /// `bootstrap_port + dp_rank * tp_size` (the reference's rule). Each
    /// tensor-parallel worker listens on this plus its `tp_rank`.
    pub fn side_channel_base_port(&self, dp_rank: u16, tp_size: u16) -> Option<u16> {
        self.bootstrap_port.checked_add(dp_rank.checked_mul(tp_size)?)
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
        assert_eq!(c.side_channel_base_port(2, 4), Some(9006));
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
        "mooncake_protocol = \"nvlink\" is invalid; accepted: \"tcp\", \"quic\", \"rdma\""
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
    fn invalid_environment_names_the_variable(#[case] var: &'static str, #[case] value: &'static str) {
        let err = KvTransferConfig::from_json(r#"{"kv_role":"kv_both","engine_id":"e"}"#, |k| {
            (k == var).then(|| value.to_owned())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains(var), "{err}");
    }
}
