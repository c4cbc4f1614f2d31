//! The `--metrics` endpoint of the real `kvlink` binary: what a bench's
//! workers count agrees with what the bench reports (during the run and
//! after it, held up by `--metrics-hold` until the test closes the bench's
//! standard input), failed pulls show under their cause (a side channel
//! refusing the secret, a prefill process killed mid-bench), `serve`'s
//! counts add up over its sessions, and the endpoint refuses what a hostile
//! client sends without the bench noticing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::collections::BTreeMap;
use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::faults::SLACK;
use common::proxy::{runtime, tally, Proxy, BATCH};
use common::scrape::{exchange, exchange_on, metrics_addr, parse_answer, scrape, Exposition};
use common::{
    assert_one_line_error, connect_from, loopback_bench, loopback_serve, until_closed, Proc, SecretFile, ATTACKER,
    BOUND, SHAPE,
};
use kv_worker::AuthSecret;
use kvlink::metrics::{CONNECTION_DEADLINE, MAX_CONNECTIONS_PER_HOST, MAX_REQUEST_BYTES};

const DECODE: &[(&str, &str)] = &[("role", "decode")];
const PREFILL: &[(&str, &str)] = &[("role", "prefill")];

/// `kvlink bench --json --metrics 127.0.0.1:0 --metrics-hold ARGS`, its
/// standard input held; returns it once its endpoint is announced (its
/// workers are on it then), with the endpoint's address.
fn bench_holding(args: &[&str]) -> (Proc, SocketAddr) {
    let mut all = vec!["bench", "--json", "--metrics", "127.0.0.1:0", "--metrics-hold"];
    all.extend_from_slice(args);
    let bench = Proc::spawn_holding_stdin("kvlink bench", &all);
    let line = bench.wait_log("metrics on http://", BOUND);
    (bench, metrics_addr(&line))
}

/// The bench's JSON report (it holds the endpoint up after printing it).
fn report(bench: &mut Proc) -> serde_json::Value {
    let line = bench.line();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON report ({e}): {line}"))
}

fn u64_of(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// A report's `failures`-like object, as counts.
fn causes(v: &serde_json::Value) -> BTreeMap<String, f64> {
    v.as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .iter()
        .map(|(k, n)| (k.clone(), u64_of(n) as f64))
        .collect()
}

/// Ends a held bench: closes its standard input and waits for its exit.
fn release(mut bench: Proc) -> std::process::ExitStatus {
    bench.close_stdin();
    bench.finish().0
}

/// A `kvlink serve` with `--metrics 127.0.0.1:0`: it, its control address
/// and its metrics address.
fn serve_with_metrics(role: &str, extra: &[&str]) -> (Proc, SocketAddr, SocketAddr) {
    let mut args = vec!["--metrics", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let (serve, control) = loopback_serve(role, &args);
    let line = serve.wait_log("metrics on http://", BOUND);
    (serve, control, metrics_addr(&line))
}

#[test]
fn the_reader_takes_the_format_and_refuses_what_breaks_it() {
    let good = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\",y=\"q\\\"\"} 3\n\
                # HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 3.5\nh_count 2\n";
    let e = Exposition::parse(good);
    assert_eq!(e.one("a_total", &[("x", "1"), ("y", "q\"")]), 3.0);
    for bad in [
        "a_total 3\n",
        "# HELP a A.\n# TYPE a counter\nb 1\n",
        "# HELP a A.\n# TYPE a gauge\na{x=1} 1\n",
        "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 3\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 2\n",
        "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",
    ] {
        assert!(std::panic::catch_unwind(|| Exposition::parse(bad)).is_err(), "{bad:?} passed");
    }
}

#[test]
fn a_bench_scraped_during_and_after_its_run_agrees_with_its_report() {
    const N: u64 = 300;
    let n = N.to_string();
    let mut args = vec!["--requests", n.as_str(), "--warmup", "0"];
    args.extend_from_slice(SHAPE);
    let (mut bench, addr) = bench_holding(&args);

    let during = scrape(addr);
    for role in [DECODE, PREFILL] {
        assert_eq!(during.matching("kvlink_pulls_received_total", role).count(), 1, "{role:?} not shown: {during:?}");
    }
    let received_during = during.sum("kvlink_pulls_received_total", DECODE);
    assert!(received_during <= N as f64, "{received_during}");

    let report = report(&mut bench);
    assert_eq!(u64_of(&report["received"]), N, "{report}");
    assert_eq!(u64_of(&report["failed"]), 0, "{report}");
    assert!(causes(&report["failures"]).is_empty() && causes(&report["send_failures"]).is_empty(), "{report}");
    assert!(report.get("metrics_mismatch").is_none() && report.get("error").is_none(), "{report}");
    let bytes = u64_of(&report["bytes"]) as f64;

    // The workers are shut down: what they counted is still served.
    let after = scrape(addr);
    assert_eq!(after.sum("kvlink_pulls_started_total", DECODE), N as f64);
    assert_eq!(after.sum("kvlink_pulls_received_total", DECODE), N as f64);
    assert_eq!(after.sum("kvlink_received_bytes_total", DECODE), bytes);
    assert_eq!(after.sum("kvlink_pull_seconds_count", DECODE), N as f64);
    assert_eq!(after.sum("kvlink_pull_bytes_sum", DECODE), bytes);
    assert_eq!(after.sum("kvlink_sends_done_total", PREFILL), N as f64);
    assert_eq!(after.sum("kvlink_sent_bytes_total", PREFILL), bytes);
    assert_eq!(after.sum("kvlink_pulls_failed_total", &[]), 0.0);
    assert_eq!(after.sum("kvlink_sends_failed_total", &[]), 0.0);
    assert_eq!(after.sum("kvlink_auth_failures_total", &[]), 0.0);
    // Counters only go up between scrapes.
    for s in during.samples.iter().filter(|s| s.name.ends_with("_total")) {
        let labels: Vec<(&str, &str)> = s.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert!(after.one(&s.name, &labels) >= s.value, "{s:?} went down");
    }
    assert!(release(bench).success());
}

/// The bench proves its secret on the control connection before it
/// starts anything, so a wrong one is refused there and no pull is ever
/// made. A side channel that refuses is driven by the test as the proxy:
/// D is told a secret P does not share.
#[test]
fn a_side_channel_with_another_secret_fails_the_pulls_under_auth_failed() {
    let (p_secret, d_secret) = ("secret-of-prefill", "secret-of-decode");
    let (p_file, d_file) = (SecretFile::new("metrics-p", p_secret), SecretFile::new("metrics-d", d_secret));
    let (p, p_control, p_metrics) = serve_with_metrics("producer", &["--auth-secret-file", p_file.path()]);
    let refused = loopback_bench(p_control, &["--auth-secret-file", d_file.path()]);
    assert_one_line_error(&refused, "shared secret");
    assert!(scrape(p_metrics).samples.is_empty(), "a refused client started no worker");

    let (d, d_control, d_metrics) = serve_with_metrics("consumer", &["--auth-secret-file", d_file.path()]);
    let rt = runtime();
    let (p_key, d_key) = (AuthSecret::new(p_secret.as_bytes()), AuthSecret::new(d_secret.as_bytes()));
    let mut proxy = rt.block_on(Proxy::start_with(p_control, Some(&p_key), d_control, Some(&d_key), "auth"));
    let ids = rt.block_on(proxy.send());
    let ended = rt.block_on(proxy.outcomes(&ids, BOUND));
    assert_eq!(tally(&ended), (0, BATCH, 0), "{ended:?}");

    let on_d = scrape(d_metrics);
    let by_cause = on_d.nonzero_by("kvlink_pulls_failed_total", DECODE, "cause");
    eprintln!("D's failed pulls by cause: {by_cause:?}");
    assert_eq!(by_cause, BTreeMap::from([("auth_failed".to_owned(), BATCH as f64)]));
    assert_eq!(on_d.sum("kvlink_pulls_received_total", DECODE), 0.0);
    // D judged P's proof first (P proves first) and hung up: P saw a
    // connection closed in its handshake, not a wrong proof, and still
    // holds the requests for a pull that never came.
    let on_p = scrape(p_metrics);
    assert_eq!(on_p.sum("kvlink_sends_done_total", PREFILL), 0.0);
    assert_eq!(on_p.sum("kvlink_held_requests", PREFILL), BATCH as f64);
    drop((p, d));
}

/// Waits (bounded) until the endpoint shows at least `n` requests received.
fn until_received(addr: SocketAddr, n: f64) {
    let deadline = Instant::now() + BOUND;
    while scrape(addr).sum("kvlink_pulls_received_total", DECODE) < n {
        assert!(Instant::now() < deadline, "fewer than {n} requests received within {BOUND:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn p_killed_mid_bench_fails_the_pulls_in_flight_and_the_metrics_name_the_cause() {
    let (mut p, p_control) = loopback_serve("producer", &[]);
    let target = p_control.to_string();
    // 16 MiB requests, unverified (a debug build checks bytes slowly): a
    // pull takes long enough that stopping P catches some in flight.
    let (bench, addr) = bench_holding(&[
        "--connect",
        &target,
        "--requests",
        "100000",
        "--no-verify",
        "--layers",
        "4",
        "--heads",
        "8",
        "--head-dim",
        "128",
        "--blocks-per-request",
        "64",
    ]);
    let mut bench = bench;
    let mut received = 8.0;
    for attempt in 0.. {
        assert!(attempt < 20, "P never stopped with pulls in flight");
        until_received(addr, received);
        p.stop();
        if scrape(addr).sum("kvlink_pulls_in_flight", DECODE) > 0.0 {
            break;
        }
        p.signal(libc::SIGCONT);
        received += 1.0;
    }
    p.kill();

    let report = report(&mut bench);
    let failed = u64_of(&report["failed"]);
    assert!(failed >= 1, "{report}");
    assert_eq!(u64_of(&report["warmup_failed"]), 0, "{report}");
    assert!(report["error"].as_str().is_some_and(|e| e.contains(&target)), "{report}");
    assert!(report.get("metrics_mismatch").is_none(), "{report}");
    let reported = causes(&report["failures"]);

    let after = scrape(addr);
    let by_cause = after.nonzero_by("kvlink_pulls_failed_total", DECODE, "cause");
    eprintln!("P killed: {failed} pulls failed, by cause {by_cause:?}");
    assert_eq!(by_cause, reported);
    assert_eq!(by_cause.values().sum::<f64>(), failed as f64);
    // Pulls in flight on the connection P's death reset fail as
    // `connection_lost`, and so does one retried on a fresh connection that
    // is reset in its hello while the killed P's sockets are torn down.
    assert!(by_cause.keys().all(|cause| cause == "connection_lost"), "{by_cause:?}");
    assert_eq!(after.sum("kvlink_pulls_received_total", DECODE), u64_of(&report["received"]) as f64 + 4.0);
    assert!(!release(bench).success(), "a bench whose server went away fails");
}

#[test]
fn serve_metrics_add_up_over_sessions_and_outlive_their_workers() {
    let (serve, control, addr) = serve_with_metrics("producer", &[]);
    assert!(scrape(addr).samples.is_empty(), "no session, no worker");
    let mut bytes = 0;
    for _ in 0..2 {
        let (status, stdout, stderr) = loopback_bench(control, &["--warmup", "0"]);
        assert!(status.success(), "{stdout}\n{stderr}");
        let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        bytes += u64_of(&report["bytes"]);
    }
    let on_p = scrape(addr);
    let prefill = &[("role", "prefill"), ("engine_id", "kvlink-serve-prefill")];
    assert_eq!(on_p.sum("kvlink_sends_done_total", prefill), 40.0);
    assert_eq!(on_p.sum("kvlink_sent_bytes_total", prefill), bytes as f64);
    assert_eq!(on_p.sum("kvlink_sends_failed_total", prefill), 0.0);
    // The sessions' instance is shut down: it holds nothing now.
    assert_eq!(on_p.matching("kvlink_held_requests", prefill).count(), 0, "{on_p:?}");
    assert_eq!(on_p.types.get("kvlink_held_requests").map(String::as_str), Some("gauge"));
    serve.terminate();
    assert!(serve.finish().0.success());
}

fn status(answer: &common::scrape::Answer) -> &str {
    answer.status.as_str()
}

#[test]
fn the_endpoint_refuses_garbage_oversized_and_excess_connections_and_the_bench_goes_on() {
    let mut args = vec!["--requests", "200"];
    args.extend_from_slice(SHAPE);
    let (mut bench, addr) = bench_holding(&args);
    let from_attacker = |request: &[u8]| exchange_on(&mut connect_from(ATTACKER, addr), request);

    let every_byte: Vec<u8> = (0..=255u8).chain(*b"\r\n\r\n").collect();
    let mut oversized = b"GET /metrics HTTP/1.1\r\nX-Filler: ".to_vec();
    oversized.resize(2 * MAX_REQUEST_BYTES, b'a');
    for (request, want) in [
        (&b"\x16\x03\x01\x02\x00garbage\r\n\r\n"[..], "HTTP/1.1 400 Bad Request"),
        (&every_byte[..], "HTTP/1.1 400 Bad Request"),
        (b"GET /metrics HTTP/2.0\r\n\r\n", "HTTP/1.1 400 Bad Request"),
        (b"GET /\r\n\r\n", "HTTP/1.1 400 Bad Request"),
        (b"GET /admin HTTP/1.1\r\n\r\n", "HTTP/1.1 404 Not Found"),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", "HTTP/1.1 405 Method Not Allowed"),
        (&oversized[..], "HTTP/1.1 431 Request Header Fields Too Large"),
    ] {
        let answer = from_attacker(request);
        assert_eq!(status(&answer), want, "{:?}", String::from_utf8_lossy(&request[..request.len().min(40)]));
    }
    let head = from_attacker(b"HEAD /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(status(&head), "HTTP/1.1 200 OK");
    assert!(head.body.is_empty() && head.headers["content-length"] != "0");

    // Silent connections from one host take that host's places and no more:
    // the next one from it is refused at once, another host still scrapes,
    // and the silent ones are cut at the deadline. (From a host of their own:
    // the connections above may still be closing, holding places of theirs.)
    let silent_host = Ipv4Addr::new(127, 0, 0, 3);
    let mut silent: Vec<TcpStream> = (0..MAX_CONNECTIONS_PER_HOST).map(|_| connect_from(silent_host, addr)).collect();
    let opened = Instant::now();
    let mut excess = connect_from(silent_host, addr);
    excess.set_read_timeout(Some(BOUND)).unwrap();
    let mut raw = Vec::new();
    excess.read_to_end(&mut raw).unwrap();
    assert_eq!(parse_answer(&raw).status, "HTTP/1.1 503 Service Unavailable");
    let honest = exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(status(&honest), "HTTP/1.1 200 OK");
    for s in &mut silent {
        until_closed(s, CONNECTION_DEADLINE + SLACK);
    }
    assert!(opened.elapsed() >= CONNECTION_DEADLINE - Duration::from_millis(100), "cut before the deadline");

    let report = report(&mut bench);
    assert_eq!(u64_of(&report["received"]), 200, "{report}");
    assert_eq!(u64_of(&report["failed"]), 0, "{report}");
    // The default warm-up's 4 requests count too.
    assert_eq!(scrape(addr).sum("kvlink_pulls_received_total", DECODE), 204.0);
    assert!(release(bench).success());
}
