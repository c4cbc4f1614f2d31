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
