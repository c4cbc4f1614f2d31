//! Short leases through real workers: D's renewal task reaches P's side
//! channel and P applies what it reads, frees a request whose decode
//! instance died within a renewal period instead of the abort timeout, and
//! renews on D's behalf while it makes D's messages wait. When each of them
//! acts is decided by the sans-IO cores, proven with explicit time in
//! `leases.rs`; these tests only wait for events (each wait bounded), never
//! for time to pass.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kv_proto::{ConnectorMetadata, KvRole, ReqId};
use kv_worker::{Worker, WorkerConfig};

/// P's renewal period here (D renews every third of it). Long enough
/// that a renewal task stalled for over a second on a loaded machine does
/// not let P's hold run out in the tests that say it must not.
const RENEWAL: Duration = Duration::from_secs(2);
/// P's abort timeout here: far beyond any bound of these tests, so a request
/// freed within them was freed by a renewal running out.
const ABORT: Duration = Duration::from_secs(3600);
/// Renewals that span more than two renewal periods (D renews every third
/// of one).
const RENEWALS_PAST_TWO_PERIODS: u64 = 7;

fn prefill_config(net: &Net) -> WorkerConfig {
    WorkerConfig { lease_renewal: RENEWAL, abort_request_timeout: ABORT, ..net.config(KvRole::Producer, "p") }
}

/// D starts renewing `req` on P.
fn watch(d: &Instance, p: &Instance, req: &str) {
    let (host, port) = side_channel(p);
    let mut meta = ConnectorMetadata::default();
    meta.reqs_to_watch.insert(ReqId::new(req), remote(&host, port, req));
    d.worker.start_load_kv(&meta);
}

/// Waits (bounded) until `count` of `worker`'s metrics reaches `n`.
async fn until_counted(worker: &Worker, what: &str, n: u64, count: impl Fn(&Worker) -> u64) {
    let deadline = Instant::now() + BOUND;
    while count(worker) < n {
        assert!(Instant::now() < deadline, "{what}: {} within {BOUND:?}, not {n}", count(worker));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (bounded) until P holds `n` requests for a decode instance that renews them.
async fn until_renewed(p: &Worker, n: usize) {
    until_counted(p, "requests P holds for a renewing decode instance", n as u64, |p| p.renewed_requests() as u64)
        .await;
}

/// Renewals P applied.
fn received(p: &Worker) -> u64 {
    p.metrics().renewals_received
}

/// Renewals D sent (whether P read them or not).
fn sent(d: &Worker) -> u64 {
    d.metrics().renewals_sent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_instance_that_dies_before_pulling_frees_p_within_a_renewal() {
    let net = Net::new(Backend::InMemory).unwrap();
    let p = start(prefill_config(&net), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    ready(&p, "r", &[0, 1]);
    watch(&d, &p, "r");
    assert_eq!(d.worker.watched_requests(), 1);
    until_renewed(&p.worker, 1).await;

    d.worker.shutdown().await;
    let finished = until(&p.worker, |f| f.sending.contains(&p_id("r"))).await;
    assert_eq!(finished.sending.len(), 1, "{finished:?}");
    assert_eq!(p.worker.renewed_requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_request_outlives_many_renewal_periods_and_is_pulled() {
    let net = Net::new(Backend::InMemory).unwrap();
    let p = start(prefill_config(&net), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    fill(&p.cache, 7, &[0, 1]);
    ready(&p, "r", &[0, 1]);
    watch(&d, &p, "r");
    until_renewed(&p.worker, 1).await;

    // D keeps renewing past two renewal periods, and P keeps the request.
    until_counted(&p.worker, "renewals P applied", RENEWALS_PAST_TWO_PERIODS, received).await;
    assert!(p.worker.get_finished().sending.is_empty(), "P freed a request its decode instance still renews");

    let (host, port) = side_channel(&p);
    pull(&d, &host, port, &[("r", &[4, 5])]);
    assert_eq!(d.worker.watched_requests(), 0, "a pull ends the watch");
    let finished = until(&d.worker, |f| !f.receiving.is_empty() || !f.failed_receiving.is_empty()).await;
    assert_eq!(finished.receiving.len(), 1, "{finished:?}");
    assert!(holds(&d.cache, 7, &[4, 5]));
    until(&p.worker, |f| f.sending.contains(&p_id("r"))).await;
}

/// P makes D's messages wait (its admission is full): D's renewals sit
/// unread behind a transfer request, and P must not hold that against D.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_stuck_behind_p_s_admission_do_not_free_the_request() {
    let net = Net::new(Backend::InMemory).unwrap();
    let gated = GatedWriter::new(net.writer(KvRole::Producer, "p").await, 1);
    // One transfer request admitted per connection: the second waits.
    let config = WorkerConfig { queue_depth: 2, ..prefill_config(&net) };
    let p = start(config, gated.clone()).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    for (req, seed, blocks) in [("a", 1, [0, 1]), ("b", 2, [2, 3]), ("r", 3, [4, 5])] {
        fill(&p.cache, seed, &blocks);
        ready(&p, req, &blocks);
    }
    watch(&d, &p, "r");
    until_renewed(&p.worker, 1).await;

    let (host, port) = side_channel(&p);
    pull(&d, &host, port, &[("a", &[0, 1])]);
    gated.until_held(1).await;
    let before = sent(&d.worker);
    pull(&d, &host, port, &[("b", &[2, 3])]);
    // Every renewal D sends from now on waits unread behind the pull of
    // `b`, which waits for admission: once D sent them for more than two
    // renewal periods, P has held the request on D's behalf alone.
    until_counted(&d.worker, "renewals D sent", before + RENEWALS_PAST_TWO_PERIODS, sent).await;
    assert!(p.worker.get_finished().sending.is_empty(), "P freed a request whose renewals it left unread");
    gated.open();
    pull(&d, &host, port, &[("r", &[4, 5])]);

    let finished = until(&d.worker, |f| f.receiving.len() + f.failed_receiving.len() == 3).await;
    assert!(finished.failed_receiving.is_empty(), "{finished:?}");
    assert!(holds(&d.cache, 1, &[0, 1]) && holds(&d.cache, 2, &[2, 3]) && holds(&d.cache, 3, &[4, 5]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_renewals_p_holds_a_request_for_the_abort_timeout() {
    let net = Net::new(Backend::InMemory).unwrap();
    let config = WorkerConfig {
        lease_renewal: Duration::ZERO,
        abort_request_timeout: Duration::from_millis(300),
        ..net.config(KvRole::Producer, "p")
    };
    let p = start(config, net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    ready(&p, "r", &[0, 1]);
    watch(&d, &p, "r");
    // D sends nothing to a P that takes no renewals; P's lease ends the request.
    let finished = until(&p.worker, |f| f.sending.contains(&p_id("r"))).await;
    assert_eq!(finished.sending.len(), 1);
    assert_eq!(p.worker.renewed_requests(), 0);
}
