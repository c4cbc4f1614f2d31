//! A prefill and a decode worker moving real KV over RDMA (one-sided writes
//! through per-grant memory windows), every byte verified: contiguous,
//! scattered and reversed block lists, several pulls at once, and blocks
//! reused for later pulls after their grants were revoked.
//!
//! Runs where an RDMA device is named by `KVLINK_RDMA_DEVICE` and the `rdma`
//! feature is on (`cargo xtask rdma-test` runs it in a Soft-RoCE guest);
//! elsewhere it passes vacuously.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kv_proto::{BlockId, KvRole, LayoutKind, Protocol, ReqId};
use kv_worker::{CacheDims, CacheShape, Finished, Worker, WorkerConfig};

/// 8 layers, K/V split: 16 regions of 64 blocks of 4 KiB.
fn rdma_shape() -> CacheShape {
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

async fn start_rdma(role: KvRole, name: &str) -> Instance {
    let config = WorkerConfig { protocol: Protocol::Rdma, ..WorkerConfig::loopback(role, name) };
    let instance = start_owned(config, rdma_shape()).await;
    assert_eq!(instance.worker.data_endpoint().protocol, Protocol::Rdma);
    instance
}

/// D pulls `pulls` (request, D's blocks) from P's side channel, in one step.
fn pull_from(d: &Instance, p: &Instance, pulls: &[(String, Vec<BlockId>)]) {
    let (host, port) = side_channel(p);
    let pulls: Vec<(&str, &[BlockId])> = pulls.iter().map(|(req, blocks)| (req.as_str(), blocks.as_slice())).collect();
    pull(d, &host, port, &pulls);
}

/// Collects what `worker` reports until `n` requests finished receiving (or failed).
async fn received(worker: &Worker, n: usize) -> Finished {
    until(worker, |f| f.receiving.len() + f.failed_receiving.len() >= n).await
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
    let p = start_rdma(KvRole::Producer, "p-rdma").await;
    let d = start_rdma(KvRole::Consumer, "d-rdma").await;
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
        pull_from(&d, &p, &pulls[..half]);
        pull_from(&d, &p, &pulls[half..]);
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
    let a = start_rdma(KvRole::Both, "a-rdma").await;
    let b = start_rdma(KvRole::Both, "b-rdma").await;
    fill(&a.cache, 7, &[0, 1, 2, 3]);
    fill(&b.cache, 9, &[10, 11, 12]);
    ready(&a, "from-a", &[0, 1, 2, 3]);
    ready(&b, "from-b", &[10, 11, 12]);
    pull_from(&b, &a, &[("from-a".to_owned(), vec![20, 21, 22, 23])]);
    pull_from(&a, &b, &[("from-b".to_owned(), vec![30, 31, 32])]);
    let (at_b, at_a) = tokio::join!(received(&b.worker, 1), received(&a.worker, 1));
    assert!(at_b.failed_receiving.is_empty() && at_a.failed_receiving.is_empty(), "{at_b:?} {at_a:?}");
    assert!(holds(&b.cache, 7, &[20, 21, 22, 23]));
    assert!(holds(&a.cache, 9, &[30, 31, 32]));
    a.worker.shutdown().await;
    b.worker.shutdown().await;
}
