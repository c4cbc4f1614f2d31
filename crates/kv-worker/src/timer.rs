//! Waiting for the deadline a sans-IO core names.

use std::time::Instant;

/// Returns at `at`, or never when there is no deadline (`None`).
pub(crate) async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
