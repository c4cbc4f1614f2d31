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
