//! kvlink's settings as vLLM passes them: `--kv-transfer-config` (role,
//! engine id, `kv_connector_extra_config`) plus the reference's environment
//! variables, parsed and checked by kv-proto's one parser
//! ([`KvTransferConfig::from_json`]: every key of `kv_connector_extra_config`
//! is kvlink's own, or one of vLLM's own connectors' (ignored); any other
//! is an error naming it), and the shared secret read from its file.

use std::net::IpAddr;

use kv_proto::auth::AuthSecret;
use kv_proto::KvTransferConfig;

use crate::error::{Error, Result};

/// Parsed settings of one engine instance.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    /// Everything `--kv-transfer-config` and the environment set.
    pub(crate) transfer: KvTransferConfig,
    /// The secret read from `auth_secret_file`.
    pub(crate) auth_secret: Option<AuthSecret>,
}

fn key(name: &str) -> String {
    format!("kv_connector_extra_config.{name}")
}

impl Settings {
    /// Parses the JSON object `{"kv_role", "engine_id", "kv_connector_extra_config"}`
    /// (the fields of vLLM's `KVTransferConfig` kvlink reads); `env` looks up
    /// the reference's environment variables. Reads the secret file, if one
    /// is named.
    pub(crate) fn from_json(text_json: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let transfer = KvTransferConfig::from_json(text_json, env)?;
        let auth_secret = transfer.auth_secret_file.as_deref().map(read_secret).transpose()?;
        Ok(Self { transfer, auth_secret })
    }

    /// The host peers are told to use: `advertised_host`, else `default_host`.
    pub(crate) fn host<'a>(&'a self, default_host: &'a str) -> &'a str {
        self.transfer.advertised_host.as_deref().unwrap_or(default_host)
    }

    /// The address listeners bind: `bind_host`, else the advertised host if
    /// it is an IP address, else every interface.
    pub(crate) fn bind_addr(&self, default_host: &str) -> IpAddr {
        self.transfer
            .bind_host
            .or_else(|| self.host(default_host).parse().ok())
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED))
    }

    /// The side-channel base port of data-parallel rank `dp_rank` (the
    /// reference's rule, with room for every stage's workers: bootstrap
    /// port + dp_rank * tp_size * pp_size).
    pub(crate) fn side_channel_port(&self, dp_rank: u16, tp_size: u16, pp_size: u16) -> Result<u16> {
        self.transfer.side_channel_base_port(dp_rank, tp_size, pp_size).ok_or_else(|| {
            Error::Config(format!(
                "side-channel port {} + {dp_rank} * {tp_size} * {pp_size} exceeds 65535 ({})",
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
