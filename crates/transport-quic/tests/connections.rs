//! Connection use: concurrent batches share one connection as concurrent
//! streams; limits the receiver advertises fail a batch before it is sent,
//! and the receiver refuses a batch outside its grant before reading its
//! payload; a connection the receiver closed is replaced; shutdown and drop
//! stop every write into registered memory promptly, even mid-batch; a
//! receiver that never answers cannot hold a batch past the absolute
//! deadline; a dropped `batch_write` resets its stream.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{any_grant, check, fake_server_hello, fill, request, verdict, FakeReceiver, Node, RawClient, BOUND};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchWriter, TransportError, WriteOp};
use tokio::task::JoinSet;
use transport_quic::QuicConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_share_one_connection() {
    const BATCHES: usize = 32;
    const OPS: usize = 64;
    const LEN: usize = 2048;
    let mut a = Node::with_defaults(BATCHES * OPS * LEN).await;
    // Fewer streams than batches: the rest wait for a free stream.
    let b = Node::new(QuicConfig { max_concurrent_streams: 4, ..QuicConfig::default() }, 2 * BATCHES * OPS * LEN).await;
    let all: Vec<WriteOp> = (0..BATCHES * OPS)
        .map(|k| WriteOp {
            src: a.buf.addr() + (k * LEN) as u64,
            dst: b.buf.addr() + (k * 2 * LEN) as u64,
            len: LEN as u64,
        })
        .collect();
    fill(&mut a.buf, &all);
    let endpoint = b.transport.endpoint();
    let grant = b.grant_all().await;
    let mut tasks = JoinSet::new();
    for chunk in all.chunks(OPS) {
        let (writer, endpoint, grant, ops) =
            (Arc::clone(&a.transport), endpoint.clone(), grant.clone(), chunk.to_vec());
        tasks.spawn(async move { writer.batch_write(&endpoint, &grant, &ops).await });
    }
    while let Some(joined) = tokio::time::timeout(BOUND, tasks.join_next()).await.unwrap() {
        joined.unwrap().unwrap();
    }
    b.transport.revoke(&grant.id).await;
    check(&b.buf, &all);
    assert_eq!(a.transport.connections_opened(), 1, "concurrent batches opened more than one connection");
    assert_eq!(b.transport.connections_accepted(), 1);
    assert_eq!(a.transport.open_connections(), 1);
    // Later batches reuse it too.
    let grant = b.grant_all().await;
    for chunk in all.chunks(OPS).take(4) {
        a.transport.batch_write(&endpoint, &grant, chunk).await.unwrap();
    }
    assert_eq!(a.transport.connections_opened(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_the_advertised_op_limit_fails_before_sending() {
    let a = Node::with_defaults(1 << 16).await;
    let b = Node::new(QuicConfig { max_ops_per_batch: 8, ..QuicConfig::default() }, 1 << 16).await;
    let ops: Vec<WriteOp> =
        (0..9).map(|k| WriteOp { src: a.buf.addr() + k * 16, dst: b.buf.addr() + k * 16, len: 16 }).collect();
    let grant = b.grant_all().await;
    let err = a.transport.batch_write(&b.transport.endpoint(), &grant, &ops).await.unwrap_err();
    match &err {
        TransportError::Refused { reason, .. } => assert!(reason.contains("limit of 8"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(a.transport.connections_opened(), 0);
    a.transport.batch_write(&b.transport.endpoint(), &grant, &ops[..8]).await.unwrap();
}

/// How the victim stops mid-batch.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Shutdown,
    Drop,
}

#[rstest::rstest]
#[case::shutdown(Stop::Shutdown)]
#[case::drop(Stop::Drop)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_mid_batch_is_prompt_and_nothing_lands_after(#[case] stop: Stop) {
    const LEN: usize = 64 * 1024;
    const FIRST: usize = 16 * 1024;
    // A long I/O bound: stopping must not wait for it.
    let victim = Node::new(QuicConfig { io_timeout: Duration::from_secs(60), ..QuicConfig::default() }, LEN).await;
    let grant = victim.grant_all().await.id;
    let client = RawClient::connect(&victim).await;
    let (mut send, mut recv) = client.stream().await;
    let bytes = request(&grant, &[(victim.buf.addr(), LEN as u64)], LEN as u64, &[7; FIRST]);
    send.write_all(&bytes).await.unwrap();
    let Node { transport, buf } = victim;
    let started = Instant::now();
    match stop {
        Stop::Shutdown => tokio::time::timeout(BOUND, transport.shutdown()).await.expect("shutdown hung"),
        Stop::Drop => drop(transport),
    }
    assert!(started.elapsed() < Duration::from_secs(10), "stopping took {:?}", started.elapsed());
    // The rest of the payload arrives (or is refused) after the stop: none
    // of it may land.
    let _ = send.write_all(&[9; LEN - FIRST]).await;
    let _ = send.finish();
    let got = common::reply(&mut recv).await;
    assert!(!matches!(got, Ok((ReplyStatus::Ok, _))), "{got:?}");
    assert!(buf.bytes()[FIRST..].iter().all(|&b| b == 0), "bytes landed after the transport stopped");
    assert!(buf.bytes()[..FIRST].iter().all(|&b| b == 0 || b == 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_outside_its_grant_is_refused_before_its_payload_is_read() {
    let mut a = Node::with_defaults(1 << 16).await;
    let b = Node::with_defaults(1 << 16).await;
    let endpoint = b.transport.endpoint();
    // The grant covers the first half of b's buffer; the sender cannot know.
    let grant = b.grant(0, 1 << 15).await;
    let good = WriteOp { src: a.buf.addr(), dst: b.buf.addr(), len: 4096 };
    // The bad op has a large payload, which the receiver must not read.
    let bad = WriteOp { src: a.buf.addr() + 4096, dst: b.buf.addr() + (1 << 15) - 10, len: 32 * 1024 };
    fill(&mut a.buf, &[good, bad]);
    let err = a.transport.batch_write(&endpoint, &grant, &[good, bad]).await.unwrap_err();
    match &err {
        TransportError::Refused { reason, .. } => assert!(reason.contains("op 1"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(b.transport.bytes_received(), 0, "a refused batch wrote bytes");
    // The refusal cost nothing else: same connection, next batch lands.
    a.transport.batch_write(&endpoint, &grant, &[good]).await.unwrap();
    b.transport.revoke(&grant.id).await;
    check(&b.buf, &[good]);
    assert!(b.buf.bytes()[4096..].iter().all(|&x| x == 0));
    assert_eq!(a.transport.connections_opened(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_receiver_closed_is_replaced_on_the_next_batch() {
    let mut a = Node::with_defaults(1 << 16).await;
    // A receiver that acknowledges each batch, then closes the connection
    // once the acknowledgement is delivered.
    let fake = FakeReceiver::kvlink();
    let accepting = fake.endpoint.clone();
    let server = tokio::spawn(async move {
        while let Some(incoming) = accepting.accept().await {
            let Ok(conn) = incoming.await else { continue };
            fake_server_hello(&conn).await.unwrap();
            if let Ok((mut send, mut recv)) = conn.accept_bi().await {
                recv.read_to_end(1 << 20).await.unwrap();
                send.write_all(&verdict(ReplyStatus::Ok, "")).await.unwrap();
                send.finish().unwrap();
                let _ = send.stopped().await;
                conn.close(0u32.into(), b"bye");
            }
        }
    });
    let ops = [WriteOp { src: a.buf.addr(), dst: 0x10_0000, len: 4096 }];
    fill(&mut a.buf, &ops);
    for round in 1..=3u64 {
        tokio::time::timeout(BOUND, a.transport.batch_write(&fake.endpoint(), &any_grant(), &ops))
            .await
            .expect("the batch hung")
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(a.transport.connections_opened(), round, "round {round}: not on a new connection");
    }
    fake.endpoint.close(0u32.into(), b"done");
    server.await.unwrap();
}
