//! `cargo xtask rdma-test`: builds transport-rdma's tests with its `verbs`
//! feature on the host, then runs every test binary in one Soft-RoCE guest
//! (see [`crate::vm`]) and exits with the guest's status.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::cmd;
use crate::vm::{self, Job, Outcome, Program, VmOptions};

/// The crate whose tests run in the guest, and the feature that compiles its verbs layer.
const PACKAGE: &str = "transport-rdma";
const FEATURE: &str = "verbs";

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
    /// Guest memory (qemu `-m`).
    #[arg(long, default_value = "1G")]
    memory: String,
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
    /// Arguments for every test binary, after `--` (e.g. `-- --nocapture`).
    #[arg(last = true, value_name = "TEST_ARGS")]
    test_args: Vec<String>,
}

impl Default for RdmaTestArgs {
    fn default() -> Self {
        Self {
            timeout: 300,
            memory: "1G".to_owned(),
            cpus: 2,
            kernel: None,
            keep: false,
            env: Vec::new(),
            test_args: Vec::new(),
        }
    }
}

/// Runs `cargo xtask rdma-test`.
pub(crate) fn run(args: &RdmaTestArgs) -> Result<ExitCode> {
    let root = cmd::workspace_root()?;
    // Before the build: a missing tool should fail in a second, not after it.
    let host = vm::host::check(args.kernel.as_deref())?;
    let programs = build_tests(&root)?;
    if programs.is_empty() {
        bail!("`cargo test -p {PACKAGE} --no-run` built no test binary");
    }
    let env = PASSED_ENV
        .iter()
        .map(|name| (*name).to_owned())
        .chain(args.env.iter().cloned())
        .filter_map(|name| std::env::var(&name).ok().map(|value| (name, value)))
        .collect();
    let job = Job { programs, args: args.test_args.clone(), env };
    let options = VmOptions {
        timeout: Duration::from_secs(args.timeout),
        memory: args.memory.clone(),
        cpus: args.cpus,
        keep: args.keep,
    };
    match vm::run(&options, &host, &job, &scratch_dir(&root))? {
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

/// Builds the test binaries and lists them, from cargo's JSON messages.
fn build_tests(root: &Path) -> Result<Vec<Program>> {
    let args = ["test", "-p", PACKAGE, "--features", FEATURE, "--no-run", "--message-format=json-render-diagnostics"];
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
        });
    }
    Ok(programs)
}

/// Where the per-run directories go: under the cargo target directory.
fn scratch_dir(root: &Path) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let target = if target.is_absolute() { target } else { root.join(target) };
    target.join("rdma-vm")
}
