//! The verbs layer on a real device: two queue pairs on the guest's one
//! Soft-RoCE device, in one process, connected through the TCP handshake.
//! Run with `cargo xtask rdma-test`.
// Test helpers: a failure is a test failure.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::{connect_pair, device, handshake, run_plan, side};
use transport_rdma::plan::{Plan, Planner, SendQueueConfig, WriteSpan};
use transport_rdma::region::{LocalRegion, RegionTable, RemoteRegion};
use transport_rdma::verbs::{
    Access, BindWindow, ConnectOptions, MemoryRegion, MemoryWindow, ProtectionDomain, QpCapacity, QueuePairState,
    RegisteredBuffer, WcStatus,
};
use transport_rdma::window::SendWindow;

const KIB: usize = 1024;
const BLOCK: usize = 4 * KIB;
const BUFFER: usize = 64 * BLOCK;

/// Deterministic, position-dependent bytes (no two nearby blocks alike).
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(131) ^ (i >> 12).wrapping_mul(29)) as u8).collect()
}

/// Scattered writes: runs of remote-contiguous blocks from shuffled sources,
/// some blocks shorter than a block, gaps between runs.
fn scattered_ops(src_base: u64, dst_base: u64) -> Vec<WriteSpan> {
    (0..48usize)
        .map(|i| {
            let dst_block = (i / 6) * 8 + i % 6; // runs of 6, then a 2-block gap
            let src_block = (i * 37) % 64;
            let len = if i % 7 == 3 { 1000 + i } else { BLOCK };
            WriteSpan {
                src: src_base + (src_block * BLOCK) as u64,
                dst: dst_base + (dst_block * BLOCK) as u64,
                len: len as u64,
            }
        })
        .collect()
}

/// What the destination must hold after `ops` (applied in order) on zeros.
fn expected_destination(ops: &[WriteSpan], source: &[u8], src_base: u64, dst_base: u64) -> Vec<u8> {
    let mut expected = vec![0u8; BUFFER];
    for op in ops {
        let (src, dst, len) = ((op.src - src_base) as usize, (op.dst - dst_base) as usize, op.len as usize);
        expected[dst..dst + len].copy_from_slice(&source[src..src + len]);
    }
    expected
}

fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b)
}

#[tokio::test]
async fn scattered_writes_land_byte_exact() {
    let device = device();
    let pd = ProtectionDomain::new(&device).unwrap();
    let capacity = QpCapacity { max_send_wr: 8, max_send_sge: 4.min(device.limits().max_sge) };
    let (mut sender, mut receiver) = (side(&pd, capacity, 0x1234), side(&pd, capacity, 0x5678));

    let source = RegisteredBuffer::new(&pd, BUFFER, Access::Source).unwrap();
    let destination = RegisteredBuffer::new(&pd, BUFFER, Access::Destination).unwrap();
    let bytes = pattern(BUFFER);
    source.write(0, &bytes).unwrap();

    let (learnt, _) = handshake(&sender, &receiver, vec![destination.region().remote()]).await;
    connect_pair(&mut sender, &mut receiver, &learnt);
    assert_eq!(sender.qp.state().unwrap(), QueuePairState::ReadyToSend);

    let config = SendQueueConfig::new(capacity.max_send_sge, device.limits().max_msg_bytes.min(1 << 20), 3, 8).unwrap();
    let planner = Planner::new(
        RegionTable::new(vec![source.region().local()]).unwrap(),
        RegionTable::new(learnt.regions.clone()).unwrap(),
        config,
    );
    let (src_base, dst_base) = (source.region().addr(), destination.region().addr());
    let ops = scattered_ops(src_base, dst_base);
    let mut plan = Plan::default();
    planner.plan(&ops, &mut plan).unwrap();
    // Chaining happened, and the plan is longer than the queue: back-pressure is exercised.
    assert!(plan.writes().len() < ops.len() && plan.writes().len() > 8, "{} work requests", plan.writes().len());

    let report = run_plan(&mut sender, &plan, &config).await;
    assert!(report.failures().is_empty(), "failed completions: {:?}", report.failures());
    assert!(report.stalls > 0 && report.max_outstanding <= 8, "{report:?}");
    // Only signalled requests (and the last) complete when all goes well.
    assert_eq!(report.completions.len(), plan.writes().iter().filter(|write| write.signaled).count());

    let got = destination.to_vec();
    let want = expected_destination(&ops, &bytes, src_base, dst_base);
    assert_eq!(first_difference(&got, &want), None, "destination differs from the expected bytes");
    assert_eq!(plan.total_bytes(), ops.iter().map(|op| op.len).sum::<u64>());
}

#[tokio::test]
async fn a_write_into_a_source_region_fails_with_a_remote_access_error() {
    let device = device();
    let pd = ProtectionDomain::new(&device).unwrap();
    let capacity = QpCapacity { max_send_wr: 4, max_send_sge: 1 };
    let (mut sender, mut receiver) = (side(&pd, capacity, 0x10), side(&pd, capacity, 0x20));
    let source = RegisteredBuffer::new(&pd, BLOCK, Access::Source).unwrap();
    source.write(0, &pattern(BLOCK)).unwrap();
    // The receiver's memory is registered as a source (no remote write), yet
    // its rkey is advertised: the device, not the planner, must refuse.
    let protected = RegisteredBuffer::new(&pd, BLOCK, Access::Source).unwrap();
    let (learnt, _) = handshake(&sender, &receiver, vec![protected.region().remote()]).await;
    connect_pair(&mut sender, &mut receiver, &learnt);

    let config = SendQueueConfig::new(1, 1 << 20, 1, 4).unwrap();
    let planner = Planner::new(
        RegionTable::new(vec![source.region().local()]).unwrap(),
        RegionTable::new(learnt.regions.clone()).unwrap(),
        config,
    );
    let mut plan = Plan::default();
    let op = WriteSpan { src: source.region().addr(), dst: protected.region().addr(), len: BLOCK as u64 };
    planner.plan(&[op], &mut plan).unwrap();
    let report = run_plan(&mut sender, &plan, &config).await;

    let statuses: Vec<WcStatus> = report.completions.iter().map(|c| c.status).collect();
    assert_eq!(statuses, [WcStatus::RemoteAccessError]);
    assert_eq!(
        sender.qp.state().unwrap(),
        QueuePairState::Error,
        "an error completion moves an RC queue pair to error"
    );
    assert!(protected.to_vec().iter().all(|&byte| byte == 0), "no byte may land in a source region");
}

#[tokio::test]
async fn the_error_state_flushes_every_outstanding_request() {
    let device = device();
    let pd = ProtectionDomain::new(&device).unwrap();
    let capacity = QpCapacity { max_send_wr: 8, max_send_sge: 1 };
    let (mut sender, receiver) = (side(&pd, capacity, 0x30), side(&pd, capacity, 0x40));
    let source = RegisteredBuffer::new(&pd, 8 * BLOCK, Access::Source).unwrap();
    let destination = RegisteredBuffer::new(&pd, 8 * BLOCK, Access::Destination).unwrap();
    let (learnt, _) = handshake(&sender, &receiver, vec![destination.region().remote()]).await;
    // Only the sender connects: the receiver stays in RESET and drops every
    // packet, so no request can complete (one try lasts ~4 s with timeout 20,
    // retries would take half a minute) until the sender is moved to error.
    let patient = ConnectOptions { ack_timeout: 20, retry_count: 7, rnr_retry: 7, ..ConnectOptions::default() };
    sender.qp.connect(&learnt.qp, &patient).unwrap();
    assert_eq!(receiver.qp.state().unwrap(), QueuePairState::Reset);

    let config = SendQueueConfig::new(1, 1 << 20, 4, 8).unwrap();
    let planner = Planner::new(
        RegionTable::new(vec![source.region().local()]).unwrap(),
        RegionTable::new(learnt.regions.clone()).unwrap(),
        config,
    );
    // Six separate requests (remote gaps), signalled: the 4th and the last.
    let ops: Vec<WriteSpan> = (0..6u64)
        .map(|i| WriteSpan {
            src: source.region().addr() + i * BLOCK as u64,
            dst: destination.region().addr() + 2 * i * KIB as u64,
            len: KIB as u64,
        })
        .collect();
    let mut plan = Plan::default();
    planner.plan(&ops, &mut plan).unwrap();
    assert_eq!(plan.writes().len(), 6);
    let mut window = SendWindow::new(config.depth());
    let seqs = window.take(6);
    sender.qp.post_writes(&plan, 0..6, seqs.start).unwrap();

    // Wait first (the queue is empty: this arms the channel and sleeps),
    // then move the queue pair to error: the flush must wake the waiter.
    let mut completions = Vec::new();
    let support::Side { qp, cq } = &mut sender;
    let (woken, moved) =
        tokio::join!(tokio::time::timeout(Duration::from_secs(20), cq.wait(&mut completions)), async {
            qp.set_error()
        },);
    moved.unwrap();
    woken.expect("the flush wakes the waiter").unwrap();
    while completions.len() < 6 {
        tokio::time::timeout(Duration::from_secs(20), sender.cq.wait(&mut completions))
            .await
            .expect("every flushed request completes")
            .unwrap();
    }
    let ids: Vec<u64> = completions.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, (seqs.start..seqs.end).collect::<Vec<_>>(), "signalled or not, each completes, in order");
    assert!(completions.iter().all(|c| c.status == WcStatus::Flushed), "{completions:?}");
    for completion in &completions {
        window.complete(completion.wr_id).unwrap();
    }
    assert!(window.is_idle());
    assert_eq!(sender.qp.state().unwrap(), QueuePairState::Error);
    assert!(destination.to_vec().iter().all(|&byte| byte == 0));
}

/// Binds `windows` (with their next keys) over `ranges` of `region` on
/// `side`'s queue pair and waits for every bind; returns the keys.
async fn bind_windows(
    side: &mut support::Side,
    windows: &mut [MemoryWindow],
    region: &Arc<MemoryRegion>,
    ranges: &[(u64, u64)],
    first_seq: u64,
) -> Vec<u32> {
    let keys: Vec<u32> = windows.iter().map(MemoryWindow::next_rkey).collect();
    let binds: Vec<BindWindow<'_>> = windows
        .iter()
        .zip(ranges)
        .zip(&keys)
        .map(|((window, &(addr, len)), &rkey)| BindWindow { window, region, addr, len, rkey })
        .collect();
    let last = binds.len() - 1;
    side.qp.post_binds(&binds, first_seq, |index| index == last).unwrap();
    let mut completions = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), side.cq.wait(&mut completions)).await.unwrap().unwrap();
    assert_eq!(completions.iter().map(|c| c.status).collect::<Vec<_>>(), [WcStatus::Success]);
    for ((window, &(addr, len)), &rkey) in windows.iter_mut().zip(ranges).zip(&keys) {
        window.set_bound(Arc::clone(region), side.qp.hold(), addr, len, rkey);
    }
    keys
}

/// Invalidates `keys` on `side`'s queue pair; returns the completion statuses.
async fn invalidate(side: &mut support::Side, keys: &[u32], first_seq: u64) -> Vec<WcStatus> {
    let last = keys.len() - 1;
    side.qp.post_invalidates(keys, first_seq, |index| index == last).unwrap();
    let mut completions = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), side.cq.wait(&mut completions)).await.unwrap().unwrap();
    completions.iter().map(|c| c.status).collect()
}

/// Writes `len` bytes from `src` to `dst` under `rkey` with a fresh plan;
/// returns the completion statuses.
async fn write_once(
    sender: &mut support::Side,
    local: LocalRegion,
    src: u64,
    dst: u64,
    len: u64,
    rkey: u32,
) -> Vec<WcStatus> {
    let config = SendQueueConfig::new(1, 1 << 20, 1, 4).unwrap();
    let remote = RemoteRegion { addr: dst, len, rkey };
    let planner = Planner::new(RegionTable::new(vec![local]).unwrap(), RegionTable::new(vec![remote]).unwrap(), config);
    let mut plan = Plan::default();
    planner.plan(&[WriteSpan { src, dst, len }], &mut plan).unwrap();
    run_plan(sender, &plan, &config).await.completions.iter().map(|c| c.status).collect()
}

/// The grant fence at the verbs level: a region registered `Windowed` takes
/// no write through its own key; a window bound on the receiver's queue pair
/// takes writes through its key until a `LOCAL_INV` completes, after which
/// the same write fails and lands nothing; the window binds again under its
/// next key, and the old key stays dead.
#[tokio::test]
async fn a_window_opens_writes_until_it_is_invalidated() {
    let device = device();
    assert!(device.limits().max_mw > 0, "the device has no memory windows");
    let pd = ProtectionDomain::new(&device).unwrap();
    let capacity = QpCapacity { max_send_wr: 8, max_send_sge: 1 };
    let source = RegisteredBuffer::new(&pd, 4 * BLOCK, Access::Source).unwrap();
    source.write(0, &pattern(4 * BLOCK)).unwrap();
    let target = RegisteredBuffer::new(&pd, 4 * BLOCK, Access::Windowed).unwrap();
    let region = Arc::new(
        // SAFETY: `target` is registered memory of this test, alive (and never
        // referenced) until after `region` and every window bound on it drop.
        unsafe { pd.register(target.region().addr(), target.region().len(), Access::Windowed) }.unwrap(),
    );
    let (src, dst) = (source.region().addr(), target.region().addr());
    let local = source.region().local();

    // Its own key opens nothing.
    let (mut sender, mut receiver) = (side(&pd, capacity, 0x100), side(&pd, capacity, 0x200));
    let (learnt, _) = handshake(&sender, &receiver, Vec::new()).await;
    connect_pair(&mut sender, &mut receiver, &learnt);
    let statuses = write_once(&mut sender, local, src, dst, BLOCK as u64, region.rkey()).await;
    assert_eq!(statuses, [WcStatus::RemoteAccessError]);
    assert!(target.to_vec().iter().all(|&b| b == 0));

    // A fresh pair; a window over block 1 takes a write through its key.
    let (mut sender, mut receiver) = (side(&pd, capacity, 0x300), side(&pd, capacity, 0x400));
    let (learnt, _) = handshake(&sender, &receiver, Vec::new()).await;
    connect_pair(&mut sender, &mut receiver, &learnt);
    let mut windows = vec![MemoryWindow::alloc(&pd).unwrap()];
    let block1 = (dst + BLOCK as u64, BLOCK as u64);
    let keys = bind_windows(&mut receiver, &mut windows, &region, &[block1], 0).await;
    assert_eq!(windows[0].bound_range(), Some(block1));
    let statuses = write_once(&mut sender, local, src, block1.0, BLOCK as u64, keys[0]).await;
    assert_eq!(statuses, [WcStatus::Success]);
    let mut landed = vec![0u8; BLOCK];
    target.read(BLOCK, &mut landed).unwrap();
    assert_eq!(landed, pattern(BLOCK)[..BLOCK]);

    // Invalidated: the same write fails and lands nothing.
    assert_eq!(invalidate(&mut receiver, &keys, 1).await, [WcStatus::Success]);
    windows[0].set_invalidated();
    target.write(BLOCK, &vec![0u8; BLOCK]).unwrap();
    let statuses = write_once(&mut sender, local, src, block1.0, BLOCK as u64, keys[0]).await;
    assert_eq!(statuses, [WcStatus::RemoteAccessError]);
    assert!(target.to_vec().iter().all(|&b| b == 0), "a write landed through an invalidated window");

    // The window binds again (next key) on a fresh pair; the old key stays dead.
    let (mut sender, mut receiver) = (side(&pd, capacity, 0x500), side(&pd, capacity, 0x600));
    let (learnt, _) = handshake(&sender, &receiver, Vec::new()).await;
    connect_pair(&mut sender, &mut receiver, &learnt);
    let block2 = (dst + 2 * BLOCK as u64, BLOCK as u64);
    let new_keys = bind_windows(&mut receiver, &mut windows, &region, &[block2], 0).await;
    assert_ne!(new_keys[0], keys[0]);
    assert_eq!(new_keys[0] >> 8, keys[0] >> 8, "same window index, new key");
    let statuses = write_once(&mut sender, local, src, block2.0, BLOCK as u64, keys[0]).await;
    assert_eq!(statuses, [WcStatus::RemoteAccessError], "the old key opened the rebound window");
    let (mut sender, mut receiver2) = (side(&pd, capacity, 0x700), side(&pd, capacity, 0x800));
    let (learnt, _) = handshake(&sender, &receiver2, Vec::new()).await;
    connect_pair(&mut sender, &mut receiver2, &learnt);
    // A window works only on the queue pair it is bound on.
    let statuses = write_once(&mut sender, local, src, block2.0, BLOCK as u64, new_keys[0]).await;
    assert_eq!(statuses, [WcStatus::RemoteAccessError], "a window opened writes on another queue pair");
    assert!(target.to_vec().iter().all(|&b| b == 0));
    drop(windows);
    drop(receiver);
}
