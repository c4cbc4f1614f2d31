//! The hub's workers in the Prometheus text format (version 0.0.4), through
//! `prometheus-client`: a [`Collector`] that walks each worker's
//! [`Family`] list at scrape time, so a metric the worker adds appears here
//! without a line of this file changing. Names are `kvlink_<name>`
//! (counters `kvlink_<name>_total`, as the format wants); every sample
//! carries its family's labels, then `role` and `engine_id` of its worker.

use std::fmt;

use kv_worker::metrics::{Family, MetricKind, Sample};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{prometheus_text, DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::hub::{MetricsHub, WorkerLabels};

/// The `Content-Type` of what [`Exposition::render`] returns.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The prefix of every metric name.
const PREFIX: &str = "kvlink";

/// Rendering failed (the encoder refused something; not expected).
#[derive(Debug, thiserror::Error)]
#[error("cannot encode the metrics")]
pub struct RenderError;

impl From<fmt::Error> for RenderError {
    fn from(_: fmt::Error) -> Self {
        RenderError
    }
}

/// A hub's workers, ready to render at each scrape.
#[derive(Debug)]
pub struct Exposition {
    registry: Registry,
}

impl Exposition {
    /// Renders `hub`'s workers.
    pub fn new(hub: MetricsHub) -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        registry.register_collector(Box::new(HubCollector { hub }));
        Self { registry }
    }

    /// Every worker's metrics now, as the text exposition.
    pub fn render(&self) -> Result<String, RenderError> {
        let mut text = String::new();
        prometheus_text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

#[derive(Debug)]
struct HubCollector {
    hub: MetricsHub,
}

fn metric_type(kind: MetricKind) -> MetricType {
    match kind {
        MetricKind::Counter => MetricType::Counter,
        MetricKind::Gauge => MetricType::Gauge,
        MetricKind::Histogram => MetricType::Histogram,
    }
}

impl Collector for HubCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        let workers = self.hub.families();
        // A family is described once, with every worker's samples under it
        // (the format allows no second block of the same name): the order
        // is the first worker's list, then families only a later one has.
        let mut described: Vec<&Family> = Vec::new();
        for family in workers.iter().flat_map(|(_, families)| families) {
            if !described.iter().any(|f| f.name == family.name) {
                described.push(family);
            }
        }
        for family in described {
            let mut metric = encoder.encode_descriptor(family.name, family.help, None, metric_type(family.kind))?;
            for (worker, families) in &workers {
                let Some(own) = families.iter().find(|f| f.name == family.name) else { continue };
                for sample in &own.samples {
                    encode_sample(&mut metric, family.kind, worker, sample)?;
                }
            }
        }
        Ok(())
    }
}

/// A sample's labels, then the worker's (unless the family names one of
/// them itself: a label twice would make the line invalid).
fn labels<'a>(own: &'a [(&'static str, String)], worker: &'a WorkerLabels) -> Vec<(&'a str, &'a str)> {
    let mut labels: Vec<(&str, &str)> = own.iter().map(|(name, value)| (*name, value.as_str())).collect();
    for (name, value) in [("role", worker.role), ("engine_id", worker.engine_id.as_str())] {
        if !labels.iter().any(|(n, _)| *n == name) {
            labels.push((name, value));
        }
    }
    labels
}

fn encode_sample(
    metric: &mut MetricEncoder<'_>,
    kind: MetricKind,
    worker: &WorkerLabels,
    sample: &Sample,
) -> Result<(), fmt::Error> {
    match (kind, sample) {
        (MetricKind::Counter, Sample::Value { labels: own, value }) => {
            let labels = labels(own, worker);
            metric.encode_family(&labels)?.encode_counter::<NoLabelSet, u64, u64>(value, None)
        }
        (MetricKind::Gauge, Sample::Value { labels: own, value }) => {
            let labels = labels(own, worker);
            metric.encode_family(&labels)?.encode_gauge(value)
        }
        (MetricKind::Histogram, Sample::Histogram { labels: own, histogram }) => {
            let labels = labels(own, worker);
            // Per finite bucket, not cumulative: the encoder adds them up,
            // and writes the `+Inf` bucket as the count.
            let buckets: Vec<(f64, u64)> =
                histogram.bounds.iter().copied().zip(histogram.counts.iter().copied()).collect();
            metric.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
                histogram.sum,
                histogram.count(),
                &buckets,
                None,
            )
        }
        // A sample of another shape than its family's kind: the worker
        // does not make them, and writing one would break the exposition.
        _ => Ok(()),
    }
}
