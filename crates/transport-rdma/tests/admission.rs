//! Admission of incoming control connections on a real device: a
//! connection in its handshake holds a handshake place (bounded in total
//! and per source host), and takes an established place only once its
//! opening (and proof of the secret) succeeded. Peers that never finish a
//! handshake cannot crowd out an honest, authenticated sender, one host
//! cannot take every handshake place, and a sender without the secret gets
//! no queue pair and no grant. Hostile connections come from 127.0.0.2,
//! honest senders from 127.0.0.1. Run with `cargo xtask rdma-test`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use kv_proto::auth::AuthSecret;
use kv_proto::{AcceptStatus, BatchWriter, MemoryRegion, RegionAccess, TransportError, WriteOp};
use test_support::TestBuf;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use transport_rdma::handshake::opening::{FLAG_AUTH, MAGIC, OPENING_LEN, VERSION};
use transport_rdma::{ListenerLimits, RdmaConfig, RdmaTransport};

const LEN: usize = 1 << 16;
const SECRET: &str = "the data-plane secret";
const HOSTILE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// Upper bound on any single wait here (never reached when things work).
const BOUND: Duration = Duration::from_secs(20);
/// Longer than any test here: a hostile handshake ends only when the test
/// closes it (or when the receiver refuses it).
const LONG: Duration = Duration::from_secs(120);

/// A transport and the buffer it registered; the transport closes first.
struct Node {
    writer: Arc<RdmaTransport>,
    buf: TestBuf,
}

fn config(secret: Option<&str>) -> RdmaConfig {
    RdmaConfig {
        connect_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(20),
        auth_secret: secret.map(AuthSecret::new),
        ..RdmaConfig::default()
    }
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

/// An honest sender (from 127.0.0.1) writes a batch into `victim`; on
/// success the bytes are checked.
async fn honest_batch(victim: &Node, secret: Option<&str>) -> Result<(), TransportError> {
    let mut sender = node(RegionAccess::Source, config(secret)).await;
    sender.buf.bytes_mut().fill(0xab);
    let ops: Vec<WriteOp> =
        (0..4).map(|k| WriteOp { src: sender.buf.at(k * 4096), dst: victim.buf.at(k * 8192), len: 4096 }).collect();
    let ranges: Vec<MemoryRegion> = ops.iter().map(|op| MemoryRegion::new(op.dst, op.len)).collect();
    let grant = victim.writer.grant(&ranges, Duration::from_secs(60)).await.unwrap();
    let written = tokio::time::timeout(BOUND, sender.writer.batch_write(&victim.writer.endpoint(), &grant, &ops))
        .await
        .expect("the honest batch was not answered in time");
    victim.writer.revoke(&grant.id).await;
    let landed = victim.buf.bytes().to_vec();
    let expected = if written.is_ok() { 0xab } else { 0 };
    assert!(
        ops.iter().all(|op| {
            let at = (op.dst - victim.buf.at(0)) as usize;
            landed[at..at + 4096].iter().all(|&b| b == expected)
        }),
        "the batch's ranges do not hold {expected:#x} after {written:?}"
    );
    written
}

/// A TCP connection to `victim`'s control listener from `source`.
async fn connect_from(victim: &Node, source: Ipv4Addr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((source, 0))).unwrap();
    socket.connect(victim.writer.local_addr()).await.unwrap()
}

/// Reads until the receiver closes `stream`; returns what came before.
async fn until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    tokio::time::timeout(BOUND, async {
        let mut chunk = [0u8; 256];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await
    .expect("the receiver kept a connection open");
    got
}

/// How a hostile connection holds its handshake place.
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// Connects and says nothing.
    Silent,
    /// Announces the secret, reads the challenge, never proves it.
    NeverProves,
}

impl Stall {
    fn secret(self) -> Option<&'static str> {
        match self {
            Stall::Silent => None,
            Stall::NeverProves => Some(SECRET),
        }
    }

    async fn open(self, victim: &Node) -> TcpStream {
        let mut stream = connect_from(victim, HOSTILE).await;
        if let Stall::NeverProves = self {
            let mut preamble = MAGIC.to_vec();
            preamble.extend_from_slice(&VERSION.to_le_bytes());
            preamble.extend_from_slice(&FLAG_AUTH.to_le_bytes());
            preamble.extend_from_slice(&[7; 32]);
            stream.write_all(&preamble).await.unwrap();
            let mut accept_and_challenge = [0u8; OPENING_LEN + 64];
            tokio::time::timeout(BOUND, stream.read_exact(&mut accept_and_challenge)).await.unwrap().unwrap();
            let status = u16::from_le_bytes([accept_and_challenge[6], accept_and_challenge[7]]);
            assert_eq!(AcceptStatus::from_code(status), AcceptStatus::Accepted);
        }
        stream
    }
}

/// As many stalled handshakes as the receiver has established places (so
/// one pool for both would be full), from one host up to its share: an
/// honest sender still connects, proves the secret and writes its batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_do_not_crowd_out_an_honest_sender() {
    for stall in [Stall::Silent, Stall::NeverProves] {
        const PLACES: usize = 4;
        let victim = node(
            RegionAccess::Destination,
            RdmaConfig {
                limits: ListenerLimits {
                    max_connections: PLACES,
                    max_handshakes_per_host: PLACES,
                    handshake_timeout: LONG,
                    ..ListenerLimits::default()
                },
                connect_timeout: LONG,
                ..config(stall.secret())
            },
        )
        .await;
        let mut stalled = Vec::new();
        for _ in 0..PLACES {
            stalled.push(stall.open(&victim).await);
        }
        // One more from that host is closed at once: every place before it
        // was taken.
        let over = until_closed(&mut connect_from(&victim, HOSTILE).await).await;
        assert!(over.is_empty(), "{stall:?}: a refused connection is closed unanswered");
        honest_batch(&victim, stall.secret()).await.unwrap_or_else(|e| panic!("{stall:?}: refused: {e}"));
        drop(stalled);
    }
}

/// A host over its share of handshake places is refused at accept, while
/// another host is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_over_its_handshake_share_is_refused_while_others_are_served() {
    let victim = node(
        RegionAccess::Destination,
        RdmaConfig {
            limits: ListenerLimits { max_handshakes_per_host: 2, handshake_timeout: LONG, ..ListenerLimits::default() },
            connect_timeout: LONG,
            ..config(None)
        },
    )
    .await;
    let held = [Stall::Silent.open(&victim).await, Stall::Silent.open(&victim).await];
    let over = until_closed(&mut connect_from(&victim, HOSTILE).await).await;
    assert!(over.is_empty(), "a refused connection is closed unanswered");
    honest_batch(&victim, None).await.expect("another host was refused");
    drop(held);
}

/// Only senders proving the receiver's secret get a queue pair and a grant
/// opened; a sender with a secret refuses a receiver without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_senders_proving_the_secret_are_served() {
    for (sender, receiver, refusal) in [
        (Some(SECRET), Some(SECRET), None),
        (None, Some(SECRET), Some("requires the data-plane shared secret")),
        (Some("guess"), Some(SECRET), Some("proof does not verify")),
        (Some(SECRET), None, Some("has no data-plane shared secret")),
    ] {
        let victim = node(RegionAccess::Destination, config(receiver)).await;
        let result = honest_batch(&victim, sender).await;
        match refusal {
            None => result.unwrap(),
            Some(expected) => {
                let err = result.unwrap_err();
                assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
                assert!(err.to_string().contains(expected), "{err}");
                assert_eq!(victim.writer.bound_windows(), 0, "a window was bound for a refused sender");
            }
        }
    }
}

/// A sender that proved the secret when every established place is taken
/// is told so; the established connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_past_the_connection_limit_is_told_why() {
    let victim = node(
        RegionAccess::Destination,
        RdmaConfig {
            limits: ListenerLimits { max_connections: 1, ..ListenerLimits::default() },
            ..config(Some(SECRET))
        },
    )
    .await;
    let mut first = node(RegionAccess::Source, config(Some(SECRET))).await;
    first.buf.bytes_mut().fill(0xcd);
    let ops = [WriteOp { src: first.buf.at(0), dst: victim.buf.at(LEN - 4096), len: 4096 }];
    let grant = victim.writer.grant(&[MemoryRegion::new(ops[0].dst, 4096)], Duration::from_secs(60)).await.unwrap();
    first.writer.batch_write(&victim.writer.endpoint(), &grant, &ops).await.unwrap();

    let refused = honest_batch(&victim, Some(SECRET)).await.expect_err("a second connection was served");
    assert!(refused.to_string().contains("max_connections"), "{refused}");

    first.writer.batch_write(&victim.writer.endpoint(), &grant, &ops).await.unwrap();
    victim.writer.revoke(&grant.id).await;
    assert!(victim.buf.bytes().to_vec()[LEN - 4096..].iter().all(|&b| b == 0xcd));
}

/// No established place at all refuses every sender, with or without the
/// secret, as TCP and QUIC do (it was once taken as one place).
#[rstest::rstest]
#[case::no_secret(None)]
#[case::with_a_secret(Some(SECRET))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_established_place_refuses_every_sender(#[case] secret: Option<&str>) {
    let victim = node(
        RegionAccess::Destination,
        RdmaConfig { limits: ListenerLimits { max_connections: 0, ..ListenerLimits::default() }, ..config(secret) },
    )
    .await;
    let refused = honest_batch(&victim, secret).await.expect_err("a sender was served without a place");
    assert!(refused.to_string().contains("max_connections"), "{refused}");
    assert_eq!(victim.writer.bound_windows(), 0, "a window was bound for a refused sender");
}
