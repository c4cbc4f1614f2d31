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

use common::{
    any_grant, default_node, fake_server_hello, node, request, verdict, FakeReceiver, Node, RawClient, BOUND,
};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchWriter, TransportError, WriteOp};
use test_support::pattern::{check, fill};
use tokio::task::JoinSet;
use transport_quic::{OpListLimits, QuicConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_share_one_connection() {
    const BATCHES: usize = 32;
    const OPS: usize = 64;
    const LEN: usize = 2048;
    let mut a = default_node(BATCHES * OPS * LEN).await;
    // Fewer streams than batches: the rest wait for a free stream.
    let b = node(QuicConfig { max_concurrent_streams: 4, ..QuicConfig::default() }, 2 * BATCHES * OPS * LEN).await;
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
    let a = default_node(1 << 16).await;
    let config = QuicConfig {
        op_lists: OpListLimits { max_ops_per_batch: 8, ..OpListLimits::default() },
        ..QuicConfig::default()
    };
    let b = node(config, 1 << 16).await;
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
    let victim = node(QuicConfig { io_timeout: Duration::from_secs(60), ..QuicConfig::default() }, LEN).await;
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
    let mut a = default_node(1 << 16).await;
    let b = default_node(1 << 16).await;
    let endpoint = b.transport.endpoint();
    // The grant covers the first half of b's buffer; the sender cannot know.
    let grant = b.grant_range(0, 1 << 15).await;
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
    let mut a = default_node(1 << 16).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_acknowledges_but_never_answers_fails_the_batch_at_the_deadline() {
    const IO_TIMEOUT: Duration = Duration::from_millis(500);
    let mut a = node(QuicConfig { io_timeout: IO_TIMEOUT, ..QuicConfig::default() }, 1 << 20).await;
    // A receiver that reads (and so acknowledges) every batch, answers every
    // batch but the first, and never answers the first.
    let fake = FakeReceiver::kvlink();
    let accepting = fake.endpoint.clone();
    let (first_read_tx, first_read_rx) = tokio::sync::oneshot::channel();
    let server = tokio::spawn(async move {
        let mut first_read = Some(first_read_tx);
        let mut silent = Vec::new();
        while let Some(incoming) = accepting.accept().await {
            let Ok(conn) = incoming.await else { continue };
            if fake_server_hello(&conn).await.is_err() {
                continue;
            }
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                if let Some(tx) = first_read.take() {
                    recv.read_to_end(1 << 24).await.unwrap();
                    let _ = tx.send(Instant::now());
                    silent.push((send, recv));
                    continue;
                }
                tokio::spawn(async move {
                    if recv.read_to_end(1 << 24).await.is_ok() {
                        let _ = send.write_all(&verdict(ReplyStatus::Ok, "")).await;
                        let _ = send.finish();
                    }
                });
            }
        }
    });
    let ops: Vec<WriteOp> =
        (0..16).map(|k| WriteOp { src: a.buf.addr() + k * 4096, dst: k * 4096, len: 4096 }).collect();
    fill(&mut a.buf, &ops);
    let endpoint = fake.endpoint();
    let silent = {
        let (writer, endpoint, ops) = (Arc::clone(&a.transport), endpoint.clone(), ops.clone());
        tokio::spawn(async move { writer.batch_write(&endpoint, &any_grant(), &ops).await })
    };
    let read_at = tokio::time::timeout(BOUND, first_read_rx).await.expect("the fake never got the batch").unwrap();
    // Other batches on the same connection keep it acknowledging busily,
    // for the first half of the bound: a batch started later could find the
    // connection already given up with the stalled batch and open another.
    let mut answered = 0u32;
    let result = loop {
        if silent.is_finished() || read_at.elapsed() >= IO_TIMEOUT / 2 {
            let waited = tokio::time::timeout(BOUND, silent).await;
            break waited.expect("the unanswered batch is still waiting after the bound").unwrap();
        }
        a.transport.batch_write(&endpoint, &any_grant(), &ops[..1]).await.unwrap();
        answered += 1;
    };
    let waited = read_at.elapsed();
    match result {
        Err(TransportError::Timeout { what, after, .. }) => {
            assert_eq!(what, "reply");
            assert_eq!(after, IO_TIMEOUT);
        }
        other => panic!("expected a reply timeout, got {other:?}"),
    }
    assert!(waited < IO_TIMEOUT + Duration::from_secs(2), "failed only after {waited:?}");
    assert!(answered > 0, "no other batch was acknowledged meanwhile");
    assert_eq!(a.transport.connections_opened(), 1, "the other batches shared the connection");
    fake.endpoint.close(0u32.into(), b"done");
    server.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_batch_write_resets_its_stream() {
    const WINDOW: u32 = 64 * 1024;
    let mut a = default_node(1 << 20).await;
    // A receiver with a small stream window that stops reading after one
    // window's worth, so the batch cannot finish on its own.
    let mut transport = quinn::TransportConfig::default();
    transport.stream_receive_window(WINDOW.into());
    let fake = FakeReceiver::bind_with(transport_quic::wire::ALPN, transport);
    let accepting = fake.endpoint.clone();
    let (half_tx, half_rx) = tokio::sync::oneshot::channel();
    let server = tokio::spawn(async move {
        let incoming = accepting.accept().await.unwrap();
        let conn = incoming.await.unwrap();
        fake_server_hello(&conn).await.unwrap();
        let (_send, mut recv) = conn.accept_bi().await.unwrap();
        let mut read = 0usize;
        while read < WINDOW as usize {
            read += recv.read_chunk(usize::MAX, true).await.unwrap().unwrap().bytes.len();
        }
        half_tx.send(()).unwrap();
        // What the stream does once the sender dropped the batch.
        loop {
            match recv.read_chunk(usize::MAX, true).await {
                Ok(Some(_)) => continue,
                other => break other.map(|c| c.map(|c| c.bytes.len())),
            }
        }
    });
    let ops: Vec<WriteOp> =
        (0..16).map(|k| WriteOp { src: a.buf.addr() + k * 65536, dst: k * 65536, len: 65536 }).collect();
    fill(&mut a.buf, &ops);
    let (endpoint, grant) = (fake.endpoint(), any_grant());
    tokio::select! {
        result = a.transport.batch_write(&endpoint, &grant, &ops) => panic!("the batch ended: {result:?}"),
        half = half_rx => half.unwrap(),
    }
    // The batch_write future is dropped: the receiver sees a reset, never a
    // clean end of a truncated batch.
    let end = tokio::time::timeout(BOUND, server).await.expect("the stream neither ended nor reset").unwrap();
    match end {
        Err(quinn::ReadError::Reset(code)) => {
            assert_eq!(code.into_inner(), u64::from(transport_quic::wire::RESET_CANCELLED))
        }
        other => panic!("expected a reset, got {other:?}"),
    }
}
