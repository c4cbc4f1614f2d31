//! P writes only to a data endpoint on the host its side-channel peer
//! connected from, unless configured otherwise: a transfer request cannot aim
//! P's writes at a third host.
#![cfg(feature = "tcp")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use kv_proto::{ConnectorMetadata, KvRole, LayoutKind, RecvReqMeta, RemotePrefill, ReqId, SendUpdate};
use kv_worker::{CacheDims, CacheShape, DataEndpointPolicy, OwnedKvCache, Worker, WorkerConfig};
use rstest::rstest;
use transport_tcp::{TcpConfig, TcpTransport};

const BOUND: Duration = Duration::from_secs(20);
/// A documentation address (TEST-NET-1): never this host.
const ELSEWHERE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

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

/// D advertises its data endpoint on `advertised` (it listens on loopback);
/// P runs with `policy`. Returns whether D received the pull, and how many
/// data-plane connections P opened.
async fn pull_with(advertised: Option<IpAddr>, policy: DataEndpointPolicy) -> (bool, u64) {
    let p_cache = Arc::new(OwnedKvCache::allocate(shape()).unwrap());
    let p_writer = TcpTransport::bind(TcpConfig { connect_timeout: Duration::from_secs(1), ..TcpConfig::default() })
        .await
        .unwrap();
    let p_config = WorkerConfig { data_endpoint_policy: policy, ..WorkerConfig::loopback(KvRole::Producer, "p") };
    // SAFETY: the cache outlives the worker (shut down below, before the drop).
    let p =
        unsafe { Worker::start_with_writer(p_config, p_cache.registered().clone(), p_writer.clone()) }.await.unwrap();
    let d_config = WorkerConfig {
        data_advertise_host: advertised.map(|ip| ip.to_string()),
        ..WorkerConfig::loopback(KvRole::Consumer, "d")
    };
    let d = Worker::start(d_config, Arc::new(OwnedKvCache::allocate(shape()).unwrap())).await.unwrap();

    let (req, on_p) = (ReqId::new("r"), ReqId::new("p-r"));
    let mut send = ConnectorMetadata::default();
    send.reqs_to_send.insert(on_p.clone(), SendUpdate::Ready { block_ids: vec![0, 1] });
    p.start_load_kv(&send);
    let addr = p.side_channel_addr().unwrap();
    let remote = RemotePrefill {
        remote_host: addr.ip().to_string(),
        remote_port: addr.port(),
        remote_request_id: on_p,
        remote_engine_id: None,
        remote_renewal_key: None,
        bootstrap: None,
    };
    let meta = RecvReqMeta { local_block_ids: vec![2, 3], first_token: None, remote };
    d.start_load_kv(&ConnectorMetadata { reqs_to_recv: BTreeMap::from([(req.clone(), meta)]), ..Default::default() });
    let finished = d.next_finished(BOUND).await;
    assert!(finished.receiving.contains(&req) || finished.failed_receiving.contains_key(&req), "{finished:?}");
    let opened = p_writer.connections_opened();
    p.shutdown().await;
    d.shutdown().await;
    (finished.receiving.contains(&req), opened)
}

#[rstest]
#[case::own_host_by_default(None, DataEndpointPolicy::SamePeerHost, true, 1)]
#[case::a_third_host_is_refused_without_a_connection(
    Some(IpAddr::V4(ELSEWHERE)),
    DataEndpointPolicy::SamePeerHost,
    false,
    0
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_writes_only_where_the_policy_allows(
    #[case] advertised: Option<IpAddr>,
    #[case] policy: DataEndpointPolicy,
    #[case] received: bool,
    #[case] connections: u64,
) {
    assert_eq!(pull_with(advertised, policy).await, (received, connections));
}
