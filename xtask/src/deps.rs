//! The crate dependency rule (ARCHITECTURE.md's first invariants), checked on each crate's
//! NORMAL dependency tree (`cargo tree -e normal`, so dev- and
//! build-dependencies are not counted) for every target platform.
//!
//! The rule is the [`RULES`] table: each row names the crates it applies to,
//! the feature set to resolve them with, and the crates that must not appear
//! anywhere below them. Extend the table to extend the rule.

use std::fmt;
use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::cmd;

/// A crate-name pattern.
#[derive(Debug, Clone, Copy)]
enum Pat {
    /// Exactly this name.
    Exact(&'static str),
    /// Any name starting with this (e.g. `transport-` for every transport).
    Prefix(&'static str),
}

use Pat::{Exact, Prefix};

impl Pat {
    fn matches(self, name: &str) -> bool {
        match self {
            Exact(exact) => name == exact,
            Prefix(prefix) => name.starts_with(prefix),
        }
    }
}

impl fmt::Display for Pat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exact(exact) => f.write_str(exact),
            Prefix(prefix) => write!(f, "{prefix}*"),
        }
    }
}

/// Which features the subject crate is resolved with.
#[derive(Debug, Clone, Copy)]
enum Features {
    /// `--all-features`: features are additive, so this is the widest tree.
    All,
    /// `--no-default-features`: what the crate needs without opting in.
    NoDefault,
}

impl Features {
    fn flag(self) -> &'static str {
        match self {
            Features::All => "--all-features",
            Features::NoDefault => "--no-default-features",
        }
    }
}

/// One row of the dependency rule.
#[derive(Debug)]
struct Rule {
    /// Workspace crates the row applies to (each pattern must match at least one member).
    subjects: &'static [Pat],
    features: Features,
    /// Crates that must not appear in a subject's normal dependency tree
    /// (the subject itself, at the root, is never matched).
    forbidden: &'static [Pat],
    /// Why, printed with a violation.
    why: &'static str,
}

/// The dependency rule.
const RULES: &[Rule] = &[
    Rule {
        subjects: &[Exact("kv-proto"), Exact("kv-sched")],
        features: Features::All,
        forbidden: &[
            Exact("tokio"),
            Exact("tokio-util"),
            Exact("mio"),
            Prefix("transport-"),
            Exact("kv-worker"),
            Exact("kvlink"),
        ],
        why: "kv-proto and kv-sched are sans-IO: no async runtime, no transport, no worker",
    },
    Rule {
        subjects: &[Prefix("transport-")],
        features: Features::All,
        forbidden: &[Exact("kv-sched"), Exact("kv-worker"), Exact("kvlink"), Prefix("transport-")],
        why:
            "a transport depends on kv-proto and kv-net only: not on kv-sched, kv-worker, kvlink, nor another transport",
    },
    Rule {
        subjects: &[Exact("kv-net")],
        features: Features::All,
        forbidden: &[Exact("kv-sched"), Exact("kv-worker"), Exact("kvlink"), Prefix("transport-")],
        why: "kv-net is what transports share: it depends on kv-proto, never on a transport or what uses them",
    },
    Rule {
        subjects: &[Exact("kv-worker")],
        features: Features::All,
        forbidden: &[Exact("kvlink")],
        why: "kv-worker is a library under kvlink, never the other way round",
    },
    Rule {
        subjects: &[Exact("kv-worker")],
        features: Features::NoDefault,
        forbidden: &[Prefix("transport-")],
        why: "kv-worker reaches transports only through its features (tcp, quic, rdma)",
    },
];

/// Paths shown per (crate, feature set) before the rest are only counted.
const MAX_PATHS_SHOWN: usize = 10;

/// Workspace member names, from `cargo tree --workspace --depth 0`.
fn workspace_members(root: &Path) -> Result<Vec<String>> {
    let args = ["tree", "--workspace", "-e", "normal", "--depth", "0", "--prefix", "none"];
    let display = format!("cargo {}", args.join(" "));
    let out = cmd::run_captured(cmd::cargo(root, &args, false), &display)?;
    let members: Vec<String> =
        out.lines().filter_map(|line| line.split_whitespace().next()).map(str::to_owned).collect();
    if members.is_empty() {
        bail!("`{display}` listed no workspace members");
    }
    Ok(members)
}

/// The forbidden paths in one `cargo tree --prefix depth` output: each is the
/// chain of crate names from the root to a forbidden crate. Below a forbidden
/// crate nothing more is reported (tokio's own mio is not a second finding).
fn violations(tree: &str, forbidden: &[Pat]) -> Vec<String> {
    let mut stack: Vec<&str> = Vec::new();
    let mut found = Vec::new();
    let mut inside_forbidden: Option<usize> = None;
    for line in tree.lines() {
        let digits = line.bytes().take_while(u8::is_ascii_digit).count();
        let Ok(depth) = line[..digits].parse::<usize>() else { continue };
        let Some(name) = line[digits..].split_whitespace().next() else { continue };
        stack.truncate(depth);
        stack.push(name);
        match inside_forbidden {
            Some(top) if depth > top => continue,
            _ => inside_forbidden = None,
        }
        if depth > 0 && forbidden.iter().any(|pat| pat.matches(name)) {
            found.push(stack.join(" -> "));
            inside_forbidden = Some(depth);
        }
    }
    found
}

/// Checks one crate against one rule; returns the report lines of violations.
fn check_crate(root: &Path, krate: &str, rule: &Rule) -> Result<Vec<String>> {
    let args = [
        "tree",
        "-p",
        krate,
        "-e",
        "normal",
        rule.features.flag(),
        "--target",
        "all",
        "--prefix",
        "depth",
        "--no-dedupe",
    ];
    let display = format!("cargo {}", args.join(" "));
    let tree = cmd::run_captured(cmd::cargo(root, &args, false), &display)?;
    let found = violations(&tree, rule.forbidden);
    let mut report: Vec<String> =
        found.iter().take(MAX_PATHS_SHOWN).map(|path| format!("    forbidden dependency: {path}")).collect();
    if found.len() > MAX_PATHS_SHOWN {
        report.push(format!("    ... and {} more paths", found.len() - MAX_PATHS_SHOWN));
    }
    Ok(report)
}

/// Runs the whole rule; fails listing every offending path.
pub(crate) fn check(root: &Path) -> Result<()> {
    let members = workspace_members(root)?;
    let mut violated = 0usize;
    for rule in RULES {
        let forbidden: Vec<String> = rule.forbidden.iter().map(ToString::to_string).collect();
        for subject in rule.subjects {
            let crates: Vec<&String> = members.iter().filter(|member| subject.matches(member)).collect();
            if crates.is_empty() {
                bail!("dependency rule names `{subject}`, which matches no workspace member: update the RULES table");
            }
            for krate in crates {
                let report = check_crate(root, krate, rule)
                    .with_context(|| format!("checking the dependency tree of {krate}"))?;
                let status = if report.is_empty() { "ok" } else { "VIOLATION" };
                println!("  {status:<9} {krate} ({}): none of {}", rule.features.flag(), forbidden.join(", "));
                if !report.is_empty() {
                    violated += 1;
                    println!("    rule: {}", rule.why);
                    for line in report {
                        println!("{line}");
                    }
                }
            }
        }
    }
    if violated > 0 {
        bail!("{violated} crate/rule pair(s) break the dependency rule (paths above)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TREE: &str = "\
0kv-sched v0.1.0 (/w/crates/kv-sched)
1kv-proto v0.1.0 (/w/crates/kv-proto)
2bytes v1.0.0
1helper v0.1.0
2tokio v1.0.0
3mio v1.0.0
2bytes v1.0.0
1transport-tcp v0.1.0 (/w/crates/transport-tcp)
";

    #[test]
    fn reports_paths_and_skips_below_a_finding() {
        let found = violations(TREE, &[Exact("tokio"), Exact("mio"), Prefix("transport-")]);
        assert_eq!(found, vec!["kv-sched -> helper -> tokio", "kv-sched -> transport-tcp"]);
    }

    #[test]
    fn root_is_never_a_finding() {
        let tree = "0transport-tcp v0.1.0 (/w)\n1kv-proto v0.1.0 (/w)\n";
        assert!(violations(tree, &[Prefix("transport-")]).is_empty());
    }
}
