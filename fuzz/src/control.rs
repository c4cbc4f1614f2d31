//! `bench_control`: arbitrary bytes as a bench control connection (between
//! `kvlink serve` and `kvlink bench --connect`), read by either side.

use bytes::BytesMut;
use kvlink::control::{
    check_shape, codec, decode_client_msg, decode_server_msg, handshake_codec, ClientMsg, ServerMsg, MAX_FRAME_LEN,
    MAX_HANDSHAKE_FRAME_LEN, MAX_REGIONS,
};
use serde::Serialize;
use serde_json::Value;
use tokio_util::codec::Decoder;

use crate::alloc_meter;

/// Heap bytes per frame byte a decoded message may take (the densest JSON,
/// `[[],[],…]` as `Vec<Vec<u32>>` or `{}`s as `Value`s, takes about 11
/// bytes per input byte, twice that while a vector doubles).
const BYTES_PER_FRAME_BYTE: usize = 48;
/// Heap one decode may take beyond that.
const DECODE_SLACK: usize = 64 * 1024;
/// Largest cache a server accepts in this target (bytes).
const MAX_CACHE_BYTES: u64 = 1 << 34;

/// Whether two JSON values are equal, numbers compared as `f64` within a
/// relative 1e-12 (serde_json's default float parsing may be one unit in the
/// last place off on a round trip).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_f64(), y.as_f64()) {
            _ if x == y => true,
            (Some(x), Some(y)) => (x - y).abs() <= 1e-12 * x.abs().max(y.abs()),
            _ => false,
        },
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

fn to_value<T: Serialize>(msg: &T) -> Value {
    match serde_json::to_value(msg) {
        Ok(value) => value,
        Err(e) => panic!("a decoded message does not serialize: {e}"),
    }
}

/// A decoded message re-encodes, and decodes to the same.
fn round_trip<T: Serialize + std::fmt::Debug>(msg: &T, decode: impl Fn(&[u8]) -> Result<T, serde_json::Error>) {
    let text = match serde_json::to_vec(msg) {
        Ok(text) => text,
        Err(e) => panic!("a decoded message does not encode: {e}"),
    };
    match decode(&text) {
        Ok(back) => assert!(same(&to_value(msg), &to_value(&back)), "{msg:?} came back as {back:?}"),
        Err(e) => panic!("a re-encoded message does not decode: {e}\n{msg:?}"),
    }
}

/// What the server checks in a hello before it allocates anything.
fn check_hello(msg: &ClientMsg) {
    if let ClientMsg::Hello { shape, .. } = msg {
        if let Ok(checked) = check_shape((*shape).into(), MAX_CACHE_BYTES) {
            assert!(checked.total_bytes() <= MAX_CACHE_BYTES, "an admitted shape is over the byte bound");
            assert!(checked.region_count() <= MAX_REGIONS, "an admitted shape has too many regions");
            assert!(checked.total_bytes() > 0);
        }
    }
}

/// Arbitrary bytes through a control connection's codec and messages.
///
/// Input: one options byte (bit 0: an established session's codec, else the
/// handshake's; bit 1: the client reads server messages, else the server
/// reads client messages), then the stream. Checks:
/// - no frame over the codec's bound is ever handed out; a claimed length
///   over it is an error before its bytes are buffered; the heap the codec
///   takes is at most two frame buffers beyond the input;
/// - every frame decodes through the receiver's own function
///   (`decode_client_msg` / `decode_server_msg`) within a heap bound
///   proportional to the frame, and what decodes re-encodes and decodes
///   the same;
/// - a hello's shape that `check_shape` admits is within its bounds.
pub fn bench_control(data: &[u8]) {
    let Some((&options, stream)) = data.split_first() else { return };
    let (mut codec, max_frame) =
        if options & 1 != 0 { (codec(), MAX_FRAME_LEN) } else { (handshake_codec(), MAX_HANDSHAKE_FRAME_LEN) };
    let server_reads = options & 2 == 0;
    let mut buf = BytesMut::from(stream);
    loop {
        let (frame, heap) = alloc_meter::measure(|| codec.decode(&mut buf));
        let bound = 2 * (4 + max_frame) + DECODE_SLACK;
        assert!(heap <= bound, "the codec took {heap} bytes of heap (bound {bound})");
        let frame = match frame {
            Ok(Some(frame)) => frame,
            Ok(None) => {
                let _ = codec.decode_eof(&mut buf);
                return;
            }
            Err(_) => return,
        };
        assert!(frame.len() <= max_frame, "a frame of {} bytes over the bound of {max_frame}", frame.len());
        let bound = BYTES_PER_FRAME_BYTE * frame.len() + DECODE_SLACK;
        if server_reads {
            let (msg, heap) = alloc_meter::measure(|| decode_client_msg(&frame));
            assert!(heap <= bound, "decoding a {}-byte frame took {heap} bytes of heap", frame.len());
            if let Ok(msg) = msg {
                check_hello(&msg);
                round_trip(&msg, decode_client_msg);
            }
        } else {
            let (msg, heap) = alloc_meter::measure(|| decode_server_msg(&frame));
            assert!(heap <= bound, "decoding a {}-byte frame took {heap} bytes of heap", frame.len());
            if let Ok(msg) = msg {
                round_trip::<ServerMsg>(&msg, decode_server_msg);
            }
        }
    }
}
