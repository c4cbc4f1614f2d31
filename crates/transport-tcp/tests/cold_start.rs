//! A sender that starts cold (no pooled connection) and writes many large
//! batches to one receiver at once opens more connections than the
//! receiver's handshake places for one host: ten batches of 16 MiB, each
//! spread over two connections, are twenty handshakes from one address
//! against a receiver with the default limits (16 per host). The sender
//! keeps fewer of them in their handshake at once than that, and tries
//! again, within its connect bound, a connection the receiver closed for
//! want of a place (as it must when other senders on its address hold
//! them): every batch lands.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{node, BOUND};
use kv_proto::auth::AuthSecret;
use kv_proto::{BatchWriter, MemoryRegion, WriteOp};
use rstest::rstest;
use tokio::task::JoinSet;
use transport_tcp::{ListenerLimits, TcpConfig};

const BATCHES: usize = 10;
/// At `TcpConfig::parallel_min_bytes` by default: two connections each.
const LARGE: usize = 16 << 20;

/// Writes `BATCHES` batches of `len` bytes at once from a new sender
/// (`sender`) into a new receiver (`receiver`); every one must land.
async fn all_land(sender: TcpConfig, receiver: TcpConfig, len: usize) {
    let receiver = node(receiver, BATCHES * len).await;
    let mut sender = node(sender, len).await;
    // Compared whole: a byte-by-byte loop over 160 MiB is slow in a debug build.
    let expected: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    sender.buf.bytes_mut().copy_from_slice(&expected);
    let (src, dst) = (sender.buf.addr(), receiver.buf.addr());
    let endpoint = receiver.transport.endpoint();
    let mut batches = JoinSet::new();
    for k in 0..BATCHES {
        let op = WriteOp { src, dst: dst + (k * len) as u64, len: len as u64 };
        let grant = receiver.transport.grant(&[MemoryRegion::new(op.dst, op.len)], BOUND).await.unwrap();
        let (writer, endpoint) = (Arc::clone(&sender.transport), endpoint.clone());
        batches.spawn(async move { writer.batch_write(&endpoint, &grant, &[op]).await });
    }
    let mut failed = Vec::new();
    while let Some(done) = batches.join_next().await {
        if let Err(error) = done.unwrap() {
            failed.push(error.to_string());
        }
    }
    assert!(failed.is_empty(), "{} of {BATCHES} batches failed: {failed:?}", failed.len());
    let landed = receiver.buf.bytes();
    for k in 0..BATCHES {
        assert!(landed[k * len..(k + 1) * len] == expected[..], "batch {k} landed wrong");
    }
}

fn with(secret: Option<&str>) -> TcpConfig {
    TcpConfig { auth_secret: secret.map(AuthSecret::new), ..TcpConfig::default() }
}

/// Defaults on both sides: twenty connections against sixteen places.
#[rstest]
#[case::no_secret(None)]
#[case::with_a_secret(Some("the data-plane secret"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_large_batches_from_a_cold_sender_all_land(#[case] secret: Option<&str>) {
    all_land(with(secret), with(secret), LARGE).await;
}

/// A receiver that gives one host a single handshake place, fewer than the
/// sender keeps in flight (as when other senders on the address hold the
/// rest): the connections it closes at once are tried again, and every
/// batch lands.
#[rstest]
#[case::no_secret(None)]
#[case::with_a_secret(Some("the data-plane secret"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_refused_a_place_are_tried_again(#[case] secret: Option<&str>) {
    let len = 1 << 20;
    let sender = TcpConfig { parallel_min_bytes: len as u64, ..with(secret) };
    let limits = ListenerLimits { max_handshakes_per_host: 1, ..ListenerLimits::default() };
    let receiver = TcpConfig { limits, ..with(secret) };
    all_land(sender, receiver, len).await;
}
