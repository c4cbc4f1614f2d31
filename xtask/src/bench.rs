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
    /// Run under `taskset -c 0`: every thread on one core, so no wake-up
    /// crosses CPUs (on virtual machines a cross-CPU wake-up costs tens of us).
    one_core: bool,
}

/// One request of one 2 KiB block at a time: per-request overhead.
#[rustfmt::skip]
const LATENCY_ARGS: &[&str] = &[
    "--layers", "1", "--layout", "mla", "--head-dim", "64", "--heads", "1", "--blocks-per-request", "1",
    "--in-flight", "1", "--requests", "1000", "--warmup", "20",
];

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
        one_core: false,
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
        one_core: false,
    },
    Scenario {
        name: "latency: 1,000 requests of 1 2-KiB block, 1 in flight",
        args: LATENCY_ARGS,
        target: "p50 - raw transfer time < 100 us",
        one_core: false,
    },
    Scenario {
        name: "latency, all threads on one core",
        args: LATENCY_ARGS,
        target: "(same, without cross-CPU wake-ups)",
        one_core: true,
    },
    Scenario {
        name: "memory: 8 GiB in 64 requests of 128 MiB",
        args: &["--blocks-per-request", "64", "--in-flight", "4", "--requests", "64", "--warmup", "0"],
        target: "peak RSS - caches < 64 MiB; CPU < 1.0 s/GB",
        one_core: false,
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

fn kvlink_json(binary: &Path, args: &[&str], one_core: bool) -> Result<serde_json::Value> {
    let mut all = vec!["bench", "--no-verify", "--json"];
    all.extend_from_slice(args);
    let mut command = if one_core {
        let mut c = Command::new("taskset");
        c.args(["-c", "0"]).arg(binary);
        c
    } else {
        Command::new(binary)
    };
    let out = command.args(&all).stderr(Stdio::inherit()).output().context("could not run kvlink")?;
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
        for (i, s) in SCENARIOS.iter().enumerate() {
            eprintln!("xtask bench: run {}/{runs}: {}", run + 1, s.name);
            results[i].push(kvlink_json(&binary, s.args, s.one_core)?);
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
