//! `cargo xtask bench`: the performance targets of the transfer path, each
//! measured as a ratio against the machine's own limit taken in the same run
//! (`iperf3` single stream on loopback), median of several runs.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::cmd;

/// Options of `cargo xtask bench`.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Runs per scenario (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

/// One kvlink bench invocation and the target it is held to.
struct Scenario {
    name: &'static str,
    args: &'static [&'static str],
    target: &'static str,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "contiguous: 1 request x 2,048 blocks of 64 KiB",
        args: &[
            "--layers",
            "1",
            "--layout",
            "mla",
            "--head-dim",
            "2048",
            "--heads",
            "1",
            "--blocks-per-request",
            "2048",
            "--pattern",
            "contiguous",
            "--in-flight",
            "1",
            "--requests",
            "16",
            "--warmup",
            "2",
        ],
        target: "throughput >= 0.95 x iperf3",
    },
    Scenario {
        name: "scattered: 4,096 ops of 8 KiB in one batch",
        args: &[
            "--layers",
            "1",
            "--layout",
            "mla",
            "--head-dim",
            "256",
            "--heads",
            "1",
            "--blocks-per-request",
            "4096",
            "--pattern",
            "scattered",
            "--in-flight",
            "1",
            "--requests",
            "64",
            "--warmup",
            "4",
        ],
        target: "throughput >= 0.85 x iperf3",
    },
    Scenario {
        name: "latency: 1,000 requests of 1 2-KiB block, 1 in flight",
        args: &[
            "--layers",
            "1",
            "--layout",
            "mla",
            "--head-dim",
            "64",
            "--heads",
            "1",
            "--blocks-per-request",
            "1",
            "--in-flight",
            "1",
            "--requests",
            "1000",
            "--warmup",
            "20",
        ],
        target: "p50 - raw transfer time < 100 us",
    },
    Scenario {
        name: "memory: 8 GiB in 64 requests of 128 MiB",
        args: &["--blocks-per-request", "64", "--in-flight", "4", "--requests", "64", "--warmup", "0"],
        target: "peak RSS - caches < 64 MiB; CPU < 1.0 s/GB",
    },
];

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

fn ensure_iperf3() -> Result<()> {
    if Command::new("iperf3").arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success()) {
        return Ok(());
    }
    eprintln!("xtask bench: iperf3 missing, installing it with apt-get");
    let ok = Command::new("apt-get").args(["install", "-y", "-q", "iperf3"]).status().is_ok_and(|s| s.success())
        || (Command::new("apt-get").args(["update", "-q"]).status().is_ok_and(|s| s.success())
            && Command::new("apt-get").args(["install", "-y", "-q", "iperf3"]).status().is_ok_and(|s| s.success()));
    if !ok {
        bail!("iperf3 is not installed and apt-get could not install it");
    }
    Ok(())
}

struct IperfServer(Child);

impl Drop for IperfServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One iperf3 run on loopback with `streams` parallel streams, in 10^9
/// bytes per second.
fn iperf3_gbytes_per_sec(port: u16, streams: usize) -> Result<f64> {
    let out = Command::new("iperf3")
        .args(["-c", "127.0.0.1", "-p", &port.to_string(), "-t", "3", "-P", &streams.to_string(), "-J"])
        .output()
        .context("could not run iperf3 -c")?;
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).context("iperf3 printed no JSON")?;
    json.pointer("/end/sum_received/bits_per_second")
        .and_then(serde_json::Value::as_f64)
        .map(|bits| bits / 8e9)
        .with_context(|| format!("iperf3 reported no throughput: {}", String::from_utf8_lossy(&out.stdout)))
}

/// Median round trip of a 32-byte ping-pong over loopback TCP between two
/// threads: the floor under any request/reply exchange on this machine.
fn loopback_rtt_us() -> Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("bind ping-pong listener")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut conn, _) = listener.accept()?;
        conn.set_nodelay(true)?;
        let mut buf = [0u8; 32];
        while conn.read_exact(&mut buf).is_ok() {
            conn.write_all(&buf)?;
        }
        Ok(())
    });
    let mut conn = std::net::TcpStream::connect(addr).context("connect ping-pong")?;
    conn.set_nodelay(true)?;
    let mut samples = Vec::with_capacity(3000);
    let mut buf = [7u8; 32];
    for _ in 0..3000 {
        let start = std::time::Instant::now();
        conn.write_all(&buf)?;
        conn.read_exact(&mut buf)?;
        samples.push(start.elapsed().as_secs_f64() * 1e6);
    }
    drop(conn);
    let _ = echo.join();
    Ok(median(samples))
}

fn kvlink_json(binary: &Path, args: &[&str]) -> Result<serde_json::Value> {
    let mut all = vec!["bench", "--no-verify", "--json"];
    all.extend_from_slice(args);
    let out = Command::new(binary).args(&all).stderr(Stdio::inherit()).output().context("could not run kvlink")?;
    if !out.status.success() {
        bail!("kvlink {} failed ({})", all.join(" "), out.status);
    }
    serde_json::from_slice(&out.stdout).context("kvlink bench printed no JSON")
}

fn field(report: &serde_json::Value, name: &str) -> f64 {
    report.get(name).and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN)
}

/// Builds kvlink in release mode, measures iperf3 and every scenario, prints
/// the ratios.
pub(crate) fn run(args: &BenchArgs) -> Result<std::process::ExitCode> {
    let root = cmd::workspace_root()?;
    cmd::run_inherited(
        cmd::cargo(&root, &["build", "--release", "-p", "kvlink"], true),
        "cargo build --release -p kvlink",
    )?;
    let target_dir = std::env::var_os("CARGO_TARGET_DIR").map(Into::into).unwrap_or_else(|| root.join("target"));
    let binary = target_dir.join("release").join("kvlink");
    ensure_iperf3()?;
    let port = 5299;
    let _server = IperfServer(
        Command::new("iperf3")
            .args(["-s", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("could not start iperf3 -s")?,
    );
    let runs = args.runs.max(1);
    let mut iperf = Vec::new();
    let mut iperf_two = Vec::new();
    let mut rtts = Vec::new();
    let mut results: Vec<Vec<serde_json::Value>> = SCENARIOS.iter().map(|_| Vec::new()).collect();
    // Interleave iperf3 and kvlink runs so both see the same machine state.
    for run in 0..runs {
        let mut sample = None;
        for _attempt in 0..20 {
            match iperf3_gbytes_per_sec(port, 1) {
                Ok(v) => {
                    sample = Some(v);
                    break;
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)), // server still starting
            }
        }
        iperf.push(sample.context("iperf3 server did not answer")?);
        iperf_two.push(iperf3_gbytes_per_sec(port, 2)?);
        rtts.push(loopback_rtt_us()?);
        for (i, s) in SCENARIOS.iter().enumerate() {
            eprintln!("xtask bench: run {}/{runs}: {}", run + 1, s.name);
            results[i].push(kvlink_json(&binary, s.args)?);
        }
    }
    let limit = median(iperf.clone());
    let limit_two = median(iperf_two.clone());
    println!("\nloopback limit: iperf3 single stream, median of {runs}: {limit:.2} GB/s (runs: {iperf:.2?})");
    println!(
        "(iperf3 with 2 streams, as the transport spreads batches of 16 MiB or more over 2 connections: {:.2} GB/s; runs: {iperf_two:.2?})",
        limit_two
    );
    println!(
        "{:<50} {:>10} {:>8} {:>8} {:>10} {:>10} {:>9} {:>11}  target",
        "scenario (median of runs)", "GB/s", "ratio", "ratio/P2", "p50 ms", "ops/batch", "CPU s/GB", "RSS-cache"
    );
    for (s, reports) in SCENARIOS.iter().zip(&results) {
        let med = |name: &str| median(reports.iter().map(|r| field(r, name)).collect());
        let gbps = med("gbytes_per_sec");
        let rss_extra_mib = median(
            reports
                .iter()
                .map(|r| (field(r, "peak_rss_bytes") - field(r, "cache_bytes")) / (1u64 << 20) as f64)
                .collect(),
        );
        println!(
            "{:<50} {:>10.2} {:>8.3} {:>8.3} {:>10.3} {:>10.0} {:>9.3} {:>8.1} MiB  {}",
            s.name,
            gbps,
            gbps / limit,
            gbps / limit_two,
            med("latency_ms_p50"),
            med("ops_per_batch"),
            med("cpu_seconds_per_gb"),
            rss_extra_mib,
            s.target
        );
        if s.name.starts_with("latency") {
            let bytes_per_request = med("bytes") / med("received").max(1.0);
            let raw_us = bytes_per_request / (limit * 1e9) * 1e6;
            let rtt = median(rtts.clone());
            println!(
                "{:<50} loopback TCP round trip (median of {runs}): {rtt:.1} us; added p50 = {:.2} round trips",
                "",
                (med("latency_ms_p50") * 1e3 - raw_us) / rtt
            );
            println!(
                "{:<50} raw transfer {:.1} us, added p50 {:.1} us",
                "",
                raw_us,
                med("latency_ms_p50") * 1e3 - raw_us
            );
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
