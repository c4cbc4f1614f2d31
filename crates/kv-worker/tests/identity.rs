//! Request identity between two engines, through real workers: D names a
//! request to P by P's id and engine (what P's `request_finished` returned),
//! reports it to its own engine under its own id, and P refuses a pull meant
//! for another prefill engine without touching its own request.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;

use common::*;
use kv_proto::{BlockId, ConnectorMetadata, EngineId, KvRole, RecvReqMeta, ReqId};
use rstest::rstest;

/// D pulls its request `req` into `blocks`, naming P's request `on_p` of
/// prefill engine `engine`.
fn pull_named(d: &Instance, host: &str, port: u16, req: &str, on_p: &str, engine: Option<&str>, blocks: &[BlockId]) {
    let mut remote = remote(host, port, req);
    remote.remote_request_id = ReqId::new(on_p);
    remote.remote_engine_id = engine.map(EngineId::new);
    let meta = RecvReqMeta { local_block_ids: blocks.to_vec(), first_token: None, remote };
    let reqs_to_recv = BTreeMap::from([(ReqId::new(req), meta)]);
    d.worker.start_load_kv(&ConnectorMetadata { reqs_to_recv, ..ConnectorMetadata::default() });
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[case::quic(Backend::Quic)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_for_another_prefill_engine_is_refused_and_takes_nothing(#[case] backend: Backend) {
    let Some(net) = Net::new(backend) else { return };
    let p = start(net.config(KvRole::Producer, "prefill-a"), net.writer(KvRole::Producer, "prefill-a").await).await;
    let d = start(net.config(KvRole::Consumer, "decode"), net.writer(KvRole::Consumer, "decode").await).await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 1, &[0, 1]);
    ready(&p, "x", &[0, 1]);

    // A proxy that mixed up prefill instances: same request id, other engine.
    pull_named(&d, &host, port, "cmpl-1-d1", p_id("x").as_str(), Some("prefill-b"), &[4, 5]);
    let refused = until(&d.worker, |f| !f.failed_receiving.is_empty()).await;
    assert_eq!(refused.failed_receiving, BTreeMap::from([(ReqId::new("cmpl-1-d1"), vec![4, 5])]));
    assert!(all_zero(&d.cache, &[4, 5]), "nothing was written for the refused pull");
    assert!(p.worker.get_finished().sending.is_empty(), "P still holds its request for the right decode");

    // The right pull, naming this P, gets it whole.
    pull_named(&d, &host, port, "cmpl-1-d2", p_id("x").as_str(), Some("prefill-a"), &[6, 7]);
    let received = until(&d.worker, |f| !f.receiving.is_empty()).await;
    assert!(received.receiving.contains(&ReqId::new("cmpl-1-d2")), "{received:?}");
    assert!(holds(&d.cache, 1, &[6, 7]));
    until(&p.worker, |f| f.sending.contains(&p_id("x"))).await;
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

#[rstest]
#[case::in_memory(Backend::InMemory)]
#[case::tcp(Backend::Tcp)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_by_ds_own_id_finds_nothing_on_a_prefill_that_names_it_otherwise(#[case] backend: Backend) {
    let Some(net) = Net::new(backend) else { return };
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let (host, port) = side_channel(&p);
    fill(&p.cache, 3, &[0, 1]);
    ready(&p, "x", &[0, 1]);

    // What kvlink did before P's id travelled: D asked for its own id.
    pull_named(&d, &host, port, "x", "x", None, &[2, 3]);
    let failed = until(&d.worker, |f| !f.failed_receiving.is_empty()).await;
    assert!(failed.failed_receiving.contains_key(&ReqId::new("x")), "{failed:?}");

    // By P's id (no engine named: an older proxy's params), it lands.
    pull_named(&d, &host, port, "x", p_id("x").as_str(), None, &[2, 3]);
    let received = until(&d.worker, |f| !f.receiving.is_empty()).await;
    assert!(received.receiving.contains(&ReqId::new("x")));
    assert!(holds(&d.cache, 3, &[2, 3]));
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}
