//! Connection handling of the sender: pooling and reuse, the peer's op
//! limit, reconnecting to a restarted peer, endpoints and shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use common::{default_node, node, BOUND};
use kv_proto::{BatchWriter, Protocol, RegionAccess, TransportError};
use test_support::pattern::{check, fill, packed_ops};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use transport_tcp::{OpListLimits, TcpConfig, TcpTransport};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_batches_reuse_one_connection() {
    let mut a = default_node(1 << 16).await;
    let b = default_node(1 << 16).await;
    let grant = b.grant_all().await;
    for round in 0..3 {
        let batch = packed_ops(&a.buf, &b.buf, 16, 1024 + round);
        fill(&mut a.buf, &batch);
        a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
        check(&b.buf, &batch);
    }
    assert_eq!(a.transport.connections_opened(), 1);
    assert_eq!(a.transport.idle_connections(), 1);
    assert_eq!(b.transport.connections_accepted(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_keep_at_most_the_idle_bound() {
    let config = TcpConfig { max_idle_conns_per_peer: 2, ..TcpConfig::default() };
    let mut a = node(config, 1 << 20).await;
    let b = default_node(1 << 20).await;
    let all = packed_ops(&a.buf, &b.buf, 8 * 128, 1024);
    fill(&mut a.buf, &all);
    let grant = b.grant_all().await;
    let mut tasks = JoinSet::new();
    for chunk in all.chunks(128) {
        let (writer, endpoint, chunk) = (Arc::clone(&a.transport), b.transport.endpoint(), chunk.to_vec());
        let grant = grant.clone();
        tasks.spawn(async move { writer.batch_write(&endpoint, &grant, &chunk).await });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.unwrap().unwrap();
    }
    check(&b.buf, &all);
    assert!(a.transport.idle_connections() <= 2, "{} idle connections", a.transport.idle_connections());
    assert!(a.transport.connections_opened() <= 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_pooling_when_the_idle_bound_is_zero() {
    let config = TcpConfig { max_idle_conns_per_peer: 0, ..TcpConfig::default() };
    let mut a = node(config, 1 << 16).await;
    let b = default_node(1 << 16).await;
    let batch = packed_ops(&a.buf, &b.buf, 4, 1024);
    fill(&mut a.buf, &batch);
    let grant = b.grant_all().await;
    for _ in 0..2 {
        a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
    }
    check(&b.buf, &batch);
    assert_eq!(a.transport.connections_opened(), 2);
    assert_eq!(a.transport.idle_connections(), 0);
}

/// A batch above the peer's op limit fails before a byte is sent, and the
/// connection stays pooled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_above_the_peers_op_limit_fails_fast() {
    let mut a = default_node(1 << 16).await;
    let config = TcpConfig {
        op_lists: OpListLimits { max_ops_per_batch: 8, ..OpListLimits::default() },
        ..TcpConfig::default()
    };
    let b = node(config, 1 << 16).await;
    let nine = packed_ops(&a.buf, &b.buf, 9, 256);
    fill(&mut a.buf, &nine);
    let grant = b.grant_all().await;
    let err = a.transport.batch_write(&b.transport.endpoint(), &grant, &nine).await.unwrap_err();
    match err {
        TransportError::Refused { reason, .. } => assert!(reason.contains("limit of 8"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert!(b.buf.is_zero());
    a.transport.batch_write(&b.transport.endpoint(), &grant, &nine[..8]).await.unwrap();
    check(&b.buf, &nine[..8]);
    assert_eq!(a.transport.connections_opened(), 1);
}

/// The peer restarts on the same port: the pooled connection is stale, and
/// the next batch goes through on a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_after_the_peer_restarted_on_the_same_port() {
    let mut a = default_node(1 << 16).await;
    // Below the ephemeral range: nothing else takes the port while it is free.
    let listen_addr = test_support::ports::restartable_loopback();
    let b = node(TcpConfig { listen_addr, ..TcpConfig::default() }, 1 << 16).await;
    let endpoint = b.transport.endpoint();
    let batch = packed_ops(&a.buf, &b.buf, 8, 512);
    fill(&mut a.buf, &batch);
    let grant = b.grant_all().await;
    a.transport.batch_write(&endpoint, &grant, &batch).await.unwrap();
    assert_eq!(a.transport.idle_connections(), 1);

    b.transport.shutdown().await;
    let restarted =
        TcpTransport::bind(TcpConfig { listen_addr: b.transport.local_addr(), ..TcpConfig::default() }).await.unwrap();
    // SAFETY: `b.buf` outlives `restarted` (dropped at the end of this test,
    // before `b`); the shut-down `b.transport` no longer touches it.
    unsafe { restarted.register_regions(&[b.buf.region()], RegionAccess::Destination) }.unwrap();
    assert_eq!(restarted.endpoint(), endpoint, "same address, nothing else advertised");
    let second: Vec<_> = batch.iter().map(|op| kv_proto::WriteOp { dst: op.dst + 8192, ..*op }).collect();
    // The old grant died with the old process: the restarted peer refuses it.
    let err = tokio::time::timeout(BOUND, a.transport.batch_write(&endpoint, &grant, &second)).await.unwrap();
    assert!(matches!(err, Err(TransportError::Refused { .. })), "{err:?}");
    let grant = restarted.grant(&[b.buf.region()], BOUND).await.unwrap();
    tokio::time::timeout(BOUND, a.transport.batch_write(&endpoint, &grant, &second)).await.unwrap().unwrap();
    check(&b.buf, &second);
    assert_eq!(a.transport.connections_opened(), 2);
    drop(restarted);
}

/// A peer that went away for good (its process died, or it came back on
/// another port) is never written to again: its pooled connection is closed
/// when the sender pools one of another peer, not kept open forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gone_peers_pooled_connection_is_closed_when_another_peer_is_served() {
    let mut a = default_node(1 << 16).await;
    let gone = default_node(1 << 16).await;
    let other = default_node(1 << 16).await;
    let to_gone = packed_ops(&a.buf, &gone.buf, 4, 256);
    fill(&mut a.buf, &to_gone);
    let grant = gone.grant_all().await;
    a.transport.batch_write(&gone.transport.endpoint(), &grant, &to_gone).await.unwrap();
    assert_eq!(a.transport.idle_connections(), 1);
    gone.transport.shutdown().await;

    let to_other = packed_ops(&a.buf, &other.buf, 4, 256);
    fill(&mut a.buf, &to_other);
    let grant = other.grant_all().await;
    // Each batch pools its connection, looking over the others: bounded
    // rounds, as the gone peer's close may still be on its way.
    for _ in 0..100 {
        a.transport.batch_write(&other.transport.endpoint(), &grant, &to_other).await.unwrap();
        if a.transport.idle_connections() == 1 {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{} idle connections: the gone peer's is still pooled", a.transport.idle_connections());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_name_the_bound_or_advertised_host() {
    let plain = TcpTransport::bind(TcpConfig::default()).await.unwrap();
    let endpoint = plain.endpoint();
    assert_eq!(endpoint.protocol, Protocol::Tcp);
    assert_eq!(endpoint.address, plain.local_addr().to_string());
    assert!(endpoint.details.is_empty());

    let v6 =
        TcpTransport::bind(TcpConfig { advertise_host: Some("::1".to_owned()), ..TcpConfig::default() }).await.unwrap();
    assert_eq!(v6.endpoint().address, format!("[::1]:{}", v6.local_addr().port()));

    // A name is resolved by the sender.
    let mut a = default_node(1 << 16).await;
    let named = TcpConfig { advertise_host: Some("localhost".to_owned()), ..TcpConfig::default() };
    let b = node(named, 1 << 16).await;
    assert_eq!(b.transport.endpoint().address, format!("localhost:{}", b.transport.local_addr().port()));
    let batch = packed_ops(&a.buf, &b.buf, 4, 100);
    fill(&mut a.buf, &batch);
    let grant = b.grant_all().await;
    a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
    check(&b.buf, &batch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_the_listener_and_pooled_connections() {
    let mut a = default_node(1 << 16).await;
    let b = default_node(1 << 16).await;
    let batch = packed_ops(&a.buf, &b.buf, 2, 64);
    fill(&mut a.buf, &batch);
    let grant = b.grant_all().await;
    a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
    let addr: SocketAddr = b.transport.local_addr();
    a.transport.shutdown().await;
    assert_eq!(a.transport.idle_connections(), 0);
    b.transport.shutdown().await;
    assert_eq!(b.transport.live_grants(), 0, "shutdown ends every grant");
    assert!(TcpStream::connect(addr).await.is_err(), "the listener still accepts after shutdown");
    let err = a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
    let err = b.transport.grant(&[b.buf.region()], BOUND).await.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
}

/// `close` is synchronous and final: when it returns, no grant is live, the
/// peer's next batch is not served, and every later call fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_ends_all_access_at_once() {
    let mut a = default_node(1 << 16).await;
    let b = default_node(1 << 16).await;
    let batch = packed_ops(&a.buf, &b.buf, 2, 64);
    fill(&mut a.buf, &batch);
    let grant = b.grant_all().await;
    a.transport.batch_write(&b.transport.endpoint(), &grant, &batch).await.unwrap();
    check(&b.buf, &batch);
    b.transport.close();
    assert_eq!(b.transport.live_grants(), 0);
    let second: Vec<_> = batch.iter().map(|op| kv_proto::WriteOp { dst: op.dst + 4096, ..*op }).collect();
    let err = tokio::time::timeout(BOUND, a.transport.batch_write(&b.transport.endpoint(), &grant, &second))
        .await
        .expect("a batch to a closed peer did not fail within the bound")
        .unwrap_err();
    assert!(!matches!(err, TransportError::Shutdown), "the sender is not shut down: {err:?}");
    assert!(b.buf.bytes()[4096..].iter().all(|&x| x == 0), "a closed transport wrote");
    let extra = test_support::TestBuf::new(4096);
    // SAFETY: refused (the transport is closed), so the buffer is never used.
    let err = unsafe { b.transport.register_regions(&[extra.region()], RegionAccess::Destination) }.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
    let err = b.transport.batch_write(&a.transport.endpoint(), &grant, &batch).await.unwrap_err();
    assert!(matches!(err, TransportError::Shutdown), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_a_taken_port_fails() {
    let first = TcpTransport::bind(TcpConfig::default()).await.unwrap();
    let taken = TcpConfig { listen_addr: first.local_addr(), ..TcpConfig::default() };
    let err = TcpTransport::bind(taken).await.unwrap_err();
    assert!(matches!(err, TransportError::Io { .. }), "{err:?}");
}
