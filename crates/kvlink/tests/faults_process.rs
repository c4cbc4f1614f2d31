//! Process faults with real processes: a prefill (P) and a decode (D) `kvlink
//! serve`, the test as their proxy (see `common/proxy.rs`). One side is
//! killed (SIGKILL) or stopped (SIGSTOP, longer than D's transfer timeout)
//! while a batch moves: D is stopped once it has read part of the batch's
//! payload (its `/proc/<pid>/io` read count), so the batch is half-way when
//! the fault strikes. Each test checks that every request of the batch
//! ends with a definite outcome within its bound, that the survivor's
//! descriptors and resident set come back near where they were, that no late
//! write lands (the next batch reuses the same blocks on D and is verified
//! byte for byte), and that the survivor serves a new peer or the restarted
//! one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use common::proxy::{runtime, tally, Proxy, BATCH, BLOCKS_PER_REQUEST};
use common::{open_fds, rss_bytes, serve_logging, Proc, BOUND};

/// D's bound on one pull (`--transfer-timeout`), where a test relies on it.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(2);
/// Longer than [`TRANSFER_TIMEOUT`]: how long a stopped process stays stopped.
const STOP: Duration = Duration::from_secs(3);
/// Grace on top of a bound for a loaded machine (process scheduling, a
/// debug build); far below the bounds a missed event would fall back to
/// (60 s default transfer timeout, 480 s lease).
const SLACK: Duration = Duration::from_secs(5);
/// `RUST_LOG` of the servers: P's admission of a transfer request is a
/// debug line.
const LOG: &str = "info,kv_worker=debug";
/// Descriptors a survivor may hold above its baseline (a data-plane
/// connection being replaced).
const FD_SLACK: usize = 2;
/// Resident memory a survivor may hold above its baseline.
const RSS_SLACK: u64 = 16 << 20;
/// Payload D must have read of a batch (32 MiB) for it to count as
/// moving: two blocks.
const PART_OF_A_BATCH: u64 = 512 << 10;

fn producer(side_channel_port: u16, extra: &[&str]) -> (Proc, SocketAddr) {
    let port = side_channel_port.to_string();
    let mut args = vec!["--role", "producer", "--listen", "127.0.0.1", "--control-port", "0"];
    args.extend(["--side-channel-port", &port]);
    args.extend_from_slice(extra);
    let (p, _, control) = serve_logging(None, &args, Some(LOG));
    (p, control)
}

fn consumer(extra: &[&str]) -> (Proc, SocketAddr) {
    let mut args = vec!["--role", "consumer", "--listen", "127.0.0.1", "--control-port", "0"];
    args.extend_from_slice(extra);
    let (d, _, control) = serve_logging(None, &args, Some(LOG));
    (d, control)
}

fn transfer_timeout_arg() -> [String; 2] {
    ["--transfer-timeout".to_owned(), TRANSFER_TIMEOUT.as_secs_f64().to_string()]
}

/// A loopback port free right now (for a P restarted on the same port).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap().local_addr().unwrap().port()
}

/// A process's descriptors and resident set.
#[derive(Clone, Copy, Debug)]
struct Footprint {
    fds: usize,
    rss: u64,
}

fn footprint(p: &Proc) -> Footprint {
    Footprint { fds: open_fds(p.pid()), rss: rss_bytes(p.pid()) }
}

/// Waits (bounded) until `p` is back near `base`.
fn assert_back_to(p: &Proc, base: Footprint) {
    let deadline = Instant::now() + SLACK;
    loop {
        let now = footprint(p);
        if now.fds <= base.fds + FD_SLACK && now.rss <= base.rss + RSS_SLACK {
            eprintln!("survivor {base:?} before, {now:?} after");
            return;
        }
        assert!(Instant::now() < deadline, "survivor leaks: {base:?} before the fault, {now:?} {SLACK:?} after");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Bytes process `pid` has read through system calls (D's `readv` of the
/// payload included).
fn read_bytes(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    io.lines().find_map(|l| l.strip_prefix("rchar:")).unwrap().trim().parse().unwrap()
}

/// Sends a batch and stops it half-way: once D read part of its payload, D
/// is stopped (it can neither read the rest nor acknowledge it). If D had
/// read the whole payload already, that batch ends normally and another is
/// tried. Returns the stalled batch's requests, D left stopped.
fn send_and_stall(rt: &tokio::runtime::Runtime, proxy: &mut Proxy, d: &Proc) -> Vec<kv_proto::ReqId> {
    let shape = common::proxy::shape();
    let batch_bytes = (BATCH * BLOCKS_PER_REQUEST) as u64 * shape.block_len() * u64::from(shape.region_count());
    for _ in 0..5 {
        let before = read_bytes(d.pid());
        let ids = rt.block_on(proxy.send());
        let deadline = Instant::now() + BOUND;
        // Polled without pause: the batch takes milliseconds.
        while read_bytes(d.pid()) < before + PART_OF_A_BATCH {
            assert!(Instant::now() < deadline, "D read no payload within {BOUND:?}");
        }
        d.signal(libc::SIGSTOP);
        if read_bytes(d.pid()) < before + batch_bytes {
            return ids;
        }
        eprintln!("D read the whole batch before it stopped; another one");
        d.signal(libc::SIGCONT);
        let ended = rt.block_on(proxy.outcomes(&ids, BOUND));
        assert_eq!(tally(&ended), (ids.len(), 0, 0), "{ended:?}");
    }
    panic!("every batch went through before D stopped")
}

/// Waits (bounded) for P's log line about failing to send each of `ids`
/// with `reason`.
fn assert_p_failed_sending(p: &Proc, ids: &[kv_proto::ReqId], reason: &str) {
    let ids: Vec<&str> = ids.iter().map(|id| id.as_str()).collect();
    p.wait_log_each(&["sending KV failed", reason], &ids, SLACK);
}

/// Sleeps out the rest of a stop: the fault itself, not a wait for an event.
fn stay_stopped(since: Instant) {
    std::thread::sleep(STOP.saturating_sub(since.elapsed()));
}

#[test]
fn p_killed_mid_batch_fails_its_pulls_and_the_same_d_pulls_from_the_restarted_p() {
    let port = free_port();
    let (mut p, p_control) = producer(port, &[]);
    let timeout = transfer_timeout_arg();
    let (d, d_control) = consumer(&[&timeout[0], &timeout[1]]);
    let rt = runtime();
    let mut proxy = rt.block_on(Proxy::start(p_control, d_control, "p-killed"));
    rt.block_on(proxy.round(BOUND));
    let base = footprint(&d);

    let ids = send_and_stall(&rt, &mut proxy, &d);
    p.kill();
    d.signal(libc::SIGCONT);
    let killed = Instant::now();
    let ended = rt.block_on(proxy.outcomes(&ids, TRANSFER_TIMEOUT + SLACK));
    eprintln!("P killed: {:?} (received, failed, corrupt) after {:?}", tally(&ended), killed.elapsed());
    assert_eq!(tally(&ended), (0, ids.len(), 0), "{ended:?}");

    // A new P process on the same side-channel port; D is not restarted.
    let (p2, p2_control) = producer(port, &[]);
    rt.block_on(proxy.reconnect_p(p2_control));
    rt.block_on(proxy.round(BOUND));
    rt.block_on(proxy.round(BOUND));
    assert_back_to(&d, base);
    drop(p2);
}

#[test]
fn d_killed_mid_batch_p_frees_at_once_and_serves_another_d() {
    // P's lease and D's transfer timeout keep their defaults (480 s, 60 s):
    // P frees the blocks because the connection is gone, not at a bound.
    let (p, p_control) = producer(0, &[]);
    let (mut d1, d1_control) = consumer(&[]);
    let (_d2, d2_control) = consumer(&[]);
    let rt = runtime();
    let mut proxy = rt.block_on(Proxy::start(p_control, d1_control, "d-killed"));
    rt.block_on(proxy.round(BOUND));
    let base = footprint(&p);

    let ids = send_and_stall(&rt, &mut proxy, &d1);
    d1.kill();
    let killed = Instant::now();
    rt.block_on(proxy.assert_p_drained(SLACK));
    eprintln!("D killed: P freed every request after {:?}", killed.elapsed());
    assert_p_failed_sending(&p, &ids, "reason=");

    rt.block_on(proxy.reconnect_d(d2_control));
    rt.block_on(proxy.round(BOUND));
    rt.block_on(proxy.round(BOUND));
    assert_back_to(&p, base);
}

#[test]
fn d_stopped_past_its_transfer_timeout_p_gives_up_in_time_and_d_recovers() {
    let (p, p_control) = producer(0, &[]);
    let timeout = transfer_timeout_arg();
    let (d, d_control) = consumer(&[&timeout[0], &timeout[1]]);
    let rt = runtime();
    let mut proxy = rt.block_on(Proxy::start(p_control, d_control, "d-stopped"));
    rt.block_on(proxy.round(BOUND));
    let (base_p, base_d) = (footprint(&p), footprint(&d));

    let ids = send_and_stall(&rt, &mut proxy, &d);
    let stopped = Instant::now();
    // P's writes are bounded by D's wait budget: P frees while D sleeps.
    rt.block_on(proxy.assert_p_drained(TRANSFER_TIMEOUT + SLACK));
    eprintln!("D stopped: P freed every request after {:?}", stopped.elapsed());
    assert_p_failed_sending(&p, &ids, "wait budget passed");
    stay_stopped(stopped);
    d.signal(libc::SIGCONT);

    let ended = rt.block_on(proxy.outcomes(&ids, SLACK));
    eprintln!("D stopped: {:?} (received, failed, corrupt)", tally(&ended));
    assert_eq!(tally(&ended), (0, ids.len(), 0), "{ended:?}");
    // The same blocks again (contiguous ids): a late byte of the failed
    // batch would make these corrupt.
    rt.block_on(proxy.round(BOUND));
    rt.block_on(proxy.round(BOUND));
    assert_back_to(&p, base_p);
    assert_back_to(&d, base_d);
}

#[test]
fn p_stopped_past_ds_transfer_timeout_d_fails_in_time_and_p_recovers() {
    let (p, p_control) = producer(0, &[]);
    let timeout = transfer_timeout_arg();
    let (d, d_control) = consumer(&[&timeout[0], &timeout[1]]);
    let rt = runtime();
    let mut proxy = rt.block_on(Proxy::start(p_control, d_control, "p-stopped"));
    rt.block_on(proxy.round(BOUND));
    let (base_p, base_d) = (footprint(&p), footprint(&d));

    let ids = send_and_stall(&rt, &mut proxy, &d);
    p.signal(libc::SIGSTOP);
    d.signal(libc::SIGCONT);
    let stopped = Instant::now();
    let ended = rt.block_on(proxy.outcomes(&ids, TRANSFER_TIMEOUT + SLACK));
    eprintln!("P stopped: {:?} (received, failed, corrupt) after {:?}", tally(&ended), stopped.elapsed());
    assert_eq!(tally(&ended), (0, ids.len(), 0), "{ended:?}");
    stay_stopped(stopped);
    p.signal(libc::SIGCONT);

    // P wakes past D's budget with the rest of the batch to write: D
    // revoked the grant, so none of it may land; P fails and frees.
    rt.block_on(proxy.assert_p_drained(SLACK));
    assert_p_failed_sending(&p, &ids, "reason=");
    rt.block_on(proxy.round(BOUND));
    rt.block_on(proxy.round(BOUND));
    assert_back_to(&p, base_p);
    assert_back_to(&d, base_d);
}
