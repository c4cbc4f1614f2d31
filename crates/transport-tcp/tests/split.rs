//! A large batch spread over several connections: every byte arrives, and a
//! bad op still gets the whole batch refused with nothing written.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{check, fill, ops, Node};
use kv_proto::{BatchWriter, TransportError, WriteOp};
use transport_tcp::TcpConfig;

fn config(streams: usize) -> TcpConfig {
    TcpConfig { parallel_streams: streams, parallel_min_bytes: 1 << 20, ..TcpConfig::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_large_op_is_split_and_arrives_whole() {
    let mut a = Node::new(config(3), 8 << 20).await;
    let b = Node::with_defaults(8 << 20).await;
    let batch = ops(&a.buf, &b.buf, 1, 8 << 20);
    fill(&mut a.buf, &batch);
    a.transport.batch_write(&b.transport.endpoint(), &batch).await.unwrap();
    check(&b.buf, &batch);
    // How many connections the parts used depends on scheduling (a part
    // done early returns its connection for the next); at most one each.
    assert!((1..=3).contains(&a.transport.connections_opened()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_ops_are_split_at_byte_boundaries() {
    let mut a = Node::new(config(2), 4 << 20).await;
    let b = Node::with_defaults(4 << 20).await;
    // Odd lengths so the cut falls inside an op.
    let batch: Vec<WriteOp> = ops(&a.buf, &b.buf, 999, 4099);
    fill(&mut a.buf, &batch);
    a.transport.batch_write(&b.transport.endpoint(), &batch).await.unwrap();
    check(&b.buf, &batch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_op_in_a_split_batch_is_refused_whole() {
    let mut a = Node::new(config(2), 4 << 20).await;
    let b = Node::with_defaults(4 << 20).await;
    let mut batch = ops(&a.buf, &b.buf, 4, 1 << 20);
    batch[3].dst = b.buf.end() - 10; // straddles the end of the peer's region
    fill(&mut a.buf, &batch);
    let err = a.transport.batch_write(&b.transport.endpoint(), &batch).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{err}");
    assert!(b.buf.is_zero(), "no byte of a refused batch lands");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_advertising_no_regions_is_written_on_one_connection() {
    let mut a = Node::new(config(4), 4 << 20).await;
    let b = Node::with_defaults(4 << 20).await;
    let batch = ops(&a.buf, &b.buf, 1, 4 << 20);
    fill(&mut a.buf, &batch);
    let mut endpoint = b.transport.endpoint();
    endpoint.details.clear();
    a.transport.batch_write(&endpoint, &batch).await.unwrap();
    check(&b.buf, &batch);
    assert_eq!(a.transport.connections_opened(), 1);
}
