//! Writes the hand-made seeds of the text and frame targets into `corpus/`:
//! real side-channel frames (each message kind, back to back, cut short,
//! corrupted), real `--kv-transfer-config` and `kv_transfer_params` texts,
//! for the data planes and the bench control channel what their real
//! encoders write (whole sessions, and a few refusals), and bootstrap
//! registrations, query replies, error bodies and addresses. The rest of
//! the corpora was grown by the fuzzer from these and reduced to a set
//! cover of the edges reached; see `README.md`. The seeds
//! match the current message layouts (protocol version 7: the topology in
//! the hello and its reply, a transfer request's heads, first tokens and
//! piece size, `XferProgress`, `XferRefused`, `KeepAlive`): rerun this when
//! a layout changes, so that they still decode as intended.
//!
//! `cargo run --manifest-path fuzz/Cargo.toml --no-default-features --example seeds`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::path::Path;
use std::time::Duration;

use bytes::BytesMut;
use kv_proto::{
    CacheLayout, Endpoint, EngineId, FrameCodec, Grant, GrantId, Hello, HelloReply, KeepAlive, LayoutKind, Outcome,
    Protocol, RenewalKey, Renewing, ReqId, RequestBlocks, RequestOutcome, SideMessage, XferProgress, XferReply,
    XferRequest,
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
    let layout = CacheLayout {
        kind: LayoutKind::SplitKv,
        region_count: 4,
        block_len: 4096,
        block_tokens: 16,
        dtype_bytes: 2,
        token_layout: kv_proto::TokenLayout::Nhd,
        block_heads: 2,
    };
    let topology = kv_proto::RankTopology::new(2, 1, 1, 0, 4).unwrap_or_default();
    vec![
        (
            "hello",
            SideMessage::Hello(Hello {
                client_nonce: [7; 32],
                engine_id: EngineId::new("decode-0"),
                protocol: Protocol::Tcp,
                layout,
                identity: kv_proto::ModelIdentity::this_kvlink(),
                topology,
            }),
        ),
        (
            "accepted",
            SideMessage::HelloReply(HelloReply::Accepted {
                engine_id: EngineId::new("prefill-0"),
                idle_timeout: Duration::from_secs(300),
                lease_renewal: Duration::from_secs(10),
                topology,
                layout,
            }),
        ),
        (
            "keep-alive",
            SideMessage::KeepAlive(KeepAlive {
                renewals: ["req-a", "req-b"]
                    .map(|id| Renewing { req_id: ReqId::new(id), key: RenewalKey::from_bytes([0x6b; 16]) })
                    .to_vec(),
            }),
        ),
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
                    RequestBlocks {
                        req_id: ReqId::new("req-a"),
                        decode_req_id: None,
                        prefill_engine_id: Some(EngineId::new("prefill-0")),
                        block_ids: vec![1, 2, 3],
                        first_token: Some(16),
                        may_precede_prefill: false,
                    },
                    RequestBlocks {
                        req_id: ReqId::new("req-b"),
                        decode_req_id: None,
                        prefill_engine_id: None,
                        block_ids: Vec::new(),
                        first_token: None,
                        may_precede_prefill: false,
                    },
                ],
                heads: Some(kv_proto::HeadRange::new(2, 2)),
                piece_blocks: 8,
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
                        outcome: Outcome::Failed {
                            cause: kv_proto::FailureCause::UnknownRequest,
                            reason: "unknown request".into(),
                        },
                    },
                ],
            }),
        ),
        ("refused", SideMessage::XferRefused { xfer_id: 43, reason: "reply too large".into() }),
        (
            "progress",
            SideMessage::XferProgress(XferProgress {
                xfer_id: 42,
                req_id: ReqId::new("req-a"),
                landed: 8,
                outcome: None,
            }),
        ),
        (
            "progress-failed",
            SideMessage::XferProgress(XferProgress {
                xfer_id: 42,
                req_id: ReqId::new("req-a"),
                landed: 2,
                outcome: Some(Outcome::Failed {
                    cause: kv_proto::FailureCause::CopyFailed,
                    reason: "copying into staging failed".into(),
                }),
            }),
        ),
    ]
}

/// The grant the data-plane targets' receiver holds live, and its range
/// (`src/op_list.rs`): batches under it are admitted.
const LIVE_GRANT: [u8; 16] = [0x5a; 16];
const GRANT_ADDR: u64 = 0x10_0000;

fn tcp_batch(batch_id: u64, flags: u32, grant: [u8; 16], ops: &[(u64, u64)], payload: bool) -> Vec<u8> {
    use transport_tcp::wire::BatchHeader;
    let total: u64 = ops.iter().map(|op| op.1).sum();
    let header = BatchHeader {
        batch_id,
        flags,
        reserved: 0,
        op_count: ops.len() as u64,
        total_bytes: total,
        grant: GrantId::from_bytes(grant),
    };
    let mut out = header.encode().to_vec();
    for &(dst, len) in ops {
        out.extend_from_slice(&kv_proto::dataplane::encode_op(dst, len));
    }
    if payload {
        out.extend((0..total).map(|i| i as u8));
    }
    out
}

fn tcp_seeds() {
    use kv_proto::dataplane::ReplyStatus;
    use transport_tcp::wire::{encode_reply, Accept, AcceptStatus, Preamble, BATCH_FLAG_PRECHECK, FLAG_AUTH, VERSION};
    let with = |options: u8, parts: &[&[u8]]| -> Vec<u8> {
        let mut out = vec![options];
        parts.iter().for_each(|p| out.extend_from_slice(p));
        out
    };
    let plain = Preamble::current().encode();
    let ops = [(GRANT_ADDR, 64), (GRANT_ADDR + 4096, 32)];
    let good = tcp_batch(1, 0, LIVE_GRANT, &ops, true);
    let unknown = tcp_batch(2, 0, [1; 16], &ops, true);
    let precheck_unknown = tcp_batch(3, BATCH_FLAG_PRECHECK, [1; 16], &ops, false);
    let precheck = tcp_batch(4, BATCH_FLAG_PRECHECK, LIVE_GRANT, &ops, true);
    write("tcp_dataplane", "session", &with(1, &[&plain, &good, &unknown, &precheck_unknown, &precheck]));
    let auth = Preamble { version: VERSION, flags: FLAG_AUTH }.encode();
    write("tcp_dataplane", "session-auth", &with(8 | 3, &[&auth, &[7; 32], &[8; 32], &good]));
    write("tcp_dataplane", "auth-required", &with(8, &[&plain, &good]));
    let many: Vec<(u64, u64)> = (0..4).map(|i| (GRANT_ADDR + i * 16, 16)).collect();
    write("tcp_dataplane", "over-op-limit", &with(4 | 1, &[&plain, &tcp_batch(5, 0, LIVE_GRANT, &many, true)]));
    let big: Vec<(u64, u64)> = (0..40).map(|i| (GRANT_ADDR + i * 16, 16)).collect();
    write("tcp_dataplane", "budget-shared", &with(32 | 1, &[&plain, &tcp_batch(6, 0, LIVE_GRANT, &big, true)]));
    let mut mismatch = tcp_batch(7, 0, LIVE_GRANT, &ops, false);
    mismatch[24] ^= 1;
    write("tcp_dataplane", "length-mismatch", &with(1, &[&plain, &mismatch]));
    let outside = tcp_batch(8, 0, LIVE_GRANT, &[(GRANT_ADDR + 0x8_0000, 8)], true);
    let overlapping = tcp_batch(9, 0, LIVE_GRANT, &[(GRANT_ADDR + 8, 8), (GRANT_ADDR, 16)], true);
    write("tcp_dataplane", "refused", &with(1, &[&plain, &outside, &overlapping, &good]));
    let accept = Accept {
        version: VERSION,
        status: AcceptStatus::Accepted,
        max_ops_per_batch: 1 << 24,
        idle_timeout_ms: 120_000,
    }
    .encode();
    let ok = encode_reply(1, ReplyStatus::Ok, "");
    let refused = encode_reply(2, ReplyStatus::Refused, "unknown grant 5a5a5a5a");
    let protocol = encode_reply(3, ReplyStatus::ProtocolError, "batch 3 announces 4 ops, more than the limit of 3");
    write("tcp_dataplane", "sender", &with(16, &[&accept, &ok, &refused, &protocol]));
}

fn quic_seeds() {
    use kv_proto::dataplane::{put_verdict, ReplyStatus};
    use transport_quic::wire::{BatchHeader, ClientHello, ServerHello};
    use transport_quic::EndpointDetails;
    let with = |choice: u8, parts: &[&[u8]]| -> Vec<u8> {
        let mut out = vec![choice];
        parts.iter().for_each(|p| out.extend_from_slice(p));
        out
    };
    let details = EndpointDetails { fingerprint: [0xab; 32], max_ops_per_batch: 1 << 21 }.encode();
    write("quic_dataplane", "details", &with(0, &[&details]));
    write("quic_dataplane", "client-hello", &with(1, &[&ClientHello { auth: true, nonce: [3; 32] }.encode()]));
    let server = ServerHello { auth: true, nonce: [4; 32], proof: [5; 32] }.encode();
    write("quic_dataplane", "server-hello", &with(2, &[&server]));
    let batch = |grant: [u8; 16], ops: &[(u64, u64)]| -> Vec<u8> {
        let total: u64 = ops.iter().map(|op| op.1).sum();
        let header = BatchHeader { grant: GrantId::from_bytes(grant), op_count: ops.len() as u64, total_bytes: total };
        let mut out = header.encode().to_vec();
        for &(dst, len) in ops {
            out.extend_from_slice(&kv_proto::dataplane::encode_op(dst, len));
        }
        out.extend((0..total).map(|i| i as u8));
        out
    };
    let ops = [(GRANT_ADDR, 64), (GRANT_ADDR + 4096, 32)];
    // Choice 3 + 5k: a batch under receiver configuration k.
    write("quic_dataplane", "batch", &with(3 + 5 * 3, &[&batch(LIVE_GRANT, &ops)]));
    write("quic_dataplane", "batch-small-budget", &with(3 + 5, &[&batch(LIVE_GRANT, &ops)]));
    let many: Vec<(u64, u64)> = (0..200).map(|i| (GRANT_ADDR + i * 16, 16)).collect();
    write("quic_dataplane", "batch-budget-shared", &with(3 + 5 * (8 | 1), &[&batch(LIVE_GRANT, &many)]));
    write("quic_dataplane", "batch-unknown-grant", &with(3, &[&batch([1; 16], &ops)]));
    let mut verdicts = Vec::new();
    put_verdict(&mut verdicts, ReplyStatus::Ok, "");
    put_verdict(&mut verdicts, ReplyStatus::Refused, "grant 5a5a5a5a was revoked during the batch");
    write("quic_dataplane", "verdicts", &with(4, &[&verdicts]));
}

fn rdma_seeds() {
    use transport_rdma::control::{encode_reply, encode_request, ControlLimits, Reply, Request};
    use transport_rdma::details::EndpointDetails;
    use transport_rdma::handshake::{self, ConnectionInfo, HandshakeLimits, QpEndpoint};
    use transport_rdma::region::{RegionTable, RemoteRegion};
    let limits = ControlLimits { max_windows: 8 };
    let windows = |n: u64| {
        RegionTable::new(
            (0..n)
                .map(|i| RemoteRegion { addr: 0x7f00_0000_0000 + i * 0x1_0000, len: 0x8000, rkey: 0x100 + i as u32 })
                .collect(),
        )
        .unwrap()
    };
    let mut replies = Vec::new();
    for reply in [
        Reply::Progress(2),
        Reply::Windows(windows(3)),
        Reply::Refused("no live grant has this id".into()),
        Reply::Closed("shutting down".into()),
        Reply::Failed("bind failed".into()),
    ] {
        encode_reply(&reply, &limits, &mut replies).unwrap();
    }
    // Choice 4k: replies under limit k (1: 8 windows).
    write("rdma_control", "replies", &[&[4u8][..], &replies].concat());
    let mut requests = Vec::new();
    encode_request(&Request::Open(GrantId::from_bytes([9; 16])), &mut requests);
    encode_request(&Request::Open(GrantId::from_bytes([10; 16])), &mut requests);
    write("rdma_control", "requests", &[&[1u8][..], &requests].concat());
    let mut gid = [0u8; 16];
    gid[10..].copy_from_slice(&[0xff, 0xff, 127, 0, 0, 1]);
    let info = ConnectionInfo {
        qp: QpEndpoint { gid, qpn: 0x11, psn: 0xabcdef },
        regions: (0..3)
            .map(|i| RemoteRegion { addr: 0x7f00_0000_0000 + i * 0x10_0000, len: 0x8_0000, rkey: i as u32 })
            .collect(),
    };
    let mut message = Vec::new();
    handshake::encode(&info, &HandshakeLimits::default(), &mut message).unwrap();
    // Choice 2 + 4k: a handshake under limit k (2: the default).
    write("rdma_control", "handshake", &[&[2u8 + 8][..], &message].concat());
    let sender = ConnectionInfo { regions: Vec::new(), ..info };
    let mut message = Vec::new();
    handshake::encode(&sender, &HandshakeLimits::default(), &mut message).unwrap();
    write("rdma_control", "handshake-sender", &[&[2u8][..], &message].concat());
    write(
        "rdma_control",
        "details",
        &[&[3u8][..], &EndpointDetails { instance: 0x0123_4567_89ab_cdef }.encode()].concat(),
    );
}

fn control_frames(msgs: &[serde_json::Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for msg in msgs {
        let body = serde_json::to_vec(msg).unwrap();
        out.extend_from_slice(&(body.len() as u32).to_be_bytes());
        out.extend_from_slice(&body);
    }
    out
}

fn control_seeds() {
    use kv_worker::CacheDims;
    use kvlink::control::{ClientMsg, PrefilledItem, ServerMsg, WirePull, CONTROL_VERSION};
    use kvlink::{BlockPattern, Completion, PromptSpec};
    let shape = CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers: 2,
        num_blocks: 64,
        block_size: 16,
        num_kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
    };
    let hello = ClientMsg::Hello {
        version: CONTROL_VERSION,
        shape: shape.into(),
        pattern: BlockPattern::Scattered,
        protocol: Protocol::Tcp,
        verify: true,
        client_nonce: Some([7; 32]),
    };
    let params = serde_json::json!({"do_remote_prefill": true, "remote_host": "10.0.0.1", "remote_port": 8998,
        "remote_engine_id": "p0", "remote_block_ids": [1, 2, 3]});
    write(
        "bench_control",
        "hello",
        &[&[0u8][..], &control_frames(&[value(&hello), value(&ClientMsg::Proof { proof: [9; 32] })])].concat(),
    );
    let calls = [
        ClientMsg::Prefill { prompts: vec![PromptSpec { id: ReqId::new("r0"), prompt_len: 100, seed: 1 }] },
        ClientMsg::Drain { timeout_ms: 5000 },
        ClientMsg::Schedule {
            pulls: vec![WirePull {
                id: ReqId::new("r0"),
                prompt_len: 100,
                seed: 1,
                params: params.clone(),
                prefix_hit_tokens: 16,
            }],
        },
        ClientMsg::Complete { timeout_ms: 5000 },
        ClientMsg::Stats,
        ClientMsg::Ping,
        ClientMsg::Bye,
    ];
    let calls: Vec<serde_json::Value> = calls.iter().map(value).collect();
    write("bench_control", "calls", &[&[1u8][..], &control_frames(&calls)].concat());
    let replies = [
        ServerMsg::Challenge { server_nonce: [1; 32], server_proof: [2; 32] },
        ServerMsg::Welcome { version: CONTROL_VERSION, role: kv_proto::KvRole::Producer, idle_timeout_ms: 60_000 },
        ServerMsg::Prefilled { items: vec![PrefilledItem { id: ReqId::new("r0"), params, blocks: vec![1, 2, 3] }] },
        ServerMsg::Drained { held: 0 },
        ServerMsg::Scheduled { blocks: vec![vec![4, 5], vec![]] },
        ServerMsg::Completions {
            items: vec![
                Completion::Received {
                    id: ReqId::new("r0"),
                    blocks: 3,
                    verified: true,
                    latency: std::time::Duration::from_micros(1500),
                },
                Completion::Corrupt { id: ReqId::new("r1"), at: (1, 7) },
                Completion::Failed { id: ReqId::new("r2"), blocks: vec![8] },
            ],
        },
        ServerMsg::Stats {
            cpu_seconds: 1.25,
            peak_rss_bytes: 1 << 30,
            figures: Some(kvlink::stats::ProcessFigures {
                rss_bytes: 1 << 29,
                open_fds: 12,
                threads: 5,
                tokio_tasks: 3,
            }),
        },
        ServerMsg::Pong,
        ServerMsg::Bye,
        ServerMsg::Error { message: "busy: serving another session".into() },
    ];
    let replies: Vec<serde_json::Value> = replies.iter().map(value).collect();
    write("bench_control", "replies", &[&[3u8][..], &control_frames(&replies)].concat());
    let mut huge = vec![0u8];
    huge.extend_from_slice(&u32::MAX.to_be_bytes());
    write("bench_control", "huge-length", &huge);
}

/// The bootstrap target's input: a shape byte (dp, tp, pp - 1 in bit pairs
/// from the lowest), a bound byte, the body.
fn bootstrap_input(dp: u8, tp: u8, pp: u8, bound: u8, body: &str) -> Vec<u8> {
    let shape = (dp - 1) | (tp - 1) << 2 | (pp - 1) << 4;
    [&[shape, bound][..], body.as_bytes()].concat()
}

fn bootstrap_seeds() {
    use kv_proto::auth::AuthSecret;
    use kv_proto::bootstrap::{detail_json, registration_proof, BootstrapRegistry, Expected, Registration, WorkerAddr};
    let reg = |engine: &str, dp: u32, tp: u32, pp: u32, addr: &str| Registration {
        engine_id: EngineId::new(engine),
        dp_rank: dp,
        tp_rank: tp,
        pp_rank: pp,
        addr: WorkerAddr::parse(addr).unwrap(),
    };
    // As vLLM's worker posts it (Python's json.dumps: spaces after separators).
    let vllm = r#"{"engine_id": "6f1e0c1a-prefill_dp0", "dp_rank": 0, "tp_rank": 1, "pp_rank": 0, "addr": "tcp://10.203.1.2:17101"}"#;
    write("bootstrap_http", "registration-vllm", &bootstrap_input(1, 2, 1, 64, vllm));
    // A registration line and its proof under the target's secret (its first two bytes).
    let body = reg("p0", 0, 0, 0, "tcp://[fd00::2]:17100").to_json();
    let proof = registration_proof(&AuthSecret::new([0u8, 64]), body.as_bytes());
    write("bootstrap_http", "registration-proven", &bootstrap_input(1, 1, 1, 64, &format!("{body}\n{proof}")));
    // Every worker of dp 2 x tp 2 registering (out of order), with an identical
    // registration again, a conflicting address, another engine id for a
    // rank and a rank outside the shape: complete after the fourth line.
    let mut lines = Vec::new();
    let mut registry = BootstrapRegistry::new(Expected::new(2, 2, 1).unwrap());
    for (dp, tp) in [(1, 1), (0, 0), (1, 0), (0, 1)] {
        let r = reg(&format!("prefill_dp{dp}"), dp, tp, 0, &format!("tcp://10.0.{dp}.{tp}:{}", 17100 + tp));
        registry.register(&r).unwrap();
        lines.push(r.to_json());
    }
    lines.push(lines[0].clone());
    lines.push(reg("prefill_dp0", 0, 0, 0, "tcp://10.0.9.9:17100").to_json());
    lines.push(reg("prefill_dpX", 1, 0, 0, "tcp://10.0.1.0:17100").to_json());
    lines.push(reg("prefill_dp0", 0, 0, 1, "tcp://10.0.0.0:17101").to_json());
    write("bootstrap_http", "registry-complete", &bootstrap_input(2, 2, 1, 64, &lines.join("\n")));
    // The reply that registry gives, and one as FastAPI pretty-printed by hand.
    let reply = registry.query_json().unwrap();
    write("bootstrap_http", "query-reply", &bootstrap_input(1, 1, 1, 200, &reply));
    let pretty = "{ \"0\" : { \"worker_addr\" : { \"0\" : { \"1\" : \"tcp://2.2.2.2:2222\", \"0\": \
                  \"tcp://1.1.1.1:1111\" } },\n \"engine_id\" : \"eng-1\", \"extra\": 1 } }";
    write("bootstrap_http", "query-reply-pretty", &bootstrap_input(1, 1, 1, 200, pretty));
    // Hostile: a reply with a ragged engine, a rank key with a leading zero,
    // hidden characters in an engine id and an address that is no address.
    let hostile = r#"{"0":{"engine_id":"e\u202ex\u200b","worker_addr":{"0":{"0":"tcp://a:1","1":"tcp://a:2"},"1":{"0":"tcp://a:3"}}},"01":{"engine_id":"e","worker_addr":{"0":{"0":"udp://[::1:1"}}}}"#;
    write("bootstrap_http", "query-reply-hostile", &bootstrap_input(1, 1, 1, 16, hostile));
    let error = detail_json("Engine ID mismatch: \u{1b}[31mred\u{202e}\u{0}\nnext line");
    write("bootstrap_http", "error-detail", &bootstrap_input(1, 1, 1, 24, &error));
    let addresses = [
        "tcp://10.0.0.1:17100",
        "tcp://[fe80::1]:17100",
        "tcp://prefill-0.svc.cluster.local:0080",
        "tcp://[::ffff:10.0.0.1]:65535",
        "tcp://host:0",
        "tcp://::1:80",
        "http://Bootstrap.example:8998/",
        "HTTP://[::1]",
        "https://10.0.0.1:8998",
        "http://user@10.0.0.1:8998/query?x#y",
    ];
    write("bootstrap_http", "addresses", &bootstrap_input(1, 1, 1, 32, &addresses.join("\n")));
}

/// A message as JSON.
fn value<T: serde::Serialize>(msg: &T) -> serde_json::Value {
    serde_json::to_value(msg).unwrap()
}

fn main() {
    tcp_seeds();
    quic_seeds();
    rdma_seeds();
    control_seeds();
    bootstrap_seeds();
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
