//! `cargo xtask setup`: the machine set-up the CI steps need, checked and,
//! as root, installed. `cargo xtask ci` runs it as its first step.
//!
//! What is checked (the single list of it; `.ci/run` has none):
//!
//! * the Debian packages of [`APT_PACKAGES`], each by `dpkg-query -W -f='${Status}'`;
//! * the rustup components of [`RUSTUP_COMPONENTS`] on the active toolchain;
//! * a `nightly` rustup toolchain (the fuzz smoke runs cargo-fuzz on it);
//! * cargo-fuzz at [`fuzz::CARGO_FUZZ_VERSION`] (`cargo fuzz --version`).
//!
//! As root, whatever is missing is installed: `apt-get update` once, then
//! `apt-get install -y --no-install-recommends` (noninteractive);
//! `rustup component add`; `rustup toolchain install nightly --profile
//! minimal`; `cargo install cargo-fuzz --version V --locked`. An install
//! that fails is reported and the others still run; the step fails if
//! anything is still missing afterwards. Not as root (or with `--check`)
//! nothing is installed: the step prints the one command that would install
//! the missing pieces and fails, and the steps that need them fail with
//! their own errors. With nothing missing it takes well under a second.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Result};

use crate::{cmd, fuzz};

/// The Debian packages the tests need: the namespace and bench tests
/// (`iproute2`, `iperf3`, `nftables`); the verbs bindings of the RDMA tests
/// (`cmake`, `libclang-dev`); the Soft-RoCE QEMU guest of `cargo xtask
/// rdma-test` (the rest). Extend here.
pub(crate) const APT_PACKAGES: &[&str] = &[
    "iproute2",
    "iperf3",
    "nftables",
    "cmake",
    "libclang-dev",
    "qemu-system-x86",
    "linux-image-amd64",
    "busybox-static",
    "kmod",
    "rdma-core",
    "ibverbs-providers",
];

/// The rustup components of the active toolchain the steps use (`fmt`, `clippy:*`).
pub(crate) const RUSTUP_COMPONENTS: &[&str] = &["rustfmt", "clippy"];

/// Options of `cargo xtask setup`.
#[derive(Debug, clap::Args)]
pub(crate) struct SetupArgs {
    /// Only report what is missing and the command that installs it; install nothing.
    #[arg(long)]
    check: bool,
}

/// What the machine lacks. Empty when it is ready.
#[derive(Debug, Default, PartialEq, Eq)]
struct Missing {
    /// Packages of [`APT_PACKAGES`] not installed.
    apt: Vec<&'static str>,
    /// Components of [`RUSTUP_COMPONENTS`] not installed.
    components: Vec<&'static str>,
    /// No `nightly` toolchain.
    nightly: bool,
    /// cargo-fuzz is not at the pinned version: what there is instead.
    cargo_fuzz: Option<String>,
}

impl Missing {
    fn is_empty(&self) -> bool {
        self.apt.is_empty() && self.components.is_empty() && !self.nightly && self.cargo_fuzz.is_none()
    }

    /// One line: what is missing.
    fn summary(&self) -> String {
        let mut parts = Vec::new();
        if !self.apt.is_empty() {
            parts.push(format!("apt packages {}", self.apt.join(" ")));
        }
        if !self.components.is_empty() {
            parts.push(format!("rustup components {}", self.components.join(" ")));
        }
        if self.nightly {
            parts.push("the nightly toolchain".to_owned());
        }
        if self.cargo_fuzz.is_some() {
            parts.push(format!("cargo-fuzz {}", fuzz::CARGO_FUZZ_VERSION));
        }
        parts.join("; ")
    }
}

/// One installation.
#[derive(Debug, PartialEq, Eq)]
enum Install {
    /// `apt-get update`, then `apt-get install` of these packages.
    Apt(Vec<&'static str>),
    /// `rustup component add` of these components.
    Components(Vec<&'static str>),
    /// `rustup toolchain install nightly --profile minimal`.
    Nightly,
    /// `cargo install cargo-fuzz --version V --locked`.
    CargoFuzz,
}

const APT_INSTALL: &str = "apt-get install -y --no-install-recommends";

impl Install {
    /// The command line, as a shell would run it.
    fn shell(&self) -> String {
        match self {
            Install::Apt(packages) => {
                format!("apt-get update && DEBIAN_FRONTEND=noninteractive {APT_INSTALL} {}", packages.join(" "))
            }
            Install::Components(components) => format!("rustup component add {}", components.join(" ")),
            Install::Nightly => "rustup toolchain install nightly --profile minimal".to_owned(),
            Install::CargoFuzz => {
                format!("cargo install cargo-fuzz --version {} --locked", fuzz::CARGO_FUZZ_VERSION)
            }
        }
    }

    /// Runs it with inherited output.
    fn run(&self, root: &Path) -> Result<()> {
        match self {
            Install::Apt(packages) => {
                let mut update = Command::new("apt-get");
                update.arg("update").env("DEBIAN_FRONTEND", "noninteractive");
                if let Err(err) = cmd::run_inherited(update, "apt-get update") {
                    // The package lists may still be recent enough: try the install.
                    println!("setup: warning: {err:#}; trying the install anyway");
                }
                let mut install = Command::new("apt-get");
                install
                    .args(["install", "-y", "--no-install-recommends"])
                    .args(packages)
                    .env("DEBIAN_FRONTEND", "noninteractive");
                cmd::run_inherited(install, &format!("{APT_INSTALL} {}", packages.join(" ")))
            }
            Install::Components(components) => {
                let mut add = Command::new("rustup");
                add.args(["component", "add"]).args(components).current_dir(root);
                cmd::run_inherited(add, &self.shell())
            }
            Install::Nightly => {
                let mut install = Command::new("rustup");
                install.args(["toolchain", "install", "nightly", "--profile", "minimal"]).current_dir(root);
                cmd::run_inherited(install, &self.shell())
            }
            Install::CargoFuzz => {
                let install = cmd::cargo(
                    root,
                    &["install", "cargo-fuzz", "--version", fuzz::CARGO_FUZZ_VERSION, "--locked"],
                    true,
                );
                cmd::run_inherited(install, &self.shell())
            }
        }
    }
}

/// The installations that supply what is missing, in the order they must run
/// (cargo-fuzz builds on stable, so it does not wait for nightly).
fn plan(missing: &Missing) -> Vec<Install> {
    let mut plan = Vec::new();
    if !missing.apt.is_empty() {
        plan.push(Install::Apt(missing.apt.clone()));
    }
    if !missing.components.is_empty() {
        plan.push(Install::Components(missing.components.clone()));
    }
    if missing.nightly {
        plan.push(Install::Nightly);
    }
    if missing.cargo_fuzz.is_some() {
        plan.push(Install::CargoFuzz);
    }
    plan
}

/// The one command a user who is not root runs to install the plan: the apt
/// part through sudo, the rustup and cargo parts as themselves (they install
/// into the user's own rustup and cargo homes).
fn manual_command(plan: &[Install]) -> String {
    let parts: Vec<String> = plan
        .iter()
        .map(|install| match install {
            Install::Apt(_) => format!("sudo sh -c '{}'", install.shell()),
            _ => install.shell(),
        })
        .collect();
    parts.join(" && ")
}

/// Stdout of `command` if it starts and exits 0 (stderr discarded); `Err`
/// only when it cannot start.
fn quiet_output(mut command: Command) -> std::io::Result<Option<String>> {
    let output = command.stdin(Stdio::null()).stderr(Stdio::null()).output()?;
    Ok(output.status.success().then(|| String::from_utf8_lossy(&output.stdout).into_owned()))
}

/// Whether a `dpkg-query -W -f='${Status}'` status (`want error status`,
/// e.g. `install ok installed`) is an installed package; `deinstall ok
/// config-files` and the like are not.
fn dpkg_installed(status: &str) -> bool {
    let words: Vec<&str> = status.split_whitespace().collect();
    words.len() == 3 && words[1] == "ok" && words[2] == "installed"
}

/// Whether `rustup component list --installed` lists `component` (lines are
/// `<component>-<target triple>`, e.g. `rustfmt-x86_64-unknown-linux-gnu`).
fn has_component(installed: &str, component: &str) -> bool {
    installed
        .lines()
        .map(str::trim)
        .any(|line| line == component || line.strip_prefix(component).is_some_and(|rest| rest.starts_with('-')))
}

/// Whether `rustup toolchain list` has the toolchain `+nightly` names:
/// `nightly` (a linked one) or `nightly-<host>`, not a dated `nightly-2024-...`.
fn has_nightly(toolchains: &str) -> bool {
    toolchains.lines().filter_map(|line| line.split_whitespace().next()).any(|name| {
        name == "nightly"
            || name.strip_prefix("nightly-").is_some_and(|rest| !rest.starts_with(|c: char| c.is_ascii_digit()))
    })
}

/// The version `cargo fuzz --version` prints (`cargo-fuzz 0.13.2`).
fn cargo_fuzz_version(output: &str) -> Option<&str> {
    let mut words = output.split_whitespace();
    (words.next() == Some("cargo-fuzz")).then(|| words.next()).flatten()
}

/// Checks the machine, printing one line per kind of thing checked.
fn check(root: &Path) -> Missing {
    let mut missing = Missing::default();

    let mut dpkg_available = true;
    for &package in APT_PACKAGES {
        let mut query = Command::new("dpkg-query");
        query.args(["-W", "-f=${Status}", package]);
        match quiet_output(query) {
            Ok(Some(status)) if dpkg_installed(&status) => {}
            Ok(_) => missing.apt.push(package),
            Err(_) => {
                dpkg_available = false;
                break;
            }
        }
    }
    if !dpkg_available {
        println!(
            "setup: apt packages: not checked (no dpkg-query: not a Debian machine?); they are: {}",
            APT_PACKAGES.join(" ")
        );
    } else if missing.apt.is_empty() {
        println!("setup: apt packages: all {} installed", APT_PACKAGES.len());
    } else {
        println!(
            "setup: apt packages: {} of {} installed; missing: {}",
            APT_PACKAGES.len() - missing.apt.len(),
            APT_PACKAGES.len(),
            missing.apt.join(" ")
        );
    }

    let mut components = Command::new("rustup");
    components.args(["component", "list", "--installed"]).current_dir(root);
    let mut toolchains = Command::new("rustup");
    toolchains.args(["toolchain", "list"]).current_dir(root);
    match (quiet_output(components), quiet_output(toolchains)) {
        (Ok(Some(components)), Ok(Some(toolchains))) => {
            missing.components = RUSTUP_COMPONENTS.iter().copied().filter(|c| !has_component(&components, c)).collect();
            missing.nightly = !has_nightly(&toolchains);
            if missing.components.is_empty() {
                println!("setup: rustup components: {} installed", RUSTUP_COMPONENTS.join(" "));
            } else {
                println!("setup: rustup components: missing {}", missing.components.join(" "));
            }
            println!("setup: nightly toolchain: {}", if missing.nightly { "missing" } else { "installed" });
        }
        _ => println!(
            "setup: rustup components and nightly toolchain: not checked (`rustup` does not run); \
             the steps need {} and a nightly toolchain",
            RUSTUP_COMPONENTS.join(" ")
        ),
    }

    let found = quiet_output(cmd::cargo(root, &["fuzz", "--version"], false))
        .ok()
        .flatten()
        .and_then(|output| cargo_fuzz_version(&output).map(str::to_owned));
    match found {
        Some(version) if version == fuzz::CARGO_FUZZ_VERSION => {
            println!("setup: cargo-fuzz: {version} installed");
        }
        Some(version) => {
            println!("setup: cargo-fuzz: {version} installed, {} wanted", fuzz::CARGO_FUZZ_VERSION);
            missing.cargo_fuzz = Some(version);
        }
        None => {
            println!("setup: cargo-fuzz: missing ({} wanted)", fuzz::CARGO_FUZZ_VERSION);
            missing.cargo_fuzz = Some("none".to_owned());
        }
    }
    missing
}

/// Whether we run as root (`id -u` prints 0).
fn is_root() -> bool {
    let mut id = Command::new("id");
    id.arg("-u");
    quiet_output(id).ok().flatten().is_some_and(|uid| uid.trim() == "0")
}

/// Checks the machine and, as root unless `check_only`, installs what is
/// missing. Fails if anything is missing at the end.
pub(crate) fn ensure(root: &Path, check_only: bool) -> Result<()> {
    let missing = check(root);
    if missing.is_empty() {
        println!("setup: nothing missing");
        return Ok(());
    }
    let plan = plan(&missing);
    if check_only || !is_root() {
        let why = if check_only { "--check" } else { "not root" };
        println!("setup: {why}: installing nothing; this installs what is missing:");
        println!("  {}", manual_command(&plan));
        bail!("missing {}", missing.summary());
    }
    for install in &plan {
        println!("setup: + {}", install.shell());
        if let Err(err) = install.run(root) {
            println!("setup: warning: {err:#}; continuing");
        }
    }
    println!("setup: checking again");
    let after = check(root);
    if !after.is_empty() {
        bail!("still missing after installing: {}", after.summary());
    }
    println!("setup: everything installed");
    Ok(())
}

/// Runs `cargo xtask setup`.
pub(crate) fn run(args: &SetupArgs) -> Result<()> {
    ensure(&cmd::workspace_root()?, args.check)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_missing_plans_nothing() {
        let missing = Missing::default();
        assert!(missing.is_empty());
        assert!(plan(&missing).is_empty());
    }

    #[test]
    fn everything_missing_plans_apt_then_rustup_then_cargo() {
        let missing = Missing {
            apt: vec!["iperf3", "cmake"],
            components: vec!["clippy"],
            nightly: true,
            cargo_fuzz: Some("0.12.0".to_owned()),
        };
        let plan = plan(&missing);
        assert_eq!(
            plan,
            vec![
                Install::Apt(vec!["iperf3", "cmake"]),
                Install::Components(vec!["clippy"]),
                Install::Nightly,
                Install::CargoFuzz
            ]
        );
        assert_eq!(
            manual_command(&plan),
            format!(
                "sudo sh -c 'apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
                 --no-install-recommends iperf3 cmake' && rustup component add clippy && rustup toolchain \
                 install nightly --profile minimal && cargo install cargo-fuzz --version {} --locked",
                fuzz::CARGO_FUZZ_VERSION
            )
        );
        assert_eq!(
            missing.summary(),
            format!(
                "apt packages iperf3 cmake; rustup components clippy; the nightly toolchain; cargo-fuzz {}",
                fuzz::CARGO_FUZZ_VERSION
            )
        );
    }

    #[test]
    fn only_nightly_missing_plans_only_nightly() {
        let missing = Missing { nightly: true, ..Missing::default() };
        assert_eq!(plan(&missing), vec![Install::Nightly]);
        assert_eq!(manual_command(&plan(&missing)), "rustup toolchain install nightly --profile minimal");
    }

    #[test]
    fn dpkg_status_installed_only_when_installed() {
        assert!(dpkg_installed("install ok installed"));
        assert!(dpkg_installed("hold ok installed"));
        assert!(!dpkg_installed("deinstall ok config-files"));
        assert!(!dpkg_installed("install ok half-configured"));
        assert!(!dpkg_installed("unknown ok not-installed"));
        assert!(!dpkg_installed(""));
    }

    #[test]
    fn components_match_by_name_not_prefix() {
        let installed =
            "cargo-x86_64-unknown-linux-gnu\nclippy-x86_64-unknown-linux-gnu\nrustfmt-x86_64-unknown-linux-gnu\n";
        assert!(has_component(installed, "rustfmt"));
        assert!(has_component(installed, "clippy"));
        assert!(!has_component(installed, "rust-src"));
        assert!(!has_component("rustfmtx-x86_64-unknown-linux-gnu\n", "rustfmt"));
    }

    #[test]
    fn nightly_is_the_undated_one() {
        assert!(has_nightly("stable-x86_64-unknown-linux-gnu (active, default)\nnightly-x86_64-unknown-linux-gnu\n"));
        assert!(has_nightly("nightly\n"));
        assert!(!has_nightly(
            "stable-x86_64-unknown-linux-gnu (default)\nnightly-2024-01-01-x86_64-unknown-linux-gnu\n"
        ));
        assert!(!has_nightly("no installed toolchains\n"));
    }

    #[test]
    fn cargo_fuzz_version_is_read() {
        assert_eq!(cargo_fuzz_version("cargo-fuzz 0.13.2\n"), Some("0.13.2"));
        assert_eq!(cargo_fuzz_version("error: no such command: `fuzz`"), None);
        assert_eq!(cargo_fuzz_version(""), None);
    }
}
