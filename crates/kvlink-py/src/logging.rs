//! Log output: `tracing` events of every kvlink crate go to stderr, filtered
//! by the `KVLINK_LOG` environment variable (`tracing` filter syntax, default
//! `info`). Installed when the first scheduler or worker is created (vLLM
//! runs its scheduler in a process of its own once it has several workers,
//! and the scheduler's warnings must reach that process's log too), never
//! at import; if the process already has a global `tracing` subscriber,
//! that one is kept.
//!
//! Events are not forwarded to Python's `logging`: they are emitted on the
//! runtime's threads, which never touch Python objects.

use tracing_subscriber::EnvFilter;

/// Environment variable holding the log filter.
pub(crate) const ENV_LOG: &str = "KVLINK_LOG";

/// Installs the stderr subscriber, once per process (later calls do nothing).
pub(crate) fn init() {
    let filter = EnvFilter::try_from_env(ENV_LOG).unwrap_or_else(|_| EnvFilter::new("info"));
    // Fails only if a global subscriber exists already: keep that one.
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(true).try_init();
}
