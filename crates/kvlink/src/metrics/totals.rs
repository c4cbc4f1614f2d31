//! Adding up a worker's metric families: what a shut-down worker counted is
//! kept (counters and histograms), so an endpoint that outlives its workers
//! (`kvlink serve`, one worker per session; `kvlink bench --metrics-hold`
//! after the run) still shows totals that only go up. Gauges are values
//! now: a worker that is gone holds nothing, so its gauges are not kept.
//!
//! Everything here walks [`Family`] lists as the worker gives them; no
//! metric is named.

use kv_worker::metrics::{Family, HistogramSnapshot, MetricKind, Sample};

/// The labels of a sample.
fn labels_of(sample: &Sample) -> &[(&'static str, String)] {
    match sample {
        Sample::Value { labels, .. } | Sample::Histogram { labels, .. } => labels,
    }
}

/// `a + b`, bucket by bucket (the same family, so the same bounds; a
/// bucket only one of them has is kept as it is).
fn add_histograms(a: &HistogramSnapshot, b: &HistogramSnapshot) -> HistogramSnapshot {
    let len = a.counts.len().max(b.counts.len());
    let at = |h: &HistogramSnapshot, i: usize| h.counts.get(i).copied().unwrap_or(0);
    let counts = (0..len).map(|i| at(a, i).saturating_add(at(b, i))).collect();
    let bounds = if a.bounds.len() >= b.bounds.len() { a.bounds } else { b.bounds };
    HistogramSnapshot { bounds, counts, sum: a.sum + b.sum }
}

/// Adds `sample` into `into` (the sample of `into` with the same labels,
/// or a new one).
fn add_sample(into: &mut Vec<Sample>, sample: &Sample) {
    let existing = into.iter_mut().find(|s| labels_of(s) == labels_of(sample));
    match (existing, sample) {
        (Some(Sample::Value { value, .. }), Sample::Value { value: more, .. }) => {
            *value = value.saturating_add(*more);
        }
        (Some(Sample::Histogram { histogram, .. }), Sample::Histogram { histogram: more, .. }) => {
            *histogram = add_histograms(histogram, more);
        }
        // A family's samples are all of one shape; a mismatch cannot come
        // from the worker, and the newer sample wins.
        (Some(existing), _) => *existing = sample.clone(),
        (None, _) => into.push(sample.clone()),
    }
}

/// What a worker's families leave behind when it is gone: counters and
/// histograms as they are, gauges without samples.
pub(crate) fn retired(families: Vec<Family>) -> Vec<Family> {
    families
        .into_iter()
        .map(|mut family| {
            if family.kind == MetricKind::Gauge {
                family.samples.clear();
            }
            family
        })
        .collect()
}

/// Adds `more` into `into`, family by family (matched by name; a family
/// only `more` has is appended). Counters and histograms add; a gauge takes
/// `more`'s samples where it has any (the value now), else keeps its own.
pub(crate) fn add(into: &mut Vec<Family>, more: &[Family]) {
    for family in more {
        let Some(existing) = into.iter_mut().find(|f| f.name == family.name) else {
            into.push(family.clone());
            continue;
        };
        if family.kind == MetricKind::Gauge {
            if !family.samples.is_empty() {
                existing.samples = family.samples.clone();
            }
            continue;
        }
        for sample in &family.samples {
            add_sample(&mut existing.samples, sample);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(name: &'static str, kind: MetricKind, labels: Vec<(&'static str, String)>, value: u64) -> Family {
        let names: &'static [&'static str] = if labels.is_empty() { &[] } else { &["cause"] };
        Family { name, kind, labels: names, help: "help", samples: vec![Sample::Value { labels, value }] }
    }

    fn histogram(counts: Vec<u64>, sum: f64) -> Family {
        Family {
            name: "h",
            kind: MetricKind::Histogram,
            labels: &[],
            help: "help",
            samples: vec![Sample::Histogram {
                labels: Vec::new(),
                histogram: HistogramSnapshot { bounds: &[1.0, 2.0], counts, sum },
            }],
        }
    }

    fn only_value(families: &[Family], name: &str) -> Vec<u64> {
        let family = families.iter().find(|f| f.name == name).unwrap();
        family
            .samples
            .iter()
            .map(|s| match s {
                Sample::Value { value, .. } => *value,
                Sample::Histogram { histogram, .. } => histogram.count(),
            })
            .collect()
    }

    #[test]
    fn counters_and_histograms_add_gauges_are_the_value_now() {
        let cause = |c: &str| vec![("cause", c.to_owned())];
        let first = vec![
            value("c", MetricKind::Counter, cause("timeout"), 2),
            value("g", MetricKind::Gauge, Vec::new(), 7),
            histogram(vec![1, 0, 1], 3.5),
        ];
        let mut totals = retired(first);
        assert!(totals.iter().find(|f| f.name == "g").unwrap().samples.is_empty(), "a gone worker holds nothing");
        let second = vec![
            value("c", MetricKind::Counter, cause("timeout"), 3),
            value("g", MetricKind::Gauge, Vec::new(), 1),
            histogram(vec![0, 2, 0], 3.0),
        ];
        add(&mut totals, &second);
        add(&mut totals, &[value("c", MetricKind::Counter, cause("shutdown"), 1)]);
        assert_eq!(only_value(&totals, "c"), vec![5, 1]);
        assert_eq!(only_value(&totals, "g"), vec![1]);
        let Sample::Histogram { histogram, .. } = &totals.iter().find(|f| f.name == "h").unwrap().samples[0] else {
            panic!("a histogram family holds histograms");
        };
        assert_eq!(histogram.counts, vec![1, 2, 1]);
        assert!((histogram.sum - 6.5).abs() < 1e-9);
    }

    #[test]
    fn a_family_only_the_newer_list_has_is_appended() {
        let mut totals = vec![value("a", MetricKind::Counter, Vec::new(), 1)];
        add(&mut totals, &[value("b", MetricKind::Counter, Vec::new(), 4)]);
        assert_eq!(totals.iter().map(|f| f.name).collect::<Vec<_>>(), ["a", "b"]);
    }
}
