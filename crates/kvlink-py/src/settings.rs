//! `Settings`: the parsed kvlink settings, for Python.

use pyo3::prelude::*;

use kv_proto::EXTRA_KEYS;

use crate::config::Settings;
use crate::error::Result;

/// kvlink's settings of one engine instance, parsed and checked.
#[pyclass(name = "Settings", module = "kvlink_vllm._native", frozen)]
pub(crate) struct PySettings {
    inner: Settings,
}

impl PySettings {
    /// The parsed settings.
    pub(crate) fn inner(&self) -> &Settings {
        &self.inner
    }
}

#[pymethods]
impl PySettings {
    /// Parses the JSON object `{"kv_role", "engine_id",
    /// "kv_connector_extra_config"}`; the environment variables
    /// `VLLM_MOONCAKE_BOOTSTRAP_PORT` and `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`
    /// are read from this process. Raises `ConfigError` naming the bad key.
    #[new]
    fn new(config_json: &str) -> Result<Self> {
        Ok(Self { inner: Settings::from_json(config_json, |k| std::env::var(k).ok())? })
    }

    /// `kv_role`.
    #[getter]
    fn role(&self) -> &'static str {
        self.inner.transfer.kv_role.as_str()
    }

    /// `engine_id`.
    #[getter]
    fn engine_id(&self) -> &str {
        self.inner.transfer.engine_id.as_str()
    }

    /// Keys of other vLLM connectors given in `kv_connector_extra_config`
    /// and ignored: `(key, connector)` pairs.
    #[getter]
    fn ignored_keys(&self) -> Vec<(String, &'static str)> {
        self.inner.transfer.ignored.clone()
    }

    /// `mooncake_protocol`.
    #[getter]
    fn protocol(&self) -> &'static str {
        kv_worker::transport::resolve_protocol(self.inner.transfer.protocol).as_str()
    }

    /// `num_workers`.
    #[getter]
    fn num_workers(&self) -> usize {
        self.inner.transfer.num_workers
    }

    /// Side-channel bootstrap port.
    #[getter]
    fn bootstrap_port(&self) -> u16 {
        self.inner.transfer.bootstrap_port
    }

    /// Seconds P holds blocks D never asks for.
    #[getter]
    fn abort_request_timeout(&self) -> f64 {
        self.inner.transfer.abort_request_timeout.as_secs_f64()
    }

    /// Seconds a prefill worker tries to register with the bootstrap
    /// server (`bootstrap_timeout`, or its default).
    #[getter]
    fn bootstrap_timeout(&self) -> f64 {
        self.inner.transfer.bootstrap_timeout.unwrap_or(kv_proto::DEFAULT_BOOTSTRAP_TIMEOUT).as_secs_f64()
    }

    /// `bootstrap_server_address` as `(host, port)`, if set: a bootstrap
    /// server outside the instance, which its prefill workers register with.
    #[getter]
    fn bootstrap_server_address(&self) -> Option<(String, u16)> {
        self.inner.transfer.bootstrap_server_address.as_ref().map(|url| (url.host().to_owned(), url.port()))
    }

    /// `advertised_host`, if set.
    #[getter]
    fn advertised_host(&self) -> Option<&str> {
        self.inner.transfer.advertised_host.as_deref()
    }

    /// `auth_secret_file`, if set.
    #[getter]
    fn auth_secret_file(&self) -> Option<String> {
        self.inner.transfer.auth_secret_file.as_ref().map(|p| p.display().to_string())
    }

    /// `tcp_authenticate_payloads` (false unless set).
    #[getter]
    fn tcp_authenticate_payloads(&self) -> bool {
        self.inner.transfer.tcp_authenticate_payloads
    }

    /// `host_staging`: `"auto"`, `"always"` or `"never"`.
    #[getter]
    fn host_staging(&self) -> &'static str {
        self.inner.transfer.host_staging.as_str()
    }

    /// `staging_bytes`, the default applied.
    #[getter]
    fn staging_bytes(&self) -> u64 {
        self.inner.transfer.staging_bytes
    }

    /// `staging_wait` in seconds, if set (else the worker's transfer timeout).
    #[getter]
    fn staging_wait(&self) -> Option<f64> {
        self.inner.transfer.staging_wait.map(|d| d.as_secs_f64())
    }

    /// The listener limits `kv_connector_extra_config` sets, by key
    /// (`side_channel_max_handshakes`, ..., `data_max_connections`); `None`
    /// where the worker's default holds.
    #[getter]
    fn listener_limits(&self) -> Vec<(&'static str, Option<usize>)> {
        let t = &self.inner.transfer;
        let (s, d) = (&t.side_channel_limits, &t.data_limits);
        vec![
            ("side_channel_max_handshakes", s.max_handshakes),
            ("side_channel_max_handshakes_per_host", s.max_handshakes_per_host),
            ("side_channel_max_connections", s.max_connections),
            ("data_max_handshakes", d.max_handshakes),
            ("data_max_handshakes_per_host", d.max_handshakes_per_host),
            ("data_max_connections", d.max_connections),
        ]
    }

    /// The listeners' handshake deadlines `kv_connector_extra_config` sets,
    /// in seconds (`side_channel_handshake_timeout`,
    /// `data_handshake_timeout`); `None` where the worker's default holds.
    #[getter]
    fn handshake_timeouts(&self) -> Vec<(&'static str, Option<f64>)> {
        let t = &self.inner.transfer;
        vec![
            ("side_channel_handshake_timeout", t.side_channel_limits.handshake_timeout.map(|d| d.as_secs_f64())),
            ("data_handshake_timeout", t.data_limits.handshake_timeout.map(|d| d.as_secs_f64())),
        ]
    }

    /// `staging_piece_bytes`, the default applied (0: whole requests).
    #[getter]
    fn staging_piece_bytes(&self) -> u64 {
        self.inner.transfer.staging_piece_bytes
    }

    /// The keys `kv_connector_extra_config` accepts, with what each means.
    #[staticmethod]
    fn known_keys() -> Vec<(&'static str, &'static str)> {
        EXTRA_KEYS.to_vec()
    }

    fn __repr__(&self) -> String {
        format!(
            "Settings(role={}, engine_id={:?}, protocol={}, num_workers={}, bootstrap_port={})",
            self.role(),
            self.engine_id(),
            self.protocol(),
            self.num_workers(),
            self.bootstrap_port()
        )
    }
}
