//! KV of "device" caches moved through host staging between real workers
//! on loopback TCP, with real copies between the device blocks and the
//! slots (the test plays the engine's copy engine): every byte verified on
//! D's device blocks, more requests than slots, requests too large for the
//! staging, a peer gone mid-copy, a pull cancelled mid-copy; every slot
//! comes back.
#![cfg(feature = "tcp")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kv_proto::{BlockId, ConnectorMetadata, FailureCause, KvRole, LayoutKind, ReqId};
use kv_worker::staging::{CopyDirection, CopyOrder, CopyWork, StagedWorker};
use kv_worker::{CacheDims, CacheShape, Finished, OwnedKvCache};

const WAIT: Duration = Duration::from_secs(10);

fn shape_with(num_blocks: u64) -> CacheShape {
    CacheShape::try_new(CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers: 2,
        num_blocks,
        block_size: 16,
        num_kv_heads: 2,
        head_dim: 16,
        dtype_bytes: 2,
    })
    .unwrap()
}

/// An engine side: its device cache, and a staged worker over `slots` slots.
struct Side {
    device: OwnedKvCache,
    staging: Arc<OwnedKvCache>,
    staged: StagedWorker,
    /// Copies ordered and not yet run (the test runs them when it likes).
    copies: Vec<CopyOrder>,
    heard: Finished,
}

async fn side(net: &Net, role: KvRole, name: &str, slots: u64) -> Side {
    let device = OwnedKvCache::allocate(shape_with(16)).unwrap();
    let staging = Arc::new(OwnedKvCache::allocate(shape_with(slots)).unwrap());
    let worker = kv_worker::Worker::start(net.config(role, name), staging.clone()).await.unwrap();
    Side { device, staging, staged: StagedWorker::new(worker, WAIT), copies: Vec::new(), heard: Finished::default() }
}

impl Side {
    fn take(&mut self, work: CopyWork) {
        self.copies.extend(work.copies);
    }

    /// Runs every ordered copy for real, block by block, and reports them done.
    fn run_copies(&mut self) {
        while !self.copies.is_empty() {
            let copies = std::mem::take(&mut self.copies);
            for copy in &copies {
                copy_blocks(&self.device, &self.staging, copy);
            }
            let work = self.staged.copies_done(copies.iter().map(|c| c.id));
            self.take(work);
        }
    }

    fn poll(&mut self) {
        let (finished, work) = self.staged.get_finished();
        self.take(work);
        self.heard.sending.extend(finished.sending);
        self.heard.receiving.extend(finished.receiving);
        self.heard.failed_receiving.extend(finished.failed_receiving);
    }

    fn start(&mut self, meta: &ConnectorMetadata) -> Vec<u64> {
        let work = self.staged.start_load_kv(meta);
        let wait_for = work.wait_for.clone();
        self.take(work);
        wait_for
    }
}

fn copy_blocks(device: &OwnedKvCache, staging: &OwnedKvCache, copy: &CopyOrder) {
    let mut buf = vec![0u8; device.block_len()];
    for region in 0..device.shape().region_count() as usize {
        for &(dev, slot) in &copy.pairs {
            // SAFETY: the test runs copies only of blocks no transfer touches
            // (the core orders them before a pull or after its fence).
            unsafe {
                match copy.direction {
                    CopyDirection::ToStaging => {
                        device.read_block(region, dev, &mut buf).unwrap();
                        staging.write_block(region, slot, &buf).unwrap();
                    }
                    CopyDirection::ToDevice => {
                        staging.read_block(region, slot, &mut buf).unwrap();
                        device.write_block(region, dev, &buf).unwrap();
                    }
                }
            }
        }
    }
}

fn ready_meta(reqs: &[(&str, Vec<BlockId>)]) -> ConnectorMetadata {
    let mut meta = ConnectorMetadata::default();
    for (req, blocks) in reqs {
        meta.reqs_to_send.insert(p_id(req), kv_proto::SendUpdate::Ready { block_ids: blocks.clone() });
    }
    meta
}

fn recv_meta(p: &Side, reqs: &[(&str, Vec<BlockId>)]) -> ConnectorMetadata {
    let addr = p.staged.worker().side_channel_addr().unwrap();
    let mut meta = ConnectorMetadata::default();
    for (req, blocks) in reqs {
        let remote = remote(&addr.ip().to_string(), addr.port(), req);
        meta.reqs_to_recv.insert(ReqId::new(*req), kv_proto::RecvReqMeta { local_block_ids: blocks.clone(), remote });
    }
    meta
}

/// Drives both sides (copies run at once) until `done`, within [`BOUND`].
async fn drive(p: &mut Side, d: &mut Side, done: impl Fn(&Side, &Side) -> bool) {
    let deadline = Instant::now() + BOUND;
    while !done(p, d) {
        assert!(Instant::now() < deadline, "not done within {BOUND:?}: P heard {:?}, D heard {:?}", p.heard, d.heard);
        p.run_copies();
        d.run_copies();
        p.poll();
        d.poll();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn filled(side: &Side, seed: u64, blocks: &[BlockId]) {
    let mut buf = vec![0u8; side.device.block_len()];
    for region in 0..side.device.shape().region_count() {
        for (position, &block) in blocks.iter().enumerate() {
            kv_worker::pattern::fill(&mut buf, kv_worker::pattern::block_seed(seed, region, position as u32));
            // SAFETY: no copy or transfer touches the block while it is filled.
            unsafe { side.device.write_block(region as usize, block, &buf) }.unwrap();
        }
    }
}

fn device_holds(side: &Side, seed: u64, blocks: &[BlockId]) -> bool {
    let mut buf = vec![0u8; side.device.block_len()];
    (0..side.device.shape().region_count()).all(|region| {
        blocks.iter().enumerate().all(|(position, &block)| {
            // SAFETY: the pull was reported: nothing writes the block any more.
            unsafe { side.device.read_block(region as usize, block, &mut buf) }.unwrap();
            kv_worker::pattern::matches(&buf, kv_worker::pattern::block_seed(seed, region, position as u32))
        })
    })
}

/// P sends request "a" (seed `seed`) to D; D's pull lands in its slots
/// and the copy to its device is ordered, not run.
async fn pulled_not_copied(p: &mut Side, d: &mut Side, seed: u64) {
    filled(p, seed, &[0, 1]);
    p.start(&ready_meta(&[("a", vec![0, 1])]));
    p.run_copies();
    let meta = recv_meta(p, &[("a", vec![8, 9])]);
    d.start(&meta);
    let deadline = Instant::now() + BOUND;
    while d.copies.is_empty() {
        assert!(Instant::now() < deadline, "D's pull never landed");
        p.poll();
        d.poll();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_requests_than_slots_all_land_byte_exact_and_every_slot_comes_back() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side(&net, KvRole::Producer, "p", 4).await;
    let mut d = side(&net, KvRole::Consumer, "d", 4).await;
    // Six requests of two blocks through four slots on each side.
    let names = ["r0", "r1", "r2", "r3", "r4", "r5"];
    let p_reqs: Vec<(&str, Vec<BlockId>)> =
        names.iter().enumerate().map(|(i, n)| (*n, vec![2 * i as u32, 2 * i as u32 + 1])).collect();
    let d_reqs: Vec<(&str, Vec<BlockId>)> =
        names.iter().enumerate().map(|(i, n)| (*n, vec![15 - 2 * i as u32, 14 - 2 * i as u32])).collect();
    for (i, (_, blocks)) in p_reqs.iter().enumerate() {
        filled(&p, i as u64, blocks);
    }
    p.start(&ready_meta(&p_reqs));
    let meta = recv_meta(&p, &d_reqs);
    d.start(&meta);
    drive(&mut p, &mut d, |_, d| d.heard.receiving.len() + d.heard.failed_receiving.len() == names.len()).await;

    assert!(d.heard.failed_receiving.is_empty(), "{:?}", d.heard.failed_receiving);
    for (i, (_, blocks)) in d_reqs.iter().enumerate() {
        assert!(device_holds(&d, i as u64, blocks), "request {i} on D's device blocks");
    }
    // P heard every request finished sending (its device blocks free), and
    // both sides end with every slot free.
    drive(&mut p, &mut d, |p, _| p.staged.staging_state() == (0, 4)).await;
    assert_eq!(p.heard.sending.len(), names.len());
    assert_eq!(d.staged.staging_state(), (0, 4));
    let on_d = d.staged.worker().metrics();
    assert_eq!((on_d.pulls_received, on_d.pulls_failed_total()), (6, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_the_staging_fails_cleanly_on_both_sides() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side(&net, KvRole::Producer, "p", 2).await;
    let mut d = side(&net, KvRole::Consumer, "d", 4).await;
    // P cannot stage three blocks in two slots: its pull is answered failed.
    filled(&p, 1, &[0, 1, 2]);
    p.start(&ready_meta(&[("big", vec![0, 1, 2])]));
    assert!(p.heard.sending.is_empty());
    p.poll();
    assert_eq!(p.heard.sending, BTreeSet::from([p_id("big")]), "P's engine frees the blocks at once");
    let meta = recv_meta(&p, &[("big", vec![5, 6, 7])]);
    d.start(&meta);
    drive(&mut p, &mut d, |_, d| !d.heard.failed_receiving.is_empty()).await;
    assert_eq!(d.heard.failed_receiving, BTreeMap::from([(ReqId::new("big"), vec![5, 6, 7])]));
    assert_eq!(d.staged.worker().metrics().pulls_failed[&FailureCause::StagingExhausted], 1, "P said why");
    // D cannot stage five blocks in four slots: failed before any pull.
    let meta = recv_meta(&p, &[("bigger", vec![1, 2, 3, 4, 5])]);
    d.start(&meta);
    d.poll();
    assert!(d.heard.failed_receiving.contains_key(&ReqId::new("bigger")));
    assert_eq!(d.staged.worker().metrics().pulls_failed[&FailureCause::StagingExhausted], 2);
    assert_eq!((p.staged.staging_state(), d.staged.staging_state()), ((0, 2), (0, 4)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_gone_mid_copy_fails_the_pull_and_d_keeps_no_slot() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side(&net, KvRole::Producer, "p", 4).await;
    let mut d = side(&net, KvRole::Consumer, "d", 4).await;
    let mut expect = ConnectorMetadata::default();
    expect.reqs_to_send.insert(p_id("a"), kv_proto::SendUpdate::Expect);
    p.start(&expect);
    // P's copy into its slots is ordered and never run: P goes away mid-copy.
    p.start(&ready_meta(&[("a", vec![0, 1])]));
    assert_eq!(p.copies.len(), 1);
    let meta = recv_meta(&p, &[("a", vec![8, 9])]);
    d.start(&meta);
    let deadline = Instant::now() + BOUND;
    while d.staged.worker().metrics().pulls_in_flight == 0 || p.staged.worker().transfers_in_progress() == 0 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    p.staged.shutdown().await;
    let deadline = Instant::now() + BOUND;
    while d.heard.failed_receiving.is_empty() {
        assert!(Instant::now() < deadline, "D never heard the pull failed");
        d.poll();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(d.heard.failed_receiving, BTreeMap::from([(ReqId::new("a"), vec![8, 9])]));
    assert_eq!(d.staged.staging_state(), (0, 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_cancelled_mid_copy_is_waited_for_then_never_reported() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side(&net, KvRole::Producer, "p", 4).await;
    let mut d = side(&net, KvRole::Consumer, "d", 4).await;
    pulled_not_copied(&mut p, &mut d, 3).await;
    let cancel =
        ConnectorMetadata { reqs_to_cancel: BTreeSet::from([ReqId::new("a")]), ..ConnectorMetadata::default() };
    let wait_for = d.start(&cancel);
    assert_eq!(wait_for, vec![d.copies[0].id], "the engine must finish the copy before freeing the blocks");
    d.run_copies();
    d.poll();
    assert!(d.heard.receiving.is_empty() && d.heard.failed_receiving.is_empty(), "never reported");
    assert_eq!(d.staged.staging_state(), (0, 4));
}

/// A decode instance that goes away mid-copy (its pull landed, the copy to
/// its device not done): P's side still ends with every slot free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_gone_mid_copy_leaves_p_with_every_slot_free() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side(&net, KvRole::Producer, "p", 4).await;
    let mut d = side(&net, KvRole::Consumer, "d", 4).await;
    pulled_not_copied(&mut p, &mut d, 4).await;
    d.staged.shutdown().await;
    let deadline = Instant::now() + BOUND;
    while p.staged.staging_state() != (0, 4) {
        assert!(Instant::now() < deadline, "P keeps slots: {:?}", p.staged.staging_state());
        p.poll();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
