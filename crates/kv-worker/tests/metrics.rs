//! The worker's metrics against what real workers did on loopback: every
//! transfer, byte and failure counted exactly once, under the right cause,
//! on both sides.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kv_proto::{BlockId, FailureCause, KvRole};
use kv_worker::metrics::{MetricKind, Sample};
use kv_worker::AuthSecret;
use rstest::rstest;

/// Bytes of `blocks` blocks in every region of the test cache.
fn bytes_of(blocks: usize) -> u64 {
    let shape = shape();
    blocks as u64 * shape.block_len() * u64::from(shape.region_count())
}

fn only(map: &std::collections::BTreeMap<FailureCause, u64>) -> Vec<(FailureCause, u64)> {
    map.iter().filter(|(_, &n)| n > 0).map(|(&c, &n)| (c, n)).collect()
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transfer_and_byte_is_counted_once_on_both_sides(#[case] backend: Backend) {
    let Some(net) = Net::new(backend) else { return };
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let (host, port) = side_channel(&p);
    let requests: [(&str, &[BlockId], &[BlockId]); 3] =
        [("a", &[0, 1, 2], &[8, 9, 10]), ("b", &[3], &[11]), ("c", &[4, 5], &[12, 13])];
    for (i, (req, p_blocks, _)) in requests.iter().enumerate() {
        fill(&p.cache, i as u64, p_blocks);
        ready(&p, req, p_blocks);
    }
    let pulls: Vec<(&str, &[BlockId])> = requests.iter().map(|(r, _, d_blocks)| (*r, *d_blocks)).collect();
    pull(&d, &host, port, &pulls);
    until(&d.worker, |f| f.receiving.len() == 3).await;
    for (i, (_, _, d_blocks)) in requests.iter().enumerate() {
        assert!(holds(&d.cache, i as u64, d_blocks));
    }
    let bytes = bytes_of(6);

    let on_d = d.worker.metrics();
    assert_eq!((on_d.pulls_started, on_d.pulls_received, on_d.pulls_failed_total()), (3, 3, 0));
    assert_eq!(on_d.bytes_received, bytes);
    assert_eq!(on_d.pull_seconds.count(), 3);
    assert_eq!(on_d.pull_bytes.count(), 3);
    assert!((on_d.pull_bytes.sum - bytes as f64).abs() < 1.0);
    assert_eq!((on_d.pulls_in_flight, on_d.grants_live), (0, 0), "every grant revoked");

    let on_p = metrics_until(&p.worker, |m| m.sends_done == 3).await;
    assert_eq!(on_p.sends_failed_total(), 0);
    assert_eq!(on_p.bytes_sent, bytes);
    assert_eq!(on_p.send_wait_seconds.count(), 3, "one wait per request claimed");
    assert!(on_p.ops_per_batch.count() >= 1);
    assert!(on_p.batch_write_seconds.count() == on_p.ops_per_batch.count());
    // One side-channel connection each way, from and to this host.
    assert_eq!(on_p.connections.values().sum::<u64>(), 1, "{:?}", on_p.connections);
    assert_eq!(on_d.connections.values().sum::<u64>(), 1, "{:?}", on_d.connections);
    // The engine frees the blocks once told; nothing is held after that.
    until(&p.worker, |f| f.sending.len() == 3).await;
    let on_p = p.worker.metrics();
    assert_eq!((on_p.held_requests, on_p.held_blocks), (0, 0));

    // A pull of a request P never had: one failure on each side, same cause.
    pull(&d, &host, port, &[("ghost", &[14])]);
    until(&d.worker, |f| f.failed_receiving.len() == 1).await;
    let on_d = d.worker.metrics();
    assert_eq!(only(&on_d.pulls_failed), [(FailureCause::UnknownRequest, 1)]);
    assert_eq!((on_d.pulls_started, on_d.pulls_received), (4, 3));
    let on_p = metrics_until(&p.worker, |m| m.sends_failed_total() == 1).await;
    assert_eq!(only(&on_p.sends_failed), [(FailureCause::UnknownRequest, 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_requests_and_blocks_are_gauges_of_what_p_holds_now() {
    let net = Net::new(Backend::InMemory).unwrap();
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    ready(&p, "a", &[0, 1, 2]);
    ready(&p, "b", &[3]);
    expect(&p, "c");
    let on_p = p.worker.metrics();
    assert_eq!(
        (on_p.held_requests, on_p.held_blocks),
        (2, 4),
        "ready requests hold their blocks; expected ones none yet"
    );
}

#[rstest]
#[case::wrong_secret(Some("p-secret"), Some("d-secret"))]
#[case::none_on_d(Some("p-secret"), None)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_that_does_not_match_is_counted_as_an_authentication_failure(
    #[case] p_secret: Option<&str>,
    #[case] d_secret: Option<&str>,
) {
    let Some(net) = Net::new(Backend::Tcp) else { return };
    let mut p_config = net.config(KvRole::Producer, "p");
    p_config.auth_secret = p_secret.map(AuthSecret::new);
    let mut d_config = net.config(KvRole::Consumer, "d");
    d_config.auth_secret = d_secret.map(AuthSecret::new);
    let p = start_owned(p_config, shape()).await;
    let d = start_owned(d_config, shape()).await;
    let (host, port) = side_channel(&p);
    ready(&p, "a", &[0]);
    ready(&p, "b", &[1]);
    pull(&d, &host, port, &[("a", &[8])]);
    until(&d.worker, |f| f.failed_receiving.len() == 1).await;
    pull(&d, &host, port, &[("b", &[9])]);
    until(&d.worker, |f| f.failed_receiving.len() == 1).await;
    let on_d = d.worker.metrics();
    assert_eq!(only(&on_d.pulls_failed), [(FailureCause::AuthFailed, 2)]);
    assert_eq!(on_d.pulls_received, 0);
    // D stops at P's proof (P cannot prove D's secret, or D has none to
    // answer with): D counts it, once, since it takes the refusal as P's
    // answer for a while; P saw no wrong proof, only a peer that left.
    assert_eq!(on_d.auth_failures, 1);
    assert_eq!(p.worker.metrics().auth_failures, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_goes_away_fails_pulls_as_connection_lost() {
    let Some(net) = Net::new(Backend::Tcp) else { return };
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let (host, port) = side_channel(&p);
    // A request P never finishes: the pull waits on P until P is gone.
    expect(&p, "slow");
    pull(&d, &host, port, &[("slow", &[3])]);
    metrics_until(&p.worker, |m| m.transfers_in_progress == 1).await;
    p.worker.shutdown().await;
    until(&d.worker, |f| f.failed_receiving.len() == 1).await;
    let on_d = d.worker.metrics();
    let failed = only(&on_d.pulls_failed);
    assert!(
        failed == [(FailureCause::Shutdown, 1)] || failed == [(FailureCause::ConnectionLost, 1)],
        "P's shutdown answers the pull or closes the connection: {failed:?}"
    );
    // Nothing answers now: the next pull cannot connect.
    let lost_before = on_d.pulls_failed[&FailureCause::ConnectionLost];
    pull(&d, &host, port, &[("next", &[4])]);
    until(&d.worker, |f| f.failed_receiving.len() == 1).await;
    assert_eq!(d.worker.metrics().pulls_failed[&FailureCause::ConnectionLost], lost_before + 1);
}

#[test]
fn every_family_has_samples_of_its_kind() {
    let families = kv_worker::metrics::MetricsSnapshot::families;
    // A snapshot of a fresh worker is all zeros; the shape must already be
    // complete so dashboards see every series before the first event.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    rt.block_on(async {
        let net = Net::new(Backend::InMemory).unwrap();
        let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
        for family in families(&d.worker.metrics()) {
            for sample in &family.samples {
                match (family.kind, sample) {
                    (MetricKind::Histogram, Sample::Histogram { .. }) => {}
                    (MetricKind::Counter | MetricKind::Gauge, Sample::Value { .. }) => {}
                    other => panic!("{}: {other:?}", family.name),
                }
            }
            // Connections are listed per peer host, only once there is one.
            if family.name != "connections" {
                assert!(!family.samples.is_empty(), "{} has no series", family.name);
            }
        }
    });
}

#[test]
fn readme_documents_every_metric_with_its_kind_and_labels() {
    let readme = include_str!("../../../README.md");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let families = rt.block_on(async {
        let net = Net::new(Backend::InMemory).unwrap();
        let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
        d.worker.metrics().families()
    });
    for family in families {
        let kind = match family.kind {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        };
        let labels: String = family.labels.iter().map(|l| format!("`{l}` ")).collect();
        let row = format!("| `{}` | {kind} | {labels}|", family.name);
        assert!(readme.contains(&row), "README's metric table lacks the row starting {row}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_p_could_not_stage_fails_its_waiting_pull_with_that_cause() {
    let net = Net::new(Backend::InMemory).unwrap();
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let (host, port) = side_channel(&p);
    expect(&p, "a");
    pull(&d, &host, port, &[("a", &[3])]);
    metrics_until(&p.worker, |m| m.transfers_in_progress == 1).await;
    p.worker.fail_sends([&p_id("a")], FailureCause::StagingExhausted);
    let finished = until(&d.worker, |f| f.failed_receiving.len() == 1).await;
    assert!(finished.failed_receiving.contains_key(&kv_proto::ReqId::new("a")));
    assert_eq!(only(&d.worker.metrics().pulls_failed), [(FailureCause::StagingExhausted, 1)]);
    let on_p = metrics_until(&p.worker, |m| m.sends_failed_total() == 1).await;
    assert_eq!(only(&on_p.sends_failed), [(FailureCause::StagingExhausted, 1)]);
    assert!(p.worker.get_finished().sending.is_empty(), "the engine freed it itself: not reported again");
}
