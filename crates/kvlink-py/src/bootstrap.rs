//! P's bootstrap server and its workers' registrations, for Python: the
//! HTTP contract vLLM's Mooncake deployment (and the routers speaking it)
//! reads P's workers from (`kv_worker::bootstrap`). One server per
//! instance, on the prefill worker the connector chooses; every prefill
//! worker registers its side channel with it.

use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

use kv_proto::bootstrap::{BootstrapUrl, Expected, Registration, WorkerAddr};
use kv_proto::EngineId;
use kv_worker::bootstrap::{client, BootstrapHandle, BootstrapServer, RunningBootstrap};
use pyo3::prelude::*;

use crate::error::{Error, Result};
use crate::runtime::{self, ProcessRuntime};
use crate::settings::PySettings;

/// The bootstrap server of one prefill instance, serving until `stop`.
#[pyclass(name = "BootstrapServer", module = "kvlink_vllm._native", frozen)]
pub(crate) struct PyBootstrapServer {
    runtime: &'static ProcessRuntime,
    handle: BootstrapHandle,
    local: SocketAddr,
    running: Mutex<Option<RunningBootstrap>>,
}

fn registration(
    engine_id: &str,
    dp_rank: u32,
    tp_rank: u32,
    pp_rank: u32,
    host: &str,
    port: u16,
) -> Result<Registration> {
    let addr = WorkerAddr::new(host, port).map_err(|e| Error::Bootstrap(e.to_string()))?;
    Ok(Registration { engine_id: EngineId::new(engine_id), dp_rank, tp_rank, pp_rank, addr })
}

#[pymethods]
impl PyBootstrapServer {
    /// Binds `host:port` and serves the registry of `dp_size` data-parallel
    /// engines of `tp_size * pp_size` workers each; a registration must
    /// carry a proof when `settings` name a shared secret.
    #[new]
    fn new(
        py: Python<'_>,
        settings: &PySettings,
        host: &str,
        port: u16,
        dp_size: u32,
        tp_size: u32,
        pp_size: u32,
    ) -> Result<Self> {
        let runtime = runtime::runtime()?;
        let expected = Expected::new(dp_size, tp_size, pp_size).map_err(|e| Error::Bootstrap(e.to_string()))?;
        let ip: IpAddr =
            host.parse().map_err(|_| Error::Config(format!("bootstrap server host {host:?} is not an IP address")))?;
        let addr = SocketAddr::new(ip, port);
        let secret = settings.inner().auth_secret.clone();
        let server =
            py.detach(|| runtime.get().block_on(BootstrapServer::bind(addr, expected, secret))).map_err(|e| {
                Error::Bootstrap(format!(
                    "{e} (the prefill instance's bootstrap port: VLLM_MOONCAKE_BOOTSTRAP_PORT; each prefill instance \
                     on a host needs its own)"
                ))
            })?;
        let (local, handle) = (server.local_addr(), server.handle());
        let running = {
            let _guard = runtime.get().enter();
            server.spawn()
        };
        tracing::info!(bootstrap = %local, workers = %expected, "kvlink bootstrap server listening");
        Ok(Self { runtime, handle, local, running: Mutex::new(Some(running)) })
    }

    /// The port it listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.local.port()
    }

    /// Registers a worker of this process without HTTP (the same checks).
    fn register(&self, engine_id: &str, dp_rank: u32, tp_rank: u32, pp_rank: u32, host: &str, port: u16) -> Result<()> {
        let reg = registration(engine_id, dp_rank, tp_rank, pp_rank, host, port)?;
        self.handle.register(&reg).map_err(|e| Error::Bootstrap(e.to_string()))
    }

    /// Whether every expected worker has registered.
    #[getter]
    fn is_complete(&self) -> bool {
        self.handle.is_complete()
    }

    /// Stops serving (open connections are ended) and waits for it.
    fn stop(&self, py: Python<'_>) -> Result<()> {
        runtime::check_pid(std::process::id())?;
        let running = self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if let Some(running) = running {
            py.detach(|| self.runtime.get().block_on(running.stop()));
        }
        Ok(())
    }
}

/// Registers a prefill worker's side channel (`host:port`) with the
/// bootstrap server at `url` (`http://host:port`), retrying within
/// `timeout_s` while it is not up yet; with the proof `settings`' secret
/// makes, if any.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(crate) fn register_with_bootstrap(
    py: Python<'_>,
    settings: &PySettings,
    url: &str,
    engine_id: &str,
    dp_rank: u32,
    tp_rank: u32,
    pp_rank: u32,
    host: &str,
    port: u16,
    timeout_s: f64,
) -> Result<()> {
    let runtime = runtime::runtime()?;
    let url = BootstrapUrl::parse(url).map_err(|e| Error::Config(format!("bootstrap server address: {e}")))?;
    let reg = registration(engine_id, dp_rank, tp_rank, pp_rank, host, port)?;
    let timeout = Duration::try_from_secs_f64(timeout_s)
        .map_err(|_| Error::Config(format!("bootstrap registration timeout {timeout_s} is not a duration")))?;
    let secret = settings.inner().auth_secret.clone();
    py.detach(|| runtime.get().block_on(client::register(&url, &reg, secret.as_ref(), timeout)))
        .map_err(|e| Error::Bootstrap(format!("cannot register with {url}: {e}")))
}
