//! What decoding a frame may allocate is bounded by the frame, not by the
//! lengths the frame claims: a 50-byte hello claiming a 240 MiB engine id
//! allocated 240 MiB before the decoder found the bytes missing (found by
//! the `side_channel_frame` fuzz target).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kv_proto::FrameCodec;
use test_support::{largest_allocation, reset_peak_heap};

#[test]
fn a_claimed_string_length_allocates_nothing_before_its_bytes_are_there() {
    let mut frame = Vec::new();
    frame.extend_from_slice(b"KVLK");
    frame.extend_from_slice(&kv_proto::PROTOCOL_VERSION.to_be_bytes());
    frame.extend_from_slice(&[0, 0]);
    let mut body = vec![0u8]; // SideMessage::Hello
    body.extend_from_slice(&[0u8; 32]); // client_nonce
    body.extend_from_slice(&[0xfc, 0x00, 0x00, 0x00, 0x0f]); // engine_id length: 0x0f000000
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    let codec = FrameCodec::default();
    reset_peak_heap();
    let decoded = codec.decode_exact(&frame);
    let largest = largest_allocation();
    assert!(decoded.is_err(), "{decoded:?}");
    assert!(largest < 64 * 1024, "decoding a {}-byte frame allocated {largest} bytes at once", frame.len());
}
