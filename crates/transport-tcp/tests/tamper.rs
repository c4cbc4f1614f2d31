//! Bytes altered after the data plane's authenticated handshake: a relay
//! between two transports holding the same secret lets the handshake
//! through, then flips one bit of the first batch (its header, an op's
//! destination, the op list's tag) or of the receiver's reply. Each ends
//! the connection; an altered header or op list lands nothing (without the
//! tags, the altered destination would put the payload 4 bytes off). The
//! same relay passing every byte through changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;

use common::{check, dst_ranges, fill, ops, Node};
use kv_proto::auth::AuthSecret;
use kv_proto::session::FRAME_TAG_LEN;
use kv_proto::{BatchWriter, Endpoint, TransportError};
use rstest::rstest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use transport_tcp::wire::{ACCEPT_LEN, AUTH_TAG_LEN, BATCH_HEADER_LEN, CHALLENGE_LEN, PREAMBLE_LEN};
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
    let receiver = Node::new(config(), 4 * 64).await;
    let mut sender = Node::new(config(), 4 * 64).await;
    let batch = ops(&sender.buf, &receiver.buf, 4, 64);
    fill(&mut sender.buf, &batch);
    let grant = receiver.grant(&dst_ranges(&batch)).await;
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
    // The receiver keeps serving: the same batch, straight to it.
    let grant = receiver.grant(&dst_ranges(&batch)).await;
    sender.transport.batch_write(&receiver.transport.endpoint(), &grant, &batch).await.unwrap();
    check(&receiver.buf, &batch);
}
