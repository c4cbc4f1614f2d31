//! Bytes altered after the data plane's authenticated handshake: a relay
//! between two transports holding the same secret lets the handshake
//! through, then flips one bit of the first batch (its header, an op's
//! destination, the op list's tag) or of the receiver's reply. Each ends
//! the connection; an altered header or op list lands nothing (without the
//! tags, the altered destination would put the payload 4 bytes off). The
//! same relay passing every byte through changes nothing. An altered
//! payload byte fails the batch and closes the connection with
//! `authenticate_payloads`, and lands without it. A batch the relay
//! injects (a forged copy of a real one) or replays (a real earlier one,
//! sent again later) ends the connection and lands nothing.
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

/// The batches the insertion cases write: `OPS` ops of `OP_BYTES` bytes.
const OPS: usize = 4;
const OP_BYTES: usize = 64;
/// Bytes of one such batch in the sender's stream (untagged payload).
const BATCH: usize = BATCH_HEADER_LEN + FRAME_TAG_LEN + OPS * OP_LEN + FRAME_TAG_LEN + OPS * OP_BYTES;

/// Where batch `nth` (from 0) of `BATCH` bytes starts in the sender's stream.
const fn batch_start(nth: usize) -> usize {
    SENDER_HANDSHAKE + nth * BATCH
}

/// What the relay does to the sender's stream or the receiver's.
#[derive(Clone, Copy, Debug)]
enum Tamper {
    Nothing,
    /// Flips byte `at` of what the sender sends (bit mask).
    SenderByte {
        at: usize,
        mask: u8,
    },
    /// Flips byte `at` of what the receiver sends (bit mask).
    ReceiverByte {
        at: usize,
        mask: u8,
    },
    /// Inserts a batch into what the sender sends, just before its batch
    /// `before` (from 0).
    SenderInserts {
        before: usize,
        batch: Inserted,
    },
}

/// A whole batch the relay inserts; it holds the sender's next batch back
/// until it has all of it, then sends the inserted one first.
#[derive(Clone, Copy, Debug)]
enum Inserted {
    /// A copy of the sender's next batch under another batch id and with
    /// the relay's own payload: the header keeps the only tag the relay
    /// has, the real header's, as it cannot compute one.
    Forged,
    /// The sender's first batch, byte for byte, tags and all.
    FirstAgain,
}

impl Inserted {
    /// The bytes inserted before the batch starting at `at` of `seen`.
    fn bytes(self, seen: &[u8], at: usize) -> Vec<u8> {
        match self {
            Inserted::Forged => {
                let mut forged = seen[at..at + BATCH].to_vec();
                forged[..8].copy_from_slice(&u64::MAX.to_le_bytes());
                forged[BATCH - OPS * OP_BYTES..].fill(0xEE);
                forged
            }
            Inserted::FirstAgain => seen[batch_start(0)..batch_start(1)].to_vec(),
        }
    }
}

/// What one direction of the relay does to its stream.
#[derive(Clone, Copy, Debug)]
enum Edit {
    Pass,
    Flip { at: usize, mask: u8 },
    Insert { at: usize, batch: Inserted },
}

async fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, edit: Edit) {
    // Everything read so far (these streams are small), and how much of it
    // went on.
    let mut seen = Vec::new();
    let mut sent = 0;
    let mut inserted = false;
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let offset = seen.len();
        seen.extend_from_slice(&chunk[..n]);
        if let Edit::Flip { at, mask } = edit {
            if (offset..seen.len()).contains(&at) {
                seen[at] ^= mask;
            }
        }
        let mut out = Vec::new();
        let upto = match edit {
            // The batch at `at` is held back until it is whole: a forged
            // copy is made of it.
            Edit::Insert { at, .. } if !inserted && seen.len() < at + BATCH => at.min(seen.len()),
            Edit::Insert { at, batch } if !inserted => {
                out.extend_from_slice(&seen[sent..at]);
                out.extend_from_slice(&batch.bytes(&seen, at));
                sent = at;
                inserted = true;
                seen.len()
            }
            _ => seen.len(),
        };
        out.extend_from_slice(&seen[sent..upto]);
        sent = upto;
        if to.write_all(&out).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// A relay in front of `receiver` applying `tamper` to the one connection
/// it carries: a sender's retry on a new connection (after a pooled one
/// closed) finds no path, so the writer sees what the tampered connection
/// did.
async fn relay(receiver: SocketAddr, tamper: Tamper) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let Ok((sender, _)) = listener.accept().await else { return };
        drop(listener);
        let receiver = TcpStream::connect(receiver).await.unwrap();
        let (s_read, s_write) = sender.into_split();
        let (r_read, r_write) = receiver.into_split();
        let (to_receiver, to_sender) = match tamper {
            Tamper::Nothing => (Edit::Pass, Edit::Pass),
            Tamper::SenderByte { at, mask } => (Edit::Flip { at, mask }, Edit::Pass),
            Tamper::ReceiverByte { at, mask } => (Edit::Pass, Edit::Flip { at, mask }),
            Tamper::SenderInserts { before, batch } => (Edit::Insert { at: batch_start(before), batch }, Edit::Pass),
        };
        tokio::spawn(forward(s_read, r_write, to_receiver));
        tokio::spawn(forward(r_read, s_write, to_sender));
    });
    addr
}

fn config() -> TcpConfig {
    TcpConfig { auth_secret: Some(AuthSecret::new("shared secret")), ..TcpConfig::default() }
}

/// Each case writes batches of `OPS` ops of `OP_BYTES` bytes through the
/// relay: those before the tampered one land (and are then wiped, so that
/// anything landing later shows), the tampered one fails.
#[rstest]
#[case::relayed_untouched(Tamper::Nothing)]
#[case::the_batch_id(Tamper::SenderByte { at: SENDER_HANDSHAKE, mask: 0x01 })]
#[case::the_header_tag(Tamper::SenderByte { at: SENDER_HANDSHAKE + BATCH_HEADER_LEN, mask: 0x01 })]
#[case::an_ops_destination(Tamper::SenderByte { at: OP_LIST + 16, mask: 0x04 })]
#[case::the_op_list_tag(Tamper::SenderByte { at: OP_LIST + 4 * 16 + FRAME_TAG_LEN - 1, mask: 0x80 })]
#[case::the_replys_status(Tamper::ReceiverByte { at: RECEIVER_HANDSHAKE + 8, mask: 0x01 })]
#[case::a_forged_first_batch(Tamper::SenderInserts { before: 0, batch: Inserted::Forged })]
#[case::a_forged_batch_later(Tamper::SenderInserts { before: 1, batch: Inserted::Forged })]
#[case::the_first_batch_replayed(Tamper::SenderInserts { before: 1, batch: Inserted::FirstAgain })]
#[case::the_first_batch_replayed_later(Tamper::SenderInserts { before: 2, batch: Inserted::FirstAgain })]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_altered_injected_or_replayed_after_the_handshake_ends_the_connection(#[case] tamper: Tamper) {
    let mut receiver = node(config(), OPS * OP_BYTES).await;
    let mut sender = node(config(), OPS * OP_BYTES).await;
    let batch = packed_ops(&sender.buf, &receiver.buf, OPS, OP_BYTES);
    fill(&mut sender.buf, &batch);
    let grant = receiver.grant(&covering(&batch)).await;
    let via = relay(receiver.transport.local_addr(), tamper).await;
    let endpoint = Endpoint { address: via.to_string(), ..receiver.transport.endpoint() };
    let earlier = match tamper {
        Tamper::SenderInserts { before, .. } => before,
        _ => 0,
    };
    for _ in 0..earlier {
        sender.transport.batch_write(&endpoint, &grant, &batch).await.unwrap();
        check(&receiver.buf, &batch);
        receiver.buf.bytes_mut().fill(0);
    }
    let written = sender.transport.batch_write(&endpoint, &grant, &batch).await;
    let from_sender = matches!(tamper, Tamper::SenderByte { .. } | Tamper::SenderInserts { .. });
    match tamper {
        Tamper::Nothing => {
            written.unwrap();
            check(&receiver.buf, &batch);
        }
        Tamper::SenderByte { .. } | Tamper::SenderInserts { .. } => {
            let error = written.expect_err("an altered, forged or replayed batch was taken");
            // On a pooled connection the writer tries once more on a new
            // one, which the relay does not carry: refused.
            assert!(
                matches!(
                    error,
                    TransportError::PeerClosed { .. } | TransportError::Io { .. } | TransportError::Connect { .. }
                ),
                "the receiver closes the connection, without a reply: {error:?}"
            );
            receiver.transport.revoke(&grant.id).await;
            assert!(receiver.buf.is_zero(), "bytes landed after {tamper:?}");
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
    assert_eq!(tag_failures(&receiver), counted(from_sender), "{tamper:?}");
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
