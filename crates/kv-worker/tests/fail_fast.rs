//! An incompatible prefill worker is one clear error at connect time, not a
//! stream of per-request failures: D takes P's refusal as its answer for a
//! while, failing every pull at once with P's reason, without asking again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use futures_util::{SinkExt, StreamExt};
use kv_proto::{FailureCause, FrameCodec, HelloReply, KvRole, SideMessage};
use kv_worker::SideChannelCodec;
use test_support::Logs;
use tokio::net::TcpListener;
use tokio_util::codec::Framed;

const REASON: &str = "incompatible peers (region count: prefill p has 4, decode d has 8)";

/// A prefill side channel that refuses every hello, counting connections.
async fn refusing_prefill() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut framed = Framed::new(stream, SideChannelCodec::new(FrameCodec::new(1 << 20)));
                if let Some(Ok(SideMessage::Hello(_))) = framed.next().await {
                    let refused = HelloReply::Rejected { reason: REASON.to_owned() };
                    let _ = framed.send(SideMessage::HelloReply(refused)).await;
                }
            });
        }
    });
    (port, connections)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_prefill_is_asked_once_and_every_pull_fails_with_its_reason() {
    let logs = Logs::install(tracing::Level::INFO);
    let net = Net::new(Backend::InMemory).unwrap();
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let (port, connections) = refusing_prefill().await;

    // Five steps, five transfer requests.
    for (i, req) in ["a", "b", "c", "d", "e"].into_iter().enumerate() {
        let block = i as u32;
        pull(&d, "127.0.0.1", port, &[(req, &[block])]);
        let finished = until(&d.worker, |f| !f.failed_receiving.is_empty()).await;
        assert_eq!(finished.failed_receiving.len(), 1, "{finished:?}");
        assert!(finished.receiving.is_empty());
    }
    assert_eq!(connections.load(Ordering::SeqCst), 1, "P's refusal is taken as its answer, not asked for again");
    assert_eq!(logs.lines_with(&["ERROR", "cannot use this prefill worker", REASON]), 1, "one clear error");
    // Each pull fails with P's reason, counted under its cause; the log
    // says it once per cause and interval, not once per request.
    assert_eq!(logs.lines_with(&["WARN", "KV pull failed", "incompatible_peer", REASON]), 1, "one warning");
    let metrics = d.worker.metrics();
    assert_eq!(metrics.pulls_started, 5);
    assert_eq!(metrics.pulls_failed[&FailureCause::IncompatiblePeer], 5, "{:?}", metrics.pulls_failed);
    assert_eq!(metrics.pulls_failed_total(), 5);
    assert_eq!(metrics.pulls_received, 0);
}
