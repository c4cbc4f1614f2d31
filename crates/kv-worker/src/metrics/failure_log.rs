//! D's log of failed pulls: the first failure of each cause at WARN, with
//! the cause, the peer and the reason; then at most one line per cause per
//! interval, with how many failed since the last line. A P that refuses
//! every pull costs a line every few seconds, never one per request, and
//! never silence.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kv_proto::{FailureCause, LogThrottle, ReqId};

/// How often each cause may log again.
pub(crate) const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub(crate) struct FailureLog {
    throttles: Mutex<Vec<LogThrottle>>,
}

impl Default for FailureLog {
    fn default() -> Self {
        let throttles = FailureCause::ALL.iter().map(|_| LogThrottle::new(FAILURE_LOG_INTERVAL)).collect();
        Self { throttles: Mutex::new(throttles) }
    }
}

impl FailureLog {
    /// Logs a failed pull of `req` (P's id `remote`) from `peer` at WARN,
    /// unless this cause did less than an interval ago (then at DEBUG).
    /// Returns `Some(failures left out since the last warning)` when it warned.
    pub(crate) fn failed(
        &self,
        cause: FailureCause,
        req: &ReqId,
        remote: &ReqId,
        peer: &dyn std::fmt::Display,
        reason: &str,
        now: Instant,
    ) -> Option<u64> {
        let allowed = {
            let mut throttles = self.throttles.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            throttles.get_mut(usize::from(cause.code())).and_then(|t| t.allow(now))
        };
        match allowed {
            Some(0) => {
                tracing::warn!(%cause, req_id = %req, remote_req_id = %remote, %peer, %reason, "KV pull failed; the engine recomputes the request")
            }
            Some(more) => {
                tracing::warn!(%cause, req_id = %req, remote_req_id = %remote, %peer, %reason, more_since_last_line = more, "KV pulls failed; the engine recomputes them")
            }
            None => tracing::debug!(%cause, req_id = %req, remote_req_id = %remote, %peer, %reason, "KV pull failed"),
        }
        allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_warns_first_then_once_per_interval_with_a_count() {
        let log = FailureLog::default();
        let (req, t0) = (ReqId::new("r"), Instant::now());
        let fail = |cause, at| log.failed(cause, &req, &req, &"p:1", "why", at);
        assert_eq!(fail(FailureCause::Timeout, t0), Some(0), "the first of a cause warns");
        assert_eq!(fail(FailureCause::AuthFailed, t0), Some(0), "causes are throttled apart");
        for i in 1..=50 {
            assert_eq!(fail(FailureCause::Timeout, t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(fail(FailureCause::Timeout, t0 + FAILURE_LOG_INTERVAL), Some(50), "then one line with the count");
    }
}
