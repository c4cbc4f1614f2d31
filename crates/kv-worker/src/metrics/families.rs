//! Every metric's name, kind, labels and meaning, in one list that every
//! exporter (the CLI's Prometheus endpoint, the vLLM package, tests) walks:
//! a metric is added here once and appears everywhere.

use super::{HistogramSnapshot, MetricsSnapshot};

/// How a metric behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up (since the worker started).
    Counter,
    /// A value now.
    Gauge,
    /// Observations in buckets.
    Histogram,
}

/// One labelled value of a family.
#[derive(Clone, Debug, PartialEq)]
pub enum Sample {
    /// A counter's or gauge's value.
    Value {
        /// Label names and values (empty for an unlabelled metric).
        labels: Vec<(&'static str, String)>,
        /// The value.
        value: u64,
    },
    /// A histogram.
    Histogram {
        /// Label names and values.
        labels: Vec<(&'static str, String)>,
        /// The buckets.
        histogram: HistogramSnapshot,
    },
}

/// A metric: its name (without an exporter's prefix, no unit suffix added
/// by the exporter except `_total` where its format wants one), kind,
/// label names, meaning, and samples.
#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    /// `snake_case`, e.g. `pulls_failed`; exporters prefix it (`kvlink_`,
    /// `vllm:kvlink_`).
    pub name: &'static str,
    /// Its kind.
    pub kind: MetricKind,
    /// The label names its samples carry.
    pub labels: &'static [&'static str],
    /// One line of meaning.
    pub help: &'static str,
    /// The samples (a labelled family lists every label value it knows,
    /// zeros included, so series exist before the first event).
    pub samples: Vec<Sample>,
}

fn value(name: &'static str, kind: MetricKind, help: &'static str, value: u64) -> Family {
    Family { name, kind, labels: &[], help, samples: vec![Sample::Value { labels: Vec::new(), value }] }
}

fn histogram(name: &'static str, help: &'static str, histogram: &HistogramSnapshot) -> Family {
    Family {
        name,
        kind: MetricKind::Histogram,
        labels: &[],
        help,
        samples: vec![Sample::Histogram { labels: Vec::new(), histogram: histogram.clone() }],
    }
}

fn labelled<K: ToString>(
    name: &'static str,
    kind: MetricKind,
    label: &'static [&'static str; 1],
    help: &'static str,
    values: impl IntoIterator<Item = (K, u64)>,
) -> Family {
    let samples =
        values.into_iter().map(|(k, value)| Sample::Value { labels: vec![(label[0], k.to_string())], value }).collect();
    Family { name, kind, labels: label, help, samples }
}

impl MetricsSnapshot {
    /// Every metric, described, with its samples from this snapshot.
    pub fn families(&self) -> Vec<Family> {
        use MetricKind::{Counter, Gauge};
        vec![
            value("pulls_started", Counter, "D: requests whose KV pull started.", self.pulls_started),
            value("pulls_received", Counter, "D: requests whose KV was received whole.", self.pulls_received),
            labelled(
                "pulls_failed",
                Counter,
                &["cause"],
                "D: requests whose KV pull failed (the engine recomputes them), by cause.",
                self.pulls_failed.iter().map(|(c, &n)| (c.as_str(), n)),
            ),
            value(
                "pulls_cancelled",
                Counter,
                "D: pulls cancelled by the engine (aborted requests).",
                self.pulls_cancelled,
            ),
            value("received_bytes", Counter, "D: bytes of KV received.", self.bytes_received),
            histogram("pull_seconds", "D: seconds from a pull's start to the request's report.", &self.pull_seconds),
            histogram("pull_bytes", "D: bytes of KV per received request.", &self.pull_bytes),
            value("pulls_in_flight", Gauge, "D: requests being pulled now.", self.pulls_in_flight),
            value(
                "watched_requests",
                Gauge,
                "D: requests whose hold on the prefill instance this worker renews.",
                self.watched_requests,
            ),
            value("renewals_sent", Counter, "D: request renewals sent to prefill instances.", self.renewals_sent),
            value("grants_live", Gauge, "D: write grants live now.", self.grants_live),
            value("sends_done", Counter, "P: requests whose KV was written to the decode instance.", self.sends_done),
            labelled(
                "sends_failed",
                Counter,
                &["cause"],
                "P: requests a pull asked for that were not written, by cause.",
                self.sends_failed.iter().map(|(c, &n)| (c.as_str(), n)),
            ),
            value("sent_bytes", Counter, "P: bytes of KV written to decode instances.", self.bytes_sent),
            histogram("batch_ops", "P: write ops per batch.", &self.ops_per_batch),
            histogram(
                "batch_write_seconds",
                "P: seconds per batch write, until the decode instance's memory holds every byte.",
                &self.batch_write_seconds,
            ),
            histogram(
                "send_wait_seconds",
                "P: seconds a finished request waited for its pull (ready to claimed).",
                &self.send_wait_seconds,
            ),
            value(
                "held_requests",
                Gauge,
                "P: finished requests whose blocks are held for a pull now.",
                self.held_requests,
            ),
            value("held_blocks", Gauge, "P: KV blocks held for pulls now.", self.held_blocks),
            value(
                "transfers_in_progress",
                Gauge,
                "P: transfer requests admitted and not yet answered.",
                self.transfers_in_progress,
            ),
            value(
                "lease_expiries",
                Counter,
                "P: requests freed because their lease or renewal ended before a pull.",
                self.lease_expiries,
            ),
            value(
                "renewals_received",
                Counter,
                "P: request renewals received from decode instances.",
                self.renewals_received,
            ),
            value(
                "renewals_refused",
                Counter,
                "P: renewals ignored because they did not name the request's renewal key.",
                self.renewals_refused,
            ),
            value(
                "auth_failures",
                Counter,
                "Peers that failed authentication (side channel or data plane).",
                self.auth_failures,
            ),
            labelled(
                "tag_failures",
                Counter,
                &["channel"],
                "Frames that failed their authentication tag after the handshake (altered or injected on the path), by channel; each ended its connection.",
                [("side_channel", self.tag_failures.side_channel), ("data_plane", self.tag_failures.data_plane)],
            ),
            labelled(
                "batches_refused",
                Counter,
                &["reason"],
                "Peers' data-plane batches refused, by reason.",
                self.batches_refused.iter().map(|(r, &n)| (r.as_str(), n)),
            ),
            labelled(
                "connections",
                Gauge,
                &["peer"],
                "Side-channel connections now, per peer host.",
                self.connections.iter().map(|(p, &n)| (p.as_str(), n)),
            ),
            value(
                "staging_slots",
                Gauge,
                "Host staging slots in all (one block of every layer each; 0 without staging).",
                self.staging.slots,
            ),
            value("staging_free_slots", Gauge, "Host staging slots free now.", self.staging.free_slots),
            value(
                "staging_requests",
                Gauge,
                "Requests holding or waiting for host staging slots now.",
                self.staging.requests,
            ),
            value("staging_waiting", Gauge, "Requests waiting for host staging slots now.", self.staging.waiting),
            value(
                "staging_waits",
                Counter,
                "Requests that found no host staging room and waited (on P, also finished requests held back to leave room for pulls).",
                self.staging.waits,
            ),
            value(
                "staging_exhausted",
                Counter,
                "Requests that found no host staging room within the bound (they fail: staging_exhausted).",
                self.staging.exhausted,
            ),
            labelled(
                "staging_copies_failed",
                Counter,
                &["direction"],
                "Copies between the engine's blocks and host staging that failed (the request fails: copy_failed).",
                [
                    ("to_staging", self.staging.copies_failed_to_staging),
                    ("to_device", self.staging.copies_failed_to_device),
                ],
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Gauges, Metrics};

    #[test]
    fn names_are_unique_and_labelled_families_name_their_labels() {
        let snap = Metrics::default().snapshot(Gauges::default());
        let families = snap.families();
        let mut names = std::collections::BTreeSet::new();
        for family in &families {
            assert!(names.insert(family.name), "{} twice", family.name);
            assert!(!family.help.is_empty());
            for sample in &family.samples {
                let labels = match sample {
                    super::Sample::Value { labels, .. } | super::Sample::Histogram { labels, .. } => labels,
                };
                let names: Vec<&str> = labels.iter().map(|(n, _)| *n).collect();
                assert_eq!(names, family.labels, "{}", family.name);
            }
        }
        let failed = families.iter().find(|f| f.name == "pulls_failed").map(|f| f.samples.len());
        assert_eq!(failed, Some(kv_proto::FailureCause::ALL.len()));
    }
}
