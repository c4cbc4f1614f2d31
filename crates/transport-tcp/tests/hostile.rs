//! Hostile peers on both sides of the wire: a raw client feeding the
//! receiver bad input, and fake receivers answering a sender badly. Each bad
//! connection costs only itself: the listener keeps serving well-behaved
//! writers, nothing lands outside a valid batch, every wait is bounded, and
//! once the hostile peer is gone the receiver's descriptors and memory are
//! back where they were (every test here runs `isolated`, one at a time, so
//! the count is this test's alone).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use bytes::BufMut;
use common::{assert_still_serves, isolated, node, RawClient, BOUND};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchWriter, Endpoint, Grant, GrantId, Protocol, TransportError, WriteOp};
use rstest::rstest;
use test_support::Resources;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use transport_tcp::wire::{
    encode_op, encode_reply, Accept, AcceptStatus, BatchHeader, Preamble, ReplyHeader, ACCEPT_LEN, BATCH_HEADER_LEN,
    MAX_REASON_LEN, OP_LEN, PREAMBLE_LEN, REPLY_HEADER_LEN, VERSION,
};
use transport_tcp::{OpListLimits, TcpConfig};

/// Small bounds, so the stalling cases end quickly.
fn victim_config() -> TcpConfig {
    TcpConfig {
        io_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(300),
        op_lists: OpListLimits { max_ops_per_batch: 1024, timeout: Duration::from_secs(1), ..OpListLimits::default() },
        ..TcpConfig::default()
    }
}

const VICTIM_LEN: usize = 1 << 16;

/// Completes the preamble exchange on a raw connection.
async fn handshake(client: &mut RawClient) {
    client.send(&Preamble::current().encode()).await;
    let accept = client.accept().await;
    assert_eq!(accept.status, AcceptStatus::Accepted);
    assert_eq!(accept.max_ops_per_batch, 1024);
}

/// What the raw client does wrong.
#[derive(Clone, Copy, Debug)]
enum Abuse {
    /// Bytes that are not a preamble.
    Garbage,
    /// A preamble of another version.
    BadVersion,
    /// A preamble with flags this build does not know.
    UnknownFlags,
    /// Part of a preamble, then the write side closed.
    TruncatedPreamble,
    /// Connects and says nothing.
    Silent,
    /// Completes the preamble exchange, then says nothing.
    IdleAfterPreamble,
    /// Part of a batch header, then the write side closed.
    TruncatedHeader,
    /// A batch header with flags this build does not know.
    UnknownBatchFlags,
    /// A batch header with a non-zero reserved field.
    ReservedField,
    /// One op more than the receiver's limit.
    TooManyOps,
    /// An op count of u64::MAX.
    HugeOpCount,
    /// Op lengths that do not add up to the header's total.
    SumMismatch,
    /// Op lengths whose sum overflows u64.
    SumOverflows,
    /// Part of the op list, then the write side closed.
    TruncatedOpList,
    /// The op list a byte at a time, each quick enough, never all of it.
    DribbledOpList,
    /// Part of the payload, then the write side closed.
    TruncatedPayload,
    /// Part of the payload, then silence.
    StalledPayload,
}

#[rstest]
fn a_hostile_client_costs_only_its_connection(
    #[values(
        Abuse::Garbage,
        Abuse::BadVersion,
        Abuse::UnknownFlags,
        Abuse::TruncatedPreamble,
        Abuse::Silent,
        Abuse::IdleAfterPreamble,
        Abuse::TruncatedHeader,
        Abuse::UnknownBatchFlags,
        Abuse::ReservedField,
        Abuse::TooManyOps,
        Abuse::HugeOpCount,
        Abuse::SumMismatch,
        Abuse::SumOverflows,
        Abuse::TruncatedOpList,
        Abuse::DribbledOpList,
        Abuse::TruncatedPayload,
        Abuse::StalledPayload
    )]
    abuse: Abuse,
) {
    isolated(async move {
        let victim = node(victim_config(), VICTIM_LEN).await;
        let base = victim.buf.addr();
        let grant = victim.grant_all().await.id;
        let header = |batch_id, flags, reserved, op_count, total_bytes| {
            BatchHeader { batch_id, flags, reserved, op_count, total_bytes, grant }.encode()
        };
        let with_victim = Resources::now();
        let mut client = RawClient::connect(&victim).await;
        // What the receiver must answer before closing, if anything.
        let mut expect_accept = None;
        let mut expect_reply = None;
        match abuse {
            Abuse::Garbage => client.send(&[0x42; 64]).await,
            Abuse::BadVersion => {
                client.send(&Preamble { version: 99, flags: 0 }.encode()).await;
                expect_accept = Some(AcceptStatus::UnsupportedVersion);
            }
            Abuse::UnknownFlags => {
                client.send(&Preamble { version: VERSION, flags: 0x8000 }.encode()).await;
                expect_accept = Some(AcceptStatus::UnsupportedFlags);
            }
            Abuse::TruncatedPreamble => {
                client.send(&Preamble::current().encode()[..3]).await;
                client.stream.shutdown().await.unwrap();
            }
            Abuse::Silent => {}
            Abuse::IdleAfterPreamble => handshake(&mut client).await,
            Abuse::TruncatedHeader => {
                handshake(&mut client).await;
                client.send(&[1; 10]).await;
                client.stream.shutdown().await.unwrap();
            }
            Abuse::TooManyOps => {
                handshake(&mut client).await;
                // The header alone: the receiver must refuse before reading ops.
                client.send(&header(7, 0, 0, 1025, 1025)).await;
                expect_reply = Some((7, ReplyStatus::ProtocolError));
            }
            Abuse::UnknownBatchFlags => {
                handshake(&mut client).await;
                client.send(&header(5, 0x8000_0000, 0, 1, 16)).await;
                expect_reply = Some((5, ReplyStatus::ProtocolError));
            }
            Abuse::ReservedField => {
                handshake(&mut client).await;
                client.send(&header(6, 0, 1, 1, 16)).await;
                expect_reply = Some((6, ReplyStatus::ProtocolError));
            }
            Abuse::HugeOpCount => {
                handshake(&mut client).await;
                client.send(&header(8, 0, 0, u64::MAX, 0)).await;
                expect_reply = Some((8, ReplyStatus::ProtocolError));
            }
            Abuse::SumMismatch => {
                handshake(&mut client).await;
                client.batch(9, grant, &[(base, 100), (base + 200, 100)], 201, &[]).await;
                expect_reply = Some((9, ReplyStatus::ProtocolError));
            }
            Abuse::SumOverflows => {
                handshake(&mut client).await;
                client.batch(10, grant, &[(base, u64::MAX), (base, 2)], 1, &[]).await;
                expect_reply = Some((10, ReplyStatus::ProtocolError));
            }
            Abuse::TruncatedOpList => {
                handshake(&mut client).await;
                let mut bytes = header(11, 0, 0, 4, 64).to_vec();
                bytes.extend_from_slice(&encode_op(base, 16));
                bytes.extend_from_slice(&[0; 8]);
                client.send(&bytes).await;
                client.stream.shutdown().await.unwrap();
            }
            Abuse::DribbledOpList => {
                handshake(&mut client).await;
                client.send(&header(14, 0, 0, 1000, 1000)).await;
                // A byte every 50 ms (each read well within io_timeout),
                // until the receiver answers: the whole list never arrives.
                let list: Vec<u8> = (0..1000).flat_map(|_| encode_op(base, 1)).collect();
                let started = tokio::time::Instant::now();
                for b in list {
                    let lived = started.elapsed();
                    assert!(lived < Duration::from_secs(5), "the receiver kept reading a dribbled list for {lived:?}");
                    client.send(&[b]).await;
                    let pace = Duration::from_millis(50);
                    let mut probe = [0u8; 1];
                    if tokio::time::timeout(pace, client.stream.peek(&mut probe)).await.is_ok() {
                        break;
                    }
                }
                expect_reply = Some((14, ReplyStatus::ProtocolError));
            }
            Abuse::TruncatedPayload => {
                handshake(&mut client).await;
                client.batch(12, grant, &[(base, 1000)], 1000, &[0xAB; 400]).await;
                client.stream.shutdown().await.unwrap();
            }
            Abuse::StalledPayload => {
                handshake(&mut client).await;
                client.batch(13, grant, &[(base, 1000)], 1000, &[0xAB; 400]).await;
            }
        }

        let rest = client.until_closed().await;
        if let Some(status) = expect_accept {
            assert!(rest.len() >= ACCEPT_LEN, "no accept reply before closing: {rest:?}");
            let accept = Accept::decode(rest[..ACCEPT_LEN].try_into().unwrap()).unwrap();
            assert_eq!(accept.status, status);
            assert_eq!(accept.version, VERSION);
        } else if let Some((batch_id, status)) = expect_reply {
            assert!(rest.len() >= REPLY_HEADER_LEN, "no reply before closing: {rest:?}");
            let reply = ReplyHeader::decode(rest[..REPLY_HEADER_LEN].try_into().unwrap());
            assert_eq!((reply.batch_id, reply.status), (batch_id, status));
            assert!(reply.reason_len > 0, "a protocol error names its reason");
            if matches!(abuse, Abuse::DribbledOpList) {
                let reason = String::from_utf8_lossy(&rest[REPLY_HEADER_LEN..]);
                assert!(reason.contains("op list not received within 1s"), "{reason}");
            }
        } else {
            assert!(rest.is_empty(), "unexpected bytes before closing: {rest:?}");
        }
        // Only the payload of a validated batch may land (here: at most the
        // truncated or stalled payload's first bytes, at the start of the buffer).
        let clean_from = match abuse {
            Abuse::TruncatedPayload | Abuse::StalledPayload => 400,
            _ => 0,
        };
        victim.transport.revoke(&grant).await;
        assert!(victim.buf.bytes()[clean_from..].iter().all(|&b| b == 0), "bad input wrote to memory");
        assert_still_serves(&victim).await;
        drop(client);
        with_victim.back(&format!("the receiver after {abuse:?}"), BOUND).await;
    });
}

/// A refused batch is discarded whole and leaves the connection usable; an
/// empty batch is acknowledged.
#[test]
fn a_refused_batch_keeps_the_connection_usable() {
    isolated(async move {
        let victim = node(victim_config(), VICTIM_LEN).await;
        let base = victim.buf.addr();
        let end = victim.buf.end();
        let grant = victim.grant_all().await.id;
        let with_victim = Resources::now();
        let (mut client, _) = RawClient::handshaken(&victim).await;

        let below = base - 4;
        for (batch_id, bad) in
            [(1, (end - 8, 16)), (2, (end, 1)), (3, (u64::MAX - 4, 8)), (4, (below, 8)), (5, (0x1000, 4))]
        {
            let ops = [(base, 16), bad];
            let total = 16 + bad.1;
            client.batch(batch_id, grant, &ops, total, &vec![0xCD; total as usize]).await;
            let (reply, reason) = client.reply().await;
            assert_eq!((reply.batch_id, reply.status), (batch_id, ReplyStatus::Refused));
            assert!(reason.contains("op 1"), "reason {reason:?} names no op");
            assert!(victim.buf.is_zero(), "a refused batch wrote bytes");
        }

        client.batch(20, grant, &[], 0, &[]).await;
        assert_eq!(client.reply().await.0.status, ReplyStatus::Ok);
        client.batch(21, grant, &[(base + 100, 3), (base + 10, 2)], 5, &[1, 2, 3, 4, 5]).await;
        let (reply, reason) = client.reply().await;
        assert_eq!((reply.batch_id, reply.status, reason.as_str()), (21, ReplyStatus::Ok, ""));
        victim.transport.revoke(&grant).await;
        assert_eq!(&victim.buf.bytes()[100..103], &[1, 2, 3]);
        assert_eq!(&victim.buf.bytes()[10..12], &[4, 5]);
        drop(client);
        with_victim.back("the receiver after refused batches", BOUND).await;
    });
}

/// A huge announced op list costs memory only as its bytes arrive, and an
/// announced payload is never read before its op list is admitted.
#[test]
fn an_op_list_is_admitted_before_any_payload_byte_is_read() {
    isolated(async move {
        let victim = node(victim_config(), VICTIM_LEN).await;
        let base = victim.buf.addr();
        let grant = victim.grant(&[kv_proto::MemoryRegion::new(base, 1024)]).await.id;
        let with_victim = Resources::now();
        let (mut client, _) = RawClient::handshaken(&victim).await;
        // The second op is outside the grant; its payload bytes follow at once.
        client.batch(1, grant, &[(base, 512), (base + 1024, 512)], 1024, &[0xEE; 1024]).await;
        let (reply, reason) = client.reply().await;
        assert_eq!(reply.status, ReplyStatus::Refused, "{reason}");
        assert!(reason.contains("op 1") && reason.contains("outside the grant"), "{reason}");
        victim.transport.revoke(&grant).await;
        assert!(victim.buf.is_zero(), "the first op's payload landed before the second was checked");
        drop(client);
        with_victim.back("the receiver after a refused op list", BOUND).await;
    });
}

/// Many hostile connections at once, then a well-behaved writer.
#[test]
fn a_crowd_of_garbage_connections_does_not_stop_the_listener() {
    isolated(async move {
        let victim = node(victim_config(), VICTIM_LEN).await;
        let with_victim = Resources::now();
        let mut clients = Vec::new();
        for i in 0..32u8 {
            let mut client = RawClient::connect(&victim).await;
            client.send(&[i; PREAMBLE_LEN]).await;
            clients.push(client);
        }
        for client in &mut clients {
            client.until_closed().await;
        }
        assert_still_serves(&victim).await;
        drop(clients);
        with_victim.back("the receiver after a crowd of garbage connections", BOUND).await;
    });
}

/// What a fake receiver answers a real sender.
#[derive(Clone, Copy, Debug)]
enum FakeReceiver {
    /// Not a kvlink listener: answers the preamble with junk.
    NotKvlink,
    /// Speaks another version.
    OtherVersion,
    /// Accepts, then acknowledges another batch.
    WrongBatchId,
    /// Accepts, then sends a reason longer than allowed.
    OversizedReason,
    /// Accepts, then reports a protocol error.
    ProtocolError,
    /// Accepts, reads everything, never acknowledges.
    NeverAcks,
    /// Accepts, then closes before acknowledging.
    ClosesBeforeAck,
}

#[rstest]
fn a_sender_survives_hostile_receivers(
    #[values(
        FakeReceiver::NotKvlink,
        FakeReceiver::OtherVersion,
        FakeReceiver::WrongBatchId,
        FakeReceiver::OversizedReason,
        FakeReceiver::ProtocolError,
        FakeReceiver::NeverAcks,
        FakeReceiver::ClosesBeforeAck
    )]
    fake: FakeReceiver,
) {
    isolated(async move {
        let config = TcpConfig {
            io_timeout: Duration::from_millis(300),
            connect_timeout: Duration::from_millis(2000),
            ..TcpConfig::default()
        };
        let sender = node(config, 1 << 16).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut preamble = [0u8; PREAMBLE_LEN];
            s.read_exact(&mut preamble).await.unwrap();
            let accept = |version, status| {
                Accept { version, status, max_ops_per_batch: 1 << 20, idle_timeout_ms: 60_000 }.encode()
            };
            match fake {
                FakeReceiver::NotKvlink => {
                    s.write_all(&[b'H'; ACCEPT_LEN]).await.unwrap();
                    return;
                }
                FakeReceiver::OtherVersion => {
                    s.write_all(&accept(VERSION + 1, AcceptStatus::UnsupportedVersion)).await.unwrap();
                    return;
                }
                _ => s.write_all(&accept(VERSION, AcceptStatus::Accepted)).await.unwrap(),
            }
            // Read the whole batch: header, one op and 64 payload bytes.
            let mut batch = [0u8; BATCH_HEADER_LEN + OP_LEN + 64];
            s.read_exact(&mut batch).await.unwrap();
            let header = BatchHeader::decode(batch[..BATCH_HEADER_LEN].try_into().unwrap());
            assert_eq!(header.grant, GrantId::from_bytes([3; 16]), "the batch names its grant");
            assert!(!header.wants_precheck(), "a small batch is sent in one go");
            let batch_id = header.batch_id;
            match fake {
                FakeReceiver::WrongBatchId => {
                    s.write_all(&encode_reply(batch_id + 1, ReplyStatus::Ok, "")).await.unwrap();
                }
                FakeReceiver::OversizedReason => {
                    let mut reply = Vec::new();
                    reply.put_u64_le(batch_id);
                    reply.put_u32_le(ReplyStatus::Refused.code());
                    reply.put_u32_le((MAX_REASON_LEN + 1) as u32);
                    assert_eq!(reply.len(), REPLY_HEADER_LEN);
                    assert_eq!(
                        ReplyHeader::decode(reply[..].try_into().unwrap()).reason_len as usize,
                        MAX_REASON_LEN + 1
                    );
                    s.write_all(&reply).await.unwrap();
                }
                FakeReceiver::ProtocolError => {
                    s.write_all(&encode_reply(batch_id, ReplyStatus::ProtocolError, "nope")).await.unwrap();
                }
                FakeReceiver::NeverAcks => {
                    // Hold the connection open until the sender gives up.
                    let mut rest = Vec::new();
                    let _ = s.read_to_end(&mut rest).await;
                }
                FakeReceiver::ClosesBeforeAck => {}
                FakeReceiver::NotKvlink | FakeReceiver::OtherVersion => unreachable!(),
            }
        });
        let peer = Endpoint { protocol: Protocol::Tcp, address, details: Vec::new() };
        let ops = [WriteOp { src: sender.buf.addr(), dst: 0x1000, len: 64 }];
        let grant = Grant::plain(GrantId::from_bytes([3; 16]));
        let result = tokio::time::timeout(BOUND, sender.transport.batch_write(&peer, &grant, &ops))
            .await
            .expect("unbounded wait");
        let err = result.expect_err("a hostile receiver's batch succeeded");
        let expected = match fake {
            FakeReceiver::NotKvlink => matches!(err, TransportError::Connect { .. }),
            FakeReceiver::OtherVersion => {
                matches!(&err, TransportError::Protocol { reason, .. } if reason.contains(&format!("version {}", VERSION + 1)))
            }
            FakeReceiver::WrongBatchId | FakeReceiver::OversizedReason | FakeReceiver::ProtocolError => {
                matches!(err, TransportError::Protocol { .. })
            }
            FakeReceiver::NeverAcks => matches!(err, TransportError::Timeout { .. }),
            FakeReceiver::ClosesBeforeAck => matches!(err, TransportError::PeerClosed { .. }),
        };
        assert!(expected, "{fake:?}: unexpected error {err:?}");
        assert_eq!(sender.transport.idle_connections(), 0, "a failed connection was pooled");
        drop(sender);
        server.await.unwrap();
    });
}
