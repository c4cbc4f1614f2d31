//! Peer death with real processes: the prefill server is killed (SIGKILL)
//! in the middle of a bench session; the decode side must end within its
//! bounds with a one-line error, never hang. (The fault tests with a
//! surviving peer are `faults_process.rs` and `faults_network.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use common::{serve_logging, Proc, BOUND, SHAPE};

#[test]
fn killing_the_prefill_server_mid_session_ends_the_bench_with_one_line() {
    let args = ["--role", "producer", "--listen", "127.0.0.1", "--control-port", "0", "--side-channel-port", "0"];
    let (mut serve, _, control) = serve_logging(None, &args, Some("info"));
    let control = control.to_string();

    // Enough requests that the session is still running when serve dies.
    let mut args = vec!["bench", "--connect", &control, "--requests", "1000000", "--json"];
    args.extend_from_slice(SHAPE);
    let bench = Proc::spawn("kvlink bench", None, &args);
    serve.wait_log("session started", BOUND);

    serve.kill(); // SIGKILL: no goodbye on any connection

    // Bounded: the bench must end on its own.
    let (status, _, stderr) = bench.finish();
    assert!(!status.success(), "bench must fail when its prefill server dies");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("kvlink:")).collect();
    assert_eq!(errors.len(), 1, "exactly one error line, got {stderr:?}");
    eprintln!("bench ended with: {}", errors[0]);
}
