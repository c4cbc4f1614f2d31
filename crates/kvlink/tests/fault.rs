//! Peer death with real processes: the prefill server is killed (SIGKILL)
//! in the middle of a bench session; the decode side must end within its
//! bounds with a one-line error, never hang.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const KVLINK: &str = env!("CARGO_BIN_EXE_kvlink");
const BOUND: Duration = Duration::from_secs(60);

/// Kills the child on drop (also when the test panics).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Lines of a child's stream, read on a thread so waits can be bounded.
fn lines(stream: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The first line containing `needle` (bounded).
fn wait_for(rx: &mpsc::Receiver<String>, needle: &str) -> String {
    let deadline = Instant::now() + BOUND;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(needle) => return line,
            Ok(_) => {}
            Err(e) => panic!("no line containing {needle:?} within {BOUND:?}: {e}"),
        }
    }
}

#[test]
fn killing_the_prefill_server_mid_session_ends_the_bench_with_one_line() {
    let mut serve = Command::new(KVLINK)
        .args(["serve", "--role", "producer", "--listen", "127.0.0.1", "--control-port", "0"])
        .args(["--side-channel-port", "0"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let serve_out = lines(serve.stdout.take().unwrap());
    let serve_log = lines(serve.stderr.take().unwrap());
    let mut serve = Killed(serve);
    let ready = wait_for(&serve_out, "listening control=");
    let control = ready.split_whitespace().find_map(|w| w.strip_prefix("control=")).unwrap().to_owned();

    // Enough requests that the session is still running when serve dies.
    let mut bench = Command::new(KVLINK)
        .args(["bench", "--connect", &control, "--requests", "1000000", "--blocks-per-request", "8"])
        .args(["--layers", "4", "--heads", "1", "--head-dim", "64", "--json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let bench_err = lines(bench.stderr.take().unwrap());
    let mut bench = Killed(bench);
    wait_for(&serve_log, "session started");

    serve.0.kill().unwrap(); // SIGKILL: no goodbye on any connection
    serve.0.wait().unwrap();

    // The bench's stderr closes when it exits: read it to the end (bounded),
    // then reap it.
    let deadline = Instant::now() + BOUND;
    let mut stderr = Vec::new();
    loop {
        match bench_err.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => stderr.push(line),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("bench still running {BOUND:?} after its prefill server died")
            }
        }
    }
    let status = bench.0.wait().unwrap();
    assert!(!status.success(), "bench must fail when its prefill server dies");
    let errors: Vec<&String> = stderr.iter().filter(|l| l.starts_with("kvlink:")).collect();
    assert_eq!(errors.len(), 1, "exactly one error line, got {stderr:?}");
    eprintln!("bench ended with: {}", errors[0]);
}
