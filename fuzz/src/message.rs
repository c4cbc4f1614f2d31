//! `side_channel_message`: built side-channel messages through the codec.

use arbitrary::Unstructured;
use bytes::BytesMut;
use kv_proto::{
    FrameCodec, FrameError, Outcome, RequestOutcome, SideMessage, XferReply, XferRequest, FRAME_HEADER_LEN,
    MAX_TEXT_LEN,
};

use crate::arb;

/// The largest reply P can send to `request`: every request failed with a
/// reason of the longest length, under the largest `xfer_id`.
fn worst_reply(request: &XferRequest) -> SideMessage {
    let reason = "\u{10ffff}".repeat(MAX_TEXT_LEN / 4);
    SideMessage::XferReply(XferReply {
        xfer_id: u64::MAX,
        outcomes: request
            .requests
            .iter()
            .map(|r| RequestOutcome {
                req_id: r.req_id.clone(),
                outcome: Outcome::Failed { cause: kv_proto::FailureCause::Other, reason: reason.clone() },
            })
            .collect(),
    })
}

/// Bytes of the frame body carrying `msg` (no limit applied).
fn body_len(msg: &SideMessage) -> usize {
    let mut out = BytesMut::new();
    match FrameCodec::new(usize::MAX).encode(msg, &mut out) {
        Ok(()) => out.len() - FRAME_HEADER_LEN,
        Err(e) => panic!("an unlimited codec refused to encode: {e}"),
    }
}

/// Built `SideMessage`s through `FrameCodec` encode and decode.
///
/// Checks: a message within the decoder's bounds that fits the frame limit
/// round-trips unchanged, alone and back to back with a second one; one with
/// a field past its bound (a text over `MAX_TEXT_LEN` bytes, too many
/// elements) is refused by the decoder, never truncated; one over the frame
/// limit is refused by the encoder. For every transfer request,
/// `reply_bound()` is at least the body length of the largest reply P could
/// send to it (checked for requests within the bounds, which are the only
/// ones P ever sees).
pub fn side_channel_message(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let (Ok(limit_choice), Ok(first), Ok(second)) =
        (u.arbitrary::<bool>(), arb::side_message(&mut u), arb::side_message(&mut u))
    else {
        return;
    };
    let codec = if limit_choice { FrameCodec::default() } else { FrameCodec::new(4096) };

    for msg in [&first, &second] {
        let mut frame = BytesMut::new();
        match codec.encode(msg, &mut frame) {
            Ok(()) => {}
            Err(FrameError::TooLarge { len, max }) => {
                assert!(len > max, "encode refused {len} bytes under a limit of {max}");
                continue;
            }
            Err(e) => panic!("encode failed: {e}"),
        }
        let decoded = codec.decode_exact(&frame);
        if arb::within_bounds(msg) {
            match decoded {
                Ok(back) => assert_eq!(&back, msg, "a message changed on its way through the codec"),
                Err(e) => panic!("a message within bounds does not decode: {e}\n{msg:?}"),
            }
        } else {
            assert!(
                matches!(decoded, Err(FrameError::Codec(_))),
                "a message past a decoder bound was not refused: {decoded:?}"
            );
        }
        if let SideMessage::XferRequest(request) = msg {
            if arb::within_bounds(msg) {
                let worst = body_len(&worst_reply(request));
                assert!(worst <= request.reply_bound(), "a reply takes {worst} bytes, reply_bound() says {}", {
                    request.reply_bound()
                });
            }
        }
    }

    // Back to back in one buffer: each frame decodes on its own.
    let mut stream = BytesMut::new();
    let both_fit = codec.encode(&first, &mut stream).is_ok() && codec.encode(&second, &mut stream).is_ok();
    if both_fit && arb::within_bounds(&first) && arb::within_bounds(&second) {
        for expected in [&first, &second] {
            match codec.decode(&mut stream) {
                Ok(Some(msg)) => assert_eq!(&msg, expected),
                other => panic!("back-to-back frames did not decode: {other:?}"),
            }
        }
        assert!(stream.is_empty());
    }
}
