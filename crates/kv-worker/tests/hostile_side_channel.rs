//! P's side channel against hostile clients speaking its wire by hand, each
//! case with an honest decode worker pulling at the same time, and the
//! process's file descriptors back to where they were afterwards.
//!
//! Attackers connect from 127.0.0.2 (any 127/8 address is loopback on
//! Linux), the honest D from 127.0.0.1: two hosts as P sees them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use kv_proto::{
    auth, ConnectorMetadata, Endpoint, EngineId, FrameCodec, Grant, GrantId, Hello, HelloReply, KeepAlive, KvRole,
    LayoutKind, Protocol, RecvReqMeta, RemotePrefill, RenewalKey, RenewalSecret, Renewing, ReqId, RequestBlocks,
    SendUpdate, SideMessage, XferRequest,
};
use kv_worker::in_memory::InMemoryNetwork;
use kv_worker::{CacheDims, CacheShape, DataEndpointPolicy, OwnedKvCache, SideChannelCodec, Worker, WorkerConfig};
use test_support::open_fds;
use tokio::net::{TcpSocket, TcpStream};
use tokio_util::codec::Framed;

const BOUND: Duration = Duration::from_secs(20);
const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

fn shape() -> CacheShape {
    CacheShape::try_new(CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers: 2,
        num_blocks: 16,
        block_size: 16,
        num_kv_heads: 1,
        head_dim: 8,
        dtype_bytes: 2,
    })
    .unwrap()
}

struct Pair {
    p: Worker,
    d: Worker,
    _caches: (Arc<OwnedKvCache>, Arc<OwnedKvCache>),
    next: u32,
}

/// A prefill worker configured by `tune`, and an honest decode worker.
async fn pair(tune: impl FnOnce(&mut WorkerConfig)) -> Pair {
    let net = InMemoryNetwork::new();
    let mut p_config =
        WorkerConfig { data_endpoint_policy: DataEndpointPolicy::Any, ..WorkerConfig::loopback(KvRole::Producer, "p") };
    tune(&mut p_config);
    // The honest D holds whatever secret P was given.
    let d_config = WorkerConfig {
        data_endpoint_policy: DataEndpointPolicy::Any,
        auth_secret: p_config.auth_secret.clone(),
        ..WorkerConfig::loopback(KvRole::Consumer, "d")
    };
    let p_cache = Arc::new(OwnedKvCache::allocate(shape()).unwrap());
    let d_cache = Arc::new(OwnedKvCache::allocate(shape()).unwrap());
    // SAFETY: the caches outlive the workers (the pair drops the workers
    // first; the test reads no block).
    let p =
        unsafe { Worker::start_with_writer(p_config, p_cache.registered().clone(), net.writer("p")) }.await.unwrap();
    // SAFETY: as above.
    let d =
        unsafe { Worker::start_with_writer(d_config, d_cache.registered().clone(), net.writer("d")) }.await.unwrap();
    Pair { p, d, _caches: (p_cache, d_cache), next: 0 }
}

impl Pair {
    fn side_channel(&self) -> SocketAddr {
        self.p.side_channel_addr().unwrap()
    }

    /// One honest pull of a ready request, start to finish.
    async fn honest_pull(&mut self) {
        self.next += 1;
        let req = ReqId::new(format!("honest-{}", self.next));
        let on_p = ReqId::new(format!("p-honest-{}", self.next));
        let mut send = ConnectorMetadata::default();
        send.reqs_to_send.insert(on_p.clone(), SendUpdate::Ready { block_ids: vec![0, 1] });
        self.p.start_load_kv(&send);
        let addr = self.side_channel();
        let remote = RemotePrefill {
            remote_host: addr.ip().to_string(),
            remote_port: addr.port(),
            remote_request_id: on_p,
            remote_engine_id: None,
            remote_renewal_key: None,
            bootstrap: None,
        };
        let meta = RecvReqMeta { local_block_ids: vec![2, 3], first_token: None, remote };
        let recv = ConnectorMetadata { reqs_to_recv: BTreeMap::from([(req.clone(), meta)]), ..Default::default() };
        self.d.start_load_kv(&recv);
        let finished = self.d.next_finished(BOUND).await;
        assert!(finished.receiving.contains(&req), "the honest pull failed: {finished:?}");
    }

    async fn shutdown(self) {
        self.p.shutdown().await;
        self.d.shutdown().await;
    }
}

/// Waits (bounded) until the fd count is back to `baseline`.
async fn fds_back_to(baseline: usize) {
    let deadline = Instant::now() + BOUND;
    loop {
        let now = open_fds();
        if now <= baseline {
            return;
        }
        assert!(Instant::now() < deadline, "{now} fds open, {baseline} before the attack");
        tokio::task::yield_now().await;
    }
}

type Raw = Framed<TcpStream, SideChannelCodec>;

async fn connect_from(source: Ipv4Addr, to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((source, 0))).unwrap();
    socket.connect(to).await.unwrap()
}

fn framed(stream: TcpStream) -> Raw {
    Framed::new(stream, SideChannelCodec::new(FrameCodec::new(64 << 20)))
}

/// A raw client that completes the hello as a decode instance would.
async fn hello(to: SocketAddr, codec_limit: usize) -> (Raw, HelloReply) {
    hello_with(to, codec_limit, OwnedKvCache::allocate(shape()).unwrap().registered().layout()).await
}

/// A raw client that says hello with `layout`.
async fn hello_with(to: SocketAddr, codec_limit: usize, layout: kv_proto::CacheLayout) -> (Raw, HelloReply) {
    let stream = connect_from(ATTACKER, to).await;
    let mut raw = Framed::new(stream, SideChannelCodec::new(FrameCodec::new(codec_limit)));
    let hello = Hello {
        client_nonce: auth::fresh_nonce().unwrap(),
        engine_id: EngineId::new("mallory"),
        protocol: Protocol::Tcp,
        layout,
        identity: kv_proto::ModelIdentity::this_kvlink(),
        topology: kv_proto::RankTopology::single(),
    };
    raw.send(SideMessage::Hello(hello)).await.unwrap();
    let reply = match tokio::time::timeout(BOUND, raw.next()).await.unwrap() {
        Some(Ok(SideMessage::HelloReply(reply))) => reply,
        other => panic!("expected a hello reply, got {other:?}"),
    };
    (raw, reply)
}

fn transfer_request(xfer_id: u64, ids: impl IntoIterator<Item = String>) -> XferRequest {
    XferRequest {
        xfer_id,
        endpoint: Endpoint { protocol: Protocol::Tcp, address: "mem://mallory".into(), details: vec![] },
        grant: Grant::plain(GrantId::random().unwrap()),
        wait_budget: Duration::from_secs(30),
        region_base_addrs: vec![0x1000; 4],
        requests: ids
            .into_iter()
            .map(|id| RequestBlocks {
                req_id: ReqId::new(id),
                decode_req_id: None,
                prefill_engine_id: None,
                block_ids: vec![],
                first_token: None,
                may_precede_prefill: false,
            })
            .collect(),
        heads: None,
        piece_blocks: 0,
    }
}

/// Many connections from one host that never say hello cannot keep an
/// honest decode instance from another host out, and all go away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_from_one_host_do_not_lock_out_another() {
    let baseline = open_fds();
    let mut pair = pair(|c| {
        c.side_channel_limits.max_handshakes = 8;
        c.side_channel_limits.max_handshakes_per_host = 4;
        c.side_channel_limits.handshake_timeout = Duration::from_millis(500);
    })
    .await;
    // The honest D's connection to P stays open for reuse: count it in.
    pair.honest_pull().await;
    let with_workers = open_fds();
    let mut silent = Vec::new();
    for _ in 0..64 {
        silent.push(connect_from(ATTACKER, pair.side_channel()).await);
    }
    pair.honest_pull().await;
    // P drops the silent ones at the handshake deadline (or at once, past the limits).
    for mut stream in silent {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(BOUND, tokio::io::AsyncReadExt::read(&mut stream, &mut byte)).await.unwrap();
        assert!(matches!(read, Ok(0) | Err(_)), "P kept a silent connection open: {read:?}");
    }
    pair.honest_pull().await;
    fds_back_to(with_workers).await;
    pair.shutdown().await;
    fds_back_to(baseline).await;
}

/// Connections that complete the hello and then idle are capped, and P
/// closes them at its idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_established_connections_are_capped_and_closed() {
    let mut pair = pair(|c| {
        c.side_channel_limits.max_connections = 4;
        c.side_channel_idle_timeout = Duration::from_millis(300);
    })
    .await;
    let with_workers = open_fds();
    let mut idle = Vec::new();
    for _ in 0..3 {
        let (raw, reply) = hello(pair.side_channel(), 1 << 20).await;
        assert!(matches!(reply, HelloReply::Accepted { .. }), "{reply:?}");
        idle.push(raw);
    }
    // The honest D takes the fourth place; a fifth connection is turned away.
    pair.honest_pull().await;
    let (_, reply) = hello(pair.side_channel(), 1 << 20).await;
    assert!(matches!(&reply, HelloReply::Rejected { reason } if reason.contains("already")), "{reply:?}");
    for mut raw in idle {
        let end = tokio::time::timeout(BOUND, raw.next()).await.expect("P never closed an idle connection");
        assert!(end.is_none(), "expected P to close, got {end:?}");
    }
    // The honest D retires its idle connection too, and pulls again on a new one.
    pair.honest_pull().await;
    drop(reply);
    pair.shutdown().await;
    fds_back_to(with_workers).await;
}

/// A decode instance whose cache differs is turned away at the hello, with
/// every difference named with both values, not request by request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incompatible_decode_instance_is_rejected_at_hello() {
    let mut pair = pair(|_| {}).await;
    let ours = OwnedKvCache::allocate(shape()).unwrap().registered().layout();
    // Heads undeclared: blocks could only be copied whole, so they must agree.
    let theirs = kv_proto::CacheLayout {
        block_tokens: 32,
        dtype_bytes: 1,
        token_layout: kv_proto::TokenLayout::Undeclared,
        block_heads: 0,
        ..ours
    };
    let (_, reply) = hello_with(pair.side_channel(), 1 << 20, theirs).await;
    match reply {
        HelloReply::Rejected { reason } => {
            assert!(reason.contains("tokens per block: decode mallory has 32, prefill p has 16"), "{reason}");
            assert!(reason.contains("bytes per element: decode mallory has 1, prefill p has 2"), "{reason}");
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    pair.honest_pull().await;
    pair.shutdown().await;
}

/// A decode instance that speaks another side-channel version gets an answer
/// in this one, which its decoder reports naming both versions: one clear
/// error at connect time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_protocol_version_fails_at_connect_naming_both() {
    let mut pair = pair(|_| {}).await;
    let mut stream = connect_from(ATTACKER, pair.side_channel()).await;
    // A frame header of version 1 with an empty body.
    let mut old = Vec::new();
    old.extend_from_slice(b"KVLK");
    old.extend_from_slice(&1u16.to_be_bytes());
    old.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    tokio::io::AsyncWriteExt::write_all(&mut stream, &old).await.unwrap();
    // Read with this build's decoder (an old decoder would instead report
    // "protocol version 2, this build speaks 1", naming both too).
    let mut raw = framed(stream);
    match tokio::time::timeout(BOUND, raw.next()).await.unwrap() {
        Some(Ok(SideMessage::HelloReply(HelloReply::Rejected { reason }))) => {
            let ours = kv_proto::PROTOCOL_VERSION;
            assert!(reason.contains("version 1") && reason.contains(&format!("speaks {ours}")), "{reason}");
        }
        other => panic!("expected a rejection naming both versions, got {other:?}"),
    }
    pair.honest_pull().await;
    pair.shutdown().await;
}

/// Durations are peer input too: a wait budget of `Duration::MAX` is served
/// (the fuzz harness found it panicked P's transfer task).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_wait_budget_is_served_not_a_panic() {
    let mut pair = pair(|_| {}).await;
    let (mut raw, reply) = hello(pair.side_channel(), 1 << 20).await;
    assert!(matches!(reply, HelloReply::Accepted { .. }), "{reply:?}");
    let request = XferRequest { wait_budget: Duration::MAX, ..transfer_request(3, ["unknown".to_owned()]) };
    raw.send(SideMessage::XferRequest(request)).await.unwrap();
    match tokio::time::timeout(BOUND, raw.next()).await.unwrap() {
        Some(Ok(SideMessage::XferReply(reply))) => assert_eq!(reply.outcomes.len(), 1),
        other => panic!("expected a reply, got {other:?}"),
    }
    pair.honest_pull().await;
    pair.shutdown().await;
}

/// What a client answers P's challenge with.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// The right proof.
    Proof,
    /// P's own proof sent back (reflection).
    Reflected,
    /// A proof over the same nonces made for the TCP data plane.
    DataPlaneProof,
    /// A proof made with the nonces swapped.
    SwappedNonces,
}

/// P's side-channel authentication accepts only a proof made for this
/// channel, this direction and this connection: reflection and cross-protocol
/// replay are refused, and an honest D is served meanwhile.
#[rstest::rstest]
#[case::the_right_proof(Answer::Proof, true)]
#[case::reflection(Answer::Reflected, false)]
#[case::a_data_plane_proof(Answer::DataPlaneProof, false)]
#[case::swapped_nonces(Answer::SwappedNonces, false)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_channel_proofs_cannot_be_reflected_or_replayed(#[case] answer: Answer, #[case] accepted: bool) {
    let secret = kv_proto::auth::AuthSecret::new("s3cret");
    let mut pair = pair(|c| c.auth_secret = Some(secret.clone())).await;
    let stream = connect_from(ATTACKER, pair.side_channel()).await;
    let mut raw = framed(stream);
    let cache = OwnedKvCache::allocate(shape()).unwrap();
    let hello = Hello {
        client_nonce: auth::fresh_nonce().unwrap(),
        engine_id: EngineId::new("mallory"),
        protocol: Protocol::Tcp,
        layout: cache.registered().layout(),
        identity: kv_proto::ModelIdentity::this_kvlink(),
        topology: kv_proto::RankTopology::single(),
    };
    let context = hello.auth_context();
    let client_nonce = hello.client_nonce;
    raw.send(SideMessage::Hello(hello)).await.unwrap();
    let (server_nonce, server_proof) = match tokio::time::timeout(BOUND, raw.next()).await.unwrap() {
        Some(Ok(SideMessage::HelloReply(HelloReply::Challenge { server_nonce, server_proof }))) => {
            (server_nonce, server_proof)
        }
        other => panic!("expected a challenge, got {other:?}"),
    };
    let transcript = |channel, client_nonce, server_nonce| auth::Transcript {
        channel,
        client_nonce,
        server_nonce,
        context: &context,
    };
    let side = auth::Channel::SideChannel;
    let proof = match answer {
        Answer::Proof => auth::client_proof(&secret, &transcript(side, &client_nonce, &server_nonce)),
        Answer::Reflected => server_proof,
        Answer::DataPlaneProof => {
            auth::client_proof(&secret, &transcript(auth::Channel::DataTcp, &client_nonce, &server_nonce))
        }
        Answer::SwappedNonces => auth::client_proof(&secret, &transcript(side, &server_nonce, &client_nonce)),
    };
    raw.send(SideMessage::AuthProof(proof)).await.unwrap();
    let reply = tokio::time::timeout(BOUND, raw.next()).await.unwrap();
    match (accepted, reply) {
        (true, Some(Ok(SideMessage::HelloReply(HelloReply::Accepted { .. })))) => {}
        (false, Some(Ok(SideMessage::HelloReply(HelloReply::Rejected { reason })))) => {
            assert!(reason.contains("authentication"), "{reason}");
        }
        (_, other) => panic!("{answer:?}: unexpected {other:?}"),
    }
    pair.honest_pull().await;
    pair.shutdown().await;
}

/// A transfer request whose reply could not fit in a frame is refused whole
/// at once, without serving (or building the reply of) any request of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_could_not_fit_is_refused_not_built() {
    let mut pair = pair(|c| c.max_frame_len = 1 << 20).await;
    let (mut raw, reply) = hello(pair.side_channel(), 1 << 20).await;
    assert!(matches!(reply, HelloReply::Accepted { .. }), "{reply:?}");
    raw.send(SideMessage::XferRequest(transfer_request(9, (0..10_000).map(|i| i.to_string())))).await.unwrap();
    match tokio::time::timeout(BOUND, raw.next()).await.unwrap() {
        Some(Ok(SideMessage::XferRefused { xfer_id: 9, reason })) => assert!(reason.contains("frame"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    // The connection stays usable for requests that fit.
    raw.send(SideMessage::XferRequest(transfer_request(10, ["nope".to_owned()]))).await.unwrap();
    match tokio::time::timeout(BOUND, raw.next()).await.unwrap() {
        Some(Ok(SideMessage::XferReply(reply))) => assert_eq!(reply.outcomes.len(), 1),
        other => panic!("expected a reply, got {other:?}"),
    }
    pair.honest_pull().await;
    pair.shutdown().await;
}

/// A client that pipelines transfer requests and never reads the replies
/// holds at most its share of P's admission, then loses its connection;
/// an honest D keeps pulling meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_a_client_never_reads_are_bounded() {
    let mut pair = pair(|c| {
        c.queue_depth = 8;
        c.reply_timeout = Duration::from_millis(500);
    })
    .await;
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((ATTACKER, 0))).unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(pair.side_channel()).await.unwrap();
    let mut raw = framed(stream);
    let cache = OwnedKvCache::allocate(shape()).unwrap();
    let hello = Hello {
        client_nonce: auth::fresh_nonce().unwrap(),
        engine_id: EngineId::new("mallory"),
        protocol: Protocol::Tcp,
        layout: cache.registered().layout(),
        identity: kv_proto::ModelIdentity::this_kvlink(),
        topology: kv_proto::RankTopology::single(),
    };
    raw.send(SideMessage::Hello(hello)).await.unwrap();
    assert!(matches!(raw.next().await, Some(Ok(SideMessage::HelloReply(HelloReply::Accepted { .. })))));
    // Each reply fails 1,000 unknown requests (about 100 kB); none is ever
    // read. The flood goes on until P closes the connection under it.
    let (mut sink, stream) = raw.split();
    let flood = tokio::spawn(async move {
        for xfer_id in 0.. {
            let ids = (0..1000).map(|i| format!("unknown-{xfer_id}-{i}"));
            if sink.send(SideMessage::XferRequest(transfer_request(xfer_id, ids))).await.is_err() {
                break;
            }
        }
    });
    pair.honest_pull().await;
    // Meanwhile the client holds at most its share (half of the queue) of
    // P's admission, and the honest D keeps being served.
    let deadline = Instant::now() + BOUND;
    let mut most = 0;
    while !flood.is_finished() {
        most = most.max(pair.p.transfers_in_progress());
        assert!(Instant::now() < deadline, "P kept the connection of a client that does not read its replies");
        tokio::task::yield_now().await;
    }
    assert!(most <= 4, "one connection held {most} of P's 8 admissions");
    while pair.p.transfers_in_progress() > 0 {
        assert!(Instant::now() < deadline, "P still holds {} admissions", pair.p.transfers_in_progress());
        tokio::task::yield_now().await;
    }
    drop(stream);
    flood.await.unwrap();
    pair.honest_pull().await;
    pair.shutdown().await;
}

/// Renewals are peer input too: a flood of renewals naming requests P does
/// not hold renews nothing and costs the peer's connection nothing more
/// than reading it; a renewal before the hello is refused like any other
/// message. An honest pull still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_of_requests_p_does_not_hold_renew_nothing() {
    let mut pair = pair(|_| {}).await;
    let (mut raw, reply) = hello(pair.side_channel(), 64 << 20).await;
    assert!(matches!(reply, HelloReply::Accepted { .. }), "{reply:?}");
    let key = RenewalKey::from_bytes([0x33; 16]);
    let unknown: Vec<Renewing> = (0..kv_proto::MAX_REQUESTS_PER_TRANSFER)
        .map(|i| Renewing { req_id: ReqId::new(format!("not-held-{i}")), key })
        .collect();
    for _ in 0..20 {
        raw.send(SideMessage::KeepAlive(KeepAlive { renewals: unknown.clone() })).await.unwrap();
    }
    // Read in order: once a transfer request behind them is answered, every
    // renewal before it was applied.
    raw.send(SideMessage::XferRequest(transfer_request(1, ["unknown".to_owned()]))).await.unwrap();
    match tokio::time::timeout(BOUND, raw.next()).await.unwrap() {
        Some(Ok(SideMessage::XferReply(reply))) => assert_eq!(reply.outcomes.len(), 1),
        other => panic!("expected a reply, got {other:?}"),
    }
    assert_eq!(pair.p.renewed_requests(), 0, "P renewed requests it does not hold");

    let mut early = framed(connect_from(ATTACKER, pair.side_channel()).await);
    early.send(SideMessage::KeepAlive(KeepAlive { renewals: unknown[..1].to_vec() })).await.unwrap();
    let answer = tokio::time::timeout(BOUND, early.next()).await.unwrap();
    assert!(
        matches!(answer, None | Some(Err(_)) | Some(Ok(SideMessage::HelloReply(HelloReply::Rejected { .. })))),
        "a renewal before the hello was served: {answer:?}"
    );
    pair.honest_pull().await;
    pair.shutdown().await;
}

/// The attack run's hole, over a real side channel: a decode instance that
/// was never given a request's params renews it by P's id. Without the
/// request's renewal key its renewal moves nothing (P still holds the
/// request for its whole lease, and counts the refusal); the same
/// connection naming the key renews it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_without_the_requests_key_moves_nothing() {
    let mut pair = pair(|_| {}).await;
    let victim = ReqId::new("p-victim");
    let key = RenewalSecret::from_bytes([0x21; 32]).key_for(&victim);
    let mut send = ConnectorMetadata::default();
    send.reqs_to_send.insert(victim.clone(), SendUpdate::Ready { block_ids: vec![4, 5] });
    send.renewal_keys.insert(victim.clone(), key);
    pair.p.start_load_kv(&send);

    let (mut raw, reply) = hello(pair.side_channel(), 64 << 20).await;
    assert!(matches!(reply, HelloReply::Accepted { .. }), "{reply:?}");
    let guessed = RenewalKey::from_bytes([0x21; 16]);
    renew_then_sync(&mut raw, Renewing { req_id: victim.clone(), key: guessed }, 1).await;
    assert_eq!(pair.p.renewed_requests(), 0, "a renewal without the key took the request");
    assert_eq!(pair.p.metrics().renewals_refused, 1);
    assert_eq!(pair.p.metrics().renewals_received, 0);

    renew_then_sync(&mut raw, Renewing { req_id: victim, key }, 2).await;
    assert_eq!(pair.p.renewed_requests(), 1, "the key renews it");
    assert_eq!(pair.p.metrics().renewals_received, 1);
    pair.honest_pull().await;
    pair.shutdown().await;
}

/// Sends one renewal, then waits for the answer to a transfer request sent
/// behind it: renewals are read in order, so by then P applied (or
/// refused) it.
async fn renew_then_sync(raw: &mut Raw, renewing: Renewing, xfer_id: u64) {
    raw.send(SideMessage::KeepAlive(KeepAlive { renewals: vec![renewing] })).await.unwrap();
    raw.send(SideMessage::XferRequest(transfer_request(xfer_id, ["unknown".to_owned()]))).await.unwrap();
    match tokio::time::timeout(BOUND, raw.next()).await.unwrap() {
        Some(Ok(SideMessage::XferReply(reply))) => assert_eq!(reply.xfer_id, xfer_id),
        other => panic!("expected a reply, got {other:?}"),
    }
}
