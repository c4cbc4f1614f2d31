//! Writes the hand-made seeds of the text and frame targets into `corpus/`:
//! real side-channel frames (each message kind, back to back, cut short,
//! corrupted) and real `--kv-transfer-config` and `kv_transfer_params`
//! texts. The rest of the corpora was grown by the fuzzer from these and
//! reduced to a set cover of the edges reached; see `README.md`. The seeds
//! match the current message layouts (protocol version 3, `idle_timeout`,
//! `lease_renewal`, `block_tokens` and `dtype_bytes`, `XferRefused`,
//! `KeepAlive`): rerun this when a layout changes, so that they still decode
//! as intended.
//!
//! `cargo run --manifest-path fuzz/Cargo.toml --no-default-features --example seeds`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::path::Path;
use std::time::Duration;

use bytes::BytesMut;
use kv_proto::{
    CacheLayout, Endpoint, EngineId, FrameCodec, Grant, GrantId, Hello, HelloReply, KeepAlive, LayoutKind, Outcome,
    Protocol, ReqId, RequestBlocks, RequestOutcome, SideMessage, XferReply, XferRequest,
};

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
    println!("corpus/{target}/seed-{name}: {} bytes", bytes.len());
}

fn frame(msg: &SideMessage) -> Vec<u8> {
    let mut out = BytesMut::new();
    FrameCodec::default().encode(msg, &mut out).unwrap();
    out.to_vec()
}

/// The frame target's input: limit choice, split seed, stream.
fn frame_input(choice: u8, seed: u16, stream: &[u8]) -> Vec<u8> {
    let mut out = vec![choice];
    out.extend_from_slice(&seed.to_le_bytes());
    out.extend_from_slice(stream);
    out
}

fn messages() -> Vec<(&'static str, SideMessage)> {
    let layout =
        CacheLayout { kind: LayoutKind::SplitKv, region_count: 4, block_len: 4096, block_tokens: 16, dtype_bytes: 2 };
    vec![
        (
            "hello",
            SideMessage::Hello(Hello {
                client_nonce: [7; 32],
                engine_id: EngineId::new("decode-0"),
                protocol: Protocol::Tcp,
                layout,
            }),
        ),
        (
            "accepted",
            SideMessage::HelloReply(HelloReply::Accepted {
                engine_id: EngineId::new("prefill-0"),
                idle_timeout: Duration::from_secs(300),
                lease_renewal: Duration::from_secs(10),
            }),
        ),
        ("keep-alive", SideMessage::KeepAlive(KeepAlive { req_ids: vec![ReqId::new("req-a"), ReqId::new("req-b")] })),
        ("challenge", SideMessage::HelloReply(HelloReply::Challenge { server_nonce: [1; 32], server_proof: [2; 32] })),
        ("rejected", SideMessage::HelloReply(HelloReply::Rejected { reason: "region count: p has 4, d has 8".into() })),
        ("proof", SideMessage::AuthProof([3; 32])),
        (
            "request",
            SideMessage::XferRequest(XferRequest {
                xfer_id: 42,
                endpoint: Endpoint { protocol: Protocol::Tcp, address: "10.0.0.2:9000".into(), details: Vec::new() },
                grant: Grant::plain(GrantId::from_bytes([9; 16])),
                wait_budget: Duration::from_millis(1500),
                region_base_addrs: vec![0x1000, 0x20000, 0x40000, 0x80000],
                requests: vec![
                    RequestBlocks { req_id: ReqId::new("req-a"), block_ids: vec![1, 2, 3] },
                    RequestBlocks { req_id: ReqId::new("req-b"), block_ids: Vec::new() },
                ],
            }),
        ),
        (
            "reply",
            SideMessage::XferReply(XferReply {
                xfer_id: 42,
                outcomes: vec![
                    RequestOutcome { req_id: ReqId::new("req-a"), outcome: Outcome::Done },
                    RequestOutcome {
                        req_id: ReqId::new("req-b"),
                        outcome: Outcome::Failed { reason: "unknown request".into() },
                    },
                ],
            }),
        ),
        ("refused", SideMessage::XferRefused { xfer_id: 43, reason: "reply too large".into() }),
    ]
}

fn main() {
    let all = messages();
    for (name, msg) in &all {
        write("side_channel_frame", name, &frame_input(0, 1, &frame(msg)));
    }
    let mut session = Vec::new();
    for name in ["hello", "challenge", "proof", "accepted", "request", "reply"] {
        let (_, msg) = all.iter().find(|(n, _)| *n == name).unwrap();
        session.extend_from_slice(&frame(msg));
    }
    write("side_channel_frame", "session-split", &frame_input(0, 0x1234, &session));
    write("side_channel_frame", "session-1k-limit", &frame_input(2, 7, &session));
    let request = frame(&all[5].1);
    write("side_channel_frame", "cut-short", &frame_input(0, 3, &request[..request.len() - 5]));
    let mut bad_version = request.clone();
    bad_version[5] ^= 1;
    write("side_channel_frame", "bad-version", &frame_input(0, 3, &bad_version));
    let mut huge = request[..12].to_vec();
    huge[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
    write("side_channel_frame", "huge-length", &frame_input(0, 3, &huge));

    let configs: &[(&str, &str)] = &[
        ("producer", "-\n-\n{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_producer\",\"engine_id\":\"p0\"}"),
        (
            "consumer-quic",
            "9100\n2.5\n{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_consumer\",\"engine_id\":\"d0\",\
             \"kv_connector_extra_config\":{\"mooncake_protocol\":\"quic\",\"num_workers\":4}}",
        ),
        (
            "both-nulls",
            "-\n 30 \n{\"kv_role\":\"kv_both\",\"engine_id\":\"e\",\"kv_connector_extra_config\":\
             {\"mooncake_protocol\":null,\"num_workers\":null}}",
        ),
        ("bad-role", "-\n-\n{\"kv_role\":\"kv_sender\",\"engine_id\":\"e\"}"),
        ("bad-port", "0\n-\n{\"kv_role\":\"kv_both\",\"engine_id\":\"e\"}"),
    ];
    for (name, text) in configs {
        write("transfer_config_json", name, text.as_bytes());
    }
    let params: &[(&str, &str)] = &[
        (
            "pull",
            "{\"do_remote_prefill\":true,\"do_remote_decode\":false,\"remote_host\":\"10.0.0.1\",\"remote_port\":8998,\
             \"remote_engine_id\":\"p0\",\"remote_block_ids\":[1,2]}",
        ),
        ("decode-elsewhere", "{\"do_remote_decode\":true}"),
        ("nulls", "{\"do_remote_prefill\":null,\"remote_host\":null,\"remote_port\":null}"),
        ("port-too-big", "{\"remote_port\":70000}"),
        ("not-an-object", "[1,2,3]"),
    ];
    for (name, text) in params {
        write("transfer_params_json", name, text.as_bytes());
    }
}
