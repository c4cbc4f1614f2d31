//! D's renewals: while the engine will still pull a request it has seen, the
//! worker renews P's hold on it every third of P's renewal period, so P can
//! free a request no live decode instance wants within seconds.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_proto::{LogThrottle, ReqId};
use tokio::sync::mpsc;

use crate::receiver::SideChannelAddr;
use crate::worker::Shared;

/// Next try after a failed renewal (P unreachable, connection refused).
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// Next look at a prefill worker that takes no renewals (its settings may
/// change with a restart).
const UNRENEWED_RECHECK: Duration = Duration::from_secs(60);
/// At most one log line per this interval about failed renewals.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// When each prefill worker is due its next renewal.
#[derive(Default)]
struct Schedule {
    next_due: HashMap<SideChannelAddr, Instant>,
    sending: HashSet<SideChannelAddr>,
}

/// Renews until the worker shuts down.
pub(crate) async fn run(shared: Arc<Shared>) {
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<(SideChannelAddr, Result<Duration, String>)>();
    let mut schedule = Schedule::default();
    let mut throttle = LogThrottle::new(LOG_INTERVAL);
    loop {
        let changed = shared.watches_changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let now = Instant::now();
        let due: Vec<(SideChannelAddr, Vec<ReqId>)> = {
            let watches = shared.lock_watches();
            schedule.next_due.retain(|peer, _| watches.watches_on(peer));
            watches
                .by_peer()
                .filter(|(peer, _)| !schedule.sending.contains(*peer))
                .filter(|(peer, _)| schedule.next_due.get(*peer).is_none_or(|due| *due <= now))
                .map(|(peer, reqs)| (peer.clone(), reqs))
                .collect()
        };
        for (peer, reqs) in due {
            schedule.sending.insert(peer.clone());
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
        let wake_at = schedule.next_due.values().min().copied();
        tokio::select! {
            () = shared.cancel.cancelled() => return,
            () = &mut changed => {}
            Some((peer, result)) = done_rx.recv() => {
                schedule.sending.remove(&peer);
                let after = match result {
                    Ok(renewal) if renewal.is_zero() => UNRENEWED_RECHECK,
                    Ok(renewal) => renewal / 3,
                    Err(reason) => {
                        if let Some(suppressed) = throttle.allow(Instant::now()) {
                            tracing::warn!(%peer, %reason, suppressed, "cannot renew requests on prefill");
                        }
                        RETRY_AFTER
                    }
                };
                schedule.next_due.insert(peer, Instant::now() + after);
            }
            () = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}
