//! A prefill and a decode worker moving real KV over RDMA (one-sided writes
//! through per-grant memory windows), every byte verified: contiguous,
//! scattered and reversed block lists, several pulls at once, and blocks
//! reused for later pulls after their grants were revoked.
//!
//! Runs where an RDMA device is named by `KVLINK_RDMA_DEVICE` and the `rdma`
//! feature is on (`cargo xtask rdma-test` runs it in a Soft-RoCE guest);
//! elsewhere it passes vacuously.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_proto::{BlockId, ConnectorMetadata, KvRole, LayoutKind, Protocol, RecvReqMeta, ReqId, SendUpdate};
use kv_worker::{pattern, CacheDims, CacheShape, Finished, OwnedKvCache, Worker, WorkerConfig};

/// Upper bound on any wait here (never reached when things work).
const BOUND: Duration = Duration::from_secs(60);

/// 8 layers, K/V split: 16 regions of 64 blocks of 4 KiB.
fn shape() -> CacheShape {
    CacheShape::try_new(CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers: 8,
        num_blocks: 64,
        block_size: 16,
        num_kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
    })
    .unwrap()
}

fn enabled() -> bool {
    cfg!(feature = "rdma") && std::env::var_os("KVLINK_RDMA_DEVICE").is_some()
}

struct Instance {
    worker: Worker,
    cache: Arc<OwnedKvCache>,
}

async fn start(role: KvRole, name: &str) -> Instance {
    let cache = Arc::new(OwnedKvCache::allocate(shape()).unwrap());
    let config = WorkerConfig { protocol: Protocol::Rdma, ..WorkerConfig::loopback(role, name) };
    let worker = Worker::start(config, Arc::clone(&cache)).await.unwrap();
    assert_eq!(worker.data_endpoint().protocol, Protocol::Rdma);
    Instance { worker, cache }
}

/// Writes request `seed`'s KV into `blocks` of every region.
fn fill(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) {
    let mut buf = vec![0u8; cache.block_len()];
    for region in 0..cache.shape().region_count() {
        for (position, &block) in blocks.iter().enumerate() {
            pattern::fill(&mut buf, pattern::block_seed(seed, region, position as u32));
            // SAFETY: no transfer reads or writes these blocks while the test fills them.
            unsafe { cache.write_block(region as usize, block, &buf) }.unwrap();
        }
    }
}

/// Whether `blocks` hold request `seed`'s KV in every region.
fn holds(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) -> bool {
    let mut buf = vec![0u8; cache.block_len()];
    (0..cache.shape().region_count()).all(|region| {
        blocks.iter().enumerate().all(|(position, &block)| {
            // SAFETY: the test reads only blocks whose pull was reported received.
            unsafe { cache.read_block(region as usize, block, &mut buf) }.unwrap();
            pattern::matches(&buf, pattern::block_seed(seed, region, position as u32))
        })
    })
}

fn ready(p: &Instance, req: &str, blocks: &[BlockId]) {
    let mut meta = ConnectorMetadata::default();
    meta.reqs_to_send.insert(ReqId::new(req), SendUpdate::Ready { block_ids: blocks.to_vec() });
    p.worker.start_load_kv(&meta);
}

/// D pulls `pulls` (request, D's blocks) from P's side channel, in one step.
fn pull(d: &Instance, p: &Instance, pulls: &[(String, Vec<BlockId>)]) {
    let addr = p.worker.side_channel_addr().unwrap();
    let reqs_to_recv = pulls
        .iter()
        .map(|(req, blocks)| {
            let meta = RecvReqMeta {
                local_block_ids: blocks.clone(),
                remote_host: addr.ip().to_string(),
                remote_port: addr.port(),
            };
            (ReqId::new(req.as_str()), meta)
        })
        .collect::<BTreeMap<_, _>>();
    d.worker.start_load_kv(&ConnectorMetadata { reqs_to_recv, ..ConnectorMetadata::default() });
}

/// Collects what `worker` reports until `n` requests finished receiving (or failed).
async fn received(worker: &Worker, n: usize) -> Finished {
    let deadline = Instant::now() + BOUND;
    let mut all = Finished::default();
    while all.receiving.len() + all.failed_receiving.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "only {all:?} within {BOUND:?}");
        let f = worker.next_finished(left).await;
        all.sending.extend(f.sending);
        all.receiving.extend(f.receiving);
        all.failed_receiving.extend(f.failed_receiving);
    }
    all
}

/// Block lists of each round, (P's blocks, D's blocks) per request:
/// contiguous, scattered, reversed, single. Within a round no two requests
/// share a block on either side.
fn rounds() -> Vec<Vec<(Vec<BlockId>, Vec<BlockId>)>> {
    vec![
        vec![
            ((0..8).collect(), (8..16).collect()),
            ((16..24).map(|b| b * 2).collect(), (0..8).map(|b| 63 - b).collect()),
            ((48..56).rev().collect(), (40..48).collect()),
            (vec![60], vec![2]),
        ],
        // The same destination blocks again: their windows were invalidated
        // when the first round's grants were revoked, and the windows
        // themselves are reused.
        vec![
            ((0..8).collect(), (8..16).collect()),
            ((16..24).collect(), (40..48).collect()),
            ((24..27).collect(), vec![2, 3, 4]),
        ],
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_over_rdma_move_every_byte() {
    if !enabled() {
        return;
    }
    let p = start(KvRole::Producer, "p-rdma").await;
    let d = start(KvRole::Consumer, "d-rdma").await;
    let mut seed = 100u64;
    for (round, transfers) in rounds().into_iter().enumerate() {
        let mut expected = Vec::new();
        let mut pulls = Vec::new();
        for (i, (p_blocks, d_blocks)) in transfers.into_iter().enumerate() {
            seed += 1;
            let req = format!("r{round}-{i}");
            fill(&p.cache, seed, &p_blocks);
            ready(&p, &req, &p_blocks);
            pulls.push((req.clone(), d_blocks.clone()));
            expected.push((req, seed, d_blocks));
        }
        // Half the requests in one transfer request, half in another.
        let half = pulls.len() / 2;
        pull(&d, &p, &pulls[..half]);
        pull(&d, &p, &pulls[half..]);
        let finished = received(&d.worker, expected.len()).await;
        assert!(finished.failed_receiving.is_empty(), "round {round}: {finished:?}");
        for (req, seed, blocks) in &expected {
            assert!(finished.receiving.contains(&ReqId::new(req.as_str())), "round {round}: {req} not received");
            assert!(holds(&d.cache, *seed, blocks), "round {round}: {req} landed wrong");
        }
    }
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}

/// A kv_both pair: each side pulls from the other at once, over one
/// transport per side serving and sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_ways_at_once() {
    if !enabled() {
        return;
    }
    let a = start(KvRole::Both, "a-rdma").await;
    let b = start(KvRole::Both, "b-rdma").await;
    fill(&a.cache, 7, &[0, 1, 2, 3]);
    fill(&b.cache, 9, &[10, 11, 12]);
    ready(&a, "from-a", &[0, 1, 2, 3]);
    ready(&b, "from-b", &[10, 11, 12]);
    pull(&b, &a, &[("from-a".to_owned(), vec![20, 21, 22, 23])]);
    pull(&a, &b, &[("from-b".to_owned(), vec![30, 31, 32])]);
    let (at_b, at_a) = tokio::join!(received(&b.worker, 1), received(&a.worker, 1));
    assert!(at_b.failed_receiving.is_empty() && at_a.failed_receiving.is_empty(), "{at_b:?} {at_a:?}");
    assert!(holds(&b.cache, 7, &[20, 21, 22, 23]));
    assert!(holds(&a.cache, 9, &[30, 31, 32]));
    a.worker.shutdown().await;
    b.worker.shutdown().await;
}
