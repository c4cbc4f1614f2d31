//! `cargo xtask ci`: the step table and the runner.
//!
//! Steps run in order; each gets a header line and a timing line, a failure
//! does not stop the run, and the last lines are the summary
//! (`xtask ci: N passed, M failed`, then the failed step names if any).

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::{cmd, deps, engine_test, fuzz, python, rdma_test, setup, soak, unsafe_files};

/// Crates left out of the workspace-wide all-features clippy, test and doc
/// steps: transport-rdma's device tests need an RDMA device. Its own steps
/// below cover it: clippy with `verbs`, its device-free tests on the host,
/// and `rdma-test` (every test, in a Soft-RoCE guest). kv-worker's and
/// kvlink's `rdma` features still build it (with cmake and libclang) in the
/// all-features steps; their RDMA tests pass vacuously on a host without a
/// device and run for real in `rdma-test`.
const EXCLUDED: &[&str] = &["--exclude", "transport-rdma"];

/// Clippy is run once per feature set: `(step suffix, cargo clippy args)`.
/// Each row becomes the step `clippy:<suffix>`; `--step clippy` runs them all.
const CLIPPY_FEATURE_SETS: &[(&str, &[&str])] = &[
    ("default", &["--workspace", "--all-targets"]),
    ("kv-worker-no-default", &["-p", "kv-worker", "--no-default-features", "--all-targets"]),
    ("all-features", &["--workspace", "--all-targets", "--all-features", "--exclude", "transport-rdma"]),
    ("rdma", &["-p", "transport-rdma", "--all-targets", "--features", "verbs"]),
    ("kv-worker-rdma", &["-p", "kv-worker", "--no-default-features", "--features", "rdma", "--all-targets"]),
];

/// The checks that must hold without debug assertions or overflow checks
/// (cache shape arithmetic, block bounds), run in a release build: one test
/// file of one crate, no transport.
const RELEASE_CHECKS: &[&str] =
    &["test", "--release", "-p", "kv-worker", "--no-default-features", "--test", "checked_shapes"];

/// Arguments of `cargo xtask ci`.
#[derive(Debug, clap::Args)]
pub(crate) struct CiArgs {
    /// Run only this step (repeatable). A group name such as `clippy` selects
    /// all its steps. See `--list` for the names.
    #[arg(long = "step", value_name = "NAME")]
    steps: Vec<String>,
    /// List the steps and the command each runs, then exit.
    #[arg(long)]
    list: bool,
}

/// What a step does.
#[derive(Debug)]
enum Action {
    /// `cargo xtask setup`: check the machine's tools, install what is missing as root (see [`setup`]).
    Setup,
    /// `cargo <args>` with inherited output, plus extra environment.
    Cargo { args: Vec<&'static str>, env: Vec<(&'static str, OsString)> },
    /// The crate dependency rule (see [`deps`]).
    DependencyRule,
    /// Where `unsafe` may live (see [`unsafe_files`]).
    UnsafeFiles,
    /// `cargo xtask rdma-test` (see [`rdma_test`]).
    RdmaTest,
    /// The `kvlink_vllm` Python package: install and pytest (see [`python`]).
    Python,
    /// P and D as real vLLM engines of this release with kvlink (see [`engine_test`]).
    Engine(&'static str),
    /// vLLM's own connector tests of this release against kvlink (see [`python`]).
    VllmCheck(&'static str),
    /// `cargo xtask fuzz` with these options (see [`fuzz`]).
    Fuzz(fuzz::FuzzArgs),
    /// `cargo xtask soak` with these options (see [`soak`]).
    Soak(soak::SoakArgs),
}

/// One CI step.
#[derive(Debug)]
struct Step {
    /// Unique name, used by `--step` and in the summary.
    name: String,
    /// Group name (`clippy` for the clippy steps; otherwise the name itself).
    group: &'static str,
    action: Action,
}

impl Step {
    fn cargo(name: &str, group: &'static str, args: Vec<&'static str>) -> Self {
        Self { name: name.to_owned(), group, action: Action::Cargo { args, env: Vec::new() } }
    }

    /// How the step is shown in its header and in `--list`.
    fn describe(&self) -> String {
        match &self.action {
            Action::Cargo { args, env } => {
                let env: String =
                    env.iter().map(|(key, value)| format!("{key}={:?} ", value.to_string_lossy())).collect();
                format!("{env}cargo {}", args.join(" "))
            }
            Action::Setup => format!(
                "cargo xtask setup ({} apt packages, rustup {}, nightly, cargo-fuzz {}; installs what is missing \
                 as root)",
                setup::APT_PACKAGES.len(),
                setup::RUSTUP_COMPONENTS.join(" "),
                fuzz::CARGO_FUZZ_VERSION
            ),
            Action::DependencyRule => "dependency rule (cargo tree -e normal per crate)".to_owned(),
            Action::UnsafeFiles => "`unsafe` only in the files ARCHITECTURE.md lists, and all of them".to_owned(),
            Action::RdmaTest => "cargo xtask rdma-test (transport-rdma's tests, the conformance suite's among them, \
                                 and kv-worker's RDMA end-to-end test, in a Soft-RoCE guest)"
                .to_owned(),
            Action::Engine(release) => format!(
                "cargo xtask engine-test --vllm {release} (vLLM {release} CPU: baseline, P and D as `vllm serve`, \
                 vllm-router; a cached venv from engine_test/{})",
                engine_test::lock_name(release)
            ),
            Action::VllmCheck(release) => format!(
                "cargo xtask vllm-check --vllm {release} (kvlink under vLLM {release}'s scheduler, then vLLM's own \
                 tests/v1/kv_connector/unit against KvlinkConnector; the engine test's venv)"
            ),
            Action::Python => format!(
                "kvlink_vllm: venv, pip install {} {}, pip install crates/kvlink-py, pytest",
                python::MATURIN,
                python::PYTEST
            ),
            Action::Fuzz(args) if args.replay => {
                "cargo xtask fuzz --replay (every fuzz corpus file through its target's checks, stable)".to_owned()
            }
            Action::Fuzz(_) => format!(
                "cargo xtask fuzz --seconds {} (every target from the committed corpus, nightly + cargo-fuzz)",
                fuzz::CI_SECONDS
            ),
            Action::Soak(a) => format!(
                "cargo xtask soak --debug --requests {} --in-flight {} --layers {} --head-dim {} --blocks-per-request {} \
                 (separate processes: {} producers -> 1 decode, 1 producer -> {} decodes)",
                a.requests, a.in_flight, a.layers, a.head_dim, a.blocks_per_request, a.producers, a.decoders
            ),
        }
    }

    fn run(&self, root: &Path) -> Result<()> {
        match &self.action {
            Action::Cargo { args, env } => {
                let mut command = cmd::cargo(root, args, true);
                command.envs(env.iter().map(|(key, value)| (key, value)));
                cmd::run_inherited(command, &self.describe())
            }
            Action::Setup => setup::ensure(root, false),
            Action::DependencyRule => deps::check(root),
            Action::UnsafeFiles => unsafe_files::check(root),
            Action::RdmaTest => rdma_test::run_step(),
            Action::Python => python::ci(root),
            Action::Engine(release) => engine_test::ci(root, release),
            Action::VllmCheck(release) => python::vllm_check_ci(root, release),
            Action::Fuzz(args) => fuzz::run(args),
            Action::Soak(args) => soak::soak(args),
        }
    }
}

/// All steps, in run order.
fn steps() -> Vec<Step> {
    let mut steps = vec![
        // First, so the steps after it find their tools (a few seconds when nothing is missing).
        Step { name: "setup".to_owned(), group: "setup", action: Action::Setup },
        Step::cargo("fmt", "fmt", vec!["fmt", "--all", "--", "--check"]),
        Step::cargo("fmt:fuzz", "fmt", vec!["fmt", "--manifest-path", "fuzz/Cargo.toml", "--", "--check"]),
        Step { name: "deps".to_owned(), group: "deps", action: Action::DependencyRule },
        Step { name: "unsafe".to_owned(), group: "unsafe", action: Action::UnsafeFiles },
    ];
    for (suffix, feature_args) in CLIPPY_FEATURE_SETS {
        let mut args = vec!["clippy"];
        args.extend_from_slice(feature_args);
        args.extend_from_slice(&["--", "-D", "warnings"]);
        steps.push(Step::cargo(&format!("clippy:{suffix}"), "clippy", args));
    }
    // The fuzz crate without its libFuzzer entry points (stable; they are
    // one line each), with `--cfg fuzzing` as cargo-fuzz builds it.
    steps.push(Step {
        name: "clippy:fuzz".to_owned(),
        group: "clippy",
        action: Action::Cargo {
            args: vec![
                "clippy",
                "--manifest-path",
                "fuzz/Cargo.toml",
                "--no-default-features",
                "--all-targets",
                "--locked",
                "--",
                "-D",
                "warnings",
            ],
            env: vec![("RUSTFLAGS", fuzz::fuzzing_rustflags())],
        },
    });
    // All features: every test of every crate (each transport runs the
    // conformance suite in its own tests; RDMA's, in `rdma-test`).
    let mut test = vec!["test", "--workspace", "--all-features"];
    test.extend_from_slice(EXCLUDED);
    test.push("--no-fail-fast");
    steps.push(Step::cargo("test", "test", test));
    steps.push(Step::cargo("release-checks", "release-checks", RELEASE_CHECKS.to_vec()));
    // transport-rdma's device-free tests (planner, window, handshake, control
    // codec, fence bookkeeping) need no verbs.
    steps.push(Step::cargo("test:rdma-host", "test", vec!["test", "-p", "transport-rdma", "--no-fail-fast"]));
    // A shortened soak: many requests in flight between separate processes,
    // no failure, flat memory, descriptors and tasks back to their baseline.
    steps.push(Step { name: "soak".to_owned(), group: "soak", action: Action::Soak(soak::SoakArgs::ci()) });
    steps.push(Step { name: "rdma-test".to_owned(), group: "rdma-test", action: Action::RdmaTest });

    let mut doc = vec!["doc", "--workspace", "--no-deps"];
    doc.extend_from_slice(EXCLUDED);
    // Keep whatever RUSTDOCFLAGS the caller set, and deny warnings on top.
    let mut rustdocflags = std::env::var_os("RUSTDOCFLAGS").unwrap_or_default();
    if !rustdocflags.is_empty() {
        rustdocflags.push(" ");
    }
    rustdocflags.push("-D warnings");
    steps.push(Step {
        name: "doc".to_owned(),
        group: "doc",
        action: Action::Cargo { args: doc, env: vec![("RUSTDOCFLAGS", rustdocflags.clone())] },
    });
    steps.push(Step {
        name: "doc:rdma".to_owned(),
        group: "doc",
        action: Action::Cargo {
            args: vec!["doc", "-p", "transport-rdma", "--features", "verbs", "--no-deps"],
            env: vec![("RUSTDOCFLAGS", rustdocflags)],
        },
    });
    steps.push(Step { name: "python".to_owned(), group: "python", action: Action::Python });
    // The CI's vLLM releases (every one: `cargo xtask vllm-matrix`): its
    // connector tests, then, for most, its engines (the first builds the
    // release's cached environment).
    for release in engine_test::CI_RELEASES {
        let minor = engine_test::minor(release);
        steps.push(Step {
            name: format!("vllm-check:{minor}"),
            group: "vllm-check",
            action: Action::VllmCheck(release),
        });
        if engine_test::ENGINE_CI_RELEASES.contains(&release) {
            steps.push(Step { name: format!("engine:{minor}"), group: "engine", action: Action::Engine(release) });
        }
    }
    // The fuzz crate is outside the workspace: its corpus replayed on stable,
    // then a short fuzzing smoke from that corpus on nightly.
    steps.push(Step { name: "fuzz-replay".to_owned(), group: "fuzz", action: Action::Fuzz(fuzz::FuzzArgs::replay()) });
    steps.push(Step { name: "fuzz".to_owned(), group: "fuzz", action: Action::Fuzz(fuzz::FuzzArgs::smoke()) });
    steps
}

/// Keeps the steps named by `--step` (by name or group), all if none given.
fn select(all: Vec<Step>, wanted: &[String]) -> Result<Vec<Step>> {
    if wanted.is_empty() {
        return Ok(all);
    }
    for name in wanted {
        if !all.iter().any(|step| step.name == *name || step.group == name) {
            let known: Vec<&str> = all.iter().map(|step| step.name.as_str()).collect();
            bail!(
                "unknown step `{name}`; steps are: {} (and the groups `clippy`, `test`, `doc`, `fuzz`, `vllm-check`, `engine`)",
                known.join(", ")
            );
        }
    }
    Ok(all.into_iter().filter(|step| wanted.iter().any(|name| step.name == *name || step.group == name)).collect())
}

fn seconds(duration: Duration) -> String {
    format!("{:.1}s", duration.as_secs_f64())
}

/// Runs `cargo xtask ci`.
pub(crate) fn run(args: &CiArgs) -> Result<ExitCode> {
    let steps = select(steps(), &args.steps)?;
    if args.list {
        for step in &steps {
            println!("{:<28} {}", step.name, step.describe());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let root = cmd::workspace_root()?;
    let total = steps.len();
    let mut results: Vec<(&Step, Duration, bool)> = Vec::with_capacity(total);
    for (index, step) in steps.iter().enumerate() {
        println!("\n==> [{}/{total}] {}: {}", index + 1, step.name, step.describe());
        let started = Instant::now();
        let outcome = step.run(&root);
        let elapsed = started.elapsed();
        match &outcome {
            Ok(()) => println!("<== {}: ok in {}", step.name, seconds(elapsed)),
            Err(err) => {
                println!("<== {}: FAILED in {}: {err:#}", step.name, seconds(elapsed));
                println!("    {}", cmd::machine_state(&root));
            }
        }
        results.push((step, elapsed, outcome.is_ok()));
    }

    println!();
    for (step, elapsed, ok) in &results {
        println!("  {:<6} {:<28} {:>8}", if *ok { "ok" } else { "FAILED" }, step.name, seconds(*elapsed));
    }
    let failed: Vec<&str> = results.iter().filter(|(_, _, ok)| !ok).map(|(step, _, _)| step.name.as_str()).collect();
    println!("xtask ci: {} passed, {} failed", total - failed.len(), failed.len());
    if failed.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        println!("failed: {}", failed.join(" "));
        Ok(ExitCode::FAILURE)
    }
}
