//! The holes a review found, end to end through real workers: a late write
//! into blocks D already reused, a side channel cut mid-batch, one slow
//! request starving its batch, and writing past D's wait budget.
//!
//! Each runs over every data plane compiled in (the in-memory reference,
//! TCP, QUIC). A gate in front of P's `batch_write` holds its write at the
//! door and lets it through after D gave up: exactly a P that waited for a
//! transfer slot, or was mid-batch, when D's deadline passed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::*;
use kv_proto::{BlockId, ConnectorMetadata, KvRole, ReqId};
use kv_worker::WorkerConfig;
use rstest::rstest;
use tokio::net::{TcpListener, TcpStream};

/// D's transfer timeout in the scenarios where D gives up.
const SHORT: Duration = Duration::from_millis(300);

/// Hole 1: D gives up on X (P's write is stuck behind a transfer slot), the
/// engine reuses X's blocks for Y, Y lands; then P's write of X goes ahead:
/// not one byte of it lands in Y's blocks.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_write_cannot_touch_blocks_d_reused(#[case] backend: Backend) {
    let Some(net) = Net::new(backend) else { return };
    let gated = GatedWriter::new(net.writer(KvRole::Producer, "p").await, 1);
    let p = start(net.config(KvRole::Producer, "p"), gated.clone()).await;
    let d = start(
        WorkerConfig { transfer_timeout: SHORT, ..net.config(KvRole::Consumer, "d") },
        net.writer(KvRole::Consumer, "d").await,
    )
    .await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 1, &[0, 1]);
    fill(&p.cache, 2, &[2, 3]);
    ready(&p, "x", &[0, 1]);
    ready(&p, "y", &[2, 3]);

    pull(&d, &host, port, &[("x", &[4, 5])]);
    gated.until_held(1).await;
    let failed = until(&d.worker, |f| !f.failed_receiving.is_empty()).await;
    assert_eq!(failed.failed_receiving, BTreeMap::from([(ReqId::new("x"), vec![4, 5])]));

    // The engine hands blocks 4 and 5 to Y, which arrives whole.
    pull(&d, &host, port, &[("y", &[4, 5])]);
    let received = until(&d.worker, |f| !f.receiving.is_empty()).await;
    assert!(received.receiving.contains(&ReqId::new("y")), "{received:?}");
    assert!(holds(&d.cache, 2, &[4, 5]));

    // P's write of X now goes ahead, under the grant D revoked.
    gated.open();
    let sent = until(&p.worker, |f| f.sending.contains(&p_id("x"))).await;
    assert!(sent.sending.contains(&p_id("x")), "P frees X's blocks once its write failed");
    assert!(holds(&d.cache, 2, &[4, 5]), "the late write of X landed in Y's blocks");
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// A TCP relay the test can cut: one connection, both directions.
struct Relay {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn to(upstream: (String, u16)) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let (mut inbound, _) = listener.accept().await.unwrap();
            let mut outbound = TcpStream::connect((upstream.0.as_str(), upstream.1)).await.unwrap();
            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        });
        Self { port, task }
    }

    /// Drops both connections at once.
    fn cut(&self) {
        self.task.abort();
    }
}

/// The side channel drops while P's write is in flight: D reports the pull
/// failed, and no byte of it lands afterwards.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lands_after_the_side_channel_dropped_mid_batch(#[case] backend: Backend) {
    let Some(net) = Net::new(backend) else { return };
    let gated = GatedWriter::new(net.writer(KvRole::Producer, "p").await, 1);
    let p = start(net.config(KvRole::Producer, "p"), gated.clone()).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let relay = Relay::to(side_channel(&p)).await;
    fill(&p.cache, 1, &[0, 1]);
    ready(&p, "x", &[0, 1]);

    pull(&d, "127.0.0.1", relay.port, &[("x", &[4, 5])]);
    gated.until_held(1).await;
    relay.cut();
    let failed = until(&d.worker, |f| !f.failed_receiving.is_empty()).await;
    assert_eq!(failed.failed_receiving, BTreeMap::from([(ReqId::new("x"), vec![4, 5])]));

    gated.open();
    until(&p.worker, |f| f.sending.contains(&p_id("x"))).await;
    assert!(all_zero(&d.cache, &[4, 5]), "bytes landed after D reported the pull failed");
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// Hole 4: a transfer request for a request that is not ready yet (A) and
/// one that is (B): B is written at once, without waiting for A.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_request_does_not_hold_back_its_batch(#[case] backend: Backend) {
    let Some(net) = Net::new(backend) else { return };
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 1, &[0, 1]);
    fill(&p.cache, 2, &[2, 3]);
    expect(&p, "a");
    ready(&p, "b", &[2, 3]);

    pull(&d, &host, port, &[("a", &[4, 5]), ("b", &[6, 7])]);
    let sent = until(&p.worker, |f| !f.sending.is_empty()).await;
    assert_eq!(sent.sending.iter().map(ReqId::as_str).collect::<Vec<_>>(), ["p-b"], "B went out while A was not ready");

    ready(&p, "a", &[0, 1]);
    let received = until(&d.worker, |f| f.receiving.len() == 2).await;
    assert!(received.failed_receiving.is_empty(), "{received:?}");
    assert!(holds(&d.cache, 1, &[4, 5]) && holds(&d.cache, 2, &[6, 7]));
    until(&p.worker, |f| f.sending.contains(&p_id("a"))).await;
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// P does not start writing once D's wait budget has passed: X becomes ready
/// on P only after D gave up, and nothing of it is written.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_written_past_the_wait_budget(#[case] backend: Backend) {
    let Some(net) = Net::new(backend) else { return };
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(
        WorkerConfig { transfer_timeout: SHORT, ..net.config(KvRole::Consumer, "d") },
        net.writer(KvRole::Consumer, "d").await,
    )
    .await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 1, &[0, 1]);
    expect(&p, "x");

    pull(&d, &host, port, &[("x", &[4, 5])]);
    let failed = until(&d.worker, |f| !f.failed_receiving.is_empty()).await;
    assert!(failed.failed_receiving.contains_key(&ReqId::new("x")));
    // P's wait for X ends at the budget too: no transfer is left waiting.
    let deadline = Instant::now() + BOUND;
    while p.worker.transfers_in_progress() > 0 {
        assert!(Instant::now() < deadline, "P still waits for X past D's budget");
        tokio::task::yield_now().await;
    }
    ready(&p, "x", &[0, 1]);
    // D gave up on X for good: P frees it as soon as it is ready, not at
    // the end of a lease no one will use.
    until(&p.worker, |f| f.sending.contains(&p_id("x"))).await;
    assert!(all_zero(&d.cache, &[4, 5]));
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// D's side-channel connection closes while P waits for X to become ready:
/// X is freed on P the moment it is ready, not leased for 480 s.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_puller_went_away_is_freed_when_ready(#[case] backend: Backend) {
    let Some(net) = Net::new(backend) else { return };
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let relay = Relay::to(side_channel(&p)).await;
    expect(&p, "x");
    pull(&d, "127.0.0.1", relay.port, &[("x", &[4, 5])]);
    let deadline = Instant::now() + BOUND;
    while p.worker.transfers_in_progress() == 0 {
        assert!(Instant::now() < deadline, "the pull never reached P");
        tokio::task::yield_now().await;
    }
    relay.cut();
    until(&d.worker, |f| f.failed_receiving.contains_key(&ReqId::new("x"))).await;
    while p.worker.transfers_in_progress() > 0 {
        assert!(Instant::now() < deadline, "P still waits for X for a puller that is gone");
        tokio::task::yield_now().await;
    }
    ready(&p, "x", &[0, 1]);
    until(&p.worker, |f| f.sending.contains(&p_id("x"))).await;
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// The engine aborts X while P's write of it is in flight (vLLM frees the
/// blocks at once): when `start_load_kv` with the cancellation returns, no
/// byte of X can land, so the blocks can go straight to Y.
#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_cancelled_by_the_engine_lands_nothing_after_the_step(#[case] backend: Backend) {
    let Some(net) = Net::new(backend) else { return };
    let gated = GatedWriter::new(net.writer(KvRole::Producer, "p").await, 1);
    let p = start(net.config(KvRole::Producer, "p"), gated.clone()).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 1, &[0, 1]);
    fill(&p.cache, 2, &[2, 3]);
    ready(&p, "x", &[0, 1]);
    ready(&p, "y", &[2, 3]);

    pull(&d, &host, port, &[("x", &[4, 5])]);
    gated.until_held(1).await;
    let cancel = ConnectorMetadata { reqs_to_cancel: [ReqId::new("x")].into(), ..ConnectorMetadata::default() };
    d.worker.start_load_kv(&cancel);
    // The engine reuses 4 and 5 for Y at once.
    pull(&d, &host, port, &[("y", &[4, 5])]);
    let received = until(&d.worker, |f| f.receiving.contains(&ReqId::new("y"))).await;
    assert!(
        !received.receiving.contains(&ReqId::new("x")) && !received.failed_receiving.contains_key(&ReqId::new("x"))
    );
    assert!(holds(&d.cache, 2, &[4, 5]));

    gated.open();
    until(&p.worker, |f| f.sending.contains(&p_id("x"))).await;
    assert!(holds(&d.cache, 2, &[4, 5]), "the cancelled pull's write landed in Y's blocks");
    let later = d.worker.get_finished();
    assert!(
        !later.receiving.contains(&ReqId::new("x")) && !later.failed_receiving.contains_key(&ReqId::new("x")),
        "a cancelled pull is never reported: {later:?}"
    );
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// Hole 4 as a table: requests of one transfer request become ready on P in
/// some order; each is written as soon as it is ready, never held back by
/// one that is not.
#[rstest]
#[case::first_not_ready(&["b", "c"], &["a"])]
#[case::last_not_ready(&["a", "b"], &["c"])]
#[case::none_ready_then_out_of_order(&[], &["c", "a", "b"])]
#[case::all_ready(&["a", "b", "c"], &[])]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_is_written_as_soon_as_it_is_ready(#[case] ready_at_once: &[&str], #[case] later: &[&str]) {
    let Some(net) = Net::new(Backend::InMemory) else { return };
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let (host, port) = side_channel(&p);
    let p_blocks = |req: &str| -> Vec<BlockId> {
        let i = u32::from(req.as_bytes()[0] - b'a');
        vec![2 * i, 2 * i + 1]
    };
    for (seed, req) in ["a", "b", "c"].into_iter().enumerate() {
        fill(&p.cache, seed as u64 + 1, &p_blocks(req));
        if ready_at_once.contains(&req) {
            ready(&p, req, &p_blocks(req));
        } else {
            expect(&p, req);
        }
    }
    pull(&d, &host, port, &[("a", &[6, 7]), ("b", &[8, 9]), ("c", &[10, 11])]);
    let mut sent = BTreeSet::new();
    let mut wanted: BTreeSet<ReqId> = ready_at_once.iter().map(|r| p_id(r)).collect();
    sent.extend(until(&p.worker, |f| wanted.iter().all(|r| f.sending.contains(r))).await.sending);
    for req in later {
        assert!(!sent.contains(&p_id(req)), "{req} was sent before it was ready");
        ready(&p, req, &p_blocks(req));
        wanted.insert(p_id(req));
        sent.extend(until(&p.worker, |f| f.sending.contains(&p_id(req))).await.sending);
    }
    let received = until(&d.worker, |f| f.receiving.len() == 3).await;
    assert!(received.failed_receiving.is_empty(), "{received:?}");
    assert!(holds(&d.cache, 1, &[6, 7]) && holds(&d.cache, 2, &[8, 9]) && holds(&d.cache, 3, &[10, 11]));
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}
