//! `cargo xtask`: kvlink's developer commands.
//!
//! Run through the alias in `.cargo/config.toml`
//! (`cargo xtask` = `cargo run --quiet --package xtask --`).
//!
//! * `cargo xtask ci` runs every CI step (the machine set-up, fmt, dependency
//!   rule, clippy per feature set, tests, the RDMA tests in a Soft-RoCE
//!   guest, docs), keeps going after a failure, prints a summary and exits
//!   non-zero if any step failed.
//! * `cargo xtask setup [--check]` checks for the apt packages, rustup
//!   components, nightly toolchain and cargo-fuzz the steps need and, as
//!   root, installs what is missing (else prints the command that would).
//! * `cargo xtask bench` builds kvlink in release mode and measures the
//!   performance targets as ratios against iperf3 on loopback.
//! * `cargo xtask vllm-check [--vllm RELEASE]` runs the connector under each
//!   supported vLLM release's own scheduler, then that release's own
//!   KV-connector unit tests against it, in the engine test's environment of
//!   the release (also the CI steps `vllm-check:0.14`, `vllm-check:0.32`).
//! * `cargo xtask ci --step <name>` runs only the named step(s);
//!   `cargo xtask ci --list` lists them.
//! * `cargo xtask rdma-test` builds the RDMA tests (transport-rdma's, with
//!   its verbs layer, the conformance suite among them; kv-worker's
//!   end-to-end test with its `rdma` feature) and runs them in a QEMU guest with a Soft-RoCE
//!   device; `--bench` runs `kvlink demo` and `kvlink bench` over RDMA and
//!   perftest's `ib_write_bw` there instead, with the throughput ratio.
//!
//! * `cargo xtask soak [--requests N --in-flight M ...]` runs 10,000
//!   requests with 512 in flight between separate kvlink processes on
//!   loopback (4 producers to 1 decode, then 1 producer to 2 decodes) and
//!   checks for failures, RSS growth and leaked descriptors or tasks.
//!
//! * `cargo xtask fuzz [--seconds N] [--target T]` fuzzes the decoders and
//!   state machines (cargo-fuzz on nightly) from the committed corpus;
//!   `cargo xtask fuzz --replay` runs that corpus through the same checks
//!   on stable.
//!
//! * `cargo xtask engine-test [--vllm RELEASE] [PYTEST_ARGS]` runs kvlink
//!   between two real vLLM engines of a supported release (0.14.0 by
//!   default, or 0.32.0; CPU build, tiny generated models) behind
//!   vllm-router, against a baseline engine, with faults and TTFT figures
//!   (also the CI steps `engine:0.14`, `engine:0.32`).
//!
//! Modules, one job each: [`cmd`] spawns cargo, [`ci`] owns the step table and
//! the runner, [`deps`] checks the crate dependency rule, [`vm`] boots the
//! Soft-RoCE guest and [`rdma_test`] runs the RDMA tests in it, [`python`]
//! builds and tests the `kvlink_vllm` package, [`fuzz`] runs the fuzz targets,
//! [`soak`] runs the soak, [`setup`] checks and installs the machine's tools,
//! [`engine_test`] runs the two-engine test.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod bench;
mod ci;
mod cmd;
mod deps;
mod engine_test;
mod fuzz;
mod matrix;
mod python;
mod rdma_test;
mod setup;
mod soak;
mod unsafe_files;
mod vm;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvlink developer commands.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The developer commands. To add one (e.g. `bench`): add a variant here with
/// its own `clap::Args` struct, put the work in its own module, and add the
/// arm to the `match` in [`main`].
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the CI checks: fmt, dependency rule, clippy (per feature set), tests, docs, the Python package.
    Ci(ci::CiArgs),
    /// Check for the apt packages, rustup components, nightly and cargo-fuzz the CI steps need; install them as root.
    Setup(setup::SetupArgs),
    /// Measure the transfer path against iperf3 on loopback (median of runs, ratios).
    Bench(bench::BenchArgs),
    /// Build the RDMA tests and run them in a Soft-RoCE QEMU guest (`--bench`: demo, bench, ib_write_bw).
    RdmaTest(rdma_test::RdmaTestArgs),
    /// kvlink under each supported vLLM's own scheduler, then that vLLM's own connector unit tests (offline, CPU).
    VllmCheck(python::VllmCheckArgs),
    /// `vllm-check` on every supported vLLM release (0.14..0.34), one table of what each counted.
    VllmMatrix(matrix::MatrixArgs),
    /// Fuzz the decoders and state machines (nightly, cargo-fuzz), or replay their corpus on stable.
    Fuzz(fuzz::FuzzArgs),
    /// Many requests between separate kvlink processes (4 P -> 1 D, then 1 P -> 2 D): no failure, flat RSS, no leak.
    Soak(soak::SoakArgs),
    /// kvlink between two real vLLM engines (CPU, any supported release): P/D through vllm-router against a baseline, faults, TTFT.
    EngineTest(engine_test::EngineTestArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Ci(args) => ci::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::RdmaTest(args) => rdma_test::run(&args),
        Command::VllmCheck(args) => python::vllm_check(&args),
        Command::VllmMatrix(args) => matrix::run(&args),
        Command::Fuzz(args) => fuzz::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Soak(args) => soak::run(&args),
        Command::EngineTest(args) => engine_test::run(&args),
        Command::Setup(args) => setup::run(&args).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::from(2)
        }
    }
}
