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

use std::net::SocketAddr;
use std::time::Instant;

use common::faults::{
    assert_back_to, assert_p_failed_sending, footprint, send_and_stall, stay_renewed, stay_stopped, LOG, SLACK,
    TRANSFER_TIMEOUT,
};
use common::proxy::{runtime, tally, Proxy};
use common::{serve_logging, Proc, BOUND};
use kv_proto::ReqId;
use rstest::rstest;

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

/// The new P listens on the dead one's side-channel port (a restart), or on
/// another (the dead one is gone for good; D must not keep anything of it).
#[rstest]
#[case::restarted_on_the_same_port(true)]
#[case::another_p_on_another_port(false)]
fn p_killed_mid_batch_fails_its_pulls_and_the_same_d_pulls_from_a_new_p(#[case] same_port: bool) {
    // Below the ephemeral range: nothing else takes it while P is dead.
    let port = test_support::ports::restartable_loopback().port();
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

    // A new P process; D is not restarted.
    let (p2, p2_control) = producer(if same_port { port } else { 0 }, &[]);
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

/// P's ids of `pulls` (what P logs), from the params P returned.
fn prefill_ids(pulls: &[kvlink::PullSpec]) -> Vec<ReqId> {
    pulls.iter().map(|pull| pull.params.prefill_request_id(&pull.id)).collect()
}

/// D has seen a batch and will pull it (it renews P's hold on it), then
/// dies before pulling: P frees the blocks a renewal period after the
/// renewals stop, not at its lease (an hour here); a live D that renews
/// keeps them past many renewal periods and then pulls them.
#[test]
fn d_killed_before_pulling_p_frees_within_a_renewal_not_its_lease() {
    let (p, p_control) = producer(0, &["--lease", "3600", "--lease-renewal", "1"]);
    let (mut d1, d1_control) = consumer(&[]);
    let (_d2, d2_control) = consumer(&[]);
    let rt = runtime();
    let mut proxy = rt.block_on(Proxy::start(p_control, d1_control, "d-gone"));
    rt.block_on(proxy.round(BOUND));

    let watched = rt.block_on(proxy.send_to_watch());
    let on_p = prefill_ids(&watched);
    let ids: Vec<&str> = on_p.iter().map(ReqId::as_str).collect();
    p.wait_log_each(&["request held for a decode instance renewing it"], &ids, SLACK);
    d1.kill();
    let killed = Instant::now();
    rt.block_on(proxy.assert_p_drained(SLACK));
    eprintln!("D killed before pulling: P freed every request after {:?}", killed.elapsed());

    // A live D renews: its requests outlive many renewal periods, then land.
    rt.block_on(proxy.reconnect_d(d2_control));
    let pulls = rt.block_on(proxy.send_to_watch());
    let on_p = prefill_ids(&pulls);
    let ids: Vec<&str> = on_p.iter().map(ReqId::as_str).collect();
    p.wait_log_each(&["request held for a decode instance renewing it"], &ids, SLACK);
    stay_renewed(Instant::now());
    rt.block_on(proxy.d.schedule(&pulls)).unwrap();
    let ids: Vec<_> = pulls.into_iter().map(|pull| pull.id).collect();
    let ended = rt.block_on(proxy.outcomes(&ids, BOUND));
    assert_eq!(tally(&ended), (ids.len(), 0, 0), "{ended:?}");
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
    p.stop();
    d.signal(libc::SIGCONT);
    let stopped = Instant::now();
    let ended = rt.block_on(proxy.outcomes(&ids, TRANSFER_TIMEOUT + SLACK));
    eprintln!("P stopped: {:?} (received, failed, corrupt) after {:?}", tally(&ended), stopped.elapsed());
    assert_eq!(tally(&ended), (0, ids.len(), 0), "{ended:?}");
    stay_stopped(stopped);
    p.signal(libc::SIGCONT);

    // P wakes past D's budget, mostly with the rest of the batch to write:
    // D revoked the grant, so none of it may land, and P fails. (If the
    // rest was in socket buffers already, D took it inside the grant before
    // failing the pull, and P finds the batch acknowledged.) Either way P
    // frees the requests.
    rt.block_on(proxy.assert_p_drained(SLACK));
    rt.block_on(proxy.round(BOUND));
    rt.block_on(proxy.round(BOUND));
    assert_back_to(&p, base_p);
    assert_back_to(&d, base_d);
}
