//! `side_channel_frame`: arbitrary bytes as a side-channel stream.

use bytes::BytesMut;
use kv_proto::{FrameCodec, FrameError, SideMessage, DEFAULT_MAX_FRAME_LEN, FRAME_HEADER_LEN};

use crate::alloc_meter;

/// Heap one decode may take beyond the frame buffer and the decoded
/// messages: the largest preallocation a lying element count can cause
/// before the decode fails (bounded vectors preallocate at most 4,096
/// elements, serde's own at most 1 MiB). A lying string length takes
/// nothing: strings are borrowed from the frame, and copied only once their
/// bytes are there and within their bound.
const DECODE_SLACK: usize = 2 << 20;

/// Heap bytes per input byte the decoded messages may take (the densest
/// encoding is two bytes for a 48-byte `RequestBlocks`, and vectors grow by
/// doubling).
const BYTES_PER_INPUT_BYTE: usize = 64;

/// How a stream ended.
#[derive(Debug, PartialEq)]
enum End {
    /// Every byte belonged to a complete frame.
    Clean,
    /// The stream ended inside a frame of which this many bytes arrived.
    Partial(usize),
    /// A frame was refused (stream unusable).
    Refused(FrameError),
}

/// One decoded message and the bytes of the frame that carried it.
struct Decoded {
    msg: SideMessage,
    frame_len: usize,
}

/// The same error however many bytes of the bad frame had arrived: a bad
/// magic is seen from its first wrong byte, so the bytes it shows vary.
fn normalise(err: FrameError) -> FrameError {
    match err {
        FrameError::BadMagic { .. } => FrameError::BadMagic { got: Vec::new() },
        other => other,
    }
}

/// Feeds `chunks` one after the other to `codec`, taking every complete frame
/// after each, then ends the stream.
fn decode_stream<'a>(codec: &FrameCodec, chunks: impl IntoIterator<Item = &'a [u8]>) -> (Vec<Decoded>, End) {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for chunk in chunks {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.len();
            match codec.decode(&mut buf) {
                Ok(Some(msg)) => out.push(Decoded { msg, frame_len: before - buf.len() }),
                Ok(None) => {
                    assert_eq!(buf.len(), before, "a decode that needs more bytes consumed some");
                    break;
                }
                Err(e) => return (out, End::Refused(normalise(e))),
            }
        }
    }
    let left = buf.len();
    match codec.decode_eof(&mut buf) {
        Ok(None) => {
            assert_eq!(left, 0, "decode_eof accepted {left} leftover bytes");
            (out, End::Clean)
        }
        Ok(Some(_)) => panic!("decode_eof found a frame that decode had left"),
        Err(FrameError::Truncated { buffered }) => {
            assert_eq!(buffered, left, "decode_eof miscounted the leftover bytes");
            (out, End::Partial(left))
        }
        Err(e) => panic!("decode_eof failed with {e:?} on leftovers that decode accepted"),
    }
}

/// Chunk lengths from a small deterministic generator seeded by the input.
fn split_points(seed: u16, len: usize) -> Vec<usize> {
    let mut state = u32::from(seed) | 1;
    let mut cuts = Vec::new();
    let mut at = 0;
    while at < len {
        // xorshift32
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let step = match state % 8 {
            0 => 1 + (state >> 8) as usize % 4096,
            _ => 1 + (state >> 8) as usize % 16,
        };
        at = (at + step).min(len);
        cuts.push(at);
    }
    cuts
}

fn codec_for(choice: u8) -> FrameCodec {
    match choice & 3 {
        0 => FrameCodec::new(DEFAULT_MAX_FRAME_LEN),
        1 => FrameCodec::new(64 * 1024),
        2 => FrameCodec::new(1024),
        _ => FrameCodec::new(usize::from(choice >> 2)),
    }
}

/// Arbitrary bytes through the side channel's frame decoder.
///
/// Input: one byte choosing the frame limit, two bytes seeding where the
/// stream is split, then the stream. Checks:
/// - decoding the whole stream at once and in chunks gives the same
///   messages and ends the same way; `decode` consumes nothing when it needs
///   more bytes; `decode_eof` reports exactly the leftover bytes;
/// - decoding the whole stream holds at most two frame buffers plus
///   [`BYTES_PER_INPUT_BYTE`] per input byte plus [`DECODE_SLACK`] of heap,
///   whatever lengths the frame claims (a string's claimed length allocates
///   nothing before its bytes are there);
/// - `decode_exact` accepts the stream exactly when it is one whole frame,
///   and then yields that frame's message;
/// - every decoded message re-encodes with the same limit into a frame no
///   longer than the one it came from (the encoding is minimal), which
///   decodes to the same message.
pub fn side_channel_frame(data: &[u8]) {
    let (choice, seed, stream) = match data {
        [c, s0, s1, rest @ ..] => (*c, u16::from_le_bytes([*s0, *s1]), rest),
        _ => (0, 0, data),
    };
    let codec = codec_for(choice);

    let ((whole, whole_end), heap) = alloc_meter::measure(|| decode_stream(&codec, [stream]));
    let bound = 2 * (FRAME_HEADER_LEN + codec.max_frame_len()) + BYTES_PER_INPUT_BYTE * stream.len() + DECODE_SLACK;
    assert!(heap <= bound, "decoding {} bytes took {heap} bytes of heap (bound {bound})", stream.len());

    let cuts = split_points(seed, stream.len());
    let mut from = 0;
    let chunks = cuts.iter().map(|&to| {
        let chunk = &stream[from..to];
        from = to;
        chunk
    });
    let (split, split_end) = decode_stream(&codec, chunks);
    assert_eq!(whole.len(), split.len(), "whole and chunked decodes disagree on the frame count");
    for (a, b) in whole.iter().zip(&split) {
        assert_eq!(a.msg, b.msg, "whole and chunked decodes disagree");
        assert_eq!(a.frame_len, b.frame_len);
    }
    assert_eq!(whole_end, split_end, "whole and chunked decodes end differently");

    match codec.decode_exact(stream) {
        Ok(msg) => {
            assert!(
                whole_end == End::Clean && whole.len() == 1,
                "decode_exact accepted a stream that is not one frame"
            );
            assert_eq!(msg, whole[0].msg);
        }
        Err(_) => {
            assert!(
                !(whole_end == End::Clean && whole.len() == 1),
                "decode_exact refused a stream of exactly one frame"
            );
        }
    }

    for Decoded { msg, frame_len } in &whole {
        let mut again = BytesMut::new();
        if let Err(e) = codec.encode(msg, &mut again) {
            panic!("a decoded message does not re-encode: {e}");
        }
        assert!(again.len() <= *frame_len, "re-encoded to {} bytes, it arrived in {frame_len}", again.len());
        match codec.decode_exact(&again) {
            Ok(back) => assert_eq!(&back, msg, "re-encoded message decodes differently"),
            Err(e) => panic!("a re-encoded message does not decode: {e}"),
        }
    }
}
