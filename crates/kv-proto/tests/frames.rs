//! Round trips of every side-channel message and malformed-frame cases.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::BytesMut;
use kv_proto::{
    CacheLayout, Endpoint, EngineId, FailureCause, FrameCodec, FrameError, Grant, GrantId, Hello, HelloReply,
    KeepAlive, LayoutKind, Outcome, Protocol, RenewalKey, Renewing, ReqId, RequestBlocks, RequestOutcome, SideMessage,
    XferProgress, XferReply, XferRequest, FRAME_HEADER_LEN, MAX_REQUESTS_PER_TRANSFER, MAX_TEXT_LEN, PROTOCOL_VERSION,
};
use proptest::prelude::*;
use rstest::rstest;

fn renewing(req: &str) -> Renewing {
    Renewing { req_id: ReqId::new(req), key: RenewalKey::from_bytes([3; 16]) }
}

fn hello() -> SideMessage {
    SideMessage::Hello(Hello {
        client_nonce: [9; 32],
        engine_id: EngineId::new("decode-0"),
        protocol: Protocol::Tcp,
        layout: CacheLayout {
            kind: LayoutKind::SplitKv,
            region_count: 64,
            block_len: 65536,
            block_tokens: 16,
            dtype_bytes: 2,
            token_layout: kv_proto::TokenLayout::Hnd,
            block_heads: 8,
        },
        identity: kv_proto::ModelIdentity {
            model: "meta-llama/Llama-3.1-8B".into(),
            kv_dtype: "bfloat16".into(),
            num_layers: 32,
            ..kv_proto::ModelIdentity::this_kvlink()
        },
        topology: kv_proto::RankTopology::new(4, 3, 2, 1, 8).unwrap(),
    })
}

fn xfer_request() -> SideMessage {
    SideMessage::XferRequest(XferRequest {
        xfer_id: 42,
        endpoint: Endpoint { protocol: Protocol::Quic, address: "127.0.0.1:5555".into(), details: vec![7; 32] },
        grant: Grant { id: GrantId::from_bytes([9; 16]), details: vec![1, 2, 3] },
        wait_budget: Duration::from_millis(60_000),
        region_base_addrs: (0..64).map(|i| 0x7f00_0000_0000 + i * 0x100_0000).collect(),
        requests: vec![
            RequestBlocks {
                req_id: ReqId::new("r1"),
                decode_req_id: None,
                prefill_engine_id: Some(EngineId::new("p0")),
                block_ids: vec![1, 2, 3, 9],
                first_token: Some(32),
                may_precede_prefill: false,
            },
            RequestBlocks {
                req_id: ReqId::new("r2"),
                decode_req_id: None,
                prefill_engine_id: None,
                block_ids: vec![],
                first_token: None,
                may_precede_prefill: false,
            },
        ],
        heads: Some(kv_proto::HeadRange::new(2, 2)),
        piece_blocks: 64,
    })
}

fn xfer_reply() -> SideMessage {
    SideMessage::XferReply(XferReply {
        xfer_id: 42,
        outcomes: vec![
            RequestOutcome { req_id: ReqId::new("r1"), outcome: Outcome::Done },
            RequestOutcome {
                req_id: ReqId::new("r2"),
                outcome: Outcome::Failed { cause: FailureCause::UnknownRequest, reason: "unknown request".into() },
            },
        ],
    })
}

fn accepted() -> SideMessage {
    let layout = match hello() {
        SideMessage::Hello(hello) => hello.layout,
        _ => unreachable!(),
    };
    SideMessage::HelloReply(HelloReply::Accepted {
        engine_id: EngineId::new("p"),
        idle_timeout: Duration::from_secs(300),
        lease_renewal: Duration::from_secs(10),
        topology: kv_proto::RankTopology::new(2, 1, 1, 0, 8).unwrap(),
        layout,
    })
}

fn encode(msg: &SideMessage) -> Vec<u8> {
    let mut buf = BytesMut::new();
    FrameCodec::default().encode(msg, &mut buf).unwrap();
    buf.to_vec()
}

#[rstest]
#[case::hello(hello())]
#[case::hello_accepted(accepted())]
#[case::keep_alive(SideMessage::KeepAlive(KeepAlive { renewals: vec![renewing("a"), renewing("b")] }))]
#[case::transfer_refused(SideMessage::XferRefused { xfer_id: 7, reason: "too big".into() })]
#[case::hello_challenge(SideMessage::HelloReply(HelloReply::Challenge { server_nonce: [1; 32], server_proof: [2; 32] }))]
#[case::auth_proof(SideMessage::AuthProof([3; 32]))]
#[case::hello_rejected(SideMessage::HelloReply(HelloReply::Rejected { reason: "block_len 1 vs 2".into() }))]
#[case::xfer_request(xfer_request())]
#[case::xfer_reply(xfer_reply())]
#[case::progress(SideMessage::XferProgress(XferProgress { xfer_id: 42, req_id: ReqId::new("r1"), landed: 3, outcome: None }))]
#[case::progress_with_outcome(SideMessage::XferProgress(XferProgress { xfer_id: 42, req_id: ReqId::new("r2"), landed: 0, outcome: Some(Outcome::Failed { cause: FailureCause::CopyFailed, reason: "copy".into() }) }))]
fn every_message_round_trips(#[case] msg: SideMessage) {
    let bytes = encode(&msg);
    assert_eq!(FrameCodec::default().decode_exact(&bytes).unwrap(), msg);
}

#[test]
fn frames_decode_incrementally_and_back_to_back() {
    let codec = FrameCodec::default();
    let mut stream = encode(&hello());
    stream.extend(encode(&xfer_reply()));
    let mut buf = BytesMut::new();
    let mut got = Vec::new();
    for byte in stream {
        buf.extend_from_slice(&[byte]);
        if let Some(msg) = codec.decode(&mut buf).unwrap() {
            got.push(msg);
        }
    }
    assert_eq!(got, vec![hello(), xfer_reply()]);
    assert!(buf.is_empty());
}

#[rstest]
#[case::hello(hello())]
#[case::xfer_request(xfer_request())]
#[case::xfer_reply(xfer_reply())]
fn truncated_at_every_offset_is_an_error(#[case] msg: SideMessage) {
    let bytes = encode(&msg);
    let codec = FrameCodec::default();
    for cut in 0..bytes.len() {
        let mut buf = BytesMut::from(&bytes[..cut]);
        assert_eq!(codec.decode(&mut buf), Ok(None), "cut at {cut} must wait for more");
        if cut > 0 {
            assert!(
                matches!(codec.decode_eof(&mut buf), Err(FrameError::Truncated { .. })),
                "cut at {cut} must be truncated at end of stream"
            );
        }
        assert!(codec.decode_exact(&bytes[..cut]).is_err(), "cut at {cut}");
    }
}

#[test]
fn oversized_length_is_refused_before_buffering() {
    let codec = FrameCodec::new(1024);
    let mut header = BytesMut::new();
    header.extend_from_slice(b"KVLK");
    header.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    header.extend_from_slice(&0u16.to_be_bytes());
    header.extend_from_slice(&u32::MAX.to_be_bytes());
    assert_eq!(codec.decode(&mut header), Err(FrameError::TooLarge { len: u32::MAX as usize, max: 1024 }));
    assert!(header.capacity() < 1 << 20, "nothing reserved for the claimed length");
}

#[test]
fn oversized_message_is_refused_on_encode() {
    let codec = FrameCodec::new(64);
    let mut buf = BytesMut::new();
    assert!(matches!(codec.encode(&xfer_request(), &mut buf), Err(FrameError::TooLarge { .. })));
    assert!(buf.is_empty());
}

#[test]
fn bad_magic_is_refused_from_the_first_byte() {
    let codec = FrameCodec::default();
    let mut buf = BytesMut::from(&b"G"[..]);
    assert!(matches!(codec.decode(&mut buf), Err(FrameError::BadMagic { .. })));
    let mut bytes = encode(&hello());
    bytes[3] = b'X';
    assert!(matches!(codec.decode_exact(&bytes), Err(FrameError::BadMagic { .. })));
}

#[test]
fn bad_version_and_reserved_are_refused() {
    let codec = FrameCodec::default();
    let mut bytes = encode(&hello());
    bytes[5] = bytes[5].wrapping_add(1);
    assert_eq!(codec.decode_exact(&bytes), Err(FrameError::BadVersion { got: PROTOCOL_VERSION + 1 }));
    let mut bytes = encode(&hello());
    bytes[7] = 1;
    assert_eq!(codec.decode_exact(&bytes), Err(FrameError::BadReserved(1)));
}

#[test]
fn trailing_bytes_inside_a_frame_are_refused() {
    let mut bytes = encode(&hello());
    bytes.push(0);
    let len = u32::from_be_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) + 1;
    bytes[8..12].copy_from_slice(&len.to_be_bytes());
    assert!(matches!(FrameCodec::default().decode_exact(&bytes), Err(FrameError::Codec(_))));
}

#[test]
fn huge_claimed_collection_inside_a_small_frame_is_refused() {
    // A body claiming a request list of 2^60 entries must fail fast, not allocate.
    let mut body = vec![2u8]; // variant XferRequest
    body.push(0); // xfer_id varint 0
    body.extend_from_slice(&[0, 0, 0]); // endpoint protocol, empty address, empty details
    body.extend_from_slice(&[253]); // u64 varint marker for region_base_addrs length
    body.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let mut frame = BytesMut::new();
    frame.extend_from_slice(b"KVLK");
    frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    frame.extend_from_slice(&0u16.to_be_bytes());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    assert!(FrameCodec::default().decode_exact(&frame).is_err());
}

fn many_requests(count: usize, id_len: usize) -> XferRequest {
    XferRequest {
        xfer_id: 1,
        endpoint: Endpoint { protocol: Protocol::Tcp, address: "h:1".into(), details: vec![] },
        grant: Grant::plain(GrantId::from_bytes([0; 16])),
        wait_budget: Duration::from_secs(1),
        region_base_addrs: vec![],
        requests: (0..count)
            .map(|i| RequestBlocks {
                req_id: ReqId::new(format!("{i:0id_len$}")),
                decode_req_id: None,
                prefill_engine_id: None,
                block_ids: vec![],
                first_token: None,
                may_precede_prefill: false,
            })
            .collect(),
        heads: None,
        piece_blocks: 0,
    }
}

#[test]
fn element_counts_are_bounded_while_decoding() {
    let codec = FrameCodec::new(64 << 20);
    let at_limit = SideMessage::XferRequest(many_requests(MAX_REQUESTS_PER_TRANSFER, 1));
    assert_eq!(codec.decode_exact(&encode_with(&codec, &at_limit)).unwrap(), at_limit);
    let over = SideMessage::XferRequest(many_requests(MAX_REQUESTS_PER_TRANSFER + 1, 1));
    assert!(matches!(codec.decode_exact(&encode_with(&codec, &over)), Err(FrameError::Codec(_))));
    let long_id = SideMessage::XferRequest(many_requests(1, MAX_TEXT_LEN + 1));
    assert!(matches!(codec.decode_exact(&encode_with(&codec, &long_id)), Err(FrameError::Codec(_))));
}

#[test]
fn a_reply_never_exceeds_its_bound() {
    let request = many_requests(100, 40);
    let reply = SideMessage::XferReply(XferReply {
        xfer_id: u64::MAX,
        outcomes: request
            .requests
            .iter()
            .map(|r| RequestOutcome {
                req_id: r.req_id.clone(),
                outcome: Outcome::Failed { cause: FailureCause::Other, reason: "é".repeat(MAX_TEXT_LEN / 2) },
            })
            .collect(),
    });
    let encoded = encode(&reply);
    assert!(encoded.len() - FRAME_HEADER_LEN <= request.reply_bound(), "{} > {}", encoded.len(), request.reply_bound());
}

fn encode_with(codec: &FrameCodec, msg: &SideMessage) -> Vec<u8> {
    let mut buf = BytesMut::new();
    codec.encode(msg, &mut buf).unwrap();
    buf.to_vec()
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let codec = FrameCodec::default();
        let mut buf = BytesMut::from(&bytes[..]);
        while let Ok(Some(_)) = codec.decode(&mut buf) {}
        let _ = codec.decode_exact(&bytes);
    }

    #[test]
    fn random_bodies_behind_a_valid_header_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
        frame.extend_from_slice(b"KVLK");
        frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
        frame.extend_from_slice(&0u16.to_be_bytes());
        frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
        frame.extend_from_slice(&body);
        let _ = FrameCodec::default().decode_exact(&frame);
    }

    #[test]
    fn transfer_requests_round_trip(
        xfer_id in any::<u64>(),
        grant in any::<[u8; 16]>(),
        budget_ms in any::<u32>(),
        addrs in proptest::collection::vec(any::<u64>(), 0..8),
        reqs in proptest::collection::vec(("[a-z0-9-]{1,12}", proptest::collection::vec(any::<u32>(), 0..16), any::<Option<u64>>()), 0..8),
        heads in any::<Option<(u32, u32)>>(),
        piece_blocks in any::<u32>(),
    ) {
        let msg = SideMessage::XferRequest(XferRequest {
            xfer_id,
            endpoint: Endpoint { protocol: Protocol::Tcp, address: "h:1".into(), details: vec![] },
            grant: Grant::plain(GrantId::from_bytes(grant)),
            wait_budget: Duration::from_millis(u64::from(budget_ms)),
            region_base_addrs: addrs,
            requests: reqs.into_iter().map(|(id, block_ids, first_token)| RequestBlocks { req_id: ReqId::new(id), decode_req_id: None, prefill_engine_id: None, block_ids, first_token, may_precede_prefill: false }).collect(),
            heads: heads.map(|(first, count)| kv_proto::HeadRange::new(first, count)),
            piece_blocks,
        });
        prop_assert_eq!(FrameCodec::default().decode_exact(&encode(&msg)).unwrap(), msg);
    }
}
