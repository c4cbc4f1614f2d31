//! Where `unsafe` may live: the files and folders ARCHITECTURE.md's unsafe
//! invariant lists (the backticked `crates/` paths, wildcards aside, of the
//! paragraph that starts
//! "**Architecture Invariant:** `unsafe` lives only in"), checked both ways
//! against the library code (`crates/*/src`): every file that says
//! `unsafe` is listed, and every listed path still does.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// How the invariant's paragraph starts in ARCHITECTURE.md.
const INVARIANT: &str = "**Architecture Invariant:** `unsafe` lives only in";

/// The listed paths (relative to the root; a folder ends with `/`).
fn listed(architecture: &str) -> Result<Vec<String>> {
    let start = architecture.find(INVARIANT).with_context(|| format!("ARCHITECTURE.md has no \"{INVARIANT}\""))?;
    let paragraph = architecture[start..].split("\n\n").next().unwrap_or_default();
    let paths: Vec<String> = paragraph
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|quoted| quoted.starts_with("crates/") && !quoted.contains('*'))
        .map(str::to_owned)
        .collect();
    if paths.is_empty() {
        bail!("ARCHITECTURE.md's unsafe invariant lists no `crates/...` path");
    }
    Ok(paths)
}

/// Whether a line of Rust says `unsafe` as a keyword, outside a line
/// comment (`unsafe_code` and the like are other words).
fn says_unsafe(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or_default();
    code.match_indices("unsafe").any(|(at, _)| {
        let before = code[..at].chars().next_back();
        let after = code[at + "unsafe".len()..].chars().next();
        let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !word(before) && !word(after)
    })
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// Library files (under `crates/*/src`) that say `unsafe`, relative to `root`.
fn files_with_unsafe(root: &Path) -> Result<BTreeSet<String>> {
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root.join("crates"))? {
        let src = krate?.path().join("src");
        if src.is_dir() {
            rust_files(&src, &mut files)?;
        }
    }
    let mut found = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        if text.lines().any(says_unsafe) {
            let relative = file.strip_prefix(root).unwrap_or(&file);
            found.insert(relative.to_string_lossy().replace('\\', "/"));
        }
    }
    Ok(found)
}

fn covers(listed: &str, file: &str) -> bool {
    if listed.ends_with('/') {
        file.starts_with(listed)
    } else {
        file == listed
    }
}

/// `cargo xtask ci --step unsafe`.
pub(crate) fn check(root: &Path) -> Result<()> {
    let architecture = std::fs::read_to_string(root.join("ARCHITECTURE.md")).context("reading ARCHITECTURE.md")?;
    let listed = listed(&architecture)?;
    let found = files_with_unsafe(root)?;
    let unlisted: Vec<&String> = found.iter().filter(|f| !listed.iter().any(|l| covers(l, f))).collect();
    let stale: Vec<&String> = listed.iter().filter(|l| !found.iter().any(|f| covers(l, f))).collect();
    for file in &found {
        eprintln!("  {} {file}", if unlisted.contains(&file) { "UNLISTED" } else { "ok      " });
    }
    for path in &stale {
        eprintln!("  STALE    {path} (listed, but says no `unsafe`)");
    }
    if !unlisted.is_empty() || !stale.is_empty() {
        bail!(
            "ARCHITECTURE.md's unsafe invariant is out of date: {} file(s) with `unsafe` not listed, {} listed path(s) \
             without it",
            unlisted.len(),
            stale.len()
        );
    }
    eprintln!("  `unsafe` in {} files, all listed in ARCHITECTURE.md", found.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keyword_is_found_and_other_words_are_not() {
        assert!(says_unsafe("    unsafe { libc::malloc_trim(0) };"));
        assert!(says_unsafe("pub unsafe fn register(&self) {}"));
        assert!(says_unsafe("unsafe impl Send for X {}"));
        assert!(!says_unsafe("#![deny(unsafe_code)]"));
        assert!(!says_unsafe("unsafe_op_in_unsafe_fn = \"deny\""));
        assert!(!says_unsafe("// SAFETY: this unsafe block only reads"));
        assert!(!says_unsafe("let not_unsafe = 1;"));
    }

    #[test]
    fn the_list_is_the_invariants_backticked_crate_paths() {
        let text = "intro `crates/x/src/a.rs`\n\n**Architecture Invariant:** `unsafe` lives only in `crates/a/src/m.rs`, \
                    `crates/b/src/verbs/` and `Worker::start` (not a path)\nstill the paragraph `crates/c/src/d.rs`.\n\n\
                    next `crates/e/src/f.rs`";
        assert_eq!(listed(text).unwrap(), ["crates/a/src/m.rs", "crates/b/src/verbs/", "crates/c/src/d.rs"]);
        assert!(covers("crates/b/src/verbs/", "crates/b/src/verbs/qp.rs"));
        assert!(!covers("crates/a/src/m.rs", "crates/a/src/m.rs.bak"));
    }
}
