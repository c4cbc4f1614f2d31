//! A prefill and a decode instance (scheduler + worker each) moving real KV
//! over loopback TCP through the whole flow, every byte verified.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kv_proto::{KvRole, KvTransferParams, LayoutKind, ReqId};
use kv_worker::{CacheDims, CacheShape, WorkerConfig};
use kvlink::{BlockPattern, Completion, DecodeInstance, PrefillInstance, PromptSpec, PullSpec};
use rstest::rstest;

/// Llama-shaped (32 layers, K/V split, 16-token blocks) but narrow, so a
/// debug build moves hundreds of requests quickly: 2 KiB per block per region.
fn shape(num_blocks: u64) -> CacheShape {
    CacheShape::try_new(CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers: 32,
        num_blocks,
        block_size: 16,
        num_kv_heads: 1,
        head_dim: 64,
        dtype_bytes: 2,
    })
    .unwrap()
}

const BOUND: Duration = Duration::from_secs(20);

async fn prefill(pattern: BlockPattern) -> PrefillInstance {
    PrefillInstance::start(WorkerConfig::loopback(KvRole::Producer, "p"), shape(400), pattern, 11).await.unwrap()
}

async fn decode(pattern: BlockPattern) -> DecodeInstance {
    DecodeInstance::start(WorkerConfig::loopback(KvRole::Consumer, "d"), shape(400), pattern, 22).await.unwrap()
}

fn prompt(i: usize, tokens: usize) -> PromptSpec {
    PromptSpec { id: ReqId::new(format!("r{i}")), prompt_len: tokens, seed: 1000 + i as u64 }
}

fn pull(spec: &PromptSpec, params: KvTransferParams, prefix_hit_tokens: usize) -> PullSpec {
    PullSpec { id: spec.id.clone(), prompt_len: spec.prompt_len, seed: spec.seed, params, prefix_hit_tokens }
}

/// The params a proxy would hand D for a request on the P at `addr`.
fn params_pointing_at(addr: std::net::SocketAddr) -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: true,
        do_remote_decode: false,
        remote_host: Some(addr.ip().to_string()),
        remote_port: Some(addr.port()),
        ..KvTransferParams::default()
    }
}

/// The params a proxy would hand D for `spec`, scheduled (not finished) on
/// the P at `addr`: they name P's id of it, as P's would once it finished.
fn params_for_scheduled(addr: std::net::SocketAddr, spec: &PromptSpec) -> KvTransferParams {
    KvTransferParams {
        remote_request_id: Some(kvlink::PrefillInstance::internal_id(&spec.id)),
        ..params_pointing_at(addr)
    }
}

/// Waits until `n` completions arrived (bounded).
async fn completions(d: &mut DecodeInstance, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    while out.len() < n {
        let got = d.complete(BOUND).await;
        assert!(!got.is_empty(), "nothing finished within {BOUND:?}; have {}/{n}", out.len());
        out.extend(got);
    }
    out
}

fn assert_all_received(got: &[Completion]) {
    for c in got {
        assert!(matches!(c, Completion::Received { verified: true, .. }), "{c:?}");
    }
}

/// Reaps P until `n` requests are freed (bounded).
async fn reap(p: &mut PrefillInstance, n: usize) -> Vec<ReqId> {
    let mut freed = Vec::new();
    while freed.len() < n {
        let got = p.reap_wait(BOUND).await;
        assert!(!got.is_empty(), "prefill freed nothing within {BOUND:?}; have {}/{n}", freed.len());
        freed.extend(got);
    }
    freed
}

#[rstest]
#[case::contiguous(BlockPattern::Contiguous)]
#[case::scattered(BlockPattern::Scattered)]
#[case::random(BlockPattern::Random)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_requests_arrive_byte_exact(#[case] pattern: BlockPattern) {
    let (mut p, mut d) = (prefill(pattern).await, decode(pattern).await);
    let mut received = 0;
    for round in 0..25 {
        // 8 requests of 1..=20 blocks per step, varied lengths (partial last block).
        let prompts: Vec<PromptSpec> = (0..8).map(|i| prompt(round * 8 + i, 17 + 37 * ((round + i) % 9))).collect();
        let pulls: Vec<PullSpec> =
            p.prefill(&prompts).unwrap().into_iter().map(|(s, params)| pull(&s, params, 0)).collect();
        d.schedule(&pulls).unwrap();
        let got = completions(&mut d, pulls.len()).await;
        assert_all_received(&got);
        received += got.len();
        reap(&mut p, pulls.len()).await;
    }
    assert_eq!(received, 200);
    assert_eq!((p.held(), p.free_blocks()), (0, 400), "prefill freed every block");
    assert_eq!(d.free_blocks(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_prefix_hit_pulls_only_the_missing_tail() {
    let (mut p, mut d) = (prefill(BlockPattern::Random).await, decode(BlockPattern::Random).await);
    let spec = prompt(1, 16 * 10);
    let (spec, params) = p.prefill(&[spec]).unwrap().pop().unwrap();
    d.schedule(&[pull(&spec, params, 16 * 4)]).unwrap();
    let got = completions(&mut d, 1).await;
    assert!(matches!(got[0], Completion::Received { blocks: 6, verified: true, .. }), "{got:?}");
    assert_eq!(reap(&mut p, 1).await, vec![spec.id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_prefix_hit_pulls_nothing_but_frees_prefill() {
    let (mut p, mut d) = (prefill(BlockPattern::Contiguous).await, decode(BlockPattern::Contiguous).await);
    let (spec, params) = p.prefill(&[prompt(1, 16 * 4)]).unwrap().pop().unwrap();
    d.schedule(&[pull(&spec, params, 16 * 4)]).unwrap();
    let got = completions(&mut d, 1).await;
    assert!(matches!(got[0], Completion::Received { blocks: 0, .. }), "{got:?}");
    assert_eq!(reap(&mut p, 1).await, vec![spec.id]);
    assert_eq!(p.free_blocks(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_on_decode_before_scheduling_frees_prefill() {
    let (mut p, mut d) = (prefill(BlockPattern::Contiguous).await, decode(BlockPattern::Contiguous).await);
    let (spec, params) = p.prefill(&[prompt(1, 100)]).unwrap().pop().unwrap();
    assert_eq!(p.held(), 1);
    d.abort_unscheduled(&[pull(&spec, params, 0)]).unwrap();
    completions(&mut d, 1).await;
    assert_eq!(reap(&mut p, 1).await, vec![spec.id]);
    assert_eq!((p.held(), p.free_blocks()), (0, 400));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_unknown_to_prefill_fails_on_decode_never_done() {
    let (p, mut d) = (prefill(BlockPattern::Contiguous).await, decode(BlockPattern::Contiguous).await);
    let addr = p.side_channel().unwrap();
    let params = params_pointing_at(addr);
    let ghost = prompt(7, 64);
    d.schedule(&[pull(&ghost, params, 0)]).unwrap();
    let got = completions(&mut d, 1).await;
    assert!(matches!(&got[0], Completion::Failed { id, blocks } if *id == ghost.id && blocks.len() == 4), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_gone_mid_flight_fails_the_pull_within_its_bound() {
    let mut p = prefill(BlockPattern::Contiguous).await;
    let mut d = decode(BlockPattern::Contiguous).await;
    // Scheduled with remote decode but never finished: D's pull waits on P...
    let spec = prompt(1, 64);
    let addr = p.side_channel().unwrap();
    p.schedule_only(std::slice::from_ref(&spec)).unwrap();
    let params = params_for_scheduled(addr, &spec);
    d.schedule(&[pull(&spec, params, 0)]).unwrap();
    assert!(p.wait_for_pull_waiting(BOUND).await, "prefill admitted the pull");
    // ...and P goes away while it waits.
    p.shutdown().await;
    let got = completions(&mut d, 1).await;
    assert!(matches!(&got[0], Completion::Failed { id, .. } if *id == spec.id), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_prefill_fails_the_pull_at_the_transfer_timeout() {
    let mut p = prefill(BlockPattern::Contiguous).await;
    let mut config = WorkerConfig::loopback(KvRole::Consumer, "d");
    config.transfer_timeout = Duration::from_millis(300);
    let mut d = DecodeInstance::start(config, shape(400), BlockPattern::Contiguous, 1).await.unwrap();
    let spec = prompt(1, 64);
    let addr = p.side_channel().unwrap();
    p.schedule_only(std::slice::from_ref(&spec)).unwrap();
    let params = params_for_scheduled(addr, &spec);
    d.schedule(&[pull(&spec, params, 0)]).unwrap();
    let got = completions(&mut d, 1).await;
    assert!(matches!(&got[0], Completion::Failed { .. }), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expiry_frees_prefill_and_a_late_pull_fails() {
    let mut config = WorkerConfig::loopback(KvRole::Producer, "p");
    config.abort_request_timeout = Duration::from_millis(200);
    let mut p = PrefillInstance::start(config, shape(400), BlockPattern::Contiguous, 1).await.unwrap();
    let mut d = decode(BlockPattern::Contiguous).await;
    let (spec, params) = p.prefill(&[prompt(1, 64)]).unwrap().pop().unwrap();
    assert_eq!(reap(&mut p, 1).await, vec![spec.id.clone()], "the lease ends and the blocks are freed");
    assert_eq!(p.free_blocks(), 400);
    d.schedule(&[pull(&spec, params, 0)]).unwrap();
    let got = completions(&mut d, 1).await;
    assert!(matches!(&got[0], Completion::Failed { .. }), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_one_step() {
    let (mut p, mut d) = (prefill(BlockPattern::Random).await, decode(BlockPattern::Random).await);
    let prompts: Vec<PromptSpec> = (0..120).map(|i| prompt(i, 48)).collect();
    let pulls: Vec<PullSpec> =
        p.prefill(&prompts).unwrap().into_iter().map(|(s, params)| pull(&s, params, 0)).collect();
    d.schedule(&pulls).unwrap();
    let got = completions(&mut d, 120).await;
    assert_eq!(got.len(), 120);
    assert_all_received(&got);
    reap(&mut p, 120).await;
    assert_eq!(p.free_blocks(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefill_instances_feed_one_decode() {
    let mut p1 = prefill(BlockPattern::Contiguous).await;
    let mut p2 = prefill(BlockPattern::Scattered).await;
    let mut d = decode(BlockPattern::Random).await;
    let mut pulls = Vec::new();
    for (i, (spec, params)) in
        p1.prefill(&(0..10).map(|i| prompt(i, 80)).collect::<Vec<_>>()).unwrap().into_iter().enumerate()
    {
        pulls.push(pull(&spec, params, if i % 3 == 0 { 32 } else { 0 }));
    }
    for (spec, params) in p2.prefill(&(10..20).map(|i| prompt(i, 80)).collect::<Vec<_>>()).unwrap() {
        pulls.push(pull(&spec, params, 0));
    }
    d.schedule(&pulls).unwrap();
    let got = completions(&mut d, 20).await;
    assert_all_received(&got);
    reap(&mut p1, 10).await;
    reap(&mut p2, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layout_mismatch_fails_fast_naming_both_sides() {
    let mut p = prefill(BlockPattern::Contiguous).await;
    let other = CacheShape::try_new(CacheDims { head_dim: 128, ..shape(400).dims() }).unwrap();
    let mut d =
        DecodeInstance::start(WorkerConfig::loopback(KvRole::Consumer, "d"), other, BlockPattern::Contiguous, 1)
            .await
            .unwrap();
    let (spec, params) = p.prefill(&[prompt(1, 64)]).unwrap().pop().unwrap();
    d.schedule(&[pull(&spec, params, 0)]).unwrap();
    let got = completions(&mut d, 1).await;
    assert!(matches!(&got[0], Completion::Failed { .. }), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_the_side_channel_and_the_data_plane() {
    let p = prefill(BlockPattern::Contiguous).await;
    let side_channel = p.side_channel().unwrap();
    let data: std::net::SocketAddr = p.worker().data_endpoint().address.parse().unwrap();
    tokio::net::TcpStream::connect(side_channel).await.expect("side channel serves before shutdown");
    tokio::net::TcpStream::connect(data).await.expect("data plane serves before shutdown");
    p.shutdown().await;
    assert!(tokio::net::TcpStream::connect(side_channel).await.is_err(), "side channel closed");
    assert!(tokio::net::TcpStream::connect(data).await.is_err(), "data plane closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_worker_stops_its_tasks_and_closes_its_sockets() {
    let p = prefill(BlockPattern::Contiguous).await;
    let side_channel = p.side_channel().unwrap();
    let data: std::net::SocketAddr = p.worker().data_endpoint().address.parse().unwrap();
    drop(p);
    // Drop cancels at once; the listeners close as their tasks observe it.
    let deadline = tokio::time::Instant::now() + BOUND;
    for addr in [side_channel, data] {
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            assert!(tokio::time::Instant::now() < deadline, "{addr} still accepts after the worker was dropped");
            tokio::task::yield_now().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_aborted_on_prefill_is_forgotten_and_its_pull_fails() {
    // Defect 3 of the reference, end to end: the send entry of a request that
    // finished without delay-free is dropped, so a pull for it fails at once
    // instead of waiting on an entry nobody owns.
    let mut p = prefill(BlockPattern::Contiguous).await;
    let mut d = decode(BlockPattern::Contiguous).await;
    let spec = prompt(1, 64);
    p.schedule_then_abort(std::slice::from_ref(&spec)).unwrap();
    assert_eq!((p.held(), p.free_blocks()), (0, 400));
    d.schedule(&[pull(&spec, params_pointing_at(p.side_channel().unwrap()), 0)]).unwrap();
    let got = completions(&mut d, 1).await;
    assert!(matches!(&got[0], Completion::Failed { id, .. } if *id == spec.id), "{got:?}");
}
