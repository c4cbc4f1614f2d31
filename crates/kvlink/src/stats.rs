//! Latency percentiles and process resource figures for the demo and bench.

use std::time::Duration;

/// Sorted latency samples.
#[derive(Clone, Debug, Default)]
pub struct Latencies {
    samples: Vec<Duration>,
    sorted: bool,
}

impl Latencies {
    /// Adds one sample.
    pub fn record(&mut self, d: Duration) {
        self.samples.push(d);
        self.sorted = false;
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The `q` quantile (0.0..=1.0), nearest rank; zero when empty.
    pub fn quantile(&mut self, q: f64) -> Duration {
        if self.samples.is_empty() {
            return Duration::ZERO;
        }
        if !self.sorted {
            self.samples.sort_unstable();
            self.sorted = true;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.samples.len() as f64).ceil() as usize).clamp(1, self.samples.len());
        self.samples[rank - 1]
    }
}

/// CPU time (user + system) of this process so far.
pub fn process_cpu_time() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole `rusage` into the pointer on success;
    // the struct is zero-initialised, so it is valid even on failure.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Peak resident set size of this process, in bytes.
pub fn peak_rss_bytes() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: as in `process_cpu_time`.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    (usage.ru_maxrss as u64) * 1024
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut l = Latencies::default();
        assert_eq!(l.quantile(0.5), Duration::ZERO);
        for ms in [5u64, 1, 4, 2, 3] {
            l.record(Duration::from_millis(ms));
        }
        assert_eq!(l.quantile(0.5), Duration::from_millis(3));
        assert_eq!(l.quantile(0.99), Duration::from_millis(5));
        assert_eq!(l.quantile(0.0), Duration::from_millis(1));
    }
}
