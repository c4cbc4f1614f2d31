//! Network faults with real processes, the test as the proxy of a prefill
//! (P) and a decode (D) `kvlink serve` (see `common/proxy.rs`):
//!
//! - a partition (nftables `drop`) and a connection reset (`reject with tcp
//!   reset`) half-way through a batch, inside a namespace pair of the
//!   test's own (P and the proxy in one, D in the other; the control port
//!   stays open so the proxy can still ask);
//! - a peer that accepts and never answers, as D's side channel and as P's
//!   data endpoint;
//! - an unreachable side channel: nothing listening, or its packets
//!   dropped (nftables, in the namespace pair).
//!
//! Each checks that every request ends with a definite outcome within its
//! bound, that nothing leaks on the survivors, and that they serve the next
//! batches (same blocks on D, verified byte for byte: no late write lands).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::faults::{
    assert_back_to, assert_back_to_with, assert_p_failed_sending, footprint, send_and_stall, LOG, SLACK,
    TRANSFER_TIMEOUT,
};
use common::netns::Namespaces;
use common::proxy::{runtime, shape, tally, Proxy, BATCH, BLOCKS_PER_REQUEST};
use common::{serve_logging, Proc, BOUND};
use kv_proto::{
    CacheLayout, Endpoint, EngineId, FrameCodec, Grant, GrantId, Hello, HelloReply, Outcome, Protocol, ReqId,
    RequestBlocks, SideMessage, XferRequest,
};

/// The control port of both servers in the namespaces (the default): the
/// fault rules spare it.
const CONTROL_PORT: &str = "18998";
/// nftables table of the fault rules, in D's namespace.
const TABLE: &str = "kvlink_fault";

fn transfer_timeout(t: Duration) -> [String; 2] {
    ["--transfer-timeout".to_owned(), t.as_secs_f64().to_string()]
}

/// P in namespace `a` and D in namespace `b`, on the namespaces' addresses.
fn pair(ns: &Namespaces, d_extra: &[String]) -> (Proc, SocketAddr, Proc, SocketAddr) {
    let (p_host, d_host) = (ns.host(1), ns.host(2));
    let (p, _, p_control) = serve_logging(Some(ns.a()), &["--role", "producer", "--listen", &p_host], Some(LOG));
    let mut args = vec!["--role", "consumer", "--listen", &d_host];
    args.extend(d_extra.iter().map(String::as_str));
    let (d, _, d_control) = serve_logging(Some(ns.b()), &args, Some(LOG));
    (p, p_control, d, d_control)
}

fn loopback(role: &str, extra: &[String]) -> (Proc, SocketAddr) {
    let mut args = vec!["--role", role, "--listen", "127.0.0.1", "--control-port", "0", "--side-channel-port", "0"];
    args.extend(extra.iter().map(String::as_str));
    let (p, _, control) = serve_logging(None, &args, Some(LOG));
    (p, control)
}

/// Cuts every TCP packet into namespace `ns` (and out of it, with `both`)
/// but the control port's, with `verdict` (`drop` or `reject with tcp
/// reset`).
fn cut(ns: &str, verdict: &str, both: bool) {
    let nft = |args: &str| Namespaces::nft(ns, args).expect("nftables worked a moment ago");
    nft(&format!("add table inet {TABLE}"));
    let hooks: &[(&str, &str)] = if both { &[("in", "input"), ("out", "output")] } else { &[("in", "input")] };
    for (chain, hook) in hooks {
        nft(&format!("add chain inet {TABLE} {chain} {{ type filter hook {hook} priority 0 ; }}"));
        // One rule per port: nftables 1.0 merges `tcp dport != A tcp sport
        // != A` into one comparison of both ports, which is not the same.
        nft(&format!("add rule inet {TABLE} {chain} tcp dport {CONTROL_PORT} accept"));
        nft(&format!("add rule inet {TABLE} {chain} tcp sport {CONTROL_PORT} accept"));
        nft(&format!("add rule inet {TABLE} {chain} meta l4proto tcp {verdict}"));
    }
}

fn heal(ns: &str) {
    Namespaces::nft(ns, &format!("delete table inet {TABLE}")).expect("nftables worked a moment ago");
}

/// Namespaces with nftables usable in them, or `None` after a skip message.
fn namespaces(tag: &str) -> Option<Namespaces> {
    let ns = Namespaces::create(tag)?;
    Namespaces::nft(ns.b(), "list tables")?;
    Some(ns)
}

/// How a test cuts the link into D's namespace.
struct Cut {
    tag: &'static str,
    /// `drop` or `reject with tcp reset`.
    verdict: &'static str,
    /// Whether what D sends is cut too.
    both: bool,
    /// Data-plane connections D may still hold after the cut: half-open
    /// ones (P's end reset, no reset reached D's) until its data plane's
    /// idle timeout (120 s) closes them.
    d_half_open: usize,
}

/// A batch half-way when the link is cut with `verdict`: D fails it within
/// its transfer timeout, P frees it within `p_bound`, and once the link is
/// back both serve the next batches and hold no more than before.
fn cut_mid_batch(cut_how: Cut, d_timeout: Duration, p_bound: Duration, p_reason: &str) {
    let Cut { tag, verdict, both, d_half_open } = cut_how;
    let Some(ns) = namespaces(tag) else { return };
    // D's receive buffers hold a fraction of a batch (1 MiB, not the 32 MiB
    // loopback allows): a stalled batch leaves P data to send, whose
    // segments meet the cut (a reset rule answers only the packets it sees).
    Namespaces::sysctl(ns.b(), "net.ipv4.tcp_rmem", "4096 131072 1048576");
    Namespaces::within(ns.a(), || {
        let (p, p_control, d, d_control) = pair(&ns, &transfer_timeout(d_timeout));
        let rt = runtime();
        let mut proxy = rt.block_on(Proxy::start(p_control, d_control, tag));
        rt.block_on(proxy.round(BOUND));
        let (base_p, base_d) = (footprint(&p), footprint(&d));

        let ids = send_and_stall(&rt, &mut proxy, &d);
        cut(ns.b(), verdict, both);
        d.signal(libc::SIGCONT);
        let cut_at = Instant::now();
        rt.block_on(proxy.assert_p_drained(p_bound));
        eprintln!("{verdict}: P freed every request after {:?}", cut_at.elapsed());
        assert_p_failed_sending(&p, &ids, p_reason);
        let ended = rt.block_on(proxy.outcomes(&ids, d_timeout + SLACK));
        eprintln!("{verdict}: D ended the batch {:?} after {:?}", tally(&ended), cut_at.elapsed());
        assert_eq!(tally(&ended), (0, BATCH, 0), "{ended:?}");

        heal(ns.b());
        // Retransmissions of the cut batch may reach D now: its grant is
        // revoked, and these batches reuse its blocks.
        rt.block_on(proxy.round(BOUND));
        rt.block_on(proxy.round(BOUND));
        assert_back_to(&p, base_p);
        assert_back_to_with(&d, base_d, d_half_open);
    });
}

#[test]
fn partition_mid_batch_ends_it_on_both_sides_within_ds_budget_and_both_recover() {
    // P's writes stall on a dead link: D's wait budget bounds them.
    let cut = Cut { tag: "np", verdict: "drop", both: true, d_half_open: 0 };
    cut_mid_batch(cut, TRANSFER_TIMEOUT, TRANSFER_TIMEOUT + SLACK, "wait budget passed");
}

/// Resets answer what P sends into D's namespace; what D sends goes out.
/// P's connections are reset, D's stay open without D knowing (a reset
/// never reaches it): D fails the batch at its transfer timeout, and its
/// first request after the cut finds its side-channel connection dead only
/// by sending on it.
#[test]
fn connection_reset_mid_batch_frees_ps_blocks_at_once_and_both_recover() {
    // P frees well before D's budget: on the reset, not at the budget.
    let d_timeout = 2 * TRANSFER_TIMEOUT;
    // The batch moved on two data-plane connections (32 MiB, 16 MiB each).
    let cut = Cut { tag: "nr", verdict: "reject with tcp reset", both: false, d_half_open: 2 };
    cut_mid_batch(cut, d_timeout, TRANSFER_TIMEOUT, "reset");
}

/// A listener that accepts every connection and never sends a byte, nor
/// closes (its connections live as long as the test process).
struct Silent {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
}

impl Silent {
    fn start() -> Self {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming().map_while(Result::ok) {
                held.push(stream);
                count.fetch_add(1, Ordering::SeqCst);
            }
        });
        Self { addr, accepted }
    }
}

#[test]
fn silent_side_channel_fails_ds_pulls_within_its_transfer_timeout() {
    let silent = Silent::start();
    let (_p, p_control) = loopback("producer", &[]);
    let (d, d_control) = loopback("consumer", &transfer_timeout(TRANSFER_TIMEOUT));
    let rt = runtime();
    let mut proxy = rt.block_on(Proxy::start(p_control, d_control, "silent-side-channel"));
    rt.block_on(proxy.round(BOUND));
    let base = footprint(&d);
    for _ in 0..3 {
        let asked = Instant::now();
        let ids = rt.block_on(proxy.pull_from("127.0.0.1", silent.addr.port()));
        let ended = rt.block_on(proxy.outcomes(&ids, TRANSFER_TIMEOUT + SLACK));
        eprintln!("silent side channel: {:?} after {:?}", tally(&ended), asked.elapsed());
        assert_eq!(tally(&ended), (0, BATCH, 0), "{ended:?}");
    }
    assert!(silent.accepted.load(Ordering::SeqCst) > 0, "D never reached the silent peer");
    rt.block_on(proxy.round(BOUND));
    assert_back_to(&d, base);
}

#[test]
fn unreachable_side_channel_fails_ds_pulls_at_once() {
    let (_p, p_control) = loopback("producer", &[]);
    // D's bound is long: a refused connection must not wait for it.
    let (d, d_control) = loopback("consumer", &transfer_timeout(Duration::from_secs(60)));
    let rt = runtime();
    let mut proxy = rt.block_on(Proxy::start(p_control, d_control, "unreachable"));
    rt.block_on(proxy.round(BOUND));
    let base = footprint(&d);
    // A port nothing listens on (bound, then closed).
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port();
    let asked = Instant::now();
    let ids = rt.block_on(proxy.pull_from("127.0.0.1", port));
    let ended = rt.block_on(proxy.outcomes(&ids, SLACK));
    eprintln!("unreachable side channel: {:?} after {:?}", tally(&ended), asked.elapsed());
    assert_eq!(tally(&ended), (0, BATCH, 0), "{ended:?}");
    rt.block_on(proxy.round(BOUND));
    assert_back_to(&d, base);
}

#[test]
fn blackholed_side_channel_fails_ds_pulls_within_its_transfer_timeout() {
    let Some(ns) = namespaces("nb") else { return };
    // What D sends to this port of P's host is dropped: its connect hangs.
    let port = "9";
    for args in [
        format!("add table inet {TABLE}"),
        format!("add chain inet {TABLE} out {{ type filter hook output priority 0 ; }}"),
        format!("add rule inet {TABLE} out tcp dport {port} drop"),
    ] {
        Namespaces::nft(ns.b(), &args).expect("nftables worked a moment ago");
    }
    Namespaces::within(ns.a(), || {
        let (_p, p_control, d, d_control) = pair(&ns, &transfer_timeout(TRANSFER_TIMEOUT));
        let rt = runtime();
        let mut proxy = rt.block_on(Proxy::start(p_control, d_control, "blackholed"));
        rt.block_on(proxy.round(BOUND));
        let base = footprint(&d);
        let asked = Instant::now();
        let ids = rt.block_on(proxy.pull_from(&ns.host(1), port.parse().unwrap()));
        let ended = rt.block_on(proxy.outcomes(&ids, TRANSFER_TIMEOUT + SLACK));
        eprintln!("blackholed side channel: {:?} after {:?}", tally(&ended), asked.elapsed());
        assert_eq!(tally(&ended), (0, BATCH, 0), "{ended:?}");
        rt.block_on(proxy.round(BOUND));
        assert_back_to(&d, base);
    });
}

/// One side-channel frame out, and one in (bounded).
fn exchange(s: &mut TcpStream, msg: &SideMessage) -> SideMessage {
    let codec = FrameCodec::default();
    let mut out = BytesMut::new();
    codec.encode(msg, &mut out).unwrap();
    s.write_all(&out).unwrap();
    s.set_read_timeout(Some(BOUND)).unwrap();
    let mut buf = BytesMut::new();
    loop {
        if let Some(reply) = codec.decode(&mut buf).unwrap() {
            return reply;
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "P closed the side channel");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[test]
fn silent_data_endpoint_fails_ps_writes_within_ds_budget_and_p_serves_the_next_d() {
    let silent = Silent::start();
    let (p, p_control) = loopback("producer", &[]);
    let (_d, d_control) = loopback("consumer", &[]);
    let rt = runtime();
    let mut proxy = rt.block_on(Proxy::start(p_control, d_control, "silent-data"));
    rt.block_on(proxy.round(BOUND));
    let base = footprint(&p);

    // The test is a decode instance whose data endpoint never answers.
    let block_size = shape().block_size() as usize;
    let prompts: Vec<kvlink::PromptSpec> = (0..BATCH as u64)
        .map(|n| kvlink::PromptSpec {
            id: ReqId::new(format!("silent-data-{}-{n}", std::process::id())),
            prompt_len: BLOCKS_PER_REQUEST * block_size,
            seed: n,
        })
        .collect();
    let prefilled = rt.block_on(proxy.p.prefill(&prompts)).unwrap();
    let params = &prefilled[0].1;
    let mut s = TcpStream::connect((params.remote_host.clone().unwrap(), params.remote_port.unwrap())).unwrap();
    let layout = CacheLayout {
        kind: shape().kind(),
        region_count: shape().region_count(),
        block_len: shape().block_len(),
        block_tokens: shape().block_size(),
        dtype_bytes: shape().dtype_bytes(),
        token_layout: kv_proto::TokenLayout::Undeclared,
        block_heads: 0,
    };
    let hello = Hello {
        client_nonce: [7; 32],
        engine_id: EngineId::new("silent-decode"),
        protocol: Protocol::Tcp,
        layout,
        identity: kv_proto::ModelIdentity::this_kvlink(),
        topology: kv_proto::RankTopology::single(),
    };
    match exchange(&mut s, &SideMessage::Hello(hello)) {
        SideMessage::HelloReply(HelloReply::Accepted { .. }) => {}
        other => panic!("hello not accepted: {other:?}"),
    }
    let region_len = shape().region_len();
    let request = XferRequest {
        xfer_id: 1,
        endpoint: Endpoint { protocol: Protocol::Tcp, address: silent.addr.to_string(), details: Vec::new() },
        grant: Grant::plain(GrantId::random().unwrap()),
        wait_budget: TRANSFER_TIMEOUT,
        region_base_addrs: (1..=u64::from(shape().region_count())).map(|r| r * 2 * region_len).collect(),
        requests: prefilled
            .iter()
            .map(|(_, params, _)| RequestBlocks {
                req_id: params.remote_request_id.clone().unwrap(),
                decode_req_id: None,
                prefill_engine_id: params.remote_engine_id.clone(),
                block_ids: (0..BLOCKS_PER_REQUEST as u32).collect(),
                first_token: None,
                may_precede_prefill: false,
            })
            .collect(),
        heads: None,
        piece_blocks: 0,
    };
    let asked = Instant::now();
    let reply = match exchange(&mut s, &SideMessage::XferRequest(request)) {
        SideMessage::XferReply(reply) => reply,
        other => panic!("expected a transfer reply, got {other:?}"),
    };
    eprintln!("silent data endpoint: P replied after {:?}: {:?}", asked.elapsed(), reply.outcomes.first());
    assert!(asked.elapsed() < TRANSFER_TIMEOUT + SLACK, "P replied after {:?}", asked.elapsed());
    assert_eq!(reply.outcomes.len(), BATCH);
    assert!(reply.outcomes.iter().all(|o| matches!(o.outcome, Outcome::Failed { .. })), "{reply:?}");
    assert!(silent.accepted.load(Ordering::SeqCst) > 0, "P never reached the silent endpoint");
    rt.block_on(proxy.assert_p_drained(SLACK));
    drop(s);

    // P serves the honest D still.
    rt.block_on(proxy.round(BOUND));
    assert_back_to(&p, base);
}
