//! Shared set-up for the tests that need an RDMA device: the device named by
//! the Soft-RoCE guest (`cargo xtask rdma-test` sets RXE_DEV and
//! RXE_GID_INDEX), a connected pair of queue pairs on it, and a driver that
//! posts a plan under the send window and collects its completions.
// Test set-up: a failure here is a test failure, with the message saying why.
#![allow(clippy::expect_used)]

use std::sync::Arc;

use transport_rdma::handshake::{exchange, ConnectionInfo, HandshakeLimits};
use transport_rdma::plan::{Plan, SendQueueConfig};
use transport_rdma::region::RemoteRegion;
use transport_rdma::tags::FrameTags;
use transport_rdma::verbs::{
    Completion, CompletionQueue, ConnectOptions, Device, ProtectionDomain, QpCapacity, QueuePair, WcStatus,
};
use transport_rdma::window::SendWindow;

/// The guest's device, port 1, at the GID index of its IPv4 address.
pub(crate) fn device() -> Arc<Device> {
    let name = std::env::var("RXE_DEV").expect("RXE_DEV is unset: run these tests with `cargo xtask rdma-test`");
    let gid_index: u8 = std::env::var("RXE_GID_INDEX")
        .expect("RXE_GID_INDEX is unset: run these tests with `cargo xtask rdma-test`")
        .parse()
        .expect("RXE_GID_INDEX is a small integer");
    Device::open(&name, 1, gid_index).expect("open the RDMA device")
}

/// One side of a connection: its queue pair and the completion queue it uses.
pub(crate) struct Side {
    pub(crate) qp: QueuePair,
    pub(crate) cq: CompletionQueue,
}

/// Creates a queue pair (with its own completion queue) in `pd`.
pub(crate) fn side(pd: &Arc<ProtectionDomain>, capacity: QpCapacity, psn: u32) -> Side {
    // A flush completes every outstanding request: room for all of them.
    let cq = CompletionQueue::new(pd.device(), capacity.max_send_wr * 2).expect("create a completion queue");
    let qp = QueuePair::new(pd, &cq, capacity, psn).expect("create a queue pair");
    Side { qp, cq }
}

/// Runs the handshake between `sender` and `receiver` over TCP on loopback,
/// the receiver advertising `regions`; returns what the sender learnt.
pub(crate) async fn handshake(
    sender: &Side,
    receiver: &Side,
    regions: Vec<RemoteRegion>,
) -> (ConnectionInfo, ConnectionInfo) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("local address");
    let receiver_info = ConnectionInfo { qp: receiver.qp.endpoint(), regions };
    let sender_info = ConnectionInfo { qp: sender.qp.endpoint(), regions: Vec::new() };
    let limits = HandshakeLimits::default();
    let accept = async {
        let (mut stream, _) = listener.accept().await.expect("accept");
        exchange(&mut stream, &receiver_info, &limits, &mut FrameTags::none()).await.expect("receiver's handshake")
    };
    let connect = async {
        let mut stream = tokio::net::TcpStream::connect(address).await.expect("connect");
        exchange(&mut stream, &sender_info, &limits, &mut FrameTags::none()).await.expect("sender's handshake")
    };
    let (learnt_by_receiver, learnt_by_sender) = tokio::join!(accept, connect);
    (learnt_by_sender, learnt_by_receiver)
}

/// Connects both queue pairs to each other.
pub(crate) fn connect_pair(sender: &mut Side, receiver: &mut Side, sender_learnt: &ConnectionInfo) {
    let sender_endpoint = sender.qp.endpoint();
    sender.qp.connect(&sender_learnt.qp, &ConnectOptions::default()).expect("connect the sender");
    receiver.qp.connect(&sender_endpoint, &ConnectOptions::default()).expect("connect the receiver");
}

/// What [`run_plan`] saw.
#[derive(Debug, Default)]
pub(crate) struct RunReport {
    /// Every completion, in arrival order.
    pub(crate) completions: Vec<Completion>,
    /// Times the poster found the window full and had to wait.
    pub(crate) stalls: usize,
    /// Most requests outstanding at once.
    pub(crate) max_outstanding: u32,
}

impl RunReport {
    /// The completions that did not succeed.
    pub(crate) fn failures(&self) -> Vec<Completion> {
        self.completions.iter().filter(|c| c.status != WcStatus::Success).copied().collect()
    }
}

/// Posts all of `plan` on `side` under a window of `config.depth()`,
/// waiting for completions whenever the window is full, until every request
/// has completed or one has failed (then the rest are flushed: the queue
/// pair is in the error state, and they are collected too).
pub(crate) async fn run_plan(side: &mut Side, plan: &Plan, config: &SendQueueConfig) -> RunReport {
    let mut window = SendWindow::new(config.depth());
    let mut report = RunReport::default();
    let total = plan.writes().len();
    let mut posted = 0usize;
    let mut failed = false;
    let mut batch = Vec::new();
    while (posted < total && !failed) || !window.is_idle() {
        if posted < total && !failed {
            let wanted = u32::try_from(total - posted).unwrap_or(u32::MAX);
            let granted = window.take(wanted);
            let count = (granted.end - granted.start) as usize;
            if count > 0 {
                side.qp.post_writes(plan, posted..posted + count, granted.start).expect("post work requests");
                posted += count;
                report.max_outstanding = report.max_outstanding.max(window.outstanding());
                continue;
            }
            report.stalls += 1;
        }
        batch.clear();
        side.cq.wait(&mut batch).await.expect("wait for completions");
        for completion in &batch {
            window.complete(completion.wr_id).expect("a completion for a posted request");
            failed |= completion.status != WcStatus::Success;
        }
        report.completions.extend_from_slice(&batch);
    }
    report
}
