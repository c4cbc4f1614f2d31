//! A large batch spread over several connections: every byte arrives, and a
//! bad op still gets the whole batch refused with nothing written, because
//! every part is admitted by the receiver before any payload is sent.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{default_node, node};
use kv_proto::{BatchWriter, MemoryRegion, TransportError, WriteOp};
use rstest::rstest;
use test_support::pattern::{check, covering, fill, packed_ops};
use transport_tcp::TcpConfig;

fn config(streams: usize) -> TcpConfig {
    TcpConfig { parallel_streams: streams, parallel_min_bytes: 1 << 20, ..TcpConfig::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_large_op_is_split_and_arrives_whole() {
    let mut a = node(config(3), 8 << 20).await;
    let b = default_node(8 << 20).await;
    let batch = packed_ops(&a.buf, &b.buf, 1, 8 << 20);
    fill(&mut a.buf, &batch);
    let grant = b.grant(&covering(&batch)).await;
    a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
    check(&b.buf, &batch);
    // Every part is admitted at once, each on its own connection.
    assert_eq!(a.transport.connections_opened(), 3);
    assert_eq!(b.transport.connections_accepted(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_ops_are_split_at_byte_boundaries() {
    let mut a = node(config(2), 4 << 20).await;
    let b = default_node(4 << 20).await;
    // Odd lengths so the cut falls inside an op.
    let batch: Vec<WriteOp> = packed_ops(&a.buf, &b.buf, 999, 4099);
    fill(&mut a.buf, &batch);
    let grant = b.grant(&covering(&batch)).await;
    a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
    check(&b.buf, &batch);
}

/// Where the one bad op of a split batch points.
#[derive(Clone, Copy, Debug)]
enum BadOp {
    /// Inside the receiver's registered destination region, outside the
    /// grant: only the receiver's grant check can see it (the endpoint
    /// advertises nothing).
    OutsideTheGrant,
    /// Straddling the end of the receiver's region.
    PastTheRegion,
}

/// The bad op is in the last part: the first part is admitted, then
/// abandoned, and nothing of it lands.
#[rstest]
#[case::outside_the_grant(BadOp::OutsideTheGrant)]
#[case::past_the_region(BadOp::PastTheRegion)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_op_in_a_split_batch_is_refused_whole(#[case] bad: BadOp) {
    let mut a = node(config(2), 4 << 20).await;
    let b = default_node(8 << 20).await;
    let mut batch = packed_ops(&a.buf, &b.buf, 4, 1 << 20);
    // The grant covers the first 4 MiB of the receiver's 8 MiB region.
    let grant = b.grant(&[MemoryRegion::new(b.buf.addr(), 4 << 20)]).await;
    batch[3].dst = match bad {
        BadOp::OutsideTheGrant => b.buf.addr() + (6 << 20),
        BadOp::PastTheRegion => b.buf.end() - 10,
    };
    fill(&mut a.buf, &batch);
    let err = a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap_err();
    match &err {
        TransportError::Refused { reason, .. } => assert!(reason.contains("outside the grant"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(b.buf.is_zero(), "no byte of a refused batch lands");

    // The refusal costs nothing else: the same grant still works, and the
    // refused part's connection was kept.
    let good = &batch[..3];
    a.transport.batch_write(&b.transport.endpoint(), &grant, good).await.unwrap();
    check(&b.buf, good);
    assert!(b.buf.bytes()[3 << 20..].iter().all(|&x| x == 0));
}

/// Every part refused (a forged grant): nothing lands, and the sender's
/// connections stay usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_batch_under_a_forged_grant_is_refused() {
    let mut a = node(config(2), 4 << 20).await;
    let b = default_node(4 << 20).await;
    let batch = packed_ops(&a.buf, &b.buf, 1, 4 << 20);
    fill(&mut a.buf, &batch);
    let forged = kv_proto::Grant::plain(kv_proto::GrantId::from_bytes([0x5A; 16]));
    let err = a.transport.batch_write(&b.transport.endpoint(), &forged, &batch).await.unwrap_err();
    assert!(matches!(&err, TransportError::Refused { reason, .. } if reason.contains("no live grant")), "{err:?}");
    assert!(b.buf.is_zero());
    // Refused parts keep their connections (two, or one if a part finished
    // before the other picked a connection and both used it in turn).
    let opened = a.transport.connections_opened();
    assert_eq!(a.transport.idle_connections() as u64, opened, "a refused part dropped its connection");
    let grant = b.grant_all().await;
    a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
    check(&b.buf, &batch);
    assert!(a.transport.connections_opened() <= 2);
}

/// What a fake receiver answers the second part's question.
#[derive(Clone, Copy, Debug)]
enum SecondPart {
    /// Admits it too: both payloads follow.
    Admitted,
    /// Refuses it.
    Refused,
    /// Closes its connection without a verdict.
    Closed,
}

/// A fake receiver sees the wire of a split batch: both parts ask first
/// (PRECHECK, no payload), and a part's payload follows only once both were
/// admitted; otherwise the admitted part's connection closes before any
/// payload byte.
#[rstest]
#[case::admitted(SecondPart::Admitted)]
#[case::refused(SecondPart::Refused)]
#[case::closed(SecondPart::Closed)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_follow_only_once_every_part_was_admitted(#[case] second: SecondPart) {
    use kv_proto::dataplane::ReplyStatus;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use transport_tcp::wire::{
        encode_reply, Accept, AcceptStatus, BatchHeader, BATCH_HEADER_LEN, OP_LEN, PREAMBLE_LEN, VERSION,
    };

    let mut a = node(config(2), 2 << 20).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let batch = vec![WriteOp { src: a.buf.addr(), dst: 0x10_0000, len: 2 << 20 }];
    fill(&mut a.buf, &batch);
    let fake = tokio::spawn(async move {
        let mut parts = Vec::new();
        for _ in 0..2 {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut preamble = [0u8; PREAMBLE_LEN];
            s.read_exact(&mut preamble).await.unwrap();
            let accept = Accept {
                version: VERSION,
                status: AcceptStatus::Accepted,
                max_ops_per_batch: 1024,
                idle_timeout_ms: 60_000,
            };
            s.write_all(&accept.encode()).await.unwrap();
            parts.push(s);
        }
        let mut headers = Vec::new();
        for s in &mut parts {
            let mut h = [0u8; BATCH_HEADER_LEN];
            s.read_exact(&mut h).await.unwrap();
            let header = BatchHeader::decode(&h);
            assert!(header.wants_precheck(), "a part of a split batch asks first");
            let mut ops = vec![0u8; header.op_count as usize * OP_LEN];
            s.read_exact(&mut ops).await.unwrap();
            headers.push(header);
        }
        let mut second_conn = parts.pop().unwrap();
        let mut first = parts.pop().unwrap();
        first.write_all(&encode_reply(headers[0].batch_id, ReplyStatus::Ok, "")).await.unwrap();
        let (status, reason) = match second {
            SecondPart::Admitted => (ReplyStatus::Ok, ""),
            SecondPart::Refused => (ReplyStatus::Refused, "op 0: outside the grant"),
            SecondPart::Closed => {
                // Close without a verdict; the admitted part is abandoned.
                drop(second_conn);
                let mut rest = Vec::new();
                first.read_to_end(&mut rest).await.unwrap();
                assert!(rest.is_empty(), "{} payload bytes of an abandoned part were sent", rest.len());
                return;
            }
        };
        second_conn.write_all(&encode_reply(headers[1].batch_id, status, reason)).await.unwrap();
        if status == ReplyStatus::Ok {
            for (s, header) in [(&mut first, headers[0]), (&mut second_conn, headers[1])] {
                let mut payload = vec![0u8; header.total_bytes as usize];
                s.read_exact(&mut payload).await.unwrap();
                s.write_all(&encode_reply(header.batch_id, ReplyStatus::Ok, "")).await.unwrap();
            }
        } else {
            // The admitted part is abandoned: end of stream, not a byte of payload.
            let mut rest = Vec::new();
            first.read_to_end(&mut rest).await.unwrap();
            assert!(rest.is_empty(), "{} payload bytes of an abandoned part were sent", rest.len());
        }
    });
    let peer = kv_proto::Endpoint { protocol: kv_proto::Protocol::Tcp, address, details: Vec::new() };
    let grant = kv_proto::Grant::plain(kv_proto::GrantId::from_bytes([9; 16]));
    let result = tokio::time::timeout(common::BOUND, a.transport.batch_write(&peer, &grant, &batch))
        .await
        .expect("unbounded wait");
    tokio::time::timeout(common::BOUND, fake).await.expect("the fake receiver hung").unwrap();
    match second {
        SecondPart::Admitted => result.unwrap(),
        SecondPart::Refused => {
            let err = result.unwrap_err();
            assert!(matches!(&err, TransportError::Refused { reason, .. } if reason.contains("outside")), "{err:?}");
        }
        SecondPart::Closed => assert!(matches!(result, Err(TransportError::PeerClosed { .. })), "{result:?}"),
    }
}

/// Dropping the `batch_write` future of a split batch stops it: a fake
/// receiver admits one part, holds the other's verdict until the future is
/// dropped, then admits it too; no payload byte follows on either
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_split_batch_before_its_gate_opens_sends_no_payload() {
    use kv_proto::dataplane::ReplyStatus;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use transport_tcp::wire::{
        encode_reply, Accept, AcceptStatus, BatchHeader, BATCH_HEADER_LEN, OP_LEN, PREAMBLE_LEN, VERSION,
    };

    let mut a = node(config(2), 2 << 20).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let batch = vec![WriteOp { src: a.buf.addr(), dst: 0x10_0000, len: 2 << 20 }];
    fill(&mut a.buf, &batch);
    let (asked_tx, asked_rx) = tokio::sync::oneshot::channel::<()>();
    let (dropped_tx, dropped_rx) = tokio::sync::oneshot::channel::<()>();
    let fake = tokio::spawn(async move {
        let mut parts = Vec::new();
        for _ in 0..2 {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut preamble = [0u8; PREAMBLE_LEN];
            s.read_exact(&mut preamble).await.unwrap();
            let accept = Accept {
                version: VERSION,
                status: AcceptStatus::Accepted,
                max_ops_per_batch: 1024,
                idle_timeout_ms: 60_000,
            };
            s.write_all(&accept.encode()).await.unwrap();
            let mut h = [0u8; BATCH_HEADER_LEN];
            s.read_exact(&mut h).await.unwrap();
            let header = BatchHeader::decode(&h);
            let mut ops = vec![0u8; header.op_count as usize * OP_LEN];
            s.read_exact(&mut ops).await.unwrap();
            parts.push((s, header.batch_id));
        }
        let (first, first_id) = &mut parts[0];
        first.write_all(&encode_reply(*first_id, ReplyStatus::Ok, "")).await.unwrap();
        asked_tx.send(()).unwrap();
        dropped_rx.await.unwrap();
        let (second, second_id) = &mut parts[1];
        // The sender may have closed already: the verdict may not arrive.
        let _ = second.write_all(&encode_reply(*second_id, ReplyStatus::Ok, "")).await;
        for (s, _) in &mut parts {
            let mut received = 0;
            let mut chunk = [0u8; 4096];
            loop {
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => received += n,
                }
            }
            assert_eq!(received, 0, "payload bytes followed a dropped batch");
        }
    });
    let peer = kv_proto::Endpoint { protocol: kv_proto::Protocol::Tcp, address, details: Vec::new() };
    let grant = kv_proto::Grant::plain(kv_proto::GrantId::from_bytes([9; 16]));
    tokio::select! {
        result = a.transport.batch_write(&peer, &grant, &batch) => panic!("the batch ended: {result:?}"),
        asked = asked_rx => asked.unwrap(),
    }
    // The batch_write future is dropped here, one part admitted, one waiting.
    dropped_tx.send(()).unwrap();
    tokio::time::timeout(common::BOUND, fake).await.expect("a dropped batch's connection stayed open").unwrap();
}
