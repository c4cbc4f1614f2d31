//! `cargo xtask fuzz`: the fuzz targets of `fuzz/` (a cargo-fuzz crate
//! outside the workspace).
//!
//! * `cargo xtask fuzz [--seconds N] [--target T]...` builds every target
//!   once with `cargo +nightly fuzz build` (libFuzzer, AddressSanitizer),
//!   then runs each for N seconds from the corpus kept in the repository,
//!   under a memory limit and a per-input timeout, two at a time. New inputs
//!   go to `fuzz/corpus-work/<target>/` (not kept); a crash is saved by
//!   libFuzzer under `fuzz/artifacts/<target>/` and fails the command.
//! * `cargo xtask fuzz --replay` runs every committed corpus file through the
//!   same checks on the current (stable) toolchain: the crate's
//!   `tests/replay.rs`, built without libFuzzer but, as cargo-fuzz builds,
//!   with `--cfg fuzzing` (the modules kvlink's crates make public to the
//!   fuzz targets only are public under it).
//!
//! Fuzzing needs the nightly toolchain and cargo-fuzz; when either is
//! missing the command says so in one line and fails (CI never skips it).

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::cmd;

/// The cargo-fuzz release `cargo xtask setup` installs (`cargo install --locked`).
pub(crate) const CARGO_FUZZ_VERSION: &str = "0.13.2";
/// libFuzzer's limit on the process's resident memory.
const RSS_LIMIT_MB: u32 = 2048;
/// libFuzzer's limit on one input, in seconds.
const INPUT_TIMEOUT_SECS: u32 = 10;
/// Seconds per target of the CI smoke.
pub(crate) const CI_SECONDS: u64 = 10;
/// libFuzzer options for one target beyond the common ones.
const TARGET_FLAGS: &[(&str, &[&str])] = &[
    // A message at a decode bound (and its worst reply) takes tens of
    // milliseconds; without this the fuzzer spends nearly all its time
    // mutating those (60 inputs a second instead of 1,000).
    ("side_channel_message", &["-entropic_scale_per_exec_time=1"]),
];
/// Lines of a failed run's log shown when it names no panic or failing input.
const FAILURE_TAIL_LINES: usize = 60;

/// Options of `cargo xtask fuzz`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct FuzzArgs {
    /// Seconds to fuzz each target.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Fuzz only this target (repeatable); all of them if none is given.
    #[arg(long = "target", value_name = "TARGET")]
    targets: Vec<String>,
    /// Targets fuzzed at the same time.
    #[arg(long, default_value_t = 2)]
    jobs: usize,
    /// Instead of fuzzing: run every corpus file through the targets' checks
    /// on the current toolchain (no nightly needed).
    #[arg(long)]
    pub(crate) replay: bool,
}

impl FuzzArgs {
    /// The CI smoke: every target for [`CI_SECONDS`].
    pub(crate) fn smoke() -> Self {
        Self { seconds: CI_SECONDS, targets: Vec::new(), jobs: 2, replay: false }
    }

    /// The corpus replay.
    pub(crate) fn replay() -> Self {
        Self { replay: true, ..Self::smoke() }
    }
}

fn fuzz_dir(root: &Path) -> PathBuf {
    root.join("fuzz")
}

/// `cargo +nightly <args>` from the repository root, through the rustup
/// proxy (not `$CARGO`, which is the stable toolchain's own cargo) and
/// without the toolchain choices the outer cargo passes down.
fn nightly(root: &Path, args: &[&str]) -> Command {
    let mut command = Command::new("cargo");
    command.arg("+nightly").args(args).current_dir(root);
    for var in ["RUSTUP_TOOLCHAIN", "RUSTC", "RUSTDOC", "CARGO"] {
        command.env_remove(var);
    }
    command
}

fn succeeds(mut command: Command) -> bool {
    command.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Fails in one line unless the nightly toolchain and cargo-fuzz are there.
fn check_tools(root: &Path) -> Result<()> {
    if !succeeds(nightly(root, &["--version"])) {
        bail!(
            "`cargo +nightly` does not run: cargo-fuzz needs the nightly toolchain (rustup toolchain install nightly)"
        );
    }
    if !succeeds(nightly(root, &["fuzz", "--version"])) {
        bail!("cargo-fuzz is not installed: cargo install cargo-fuzz --version {CARGO_FUZZ_VERSION} --locked");
    }
    Ok(())
}

/// The targets: the `[[bin]]` files of `fuzz/fuzz_targets/`.
fn all_targets(root: &Path) -> Result<Vec<String>> {
    let dir = fuzz_dir(root).join("fuzz_targets");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs") {
            if let Some(stem) = path.file_stem() {
                names.push(stem.to_string_lossy().into_owned());
            }
        }
    }
    names.sort();
    Ok(names)
}

/// One target's libFuzzer run in progress.
struct Running {
    target: String,
    child: Child,
    log: PathBuf,
    started: Instant,
}

fn start(root: &Path, target: &str, seconds: u64, logs: &Path) -> Result<Running> {
    let fuzz = fuzz_dir(root);
    let work = fuzz.join("corpus-work").join(target);
    std::fs::create_dir_all(&work).with_context(|| format!("cannot create {}", work.display()))?;
    let corpus = fuzz.join("corpus").join(target);
    let log = logs.join(format!("{target}.log"));
    let out = File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let err = out.try_clone()?;
    let max_total_time = format!("-max_total_time={seconds}");
    let rss = format!("-rss_limit_mb={RSS_LIMIT_MB}");
    let timeout = format!("-timeout={INPUT_TIMEOUT_SECS}");
    // The first corpus directory receives new inputs; the committed one is only read.
    let work = work.to_string_lossy().into_owned();
    let corpus = corpus.to_string_lossy().into_owned();
    let mut args = vec![
        "fuzz",
        "run",
        "--fuzz-dir",
        "fuzz",
        target,
        &work,
        &corpus,
        "--",
        &max_total_time,
        &rss,
        &timeout,
        "-print_final_stats=1",
    ];
    for (name, flags) in TARGET_FLAGS {
        if *name == target {
            args.extend_from_slice(flags);
        }
    }
    let child = nightly(root, &args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .with_context(|| format!("could not start cargo fuzz run {target}"))?;
    Ok(Running { target: target.to_owned(), child, log, started: Instant::now() })
}

/// What a failed run's log says that matters: the panic and its message,
/// libFuzzer's error and summary lines, and cargo-fuzz's "failing input" and
/// "reproduce with" block; the last lines if none of these is there.
fn failure_report(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    let mut keep = vec![false; lines.len()];
    let mut in_block = false;
    for (i, line) in lines.iter().enumerate() {
        if line.contains("panicked at") {
            keep[i..lines.len().min(i + 4)].iter_mut().for_each(|k| *k = true);
        }
        if line.contains("ERROR: libFuzzer") || line.starts_with("SUMMARY:") || line.contains("ERROR: AddressSanitizer")
        {
            keep[i] = true;
        }
        if line.starts_with("Failing input:") {
            in_block = true;
        }
        if line.starts_with("Minimize test case with:") {
            in_block = false;
        }
        if in_block && !line.starts_with("Output of") && !line.starts_with("\t[") {
            keep[i] = !line.trim().is_empty();
        }
    }
    let picked: Vec<&str> = lines.iter().zip(&keep).filter(|(_, k)| **k).map(|(l, _)| *l).collect();
    if picked.is_empty() {
        lines[lines.len().saturating_sub(FAILURE_TAIL_LINES)..].join("\n")
    } else {
        picked.join("\n")
    }
}

/// What one finished run reports: its libFuzzer summary, or its failure.
fn finish(mut run: Running, root: &Path) -> Result<bool> {
    let status = run.child.wait()?;
    let log = std::fs::read_to_string(&run.log).unwrap_or_default();
    let elapsed = run.started.elapsed().as_secs_f64();
    if status.success() {
        let done = log.lines().rev().find(|l| l.starts_with("Done ")).unwrap_or("(no summary)");
        let cov = log.lines().rev().find(|l| l.contains("DONE")).map(str::trim).unwrap_or("");
        println!("fuzz: {:<22} ok in {elapsed:.0}s: {done} {cov}", run.target);
        return Ok(true);
    }
    println!("fuzz: {:<22} FAILED ({status}) after {elapsed:.0}s; log {}", run.target, run.log.display());
    println!("{}", failure_report(&log));
    let artifacts = fuzz_dir(root).join("artifacts").join(&run.target);
    if let Ok(entries) = std::fs::read_dir(&artifacts) {
        // Only what this run saved (earlier runs' inputs stay there too).
        let since = std::time::SystemTime::now().checked_sub(run.started.elapsed()).unwrap_or(std::time::UNIX_EPOCH);
        for entry in entries.flatten() {
            if entry.metadata().and_then(|m| m.modified()).is_ok_and(|t| t >= since) {
                println!("fuzz: {}: saved input {}", run.target, entry.path().display());
            }
        }
    }
    Ok(false)
}

/// `RUSTFLAGS` for a stable build of the fuzz crate: the caller's, and
/// `--cfg fuzzing` as cargo-fuzz passes it (modules public to the fuzz
/// targets only are public under it).
pub(crate) fn fuzzing_rustflags() -> OsString {
    let mut flags = std::env::var_os("RUSTFLAGS").unwrap_or_default();
    if !flags.is_empty() {
        flags.push(" ");
    }
    flags.push("--cfg fuzzing");
    flags
}

/// `cargo xtask fuzz --replay`: the corpus through the checks, on stable.
fn replay(root: &Path) -> Result<()> {
    let manifest = fuzz_dir(root).join("Cargo.toml");
    let manifest = manifest.to_string_lossy().into_owned();
    let args = ["test", "--manifest-path", &manifest, "--no-default-features", "--locked"];
    let mut command = cmd::cargo(root, &args, true);
    command.env("RUSTFLAGS", fuzzing_rustflags());
    cmd::run_inherited(command, &format!("RUSTFLAGS='--cfg fuzzing' cargo {}", args.join(" ")))
}

/// Runs `cargo xtask fuzz`; an error when anything failed.
pub(crate) fn run(args: &FuzzArgs) -> Result<()> {
    let root = cmd::workspace_root()?;
    if args.replay {
        return replay(&root);
    }
    check_tools(&root)?;
    let all = all_targets(&root)?;
    let targets = if args.targets.is_empty() { all.clone() } else { args.targets.clone() };
    if let Some(unknown) = targets.iter().find(|t| !all.contains(t)) {
        bail!("unknown fuzz target `{unknown}`; targets are: {}", all.join(", "));
    }

    let started = Instant::now();
    println!("fuzz: cargo +nightly fuzz build --fuzz-dir fuzz");
    let mut build = nightly(&root, &["fuzz", "build", "--fuzz-dir", "fuzz"]);
    build.stdin(Stdio::null());
    // cargo-fuzz answers a failed build with its own backtrace, which would
    // push the compiler's or linker's message out of a truncated log's tail.
    build.env("RUST_BACKTRACE", "0");
    cmd::run_inherited(build, "cargo +nightly fuzz build")?;
    println!("fuzz: built in {:.0}s", started.elapsed().as_secs_f64());

    let logs = fuzz_dir(&root).join("target").join("xtask-fuzz");
    std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
    let jobs = args.jobs.max(1);
    let mut queue = targets.iter();
    let mut running: Vec<Running> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    loop {
        while running.len() < jobs {
            let Some(target) = queue.next() else { break };
            running.push(start(&root, target, args.seconds, &logs)?);
        }
        if running.is_empty() {
            break;
        }
        let mut still = Vec::new();
        for mut run in running {
            if run.child.try_wait()?.is_some() {
                let target = run.target.clone();
                if !finish(run, &root)? {
                    failed.push(target);
                }
            } else {
                still.push(run);
            }
        }
        running = still;
        std::thread::sleep(Duration::from_millis(200));
    }
    println!("fuzz: {} targets for {}s each in {:.0}s", targets.len(), args.seconds, started.elapsed().as_secs_f64());
    if !failed.is_empty() {
        bail!("fuzz targets failed: {} (inputs saved under fuzz/artifacts/)", failed.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_report_keeps_the_panic_and_how_to_reproduce() {
        let log = "\
INFO: Running with entropic power schedule
#1024\tpulse  cov: 10 ft: 20 corp: 3/30b
thread '<unnamed>' (1) panicked at src/cores.rs:1:1:
s2 reported twice
stack backtrace:
   0: __rustc::rust_begin_unwind
   1: noise
==1== ERROR: libFuzzer: deadly signal
    #0 0x1 in noise
SUMMARY: libFuzzer: deadly signal
Failing input:

\tfuzz/artifacts/cores/crash-1

Output of `std::fmt::Debug`:

\t[1, 2, 3]

Reproduce with:

\tcargo fuzz run cores fuzz/artifacts/cores/crash-1

Minimize test case with:

\tcargo fuzz tmin cores fuzz/artifacts/cores/crash-1
";
        let report = failure_report(log);
        assert_eq!(
            report,
            "thread '<unnamed>' (1) panicked at src/cores.rs:1:1:\ns2 reported twice\nstack backtrace:\n   \
             0: __rustc::rust_begin_unwind\n==1== ERROR: libFuzzer: deadly signal\nSUMMARY: libFuzzer: deadly signal\n\
             Failing input:\n\tfuzz/artifacts/cores/crash-1\nReproduce with:\n\tcargo fuzz run cores \
             fuzz/artifacts/cores/crash-1"
        );
        assert_eq!(failure_report("a\nb"), "a\nb", "no marker: the last lines");
    }
}
