//! The serde shape of `--kv-transfer-config`. The top level is vLLM's
//! `KVTransferConfig`, of which kvlink reads three fields (the others are
//! vLLM's and pass); [`ExtraConfig`] is `kv_connector_extra_config` with
//! every key kvlink reads, and refuses any other (`deny_unknown_fields`).
//! Each value is kept as given beside its typed reading ([`Given`]), so the
//! validation pass that follows can name the key and the value it refuses.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// A value as given, and its reading as a `T` (`None`: not a `T`).
#[derive(Debug)]
pub(super) struct Given<T> {
    /// The JSON value, for messages.
    pub(super) value: Value,
    /// The value read as a `T`.
    pub(super) typed: Option<T>,
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Given<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        let typed = T::deserialize(&value).ok();
        Ok(Self { value, typed })
    }
}

/// The fields of vLLM's `KVTransferConfig` kvlink reads (`null` counts as
/// absent); vLLM's other fields are not kvlink's to check.
#[derive(Debug, Deserialize)]
pub(super) struct TopLevel {
    #[serde(default)]
    pub(super) kv_role: Option<Given<String>>,
    #[serde(default)]
    pub(super) engine_id: Option<Given<String>>,
    /// Read as a map first: the keys of other connectors are set aside
    /// before the rest is read as an [`ExtraConfig`].
    #[serde(default)]
    pub(super) kv_connector_extra_config: Option<Value>,
}

/// `kv_connector_extra_config`: every key kvlink reads (see
/// `keys::EXTRA_KEYS` for what each accepts), `null` counting as absent.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct ExtraConfig {
    pub(super) mooncake_protocol: Option<Given<String>>,
    pub(super) num_workers: Option<Given<u64>>,
    pub(super) queue_depth: Option<Given<u64>>,
    pub(super) transfer_timeout: Option<Given<f64>>,
    pub(super) connect_timeout: Option<Given<f64>>,
    pub(super) bootstrap_timeout: Option<Given<f64>>,
    pub(super) bootstrap_server_address: Option<Given<String>>,
    pub(super) lease_renewal: Option<Given<f64>>,
    pub(super) auth_secret_file: Option<Given<String>>,
    pub(super) tcp_authenticate_payloads: Option<Given<bool>>,
    pub(super) advertised_host: Option<Given<String>>,
    pub(super) bind_host: Option<Given<String>>,
    pub(super) host_staging: Option<Given<String>>,
    pub(super) staging_bytes: Option<Given<u64>>,
    pub(super) staging_wait: Option<Given<f64>>,
    pub(super) staging_piece_bytes: Option<Given<u64>>,
    pub(super) side_channel_max_handshakes: Option<Given<u64>>,
    pub(super) side_channel_max_handshakes_per_host: Option<Given<u64>>,
    pub(super) side_channel_max_connections: Option<Given<u64>>,
    pub(super) data_max_handshakes: Option<Given<u64>>,
    pub(super) data_max_handshakes_per_host: Option<Given<u64>>,
    pub(super) data_max_connections: Option<Given<u64>>,
    pub(super) side_channel_handshake_timeout: Option<Given<f64>>,
    pub(super) data_handshake_timeout: Option<Given<f64>>,
}
