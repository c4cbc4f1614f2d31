//! `kvlink serve` and `kvlink bench --connect` as real processes: across two
//! network namespaces joined by a veth pair (the test makes and removes
//! them), on loopback, and the one-line errors a user meets.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::io::Write;
use std::net::TcpStream;

use common::netns::Namespaces;
use common::{
    assert_all_verified, assert_one_line_error, assert_refused_and_closed, assert_served, bench, frame, loopback_bench,
    loopback_serve, reply, serve, Proc, SecretFile, SHAPE,
};

#[test]
fn producer_in_one_namespace_decode_in_another() {
    let Some(ns) = Namespaces::create("p") else { return };
    let p_host = ns.host(1);
    // Default ports (control 18998, side channel 8998): the namespace is ours.
    let (serve, ready, control) = serve(Some(ns.a()), &["--role", "producer", "--listen", &p_host, "--sessions", "1"]);
    assert_eq!(ready, format!("listening control={p_host}:18998 side_channel={p_host}:8998 role=producer"));
    assert_eq!(control.port(), 18998);
    let mut args = vec!["--connect", &p_host, "--requests", "20", "--pattern", "random", "--json"];
    args.extend_from_slice(SHAPE);
    let gbps = assert_all_verified(20, &bench(Some(ns.b()), &args), "decode");
    eprintln!("two namespaces, producer serves: {gbps:.3} GB/s");
    assert_served(serve, 1);
}

#[test]
fn consumer_on_a_wildcard_address_in_one_namespace_prefill_in_another() {
    let Some(ns) = Namespaces::create("c") else { return };
    // Listening on 0.0.0.0 (between hosts; the default is loopback): D
    // advertises the address the client reached.
    let (serve, ready, _) = serve(Some(ns.a()), &["--role", "consumer", "--listen", "0.0.0.0", "--sessions", "1"]);
    assert_eq!(ready, "listening control=0.0.0.0:18998 role=consumer");
    let target = format!("{}:18998", ns.host(1));
    let mut args = vec!["--connect", &target, "--requests", "20", "--pattern", "scattered", "--json"];
    args.extend_from_slice(SHAPE);
    assert_all_verified(20, &bench(Some(ns.b()), &args), "prefill");
    assert_served(serve, 1);
}

#[test]
fn producer_on_loopback_serves_two_sessions() {
    let (serve, control) = loopback_serve("producer", &["--sessions", "2"]);
    assert_all_verified(20, &loopback_bench(control, &[]), "decode");
    assert_all_verified(20, &loopback_bench(control, &["--pattern", "random", "--in-flight", "7"]), "decode");
    assert_served(serve, 2);
}

#[test]
fn consumer_on_loopback() {
    let (serve, control) = loopback_serve("consumer", &["--sessions", "1"]);
    assert_all_verified(20, &loopback_bench(control, &["--layout", "mla"]), "prefill");
    assert_served(serve, 1);
}

#[test]
fn connect_to_nothing_is_one_line() {
    let out = bench(None, &["--connect", "127.0.0.1:1", "--requests", "1"]);
    assert_one_line_error(&out, "cannot reach kvlink serve at 127.0.0.1:1");
}

#[test]
fn second_serve_on_the_same_port_is_one_line() {
    let (_first, control) = loopback_serve("producer", &[]);
    let port = control.port().to_string();
    let second = Proc::spawn(
        "second kvlink serve",
        None,
        &["serve", "--listen", "127.0.0.1", "--control-port", &port, "--side-channel-port", "0"],
    );
    assert_one_line_error(&second.finish(), &format!("control port {port} on 127.0.0.1 is already in use"));
}

#[test]
fn a_rank_whose_side_channel_port_is_past_65535_is_one_line() {
    let out = Proc::spawn(
        "kvlink serve of rank 1",
        None,
        &[
            "serve",
            "--listen",
            "127.0.0.1",
            "--control-port",
            "0",
            "--side-channel-port",
            "65535",
            "--tp-size",
            "2",
            "--tp-rank",
            "1",
        ],
    )
    .finish();
    assert_one_line_error(&out, "--side-channel-port 65535 plus this worker's rank (1) is past port 65535");
}

#[test]
fn layout_mismatch_is_one_line_and_serve_keeps_serving() {
    let (serve, control) =
        loopback_serve("producer", &["--layers", "4", "--head-dim", "64", "--layout", "split", "--sessions", "1"]);
    let out = loopback_bench(control, &["--layout", "fused"]);
    assert_one_line_error(&out, "layout mismatch between P and D: layout Fused (client) vs SplitKv (server)");
    // Refused hellos are not sessions: a matching client is still served.
    assert_all_verified(20, &loopback_bench(control, &[]), "decode");
    assert_served(serve, 1);
}

#[test]
fn bad_peer_input_is_refused_and_serve_keeps_serving() {
    let (serve, control) = loopback_serve("producer", &["--sessions", "1"]);
    // Not JSON.
    let mut s = TcpStream::connect(control).unwrap();
    s.write_all(&frame(b"\xff\x00 not json")).unwrap();
    assert_refused_and_closed(&mut s, "bad message");
    // A frame over the bound: refused from its header, never allocated.
    let mut s = TcpStream::connect(control).unwrap();
    s.write_all(&u32::MAX.to_be_bytes()).unwrap();
    assert_refused_and_closed(&mut s, "bad frame");
    // A shape that would overflow every size computation.
    let mut s = TcpStream::connect(control).unwrap();
    let hello = serde_json::json!({"type": "hello", "version": 2, "pattern": "random", "protocol": "Tcp",
        "verify": true, "shape": {"kind": "SplitKv", "num_layers": u32::MAX, "num_blocks": 10, "block_size": u32::MAX,
        "num_kv_heads": u32::MAX, "head_dim": u32::MAX, "dtype_bytes": u32::MAX}});
    s.write_all(&frame(hello.to_string().as_bytes())).unwrap();
    assert_refused_and_closed(&mut s, "shape");
    // A well-formed session asking for what the server cannot do.
    let mut s = TcpStream::connect(control).unwrap();
    let hello = serde_json::json!({"type": "hello", "version": 2, "pattern": "random", "protocol": "Tcp",
        "verify": true, "shape": {"kind": "SplitKv", "num_layers": 1, "num_blocks": 4, "block_size": 16,
        "num_kv_heads": 1, "head_dim": 8, "dtype_bytes": 2}});
    s.write_all(&frame(hello.to_string().as_bytes())).unwrap();
    let welcome = reply(&mut s).unwrap();
    assert_eq!((welcome["type"].as_str(), welcome["role"].as_str()), (Some("welcome"), Some("kv_producer")));
    // While it runs, a second client is refused as busy.
    assert_one_line_error(&loopback_bench(control, &[]), "busy");
    let too_long = serde_json::json!({"type": "prefill", "prompts": [{"id": "x", "prompt_len": 16 * 5, "seed": 1}]});
    s.write_all(&frame(too_long.to_string().as_bytes())).unwrap();
    assert_refused_and_closed(&mut s, "the requests need 5 blocks, the cache has 4");
    // That was the one session; the server exits cleanly.
    assert_served(serve, 0);
}

#[test]
fn serve_stops_cleanly_on_sigterm() {
    let (serve, _) = loopback_serve("producer", &[]);
    serve.terminate();
    let (status, stdout, stderr) = serve.finish();
    assert!(status.success(), "{status}\nstdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("stopped after 0 sessions"), "{stdout}");
}

#[test]
fn shared_secret_on_both_hosts_moves_kv_and_any_mismatch_is_one_line() {
    let right = SecretFile::new("right", "s3cret");
    let wrong = SecretFile::new("wrong", "guess");
    let (serve, control) = loopback_serve("producer", &["--sessions", "1", "--auth-secret-file", right.path()]);
    // Each mismatch fails at the control hello, before the server starts
    // anything: refused connections are not sessions.
    let out = loopback_bench(control, &["--auth-secret-file", wrong.path()]);
    assert_one_line_error(&out, "failed to prove the shared secret");
    assert_one_line_error(&loopback_bench(control, &[]), "requires the shared secret");
    assert_all_verified(20, &loopback_bench(control, &["--auth-secret-file", right.path()]), "decode");
    assert_served(serve, 1);
    // A client with a secret refuses a server without one.
    let (serve, control) = loopback_serve("consumer", &["--sessions", "1"]);
    let out = loopback_bench(control, &["--auth-secret-file", right.path()]);
    assert_one_line_error(&out, "has no shared secret");
    assert_all_verified(20, &loopback_bench(control, &[]), "prefill");
    assert_served(serve, 1);
}
