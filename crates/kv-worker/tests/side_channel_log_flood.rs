//! Malformed side-channel connections cost P's log at most a line a second,
//! however many a host opens, and P keeps serving.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Instant;

use common::*;
use kv_proto::KvRole;
use test_support::Logs;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_connections_log_a_bounded_number_of_lines() {
    const CONNECTIONS: usize = 300;
    let logs = Logs::install(tracing::Level::WARN);
    let net = Net::new(Backend::InMemory).unwrap();
    let p = start(net.config(KvRole::Producer, "p"), net.writer(KvRole::Producer, "p").await).await;
    let d = start(net.config(KvRole::Consumer, "d"), net.writer(KvRole::Consumer, "d").await).await;
    let addr = p.worker.side_channel_addr().unwrap();

    let started = Instant::now();
    for _ in 0..CONNECTIONS {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // Not a kvlink frame: P drops the connection at its first bytes.
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        let _ = tokio::time::timeout(BOUND, tokio::io::AsyncReadExt::read(&mut s, &mut buf)).await;
    }
    let seconds = started.elapsed().as_secs();

    // P still serves an honest pull afterwards.
    let (host, port) = side_channel(&p);
    fill(&p.cache, 9, &[0, 1]);
    ready(&p, "r", &[0, 1]);
    pull(&d, &host, port, &[("r", &[2, 3])]);
    let received = until(&d.worker, |f| !f.receiving.is_empty()).await;
    assert!(received.failed_receiving.is_empty(), "{received:?}");
    assert!(holds(&d.cache, 9, &[2, 3]));
    p.worker.shutdown().await;
    d.worker.shutdown().await;

    let text = logs.text();
    let lines = logs.lines_with(&["side-channel connection dropped"]);
    assert!(
        lines >= 1 && lines as u64 <= 2 + seconds,
        "{lines} lines for {CONNECTIONS} malformed connections in {seconds} s:\n{text}"
    );
}
