//! The errors of the native module and their Python exception classes.

use pyo3::PyErr;

pyo3::create_exception!(_native, KvlinkError, pyo3::exceptions::PyRuntimeError, "Base class of every kvlink error.");
pyo3::create_exception!(
    _native,
    ConfigError,
    KvlinkError,
    "An invalid kvlink setting (kv-transfer-config, environment, or KV cache layout)."
);
pyo3::create_exception!(
    _native,
    ForkError,
    KvlinkError,
    "kvlink was used in a process forked after its parent started a kvlink worker."
);

/// Everything the native module can refuse or fail at.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// A setting is invalid; the message names it.
    #[error("{0}")]
    Config(String),
    /// The call runs in a forked child of the process that owns the runtime.
    #[error(
        "kvlink: this process (pid {current}) was forked from pid {owner} after that process started a kvlink \
         worker; the worker's threads do not exist here, so this call cannot work. Create the connector in the \
         child itself, or start worker processes with the 'spawn' method (VLLM_WORKER_MULTIPROC_METHOD=spawn)"
    )]
    Forked {
        /// The process that created the runtime (or the worker).
        owner: u32,
        /// This process.
        current: u32,
    },
    /// The worker was shut down.
    #[error("kvlink worker is shut down")]
    ShutDown,
    /// The worker could not start.
    #[error("kvlink worker could not start: {0}")]
    Start(#[from] kv_worker::WorkerError),
    /// The tokio runtime could not be created.
    #[error("kvlink could not create its runtime: {0}")]
    Runtime(String),
    /// The OS random source failed: the scheduler cannot mint renewal keys.
    #[error("kvlink: the operating system's random source failed; no renewal key can be minted")]
    NoRandom,
    /// P's bootstrap server could not start, or a worker could not register
    /// with it.
    #[error("kvlink bootstrap: {0}")]
    Bootstrap(String),
    /// Metadata handed to the worker is not what this version's scheduler builds.
    #[error("kvlink connector metadata cannot be decoded: {0}")]
    Metadata(String),
}

impl From<kv_proto::ConfigError> for Error {
    fn from(e: kv_proto::ConfigError) -> Self {
        Error::Config(e.to_string())
    }
}

impl From<kv_proto::ParamsError> for Error {
    fn from(e: kv_proto::ParamsError) -> Self {
        Error::Config(e.to_string())
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> Self {
        let text = e.to_string();
        match e {
            Error::Config(_) => ConfigError::new_err(text),
            Error::Forked { .. } => ForkError::new_err(text),
            Error::Start(kv_worker::WorkerError::Layout(_) | kv_worker::WorkerError::TransportNotCompiled { .. }) => {
                ConfigError::new_err(text)
            }
            _ => KvlinkError::new_err(text),
        }
    }
}

/// The result type of the native module.
pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;
