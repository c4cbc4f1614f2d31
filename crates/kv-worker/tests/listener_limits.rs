//! The listener limits a `WorkerConfig` sets reach the listeners: the side
//! channel's (`side_channel_limits`) and the data plane's (`data_limits`,
//! handed to whichever transport `protocol` picks). A limit of 0 established
//! connections refuses every connection on every listener, as the transports
//! do on their own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{fill, holds, pull, ready, side_channel, start_owned, until, Backend, Net};
use kv_proto::{KvRole, ReqId};
use kv_worker::{ListenerLimits, WorkerConfig};
use rstest::rstest;

/// Which listener gets no established place.
#[derive(Clone, Copy, Debug)]
enum Closed {
    Nothing,
    /// P's side channel.
    SideChannel,
    /// D's data plane.
    DataPlane,
}

fn closed(limits: &mut ListenerLimits) {
    limits.max_connections = 0;
}

#[rstest]
#[case::tcp_defaults(Backend::Tcp, Closed::Nothing, true)]
#[case::tcp_side_channel_closed(Backend::Tcp, Closed::SideChannel, false)]
#[case::tcp_data_plane_closed(Backend::Tcp, Closed::DataPlane, false)]
#[case::quic_defaults(Backend::Quic, Closed::Nothing, true)]
#[case::quic_side_channel_closed(Backend::Quic, Closed::SideChannel, false)]
#[case::quic_data_plane_closed(Backend::Quic, Closed::DataPlane, false)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_listener_limits_reach_its_listeners(
    #[case] backend: Backend,
    #[case] which: Closed,
    #[case] lands: bool,
) {
    let Some(net) = Net::new(backend) else { return };
    let mut p_config: WorkerConfig = net.config(KvRole::Producer, "p");
    let mut d_config: WorkerConfig = net.config(KvRole::Consumer, "d");
    match which {
        Closed::Nothing => {}
        Closed::SideChannel => closed(&mut p_config.side_channel_limits),
        Closed::DataPlane => closed(&mut d_config.data_limits),
    }
    let p = start_owned(p_config, common::shape()).await;
    let d = start_owned(d_config, common::shape()).await;
    fill(&p.cache, 7, &[0, 1]);
    ready(&p, "r", &[0, 1]);
    let (host, port) = side_channel(&p);
    pull(&d, &host, port, &[("r", &[2, 3])]);
    let req = ReqId::new("r");
    let finished = until(&d.worker, |f| f.receiving.contains(&req) || f.failed_receiving.contains_key(&req)).await;
    assert_eq!(finished.receiving.contains(&req), lands, "{which:?}: {finished:?}");
    assert_eq!(holds(&d.cache, 7, &[2, 3]), lands, "{which:?}: the blocks");
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// A request with more ops than decode's data listener takes in one batch
/// (a long prompt whose heads are mapped one token row per op; here
/// scattered blocks, one op each per region) goes out in several batches
/// under its grant, each within P's `max_ops_per_batch`: it lands whole.
/// With P's bound above decode's limit, the batch is refused and the pull
/// fails, as it did before P split its writes.
#[cfg(feature = "tcp")]
#[rstest]
#[case::within_the_limit(4, true)]
#[case::past_the_limit(64, false)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_more_ops_than_a_batch_takes_goes_out_in_several(
    #[case] prefill_max_ops: usize,
    #[case] lands: bool,
) {
    use std::sync::Arc;

    use transport_tcp::{OpListLimits, TcpConfig, TcpTransport};

    let net = Net::new(Backend::Tcp).unwrap();
    let p_config = WorkerConfig { max_ops_per_batch: prefill_max_ops, ..net.config(KvRole::Producer, "p") };
    let p = start_owned(p_config, common::shape()).await;
    let limits = OpListLimits { max_ops_per_batch: 4, ..OpListLimits::default() };
    let d_writer = TcpTransport::bind(TcpConfig { op_lists: limits, ..TcpConfig::default() }).await.unwrap();
    let d = common::start(net.config(KvRole::Consumer, "d"), Arc::clone(&d_writer) as _).await;
    // 4 scattered blocks in each of the shape's 4 regions: 16 ops.
    let (from, to) = ([0, 2, 4, 6], [1, 3, 5, 7]);
    fill(&p.cache, 7, &from);
    ready(&p, "r", &from);
    let (host, port) = side_channel(&p);
    pull(&d, &host, port, &[("r", &to)]);
    let req = ReqId::new("r");
    let finished = until(&d.worker, |f| f.receiving.contains(&req) || f.failed_receiving.contains_key(&req)).await;
    assert_eq!(finished.receiving.contains(&req), lands, "{finished:?}");
    assert_eq!(holds(&d.cache, 7, &to), lands, "the blocks");
    if lands {
        let batches = common::metrics_until(&p.worker, |m| m.sends_done >= 1).await.ops_per_batch;
        assert_eq!((batches.count(), batches.sum), (4, 16.0), "16 ops in batches of 4");
    }
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}
