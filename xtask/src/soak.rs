//! `cargo xtask soak`: many requests with many in flight between separate
//! `kvlink` processes on loopback, in two phases — several producers (`kvlink
//! serve --role producer`, one each) and one decode (`kvlink bench` with one
//! `--connect` per producer), then one producer shared by several decodes
//! (`--max-sessions`) — and checks that nothing failed, every byte was
//! verified, the resident memory of every process stayed flat after the
//! warm-up, and open descriptors and tokio tasks came back to their baseline.
//!
//! Figures: each bench reports its own and its servers' (`--json`: after the
//! warm-up, at the end, before and after the run); each server prints its
//! own when idle (`--figures`: at start, and once its sessions are gone).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::cmd;

/// Options of `cargo xtask soak`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct SoakArgs {
    /// Measured requests per phase (split evenly over the decodes of phase 2).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) requests: usize,
    /// Requests in flight at once per phase (split over the decodes of phase 2).
    #[arg(long, default_value_t = 512)]
    pub(crate) in_flight: usize,
    /// Warm-up requests before measuring (default: twice --in-flight per decode).
    #[arg(long)]
    pub(crate) warmup: Option<usize>,
    /// Producer processes of phase 1.
    #[arg(long, default_value_t = 4)]
    pub(crate) producers: usize,
    /// Decode processes of phase 2.
    #[arg(long, default_value_t = 2)]
    pub(crate) decoders: usize,
    /// Attention layers (K/V split: two regions each).
    #[arg(long, default_value_t = 4)]
    pub(crate) layers: u32,
    /// Head dimension (one KV head, bf16, 16-token blocks).
    #[arg(long, default_value_t = 128)]
    pub(crate) head_dim: u32,
    /// Blocks per request.
    #[arg(long, default_value_t = 16)]
    pub(crate) blocks_per_request: usize,
    /// Data-plane transport.
    #[arg(long, default_value = "tcp")]
    pub(crate) protocol: String,
    /// Bound on a process's RSS growth from after the warm-up to the end, MiB.
    #[arg(long, default_value_t = 16)]
    pub(crate) rss_growth_mib: u64,
    /// Bound on each phase, seconds.
    #[arg(long, default_value_t = 1800)]
    pub(crate) timeout_secs: u64,
    /// Use a debug build of kvlink (quicker to build; slower to run).
    #[arg(long)]
    pub(crate) debug: bool,
}

impl SoakArgs {
    /// The shortened run of `cargo xtask ci`: well under a minute with a debug build.
    pub(crate) fn ci() -> Self {
        Self {
            requests: 600,
            in_flight: 64,
            warmup: None,
            producers: 4,
            decoders: 2,
            layers: 2,
            head_dim: 64,
            blocks_per_request: 4,
            protocol: "tcp".to_owned(),
            rss_growth_mib: 16,
            timeout_secs: 300,
            debug: true,
        }
    }
}

/// Bound on a server's ready line and on its figures line once its sessions ended.
const SERVER_BOUND: Duration = Duration::from_secs(60);

/// A child whose stdout lines are read on a thread; killed on drop unless it exited.
struct Proc {
    name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(name: String, binary: &Path, args: &[String]) -> Result<Self> {
        let mut child = Command::new(binary)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        let out = child.stdout.take().context("no stdout pipe")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self { name, child, lines })
    }

    /// The next line starting with `prefix` (bounded); other lines are skipped.
    fn line_starting(&self, prefix: &str, deadline: Instant) -> Result<String> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => {}
                Err(e) => bail!("{}: no line starting with {prefix:?} in time ({e})", self.name),
            }
        }
    }

    /// Waits (bounded) for the exit; returns success and every stdout line.
    fn finish(mut self, deadline: Instant) -> Result<(bool, String)> {
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => out.push(line),
                // The process closed its stdout: it is exiting.
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => bail!("{} did not finish in time", self.name),
            }
        }
        let status = self.child.wait().with_context(|| format!("cannot reap {}", self.name))?;
        Ok((status.success(), out.join("\n")))
    }

    /// SIGTERM, then waits (bounded) for a clean exit.
    fn stop(mut self) -> Result<bool> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + SERVER_BOUND;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status.success());
            }
            if Instant::now() >= deadline {
                bail!("{} did not stop on SIGTERM", self.name);
            }
            // Waiting on a child's exit has no event to block on without a
            // signal handler; this poll is bounded by the deadline.
            std::thread::sleep(Duration::from_millis(20));
        }
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

/// What a process held at one point (`kvlink`'s `ProcessFigures`).
#[derive(Clone, Copy, Debug, Default)]
struct Figures {
    rss: u64,
    fds: u64,
    threads: u64,
    tasks: u64,
}

impl Figures {
    fn from_json(v: &serde_json::Value) -> Option<Self> {
        let n = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
        Some(Self { rss: n("rss_bytes")?, fds: n("open_fds")?, threads: n("threads")?, tasks: n("tokio_tasks")? })
    }

    /// From a `figures rss_bytes=N open_fds=N threads=N tokio_tasks=N` line.
    fn from_line(line: &str) -> Option<Self> {
        let fields: BTreeMap<&str, u64> = line
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
            .collect();
        let n = |k: &str| fields.get(k).copied();
        Some(Self { rss: n("rss_bytes")?, fds: n("open_fds")?, threads: n("threads")?, tasks: n("tokio_tasks")? })
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// One process's row in a phase's table.
struct Row {
    name: String,
    /// After the warm-up and at the end of the measured part (as its bench saw it).
    warm: Figures,
    end: Figures,
    /// Before and after (a server: idle before and after its sessions).
    before: Figures,
    after: Figures,
}

/// A phase's outcome: its figures and every check that failed.
struct Phase {
    title: String,
    rows: Vec<Row>,
    problems: Vec<String>,
    requests: u64,
    received: u64,
    failed: u64,
    /// Whether every bench verified every byte it received.
    verified: bool,
    bytes: u64,
    wall: Duration,
    measured_secs: f64,
    p99_ms: f64,
}

impl Phase {
    fn new(title: String) -> Self {
        Self {
            title,
            rows: Vec::new(),
            problems: Vec::new(),
            requests: 0,
            received: 0,
            failed: 0,
            verified: true,
            bytes: 0,
            wall: Duration::ZERO,
            measured_secs: 0.0,
            p99_ms: 0.0,
        }
    }

    fn check_row(&mut self, row: Row, rss_bound: u64) {
        let growth = row.end.rss.saturating_sub(row.warm.rss);
        if growth > rss_bound {
            self.problems.push(format!(
                "{}: RSS grew {:.1} MiB after the warm-up ({:.1} -> {:.1} MiB), more than {:.0} MiB",
                row.name,
                mib(growth),
                mib(row.warm.rss),
                mib(row.end.rss),
                mib(rss_bound)
            ));
        }
        if row.after.fds != row.before.fds {
            self.problems
                .push(format!("{}: {} open descriptors after, {} before", row.name, row.after.fds, row.before.fds));
        }
        if row.after.tasks != row.before.tasks {
            self.problems
                .push(format!("{}: {} tokio tasks after, {} before", row.name, row.after.tasks, row.before.tasks));
        }
        self.rows.push(row);
    }

    /// Adds one bench's report: its counts, and its own row.
    fn add_bench(&mut self, name: &str, ok: bool, stdout: &str, rss_bound: u64) -> Option<serde_json::Value> {
        let report: serde_json::Value = match serde_json::from_str(stdout.trim()) {
            Ok(r) => r,
            Err(e) => {
                self.problems.push(format!("{name}: no JSON report ({e}); it printed: {stdout}"));
                return None;
            }
        };
        let n = |k: &str| report.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
        let f = |k: &str| report.get(k).and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN);
        let (requests, received) = (n("requests"), n("received"));
        let failed = n("failed") + n("corrupt") + n("warmup_failed");
        self.requests += requests;
        self.received += received;
        self.failed += failed;
        self.bytes += n("bytes");
        self.measured_secs = self.measured_secs.max(f("seconds"));
        self.p99_ms = self.p99_ms.max(f("latency_ms_p99"));
        if !ok || failed > 0 || received != requests {
            self.problems.push(format!(
                "{name}: {received} of {requests} received, {} failed, {} corrupt, {} failed in the warm-up (exit {})",
                n("failed"),
                n("corrupt"),
                n("warmup_failed"),
                if ok { "ok" } else { "FAILED" }
            ));
        }
        if report.get("verified") != Some(&serde_json::Value::Bool(true)) {
            self.verified = false;
            self.problems.push(format!("{name}: bytes were not verified"));
        }
        let figures = |k: &str| Figures::from_json(&report["figures"][k]);
        match (figures("baseline"), figures("warm"), figures("end"), figures("after")) {
            (Some(before), Some(warm), Some(end), Some(after)) => {
                self.check_row(Row { name: name.to_owned(), warm, end, before, after }, rss_bound);
            }
            _ => self.problems.push(format!("{name}: no process figures in its report")),
        }
        Some(report)
    }

    fn print(&self) {
        println!("\n{}", self.title);
        let gb = self.bytes as f64 / 1e9;
        println!(
            "  requests   {} of {} received, every byte verified: {}; {} failed",
            self.received,
            self.requests,
            if self.verified { "yes" } else { "NO" },
            self.failed
        );
        println!(
            "  moved      {gb:.2} GB in {:.2} s measured = {:.2} GB/s ({:.2} s wall for the phase, start-up and warm-up included); p99 {:.1} ms",
            self.measured_secs,
            gb / self.measured_secs.max(1e-9),
            self.wall.as_secs_f64(),
            self.p99_ms
        );
        println!(
            "  {:<22} {:>10} {:>10} {:>9} {:>9} {:>11} {:>9}   RSS before -> after (not checked)",
            "process", "RSS warm", "RSS end", "growth", "fds", "tokio tasks", "threads"
        );
        for r in &self.rows {
            println!(
                "  {:<22} {:>6.1} MiB {:>6.1} MiB {:>+5.1} MiB {:>4} -> {:<3} {:>4} -> {:<4} {:>3} -> {:<3}  {:.1} -> {:.1} MiB",
                r.name,
                mib(r.warm.rss),
                mib(r.end.rss),
                mib(r.end.rss) - mib(r.warm.rss),
                r.before.fds,
                r.after.fds,
                r.before.tasks,
                r.after.tasks,
                r.before.threads,
                r.after.threads,
                mib(r.before.rss),
                mib(r.after.rss)
            );
        }
        for p in &self.problems {
            println!("  FAILED     {p}");
        }
    }
}

/// A running `kvlink serve` and its figures when it started.
struct Server {
    proc: Proc,
    control: String,
    baseline: Figures,
}

fn start_server(binary: &Path, name: String, max_sessions: usize) -> Result<Server> {
    let args: Vec<String> = [
        "serve",
        "--role",
        "producer",
        "--listen",
        "127.0.0.1",
        "--control-port",
        "0",
        "--side-channel-port",
        "0",
        "--figures",
        "--max-sessions",
        &max_sessions.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let proc = Proc::spawn(name, binary, &args)?;
    let deadline = Instant::now() + SERVER_BOUND;
    let ready = proc.line_starting("listening control=", deadline)?;
    let control = ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("control="))
        .with_context(|| format!("no control address in {ready:?}"))?
        .to_owned();
    let line = proc.line_starting("figures ", deadline)?;
    let baseline = Figures::from_line(&line).with_context(|| format!("unreadable {line:?}"))?;
    Ok(Server { proc, control, baseline })
}

/// A server after its sessions: what it held at start and once idle again.
struct Served {
    name: String,
    control: String,
    baseline: Figures,
    idle: Figures,
}

impl Server {
    /// Waits for `sessions` sessions to end and the figures line after the
    /// last; stops the server.
    fn finish(self, sessions: usize, phase: &mut Phase) -> Result<Served> {
        let Self { proc, control, baseline } = self;
        let deadline = Instant::now() + SERVER_BOUND;
        for _ in 0..sessions {
            let line = proc.line_starting("session from", deadline)?;
            if !line.ends_with("done") {
                phase.problems.push(format!("{}: {line}", proc.name));
            }
        }
        let line = proc.line_starting("figures ", deadline)?;
        let idle = Figures::from_line(&line).with_context(|| format!("unreadable {line:?}"))?;
        let name = proc.name.clone();
        if !proc.stop()? {
            phase.problems.push(format!("{name}: did not exit cleanly on SIGTERM"));
        }
        Ok(Served { name, control, baseline, idle })
    }
}

struct Plan<'a> {
    binary: &'a Path,
    args: &'a SoakArgs,
}

impl Plan<'_> {
    fn bench_args(&self, connect: &[&str], requests: usize, in_flight: usize) -> Vec<String> {
        let a = self.args;
        let warmup = a.warmup.unwrap_or(2 * in_flight);
        let mut out: Vec<String> = vec!["bench".into()];
        for c in connect {
            out.extend(["--connect".into(), (*c).to_owned()]);
        }
        #[rustfmt::skip]
        out.extend([
            "--protocol", &a.protocol, "--layers", &a.layers.to_string(), "--heads", "1",
            "--head-dim", &a.head_dim.to_string(), "--blocks-per-request", &a.blocks_per_request.to_string(),
            "--requests", &requests.to_string(), "--in-flight", &in_flight.to_string(),
            "--warmup", &warmup.to_string(), "--pattern", "contiguous", "--json",
        ].map(str::to_owned));
        out
    }

    fn rss_bound(&self) -> u64 {
        self.args.rss_growth_mib << 20
    }

    fn deadline(&self) -> Instant {
        Instant::now() + Duration::from_secs(self.args.timeout_secs)
    }

    /// Adds a server's row: its RSS after the warm-up (the lowest its
    /// benches saw) and at the end (the highest), its idle figures before
    /// and after.
    fn server_row(&self, phase: &mut Phase, server: Served, reports: &[serde_json::Value]) {
        let seen = |pick: &str| -> Vec<Figures> {
            reports
                .iter()
                .filter_map(|r| r["peers"].as_array()?.iter().find(|p| p["addr"] == server.control.as_str()).cloned())
                .filter_map(|p| Figures::from_json(&p[pick]))
                .collect()
        };
        let (warm, end) = (seen("warm"), seen("end"));
        match (warm.iter().min_by_key(|f| f.rss), end.iter().max_by_key(|f| f.rss)) {
            (Some(&warm), Some(&end)) => {
                let row = Row { name: server.name, warm, end, before: server.baseline, after: server.idle };
                phase.check_row(row, self.rss_bound());
            }
            _ => phase.problems.push(format!("{}: no figures from its benches", server.name)),
        }
    }

    /// Runs `benches` (name, `--connect` targets, requests, in flight) at
    /// once against `servers`, each of which serves `sessions_each`.
    fn run_phase(
        &self,
        phase: &mut Phase,
        servers: Vec<Server>,
        benches: &[(String, Vec<String>, usize, usize)],
        sessions_each: usize,
    ) -> Result<()> {
        let started = Instant::now();
        let mut running = Vec::new();
        for (name, targets, requests, in_flight) in benches {
            let targets: Vec<&str> = targets.iter().map(String::as_str).collect();
            running.push((
                name,
                Proc::spawn(name.clone(), self.binary, &self.bench_args(&targets, *requests, *in_flight))?,
            ));
        }
        let deadline = self.deadline();
        let mut reports = Vec::new();
        for (name, bench) in running {
            let (ok, out) = bench.finish(deadline)?;
            reports.extend(phase.add_bench(name, ok, &out, self.rss_bound()));
        }
        phase.wall = started.elapsed();
        for server in servers {
            let name = server.proc.name.clone();
            match server.finish(sessions_each, phase) {
                Ok(served) => self.server_row(phase, served, &reports),
                Err(e) => phase.problems.push(format!("{name}: {e:#}")),
            }
        }
        Ok(())
    }

    /// Phase 1: `producers` servers, one bench pulling from all of them.
    fn many_producers(&self) -> Result<Phase> {
        let a = self.args;
        let mut phase = Phase::new(format!(
            "phase 1: {} requests, {} in flight: {} producer processes -> 1 decode process",
            a.requests, a.in_flight, a.producers
        ));
        let servers = (0..a.producers)
            .map(|i| start_server(self.binary, format!("P{} (kvlink serve)", i + 1), 1))
            .collect::<Result<Vec<_>>>()?;
        let targets = servers.iter().map(|s| s.control.clone()).collect();
        let bench = ("D (kvlink bench)".to_owned(), targets, a.requests, a.in_flight);
        self.run_phase(&mut phase, servers, &[bench], 1)?;
        Ok(phase)
    }

    /// Phase 2: one server shared by `decoders` benches at once, the
    /// requests and the window split between them.
    fn many_decoders(&self) -> Result<Phase> {
        let a = self.args;
        let n = a.decoders;
        let mut phase = Phase::new(format!(
            "phase 2: {} requests, {} in flight: 1 producer process (one prefill instance) -> {n} decode processes",
            a.requests, a.in_flight
        ));
        let server = start_server(self.binary, "P (kvlink serve)".to_owned(), n)?;
        let benches: Vec<_> = (0..n)
            .map(|i| {
                let requests = a.requests / n + usize::from(i < a.requests % n);
                let in_flight = (a.in_flight / n + usize::from(i < a.in_flight % n)).max(1);
                (format!("D{} (kvlink bench)", i + 1), vec![server.control.clone()], requests, in_flight)
            })
            .collect();
        self.run_phase(&mut phase, vec![server], &benches, n)?;
        Ok(phase)
    }
}

/// Builds kvlink, runs both phases, prints their figures; fails if any check failed.
pub(crate) fn soak(args: &SoakArgs) -> Result<()> {
    let root = cmd::workspace_root()?;
    let mut build = vec!["build", "-p", "kvlink"];
    if !args.debug {
        build.push("--release");
    }
    cmd::run_inherited(cmd::cargo(&root, &build, true), &format!("cargo {}", build.join(" ")))?;
    let target_dir: PathBuf =
        std::env::var_os("CARGO_TARGET_DIR").map(Into::into).unwrap_or_else(|| root.join("target"));
    let binary = target_dir.join(if args.debug { "debug" } else { "release" }).join("kvlink");
    anyhow::ensure!(args.requests > 0 && args.in_flight > 0, "nothing to run");
    anyhow::ensure!(args.producers > 0 && args.decoders > 0, "at least one producer and one decode");
    let plan = Plan { binary: &binary, args };
    let started = Instant::now();
    let phases = vec![plan.many_producers()?, plan.many_decoders()?];
    println!(
        "\nxtask soak: kvlink {} build, {} KiB per request ({} blocks x {} regions x {} B), {} s in all",
        if args.debug { "debug" } else { "release" },
        args.blocks_per_request as u64 * 2 * u64::from(args.layers) * 32 * u64::from(args.head_dim) / 1024,
        args.blocks_per_request,
        2 * args.layers,
        32 * args.head_dim,
        started.elapsed().as_secs()
    );
    for p in &phases {
        p.print();
    }
    let failed: usize = phases.iter().map(|p| p.problems.len()).sum();
    if failed == 0 {
        println!("\nxtask soak: OK");
        Ok(())
    } else {
        bail!("{failed} soak check(s) failed")
    }
}

/// `cargo xtask soak`: exits non-zero if any check failed.
pub(crate) fn run(args: &SoakArgs) -> Result<ExitCode> {
    match soak(args) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            println!("\nxtask soak: FAILED: {e:#}");
            Ok(ExitCode::FAILURE)
        }
    }
}
