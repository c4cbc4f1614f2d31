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

/// What a process holds right now, for soak runs: resident memory, open
/// descriptors, threads and live tokio tasks. Read from `/proc/self` (Linux);
/// a figure that cannot be read is 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcessFigures {
    /// Resident set (`VmRSS`), bytes.
    pub rss_bytes: u64,
    /// Open file descriptors (entries of `/proc/self/fd`, less the one
    /// reading it).
    pub open_fds: u64,
    /// Threads of the process.
    pub threads: u64,
    /// Tasks alive on the current tokio runtime (0 outside one).
    pub tokio_tasks: u64,
}

impl ProcessFigures {
    /// Samples this process now.
    pub fn sample() -> Self {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        // `read_dir` holds one descriptor on the directory while listing it.
        let open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64).saturating_sub(1);
        let tokio_tasks = tokio::runtime::Handle::try_current().map_or(0, |h| h.metrics().num_alive_tasks() as u64);
        Self { rss_bytes: field("VmRSS:") * 1024, open_fds, threads: field("Threads:"), tokio_tasks }
    }

    /// Samples once at most `tasks` tokio tasks are alive, or when `bound`
    /// has passed: a task that has just returned its result is counted
    /// until its thread releases it, a moment later.
    pub async fn settled(tasks: u64, bound: std::time::Duration) -> Self {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let figures = Self::sample();
            if figures.tokio_tasks <= tasks || tokio::time::Instant::now() >= deadline {
                return figures;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }
}

/// `rss_bytes=N open_fds=N threads=N tokio_tasks=N`, as `kvlink serve
/// --figures` prints it.
impl std::fmt::Display for ProcessFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rss_bytes={} open_fds={} threads={} tokio_tasks={}",
            self.rss_bytes, self.open_fds, self.threads, self.tokio_tasks
        )
    }
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

    #[tokio::test]
    async fn figures_see_this_process() {
        let before = ProcessFigures::sample();
        assert!(before.rss_bytes > 0 && before.threads > 0, "{before:?}");
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move { rx.await.ok() });
        let during = ProcessFigures::sample();
        assert_eq!(during.open_fds, before.open_fds + 1, "{before:?} {during:?}");
        assert_eq!(during.tokio_tasks, before.tokio_tasks + 1, "{before:?} {during:?}");
        drop(file);
        tx.send(()).unwrap();
        task.await.unwrap();
        assert_eq!(ProcessFigures::sample().open_fds, before.open_fds);
    }
}
