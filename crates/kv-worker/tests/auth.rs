//! Side-channel shared-secret authentication between real workers on loopback.
#![cfg(feature = "tcp")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kv_proto::{ConnectorMetadata, KvRole, LayoutKind, RecvReqMeta, RemotePrefill, ReqId, SendUpdate};
use kv_worker::{AuthSecret, CacheDims, CacheShape, Finished, OwnedKvCache, Worker, WorkerConfig};
use rstest::rstest;

const BOUND: Duration = Duration::from_secs(20);

fn shape() -> CacheShape {
    CacheShape::try_new(CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers: 2,
        num_blocks: 8,
        block_size: 16,
        num_kv_heads: 1,
        head_dim: 8,
        dtype_bytes: 2,
    })
    .unwrap()
}

async fn worker(role: KvRole, secret: Option<&str>) -> Worker {
    let mut config = WorkerConfig::loopback(role, if role == KvRole::Producer { "p" } else { "d" });
    config.auth_secret = secret.map(AuthSecret::new);
    Worker::start(config, Arc::new(OwnedKvCache::allocate(shape()).unwrap())).await.unwrap()
}

/// P holds request `r` ready; D pulls it; returns what D reports.
async fn pull(p_secret: Option<&str>, d_secret: Option<&str>) -> Finished {
    let p = worker(KvRole::Producer, p_secret).await;
    let d = worker(KvRole::Consumer, d_secret).await;
    // P and D name the request differently, as engines do.
    let (r, on_p) = (ReqId::new("r"), ReqId::new("p-r"));
    let mut send = ConnectorMetadata::default();
    send.reqs_to_send.insert(on_p.clone(), SendUpdate::Ready { block_ids: vec![0, 1] });
    p.start_load_kv(&send);
    let side_channel = p.side_channel_addr().unwrap();
    let recv = ConnectorMetadata {
        reqs_to_recv: BTreeMap::from([(
            r,
            RecvReqMeta {
                local_block_ids: vec![5, 6],
                first_token: None,
                remote: RemotePrefill {
                    remote_host: side_channel.ip().to_string(),
                    remote_port: side_channel.port(),
                    remote_request_id: on_p,
                    remote_engine_id: None,
                    remote_renewal_key: None,
                    bootstrap: None,
                },
            },
        )]),
        ..ConnectorMetadata::default()
    };
    d.start_load_kv(&recv);
    let finished = d.next_finished(BOUND).await;
    p.shutdown().await;
    d.shutdown().await;
    finished
}

#[rstest]
#[case::same_secret_on_both(Some("s3cret"), Some("s3cret"), true)]
#[case::no_secret_on_either(None, None, true)]
#[case::prefill_requires_it_decode_lacks_it(Some("s3cret"), None, false)]
#[case::decode_requires_it_prefill_lacks_it(None, Some("s3cret"), false)]
#[case::different_secrets(Some("s3cret"), Some("guess"), false)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_need_matching_secrets(#[case] p: Option<&str>, #[case] d: Option<&str>, #[case] received: bool) {
    let finished = pull(p, d).await;
    if received {
        assert_eq!(finished.receiving.len(), 1, "{finished:?}");
    } else {
        assert_eq!(finished.failed_receiving.len(), 1, "{finished:?}");
        assert!(finished.receiving.is_empty());
    }
}
