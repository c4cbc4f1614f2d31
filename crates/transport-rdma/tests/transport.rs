//! The RDMA `BatchWriter` on a real device, for what the shared conformance
//! suite (`tests/conformance.rs`, which runs the same contract over RDMA)
//! does not see from outside: the windows behind the fence. A sender that
//! cached a grant's windows is refused by the receiver's device once the
//! grant is revoked or expired; every window is invalidated by then; a
//! connection that ends frees its windows at once; a restarted receiver gets
//! a fresh connection. Run with `cargo xtask rdma-test`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_proto::{BatchWriter, Grant, MemoryRegion, RegionAccess, TransportError, WriteOp};
use test_support::TestBuf;
use transport_rdma::{RdmaConfig, RdmaTransport};

const LEN: usize = 1 << 20;
const TTL: Duration = Duration::from_secs(60);

/// A transport and the buffer it registered. Field order: the transport
/// (closed on drop) before the memory.
struct Node {
    writer: Arc<RdmaTransport>,
    buf: TestBuf,
}

fn config() -> RdmaConfig {
    RdmaConfig { connect_timeout: Duration::from_secs(5), io_timeout: Duration::from_secs(20), ..RdmaConfig::default() }
        .with_env(|name| std::env::var(name).ok())
        .unwrap()
}

async fn node(access: RegionAccess, config: RdmaConfig) -> Node {
    let writer = RdmaTransport::bind(config).await.unwrap();
    let buf = TestBuf::new(LEN);
    // SAFETY: `buf` lives in the returned node, whose writer closes first.
    unsafe { writer.register_regions(&[buf.region()], access) }.unwrap();
    Node { writer, buf }
}

async fn sender() -> Node {
    let mut node = node(RegionAccess::Source, config()).await;
    node.buf.bytes_mut().fill(0xab);
    node
}

async fn receiver() -> Node {
    node(RegionAccess::Destination, config()).await
}

/// Eight 4 KiB ops into every other 4 KiB slot of `to` (eight windows).
fn ops(from: &Node, to: &Node) -> Vec<WriteOp> {
    (0..8).map(|k| WriteOp { src: from.buf.at(k * 4096), dst: to.buf.at(k * 8192), len: 4096 }).collect()
}

async fn grant(to: &Node, ops: &[WriteOp], ttl: Duration) -> Grant {
    let ranges: Vec<MemoryRegion> = ops.iter().map(|op| MemoryRegion::new(op.dst, op.len)).collect();
    to.writer.grant(&ranges, ttl).await.unwrap()
}

fn assert_refused(result: Result<(), TransportError>, what: &str) {
    assert!(matches!(result, Err(TransportError::Refused { .. })), "{what}: {result:?}");
}

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_grant_is_refused_by_the_device_even_with_cached_windows() {
    let (a, b) = (sender().await, receiver().await);
    let ops = ops(&a, &b);
    let first = grant(&b, &ops, TTL).await;
    a.writer.batch_write(&b.writer.endpoint(), &first, &ops).await.unwrap();
    assert_eq!(b.writer.bound_windows(), 8, "one window per grant range");

    b.writer.revoke(&first.id).await;
    assert_eq!(b.writer.bound_windows(), 0, "revoke invalidated every window");
    assert_eq!(b.writer.live_grants(), 0);
    let before = b.buf.bytes().to_vec();
    // The sender still holds the windows' keys: its first write fails at
    // the receiver's device, and the batch is refused whole.
    let again = a.writer.batch_write(&b.writer.endpoint(), &first, &ops).await;
    assert_refused(again, "a batch after revoke, with cached windows");
    assert_eq!(b.buf.bytes().to_vec(), before, "a byte landed after revoke");
    // And asking the receiver again is refused too (a new connection).
    assert_refused(a.writer.batch_write(&b.writer.endpoint(), &first, &ops).await, "a batch after revoke");
    assert_eq!(b.buf.bytes().to_vec(), before);

    // A new grant works; its windows reuse the invalidated ones.
    let fresh = grant(&b, &ops, TTL).await;
    a.writer.batch_write(&b.writer.endpoint(), &fresh, &ops).await.unwrap();
    assert!(b.buf.bytes().to_vec()[..4096].iter().all(|&byte| byte == 0xab));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_grant_is_fenced_by_its_timer() {
    let (a, b) = (sender().await, receiver().await);
    let ops = ops(&a, &b);
    let grant = grant(&b, &ops, Duration::from_millis(1500)).await;
    a.writer.batch_write(&b.writer.endpoint(), &grant, &ops).await.unwrap();
    assert_eq!(b.writer.bound_windows(), 8);
    until("the expiry timer invalidates the windows", || b.writer.bound_windows() == 0).await;
    assert_eq!(b.writer.live_grants(), 0);
    let before = b.buf.bytes().to_vec();
    assert_refused(a.writer.batch_write(&b.writer.endpoint(), &grant, &ops).await, "a batch after expiry");
    assert_eq!(b.buf.bytes().to_vec(), before, "a byte landed after expiry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_grant_on_two_connections_has_windows_on_each_and_revoke_fences_both() {
    let (a, c, b) = (sender().await, sender().await, receiver().await);
    let ops_a = ops(&a, &b);
    let ops_c: Vec<WriteOp> = ops_a.iter().map(|op| WriteOp { src: c.buf.at(0), ..*op }).collect();
    let grant = grant(&b, &ops_a, TTL).await;
    a.writer.batch_write(&b.writer.endpoint(), &grant, &ops_a).await.unwrap();
    c.writer.batch_write(&b.writer.endpoint(), &grant, &ops_c).await.unwrap();
    assert_eq!(b.writer.bound_windows(), 16, "a window only works on its own queue pair");
    b.writer.revoke(&grant.id).await;
    assert_eq!(b.writer.bound_windows(), 0);
    let before = b.buf.bytes().to_vec();
    assert_refused(a.writer.batch_write(&b.writer.endpoint(), &grant, &ops_a).await, "first sender after revoke");
    assert_refused(c.writer.batch_write(&b.writer.endpoint(), &grant, &ops_c).await, "second sender after revoke");
    assert_eq!(b.buf.bytes().to_vec(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_ends_frees_its_windows_at_once() {
    let (a, b) = (sender().await, receiver().await);
    let ops = ops(&a, &b);
    let grant = grant(&b, &ops, TTL).await;
    a.writer.batch_write(&b.writer.endpoint(), &grant, &ops).await.unwrap();
    assert_eq!(b.writer.bound_windows(), 8);
    let started = Instant::now();
    a.writer.close();
    until("the receiver frees the windows of the ended connection", || b.writer.bound_windows() == 0).await;
    assert!(started.elapsed() < Duration::from_secs(2), "teardown took {:?}", started.elapsed());
    assert_eq!(b.writer.live_grants(), 1, "the grant outlives the connection");
    // Another sender can still open it.
    let c = sender().await;
    let ops_c: Vec<WriteOp> = ops.iter().map(|op| WriteOp { src: c.buf.at(0), ..*op }).collect();
    c.writer.batch_write(&b.writer.endpoint(), &grant, &ops_c).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_receiver_on_the_same_port_gets_a_fresh_connection() {
    let a = sender().await;
    // Below the ephemeral range: nothing else takes the port while it is free.
    let b = node(
        RegionAccess::Destination,
        RdmaConfig { listen_addr: test_support::ports::restartable_loopback(), ..config() },
    )
    .await;
    let ops = ops(&a, &b);
    let grant1 = grant(&b, &ops, TTL).await;
    a.writer.batch_write(&b.writer.endpoint(), &grant1, &ops).await.unwrap();
    let port = b.writer.local_addr();
    let old = b.writer.endpoint();
    // `shutdown` waits for the accept task, so the port is free to bind again
    // (a plain drop closes at once but frees the listener when that task next runs).
    b.writer.shutdown().await;
    drop(b);
    let b2 = node(RegionAccess::Destination, RdmaConfig { listen_addr: port, ..config() }).await;
    assert_eq!(b2.writer.endpoint().address, old.address);
    assert_ne!(b2.writer.endpoint().details, old.details, "a new instance number");
    let ops2: Vec<WriteOp> = ops.iter().map(|op| WriteOp { dst: op.dst - ops[0].dst + b2.buf.at(0), ..*op }).collect();
    let grant2 = grant(&b2, &ops2, TTL).await;
    a.writer.batch_write(&b2.writer.endpoint(), &grant2, &ops2).await.unwrap();
    assert!(b2.buf.bytes().to_vec()[..4096].iter().all(|&byte| byte == 0xab));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_fences_every_window_and_refuses_everything() {
    let (a, b) = (sender().await, receiver().await);
    let ops = ops(&a, &b);
    let grant = grant(&b, &ops, TTL).await;
    a.writer.batch_write(&b.writer.endpoint(), &grant, &ops).await.unwrap();
    b.writer.close();
    assert_eq!(b.writer.bound_windows(), 0);
    assert_eq!(b.writer.live_grants(), 0);
    let before = b.buf.bytes().to_vec();
    let result = a.writer.batch_write(&b.writer.endpoint(), &grant, &ops).await;
    assert!(result.is_err(), "a closed receiver took a batch");
    assert_eq!(b.buf.bytes().to_vec(), before, "a byte landed after close");
}
