//! A rate limit for log lines a peer can provoke (accept failures, refused
//! connections): at most one line per interval, with the count of the ones
//! left out. Time is an argument; nothing here reads a clock.

use std::time::{Duration, Instant};

/// Lets one event through per `interval` and counts the rest.
#[derive(Debug, Clone)]
pub struct LogThrottle {
    interval: Duration,
    next: Option<Instant>,
    suppressed: u64,
}

impl LogThrottle {
    /// At most one line per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self { interval, next: None, suppressed: 0 }
    }

    /// Whether to log an event at `now`: `Some(n)` with the number of events
    /// left out since the last line, or `None` to stay quiet.
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.next {
            Some(next) if now < next => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.next = Some(now + self.interval);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_left_out() {
        let t0 = Instant::now();
        let mut throttle = LogThrottle::new(Duration::from_secs(1));
        assert_eq!(throttle.allow(t0), Some(0));
        for i in 1..=1000 {
            assert_eq!(throttle.allow(t0 + Duration::from_micros(i)), None);
        }
        assert_eq!(throttle.allow(t0 + Duration::from_secs(1)), Some(1000));
        assert_eq!(throttle.allow(t0 + Duration::from_millis(1500)), None);
    }
}
