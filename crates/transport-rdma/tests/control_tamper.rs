//! After an authenticated opening, every later control frame carries its
//! tag: a relay between sender and receiver that flips one byte of a later
//! frame (the queue-pair exchange, an "open grant" request, a reply, or a
//! tag) makes the side that reads it refuse the frame before acting on it,
//! and the connection ends. Device-free: the opening, the exchange and the
//! control codec the transport runs, over an in-process pipe.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kv_proto::auth::AuthSecret;
use kv_proto::GrantId;
use rstest::rstest;
use tokio::io::{duplex, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use transport_rdma::control::{self, ControlError, ControlLimits, Reply, Request};
use transport_rdma::handshake::{self, opening, ConnectionInfo, HandshakeError, HandshakeLimits, QpEndpoint};
use transport_rdma::region::{RegionTable, RemoteRegion};
use transport_rdma::tags::FrameTags;

const SECRET: &str = "the data-plane secret";
const LIMITS: ControlLimits = ControlLimits { max_windows: 16 };
/// The grants the sender opens, in order.
fn grants() -> [GrantId; 2] {
    [GrantId::from_bytes([1; 16]), GrantId::from_bytes([2; 16])]
}

/// Bytes of the opening each way with a secret: preamble and nonce, then
/// the proof (sender); accept, challenge, verdict (receiver).
const SENDER_OPENING: usize = opening::OPENING_LEN + 32 + 32;
const RECEIVER_OPENING: usize = opening::OPENING_LEN + 64 + 1;
/// A queue-pair message without regions (the handshake's wire format).
const EXCHANGE: usize = 36;
const TAG: usize = kv_proto::session::FRAME_TAG_LEN;

fn info(qpn: u32) -> ConnectionInfo {
    ConnectionInfo { qp: QpEndpoint { gid: [qpn as u8; 16], qpn, psn: qpn }, regions: Vec::new() }
}

fn windows(grant: GrantId) -> RegionTable<RemoteRegion> {
    let base = 0x7f00_0000_0000 + u64::from(grant.to_bytes()[0]) * 0x10_0000;
    RegionTable::new(vec![RemoteRegion { addr: base, len: 0x8000, rkey: 0x1234 }]).unwrap()
}

fn handshake_limits() -> HandshakeLimits {
    HandshakeLimits { max_regions: 0, ..HandshakeLimits::default() }
}

/// Copies `from` to `to`, flipping the lowest bit of the byte at offset
/// `flip` (counted from the start of the stream); closes `to` at the end.
async fn relay(mut from: impl AsyncRead + Unpin, mut to: impl AsyncWrite + Unpin, flip: Option<usize>) {
    let mut at = 0usize;
    let mut buf = [0u8; 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(offset) = flip.and_then(|f| f.checked_sub(at)).filter(|o| *o < n) {
            buf[offset] ^= 1;
        }
        at += n;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// What the receiver did: the grants it opened, and how it ended.
#[derive(Debug)]
struct Served {
    opened: Vec<GrantId>,
    end: Result<(), String>,
}

/// The receiver's side of a control connection, as the transport runs it:
/// opening, exchange, then requests answered until the sender closes.
async fn receiver(mut stream: DuplexStream, secret: Option<&AuthSecret>) -> Served {
    let mut opened = Vec::new();
    let end = async {
        let ((), mut tags) = opening::server(&mut stream, secret, || Some(())).await.map_err(|e| e.to_string())?;
        handshake::exchange(&mut stream, &info(0x20), &handshake_limits(), &mut tags)
            .await
            .map_err(|e| format!("exchange: {e:?}"))?;
        loop {
            match control::read_request(&mut stream, &mut tags).await {
                Ok(None) => return Ok(()),
                Ok(Some(Request::Open(grant))) => {
                    opened.push(grant);
                    let mut bytes = Vec::new();
                    control::encode_reply(&Reply::Windows(windows(grant)), &LIMITS, &mut bytes).unwrap();
                    tags.seal(&mut bytes, 0);
                    stream.write_all(&bytes).await.map_err(|e| e.to_string())?;
                }
                Err(err) => return Err(format!("request: {err:?}")),
            }
        }
    }
    .await;
    Served { opened, end }
}

/// What the sender got: the windows of each grant it opened, and how it ended.
#[derive(Debug)]
struct Sent {
    windows: Vec<RegionTable<RemoteRegion>>,
    end: Result<(), String>,
}

/// The sender's side: opening, exchange, then one request per grant.
async fn sender(mut stream: DuplexStream, secret: Option<&AuthSecret>) -> Sent {
    let mut got = Vec::new();
    let end = async {
        let mut tags = opening::client(&mut stream, secret).await.map_err(|e| e.to_string())?;
        handshake::exchange(&mut stream, &info(0x10), &handshake_limits(), &mut tags)
            .await
            .map_err(|e| format!("exchange: {e:?}"))?;
        for grant in grants() {
            let mut bytes = Vec::new();
            control::encode_request(&Request::Open(grant), &mut bytes);
            tags.seal(&mut bytes, 0);
            stream.write_all(&bytes).await.map_err(|e| e.to_string())?;
            match control::read_reply(&mut stream, &LIMITS, &mut tags).await {
                Ok(Reply::Windows(table)) => got.push(table),
                Ok(other) => return Err(format!("reply: {other:?}")),
                Err(err) => return Err(format!("reply: {err:?}")),
            }
        }
        Ok(())
    }
    .await;
    drop(stream);
    Sent { windows: got, end }
}

/// Runs both sides through a relay that flips the byte at `to_receiver` of
/// the sender's stream, or at `to_sender` of the receiver's.
async fn run(secret: Option<&str>, to_receiver: Option<usize>, to_sender: Option<usize>) -> (Sent, Served) {
    let secret = secret.map(AuthSecret::new);
    let (sender_end, relay_sender) = duplex(64 * 1024);
    let (relay_receiver, receiver_end) = duplex(64 * 1024);
    let (from_sender, to_sender_half) = tokio::io::split(relay_sender);
    let (from_receiver, to_receiver_half) = tokio::io::split(relay_receiver);
    let forward = tokio::spawn(relay(from_sender, to_receiver_half, to_receiver));
    let backward = tokio::spawn(relay(from_receiver, to_sender_half, to_sender));
    let (sent, served) = tokio::join!(sender(sender_end, secret.as_ref()), receiver(receiver_end, secret.as_ref()));
    forward.await.unwrap();
    backward.await.unwrap();
    (sent, served)
}

#[tokio::test]
async fn untouched_frames_go_through_with_and_without_a_secret() {
    for secret in [Some(SECRET), None] {
        let (sent, served) = run(secret, None, None).await;
        assert_eq!(sent.end, Ok(()), "{secret:?}");
        assert_eq!(served.end, Ok(()), "{secret:?}");
        assert_eq!(served.opened, grants().to_vec());
        assert_eq!(sent.windows, vec![windows(grants()[0]), windows(grants()[1])]);
    }
}

/// Where in the sender's stream a byte is flipped, and how many requests the
/// receiver acts on before it refuses the frame.
#[rstest]
#[case::exchange_message(SENDER_OPENING + 30, 0)]
#[case::exchange_tag(SENDER_OPENING + EXCHANGE + 3, 0)]
#[case::first_request(SENDER_OPENING + EXCHANGE + TAG + 10, 0)]
#[case::first_request_tag(SENDER_OPENING + EXCHANGE + TAG + control::REQUEST_LEN, 0)]
#[case::second_request(SENDER_OPENING + EXCHANGE + TAG + (control::REQUEST_LEN + TAG) + 8, 1)]
#[tokio::test]
async fn a_flipped_byte_from_the_sender_ends_the_connection(#[case] at: usize, #[case] acted_on: usize) {
    let (sent, served) = run(Some(SECRET), Some(at), None).await;
    let refusal = served.end.expect_err("the receiver accepted an altered frame");
    assert!(refusal.contains("BadTag"), "{refusal}");
    assert_eq!(served.opened, grants()[..acted_on].to_vec(), "the receiver acted on an altered request");
    assert!(sent.end.is_err(), "the sender went on after its connection ended");
}

/// Where in the receiver's stream a byte is flipped, and how many answers
/// the sender takes before it refuses the frame.
#[rstest]
#[case::exchange_message(RECEIVER_OPENING + 20, 0)]
#[case::first_reply(RECEIVER_OPENING + EXCHANGE + TAG + control::REPLY_HEADER_LEN + 2, 0)]
#[case::first_reply_tag(RECEIVER_OPENING + EXCHANGE + TAG + control::REPLY_HEADER_LEN + control::WINDOW_LEN + 5, 0)]
#[case::second_reply(
    RECEIVER_OPENING + EXCHANGE + TAG + (control::REPLY_HEADER_LEN + control::WINDOW_LEN + TAG) + 13,
    1
)]
#[tokio::test]
async fn a_flipped_byte_from_the_receiver_ends_the_connection(#[case] at: usize, #[case] taken: usize) {
    let (sent, served) = run(Some(SECRET), None, Some(at)).await;
    let refusal = sent.end.expect_err("the sender accepted an altered frame");
    assert!(refusal.contains("BadTag"), "{refusal}");
    assert_eq!(sent.windows.len(), taken, "the sender took an altered answer");
    let _ = served;
}

/// Without a secret nothing is tagged: the same flip in a request's grant id
/// goes through and the receiver opens another grant than the one asked
/// for (what the tags are there to stop).
#[tokio::test]
async fn without_a_secret_a_flipped_request_goes_through() {
    let preamble = opening::OPENING_LEN;
    let (_, served) = run(None, Some(preamble + EXCHANGE + 8), None).await;
    assert_eq!(served.end, Ok(()));
    assert_eq!(served.opened.len(), 2);
    assert_ne!(served.opened[0], grants()[0], "the flip did not land in the grant id");
}

/// The error kinds the readers give for a failed tag.
#[test]
fn a_failed_tag_reads_as_such() {
    let bad = kv_proto::session::BadTag { seq: 3 };
    assert!(ControlError::from(bad).to_string().contains("failed its authentication tag"));
    assert!(HandshakeError::from(bad).to_string().contains("failed its authentication tag"));
    assert!(!FrameTags::none().is_on());
}
