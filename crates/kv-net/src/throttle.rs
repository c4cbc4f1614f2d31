//! [`RefusalLog`]: the one rate limit on the log lines a peer can provoke
//! (refused connections and requests, connections ended badly, accept
//! errors), shared by every listener. One instance per kind of line: it lets
//! at most one line through per interval ([`LOG_INTERVAL`] unless told
//! otherwise) and counts those it holds back, so the next line can say how
//! many were left out. Time is an argument, so tests drive it with explicit
//! instants; the counting is kv-proto's [`LogThrottle`].

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use kv_proto::LogThrottle;

/// At most one log line per this interval for each kind a peer can provoke.
pub const LOG_INTERVAL: Duration = Duration::from_secs(1);

/// The rate limit of one kind of log line a peer can provoke. Shared by
/// reference among a listener's connection tasks (it locks inside, never
/// across an await).
#[derive(Debug)]
pub struct RefusalLog {
    throttle: Mutex<LogThrottle>,
}

impl Default for RefusalLog {
    /// At most one line per [`LOG_INTERVAL`].
    fn default() -> Self {
        Self::with_interval(LOG_INTERVAL)
    }
}

impl RefusalLog {
    /// At most one line per [`LOG_INTERVAL`].
    pub fn new() -> Self {
        Self::default()
    }

    /// At most one line per `interval`.
    pub fn with_interval(interval: Duration) -> Self {
        Self { throttle: Mutex::new(LogThrottle::new(interval)) }
    }

    /// Whether a line may be written at `now`: `Some` with how many were
    /// held back since the last one written (the caller puts it in the
    /// line's fields, as `suppressed`), or `None` (leave the line out; it is
    /// counted).
    pub fn allow(&self, now: Instant) -> Option<u64> {
        // A panic elsewhere while holding it leaves only a count behind.
        self.throttle.lock().unwrap_or_else(PoisonError::into_inner).allow(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offsets from the first event (ms) and what each gets.
    const STEPS: &[(u64, Option<u64>)] = &[
        (0, Some(0)),
        (1, None),
        (500, None),
        (999, None),
        // One interval after the first line: through, with the three held back.
        (1000, Some(3)),
        (1500, None),
        // Quiet for long: the count starts again from nothing.
        (10_000, Some(1)),
        (11_000, Some(0)),
    ];

    #[test]
    fn one_line_per_interval_with_the_count_held_back() {
        let t0 = Instant::now();
        let log = RefusalLog::new();
        for &(ms, expected) in STEPS {
            assert_eq!(log.allow(t0 + Duration::from_millis(ms)), expected, "at {ms} ms");
        }
    }

    #[test]
    fn the_interval_can_be_set() {
        let t0 = Instant::now();
        let log = RefusalLog::with_interval(Duration::from_secs(5));
        assert_eq!(log.allow(t0), Some(0));
        assert_eq!(log.allow(t0 + LOG_INTERVAL), None, "the default interval is not the one in force");
        assert_eq!(log.allow(t0 + Duration::from_secs(5)), Some(1));
    }

    #[test]
    fn instances_do_not_share_a_limit() {
        let t0 = Instant::now();
        let (refusals, faults) = (RefusalLog::new(), RefusalLog::new());
        assert_eq!(refusals.allow(t0), Some(0));
        assert_eq!(refusals.allow(t0), None);
        assert_eq!(faults.allow(t0), Some(0), "another kind of line");
    }

    #[test]
    fn shared_among_threads_every_event_is_written_or_counted() {
        let t0 = Instant::now();
        let log = RefusalLog::new();
        let written: usize = std::thread::scope(|scope| {
            let threads: Vec<_> =
                (0..4).map(|_| scope.spawn(|| (0..250).filter(|_| log.allow(t0).is_some()).count())).collect();
            threads.into_iter().map(|t| t.join().unwrap_or(0)).sum()
        });
        assert_eq!(written, 1);
        // 1000 events within one interval: one written, 999 held back.
        assert_eq!(log.allow(t0 + LOG_INTERVAL), Some(999));
    }
}
