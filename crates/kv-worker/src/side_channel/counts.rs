//! Live side-channel connections per peer host, peers that failed
//! authentication and frames that failed their tag: what the metrics read.
//! Touched once per connection opened or closed, never per message.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Shared by the worker's side-channel server and clients.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    open: Mutex<BTreeMap<String, u64>>,
    auth_failures: AtomicU64,
    tag_failures: AtomicU64,
}

impl Counts {
    /// A connection to or from `host` is open until the guard drops.
    pub(crate) fn opened(self: &Arc<Self>, host: &str) -> OpenConnection {
        *self.lock().entry(host.to_owned()).or_default() += 1;
        OpenConnection { counts: self.clone(), host: host.to_owned() }
    }

    /// A peer failed authentication (either way).
    pub(crate) fn auth_failed(&self) {
        self.auth_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn auth_failures(&self) -> u64 {
        self.auth_failures.load(Ordering::Relaxed)
    }

    /// A frame after the handshake failed its tag (either way): altered or
    /// injected on the path; the connection ended.
    pub(crate) fn tag_failed(&self) {
        self.tag_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn tag_failures(&self) -> u64 {
        self.tag_failures.load(Ordering::Relaxed)
    }

    /// Open connections per host now.
    pub(crate) fn open(&self) -> BTreeMap<String, u64> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, u64>> {
        self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One open connection; counted while it lives.
#[derive(Debug)]
pub(crate) struct OpenConnection {
    counts: Arc<Counts>,
    host: String,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        let mut open = self.counts.lock();
        if let Some(n) = open.get_mut(&self.host) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.host);
            }
        }
    }
}
