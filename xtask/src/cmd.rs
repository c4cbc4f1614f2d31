//! Spawning cargo from the xtask: which binary, which directory, which
//! environment. Everything is inherited from the caller (RUSTFLAGS,
//! CARGO_TARGET_DIR, ...); the only thing added is `CARGO_TERM_COLOR=always`
//! when our stdout is a terminal and the caller did not choose a colour mode.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The workspace root: the parent of this crate's manifest directory.
pub(crate) fn workspace_root() -> Result<PathBuf> {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .parent()
        .with_context(|| format!("xtask manifest dir {} has no parent", manifest_dir.display()))?;
    Ok(root.to_path_buf())
}

/// The cargo that launched us (`$CARGO`), else `cargo` from `PATH`.
fn cargo_program() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"))
}

/// A `cargo <args>` command run from the workspace root.
///
/// `colour` asks for `CARGO_TERM_COLOR=always` when stdout is a terminal; pass
/// `false` for commands whose stdout is captured and parsed.
pub(crate) fn cargo(root: &Path, args: &[&str], colour: bool) -> Command {
    let mut command = Command::new(cargo_program());
    command.args(args).current_dir(root);
    if colour && std::io::stdout().is_terminal() && std::env::var_os("CARGO_TERM_COLOR").is_none() {
        command.env("CARGO_TERM_COLOR", "always");
    }
    command
}

/// What a failed step may have run out of, in one line: free space on the
/// filesystem holding `dir` (`df`) and the memory the kernel says is
/// available (`/proc/meminfo`). A build that dies for want of either prints
/// its cause far above the summary; this line is printed beside it.
pub(crate) fn machine_state(dir: &Path) -> String {
    let disk = Command::new("df")
        .args(["-Pk"])
        .arg(dir)
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.lines().nth(1).and_then(|line| line.split_whitespace().nth(3)?.parse::<u64>().ok()))
        .map_or_else(|| "unknown".to_owned(), |kib| format!("{:.1} GiB", kib as f64 / (1 << 20) as f64));
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|line| line.starts_with("MemAvailable:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or_else(|| "unknown".to_owned(), |kib| format!("{:.1} GiB", kib as f64 / (1 << 20) as f64));
    format!("disk free under {}: {disk}; memory available: {memory}", dir.display())
}

/// Runs `command` with inherited stdio and fails unless it exits 0.
pub(crate) fn run_inherited(mut command: Command, display: &str) -> Result<()> {
    let status = command.status().with_context(|| format!("could not start `{display}`"))?;
    if !status.success() {
        bail!("`{display}` failed ({status})");
    }
    Ok(())
}

/// Runs `command`, capturing stdout (stderr goes to the terminal), and
/// returns stdout as text; fails unless it exits 0.
pub(crate) fn run_captured(mut command: Command, display: &str) -> Result<String> {
    let output = command
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("could not start `{display}`"))?;
    if !output.status.success() {
        bail!("`{display}` failed ({})", output.status);
    }
    String::from_utf8(output.stdout).with_context(|| format!("`{display}` printed non-UTF-8 output"))
}
