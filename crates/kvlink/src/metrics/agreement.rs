//! The bench's own count of what happened against its workers' counters:
//! the failures by cause it reports come from the workers, and the totals
//! it counts itself (requests, bytes, failures) must be what the workers
//! counted, or one of the two is wrong.

use std::collections::BTreeMap;

use kv_worker::metrics::{FailureCause, MetricsSnapshot};

/// What the bench saw of every request it started (warm-up included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Reported received, bytes right.
    pub received: u64,
    /// Reported received, bytes wrong.
    pub corrupt: u64,
    /// Reported failed.
    pub failed: u64,
    /// Bytes of the received requests (not the corrupt ones).
    pub bytes: u64,
}

/// The causes with a count, by label.
pub fn nonzero(by_cause: &BTreeMap<FailureCause, u64>) -> BTreeMap<String, u64> {
    by_cause.iter().filter(|(_, &n)| n > 0).map(|(cause, &n)| (cause.as_str().to_owned(), n)).collect()
}

/// Where `tally` (what a bench saw on its decode side) and `decode` (that
/// worker's counters, since it started with the bench) disagree, one line
/// each; empty when they agree.
pub fn disagreements(tally: &Tally, decode: &MetricsSnapshot) -> Vec<String> {
    let mut out = Vec::new();
    // A corrupt request arrived whole as far as the worker knows.
    let received = tally.received + tally.corrupt;
    if decode.pulls_received != received {
        out.push(format!(
            "the bench saw {received} requests arrive, the decode worker counted {}",
            decode.pulls_received
        ));
    }
    if decode.pulls_failed_total() != tally.failed {
        out.push(format!(
            "the bench saw {} requests fail, the decode worker counted {}",
            tally.failed,
            decode.pulls_failed_total()
        ));
    }
    // The bench does not count a corrupt request's bytes.
    if tally.corrupt == 0 && decode.bytes_received != tally.bytes {
        out.push(format!(
            "the bench counted {} bytes received, the decode worker {}",
            tally.bytes, decode.bytes_received
        ));
    }
    out
}
