//! Descriptors and live heap to come back to after a hostile case, peaks
//! under an attack, and running a test alone on a runtime of its own.

use std::future::Future;
use std::time::Duration;

use crate::{heap, process};

/// Bytes this process holds live through the allocator now.
pub fn heap_bytes() -> u64 {
    heap::live() as u64
}

/// Restarts the peak of live heap (and the largest single allocation)
/// from now; returns the live heap it starts from.
pub fn reset_peak_heap() -> u64 {
    heap::reset_peak();
    heap_bytes()
}

/// How much the live heap grew at most since [`reset_peak_heap`] returned
/// `from`.
pub fn peak_heap_growth(from: u64) -> u64 {
    (heap::peak() as u64).saturating_sub(from)
}

/// The largest single allocation (or reallocation's new size) since
/// [`reset_peak_heap`], on any thread.
pub fn largest_allocation() -> u64 {
    heap::largest() as u64
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    process::open_fds(std::process::id())
}

/// Restarts the peak of resident memory from now; returns the resident
/// memory it starts from.
pub fn reset_peak_rss() -> u64 {
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    process::rss_bytes(std::process::id())
}

/// How much resident memory grew at most since [`reset_peak_rss`] returned
/// `from`.
pub fn peak_rss_growth(from: u64) -> u64 {
    process::peak_rss_bytes(std::process::id()).saturating_sub(from)
}

/// Live heap a test may keep after it ends: what the runtime and the
/// transports keep for good once grown (tokio's slab of I/O registrations,
/// thread-local caches). A leaked op list, buffer or connection state of
/// the hostile cases is far larger (an op list under attack: 16 MiB).
pub const HEAP_SLACK: u64 = 4 << 20;

/// Descriptors and live heap at one moment, to come back to.
#[derive(Clone, Copy, Debug)]
pub struct Resources {
    /// Open file descriptors.
    pub fds: usize,
    /// Bytes live through the allocator.
    pub heap: u64,
}

impl Resources {
    /// This process's descriptors and live heap now.
    pub fn now() -> Self {
        Self { fds: open_fds(), heap: heap_bytes() }
    }

    fn reached_by(&self, now: &Self) -> bool {
        now.fds <= self.fds && now.heap <= self.heap + HEAP_SLACK
    }

    fn describe(&self, now: &Self, what: &str) -> String {
        format!(
            "{what}: {} descriptors and {} KiB of live heap, {} and {} KiB before",
            now.fds,
            now.heap >> 10,
            self.fds,
            self.heap >> 10
        )
    }

    /// Waits (at most `bound`) until this process has no more descriptors
    /// open than at `self`, and no more than [`HEAP_SLACK`] more live heap;
    /// panics naming `what` if it does not get there.
    pub async fn back(&self, what: &str, bound: Duration) {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let now = Self::now();
            if self.reached_by(&now) {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "{}", self.describe(&now, what));
            // Closing is asynchronous (tasks wind down on the runtime).
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// [`Resources::back`], outside a runtime.
    pub fn back_blocking(&self, what: &str, bound: Duration) {
        let deadline = std::time::Instant::now() + bound;
        loop {
            let now = Self::now();
            if self.reached_by(&now) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "{}", self.describe(&now, what));
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Runs `test` on a runtime of its own (two workers) while no other
/// isolated test of this binary runs, then checks (within `bound`) that the
/// process has no more descriptors and no more live heap than before: all
/// the test opened, hostile peers' connections included, is gone again. In
/// a binary that counts, every test runs this way, so no other test's
/// sockets or runtime disturb the count.
pub fn isolated(test: impl Future<Output = ()>, bound: Duration) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    static WARM: std::sync::Once = std::sync::Once::new();
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let runtime = || tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // What the first runtime of a process creates for good (tokio's signal
    // pipe, with the feature on; its global structures) is there before the
    // count.
    WARM.call_once(|| drop(runtime()));
    let before = Resources::now();
    let runtime = runtime();
    runtime.block_on(test);
    runtime.shutdown_timeout(bound);
    before.back_blocking("after the test and its runtime", bound);
}
