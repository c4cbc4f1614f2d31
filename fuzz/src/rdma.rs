//! `rdma_control`: arbitrary bytes as what an RDMA peer sends over its TCP
//! connection (the handshake, then the control channel) and in its
//! endpoint details.

use std::future::Future;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use transport_rdma::control::{
    self, decode_reply, decode_request, encode_reply, encode_request, ControlError, ControlLimits, Reply,
    REPLY_HEADER_LEN, REQUEST_LEN,
};
use transport_rdma::details::{self, DetailsError, EndpointDetails};
use transport_rdma::handshake::codec::{self, HEADER_LEN};
use transport_rdma::handshake::exchange::read_message;
use transport_rdma::handshake::{HandshakeError, HandshakeLimits};
use transport_rdma::tags::FrameTags;

use crate::alloc_meter;

/// Heap a read may take beyond four bytes per input byte: one body chunk
/// (64 KiB, buffered ahead of its bytes, twice while the buffer grows) and
/// small fixed costs.
const READ_SLACK: usize = 3 * 64 * 1024;

/// Runs a future that never waits (its reader is a byte slice).
fn ready<F: Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    match future.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("a read from a byte slice waited"),
    }
}

fn control_limits(choice: u8) -> ControlLimits {
    // The transport's default bound, and small ones an input can reach.
    let max_windows = match choice & 3 {
        0 => 0,
        1 => 8,
        2 => 4096,
        _ => 1 << 20,
    };
    ControlLimits { max_windows }
}

/// The control replies a sender reads, one after the other.
fn replies(choice: u8, mut bytes: &[u8]) {
    let limits = control_limits(choice);
    while !bytes.is_empty() {
        let before = bytes;
        let (read, heap) =
            alloc_meter::measure(|| ready(control::read_reply(&mut bytes, &limits, &mut FrameTags::none())));
        let consumed = before.len() - bytes.len();
        let bound = 4 * consumed + READ_SLACK;
        assert!(heap <= bound, "reading a reply from {consumed} bytes took {heap} bytes of heap");
        match read {
            Ok(reply) => {
                // `read_reply` is the header, then `decode_reply` on the whole message.
                let message = &before[..consumed];
                match decode_reply(message, &limits) {
                    Ok(same) => assert_eq!(same, reply),
                    Err(e) => panic!("read_reply accepted a reply decode_reply refuses: {e}"),
                }
                let mut again = Vec::new();
                if let Err(e) = encode_reply(&reply, &limits, &mut again) {
                    panic!("a decoded reply does not re-encode: {e}");
                }
                match decode_reply(&again, &limits) {
                    Ok(back) => assert_eq!(back, reply, "a re-encoded reply decodes differently"),
                    Err(e) => panic!("a re-encoded reply does not decode: {e}"),
                }
                // Windows come back sorted; everything else byte for byte.
                if !matches!(reply, Reply::Windows(_)) {
                    assert_eq!(again, message, "a reply does not re-encode to its bytes");
                }
                assert_eq!(again.len(), consumed);
            }
            Err(ControlError::PeerClosed) => {
                assert!(bytes.is_empty());
                return;
            }
            Err(_) => {
                assert!(consumed >= REPLY_HEADER_LEN, "a reply was refused before its header was there");
                return;
            }
        }
    }
}

/// The control requests a receiver reads.
fn requests(mut bytes: &[u8]) {
    loop {
        let before = bytes;
        match ready(control::read_request(&mut bytes, &mut FrameTags::none())) {
            Ok(None) => {
                assert!(before.is_empty());
                return;
            }
            Ok(Some(request)) => {
                let message = &before[..REQUEST_LEN];
                assert_eq!(decode_request(message).ok(), Some(request));
                let mut again = Vec::new();
                encode_request(&request, &mut again);
                assert_eq!(again, message, "a request does not re-encode to its bytes");
            }
            Err(_) => return,
        }
    }
}

fn handshake_limits(choice: u8) -> HandshakeLimits {
    // The receiver reads a sender's with none (a sender offers no
    // regions), a sender the receiver's with the default.
    let max_regions = match choice & 3 {
        0 => 0,
        1 => 8,
        _ => HandshakeLimits::default().max_regions,
    };
    HandshakeLimits { max_regions, timeout: Duration::from_secs(10) }
}

/// A peer's handshake message, as `exchange` reads it.
fn handshake(choice: u8, bytes: &[u8]) {
    let limits = handshake_limits(choice);
    let mut reader = bytes;
    let (read, heap) = alloc_meter::measure(|| ready(read_message(&mut reader, &limits, &mut FrameTags::none())));
    let consumed = bytes.len() - reader.len();
    let claimed = HEADER_LEN + limits.max_regions as usize * codec::REGION_LEN;
    let bound = 4 * claimed.min(consumed + claimed) + 64 * 1024;
    assert!(heap <= bound, "reading a handshake from {consumed} bytes took {heap} bytes of heap");
    match read {
        Ok(info) => {
            let message = &bytes[..consumed];
            match codec::decode(message, &limits) {
                Ok(same) => assert_eq!(same, info),
                Err(e) => panic!("read_message accepted a message decode refuses: {e}"),
            }
            assert!(info.regions.len() <= limits.max_regions as usize);
            assert!(info.qp.qpn >= 2 && info.qp.qpn < 1 << 24 && info.qp.psn < 1 << 24);
            let mut again = Vec::new();
            if let Err(e) = codec::encode(&info, &limits, &mut again) {
                panic!("an accepted handshake does not re-encode: {e}");
            }
            assert_eq!(again, message, "a handshake does not re-encode to its bytes");
        }
        Err(HandshakeError::PeerClosed) => assert!(reader.is_empty()),
        Err(e) => {
            assert!(
                codec::decode(&bytes[..consumed], &limits).is_err(),
                "read_message refused ({e}) what decode accepts"
            );
        }
    }
}

/// An RDMA endpoint's details, as a sender decodes them.
fn endpoint_details(bytes: &[u8]) {
    match EndpointDetails::decode(bytes) {
        Ok(decoded) => assert_eq!(decoded.encode(), bytes, "details do not re-encode to their bytes"),
        Err(DetailsError::Length(len)) => assert!(len == bytes.len() && len != details::LEN),
        Err(DetailsError::BadMagic(magic)) => {
            assert_eq!(bytes.get(..4), Some(&magic[..]));
            assert_ne!(magic, details::MAGIC);
        }
        Err(DetailsError::UnsupportedVersion { got, .. }) => assert_ne!(got, details::VERSION),
        Err(DetailsError::UnknownFlags(flags)) => assert_ne!(flags, 0),
    }
}

/// Arbitrary bytes through the RDMA transport's decoders of peer input
/// (pure Rust, built without the verbs layer).
///
/// Input: one byte choosing the decoder (and its limits), then its bytes.
/// Checks:
/// - control replies read with `read_reply` (the sender's read) agree with
///   `decode_reply` on the same bytes, re-encode and decode the same
///   (windows sorted, everything else byte for byte); the heap a read takes
///   is at most four times the bytes it consumed plus a body chunk, however
///   many windows the header claims; a reply is refused only once its header
///   is there;
/// - control requests read with `read_request` re-encode to their bytes;
/// - a handshake read with `read_message` (the half of `exchange` that
///   reads) agrees with `decode`, keeps its limits (region count, 24-bit
///   QPN and PSN) and re-encodes to its bytes;
/// - endpoint details decode only as 16 bytes with magic, version and no
///   flags, and re-encode to their bytes.
pub fn rdma_control(data: &[u8]) {
    let Some((&choice, rest)) = data.split_first() else { return };
    match choice % 4 {
        0 => replies(choice / 4, rest),
        1 => requests(rest),
        2 => handshake(choice / 4, rest),
        _ => endpoint_details(rest),
    }
}
