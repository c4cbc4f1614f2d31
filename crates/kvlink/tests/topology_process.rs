//! Prefill and decode instances of other tensor-parallel sizes with one
//! real process per rank: every rank a `kvlink serve` of its own (its
//! worker on the instance's base side-channel port plus its rank), the test
//! the engines' scheduler and the proxy at once. Every rank of an instance
//! is handed the same steps, as vLLM's workers are; the proxy gives decode
//! the params of prefill's rank 0. Each decode rank checks every byte of
//! the heads it holds, and every prefill rank frees every request.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::collections::HashSet;
use std::net::{Ipv4Addr, TcpListener};
use std::time::{Duration, Instant};

use common::{Proc, BOUND};
use kv_proto::{LayoutKind, Protocol, ReqId};
use kv_worker::{CacheDims, CacheShape};
use kvlink::control::{check_shape, ControlClient, RemoteDecode, RemotePrefill};
use kvlink::{BlockPattern, Completion, PromptSpec, PullSpec};
use rstest::rstest;

/// Requests of one step.
const BATCH: usize = 3;

/// The model: 2 layers of 2 KV heads (split over 4 ranks, each is
/// replicated on two) or MLA, 16-token blocks.
fn model(kind: LayoutKind) -> CacheShape {
    let dims = CacheDims {
        kind,
        num_layers: 2,
        num_blocks: 64,
        block_size: 16,
        num_kv_heads: if kind == LayoutKind::Mla { 1 } else { 2 },
        head_dim: 32,
        dtype_bytes: 2,
    };
    check_shape(dims, u64::MAX).unwrap()
}

/// A base port with `n` free loopback ports from it.
fn free_run(n: u16) -> u16 {
    for _ in 0..64 {
        let probe = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let base = probe.local_addr().unwrap().port();
        if base.checked_add(n).is_none() {
            continue;
        }
        let rest: Vec<_> = (1..n).map(|i| TcpListener::bind((Ipv4Addr::LOCALHOST, base + i))).collect();
        if rest.iter().all(Result::is_ok) {
            return base;
        }
    }
    panic!("no run of {n} free ports");
}

/// One `kvlink serve` per rank of an instance of `tp` ranks from side-channel
/// port `base`, and a session of `shape` with each; `None` if a rank's port
/// was taken (at the server's start or its worker's), so the caller tries
/// another run of ports.
async fn try_instance(
    role: &str,
    tp: u16,
    base: u16,
    order: &str,
    shape: CacheShape,
) -> Option<Vec<(Proc, ControlClient)>> {
    let mut ranks = Vec::new();
    for rank in 0..tp {
        let (tp_size, tp_rank, base) = (tp.to_string(), rank.to_string(), base.to_string());
        let args = [
            "--role",
            role,
            "--listen",
            "127.0.0.1",
            "--control-port",
            "0",
            "--side-channel-port",
            &base,
            "--tp-size",
            &tp_size,
            "--tp-rank",
            &tp_rank,
            "--token-layout",
            order,
        ];
        let (proc, control) = match common::try_serve(&args) {
            Ok(started) => started,
            Err(stderr) if stderr.contains("already in use") => return None,
            Err(stderr) => panic!("kvlink serve did not start: {stderr}"),
        };
        let mut client = ControlClient::connect(&control.to_string(), BOUND, BOUND).await.unwrap();
        match client.hello(shape, BlockPattern::Scattered, Protocol::Tcp, true, None).await {
            Ok(_) => ranks.push((proc, client)),
            Err(e) if e.to_string().contains("already in use") => return None,
            Err(e) => panic!("hello with rank {rank}: {e}"),
        }
    }
    Some(ranks)
}

/// An instance of `tp` ranks (see [`try_instance`]) on a run of free
/// side-channel ports: another run if a port of one was taken between
/// [`free_run`] finding it free and a rank binding it (any connection on
/// the machine may take an ephemeral port meanwhile).
async fn instance(role: &str, tp: u16, order: &str, shape: CacheShape) -> Vec<(Proc, ControlClient)> {
    for _ in 0..8 {
        if let Some(ranks) = try_instance(role, tp, free_run(tp), order, shape).await {
            return ranks;
        }
    }
    panic!("no run of {tp} side-channel ports stayed free long enough");
}

#[rstest]
#[case::split_nhd(LayoutKind::SplitKv, "nhd")]
#[case::split_hnd(LayoutKind::SplitKv, "hnd")]
#[case::mla(LayoutKind::Mla, "nhd")]
fn every_rank_a_process_moves_every_head(
    #[case] kind: LayoutKind,
    #[case] order: &str,
    #[values(1, 2, 4)] tp_p: u16,
    #[values(1, 2, 4)] tp_d: u16,
) {
    let shape = model(kind);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let prefill = instance("producer", tp_p, order, shape).await;
        let decode = instance("consumer", tp_d, order, shape).await;
        let (prefill, p): (Vec<Proc>, Vec<ControlClient>) = prefill.into_iter().unzip();
        let mut p: Vec<RemotePrefill> = p.into_iter().map(RemotePrefill::new).collect();
        let (decode, d): (Vec<Proc>, Vec<ControlClient>) = decode.into_iter().unzip();
        let mut d: Vec<RemoteDecode> = d.into_iter().map(RemoteDecode::new).collect();
        let tag = format!("tp-{tp_p}-{tp_d}-{order}-{}", std::process::id());
        for round in 0..2u64 {
            let prompts: Vec<PromptSpec> = (0..BATCH as u64)
                .map(|n| PromptSpec {
                    id: ReqId::new(format!("{tag}-{round}-{n}")),
                    prompt_len: 40 + 13 * n as usize,
                    seed: round * 10 + n,
                })
                .collect();
            // Every prefill rank computes the step; decode pulls by rank 0's params.
            let mut params = None;
            for rank in &mut p {
                let done = rank.prefill(&prompts).await.unwrap();
                params.get_or_insert(done);
            }
            let pulls: Vec<PullSpec> = params
                .unwrap()
                .into_iter()
                .enumerate()
                .map(|(n, (spec, params, _))| PullSpec {
                    id: spec.id,
                    prompt_len: spec.prompt_len,
                    seed: spec.seed,
                    params,
                    // The second request's first block is in decode's prefix cache.
                    prefix_hit_tokens: if n == 1 { 16 } else { 0 },
                })
                .collect();
            for rank in &mut d {
                rank.schedule(&pulls).await.unwrap();
            }
            let ids: HashSet<ReqId> = pulls.iter().map(|p| p.id.clone()).collect();
            for (r, rank) in d.iter_mut().enumerate() {
                let deadline = Instant::now() + BOUND;
                let mut received = HashSet::new();
                while received.len() < ids.len() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    assert!(!left.is_zero(), "decode rank {r}: only {received:?} within {BOUND:?}");
                    for c in rank.complete(left).await.unwrap() {
                        match c {
                            Completion::Received { id, verified, .. } => {
                                assert!(verified);
                                assert!(received.insert(id));
                            }
                            other => panic!("decode rank {r} of {tp_d} from {tp_p}: {other:?}"),
                        }
                    }
                }
                assert_eq!(received, ids);
            }
            for (r, rank) in p.iter_mut().enumerate() {
                assert_eq!(rank.drain(Duration::from_secs(20)).await.unwrap(), 0, "prefill rank {r} still holds");
            }
        }
        for rank in p {
            rank.into_client().bye().await.unwrap();
        }
        for rank in d {
            rank.into_client().bye().await.unwrap();
        }
        // The servers stop with their processes, after their sessions ended.
        drop((prefill, decode));
    });
}

/// Pipeline parallelism on one side only is refused at start-up: the bench
/// names both sizes and starts no worker.
#[test]
fn pipeline_parallelism_on_one_side_is_a_start_up_error() {
    let (status, stdout, stderr) =
        common::bench(None, &["--pp-prefill", "2", "--requests", "1", "--layers", "4", "--json"]);
    assert!(!status.success());
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("--pp-prefill 2 and --pp-decode 1"), "{stderr}");
}

/// Two pipeline stages on both sides, each of two tensor-parallel ranks on
/// prefill and one on decode: every stage pulls its layers.
#[test]
fn two_pipeline_stages_on_both_sides_move_every_layer() {
    let args = [
        "--layers",
        "4",
        "--heads",
        "2",
        "--head-dim",
        "32",
        "--blocks-per-request",
        "4",
        "--requests",
        "6",
        "--pp-prefill",
        "2",
        "--pp-decode",
        "2",
        "--tp-prefill",
        "2",
        "--json",
    ];
    let (status, stdout, stderr) = common::bench(None, &args);
    assert!(status.success(), "bench failed: {status}\nstdout: {stdout}\nstderr: {stderr}");
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    for (field, value) in [("received", 6), ("failed", 0), ("corrupt", 0)] {
        assert_eq!(report[field], value, "{report}");
    }
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["tp"], serde_json::json!([2, 1]), "{report}");
}

/// `kvlink demo` runs other tensor-parallel sizes and block sizes per side
/// too (8-token blocks on prefill at TP 2, 16 on decode at TP 1) and
/// verifies every byte, as it does in its plain form.
#[test]
fn the_demo_runs_other_topologies_and_block_sizes() {
    let args = ["demo", "--requests", "2", "--block-size", "8", "--block-size-decode", "16", "--tp-prefill", "2"];
    let (status, stdout, stderr) = Proc::spawn("kvlink demo", None, &args).finish();
    assert!(status.success(), "demo failed: {status}\nstdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("8-token blocks"), "{stdout}");
    assert!(stdout.contains("decode: 1 x 1, 16-token blocks"), "{stdout}");
    assert!(stdout.contains("OK: every byte verified"), "{stdout}");
}

/// Topologies `kvlink bench` cannot run are one line before any worker starts.
#[rstest]
#[case::zero_tp(&["--tp-prefill", "0"], "parallel sizes start at 1")]
#[case::zero_decode_block_size(&["--block-size-decode", "0"], "--block-size-decode starts at 1")]
fn impossible_topologies_are_one_line(#[case] args: &[&str], #[case] needle: &str) {
    let mut all = vec!["--requests", "1"];
    all.extend_from_slice(args);
    common::assert_one_line_error(&common::bench(None, &all), needle);
}
