//! The worker's metrics for Python: kv-worker's [`MetricsSnapshot`] walked
//! through [`MetricsSnapshot::families`] (never listed here by hand) into
//! plain Python data, and the interval bookkeeping vLLM's connector stats
//! want (what changed since the previous report).
//!
//! One family is a dict:
//!
//! ```text
//! {"name": "pulls_failed", "kind": "counter" | "gauge" | "histogram",
//!  "labels": ["cause"], "help": "...",
//!  "samples": [{"labels": {"cause": "timeout"}, "value": 0}, ...]}
//! ```
//!
//! and a histogram's sample is `{"labels": {...}, "bounds": [upper bounds of
//! the finite buckets], "counts": [per bucket, not cumulative, one more than
//! the bounds: the last is +Inf], "sum": total}`.

use kv_worker::metrics::{Family, MetricKind, MetricsSnapshot, Sample};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// The kind's name in the Python data.
fn kind_name(kind: MetricKind) -> &'static str {
    match kind {
        MetricKind::Counter => "counter",
        MetricKind::Gauge => "gauge",
        MetricKind::Histogram => "histogram",
    }
}

fn labels_dict<'py>(py: Python<'py>, labels: &[(&'static str, String)]) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (name, value) in labels {
        dict.set_item(*name, value)?;
    }
    Ok(dict)
}

fn sample_dict<'py>(py: Python<'py>, sample: &Sample) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    match sample {
        Sample::Value { labels, value } => {
            dict.set_item("labels", labels_dict(py, labels)?)?;
            dict.set_item("value", *value)?;
        }
        Sample::Histogram { labels, histogram } => {
            dict.set_item("labels", labels_dict(py, labels)?)?;
            dict.set_item("bounds", PyList::new(py, histogram.bounds.iter().copied())?)?;
            dict.set_item("counts", PyList::new(py, histogram.counts.iter().copied())?)?;
            dict.set_item("sum", histogram.sum)?;
        }
    }
    Ok(dict)
}

fn family_dict<'py>(py: Python<'py>, family: &Family) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("name", family.name)?;
    dict.set_item("kind", kind_name(family.kind))?;
    dict.set_item("labels", PyList::new(py, family.labels.iter().copied())?)?;
    dict.set_item("help", family.help)?;
    let samples = family.samples.iter().map(|s| sample_dict(py, s)).collect::<PyResult<Vec<_>>>()?;
    dict.set_item("samples", PyList::new(py, samples)?)?;
    Ok(dict)
}

/// Every family of `snapshot`, as Python data (see the module's docs).
pub(crate) fn families_to_py<'py>(py: Python<'py>, snapshot: &MetricsSnapshot) -> PyResult<Bound<'py, PyList>> {
    let families = snapshot.families().iter().map(|f| family_dict(py, f)).collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, families)
}

/// What was last reported, to report intervals from.
#[derive(Debug)]
pub(crate) struct Intervals {
    /// The snapshot the next interval starts at.
    base: MetricsSnapshot,
    /// Whether an interval was reported yet (the first always is, so every
    /// family reaches the exporters before the first event).
    reported: bool,
}

impl Intervals {
    /// Intervals starting at `start` (the worker's snapshot when it started).
    pub(crate) fn new(start: MetricsSnapshot) -> Self {
        Self { base: start, reported: false }
    }

    /// The interval ending at `now`: counters and histograms as what changed
    /// since the previous report, gauges as they are now; `None` if nothing
    /// (counter, histogram or gauge) changed since then, except the first
    /// time. `now` starts the next interval.
    pub(crate) fn next(&mut self, now: MetricsSnapshot) -> Option<MetricsSnapshot> {
        if self.reported && now == self.base {
            return None;
        }
        let delta = now.since(&self.base);
        self.base = now;
        self.reported = true;
        Some(delta)
    }
}
