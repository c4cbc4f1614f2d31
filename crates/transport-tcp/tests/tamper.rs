//! Bytes altered after the data plane's authenticated handshake: a relay
//! between two transports holding the same secret lets the handshake
//! through, then flips one bit of the first batch (its header, an op's
//! destination, the op list's tag) or of the receiver's reply. Each ends
//! the connection; an altered header or op list lands nothing (without the
//! tags, the altered destination would put the payload 4 bytes off). The
//! same relay passing every byte through changes nothing. An altered
//! payload byte fails the batch and closes the connection with
//! `authenticate_payloads`, and lands without it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;

use common::node;
use kv_proto::auth::AuthSecret;
use kv_proto::session::FRAME_TAG_LEN;
use kv_proto::{BatchWriter, Endpoint, TransportError};
use rstest::rstest;
use test_support::pattern::{check, covering, fill, packed_ops};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use transport_tcp::wire::{ACCEPT_LEN, AUTH_TAG_LEN, BATCH_HEADER_LEN, CHALLENGE_LEN, OP_LEN, PREAMBLE_LEN};
use transport_tcp::TcpConfig;

/// The sender's handshake: preamble, nonce, proof.
const SENDER_HANDSHAKE: usize = PREAMBLE_LEN + 2 * AUTH_TAG_LEN;
/// The receiver's handshake: accept reply, challenge, verdict.
const RECEIVER_HANDSHAKE: usize = ACCEPT_LEN + CHALLENGE_LEN + 1;
/// Where the first batch's op list starts in the sender's stream.
const OP_LIST: usize = SENDER_HANDSHAKE + BATCH_HEADER_LEN + FRAME_TAG_LEN;

/// Which byte of which direction's stream the relay flips (bit mask).
#[derive(Clone, Copy, Debug)]
enum Tamper {
    Nothing,
    /// Byte `at` of what the sender sends.
    SenderByte {
        at: usize,
        mask: u8,
    },
    /// Byte `at` of what the receiver sends.
    ReceiverByte {
        at: usize,
        mask: u8,
    },
}

async fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, flip: Option<(usize, u8)>) {
    let mut offset = 0;
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((at, mask)) = flip {
            if (offset..offset + n).contains(&at) {
                chunk[at - offset] ^= mask;
            }
        }
        offset += n;
        if to.write_all(&chunk[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// A relay in front of `receiver` applying `tamper` to every connection.
async fn relay(receiver: SocketAddr, tamper: Tamper) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((sender, _)) = listener.accept().await {
            let receiver = TcpStream::connect(receiver).await.unwrap();
            let (s_read, s_write) = sender.into_split();
            let (r_read, r_write) = receiver.into_split();
            let (to_receiver, to_sender) = match tamper {
                Tamper::Nothing => (None, None),
                Tamper::SenderByte { at, mask } => (Some((at, mask)), None),
                Tamper::ReceiverByte { at, mask } => (None, Some((at, mask))),
            };
            tokio::spawn(forward(s_read, r_write, to_receiver));
            tokio::spawn(forward(r_read, s_write, to_sender));
        }
    });
    addr
}

fn config() -> TcpConfig {
    TcpConfig { auth_secret: Some(AuthSecret::new("shared secret")), ..TcpConfig::default() }
}

#[rstest]
#[case::relayed_untouched(Tamper::Nothing)]
#[case::the_batch_id(Tamper::SenderByte { at: SENDER_HANDSHAKE, mask: 0x01 })]
#[case::the_header_tag(Tamper::SenderByte { at: SENDER_HANDSHAKE + BATCH_HEADER_LEN, mask: 0x01 })]
#[case::an_ops_destination(Tamper::SenderByte { at: OP_LIST + 16, mask: 0x04 })]
#[case::the_op_list_tag(Tamper::SenderByte { at: OP_LIST + 4 * 16 + FRAME_TAG_LEN - 1, mask: 0x80 })]
#[case::the_replys_status(Tamper::ReceiverByte { at: RECEIVER_HANDSHAKE + 8, mask: 0x01 })]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_altered_after_the_handshake_ends_the_connection(#[case] tamper: Tamper) {
    let receiver = node(config(), 4 * 64).await;
    let mut sender = node(config(), 4 * 64).await;
    let batch = packed_ops(&sender.buf, &receiver.buf, 4, 64);
    fill(&mut sender.buf, &batch);
    let grant = receiver.grant(&covering(&batch)).await;
    let via = relay(receiver.transport.local_addr(), tamper).await;
    let endpoint = Endpoint { address: via.to_string(), ..receiver.transport.endpoint() };
    let written = sender.transport.batch_write(&endpoint, &grant, &batch).await;
    match tamper {
        Tamper::Nothing => {
            written.unwrap();
            check(&receiver.buf, &batch);
        }
        Tamper::SenderByte { .. } => {
            let error = written.expect_err("an altered batch was taken");
            assert!(
                matches!(error, TransportError::PeerClosed { .. } | TransportError::Io { .. }),
                "the receiver closes the connection, without a reply: {error:?}"
            );
            receiver.transport.revoke(&grant.id).await;
            assert!(receiver.buf.bytes().iter().all(|&b| b == 0), "bytes landed after {tamper:?}");
        }
        Tamper::ReceiverByte { .. } => {
            let error = written.expect_err("an altered reply was believed");
            assert!(error.to_string().contains("authentication tag"), "{error}");
        }
    }
    // The side that read the altered frame counted it, before it closed
    // the connection or gave up on the batch.
    let counted = |altered: bool| u64::from(altered);
    let tag_failures = |node: &common::Node| node.transport.stats().tag_failures;
    assert_eq!(tag_failures(&receiver), counted(matches!(tamper, Tamper::SenderByte { .. })), "{tamper:?}");
    assert_eq!(tag_failures(&sender), counted(matches!(tamper, Tamper::ReceiverByte { .. })), "{tamper:?}");
    // The receiver keeps serving: the same batch, straight to it.
    let grant = receiver.grant(&covering(&batch)).await;
    sender.transport.batch_write(&receiver.transport.endpoint(), &grant, &batch).await.unwrap();
    check(&receiver.buf, &batch);
}

/// Where the first batch's payload starts in the sender's stream (after its
/// `ops` ops and the op list's tag).
const fn payload_start(ops: usize) -> usize {
    OP_LIST + ops * OP_LEN + FRAME_TAG_LEN
}

/// One payload byte flipped on the path after the handshake. With
/// `authenticate_payloads` the receiver checks the payload's tag over the
/// bytes as they landed: the batch fails, the connection closes, the
/// failure is counted, and what landed stayed inside the grant (the puller
/// reports those blocks failed after revoking it). Without it the altered
/// byte lands and the batch succeeds: payloads are not authenticated unless
/// asked for. The large payload spans several of the tag's hashed blocks
/// (64 KiB), the byte in a later one.
#[rstest]
#[case::tagged(true, 4, 64, 70)]
#[case::untagged(false, 4, 64, 70)]
#[case::tagged_large(true, 16, 16 * 1024, 3 * 64 * 1024 + 123)]
#[case::untagged_large(false, 16, 16 * 1024, 3 * 64 * 1024 + 123)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_byte_altered_after_the_handshake(
    #[case] tagged: bool,
    #[case] ops: usize,
    #[case] op_len: usize,
    #[case] at: usize,
) {
    let config = TcpConfig { authenticate_payloads: tagged, ..config() };
    let payload = ops * op_len;
    // The grant covers the first half of the receiver's buffer.
    let receiver = node(config.clone(), 2 * payload).await;
    let mut sender = node(config, payload).await;
    let batch = packed_ops(&sender.buf, &receiver.buf, ops, op_len);
    fill(&mut sender.buf, &batch);
    let grant = receiver.grant(&covering(&batch)).await;
    let mask = 0x10;
    let via = relay(receiver.transport.local_addr(), Tamper::SenderByte { at: payload_start(ops) + at, mask }).await;
    let endpoint = Endpoint { address: via.to_string(), ..receiver.transport.endpoint() };
    let written = sender.transport.batch_write(&endpoint, &grant, &batch).await;
    receiver.transport.revoke(&grant.id).await;
    let landed = receiver.buf.bytes();
    assert!(landed[payload..].iter().all(|&b| b == 0), "bytes landed outside the grant");
    let sent = sender.buf.bytes()[at];
    if tagged {
        let error = written.expect_err("an altered payload was taken");
        assert!(
            matches!(error, TransportError::PeerClosed { .. } | TransportError::Io { .. }),
            "the receiver closes the connection, without a reply: {error:?}"
        );
    } else {
        written.expect("without payload tags the altered batch is taken");
        assert_eq!(landed[at], sent ^ mask, "the altered byte landed");
    }
    assert_eq!(receiver.transport.stats().tag_failures, u64::from(tagged));
    // The receiver keeps serving: the same batch, straight to it.
    let grant = receiver.grant(&covering(&batch)).await;
    sender.transport.batch_write(&receiver.transport.endpoint(), &grant, &batch).await.unwrap();
    check(&receiver.buf, &batch);
}

/// Tagged payloads, split over several connections (each part's payload
/// tagged on its own), land whole; a receiver that requires them refuses a
/// sender that does not tag; and they need a secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tagged_payloads_are_required_and_need_a_secret() {
    let tagged = TcpConfig { authenticate_payloads: true, parallel_min_bytes: 1024, ..config() };
    let receiver = node(tagged.clone(), 64 * 1024).await;
    let mut sender = node(tagged, 64 * 1024).await;
    let batch = packed_ops(&sender.buf, &receiver.buf, 16, 4096);
    fill(&mut sender.buf, &batch);
    let grant = receiver.grant(&covering(&batch)).await;
    sender.transport.batch_write(&receiver.transport.endpoint(), &grant, &batch).await.unwrap();
    check(&receiver.buf, &batch);

    let plain = node(config(), 64 * 1024).await;
    let plain_batch = packed_ops(&plain.buf, &receiver.buf, 16, 4096);
    let error = plain.transport.batch_write(&receiver.transport.endpoint(), &grant, &plain_batch).await.unwrap_err();
    assert!(error.to_string().contains("authenticated payloads"), "{error}");

    let unkeyed = TcpConfig { authenticate_payloads: true, ..TcpConfig::default() };
    let error = transport_tcp::TcpTransport::bind(unkeyed).await.unwrap_err();
    assert!(error.to_string().contains("auth_secret"), "{error}");
}
