//! D's decisions about its side-channel connections that depend on time
//! (sans-IO, explicit time): whether a connection may carry another request
//! or must be retired before P closes it for idleness, and how long P's
//! refusal is taken as its answer.

use std::time::{Duration, Instant};

/// How long a prefill worker's refusal (incompatible cache or protocol, a
/// secret that does not match) is taken as its answer without asking again:
/// pulls fail at once with its reason, and the refusal is logged once per
/// this period, not once per request.
pub(crate) const REFUSAL_MEMORY: Duration = Duration::from_secs(5);

/// When a connection was last used, and how idle it may get.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Idleness {
    last_active: Instant,
    /// Retired once idle this long (half of P's idle timeout), before P
    /// closes it under a request in flight.
    retire_after: Duration,
}

impl Idleness {
    /// A connection opened at `now` on a P that closes connections idle
    /// for `idle_timeout`.
    pub(crate) fn new(idle_timeout: Duration, now: Instant) -> Self {
        Self { last_active: now, retire_after: idle_timeout / 2 }
    }

    /// A request was sent or a reply received at `now`.
    pub(crate) fn touch(&mut self, now: Instant) {
        self.last_active = self.last_active.max(now);
    }

    /// Whether the connection may carry another request at `now`, with
    /// `in_flight` requests on it: one that waits for replies is in use;
    /// an idle one only until it is idle for half P's idle timeout.
    pub(crate) fn usable(&self, in_flight: usize, now: Instant) -> bool {
        in_flight > 0 || now.saturating_duration_since(self.last_active) < self.retire_after
    }
}

/// P's last refusal, while it stands.
#[derive(Clone, Debug)]
pub(crate) struct RefusalMemory<E> {
    last: Option<(Instant, E)>,
}

impl<E: Clone> RefusalMemory<E> {
    /// Nothing refused yet.
    pub(crate) fn new() -> Self {
        Self { last: None }
    }

    /// P refused at `now` with `error`.
    pub(crate) fn remember(&mut self, error: E, now: Instant) {
        self.last = Some((now, error));
    }

    /// P's refusal, if it came less than [`REFUSAL_MEMORY`] before `now`
    /// (an older one is forgotten).
    pub(crate) fn recent(&mut self, now: Instant) -> Option<E> {
        match &self.last {
            Some((at, error)) if now.saturating_duration_since(*at) < REFUSAL_MEMORY => Some(error.clone()),
            _ => {
                self.last = None;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A connection opened at 0 and last used at `touched`: whether it may
    /// carry a request at `at` with `in_flight` requests on it. P closes it
    /// after 30 s idle; D retires it after 15.
    #[rstest]
    #[case::fresh(None, 0, ms(0), true)]
    #[case::idle_just_under_half_the_timeout(None, 0, ms(14_999), true)]
    #[case::idle_half_the_timeout_is_retired(None, 0, ms(15_000), false)]
    #[case::in_use_is_never_retired(None, 1, ms(60_000), true)]
    #[case::a_reply_restarts_the_idle_time(Some(ms(10_000)), 0, ms(24_999), true)]
    #[case::idle_after_the_last_reply(Some(ms(10_000)), 0, ms(25_000), false)]
    #[case::an_older_touch_does_not_move_it_back(Some(ms(0)), 0, ms(14_999), true)]
    fn idleness(
        #[case] touched: Option<Duration>,
        #[case] in_flight: usize,
        #[case] at: Duration,
        #[case] usable: bool,
    ) {
        let t0 = Instant::now();
        let mut idle = Idleness::new(IDLE_TIMEOUT, t0);
        if let Some(touched) = touched {
            idle.touch(t0 + touched);
            idle.touch(t0);
        }
        assert_eq!(idle.usable(in_flight, t0 + at), usable);
    }

    /// A refusal at 0 stands until `REFUSAL_MEMORY` has passed, then is
    /// forgotten; a later one stands from its own time.
    #[rstest]
    #[case::at_once(ms(0), true)]
    #[case::just_before_it_ends(REFUSAL_MEMORY - ms(1), true)]
    #[case::when_it_ends(REFUSAL_MEMORY, false)]
    #[case::long_after(REFUSAL_MEMORY * 10, false)]
    fn refusal_memory(#[case] at: Duration, #[case] stands: bool) {
        let t0 = Instant::now();
        let mut memory = RefusalMemory::new();
        assert_eq!(memory.recent(t0), None::<&str>);
        memory.remember("no", t0);
        assert_eq!(memory.recent(t0 + at), stands.then_some("no"));
        if !stands {
            assert_eq!(memory.recent(t0), None, "a refusal that ran out is forgotten");
        }
    }
}
