//! Prefill and decode instances laid out differently (other tensor-parallel
//! sizes, block sizes, token layouts) with host staging forced on every
//! worker of both, moving requests in pieces: each decode worker pulls a
//! request in parts (one per prefill worker holding some of its heads) into
//! its slots and copies each piece into its "device" blocks only once every
//! part wrote it; each prefill worker copies its device blocks into its
//! slots in pieces and writes each piece while the rest copies, to every
//! decode worker that pulls the request from it. Every byte of every head
//! row is checked on the decode workers' device blocks, every request is
//! heard once on each side, and every slot of every worker comes back; a
//! part that fails mid-way (a copy on its prefill worker fails, or that
//! worker goes away) fails the request, once, and leaks nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kv_proto::{
    BlockId, ConnectorMetadata, FailureCause, KvRole, LayoutKind, RankTopology, RecvReqMeta, RemotePrefill, ReqId,
    SendUpdate, TokenLayout,
};
use kv_worker::pattern::RegionRows;
use kv_worker::staging::{CopyDirection, CopyOrder, CopyWork, StagedWorker};
use kv_worker::{CacheDims, CacheShape, Finished, OwnedKvCache, Worker, WorkerError};
use rstest::rstest;

/// KV heads of the model: split over 4 ranks, each is replicated on two.
const HEADS: u32 = 2;
/// Layers of the model.
const LAYERS: u32 = 2;
/// Device blocks of every worker.
const DEVICE_BLOCKS: u64 = 48;
/// How long a request waits for staging slots.
const WAIT: Duration = Duration::from_secs(20);

/// How one instance is laid out and staged.
#[derive(Clone, Copy, Debug)]
struct Layout {
    kind: LayoutKind,
    order: TokenLayout,
    block_size: u32,
    tp: u32,
    /// Staging slots of each worker.
    slots: u64,
    /// Blocks per piece (of its own blocks: P's copies into staging, D's
    /// pieces on the wire and copies to the device).
    piece: u64,
}

fn split(order: TokenLayout, block_size: u32, tp: u32) -> Layout {
    Layout { kind: LayoutKind::SplitKv, order, block_size, tp, slots: 10, piece: 2 }
}

impl Layout {
    fn topology(&self, tp_rank: u32) -> RankTopology {
        RankTopology::new(self.tp, tp_rank, 1, 0, HEADS).unwrap()
    }

    fn shape(&self, tp_rank: u32, num_blocks: u64) -> CacheShape {
        let dims = CacheDims {
            kind: self.kind,
            num_layers: LAYERS,
            num_blocks,
            block_size: self.block_size,
            num_kv_heads: self.topology(tp_rank).heads.count,
            head_dim: 8,
            dtype_bytes: 2,
        };
        CacheShape::try_new(dims).unwrap().with_token_layout(self.order)
    }
}

/// One worker of an instance: its device cache, and a staged worker over
/// its slots (the test runs the copies the core orders, as the engine's
/// copy engine would).
struct Rank {
    /// Dropped first: the worker ends every access to `staging` then.
    staged: StagedWorker,
    topology: RankTopology,
    device: OwnedKvCache,
    staging: Arc<OwnedKvCache>,
    slots: usize,
    copies: Vec<CopyOrder>,
    /// Copies into the device blocks run so far, by request.
    to_device: BTreeMap<ReqId, usize>,
    heard: Finished,
}

impl Rank {
    fn rows(&self) -> Vec<RegionRows> {
        RegionRows::of_shape(&self.device.shape(), self.topology.heads.first, 0)
    }

    fn take(&mut self, work: CopyWork) {
        self.copies.extend(work.copies);
    }

    fn start(&mut self, meta: &ConnectorMetadata) {
        let work = self.staged.start_load_kv(meta);
        self.take(work);
    }

    /// Runs the ordered copies that `which` picks (block by block, for
    /// real) and reports them done.
    fn run_copies_where(&mut self, which: impl Fn(&CopyOrder) -> bool) {
        loop {
            let (run, keep): (Vec<CopyOrder>, Vec<CopyOrder>) =
                std::mem::take(&mut self.copies).into_iter().partition(&which);
            self.copies = keep;
            if run.is_empty() {
                return;
            }
            for copy in &run {
                copy_blocks(&self.device, &self.staging, copy);
                if copy.direction == CopyDirection::ToDevice {
                    *self.to_device.entry(copy.req.clone()).or_default() += 1;
                }
            }
            let work = self.staged.copies_done(run.iter().map(|c| c.id));
            self.take(work);
        }
    }

    fn run_copies(&mut self) {
        self.run_copies_where(|_| true);
    }

    /// Fails the ordered copies that `which` picks (the copy engine broke).
    fn fail_copies_where(&mut self, which: impl Fn(&CopyOrder) -> bool) {
        let (fail, keep): (Vec<CopyOrder>, Vec<CopyOrder>) =
            std::mem::take(&mut self.copies).into_iter().partition(which);
        self.copies = keep;
        let work = self.staged.copies_failed(fail.iter().map(|c| c.id));
        self.take(work);
    }

    fn poll(&mut self) {
        let (finished, work) = self.staged.get_finished();
        self.take(work);
        for req in finished.sending {
            assert!(self.heard.sending.insert(req.clone()), "{req} heard finished sending twice");
        }
        for req in finished.receiving {
            assert!(!self.heard.failed_receiving.contains_key(&req), "{req} heard received after failed");
            assert!(self.heard.receiving.insert(req.clone()), "{req} heard received twice");
        }
        for (req, blocks) in finished.failed_receiving {
            assert!(!self.heard.receiving.contains(&req), "{req} heard failed after received");
            assert!(self.heard.failed_receiving.insert(req.clone(), blocks).is_none(), "{req} heard failed twice");
        }
    }

    fn all_slots_free(&self) -> bool {
        self.staged.staging_state() == (0, self.slots)
    }
}

fn copy_blocks(device: &OwnedKvCache, staging: &OwnedKvCache, copy: &CopyOrder) {
    let mut buf = vec![0u8; device.block_len()];
    for region in 0..device.shape().region_count() as usize {
        for &(dev, slot) in &copy.pairs {
            // SAFETY: the core orders copies only of blocks no transfer
            // touches (before a send, or of pieces P said landed).
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

/// Starts every worker of an instance, staged, on consecutive side-channel
/// ports from a base the OS left free (another base if one is taken).
async fn start_instance(net: &Net, role: KvRole, name: &str, layout: Layout) -> (u16, Vec<Rank>) {
    let first = 30_000 + (std::process::id() as u16 % 2_000) * 8;
    on_free_ports(first, 379, |base| async move {
        let mut ranks = Vec::new();
        for tp_rank in 0..layout.tp {
            let worker_name = format!("{name}-{tp_rank}");
            let device_shape = layout.shape(tp_rank, DEVICE_BLOCKS);
            let staging_shape = layout.shape(tp_rank, layout.slots);
            let slot_bytes = staging_shape.block_len() * u64::from(staging_shape.region_count());
            let mut config = net.config(role, &worker_name);
            config.engine_id = kv_proto::EngineId::new(name);
            config.side_channel_base_port = base;
            config.tp_size = layout.tp as u16;
            config.tp_rank = tp_rank as u16;
            config.identity.num_kv_heads = HEADS;
            config.piece_bytes = layout.piece * slot_bytes;
            let staging = Arc::new(OwnedKvCache::allocate(staging_shape).unwrap());
            let writer = net.writer(role, &worker_name).await;
            // SAFETY: the staging memory outlives the worker (the rank drops
            // the worker first), and the test copies a slot only when the
            // staging core says no transfer uses it.
            let started = unsafe { Worker::start_with_writer(config, staging.registered().clone(), writer) }.await;
            match started {
                Ok(worker) => ranks.push(Rank {
                    staged: StagedWorker::new(worker, WAIT),
                    topology: layout.topology(tp_rank),
                    device: OwnedKvCache::allocate(device_shape).unwrap(),
                    staging,
                    slots: layout.slots as usize,
                    copies: Vec::new(),
                    to_device: BTreeMap::new(),
                    heard: Finished::default(),
                }),
                Err(WorkerError::Bind { .. }) => return None,
                Err(e) => panic!("{e}"),
            }
        }
        Some(ranks)
    })
    .await
}

/// One request: its prompt length, P's blocks, D's blocks and the token
/// D's blocks start at (its prefix-cache hit, whole decode blocks).
struct Request {
    id: &'static str,
    prompt: u64,
    prefill_blocks: Vec<BlockId>,
    decode_blocks: Vec<BlockId>,
    first_token: u64,
}

fn request(id: &'static str, seed_block: u32, prompt: u64, p: &Layout, d: &Layout, skipped: u64) -> Request {
    let p_blocks = prompt.div_ceil(u64::from(p.block_size)) as u32;
    let d_total = prompt.div_ceil(u64::from(d.block_size)) as u32;
    // Scattered on both sides (runs broken).
    let prefill_blocks = (0..p_blocks).map(|i| seed_block + i + i / 2).collect();
    let decode_blocks = (skipped as u32..d_total).map(|i| seed_block + 2 * i).collect();
    Request { id, prompt, prefill_blocks, decode_blocks, first_token: skipped * u64::from(d.block_size) }
}

fn seed(req: &Request) -> u64 {
    req.id.bytes().map(u64::from).sum::<u64>() * 7919
}

fn fill_rows(rank: &Rank, req: &Request) {
    let tokens = u64::from(rank.device.shape().block_size());
    let mut buf = vec![0u8; rank.device.block_len()];
    for (region, rows) in rank.rows().iter().enumerate() {
        for (i, &block) in req.prefill_blocks.iter().enumerate() {
            rows.fill(&mut buf, seed(req), i as u64 * tokens);
            // SAFETY: no copy reads the block while the test fills it.
            unsafe { rank.device.write_block(region, block, &buf) }.unwrap();
        }
    }
}

fn holds_rows(rank: &Rank, req: &Request) -> bool {
    let tokens = u64::from(rank.device.shape().block_size());
    rank.rows().iter().enumerate().all(|(region, rows)| {
        req.decode_blocks.iter().enumerate().all(|(i, &block)| {
            let buf = read(&rank.device, region as u32, block);
            rows.check(&buf, seed(req), req.first_token + i as u64 * tokens, req.first_token, req.prompt)
        })
    })
}

fn sends(reqs: &[Request]) -> ConnectorMetadata {
    let mut meta = ConnectorMetadata::default();
    for req in reqs {
        meta.reqs_to_send.insert(p_id(req.id), SendUpdate::Ready { block_ids: req.prefill_blocks.clone() });
    }
    meta
}

fn pulls(base: u16, reqs: &[Request]) -> ConnectorMetadata {
    let reqs_to_recv = reqs
        .iter()
        .map(|req| {
            let meta = RecvReqMeta {
                local_block_ids: req.decode_blocks.clone(),
                first_token: Some(req.first_token),
                remote: RemotePrefill { remote_engine_id: None, ..remote("127.0.0.1", base, req.id) },
            };
            (ReqId::new(req.id), meta)
        })
        .collect();
    ConnectorMetadata { reqs_to_recv, ..ConnectorMetadata::default() }
}

/// Runs every copy and polls every worker until `done`, within [`BOUND`].
async fn drive(prefill: &mut [Rank], decode: &mut [Rank], what: &str, done: impl Fn(&[Rank], &[Rank]) -> bool) {
    let deadline = Instant::now() + BOUND;
    while !done(prefill, decode) {
        let heard: Vec<&Finished> = prefill.iter().chain(decode.iter()).map(|r| &r.heard).collect();
        assert!(Instant::now() < deadline, "{what} not within {BOUND:?}: {heard:?}");
        for rank in prefill.iter_mut().chain(decode.iter_mut()) {
            rank.run_copies();
            rank.poll();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Polls (running only the copies `which` picks) until `done`.
async fn poll_until(
    prefill: &mut [Rank],
    decode: &mut [Rank],
    what: &str,
    which: impl Fn(usize, &CopyOrder) -> bool,
    done: impl Fn(&[Rank], &[Rank]) -> bool,
) {
    let deadline = Instant::now() + BOUND;
    while !done(prefill, decode) {
        assert!(Instant::now() < deadline, "{what} not within {BOUND:?}");
        for (i, rank) in prefill.iter_mut().enumerate() {
            rank.run_copies_where(|c| which(i, c));
            rank.poll();
        }
        for rank in decode.iter_mut() {
            rank.poll();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn shutdown(ranks: Vec<Rank>) {
    for rank in ranks {
        rank.staged.shutdown().await;
    }
}

/// P (laid out `p`) prefills three requests, D (laid out `d`) pulls them,
/// staged on every worker of both, in pieces: every head row of every
/// decode worker's device blocks holds the right bytes, each request is
/// heard once on every worker, each was copied to the device in more than
/// one piece, and every slot comes back (a prefill worker's slots are
/// fewer than all requests need at once: some wait for others' slots).
#[rstest]
#[case::two_to_one(Backend::InMemory, split(TokenLayout::Nhd, 16, 2), split(TokenLayout::Nhd, 16, 1))]
#[case::four_to_one_larger_blocks_hnd(
    Backend::InMemory,
    split(TokenLayout::Hnd, 16, 4),
    split(TokenLayout::Hnd, 32, 1)
)]
#[case::one_to_two_smaller_blocks(Backend::InMemory, split(TokenLayout::Nhd, 32, 1), split(TokenLayout::Nhd, 16, 2))]
#[case::two_to_one_nhd_to_hnd(Backend::InMemory, split(TokenLayout::Nhd, 16, 2), split(TokenLayout::Hnd, 16, 1))]
#[case::two_to_one_over_tcp(Backend::Tcp, split(TokenLayout::Nhd, 16, 2), split(TokenLayout::Nhd, 32, 1))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_pulls_in_parts_and_pieces_move_every_byte_and_free_every_slot(
    #[case] backend: Backend,
    #[case] p: Layout,
    #[case] d: Layout,
) {
    let Some(net) = Net::new(backend) else { return };
    let (base, mut prefill) = start_instance(&net, KvRole::Producer, "p", p).await;
    let (_, mut decode) = start_instance(&net, KvRole::Consumer, "d", d).await;
    let reqs = [request("a", 0, 100, &p, &d, 0), request("b", 16, 70, &p, &d, 1), request("c", 32, 60, &p, &d, 0)];
    for rank in &prefill {
        for req in &reqs {
            fill_rows(rank, req);
        }
    }
    for rank in &mut prefill {
        rank.start(&sends(&reqs));
    }
    for rank in &mut decode {
        rank.start(&pulls(base, &reqs));
    }
    let all: BTreeSet<ReqId> = reqs.iter().map(|r| ReqId::new(r.id)).collect();
    drive(&mut prefill, &mut decode, "every request heard", |p, d| {
        d.iter().all(|r| r.heard.receiving.len() + r.heard.failed_receiving.len() == all.len())
            && p.iter().all(|r| r.heard.sending.len() == all.len())
    })
    .await;
    for rank in &decode {
        assert!(rank.heard.failed_receiving.is_empty(), "{:?}: {:?}", rank.topology, rank.heard.failed_receiving);
        assert_eq!(rank.heard.receiving, all);
        for req in &reqs {
            assert!(holds_rows(rank, req), "decode {:?}: request {} holds wrong bytes", rank.topology, req.id);
        }
        let pieces = rank.to_device.get(&ReqId::new("a")).copied().unwrap_or(0);
        assert!(pieces > 1, "decode {:?}: a copied to the device in {pieces} piece(s)", rank.topology);
    }
    let p_ids: BTreeSet<ReqId> = reqs.iter().map(|r| p_id(r.id)).collect();
    for rank in &prefill {
        assert_eq!(rank.heard.sending, p_ids, "prefill {:?}", rank.topology);
    }
    drive(&mut prefill, &mut decode, "every slot free", |p, d| p.iter().chain(d).all(Rank::all_slots_free)).await;
    for rank in &decode {
        let m = rank.staged.worker().metrics();
        assert_eq!((m.pulls_started, m.pulls_received, m.pulls_failed_total()), (3, 3, 0), "counted once each");
    }
    for rank in &prefill {
        let m = rank.staged.worker().metrics();
        assert_eq!((m.held_requests, m.sends_failed_total()), (0, 0), "prefill {:?}", rank.topology);
        assert_eq!(m.staging.exhausted, 0);
    }
    shutdown(prefill).await;
    shutdown(decode).await;
}

/// How the second of two prefill workers fails its part of request a
/// after its first piece was written.
#[derive(Clone, Copy, Debug)]
enum PartFailure {
    /// Its copy of a's later pieces into staging fails.
    CopyFails,
    /// It goes away.
    WorkerGone,
}

/// P at two workers, D at one pulling each request in two parts, pieces
/// of two blocks. Prefill worker 1 stages only a's first piece, D copies
/// that piece on once both parts wrote it, then worker 1's part fails:
/// a fails on D, once, with its device blocks, after every part's end;
/// b (the same pulls) lands whole; every slot comes back.
#[rstest]
#[case::a_copy_fails(PartFailure::CopyFails)]
#[case::a_prefill_worker_goes_away(PartFailure::WorkerGone)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_part_failing_mid_pieces_fails_its_request_once_and_leaks_nothing(#[case] failure: PartFailure) {
    let net = Net::new(Backend::InMemory).unwrap();
    // P's workers stage both requests before D pulls: a's six blocks and
    // b's three, with room for a's six left (see `StagingPool::reserve_ahead`).
    let p = Layout { slots: 16, ..split(TokenLayout::Nhd, 16, 2) };
    let d = split(TokenLayout::Nhd, 16, 1);
    let (base, mut prefill) = start_instance(&net, KvRole::Producer, "p", p).await;
    let (_, mut decode) = start_instance(&net, KvRole::Consumer, "d", d).await;
    let reqs = [request("a", 1, 96, &p, &d, 0), request("b", 20, 40, &p, &d, 0)];
    for rank in &prefill {
        for req in &reqs {
            fill_rows(rank, req);
        }
    }
    let (a, b) = (p_id("a"), p_id("b"));
    for rank in &mut prefill {
        rank.start(&sends(&reqs));
    }
    // Worker 1 copies b whole and a's first piece only.
    let first_of_a = prefill[1].copies.iter().find(|c| c.req == a).map(|c| c.id).unwrap();
    prefill[1].run_copies_where(|c| c.req == b || c.id == first_of_a);
    decode[0].start(&pulls(base, &reqs));
    let d_a = ReqId::new("a");
    poll_until(
        &mut prefill,
        &mut decode,
        "D copying a's first piece on",
        |i, c| i == 0 || c.req == b,
        |_, d| d[0].copies.iter().any(|c| c.req == d_a),
    )
    .await;
    let ordered: Vec<(BlockId, BlockId)> =
        decode[0].copies.iter().filter(|c| c.req == d_a).flat_map(|c| c.pairs.clone()).collect();
    let first_piece: Vec<BlockId> = reqs[0].decode_blocks[..2].to_vec();
    assert_eq!(
        ordered.iter().map(|(device, _)| *device).collect::<Vec<_>>(),
        first_piece,
        "only what both parts wrote is copied on"
    );
    let survivors = match failure {
        PartFailure::CopyFails => {
            prefill[1].fail_copies_where(|c| c.req == a);
            prefill.len()
        }
        PartFailure::WorkerGone => {
            let gone = prefill.pop().unwrap();
            gone.staged.shutdown().await;
            1
        }
    };
    drive(&mut prefill, &mut decode, "both requests heard", |_, d| {
        d[0].heard.receiving.len() + d[0].heard.failed_receiving.len() == 2
    })
    .await;
    let heard = &decode[0].heard;
    assert_eq!(heard.failed_receiving, BTreeMap::from([(d_a.clone(), reqs[0].decode_blocks.clone())]));
    if heard.receiving.contains(&ReqId::new("b")) {
        assert!(holds_rows(&decode[0], &reqs[1]), "b lands whole");
    } else {
        assert!(matches!(failure, PartFailure::WorkerGone), "only a worker gone before b ended may fail b");
    }
    drive(&mut prefill, &mut decode, "every slot free", |p, d| {
        p.iter().chain(d).all(Rank::all_slots_free) && p.iter().all(|r| r.heard.sending.len() == 2)
    })
    .await;
    let m = decode[0].staged.worker().metrics();
    assert_eq!(m.pulls_started, 2);
    assert_eq!(m.pulls_received + m.pulls_failed_total(), 2, "each counted once");
    let causes: &[FailureCause] = match failure {
        PartFailure::CopyFails => &[FailureCause::CopyFailed],
        // Told by the worker as it shuts down, or its connection lost.
        PartFailure::WorkerGone => &[FailureCause::Shutdown, FailureCause::ConnectionLost],
    };
    let failed: u64 = causes.iter().map(|c| m.pulls_failed.get(c).copied().unwrap_or(0)).sum();
    assert_eq!(failed, m.pulls_failed_total(), "{:?}", m.pulls_failed);
    assert!(failed >= 1);
    if matches!(failure, PartFailure::CopyFails) {
        assert_eq!(prefill[1].staged.worker().metrics().sends_failed[&FailureCause::CopyFailed], 1);
    }
    assert_eq!(prefill.len(), survivors);
    for rank in &prefill {
        assert_eq!(rank.staged.worker().metrics().held_requests, 0);
    }
    shutdown(prefill).await;
    shutdown(decode).await;
}
