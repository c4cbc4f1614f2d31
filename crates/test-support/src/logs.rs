//! [`Logs`]: the log lines a test provokes, captured to count and read.

use std::sync::{Arc, Mutex};

use tracing::subscriber::DefaultGuard;

/// Log lines captured by a test's subscriber.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// Captures every event at `level` and above from this thread until
    /// the guard drops (a current-thread runtime's tasks all log here).
    pub fn capture(level: tracing::Level) -> (Self, DefaultGuard) {
        let logs = Self::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(level)
            .with_writer(move || writer.clone())
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    /// Captures every event at `level` and above, from every thread, from
    /// now on: the process's global subscriber, so a binary using it has
    /// one test.
    pub fn install(level: tracing::Level) -> Self {
        let logs = Self::default();
        let writer = logs.clone();
        tracing_subscriber::fmt().with_ansi(false).with_max_level(level).with_writer(move || writer.clone()).init();
        logs
    }

    /// Like [`Logs::install`], for what the `tracing` filter `filter` lets
    /// through (the syntax of `KVLINK_LOG`).
    pub fn install_filter(filter: &str) -> Self {
        let logs = Self::default();
        let writer = logs.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(move || writer.clone())
            .init();
        logs
    }

    /// Lines holding every one of `needles`.
    pub fn lines_with(&self, needles: &[&str]) -> usize {
        self.text().lines().filter(|line| needles.iter().all(|n| line.contains(n))).count()
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)).into_owned()
    }
}
