//! What must agree between P and D for KV to mean the same on both is
//! checked at connect: each field of the identity, and each part of the
//! topology and cache layout that cannot be mapped, mismatched in turn is
//! refused at the hello with both values named, and a decode instance then
//! fails its pulls at once with that reason (never per request).
#![cfg(feature = "tcp")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use futures_util::{SinkExt, StreamExt};
use kv_proto::auth;
use kv_proto::{
    CacheLayout, EngineId, FailureCause, FrameCodec, Hello, HelloReply, KvRole, LayoutKind, ModelIdentity, Protocol,
    RankTopology, SideMessage, TokenLayout,
};
use kv_worker::{OwnedKvCache, SideChannelCodec};
use rstest::rstest;
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

fn llama() -> ModelIdentity {
    ModelIdentity {
        model: "meta-llama/Llama-3.1-8B".into(),
        config_hash: "5f2c".into(),
        kv_dtype: "bfloat16".into(),
        cache_dtype: "auto".into(),
        num_layers: 32,
        // What the tests' cache holds.
        num_kv_heads: 2,
        head_size: 128,
        attention_layout: "NHD".into(),
        tp_size: 1,
        pp_size: 1,
        engine_version: "0.14.0".into(),
        kvlink_version: "0.1.0".into(),
    }
}

/// D's identity differs from P's ([`llama`]) in one field: the hello is
/// refused naming the field and both values.
#[rstest]
#[case::model(ModelIdentity { model: "Qwen/Qwen2.5-7B".into(), ..llama() }, "model: decode d has Qwen/Qwen2.5-7B, prefill p has meta-llama/Llama-3.1-8B")]
#[case::config_hash(ModelIdentity { config_hash: "77aa".into(), ..llama() }, "model config hash: decode d has 77aa, prefill p has 5f2c")]
#[case::kv_dtype(ModelIdentity { kv_dtype: "float16".into(), ..llama() }, "KV dtype: decode d has float16, prefill p has bfloat16")]
#[case::cache_dtype(ModelIdentity { cache_dtype: "fp8_e4m3".into(), ..llama() }, "cache dtype: decode d has fp8_e4m3, prefill p has auto")]
#[case::layers(ModelIdentity { num_layers: 40, ..llama() }, "layers: decode d has 40, prefill p has 32")]
#[case::kv_heads(ModelIdentity { num_kv_heads: 4, ..llama() }, "KV heads: decode d has 4, prefill p has 2")]
#[case::head_size(ModelIdentity { head_size: 64, ..llama() }, "head size: decode d has 64, prefill p has 128")]
#[case::attention_layout(ModelIdentity { attention_layout: "HND".into(), ..llama() }, "attention layout: decode d has HND, prefill p has NHD")]
#[case::engine_version(ModelIdentity { engine_version: "0.32.0".into(), ..llama() }, "engine version: decode d has 0.32.0, prefill p has 0.14.0")]
#[case::kvlink_version(ModelIdentity { kvlink_version: "0.2.0".into(), ..llama() }, "kvlink version: decode d has 0.2.0, prefill p has 0.1.0")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_field_that_differs_is_refused_at_the_hello_with_both_values(
    #[case] decode: ModelIdentity,
    #[case] expected: &str,
) {
    let reason = refusal(decode, layout(), RankTopology::single()).await;
    assert!(reason.contains(expected), "{reason}");
    assert_eq!(reason.matches(" has ").count(), 2, "only that field differs: {reason}");
}

/// The tests' cache layout (2 heads of 16 elements of 2 bytes, NHD,
/// 16-token blocks, 2 layers, split K/V).
fn layout() -> CacheLayout {
    OwnedKvCache::allocate(shape()).unwrap().registered().layout()
}

/// Sends D's hello to a prefill worker with identity [`llama`] and the
/// tests' cache; returns P's refusal.
async fn refusal(identity: ModelIdentity, layout: CacheLayout, topology: RankTopology) -> String {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut config = net.config(KvRole::Producer, "p");
    config.identity = llama();
    let p = start(config, net.writer(KvRole::Producer, "p").await).await;
    let stream = TcpStream::connect(p.worker.side_channel_addr().unwrap()).await.unwrap();
    let mut raw = Framed::new(stream, SideChannelCodec::new(FrameCodec::new(1 << 20)));
    let hello = Hello {
        client_nonce: auth::fresh_nonce().unwrap(),
        engine_id: EngineId::new("d"),
        protocol: Protocol::Tcp,
        layout,
        identity,
        topology,
    };
    raw.send(SideMessage::Hello(hello)).await.unwrap();
    match tokio::time::timeout(BOUND, raw.next()).await.unwrap() {
        Some(Ok(SideMessage::HelloReply(HelloReply::Rejected { reason }))) => {
            assert!(reason.starts_with("incompatible peers ("), "{reason}");
            reason
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn rank(tp: u32, r: u32, pp: u32, stage: u32) -> RankTopology {
    RankTopology::new(tp, r, pp, stage, 2).unwrap()
}

fn undeclared() -> CacheLayout {
    CacheLayout { token_layout: TokenLayout::Undeclared, block_heads: 0, ..layout() }
}

/// What the hello's topology and layout carry, mismatched in a way that
/// cannot be mapped, is refused naming both values (P is rank 0 of 1, with
/// the tests' cache). Layouts that can be mapped (another tensor-parallel
/// size, block size, NHD or HND, split or fused K/V) are not refused: see
/// the topology end-to-end tests.
#[rstest]
#[case::pp_size(layout(), rank(1, 0, 2, 0), "pipeline-parallel size: decode d has 2, prefill p has 1")]
#[case::tp_size_without_heads(undeclared(), rank(2, 1, 1, 0), "tensor-parallel size: decode d has 2, prefill p has 1")]
#[case::block_size_without_heads(CacheLayout { block_tokens: 32, block_len: 2048, ..undeclared() }, RankTopology::single(), "tokens per block: decode d has 32, prefill p has 16")]
#[case::mla(CacheLayout { kind: LayoutKind::Mla, region_count: 2, block_len: 16 * 64, block_heads: 1, ..layout() }, rank(2, 0, 1, 0), "attention kind: decode d has MLA, prefill p has K and V")]
#[case::head_bytes(CacheLayout { block_len: 16 * 2 * 64, ..layout() }, rank(2, 0, 1, 0), "bytes per head and token: decode d has 64, prefill p has 32")]
#[case::layers(CacheLayout { region_count: 6, ..layout() }, rank(2, 0, 1, 0), "layers: decode d has 3, prefill p has 2")]
#[case::rows_against_planes(CacheLayout { kind: LayoutKind::FusedRows, region_count: 2, block_len: 2 * layout().block_len, ..layout() }, rank(2, 0, 1, 0), "K and V: decode d has side by side in each row, prefill p has apart")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmappable_topology_or_layout_is_refused_at_the_hello_with_both_values(
    #[case] layout: CacheLayout,
    #[case] topology: RankTopology,
    #[case] expected: &str,
) {
    let reason = refusal(llama(), layout, topology).await;
    assert!(reason.contains(expected), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeclared_fields_are_not_compared_and_a_mismatch_fails_pulls_at_once() {
    let net = Net::new(Backend::Tcp).unwrap();
    let mut p_config = net.config(KvRole::Producer, "p");
    p_config.identity = llama();
    let p = start(p_config, net.writer(KvRole::Producer, "p").await).await;
    let (host, port) = side_channel(&p);

    // A decode instance that declares only some fields (here: none but the
    // model) pulls as usual.
    let mut d_config = net.config(KvRole::Consumer, "d");
    d_config.identity = ModelIdentity { model: llama().model, ..ModelIdentity::default() };
    let d = start(d_config, net.writer(KvRole::Consumer, "d").await).await;
    fill(&p.cache, 1, &[0]);
    ready(&p, "a", &[0]);
    pull(&d, &host, port, &[("a", &[5])]);
    until(&d.worker, |f| f.receiving.len() == 1).await;
    assert!(holds(&d.cache, 1, &[5]));

    // One with another dtype fails every pull at once, counted as an
    // incompatible peer.
    let mut d_config = net.config(KvRole::Consumer, "d2");
    d_config.identity = ModelIdentity { kv_dtype: "float16".into(), ..llama() };
    let d2 = start(d_config, net.writer(KvRole::Consumer, "d2").await).await;
    ready(&p, "b", &[1]);
    ready(&p, "c", &[2]);
    pull(&d2, &host, port, &[("b", &[5])]);
    until(&d2.worker, |f| f.failed_receiving.len() == 1).await;
    pull(&d2, &host, port, &[("c", &[6])]);
    until(&d2.worker, |f| f.failed_receiving.len() == 1).await;
    assert_eq!(d2.worker.metrics().pulls_failed[&FailureCause::IncompatiblePeer], 2);
}
