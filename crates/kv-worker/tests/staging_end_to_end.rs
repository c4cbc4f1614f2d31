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
    side_with(net, role, name, slots, 0).await
}

/// Bytes of one slot: a block of each of the 4 regions of [`shape_with`].
const SLOT_BYTES: u64 = 4 * 16 * 2 * 16 * 2;

/// A side whose requests move in pieces of `piece_blocks` blocks (0: whole).
async fn side_with(net: &Net, role: KvRole, name: &str, slots: u64, piece_blocks: u64) -> Side {
    side_configured(net.config(role, name), slots, piece_blocks).await
}

async fn side_configured(config: kv_worker::WorkerConfig, slots: u64, piece_blocks: u64) -> Side {
    let device = OwnedKvCache::allocate(shape_with(16)).unwrap();
    let staging = Arc::new(OwnedKvCache::allocate(shape_with(slots)).unwrap());
    let config = kv_worker::WorkerConfig { piece_bytes: piece_blocks * SLOT_BYTES, ..config };
    let worker = kv_worker::Worker::start(config, staging.clone()).await.unwrap();
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

    /// Runs the first ordered copy only (in order), reporting it done.
    fn run_one(&mut self) -> CopyOrder {
        let copy = self.copies.remove(0);
        copy_blocks(&self.device, &self.staging, &copy);
        let work = self.staged.copies_done([copy.id]);
        self.take(work);
        copy
    }

    /// Fails every ordered copy (the engine's copy engine broke).
    fn fail_copies(&mut self) {
        let copies = std::mem::take(&mut self.copies);
        let work = self.staged.copies_failed(copies.iter().map(|c| c.id));
        self.take(work);
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
        meta.reqs_to_recv.insert(
            ReqId::new(*req),
            kv_proto::RecvReqMeta { local_block_ids: blocks.clone(), first_token: None, remote },
        );
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

/// P's slots where P copies a six-block request into them as soon as it is
/// ready: twice the request, since P copies ahead of a pull only while room
/// for the largest request stays free.
const P_SLOTS: u64 = 12;

/// Request "a" of six blocks ready on P (filled from `seed`), copied into
/// its slots in three pieces of two, and D's pull of it started.
fn pull_in_three_pieces(p: &mut Side, d: &mut Side, seed: u64, p_blocks: &[BlockId], d_blocks: &[BlockId]) {
    filled(p, seed, p_blocks);
    let mut expect = ConnectorMetadata::default();
    expect.reqs_to_send.insert(p_id("a"), kv_proto::SendUpdate::Expect);
    p.start(&expect);
    p.start(&ready_meta(&[("a", p_blocks.to_vec())]));
    assert_eq!(p.copies.len(), 3, "P copies into its slots in three pieces");
    let meta = recv_meta(p, &[("a", d_blocks.to_vec())]);
    d.start(&meta);
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

/// Polls both sides (running no copy) until `done`, within [`BOUND`].
async fn poll_until(p: &mut Side, d: &mut Side, what: &str, done: impl Fn(&Side, &Side) -> bool) {
    let deadline = Instant::now() + BOUND;
    while !done(p, d) {
        assert!(Instant::now() < deadline, "{what} not within {BOUND:?}: P heard {:?}, D heard {:?}", p.heard, d.heard);
        p.poll();
        d.poll();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Pieces of two blocks on both sides, a request of six: P copies its
/// first piece only, and D already copies that piece into its blocks while
/// P's other pieces are not even in P's slots (the wire and both copy
/// engines run within one request); then the rest, byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_moves_in_pieces_each_copied_on_as_it_lands() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side_with(&net, KvRole::Producer, "p", P_SLOTS, 2).await;
    let mut d = side_with(&net, KvRole::Consumer, "d", 8, 2).await;
    let p_blocks: Vec<BlockId> = vec![3, 1, 4, 0, 5, 9];
    let d_blocks: Vec<BlockId> = vec![15, 2, 7, 11, 6, 8];
    pull_in_three_pieces(&mut p, &mut d, 7, &p_blocks, &d_blocks);
    let first = p.run_one();
    assert_eq!(first.pairs.len(), 2);
    poll_until(&mut p, &mut d, "D copying P's first piece", |_, d| !d.copies.is_empty()).await;
    assert_eq!(p.copies.len(), 2, "P's other pieces are not copied yet");
    let piece = d.run_one();
    assert_eq!((piece.direction, piece.pairs), (CopyDirection::ToDevice, vec![(15, 0), (2, 1)]));
    assert!(d.heard.receiving.is_empty(), "not before every piece is in D's blocks");
    drive(&mut p, &mut d, |_, d| !d.heard.receiving.is_empty()).await;
    assert!(device_holds(&d, 7, &d_blocks), "every byte, in D's blocks");
    drive(&mut p, &mut d, |p, _| p.staged.staging_state() == (0, P_SLOTS as usize)).await;
    assert_eq!(d.staged.staging_state(), (0, 8));
    let on_d = d.staged.worker().metrics();
    assert_eq!((on_d.pulls_received, on_d.pulls_failed_total()), (1, 0));
}

/// A copy that fails fails its request cleanly on either side
/// (`copy_failed`, counted once), and every slot comes back.
#[rstest::rstest]
#[case::p_copy_into_staging("p")]
#[case::d_copy_into_the_device("d")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_copy_fails_the_request_cleanly(#[case] failing: &str) {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side_with(&net, KvRole::Producer, "p", 8, 2).await;
    let mut d = side_with(&net, KvRole::Consumer, "d", 4, 2).await;
    filled(&p, 5, &[0, 1, 2, 3]);
    p.start(&ready_meta(&[("a", vec![0, 1, 2, 3])]));
    let meta = recv_meta(&p, &[("a", vec![8, 9, 10, 11])]);
    d.start(&meta);
    if failing == "p" {
        p.fail_copies();
    } else {
        p.run_copies();
        poll_until(&mut p, &mut d, "D's copy ordered", |_, d| !d.copies.is_empty()).await;
        d.fail_copies();
    }
    drive(&mut p, &mut d, |_, d| !d.heard.failed_receiving.is_empty()).await;
    assert_eq!(d.heard.failed_receiving, BTreeMap::from([(ReqId::new("a"), vec![8, 9, 10, 11])]));
    assert!(d.heard.receiving.is_empty());
    let on_d = d.staged.worker().metrics();
    assert_eq!(on_d.pulls_failed[&FailureCause::CopyFailed], 1);
    assert_eq!((on_d.pulls_received, on_d.pulls_failed_total()), (0, 1), "counted once");
    let direction = if failing == "p" { on_d.staging.copies_failed_to_device } else { 1 };
    assert_eq!(direction, u64::from(failing == "d"));
    drive(&mut p, &mut d, |p, d| p.staged.staging_state() == (0, 8) && d.staged.staging_state() == (0, 4)).await;
    if failing == "p" {
        let on_p = p.staged.worker().metrics();
        assert_eq!(on_p.sends_failed[&FailureCause::CopyFailed], 1);
        assert_eq!(on_p.staging.copies_failed_to_staging, 2, "both pieces' copies failed");
        assert!(p.heard.sending.contains(&p_id("a")), "P's engine got its blocks back");
    }
}

/// Whether any byte of `slots` of `side`'s staging was written (it starts zeroed).
fn slots_written(side: &Side, slots: &[BlockId]) -> bool {
    let mut buf = vec![0u8; side.staging.block_len()];
    (0..side.staging.shape().region_count()).any(|region| {
        slots.iter().any(|&slot| {
            // SAFETY: no pull may write the slot any more (its grant was revoked).
            unsafe { side.staging.read_block(region as usize, slot, &mut buf) }.unwrap();
            buf.iter().any(|&b| b != 0)
        })
    })
}

/// Pieces of two blocks, a request of six: D's copy of the second piece
/// into its blocks fails while P has yet to stage the third. D cuts the
/// pull short at once (its grant revoked, counted failed `copy_failed`
/// once, never cancelled): P's write of the third piece is refused, so P
/// ends its send and frees its slots long before the transfer timeout,
/// and no byte of it reaches D's staging; every slot comes back on both
/// sides and the engines go on (the next request lands).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_failing_mid_pull_cuts_the_pull_short_and_p_lets_go_at_once() {
    const TIMEOUT: Duration = Duration::from_secs(40);
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side_with(&net, KvRole::Producer, "p", P_SLOTS, 2).await;
    let d_config = kv_worker::WorkerConfig { transfer_timeout: TIMEOUT, ..net.config(KvRole::Consumer, "d") };
    let mut d = side_configured(d_config, 8, 2).await;
    let p_blocks: Vec<BlockId> = vec![0, 1, 2, 3, 4, 5];
    let d_blocks: Vec<BlockId> = vec![10, 11, 12, 13, 14, 15];
    pull_in_three_pieces(&mut p, &mut d, 9, &p_blocks, &d_blocks);
    // The first piece lands and is copied into D's blocks.
    p.run_one();
    poll_until(&mut p, &mut d, "D copying the first piece", |_, d| !d.copies.is_empty()).await;
    d.run_one();
    // The second lands; its copy fails.
    p.run_one();
    poll_until(&mut p, &mut d, "D copying the second piece", |_, d| !d.copies.is_empty()).await;
    let started = Instant::now();
    d.fail_copies();
    d.poll();
    assert_eq!(d.heard.failed_receiving, BTreeMap::from([(ReqId::new("a"), d_blocks.clone())]));
    assert_eq!(d.staged.staging_state(), (0, 8), "every slot back once fenced");
    // P stages its third piece and writes it: refused, P ends its send.
    drive(&mut p, &mut d, |p, _| p.staged.staging_state() == (0, P_SLOTS as usize)).await;
    let took = started.elapsed();
    assert!(took < TIMEOUT / 4, "P let go after {took:?}, not at the transfer timeout");
    assert_eq!(p.staged.worker().transfers_in_progress(), 0);
    assert!(p.heard.sending.contains(&p_id("a")), "P's engine got its blocks back");
    assert!(!slots_written(&d, &[4, 5]), "no byte of the third piece reached D's staging");
    assert!(d.heard.receiving.is_empty());
    let on_d = d.staged.worker().metrics();
    assert_eq!(on_d.pulls_failed.get(&FailureCause::CopyFailed), Some(&1));
    assert_eq!((on_d.pulls_received, on_d.pulls_failed_total(), on_d.pulls_cancelled), (0, 1, 0), "counted once");
    assert_eq!(on_d.staging.copies_failed_to_device, 1);
    assert_eq!(on_p_sends_failed(&p), 1, "P's send ended failed");

    // Both go on: the next request lands byte-exact in the same slots.
    filled(&p, 10, &[6, 7]);
    p.start(&ready_meta(&[("b", vec![6, 7])]));
    let meta = recv_meta(&p, &[("b", vec![8, 9])]);
    d.start(&meta);
    drive(&mut p, &mut d, |_, d| d.heard.receiving.contains(&ReqId::new("b"))).await;
    assert!(device_holds(&d, 10, &[8, 9]));
    assert_eq!(d.heard.failed_receiving.len(), 1, "a is heard once");
    drive(&mut p, &mut d, |p, d| {
        p.staged.staging_state() == (0, P_SLOTS as usize) && d.staged.staging_state() == (0, 8)
    })
    .await;
}

fn on_p_sends_failed(p: &Side) -> u64 {
    p.staged.worker().metrics().sends_failed_total()
}

/// D fails a pull it has no room to stage: P, holding the request in its
/// slots for the pull, hears at once and frees them (not at its lease's end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_frees_a_request_decode_could_not_stage() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side(&net, KvRole::Producer, "p", 6).await;
    let mut d = side(&net, KvRole::Consumer, "d", 2).await;
    filled(&p, 2, &[0, 1, 2]);
    p.start(&ready_meta(&[("big", vec![0, 1, 2])]));
    p.run_copies();
    p.poll();
    assert_eq!(p.staged.staging_state(), (1, 3), "P holds it in its slots for the pull");
    let meta = recv_meta(&p, &[("big", vec![1, 2, 3])]);
    d.start(&meta);
    d.poll();
    assert!(d.heard.failed_receiving.contains_key(&ReqId::new("big")));
    // The lease is minutes: only D's word frees it within the bound.
    poll_until(&mut p, &mut d, "P's slots free", |p, _| p.staged.staging_state() == (0, 6)).await;
    assert_eq!(p.staged.worker().metrics().lease_expiries, 0);
    let on_d = d.staged.worker().metrics();
    assert_eq!((on_d.pulls_started, on_d.pulls_received, on_d.pulls_failed_total()), (1, 0, 1), "counted once");
}

/// Two requests in one pull, one of them not finished on P: with pieces, D
/// hears the ready one received without waiting for the other, which then
/// fails on its own (P could not stage it) and is told at once too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_of_a_pull_is_heard_as_soon_as_it_ends() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side_with(&net, KvRole::Producer, "p", 8, 2).await;
    let mut d = side_with(&net, KvRole::Consumer, "d", 8, 2).await;
    let mut expect = ConnectorMetadata::default();
    expect.reqs_to_send.insert(p_id("late"), kv_proto::SendUpdate::Expect);
    p.start(&expect);
    filled(&p, 1, &[0, 1]);
    p.start(&ready_meta(&[("a", vec![0, 1])]));
    let meta = recv_meta(&p, &[("a", vec![4, 5]), ("late", vec![6, 7])]);
    d.start(&meta);
    drive(&mut p, &mut d, |_, d| d.heard.receiving.contains(&ReqId::new("a"))).await;
    assert!(device_holds(&d, 1, &[4, 5]));
    assert!(d.heard.failed_receiving.is_empty(), "late is still waited for");
    p.staged.worker().fail_sends([&p_id("late")], FailureCause::StagingExhausted);
    drive(&mut p, &mut d, |_, d| !d.heard.failed_receiving.is_empty()).await;
    assert_eq!(d.heard.failed_receiving, BTreeMap::from([(ReqId::new("late"), vec![6, 7])]));
    drive(&mut p, &mut d, |p, d| p.staged.staging_state() == (0, 8) && d.staged.staging_state() == (0, 8)).await;
    let on_d = d.staged.worker().metrics();
    assert_eq!((on_d.pulls_received, on_d.pulls_failed[&FailureCause::StagingExhausted]), (1, 1));
}

/// P stages ready requests ahead of their pulls, but never so many that a
/// request D pulls first finds no room: "a" and "b" are ready before "c",
/// D pulls "c" alone (all its slots), and "c" lands although nobody has
/// pulled "a" or "b" yet (filling P's slots with them would leave D's pull
/// waiting for P and P waiting for pulls D cannot start).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pulled_request_is_staged_before_those_staged_ahead_of_their_pulls() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p = side(&net, KvRole::Producer, "p", 4).await;
    let mut d = side(&net, KvRole::Consumer, "d", 2).await;
    let ready = [("a", vec![0, 1]), ("b", vec![2, 3]), ("c", vec![4, 5])];
    for (seed, (_, blocks)) in ready.iter().enumerate() {
        filled(&p, seed as u64, blocks);
    }
    p.start(&ready_meta(&ready));
    p.run_copies();
    p.poll();
    assert_eq!(p.staged.staging_state().1, 2, "one staged ahead, room for the largest left");

    let meta = recv_meta(&p, &[("c", vec![14, 15])]);
    d.start(&meta);
    drive(&mut p, &mut d, |_, d| d.heard.receiving.contains(&ReqId::new("c"))).await;
    assert!(device_holds(&d, 2, &[14, 15]), "c on D's device blocks");

    // The others land in turn once D pulls them.
    for (seed, (req, blocks)) in [(0, ("a", vec![10, 11])), (1, ("b", vec![12, 13]))] {
        let meta = recv_meta(&p, &[(req, blocks.clone())]);
        d.start(&meta);
        drive(&mut p, &mut d, |_, d| d.heard.receiving.contains(&ReqId::new(req))).await;
        assert!(device_holds(&d, seed, &blocks), "{req} on D's device blocks");
    }
    assert!(d.heard.failed_receiving.is_empty(), "{:?}", d.heard.failed_receiving);
    drive(&mut p, &mut d, |p, d| p.staged.staging_state() == (0, 4) && d.staged.staging_state() == (0, 2)).await;
    assert_eq!(p.heard.sending.len(), 3);
}
