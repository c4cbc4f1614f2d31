//! [`Changes`]: the signal that something became available to the engine's
//! `get_finished` (a pull or a piece of one landed, a transfer ended), for
//! the worker's async waiters and for an engine thread that blocks for it.
//!
//! A staged engine's copy thread waits here, bounded, instead of sleeping
//! between polls, so a landed piece is copied on, and a freed slot handed
//! on, as soon as the worker hears of it.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// A change count with a blocking and an async way to wait for the next.
#[derive(Debug, Default)]
pub struct Changes {
    count: Mutex<u64>,
    changed: Condvar,
    notify: Notify,
}

impl Changes {
    /// Something changed: the count moves on and every waiter wakes.
    pub fn signal(&self) {
        let mut count = self.lock();
        *count = count.wrapping_add(1);
        drop(count);
        self.changed.notify_all();
        self.notify.notify_waiters();
    }

    /// The count now: read it before looking at the worker, then wait past it.
    pub fn count(&self) -> u64 {
        *self.lock()
    }

    /// Blocks the calling thread until the count is no longer `seen` or
    /// `timeout` passed, and returns the count then. For engine threads,
    /// never for a task on the worker's runtime.
    pub fn wait_past(&self, seen: u64, timeout: Duration) -> u64 {
        let (count, _) = self
            .changed
            .wait_timeout_while(self.lock(), timeout, |count| *count == seen)
            .unwrap_or_else(PoisonError::into_inner);
        *count
    }

    /// Completes at the next [`Changes::signal`] (enable it before looking
    /// at the worker, as with [`Notify::notified`]).
    pub(crate) fn notified(&self) -> Notified<'_> {
        self.notify.notified()
    }

    fn lock(&self) -> MutexGuard<'_, u64> {
        self.count.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_wait_past_an_old_count_returns_at_once() {
        let changes = Changes::default();
        let seen = changes.count();
        changes.signal();
        assert_eq!(changes.wait_past(seen, Duration::from_secs(3600)), seen + 1);
    }

    #[test]
    fn a_wait_ends_at_the_signal_or_at_its_bound() {
        let changes = Arc::new(Changes::default());
        let seen = changes.count();
        assert_eq!(changes.wait_past(seen, Duration::from_millis(1)), seen, "nothing changed: the bound ends it");
        let signaller = {
            let changes = changes.clone();
            std::thread::spawn(move || changes.signal())
        };
        assert_eq!(changes.wait_past(seen, Duration::from_secs(3600)), seen + 1);
        signaller.join().expect("the signalling thread ran");
    }
}
