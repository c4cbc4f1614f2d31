//! Helpers shared by the tests that run `kvlink serve` and `kvlink bench` as
//! real processes: bounded waits on their output, the bench's JSON report,
//! one-line errors, raw control frames, secret files and raw sockets from a
//! chosen loopback address.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr, dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub mod faults;
pub mod netns;
pub mod proxy;
pub mod scrape;

pub const KVLINK: &str = env!("CARGO_BIN_EXE_kvlink");
/// Bound on every wait: readiness, a bench run, an exit.
pub const BOUND: Duration = Duration::from_secs(90);
/// A small cache: 4 layers, K/V split, 2 KiB blocks.
pub const SHAPE: &[&str] = &["--layers", "4", "--heads", "1", "--head-dim", "64", "--blocks-per-request", "8"];

/// `kvlink`, in network namespace `netns` when given.
fn kvlink_command(netns: Option<&str>) -> Command {
    match netns {
        Some(ns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns, KVLINK]);
            cmd
        }
        None => Command::new(KVLINK),
    }
}

/// A child process, killed (and reaped) on drop unless it already exited.
pub struct Proc {
    name: &'static str,
    child: Child,
    lines: mpsc::Receiver<String>,
    stdout: Vec<String>,
    stderr: Option<JoinHandle<String>>,
    /// Stderr lines as they come (the whole of it is also kept for `finish`).
    log: mpsc::Receiver<String>,
    /// Its standard input, when the test holds it open.
    stdin: Option<ChildStdin>,
}

impl Proc {
    pub fn spawn(name: &'static str, netns: Option<&str>, args: &[&str]) -> Self {
        let mut cmd = kvlink_command(netns);
        cmd.args(args);
        Self::spawn_command(name, cmd)
    }

    /// Like [`Proc::spawn`], with its standard input held open until
    /// [`Proc::close_stdin`] (or the end of the `Proc`).
    pub fn spawn_holding_stdin(name: &'static str, args: &[&str]) -> Self {
        let mut cmd = kvlink_command(None);
        cmd.args(args);
        Self::start(name, cmd, true)
    }

    /// Closes its standard input (held by [`Proc::spawn_holding_stdin`]).
    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Starts `cmd` with its output piped.
    pub fn spawn_command(name: &'static str, cmd: Command) -> Self {
        Self::start(name, cmd, false)
    }

    fn start(name: &'static str, mut cmd: Command, hold_stdin: bool) -> Self {
        let mut child = cmd
            .stdin(if hold_stdin { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let err = child.stderr.take().unwrap();
        let (log_tx, log) = mpsc::channel();
        let stderr = Some(std::thread::spawn(move || {
            let mut s = String::new();
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let line = without_colors(&line);
                s.push_str(&line);
                s.push('\n');
                let _ = log_tx.send(line);
            }
            s
        }));
        let stdin = child.stdin.take();
        Self { name, child, lines, stdout: Vec::new(), stderr, log, stdin }
    }

    /// The next stdout line (bounded).
    pub fn line(&mut self) -> String {
        let line = self
            .lines
            .recv_timeout(BOUND)
            .unwrap_or_else(|e| panic!("{}: no output line within {BOUND:?} ({e})", self.name));
        self.stdout.push(line.clone());
        line
    }

    /// The next stdout line (bounded), or `None` if the process ended first.
    pub fn try_line(&mut self) -> Option<String> {
        match self.lines.recv_timeout(BOUND) {
            Ok(line) => {
                self.stdout.push(line.clone());
                Some(line)
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
            Err(e) => panic!("{}: no output line within {BOUND:?} ({e})", self.name),
        }
    }

    /// Waits (bounded) for the exit; returns status, stdout, stderr.
    pub fn finish(mut self) -> (ExitStatus, String, String) {
        let deadline = Instant::now() + BOUND;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "{} did not exit within {BOUND:?}", self.name);
            std::thread::sleep(Duration::from_millis(20));
        };
        // The process is gone: its pipes close and the readers end.
        self.stdout.extend(self.lines.try_iter());
        while let Ok(line) = self.lines.recv_timeout(BOUND) {
            self.stdout.push(line);
        }
        let stderr = self.stderr.take().map(|h| h.join().unwrap()).unwrap_or_default();
        (status, self.stdout.join("\n"), stderr)
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM (the child is ours and not yet reaped).
    pub fn terminate(&self) {
        self.signal(libc::SIGTERM);
    }

    /// Sends `signal` (the child is ours and not yet reaped).
    pub fn signal(&self, signal: libc::c_int) {
        let pid = i32::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) has no memory effects; the pid is our unreaped child.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// SIGSTOP, then waits (bounded) until every thread of it is stopped:
    /// kill(2) returns before the process has stopped running.
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let deadline = Instant::now() + BOUND;
        while !test_support::process::all_threads_stopped(self.pid()) {
            assert!(Instant::now() < deadline, "{} did not stop within {BOUND:?}", self.name);
            std::thread::yield_now();
        }
    }

    /// SIGKILL, then reaps it: no goodbye on any of its connections.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// The first stderr line from now on containing `needle`, within
    /// `within`; panics with what it logged otherwise.
    pub fn wait_log(&self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        let mut seen = Vec::new();
        loop {
            match self.log.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line.contains(needle) => return line,
                Ok(line) => seen.push(line),
                Err(e) => panic!(
                    "{}: no log line containing {needle:?} within {within:?} ({e}); it logged:\n{}",
                    self.name,
                    seen.join("\n")
                ),
            }
        }
    }

    /// Waits (bounded) until, for each of `subjects`, a stderr line from now
    /// on contains every one of `needles` and that subject followed by a
    /// space (a field value); panics naming those without one.
    pub fn wait_log_each(&self, needles: &[&str], subjects: &[&str], within: Duration) {
        let deadline = Instant::now() + within;
        let mut missing: Vec<&str> = subjects.to_vec();
        let mut seen = Vec::new();
        while !missing.is_empty() {
            match self.log.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    if needles.iter().all(|n| line.contains(n)) {
                        missing.retain(|s| !line.contains(&format!("{s} ")));
                    }
                    seen.push(line);
                }
                Err(e) => panic!(
                    "{}: no line with {needles:?} within {within:?} ({e}) for {missing:?}; it logged:\n{}",
                    self.name,
                    seen.join("\n")
                ),
            }
        }
    }

    /// Stderr lines logged since the last look, without waiting.
    pub fn logged(&self) -> Vec<String> {
        self.log.try_iter().collect()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // A failing test shows what its processes logged.
        if std::thread::panicking() {
            if let Some(stderr) = self.stderr.take().and_then(|h| h.join().ok()) {
                eprintln!("--- {} (pid {}) logged:\n{stderr}", self.name, self.child.id());
            }
        }
    }
}

/// `line` without ANSI color sequences (`ESC [ ... m`), as log lines are
/// matched on their text.
fn without_colors(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// Starts `kvlink serve` and reads its ready line; returns it and the control address.
pub fn serve(netns: Option<&str>, args: &[&str]) -> (Proc, String, SocketAddr) {
    serve_logging(netns, args, None)
}

/// The control address in `kvlink serve`'s first line.
fn control_of(ready: &str) -> SocketAddr {
    assert!(ready.starts_with("listening control="), "unexpected first line: {ready:?}");
    ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("control="))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no control address in {ready:?}"))
}

/// Like [`serve`], but a server that exits before it listens is its
/// standard error, for tests that try other ports when one was taken.
pub fn try_serve(args: &[&str]) -> Result<(Proc, SocketAddr), String> {
    let mut cmd = kvlink_command(None);
    cmd.arg("serve").args(args);
    let mut p = Proc::spawn_command("kvlink serve", cmd);
    let Some(ready) = p.try_line() else {
        return Err(p.finish().2);
    };
    let control = control_of(&ready);
    Ok((p, control))
}

/// Like [`serve`], with `RUST_LOG` set to `filter` (when given), for tests
/// that wait on the server's log lines.
pub fn serve_logging(netns: Option<&str>, args: &[&str], filter: Option<&str>) -> (Proc, String, SocketAddr) {
    let mut cmd = kvlink_command(netns);
    cmd.arg("serve").args(args);
    if let Some(filter) = filter {
        cmd.env("RUST_LOG", filter);
    }
    let mut p = Proc::spawn_command("kvlink serve", cmd);
    let ready = p.line();
    let control = control_of(&ready);
    (p, ready, control)
}

/// Runs `kvlink bench` to its end (bounded).
pub fn bench(netns: Option<&str>, args: &[&str]) -> (ExitStatus, String, String) {
    let mut all = vec!["bench"];
    all.extend_from_slice(args);
    Proc::spawn("kvlink bench", netns, &all).finish()
}

/// Asserts a bench's JSON report: `n` requests all received and verified.
pub fn assert_all_verified(n: u64, (status, stdout, stderr): &(ExitStatus, String, String), side: &str) -> f64 {
    assert!(status.success(), "bench failed: {status}\nstdout: {stdout}\nstderr: {stderr}");
    let report: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("bench output is not one JSON object ({e}): {stdout}"));
    assert_eq!(report["requests"], n, "{report}");
    assert_eq!(report["received"], n, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    assert_eq!(report["corrupt"], 0, "{report}");
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(report["side"], side, "{report}");
    assert!(report["peer"].is_string(), "{report}");
    assert!(report["bytes"].as_u64().unwrap() > 0, "{report}");
    report["gbytes_per_sec"].as_f64().unwrap()
}

/// An error exit with exactly one line on stderr containing `needle`.
pub fn assert_one_line_error((status, stdout, stderr): &(ExitStatus, String, String), needle: &str) {
    assert!(!status.success(), "expected a failure; stdout: {stdout}\nstderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {stderr}");
    assert!(lines[0].starts_with("kvlink: ") && lines[0].contains(needle), "{:?} lacks {needle:?}", lines[0]);
}

pub fn assert_served(serve: Proc, sessions: usize) {
    let (status, stdout, stderr) = serve.finish();
    assert!(status.success(), "serve failed: {status}\nstdout: {stdout}\nstderr: {stderr}");
    let done = stdout.lines().filter(|l| l.starts_with("session from") && l.ends_with("done")).count();
    assert_eq!(done, sessions, "stdout: {stdout}\nstderr: {stderr}");
}

pub fn loopback_serve(role: &str, extra: &[&str]) -> (Proc, SocketAddr) {
    let mut args = vec!["--role", role, "--listen", "127.0.0.1", "--control-port", "0", "--side-channel-port", "0"];
    args.extend_from_slice(extra);
    let (p, _, control) = serve(None, &args);
    (p, control)
}

pub fn loopback_bench(control: SocketAddr, extra: &[&str]) -> (ExitStatus, String, String) {
    let target = control.to_string();
    let mut args = vec!["--connect", target.as_str(), "--requests", "20", "--json"];
    args.extend_from_slice(SHAPE);
    args.extend_from_slice(extra);
    bench(None, &args)
}

pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = u32::try_from(body.len()).unwrap().to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// Reads one reply frame; `None` if the server closed the connection.
pub fn reply(s: &mut TcpStream) -> Option<serde_json::Value> {
    s.set_read_timeout(Some(BOUND)).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    Some(serde_json::from_slice(&body).unwrap())
}

pub fn assert_refused_and_closed(s: &mut TcpStream, needle: &str) {
    let r = reply(s).expect("an error reply");
    assert_eq!(r["type"], "error", "{r}");
    assert!(r["message"].as_str().unwrap().contains(needle), "{r}");
    assert!(reply(s).is_none(), "the server closes after an error");
}

/// A secret file of this test's own (removed on drop).
pub struct SecretFile(std::path::PathBuf);

impl SecretFile {
    pub fn new(tag: &str, secret: &str) -> Self {
        let path = std::env::temp_dir().join(format!("kvlink-secret-{}-{tag}", std::process::id()));
        std::fs::write(&path, format!("{secret}\n")).unwrap();
        Self(path)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A host the tests attack from: any 127/8 address is loopback on Linux, so
/// the server sees it as another host than the honest bench (127.0.0.1).
pub const ATTACKER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// A TCP connection to `to` from `source`, connected within `within`.
pub fn try_connect_from(source: Ipv4Addr, to: SocketAddr, within: Duration) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&SocketAddr::V4(SocketAddrV4::new(source, 0)).into())?;
    socket.connect_timeout(&to.into(), within)?;
    Ok(socket.into())
}

/// A TCP connection to `to` from `source`.
pub fn connect_from(source: Ipv4Addr, to: SocketAddr) -> TcpStream {
    try_connect_from(source, to, BOUND).unwrap_or_else(|e| panic!("cannot connect from {source} to {to}: {e}"))
}

/// The JSON of a control hello for a small cache, with `client_nonce` if
/// given, exactly as a client would send it.
pub fn hello_json(client_nonce: Option<[u8; 32]>) -> Vec<u8> {
    let mut hello = serde_json::json!({"type": "hello", "version": 2, "pattern": "random", "protocol": "Tcp",
        "verify": true, "shape": {"kind": "SplitKv", "num_layers": 2, "num_blocks": 16, "block_size": 16,
        "num_kv_heads": 1, "head_dim": 8, "dtype_bytes": 2}});
    if let Some(nonce) = client_nonce {
        hello["client_nonce"] = serde_json::json!(nonce);
    }
    hello.to_string().into_bytes()
}

/// Sends one control frame.
pub fn send_frame(s: &mut TcpStream, body: &[u8]) {
    s.write_all(&frame(body)).unwrap();
}

/// Reads one reply frame within `within`; `None` if the server closed the
/// connection (panics if it stays open and silent that long).
pub fn reply_within(s: &mut TcpStream, within: Duration) -> Option<serde_json::Value> {
    s.set_read_timeout(Some(within)).unwrap();
    let mut len = [0u8; 4];
    match s.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            panic!("the server neither answered nor closed within {within:?}")
        }
        Err(_) => return None,
    }
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    Some(serde_json::from_slice(&body).unwrap())
}

/// Waits until the server closes `s` (EOF or reset), discarding what it
/// sends; panics if it is still open after `within`.
pub fn until_closed(s: &mut TcpStream, within: Duration) {
    let deadline = Instant::now() + within;
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "the server kept the connection open past {within:?}");
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut chunk) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}

/// A JSON array of 32 bytes (a nonce or a proof in a control message).
pub fn bytes32(v: &serde_json::Value) -> [u8; 32] {
    let bytes: Vec<u8> = serde_json::from_value(v.clone()).unwrap();
    bytes.try_into().unwrap()
}
