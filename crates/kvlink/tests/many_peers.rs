//! One decode pulling from several producer processes (`bench --connect`
//! repeated), one producer process sharing its prefill instance between
//! concurrent sessions (`serve --max-sessions`), and the figures `serve
//! --figures` prints when idle, as real processes on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::net::{SocketAddr, TcpStream};

use common::{
    assert_all_verified, assert_one_line_error, assert_served, bench, hello_json, loopback_bench, loopback_serve,
    reply, send_frame, Proc, SHAPE,
};

/// `figures rss_bytes=N open_fds=N threads=N tokio_tasks=N` as numbers.
fn figures(line: &str) -> (u64, u64) {
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
    };
    (field("open_fds="), field("tokio_tasks="))
}

/// The next stdout line of `p` that starts with `prefix`.
fn line_starting(p: &mut Proc, prefix: &str) -> String {
    loop {
        let line = p.line();
        if line.starts_with(prefix) {
            return line;
        }
    }
}

#[test]
fn one_decode_pulls_from_three_producers_in_turn_and_each_returns_to_its_baseline() {
    let mut servers: Vec<(Proc, SocketAddr)> =
        (0..3).map(|_| loopback_serve("producer", &["--sessions", "1", "--figures"])).collect();
    let baselines: Vec<String> = servers.iter_mut().map(|(p, _)| line_starting(p, "figures ")).collect();
    let targets: Vec<String> = servers.iter().map(|(_, c)| c.to_string()).collect();
    let mut args = vec!["--requests", "30", "--warmup", "0", "--in-flight", "5", "--json"];
    for t in &targets {
        args.extend(["--connect", t.as_str()]);
    }
    args.extend_from_slice(SHAPE);
    let out = bench(None, &args);
    assert_all_verified(30, &out, "decode");
    let report: serde_json::Value = serde_json::from_str(out.1.trim()).unwrap();
    assert_eq!(report["peers"].as_array().map(Vec::len), Some(3), "{report}");
    let (before, after) = (&report["figures"]["baseline"], &report["figures"]["after"]);
    assert_eq!(before["open_fds"], after["open_fds"], "{report}");
    assert_eq!(before["tokio_tasks"], after["tokio_tasks"], "{report}");
    for ((mut serve, _), baseline) in servers.into_iter().zip(baselines) {
        // Requests went to each in turn: 10 apiece.
        assert_eq!(line_starting(&mut serve, "session from").split(": ").nth(1), Some("10 requests, done"));
        let idle = line_starting(&mut serve, "figures ");
        assert_eq!(figures(&idle), figures(&baseline), "descriptors and tasks after the session: {idle} vs {baseline}");
        assert_served(serve, 1);
    }
}

#[test]
fn several_servers_must_all_be_producers() {
    let (producer, p) = loopback_serve("producer", &[]);
    let (consumer, c) = loopback_serve("consumer", &[]);
    let (p, c) = (p.to_string(), c.to_string());
    let mut args = vec!["--connect", p.as_str(), "--connect", c.as_str(), "--requests", "4"];
    args.extend_from_slice(SHAPE);
    assert_one_line_error(&bench(None, &args), "must all be producers");
    drop((producer, consumer));
}

/// Opens a session by hand with the common small hello; returns its socket.
fn hold_session(control: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(control).unwrap();
    send_frame(&mut s, &hello_json(None));
    let welcome = reply(&mut s).expect("a welcome");
    assert_eq!(welcome["type"], "welcome", "{welcome}");
    s
}

fn bye(mut s: TcpStream) {
    send_frame(&mut s, br#"{"type":"bye"}"#);
    assert_eq!(reply(&mut s).expect("a reply to bye")["type"], "bye");
}

#[test]
fn a_producer_shares_its_instance_between_concurrent_sessions_that_agree() {
    let (serve, control) = loopback_serve("producer", &["--max-sessions", "2"]);
    // The shape and block pattern of `hello_json`: a bench with them joins
    // the held session's instance.
    let joined = |pattern: &str| {
        let target = control.to_string();
        #[rustfmt::skip]
        let args = ["--connect", target.as_str(), "--requests", "20", "--json", "--layers", "2", "--heads", "1",
            "--head-dim", "8", "--blocks-per-request", "8", "--pattern", pattern];
        bench(None, &args)
    };
    let held = hold_session(control);
    assert_all_verified(20, &joined("random"), "decode");
    // Another shape, or another block pattern, cannot share it while it runs.
    let refused = loopback_bench(control, &[]);
    assert_one_line_error(&refused, "cannot share the instance");
    assert!(refused.2.contains("layers 4 (client) vs 2"), "{}", refused.2);
    assert_one_line_error(&joined("contiguous"), "block pattern Contiguous (client) vs Random");
    // Two sessions at once is the most.
    let second = hold_session(control);
    assert_one_line_error(&joined("random"), "busy: serving 2 sessions");
    bye(held);
    bye(second);
    // Once both are gone, a session of another shape starts its own instance.
    assert_all_verified(20, &loopback_bench(control, &[]), "decode");
    serve.terminate();
    let (status, stdout, stderr) = serve.finish();
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    let done = stdout.lines().filter(|l| l.starts_with("session from") && l.ends_with("done")).count();
    assert_eq!(done, 4, "{stdout}");
}

#[test]
fn a_consumer_serves_one_session_at_a_time() {
    let out = Proc::spawn(
        "kvlink serve",
        None,
        &["serve", "--role", "consumer", "--control-port", "0", "--max-sessions", "2"],
    )
    .finish();
    assert_one_line_error(&out, "a consumer serves one session at a time");
}
