//! Prefill and decode instances laid out differently, end to end in one
//! process: every tensor-parallel size pair of {1, 2, 4} for split K/V in
//! NHD and HND, for MLA and for vLLM 0.32's rows of K and V side by side,
//! other block sizes on each side, pipeline parallelism, and a mix of
//! layouts. Every worker of each instance has its own cache and side
//! channel; each decode worker checks every byte of every head row it
//! holds, and every prefill worker frees each request exactly once, after
//! the last decode worker that asks it has.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::time::Instant;

use common::*;
use kv_proto::{
    BlockId, ConnectorMetadata, KvRole, LayoutKind, RankTopology, RecvReqMeta, RemotePrefill, ReqId, SendUpdate,
    TokenLayout,
};
use kv_worker::pattern::RegionRows;
use kv_worker::{CacheDims, CacheShape, OwnedKvCache, Worker, WorkerError};
use rstest::rstest;

/// KV heads of the model (K/V layouts): split over 4 ranks, each is
/// replicated on two.
const HEADS: u32 = 2;
/// Layers of the model (split over the pipeline stages).
const LAYERS: u32 = 4;

/// How one instance is laid out.
#[derive(Clone, Copy, Debug)]
struct Layout {
    kind: LayoutKind,
    order: TokenLayout,
    block_size: u32,
    tp: u32,
    pp: u32,
}

fn split(order: TokenLayout, tp: u32) -> Layout {
    Layout { kind: LayoutKind::SplitKv, order, block_size: 16, tp, pp: 1 }
}

/// vLLM 0.32's rows of K and V side by side, head-major.
fn fused_rows(tp: u32) -> Layout {
    Layout { kind: LayoutKind::FusedRows, ..split(TokenLayout::Hnd, tp) }
}

fn mla(tp: u32) -> Layout {
    Layout { kind: LayoutKind::Mla, order: TokenLayout::Nhd, block_size: 16, tp, pp: 1 }
}

impl Layout {
    fn heads(&self) -> u32 {
        if self.kind == LayoutKind::Mla {
            1
        } else {
            HEADS
        }
    }

    fn topology(&self, tp_rank: u32, pp_rank: u32) -> RankTopology {
        RankTopology::new(self.tp, tp_rank, self.pp, pp_rank, self.heads()).unwrap()
    }

    fn shape(&self, tp_rank: u32) -> CacheShape {
        let heads = self.topology(tp_rank, 0).heads.count;
        let dims = CacheDims {
            kind: self.kind,
            num_layers: LAYERS / self.pp,
            num_blocks: 48,
            block_size: self.block_size,
            num_kv_heads: heads,
            head_dim: if self.kind == LayoutKind::Mla { 24 } else { 8 },
            dtype_bytes: 2,
        };
        CacheShape::try_new(dims).unwrap().with_token_layout(self.order)
    }
}

/// One worker of an instance and where it sits.
struct Rank {
    instance: Instance,
    topology: RankTopology,
    shape: CacheShape,
}

impl Rank {
    fn rows(&self) -> Vec<RegionRows> {
        let first_layer = self.topology.pp_rank * (LAYERS / self.topology.pp_size);
        RegionRows::of_shape(&self.shape, self.topology.heads.first, first_layer)
    }
}

/// Starts every worker of an instance on consecutive side-channel ports
/// from a base the OS left free (tried again from another base if one of
/// them is taken).
async fn start_instance(net: &Net, role: KvRole, name: &str, layout: Layout) -> (u16, Vec<Rank>) {
    let first = 20_000 + (std::process::id() as u16 % 2_000) * 16;
    on_free_ports(first, 431, |base| async move {
        let mut ranks = Vec::new();
        for pp_rank in 0..layout.pp {
            for tp_rank in 0..layout.tp {
                let worker_name = format!("{name}-{pp_rank}-{tp_rank}");
                let mut config = net.config(role, &worker_name);
                config.engine_id = kv_proto::EngineId::new(name);
                config.side_channel_base_port = base;
                config.tp_size = layout.tp as u16;
                config.tp_rank = tp_rank as u16;
                config.pp_size = layout.pp as u16;
                config.pp_rank = pp_rank as u16;
                config.identity.num_kv_heads = layout.heads();
                let shape = layout.shape(tp_rank);
                let cache = std::sync::Arc::new(OwnedKvCache::allocate(shape).unwrap());
                let writer = net.writer(role, &worker_name).await;
                // SAFETY: the cache outlives the worker (dropped with it,
                // after it), and blocks are read only once reported.
                let started = unsafe { Worker::start_with_writer(config, cache.registered().clone(), writer) }.await;
                match started {
                    Ok(worker) => ranks.push(Rank {
                        instance: Instance { worker, cache },
                        topology: layout.topology(tp_rank, pp_rank),
                        shape,
                    }),
                    Err(WorkerError::Bind { .. }) => return None,
                    Err(e) => panic!("{e}"),
                }
            }
        }
        Some(ranks)
    })
    .await
}

/// One request: its prompt length, P's blocks, D's blocks and the token
/// D's blocks start at (its prefix-cache hit).
struct Request {
    id: &'static str,
    prompt: u64,
    prefill_blocks: Vec<BlockId>,
    decode_blocks: Vec<BlockId>,
    first_token: u64,
}

fn request(id: &'static str, seed_block: u32, prompt: u64, p: &Layout, d: &Layout, first_token: u64) -> Request {
    let p_blocks = prompt.div_ceil(u64::from(p.block_size)) as u32;
    let d_total = prompt.div_ceil(u64::from(d.block_size)) as u32;
    let d_skipped = (first_token / u64::from(d.block_size)) as u32;
    // Scattered on P (runs broken), consecutive on D.
    let prefill_blocks = (0..p_blocks).map(|i| seed_block + i + i / 2).collect();
    let decode_blocks = (d_skipped..d_total).map(|i| seed_block + i).collect();
    Request { id, prompt, prefill_blocks, decode_blocks, first_token }
}

fn seed(req: &Request) -> u64 {
    req.id.bytes().map(u64::from).sum::<u64>() * 7919
}

fn fill_rows(rank: &Rank, req: &Request) {
    let tokens = u64::from(rank.shape.block_size());
    let mut buf = vec![0u8; rank.instance.cache.block_len()];
    for (region, rows) in rank.rows().iter().enumerate() {
        for (i, &block) in req.prefill_blocks.iter().enumerate() {
            rows.fill(&mut buf, seed(req), i as u64 * tokens);
            // SAFETY: no transfer uses the block while the test fills it.
            unsafe { rank.instance.cache.write_block(region, block, &buf) }.unwrap();
        }
    }
}

fn holds_rows(rank: &Rank, req: &Request) -> bool {
    let tokens = u64::from(rank.shape.block_size());
    let origin = req.first_token - req.first_token % tokens;
    rank.rows().iter().enumerate().all(|(region, rows)| {
        req.decode_blocks.iter().enumerate().all(|(i, &block)| {
            let buf = read(&rank.instance.cache, region as u32, block);
            rows.check(&buf, seed(req), origin + i as u64 * tokens, req.first_token, req.prompt)
        })
    })
}

/// P (laid out `p`) prefills `reqs`, D (laid out `d`) pulls them; every
/// decode worker must hold every byte of its heads, and every prefill
/// worker must free each request once.
async fn transfer(backend: Backend, p: Layout, d: Layout, reqs: &[Request]) {
    let Some(net) = Net::new(backend) else { return };
    let (base, prefill) = start_instance(&net, KvRole::Producer, "p", p).await;
    let (_, decode) = start_instance(&net, KvRole::Consumer, "d", d).await;
    ready_on_every_rank(&prefill, reqs);
    pull_and_verify(base, prefill, decode, reqs).await;
}

/// Every prefill worker holds each request's rows, ready to send.
fn ready_on_every_rank(prefill: &[Rank], reqs: &[Request]) {
    let mut sends = ConnectorMetadata::default();
    for req in reqs {
        for rank in prefill {
            fill_rows(rank, req);
        }
        sends.reqs_to_send.insert(p_id(req.id), SendUpdate::Ready { block_ids: req.prefill_blocks.clone() });
        sends.renewal_keys.insert(p_id(req.id), renewal_key(req.id));
    }
    for rank in prefill {
        rank.instance.worker.start_load_kv(&sends);
    }
}

/// Every decode worker pulls every request from the instance at `base`
/// and checks each byte of its rows; every prefill worker frees each
/// request once. Then every worker is shut down.
async fn pull_and_verify(base: u16, prefill: Vec<Rank>, decode: Vec<Rank>, reqs: &[Request]) {
    let pulls = ConnectorMetadata {
        reqs_to_recv: reqs
            .iter()
            .map(|req| {
                let meta = RecvReqMeta {
                    local_block_ids: req.decode_blocks.clone(),
                    first_token: Some(req.first_token),
                    remote: RemotePrefill { remote_engine_id: None, ..remote("127.0.0.1", base, req.id) },
                };
                (ReqId::new(req.id), meta)
            })
            .collect::<BTreeMap<_, _>>(),
        ..ConnectorMetadata::default()
    };
    for rank in &decode {
        rank.instance.worker.start_load_kv(&pulls);
    }
    for rank in &decode {
        let got = until(&rank.instance.worker, |f| f.receiving.len() + f.failed_receiving.len() == reqs.len()).await;
        assert!(got.failed_receiving.is_empty(), "{:?} failed: {got:?}", rank.topology);
        for req in reqs {
            assert!(holds_rows(rank, req), "decode {:?}: request {} holds wrong bytes", rank.topology, req.id);
        }
    }
    for rank in &prefill {
        let got = until(&rank.instance.worker, |f| f.sending.len() == reqs.len()).await;
        let freed: Vec<ReqId> = got.sending.into_iter().collect();
        let mut expected: Vec<ReqId> = reqs.iter().map(|r| p_id(r.id)).collect();
        expected.sort();
        assert_eq!(freed, expected, "prefill {:?} frees each request once", rank.topology);
        assert_eq!(rank.instance.worker.metrics().held_requests, 0);
    }
    for rank in prefill.into_iter().chain(decode) {
        rank.instance.worker.shutdown().await;
    }
}

fn two_requests(p: &Layout, d: &Layout) -> Vec<Request> {
    // A full pull, and one whose first decode block D's prefix cache held.
    vec![request("a", 1, 40, p, d, 0), request("b", 24, 70, p, d, u64::from(d.block_size))]
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tensor_parallel_pair_moves_every_head(
    #[values(TokenLayout::Nhd, TokenLayout::Hnd)] order: TokenLayout,
    #[values(1, 2, 4)] tp_p: u32,
    #[values(1, 2, 4)] tp_d: u32,
) {
    let (p, d) = (split(order, tp_p), split(order, tp_d));
    transfer(Backend::InMemory, p, d, &two_requests(&p, &d)).await;
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_pulls_each_request_from_one_prefill_worker(#[values(1, 2, 4)] tp_p: u32, #[values(1, 2, 4)] tp_d: u32) {
    let (p, d) = (mla(tp_p), mla(tp_d));
    transfer(Backend::InMemory, p, d, &two_requests(&p, &d)).await;
}

/// Tokens per block differ: mapped by token range.
#[rstest]
#[case::to_larger(16, 32)]
#[case::to_smaller(32, 16)]
#[case::to_much_larger(16, 128)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_block_sizes_map_by_token(
    #[values(TokenLayout::Nhd, TokenLayout::Hnd)] order: TokenLayout,
    #[case] p_block: u32,
    #[case] d_block: u32,
) {
    let p = Layout { block_size: p_block, ..split(order, 1) };
    let d = Layout { block_size: d_block, ..split(order, 2) };
    let reqs = [request("a", 1, 200, &p, &d, 0), request("b", 24, 150, &p, &d, u64::from(d_block))];
    transfer(Backend::InMemory, p, d, &reqs).await;
}

/// Rows of K and V side by side (vLLM 0.32), every tensor-parallel size
/// pair: each row moves whole, K and V together.
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_k_and_v_move_every_head(#[values(1, 2, 4)] tp_p: u32, #[values(1, 2, 4)] tp_d: u32) {
    let (p, d) = (fused_rows(tp_p), fused_rows(tp_d));
    transfer(Backend::InMemory, p, d, &two_requests(&p, &d)).await;
}

/// NHD against HND and fused against split K/V: a permutation of head rows.
#[rstest]
#[case::nhd_to_hnd(split(TokenLayout::Nhd, 2), split(TokenLayout::Hnd, 1))]
#[case::hnd_to_nhd(split(TokenLayout::Hnd, 1), split(TokenLayout::Nhd, 4))]
#[case::fused_to_split(Layout { kind: LayoutKind::Fused, ..split(TokenLayout::Nhd, 2) }, split(TokenLayout::Hnd, 2))]
#[case::fused_rows_to_larger_blocks(fused_rows(2), Layout { block_size: 32, ..fused_rows(1) })]
#[case::fused_rows_nhd_to_hnd(Layout { order: TokenLayout::Nhd, ..fused_rows(1) }, fused_rows(2))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_token_layouts_map_head_rows(#[case] p: Layout, #[case] d: Layout) {
    transfer(Backend::InMemory, p, d, &two_requests(&p, &d)).await;
}

/// Two pipeline stages on both sides: each stage pulls its own layers.
#[rstest]
#[case::same_tp(2, 2)]
#[case::other_tp(2, 1)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_stages_each_pull_their_layers(#[case] tp_p: u32, #[case] tp_d: u32) {
    let p = Layout { pp: 2, ..split(TokenLayout::Nhd, tp_p) };
    let d = Layout { pp: 2, ..split(TokenLayout::Nhd, tp_d) };
    transfer(Backend::InMemory, p, d, &two_requests(&p, &d)).await;
}

/// The same over real sockets (TCP data plane).
#[rstest]
#[case::two_to_one(split(TokenLayout::Nhd, 2), split(TokenLayout::Nhd, 1))]
#[case::one_to_four_hnd(split(TokenLayout::Hnd, 1), split(TokenLayout::Hnd, 4))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tcp(#[case] p: Layout, #[case] d: Layout) {
    transfer(Backend::Tcp, p, d, &two_requests(&p, &d)).await;
}

/// D's renewals go to the prefill workers its pulls use, which only P's
/// hello says: with P at TP 1 and D at TP 2, both decode workers renew on
/// P's only worker (not on one at D's own rank, which P does not have),
/// before they pull.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_decode_worker_renews_on_the_prefill_workers_it_pulls_from() {
    let net = Net::new(Backend::InMemory).unwrap();
    let (p, d) = (split(TokenLayout::Nhd, 1), split(TokenLayout::Nhd, 2));
    let (base, prefill) = start_instance(&net, KvRole::Producer, "p", p).await;
    let (_, decode) = start_instance(&net, KvRole::Consumer, "d", d).await;
    let reqs = [request("a", 1, 40, &p, &d, 0)];
    ready_on_every_rank(&prefill, &reqs);
    let mut watch = ConnectorMetadata::default();
    watch
        .reqs_to_watch
        .insert(ReqId::new("a"), RemotePrefill { remote_engine_id: None, ..remote("127.0.0.1", base, "a") });
    for rank in &decode {
        rank.instance.worker.start_load_kv(&watch);
    }
    for rank in &decode {
        metrics_until(&rank.instance.worker, |m| m.renewals_sent >= 1).await;
    }
    let p_metrics = metrics_until(&prefill[0].instance.worker, |m| m.renewals_received >= 2).await;
    assert_eq!(prefill[0].instance.worker.renewed_requests(), 1, "{p_metrics:#?}");
    pull_and_verify(base, prefill, decode, &reqs).await;
}

/// What cannot be mapped fails every pull at once as an incompatible
/// peer (the hello names both values); none hangs: pipeline parallelism on
/// one side only, and rows of K and V side by side against K and V apart.
#[rstest]
#[case::pipeline_on_one_side(Layout { pp: 2, ..split(TokenLayout::Nhd, 1) }, split(TokenLayout::Nhd, 1))]
#[case::rows_against_planes(fused_rows(2), split(TokenLayout::Hnd, 1))]
#[case::planes_against_rows(split(TokenLayout::Hnd, 1), fused_rows(2))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmappable_instances_fail_pulls_at_once(#[case] p: Layout, #[case] d: Layout) {
    let net = Net::new(Backend::InMemory).unwrap();
    let (base, prefill) = start_instance(&net, KvRole::Producer, "p", p).await;
    let (_, decode) = start_instance(&net, KvRole::Consumer, "d", d).await;
    let started = Instant::now();
    pull(&decode[0].instance, "127.0.0.1", base, &[("a", &[1, 2])]);
    let got = until(&decode[0].instance.worker, |f| f.failed_receiving.len() == 1).await;
    assert!(started.elapsed() < BOUND / 2);
    assert_eq!(got.failed_receiving.keys().collect::<Vec<_>>(), [&ReqId::new("a")]);
    let metrics = decode[0].instance.worker.metrics();
    assert_eq!(metrics.pulls_failed[&kv_proto::FailureCause::IncompatiblePeer], 1);
    for rank in prefill.into_iter().chain(decode) {
        rank.instance.worker.shutdown().await;
    }
}
