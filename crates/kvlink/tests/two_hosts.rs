//! `kvlink serve` and `kvlink bench --connect` as real processes: across two
//! network namespaces joined by a veth pair (the test makes and removes
//! them), on loopback, and the one-line errors a user meets.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const KVLINK: &str = env!("CARGO_BIN_EXE_kvlink");
/// Bound on every wait: readiness, a bench run, an exit.
const BOUND: Duration = Duration::from_secs(90);
/// A small cache: 4 layers, K/V split, 2 KiB blocks.
const SHAPE: &[&str] = &["--layers", "4", "--heads", "1", "--head-dim", "64", "--blocks-per-request", "8"];

/// A child process, killed (and reaped) on drop unless it already exited.
struct Proc {
    name: &'static str,
    child: Child,
    lines: mpsc::Receiver<String>,
    stdout: Vec<String>,
    stderr: Option<JoinHandle<String>>,
}

impl Proc {
    fn spawn(name: &'static str, netns: Option<&str>, args: &[&str]) -> Self {
        let mut cmd = match netns {
            Some(ns) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns, KVLINK]);
                cmd
            }
            None => Command::new(KVLINK),
        };
        let mut child = cmd
            .args(args)
            .stdin(Stdio::null())
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
        let mut err = child.stderr.take().unwrap();
        let stderr = Some(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        }));
        Self { name, child, lines, stdout: Vec::new(), stderr }
    }

    /// The next stdout line (bounded).
    fn line(&mut self) -> String {
        let line = self
            .lines
            .recv_timeout(BOUND)
            .unwrap_or_else(|e| panic!("{}: no output line within {BOUND:?} ({e})", self.name));
        self.stdout.push(line.clone());
        line
    }

    /// Waits (bounded) for the exit; returns status, stdout, stderr.
    fn finish(mut self) -> (ExitStatus, String, String) {
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

    /// Sends SIGTERM (the child is ours and not yet reaped).
    fn terminate(&self) {
        let pid = i32::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) has no memory effects; the pid is our unreaped child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts `kvlink serve` and reads its ready line; returns it and the control address.
fn serve(netns: Option<&str>, args: &[&str]) -> (Proc, String, SocketAddr) {
    let mut all = vec!["serve"];
    all.extend_from_slice(args);
    let mut p = Proc::spawn("kvlink serve", netns, &all);
    let ready = p.line();
    assert!(ready.starts_with("listening control="), "unexpected first line: {ready:?}");
    let control = ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("control="))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no control address in {ready:?}"));
    (p, ready, control)
}

/// Runs `kvlink bench` to its end (bounded).
fn bench(netns: Option<&str>, args: &[&str]) -> (ExitStatus, String, String) {
    let mut all = vec!["bench"];
    all.extend_from_slice(args);
    Proc::spawn("kvlink bench", netns, &all).finish()
}

/// Asserts a bench's JSON report: `n` requests all received and verified.
fn assert_all_verified(n: u64, (status, stdout, stderr): &(ExitStatus, String, String), side: &str) -> f64 {
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
fn assert_one_line_error((status, stdout, stderr): &(ExitStatus, String, String), needle: &str) {
    assert!(!status.success(), "expected a failure; stdout: {stdout}\nstderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {stderr}");
    assert!(lines[0].starts_with("kvlink: ") && lines[0].contains(needle), "{:?} lacks {needle:?}", lines[0]);
}

fn assert_served(serve: Proc, sessions: usize) {
    let (status, stdout, stderr) = serve.finish();
    assert!(status.success(), "serve failed: {status}\nstdout: {stdout}\nstderr: {stderr}");
    let done = stdout.lines().filter(|l| l.starts_with("session from") && l.ends_with("done")).count();
    assert_eq!(done, sessions, "stdout: {stdout}\nstderr: {stderr}");
}

/// Two network namespaces joined by a veth pair, removed on drop (also on
/// panic). Addresses are 10.201.N.1 and .2/24, inside these namespaces only.
struct Namespaces {
    names: Vec<String>,
    subnet: String,
}

impl Namespaces {
    fn ip(args: &[&str]) -> Result<(), String> {
        let out = Command::new("ip").args(args).output().map_err(|e| format!("cannot run ip: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
        }
    }

    /// `None` (after a skip message) when namespaces cannot be made here;
    /// panics if making them fails half-way.
    fn create(tag: &str) -> Option<Self> {
        let pid = std::process::id();
        let a = format!("kvl-{tag}-a-{pid}");
        if let Err(e) = Self::ip(&["netns", "add", &a]) {
            eprintln!("SKIPPED: cannot create network namespaces (needs root and iproute2): {e}");
            return None;
        }
        let mut ns = Self { names: vec![a.clone()], subnet: format!("10.201.{}", pid % 200 + 1) };
        let b = format!("kvl-{tag}-b-{pid}");
        Self::ip(&["netns", "add", &b]).unwrap();
        ns.names.push(b.clone());
        // Interface names are at most 15 bytes.
        let (va, vb) = (format!("kv{tag}a{}", pid % 1_000_000), format!("kv{tag}b{}", pid % 1_000_000));
        Self::ip(&["link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b]).unwrap();
        for (ns_name, dev, host) in [(&a, &va, 1), (&b, &vb, 2)] {
            let addr = format!("{}.{host}/24", ns.subnet);
            Self::ip(&["-n", ns_name, "addr", "add", &addr, "dev", dev]).unwrap();
            Self::ip(&["-n", ns_name, "link", "set", dev, "up"]).unwrap();
            Self::ip(&["-n", ns_name, "link", "set", "lo", "up"]).unwrap();
        }
        Some(ns)
    }

    fn a(&self) -> &str {
        &self.names[0]
    }

    fn b(&self) -> &str {
        &self.names[1]
    }

    fn host(&self, n: u8) -> String {
        format!("{}.{n}", self.subnet)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in &self.names {
            if let Err(e) = Self::ip(&["netns", "del", name]) {
                eprintln!("cannot remove network namespace {name}: {e}");
            }
        }
    }
}

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

fn loopback_serve(role: &str, extra: &[&str]) -> (Proc, SocketAddr) {
    let mut args = vec!["--role", role, "--listen", "127.0.0.1", "--control-port", "0", "--side-channel-port", "0"];
    args.extend_from_slice(extra);
    let (p, _, control) = serve(None, &args);
    (p, control)
}

fn loopback_bench(control: SocketAddr, extra: &[&str]) -> (ExitStatus, String, String) {
    let target = control.to_string();
    let mut args = vec!["--connect", target.as_str(), "--requests", "20", "--json"];
    args.extend_from_slice(SHAPE);
    args.extend_from_slice(extra);
    bench(None, &args)
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
fn layout_mismatch_is_one_line_and_serve_keeps_serving() {
    let (serve, control) =
        loopback_serve("producer", &["--layers", "4", "--head-dim", "64", "--layout", "split", "--sessions", "1"]);
    let out = loopback_bench(control, &["--layout", "fused"]);
    assert_one_line_error(&out, "layout mismatch between P and D: layout Fused (client) vs SplitKv (server)");
    // Refused hellos are not sessions: a matching client is still served.
    assert_all_verified(20, &loopback_bench(control, &[]), "decode");
    assert_served(serve, 1);
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = u32::try_from(body.len()).unwrap().to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// Reads one reply frame; `None` if the server closed the connection.
fn reply(s: &mut TcpStream) -> Option<serde_json::Value> {
    s.set_read_timeout(Some(BOUND)).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    Some(serde_json::from_slice(&body).unwrap())
}

fn assert_refused_and_closed(s: &mut TcpStream, needle: &str) {
    let r = reply(s).expect("an error reply");
    assert_eq!(r["type"], "error", "{r}");
    assert!(r["message"].as_str().unwrap().contains(needle), "{r}");
    assert!(reply(s).is_none(), "the server closes after an error");
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
    let hello = serde_json::json!({"type": "hello", "version": 1, "pattern": "random", "protocol": "Tcp",
        "verify": true, "shape": {"kind": "SplitKv", "num_layers": u32::MAX, "num_blocks": 10, "block_size": u32::MAX,
        "num_kv_heads": u32::MAX, "head_dim": u32::MAX, "dtype_bytes": u32::MAX}});
    s.write_all(&frame(hello.to_string().as_bytes())).unwrap();
    assert_refused_and_closed(&mut s, "shape");
    // A well-formed session asking for what the server cannot do.
    let mut s = TcpStream::connect(control).unwrap();
    let hello = serde_json::json!({"type": "hello", "version": 1, "pattern": "random", "protocol": "Tcp",
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

/// A secret file of this test's own (removed on drop).
struct SecretFile(std::path::PathBuf);

impl SecretFile {
    fn new(tag: &str, secret: &str) -> Self {
        let path = std::env::temp_dir().join(format!("kvlink-secret-{}-{tag}", std::process::id()));
        std::fs::write(&path, format!("{secret}\n")).unwrap();
        Self(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn shared_secret_on_both_hosts_moves_kv_and_a_wrong_one_moves_none() {
    let right = SecretFile::new("right", "s3cret");
    let wrong = SecretFile::new("wrong", "guess");
    let (serve, control) = loopback_serve("producer", &["--sessions", "2", "--auth-secret-file", right.path()]);
    assert_all_verified(20, &loopback_bench(control, &["--auth-secret-file", right.path()]), "decode");
    let (status, stdout, stderr) = loopback_bench(control, &["--auth-secret-file", wrong.path(), "--warmup", "0"]);
    assert!(!status.success(), "a wrong secret must not move KV\nstdout: {stdout}\nstderr: {stderr}");
    if let Ok(report) = serde_json::from_str::<serde_json::Value>(stdout.trim()) {
        assert_eq!(report["received"], 0, "{report}");
    }
    assert_served(serve, 2);
}
