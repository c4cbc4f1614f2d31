//! What the worker counts: pulls and their failures by cause (D), requests
//! served, bytes, waits and holds (P), and what its transport and side
//! channel refused. Counters and histograms are relaxed atomics bumped once
//! per request or batch (never per op or byte); gauges are read when a
//! snapshot is taken.
//!
//! [`MetricsSnapshot`] is the one type the engine, the CLI and tests read;
//! [`MetricsSnapshot::families`] names and describes every metric once, for
//! every exporter.

mod failure_log;
mod families;
mod histogram;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub(crate) use failure_log::FailureLog;
pub use families::{Family, MetricKind, Sample};
use histogram::Histogram;
pub use histogram::{HistogramSnapshot, BYTES_BOUNDS, COUNT_BOUNDS, SECONDS_BOUNDS};
pub use kv_proto::{BatchRefusal, FailureCause};

const CAUSES: usize = FailureCause::ALL.len();

/// Where a cause's counter lives (codes are dense from 0).
fn slot(cause: FailureCause) -> usize {
    usize::from(cause.code()).min(CAUSES - 1)
}

/// The worker's counters and histograms.
#[derive(Debug)]
pub(crate) struct Metrics {
    pulls_started: AtomicU64,
    pulls_received: AtomicU64,
    pulls_failed: [AtomicU64; CAUSES],
    pulls_cancelled: AtomicU64,
    bytes_received: AtomicU64,
    pull_seconds: Histogram,
    pull_bytes: Histogram,
    sends_done: AtomicU64,
    sends_failed: [AtomicU64; CAUSES],
    bytes_sent: AtomicU64,
    ops_per_batch: Histogram,
    batch_write_seconds: Histogram,
    send_wait_seconds: Histogram,
    renewals_sent: AtomicU64,
    staging: StagingCells,
}

/// Host staging's figures (see [`StagingFigures`]), as a staged worker
/// last published them.
#[derive(Debug, Default)]
struct StagingCells {
    slots: AtomicU64,
    free_slots: AtomicU64,
    requests: AtomicU64,
    waiting: AtomicU64,
    waits: AtomicU64,
    exhausted: AtomicU64,
    copies_failed_to_staging: AtomicU64,
    copies_failed_to_device: AtomicU64,
}

/// What host staging holds and did (all zero without staging). Gauges are
/// the value now, counters count since the worker started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingFigures {
    /// Slots in all (a slot holds one block of every region).
    pub slots: u64,
    /// Slots free now.
    pub free_slots: u64,
    /// Requests holding or waiting for slots now.
    pub requests: u64,
    /// Requests waiting for slots now.
    pub waiting: u64,
    /// Requests that found no free slots and waited (counter).
    pub waits: u64,
    /// Requests that found no room within the bound, or needed more slots
    /// than there are (counter).
    pub exhausted: u64,
    /// Copies of the engine's blocks into slots that failed (P, counter).
    pub copies_failed_to_staging: u64,
    /// Copies of slots into the engine's blocks that failed (D, counter).
    pub copies_failed_to_device: u64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            pulls_started: AtomicU64::new(0),
            pulls_received: AtomicU64::new(0),
            pulls_failed: [const { AtomicU64::new(0) }; CAUSES],
            pulls_cancelled: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            pull_seconds: Histogram::new(SECONDS_BOUNDS),
            pull_bytes: Histogram::new(BYTES_BOUNDS),
            sends_done: AtomicU64::new(0),
            sends_failed: [const { AtomicU64::new(0) }; CAUSES],
            bytes_sent: AtomicU64::new(0),
            ops_per_batch: Histogram::new(COUNT_BOUNDS),
            batch_write_seconds: Histogram::new(SECONDS_BOUNDS),
            send_wait_seconds: Histogram::new(SECONDS_BOUNDS),
            renewals_sent: AtomicU64::new(0),
            staging: StagingCells::default(),
        }
    }
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

fn by_cause(counters: &[AtomicU64; CAUSES]) -> BTreeMap<FailureCause, u64> {
    FailureCause::ALL.iter().map(|&cause| (cause, load(&counters[slot(cause)]))).collect()
}

impl Metrics {
    pub(crate) fn pulls_started(&self, requests: u64) {
        add(&self.pulls_started, requests);
    }

    pub(crate) fn pull_received(&self, bytes: u64, took: Duration) {
        add(&self.pulls_received, 1);
        add(&self.bytes_received, bytes);
        self.pull_seconds.observe(took.as_secs_f64());
        self.pull_bytes.observe(bytes as f64);
    }

    pub(crate) fn pull_failed(&self, cause: FailureCause) {
        add(&self.pulls_failed[slot(cause)], 1);
    }

    pub(crate) fn pulls_cancelled(&self, requests: u64) {
        add(&self.pulls_cancelled, requests);
    }

    pub(crate) fn batch_written(&self, ops: usize, bytes: u64, took: Duration, ok: bool) {
        self.ops_per_batch.observe(ops as f64);
        self.batch_write_seconds.observe(took.as_secs_f64());
        if ok {
            add(&self.bytes_sent, bytes);
        }
    }

    pub(crate) fn send_done(&self) {
        add(&self.sends_done, 1);
    }

    pub(crate) fn send_failed(&self, cause: FailureCause) {
        add(&self.sends_failed[slot(cause)], 1);
    }

    pub(crate) fn send_waited(&self, ready_for: Duration) {
        self.send_wait_seconds.observe(ready_for.as_secs_f64());
    }

    pub(crate) fn renewals_sent(&self, requests: u64) {
        add(&self.renewals_sent, requests);
    }

    pub(crate) fn set_staging(&self, f: StagingFigures) {
        let c = &self.staging;
        for (cell, value) in [
            (&c.slots, f.slots),
            (&c.free_slots, f.free_slots),
            (&c.requests, f.requests),
            (&c.waiting, f.waiting),
            (&c.waits, f.waits),
            (&c.exhausted, f.exhausted),
            (&c.copies_failed_to_staging, f.copies_failed_to_staging),
            (&c.copies_failed_to_device, f.copies_failed_to_device),
        ] {
            cell.store(value, Ordering::Relaxed);
        }
    }

    fn staging(&self) -> StagingFigures {
        let c = &self.staging;
        StagingFigures {
            slots: load(&c.slots),
            free_slots: load(&c.free_slots),
            requests: load(&c.requests),
            waiting: load(&c.waiting),
            waits: load(&c.waits),
            exhausted: load(&c.exhausted),
            copies_failed_to_staging: load(&c.copies_failed_to_staging),
            copies_failed_to_device: load(&c.copies_failed_to_device),
        }
    }

    /// The counters and histograms now, with the gauges the caller read.
    pub(crate) fn snapshot(&self, gauges: Gauges) -> MetricsSnapshot {
        MetricsSnapshot {
            pulls_started: load(&self.pulls_started),
            pulls_received: load(&self.pulls_received),
            pulls_failed: by_cause(&self.pulls_failed),
            pulls_cancelled: load(&self.pulls_cancelled),
            bytes_received: load(&self.bytes_received),
            pull_seconds: self.pull_seconds.snapshot(),
            pull_bytes: self.pull_bytes.snapshot(),
            sends_done: load(&self.sends_done),
            sends_failed: by_cause(&self.sends_failed),
            bytes_sent: load(&self.bytes_sent),
            ops_per_batch: self.ops_per_batch.snapshot(),
            batch_write_seconds: self.batch_write_seconds.snapshot(),
            send_wait_seconds: self.send_wait_seconds.snapshot(),
            lease_expiries: gauges.lease_expiries,
            renewals_received: gauges.renewals_received,
            renewals_refused: gauges.renewals_refused,
            renewals_sent: load(&self.renewals_sent),
            auth_failures: gauges.side_channel_auth_failures + gauges.transport.auth_failures,
            tag_failures: TagFailures {
                side_channel: gauges.side_channel_tag_failures,
                data_plane: gauges.transport.tag_failures,
            },
            batches_refused: BatchRefusal::ALL
                .iter()
                .map(|&why| {
                    let n = gauges.transport.batches_refused.iter().find(|(w, _)| *w == why).map_or(0, |(_, n)| *n);
                    (why, n)
                })
                .collect(),
            grants_live: gauges.transport.grants_live,
            pulls_in_flight: gauges.pulls_in_flight,
            watched_requests: gauges.watched_requests,
            held_requests: gauges.held_requests,
            held_blocks: gauges.held_blocks,
            transfers_in_progress: gauges.transfers_in_progress,
            connections: gauges.connections,
            staging: self.staging(),
        }
    }
}

/// Frames that failed their authentication tag after the handshake (altered
/// or injected on the path), by where; each ended its connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TagFailures {
    /// Side-channel frames, either way.
    pub side_channel: u64,
    /// Data-plane frames: TCP batch headers, op lists, payloads and
    /// replies; RDMA control frames (QUIC's TLS ends such a connection
    /// itself, uncounted).
    pub data_plane: u64,
}

/// What a snapshot reads from live state (and the sender core's counts).
#[derive(Debug, Default)]
pub(crate) struct Gauges {
    pub(crate) lease_expiries: u64,
    pub(crate) side_channel_auth_failures: u64,
    pub(crate) side_channel_tag_failures: u64,
    pub(crate) renewals_received: u64,
    pub(crate) renewals_refused: u64,
    pub(crate) transport: kv_proto::TransportStats,
    pub(crate) pulls_in_flight: u64,
    pub(crate) watched_requests: u64,
    pub(crate) held_requests: u64,
    pub(crate) held_blocks: u64,
    pub(crate) transfers_in_progress: u64,
    pub(crate) connections: BTreeMap<String, u64>,
}

/// Everything the worker counts, as read at one moment. Counters count
/// since the worker started; gauges are the value now.
///
/// On a decode instance the `pull*` fields count requests (each request of a
/// transfer request is one pull); on a prefill instance `sends*` count
/// requests served and `ops_per_batch`/`batch_write_seconds` one batch each.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricsSnapshot {
    /// D: requests whose pull started.
    pub pulls_started: u64,
    /// D: requests whose KV was received whole.
    pub pulls_received: u64,
    /// D: requests whose pull failed, by cause (every cause listed).
    pub pulls_failed: BTreeMap<FailureCause, u64>,
    /// D: pulls the engine cancelled (aborted requests), never reported.
    pub pulls_cancelled: u64,
    /// D: bytes of KV received (in received requests).
    pub bytes_received: u64,
    /// D: seconds from a pull's start to its report, per received request.
    pub pull_seconds: HistogramSnapshot,
    /// D: bytes per received request.
    pub pull_bytes: HistogramSnapshot,
    /// P: requests whose KV was written to D.
    pub sends_done: u64,
    /// P: requests a pull asked for that were not written, by cause.
    pub sends_failed: BTreeMap<FailureCause, u64>,
    /// P: bytes written to D.
    pub bytes_sent: u64,
    /// P: ops per written batch.
    pub ops_per_batch: HistogramSnapshot,
    /// P: seconds per batch write (until D's memory holds every byte).
    pub batch_write_seconds: HistogramSnapshot,
    /// P: seconds a request was ready before a pull claimed it.
    pub send_wait_seconds: HistogramSnapshot,
    /// P: requests freed because their lease (or renewal) ended unpulled.
    pub lease_expiries: u64,
    /// P: request renewals received from decode instances.
    pub renewals_received: u64,
    /// P: renewals of requests P holds that did not name the request's
    /// renewal key (ignored: only the decode instance given the request's
    /// params can renew it).
    pub renewals_refused: u64,
    /// D: request renewals sent to prefill instances.
    pub renewals_sent: u64,
    /// Peers that failed authentication (side channel and data plane).
    pub auth_failures: u64,
    /// Frames that failed their tag after a successful handshake, each
    /// ending its connection.
    pub tag_failures: TagFailures,
    /// Peers' data-plane batches this worker refused, by reason (every reason listed).
    pub batches_refused: BTreeMap<BatchRefusal, u64>,
    /// D: grants live now.
    pub grants_live: u64,
    /// D: requests being pulled now.
    pub pulls_in_flight: u64,
    /// D: requests whose hold on P this worker renews now.
    pub watched_requests: u64,
    /// P: requests whose blocks are held for a pull now.
    pub held_requests: u64,
    /// P: blocks held for pulls now (of ready requests; those being written
    /// count their blocks too).
    pub held_blocks: u64,
    /// P: transfer requests admitted and not yet answered.
    pub transfers_in_progress: u64,
    /// Side-channel connections now, per peer host (P: decode instances
    /// connected here; D: prefill workers this one is connected to).
    pub connections: BTreeMap<String, u64>,
    /// Host staging (all zero without it).
    pub staging: StagingFigures,
}

impl MetricsSnapshot {
    /// Every metric at zero, as a worker that has done nothing reports it:
    /// for exporters that register every series before any worker runs.
    pub fn zero() -> Self {
        Metrics::default().snapshot(Gauges::default())
    }

    /// Requests whose pull failed, all causes together.
    pub fn pulls_failed_total(&self) -> u64 {
        self.pulls_failed.values().sum()
    }

    /// Requests P failed to send, all causes together.
    pub fn sends_failed_total(&self) -> u64 {
        self.sends_failed.values().sum()
    }

    /// What changed since `earlier` (a snapshot of the same worker):
    /// counters and histograms as differences, gauges as they are now.
    pub fn since(&self, earlier: &MetricsSnapshot) -> MetricsSnapshot {
        fn minus<K: Ord + Copy>(now: &BTreeMap<K, u64>, then: &BTreeMap<K, u64>) -> BTreeMap<K, u64> {
            now.iter().map(|(k, &n)| (*k, n.saturating_sub(then.get(k).copied().unwrap_or(0)))).collect()
        }
        MetricsSnapshot {
            pulls_started: self.pulls_started.saturating_sub(earlier.pulls_started),
            pulls_received: self.pulls_received.saturating_sub(earlier.pulls_received),
            pulls_failed: minus(&self.pulls_failed, &earlier.pulls_failed),
            pulls_cancelled: self.pulls_cancelled.saturating_sub(earlier.pulls_cancelled),
            bytes_received: self.bytes_received.saturating_sub(earlier.bytes_received),
            pull_seconds: self.pull_seconds.since(&earlier.pull_seconds),
            pull_bytes: self.pull_bytes.since(&earlier.pull_bytes),
            sends_done: self.sends_done.saturating_sub(earlier.sends_done),
            sends_failed: minus(&self.sends_failed, &earlier.sends_failed),
            bytes_sent: self.bytes_sent.saturating_sub(earlier.bytes_sent),
            ops_per_batch: self.ops_per_batch.since(&earlier.ops_per_batch),
            batch_write_seconds: self.batch_write_seconds.since(&earlier.batch_write_seconds),
            send_wait_seconds: self.send_wait_seconds.since(&earlier.send_wait_seconds),
            lease_expiries: self.lease_expiries.saturating_sub(earlier.lease_expiries),
            renewals_received: self.renewals_received.saturating_sub(earlier.renewals_received),
            renewals_refused: self.renewals_refused.saturating_sub(earlier.renewals_refused),
            renewals_sent: self.renewals_sent.saturating_sub(earlier.renewals_sent),
            auth_failures: self.auth_failures.saturating_sub(earlier.auth_failures),
            tag_failures: TagFailures {
                side_channel: self.tag_failures.side_channel.saturating_sub(earlier.tag_failures.side_channel),
                data_plane: self.tag_failures.data_plane.saturating_sub(earlier.tag_failures.data_plane),
            },
            batches_refused: minus(&self.batches_refused, &earlier.batches_refused),
            staging: StagingFigures {
                waits: self.staging.waits.saturating_sub(earlier.staging.waits),
                exhausted: self.staging.exhausted.saturating_sub(earlier.staging.exhausted),
                copies_failed_to_staging: self
                    .staging
                    .copies_failed_to_staging
                    .saturating_sub(earlier.staging.copies_failed_to_staging),
                copies_failed_to_device: self
                    .staging
                    .copies_failed_to_device
                    .saturating_sub(earlier.staging.copies_failed_to_device),
                ..self.staging
            },
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_have_their_own_counters() {
        let metrics = Metrics::default();
        metrics.pull_failed(FailureCause::Timeout);
        metrics.pull_failed(FailureCause::Timeout);
        metrics.pull_failed(FailureCause::AuthFailed);
        metrics.pull_received(4096, Duration::from_millis(2));
        let snap = metrics.snapshot(Gauges::default());
        assert_eq!(snap.pulls_failed.len(), FailureCause::ALL.len());
        assert_eq!(snap.pulls_failed[&FailureCause::Timeout], 2);
        assert_eq!(snap.pulls_failed[&FailureCause::AuthFailed], 1);
        assert_eq!(snap.pulls_failed_total(), 3);
        assert_eq!((snap.pulls_received, snap.bytes_received), (1, 4096));
        assert_eq!(snap.pull_seconds.count(), 1);
    }

    #[test]
    fn since_counts_the_interval_and_keeps_gauges() {
        let metrics = Metrics::default();
        metrics.send_done();
        let earlier = metrics.snapshot(Gauges::default());
        metrics.send_done();
        metrics.send_failed(FailureCause::LeaseEnded);
        let now = metrics.snapshot(Gauges { held_requests: 7, ..Gauges::default() });
        let delta = now.since(&earlier);
        assert_eq!(delta.sends_done, 1);
        assert_eq!(delta.sends_failed[&FailureCause::LeaseEnded], 1);
        assert_eq!(delta.held_requests, 7);
    }
}
