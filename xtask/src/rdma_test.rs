//! `cargo xtask rdma-test`: builds the RDMA tests on the host (transport-rdma
//! with its `verbs` feature, the conformance suite's RDMA run among them;
//! kv-worker's end-to-end test with its `rdma` feature), then runs every
//! test binary in one Soft-RoCE guest (see [`crate::vm`]) and exits with the
//! guest's status.
//!
//! `cargo xtask rdma-test --bench` instead builds `kvlink` (release, feature
//! `rdma`) and runs, in one guest: `kvlink demo --protocol rdma` (every byte
//! verified), `kvlink bench --protocol rdma` with 64 KiB blocks (contiguous,
//! then scattered), and perftest's `ib_write_bw` at 64 KiB on the same rxe
//! device, then prints both throughputs and their ratio.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::cmd;
use crate::vm::{self, Job, Outcome, Program, VmOptions};

/// One `cargo test --no-run` whose binaries run in the guest.
struct Suite {
    /// Shown before the build.
    what: &'static str,
    /// `cargo test` arguments selecting the package, features and targets.
    args: &'static [&'static str],
}

const SUITES: &[Suite] = &[
    Suite {
        what:
            "transport-rdma: the conformance suite, verbs layer, planner, handshake, control codec, fence bookkeeping",
        args: &["-p", "transport-rdma", "--features", "verbs"],
    },
    Suite {
        what: "kv-worker: the end-to-end test over RDMA",
        args: &["-p", "kv-worker", "--no-default-features", "--features", "rdma", "--test", "rdma_end_to_end"],
    },
];

/// Host variables passed into the guest whenever they are set.
const PASSED_ENV: &[&str] = &["RUST_BACKTRACE", "RUST_LOG", "RUST_TEST_THREADS"];

/// The exit status for a guest that ran out of time (as `timeout(1)`).
const TIMED_OUT: u8 = 124;

/// Arguments of `cargo xtask rdma-test`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RdmaTestArgs {
    /// Bound on the guest run, boot to power-off, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Guest memory (qemu `-m`; default 2G, with --bench 6G: the demo's
    /// llama-shaped caches take 2 GiB, registered twice).
    #[arg(long)]
    memory: Option<String>,
    /// Guest CPUs.
    #[arg(long, default_value_t = 2)]
    cpus: u32,
    /// Boot `/boot/vmlinuz-VERSION` instead of the newest kernel that has rdma_rxe.
    #[arg(long, value_name = "VERSION")]
    kernel: Option<String>,
    /// Keep the per-run directory (console log, scripts) for inspection.
    #[arg(long)]
    keep: bool,
    /// Also pass this host environment variable into the guest (repeatable).
    #[arg(long = "env", value_name = "VAR")]
    env: Vec<String>,
    /// Instead of the tests: `kvlink demo` and `kvlink bench` over RDMA and
    /// perftest's `ib_write_bw` at 64 KiB, in one guest, with the ratio.
    #[arg(long)]
    bench: bool,
    /// With --bench: measured requests of each `kvlink bench`.
    #[arg(long, default_value_t = 60)]
    bench_requests: usize,
    /// Instead of the tests: run this shell script in the guest (it sees
    /// the host's files read-only, the device in `KVLINK_RDMA_DEVICE`, and a
    /// writable /tmp), e.g. to run one test binary and read rxe's counters.
    #[arg(long, value_name = "PATH", conflicts_with = "bench")]
    script: Option<PathBuf>,
    /// Arguments for every test binary, after `--` (e.g. `-- --nocapture`).
    #[arg(last = true, value_name = "TEST_ARGS")]
    test_args: Vec<String>,
}

impl Default for RdmaTestArgs {
    fn default() -> Self {
        Self {
            timeout: 300,
            memory: None,
            cpus: 2,
            kernel: None,
            keep: false,
            env: Vec::new(),
            bench: false,
            bench_requests: 60,
            script: None,
            test_args: Vec::new(),
        }
    }
}

/// Runs `cargo xtask rdma-test`.
pub(crate) fn run(args: &RdmaTestArgs) -> Result<ExitCode> {
    let root = cmd::workspace_root()?;
    // Before the build: a missing tool should fail in a second, not after it.
    let host = vm::host::check(args.kernel.as_deref())?;
    if args.bench {
        return bench(args, &root, &host);
    }
    let mut programs = Vec::new();
    if let Some(script) = &args.script {
        let script = script.canonicalize().with_context(|| format!("{}", script.display()))?;
        programs.push(Program {
            label: format!("sh {}", script.display()),
            path: "/bin/sh".to_owned(),
            cwd: root.to_string_lossy().into_owned(),
            args: vec![script.to_string_lossy().into_owned()],
        });
    }
    for suite in SUITES.iter().filter(|_| args.script.is_none()) {
        println!("rdma-test: {}", suite.what);
        programs.extend(build_tests(&root, suite)?);
    }
    if programs.is_empty() {
        bail!("the RDMA test suites built no test binary");
    }
    let job = Job { programs, args: args.test_args.clone(), env: passed_env(args) };
    match vm::run(&vm_options(args, &root), &host, &job, &scratch_dir(&root))?.0 {
        Outcome::Exited(0) => {
            println!("rdma-test: every test binary passed in the guest");
            Ok(ExitCode::SUCCESS)
        }
        Outcome::Exited(status) => {
            println!("rdma-test: a test binary failed in the guest (first failure: exit status {status})");
            Ok(ExitCode::from(u8::try_from(status).unwrap_or(1).max(1)))
        }
        Outcome::TimedOut => {
            println!("rdma-test: the guest did not finish within {}s (--timeout)", args.timeout);
            Ok(ExitCode::from(TIMED_OUT))
        }
    }
}

/// `cargo xtask rdma-test` as a CI step: Ok only if every test passed.
pub(crate) fn run_step() -> Result<()> {
    let code = run(&RdmaTestArgs::default())?;
    if code != ExitCode::SUCCESS {
        bail!("RDMA tests failed in the Soft-RoCE guest");
    }
    Ok(())
}

fn vm_options(args: &RdmaTestArgs, root: &Path) -> VmOptions {
    let default = if args.bench { "6G" } else { "2G" };
    // The test binaries run from the target directory and with the crate
    // directory as their working directory: the guest must see both.
    let target = target_dir(root);
    let mut visible = vec![root.to_path_buf()];
    if !target.starts_with(root) {
        visible.push(target);
    }
    VmOptions {
        timeout: Duration::from_secs(args.timeout),
        memory: args.memory.clone().unwrap_or_else(|| default.to_owned()),
        cpus: args.cpus,
        keep: args.keep,
        visible,
    }
}

fn passed_env(args: &RdmaTestArgs) -> Vec<(String, String)> {
    PASSED_ENV
        .iter()
        .map(|name| (*name).to_owned())
        .chain(args.env.iter().cloned())
        .filter_map(|name| std::env::var(&name).ok().map(|value| (name, value)))
        .collect()
}

/// Builds one suite's test binaries and lists them, from cargo's JSON messages.
fn build_tests(root: &Path, suite: &Suite) -> Result<Vec<Program>> {
    let mut args = vec!["test"];
    args.extend_from_slice(suite.args);
    args.extend_from_slice(&["--no-run", "--message-format=json-render-diagnostics"]);
    let display = format!("cargo {}", args.join(" "));
    println!("rdma-test: {display}");
    let output = cmd::run_captured(cmd::cargo(root, &args, false), &display)?;
    let mut programs = Vec::new();
    for line in output.lines() {
        let message: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("cargo printed a non-JSON line: {line}"))?;
        if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
            continue;
        }
        let (Some(path), Some(manifest)) = (message["executable"].as_str(), message["manifest_path"].as_str()) else {
            continue;
        };
        let kind = message["target"]["kind"][0].as_str().unwrap_or("test");
        let name = message["target"]["name"].as_str().unwrap_or("?");
        let cwd = Path::new(manifest).parent().context("manifest path has no parent")?;
        programs.push(Program {
            label: format!("{kind} {name}"),
            path: path.to_owned(),
            cwd: cwd.to_string_lossy().into_owned(),
            args: Vec::new(),
        });
    }
    Ok(programs)
}

/// Where the per-run directories go: under the cargo target directory.
fn scratch_dir(root: &Path) -> PathBuf {
    target_dir(root).join("rdma-vm")
}

fn target_dir(root: &Path) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    if target.is_absolute() {
        target
    } else {
        root.join(target)
    }
}

/// The message size of the comparison (perftest's default too).
const MESSAGE: usize = 64 * 1024;

/// The kvlink bench runs: (label, extra arguments). 64 KiB blocks (16
/// tokens x 8 heads x 256 dims x 2 bytes), 4 layers (8 regions), 32 blocks
/// per request (16 MiB), 2 in flight; bytes not verified (the demo does).
const BENCH_RUNS: &[(&str, &[&str])] =
    &[("contiguous", &["--pattern", "contiguous"]), ("scattered", &["--pattern", "scattered"])];

/// `cargo xtask rdma-test --bench`.
fn bench(args: &RdmaTestArgs, root: &Path, host: &vm::host::Host) -> Result<ExitCode> {
    let perftest = ["/usr/bin/ib_write_bw", "/usr/local/bin/ib_write_bw"]
        .into_iter()
        .find(|path| Path::new(path).is_file())
        .context("ib_write_bw not found (apt-get install perftest)")?;
    let build = ["build", "--release", "-p", "kvlink", "--features", "rdma"];
    let display = format!("cargo {}", build.join(" "));
    println!("rdma-test: {display}");
    cmd::run_inherited(cmd::cargo(root, &build, true), &display)?;
    let kvlink = target_dir(root).join("release").join("kvlink");
    let kvlink = kvlink.to_str().context("the kvlink path is not UTF-8")?.to_owned();

    let mut script = String::from("#!/bin/sh\n# kvlink over Soft-RoCE: demo, bench, ib_write_bw.\nstatus=0\n");
    let _ = writeln!(script, "echo '== kvlink demo --protocol rdma'");
    let _ = writeln!(script, "{} demo --protocol rdma --requests 16 || status=1", vm::script::quote(&kvlink));
    for (label, extra) in BENCH_RUNS {
        let _ = writeln!(script, "echo '== kvlink bench --protocol rdma, 64 KiB blocks, {label}'");
        let _ = writeln!(
            script,
            "{} bench --protocol rdma --layers 4 --head-dim 256 --blocks-per-request 32 --in-flight 2 \
             --requests {} --warmup 4 --no-verify --json {} | sed 's/^/KVLINK-BENCH {label} /' || status=1",
            vm::script::quote(&kvlink),
            args.bench_requests,
            extra.join(" ")
        );
    }
    let _ = writeln!(script, "echo '== ib_write_bw -s {MESSAGE} on the same device'");
    let _ = writeln!(
        script,
        "opts=\"-d $KVLINK_RDMA_DEVICE -x $KVLINK_RDMA_GID_INDEX -s {MESSAGE} -n 4000 -F --output=bandwidth\"\n\
         {perftest} $opts > /tmp/ib_write_bw.server 2>&1 &\n\
         server=$!\n\
         sleep 1\n\
         {perftest} $opts 127.0.0.1 | sed 's/^/IB-WRITE-BW /' || status=1\n\
         wait $server || status=1\n\
         exit $status"
    );
    let script_path = scratch_dir(root).join(format!("bench-{}.sh", std::process::id()));
    std::fs::create_dir_all(scratch_dir(root))?;
    std::fs::write(&script_path, script)?;
    let program = Program {
        label: "kvlink demo, kvlink bench, ib_write_bw".to_owned(),
        path: "/bin/sh".to_owned(),
        cwd: root.to_string_lossy().into_owned(),
        args: vec![script_path.to_string_lossy().into_owned()],
    };
    let job = Job { programs: vec![program], args: Vec::new(), env: passed_env(args) };
    let run = vm::run(&vm_options(args, root), host, &job, &scratch_dir(root));
    let _ = std::fs::remove_file(&script_path);
    let (outcome, output) = run?;
    let report = BenchReport::parse(&output);
    println!("{report}");
    match outcome {
        Outcome::Exited(0) if report.complete() => Ok(ExitCode::SUCCESS),
        Outcome::Exited(0) => {
            println!("rdma-test --bench: some figure is missing from the guest's output");
            Ok(ExitCode::FAILURE)
        }
        Outcome::Exited(status) => {
            println!("rdma-test --bench: a run failed in the guest (exit status {status})");
            Ok(ExitCode::from(u8::try_from(status).unwrap_or(1).max(1)))
        }
        Outcome::TimedOut => Ok(ExitCode::from(TIMED_OUT)),
    }
}

/// The figures of one `--bench` run.
#[derive(Debug, Default)]
struct BenchReport {
    /// kvlink bench throughput per run label, bytes per second.
    kvlink: Vec<(String, f64)>,
    /// ib_write_bw average, bytes per second.
    ib_write_bw: Option<f64>,
}

impl BenchReport {
    /// Reads the tagged lines of the guest's output: `KVLINK-BENCH <label>
    /// <json>` (`gbytes_per_sec`, 10^9 bytes) and `IB-WRITE-BW <MiB/s>`.
    fn parse(output: &str) -> Self {
        let mut report = Self::default();
        for line in output.lines() {
            if let Some(rest) = line.strip_prefix("KVLINK-BENCH ") {
                let Some((label, json)) = rest.split_once(' ') else { continue };
                let value: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
                if let Some(gbps) = value["gbytes_per_sec"].as_f64() {
                    report.kvlink.push((label.to_owned(), gbps * 1e9));
                }
            } else if let Some(rest) = line.strip_prefix("IB-WRITE-BW ") {
                // --output=bandwidth prints the average in MiB/s.
                if let Some(mib) = rest.split_whitespace().last().and_then(|v| v.parse::<f64>().ok()) {
                    report.ib_write_bw = Some(mib * (1u64 << 20) as f64);
                }
            }
        }
        report
    }

    fn complete(&self) -> bool {
        self.ib_write_bw.is_some() && self.kvlink.len() == BENCH_RUNS.len()
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mb = |bytes: f64| bytes / 1e6;
        writeln!(f, "rdma-test --bench (one guest, rdma_rxe, {} KiB messages):", MESSAGE / 1024)?;
        match self.ib_write_bw {
            Some(ib) => writeln!(f, "  ib_write_bw            {:>9.1} MB/s", mb(ib))?,
            None => writeln!(f, "  ib_write_bw            (no figure)")?,
        }
        for (label, bytes) in &self.kvlink {
            match self.ib_write_bw {
                Some(ib) if ib > 0.0 => {
                    writeln!(f, "  kvlink {label:<15} {:>9.1} MB/s = {:.2} x ib_write_bw", mb(*bytes), bytes / ib)?
                }
                _ => writeln!(f, "  kvlink {label:<15} {:>9.1} MB/s", mb(*bytes))?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_tagged_figures() {
        let output = "== kvlink bench\nKVLINK-BENCH contiguous {\"gbytes_per_sec\":0.5,\"x\":1}\n\
                      KVLINK-BENCH scattered {\"gbytes_per_sec\":0.25}\nIB-WRITE-BW 500.00\nnoise\n";
        let report = BenchReport::parse(output);
        assert!(report.complete());
        assert_eq!(report.kvlink[0], ("contiguous".to_owned(), 0.5e9));
        assert_eq!(report.ib_write_bw, Some(500.0 * 1048576.0));
        assert!(report.to_string().contains("0.95 x ib_write_bw"), "{report}");
    }
}
