//! D's renewals: while the engine will still pull a request it has seen, the
//! worker renews P's hold on it every third of P's renewal period, so P can
//! free a request no live decode instance wants within seconds. When is
//! [`RenewalSchedule`]'s decision; this task moves the messages and time.

mod schedule;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_proto::LogThrottle;
use tokio::sync::mpsc;

pub use schedule::{RenewalSchedule, Renewed};

use crate::receiver::SideChannelAddr;
use crate::worker::Shared;

/// At most one log line per this interval about failed renewals.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Renews until the worker shuts down.
pub(crate) async fn run(shared: Arc<Shared>) {
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(SideChannelAddr, Result<Duration, String>)>();
    let mut schedule = RenewalSchedule::new();
    let mut throttle = LogThrottle::new(LOG_INTERVAL);
    // What ended since the last turn: a renewal's result, if any.
    let mut ended: Option<(SideChannelAddr, Result<Duration, String>)> = None;
    loop {
        let changed = shared.watches_changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let now = Instant::now();
        if let Some((peer, result)) = ended.take() {
            let renewed = match result {
                Ok(renewal) => Renewed::Held(renewal),
                Err(reason) => {
                    if let Some(suppressed) = throttle.allow(now) {
                        tracing::warn!(%peer, %reason, suppressed, "cannot renew requests on prefill");
                    }
                    Renewed::Failed
                }
            };
            schedule.handle_done(&peer, renewed, now);
        }
        let due = schedule.poll_due(&shared.lock_watches(), now);
        for (peer, reqs) in due {
            let client = shared.client(&peer);
            let bound = shared.config.connect_timeout;
            let done = done_tx.clone();
            let task_shared = shared.clone();
            shared.tracker.spawn(async move {
                let result = match tokio::time::timeout(bound, client.keep_alive(&reqs)).await {
                    Ok(Ok(renewal)) => {
                        if !renewal.is_zero() {
                            task_shared.metrics.renewals_sent(reqs.len() as u64);
                        }
                        Ok(renewal)
                    }
                    Ok(result) => result,
                    Err(_) => Err(format!("renewing on {peer} took longer than {bound:?}")),
                };
                let _ = done.send((peer, result));
            });
        }
        tokio::select! {
            () = shared.cancel.cancelled() => return,
            () = &mut changed => {}
            Some(result) = done_rx.recv() => ended = Some(result),
            () = crate::timer::sleep_until(schedule.poll_timeout()) => {}
        }
    }
}
