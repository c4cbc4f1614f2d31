//! The process's tokio runtime: created on first use (never at import), and
//! bound to the process that created it.
//!
//! vLLM forks its worker processes and may import this module in the parent.
//! A forked child inherits the runtime's memory but none of its threads, so
//! anything that waits on the runtime there would hang forever. Every entry
//! point therefore checks the creating pid first, without taking a lock (a
//! lock may have been held by a parent thread at fork time), and fails with
//! [`Error::Forked`] in a child.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// The runtime and the process that created it.
pub(crate) struct ProcessRuntime {
    pid: u32,
    runtime: tokio::runtime::Runtime,
}

impl ProcessRuntime {
    /// The runtime.
    pub(crate) fn get(&self) -> &tokio::runtime::Runtime {
        &self.runtime
    }
}

static RUNTIME: OnceLock<std::result::Result<ProcessRuntime, String>> = OnceLock::new();

/// Fails if `owner` is not this process.
pub(crate) fn check_pid(owner: u32) -> Result<()> {
    let current = std::process::id();
    if owner == current {
        Ok(())
    } else {
        Err(Error::Forked { owner, current })
    }
}

/// The pid of the process whose runtime exists, if one does.
pub(crate) fn owner() -> Option<u32> {
    match RUNTIME.get() {
        Some(Ok(rt)) => Some(rt.pid),
        _ => None,
    }
}

/// This process's runtime, created on first call.
pub(crate) fn runtime() -> Result<&'static ProcessRuntime> {
    if let Some(owner) = owner() {
        check_pid(owner)?;
    }
    let created = RUNTIME.get_or_init(|| {
        crate::logging::init();
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4));
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("kvlink-rt")
            .enable_all()
            .build()
            .map(|runtime| ProcessRuntime { pid: std::process::id(), runtime })
            .map_err(|e| e.to_string())
    });
    match created {
        Ok(rt) => {
            check_pid(rt.pid)?;
            Ok(rt)
        }
        Err(e) => Err(Error::Runtime(e.clone())),
    }
}
