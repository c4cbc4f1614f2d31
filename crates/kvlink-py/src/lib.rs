//! `kvlink_vllm._native`: kvlink's scheduler and worker for the Python
//! package that vLLM loads as a KV connector.
//!
//! - `sched`: `Scheduler`, the sans-IO scheduler side (no thread, no runtime);
//! - `worker`: `Worker`, a kv-worker over the engine's KV cache, or over
//!   host staging in front of it, which the caller describes with plain
//!   integers (see its safety contract);
//! - `settings` / `config`: `Settings`, `--kv-transfer-config` with every
//!   `kv_connector_extra_config` key checked;
//! - `engine`: the only module that calls kv-worker's API;
//! - `step`: the per-step metadata envelope and what may be reported to vLLM;
//! - `metrics`: the worker's metric families as Python data, by interval
//!   (and `zero_metrics()`, every family at zero);
//! - `bootstrap`: `BootstrapServer` and `register_with_bootstrap`, P's
//!   bootstrap server (vLLM's Mooncake deployment contract) and its
//!   workers' registrations;
//! - `runtime`: the lazily created, process-bound tokio runtime (fork guard).
//!
//! Importing the module starts no thread; the runtime and the log subscriber
//! are created when the first worker starts. No Python object is touched from
//! the runtime's threads.

mod bootstrap;
mod config;
mod engine;
mod error;
mod logging;
mod metrics;
mod runtime;
mod sched;
mod settings;
mod step;
mod worker;

use pyo3::prelude::*;

/// The pid of the process that created this module's runtime, or `None` if
/// no worker was started in this process's lineage.
#[pyfunction]
fn runtime_owner_pid() -> Option<u32> {
    runtime::owner()
}

/// The transports compiled into this build.
#[pyfunction]
fn compiled_protocols() -> Vec<&'static str> {
    kv_worker::transport::compiled_in().into_iter().map(kv_proto::Protocol::as_str).collect()
}

/// Every metric family at zero, as a worker that has done nothing reports
/// them (the shape of `Worker.metrics()`): what exporters register before
/// any worker reports.
#[pyfunction]
fn zero_metrics(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyList>> {
    metrics::families_to_py(py, &kv_worker::metrics::MetricsSnapshot::zero())
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("KvlinkError", py.get_type::<error::KvlinkError>())?;
    m.add("ConfigError", py.get_type::<error::ConfigError>())?;
    m.add("ForkError", py.get_type::<error::ForkError>())?;
    m.add_class::<settings::PySettings>()?;
    m.add_class::<sched::PyScheduler>()?;
    m.add_class::<worker::PyWorker>()?;
    m.add_class::<bootstrap::PyBootstrapServer>()?;
    m.add_function(wrap_pyfunction!(bootstrap::register_with_bootstrap, m)?)?;
    m.add_function(wrap_pyfunction!(runtime_owner_pid, m)?)?;
    m.add_function(wrap_pyfunction!(compiled_protocols, m)?)?;
    m.add_function(wrap_pyfunction!(zero_metrics, m)?)?;
    Ok(())
}
