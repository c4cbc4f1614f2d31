//! `cargo xtask vllm-matrix`: `vllm-check` on every supported vLLM release
//! ([`engine_test::RELEASES`]), one after another, then one table: per
//! release, what kvlink's own checks under its scheduler and its own
//! connector unit tests counted (passed, deselected with a reason in
//! `vllm_check/unit_manifest.py`, failed).
//!
//! Each release's environment is made from its lock file if missing (a
//! few GB, `engine_test::environment`); those of releases CI does not run
//! are removed once checked unless `--keep-environments`, so the whole
//! matrix fits a machine's disk. A release that fails goes on to the next;
//! the command fails if any did. The table is also written to
//! `target/vllm-matrix.md`.

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::{cmd, engine_test, python};

/// Arguments of `cargo xtask vllm-matrix`.
#[derive(Debug, clap::Args)]
pub(crate) struct MatrixArgs {
    /// Keep every release's environment (by default only those of the releases CI runs stay cached).
    #[arg(long)]
    keep_environments: bool,
    /// Only these releases (repeatable; default: every supported one).
    #[arg(long = "vllm", value_name = "RELEASE",
          value_parser = clap::builder::PossibleValuesParser::new(engine_test::RELEASES))]
    releases: Vec<String>,
}

/// What one pytest run counted (`vllm_check/pytest_counts.py`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    passed: u32,
    failed: u32,
    error: u32,
    skipped: u32,
    deselected: u32,
}

impl Counts {
    /// Parses `name=N` lines; unknown names are ignored.
    fn parse(text: &str) -> Result<Self> {
        let mut counts = Self::default();
        for line in text.lines().filter(|line| !line.trim().is_empty()) {
            let (name, value) = line.split_once('=').with_context(|| format!("not name=N: {line:?}"))?;
            let value: u32 = value.trim().parse().with_context(|| format!("not a count: {line:?}"))?;
            match name.trim() {
                "passed" => counts.passed = value,
                "failed" => counts.failed = value,
                "error" => counts.error = value,
                "skipped" => counts.skipped = value,
                "deselected" => counts.deselected = value,
                _ => {}
            }
        }
        Ok(counts)
    }

    fn read(path: &Path) -> Option<Self> {
        Self::parse(&std::fs::read_to_string(path).ok()?).ok()
    }

    fn failed(&self) -> u32 {
        self.failed + self.error
    }
}

/// One release's row.
#[derive(Debug)]
struct Row {
    release: String,
    scheduler: Option<Counts>,
    unit: Option<Counts>,
    /// Why the release failed, if it did.
    error: Option<String>,
    minutes: f64,
}

impl Row {
    fn cell(counts: Option<Counts>, show: impl Fn(Counts) -> String) -> String {
        counts.map_or_else(|| "-".to_owned(), show)
    }

    fn markdown(&self) -> String {
        let scheduler = Self::cell(self.scheduler, |c| {
            // Skipped: checks of hooks a later release brings.
            let skipped = if c.skipped > 0 { format!(", {} skipped", c.skipped) } else { String::new() };
            format!("{} passed{skipped}, {} failed", c.passed, c.failed())
        });
        let passed = Self::cell(self.unit, |c| c.passed.to_string());
        let deselected = Self::cell(self.unit, |c| c.deselected.to_string());
        let failed = Self::cell(self.unit, |c| c.failed().to_string());
        let outcome = self.error.as_deref().unwrap_or("ok");
        format!(
            "| {} | {scheduler} | {passed} | {deselected} | {failed} | {outcome} | {:.1} |",
            self.release, self.minutes
        )
    }
}

const HEADER: &str = "| vLLM | kvlink's checks under its scheduler | its unit tests passed | deselected | failed | \
                      outcome | minutes |\n|---|---|---|---|---|---|---|";

/// `cargo xtask vllm-matrix`.
pub(crate) fn run(args: &MatrixArgs) -> Result<ExitCode> {
    let root = cmd::workspace_root()?;
    let releases: Vec<&str> = if args.releases.is_empty() {
        engine_test::RELEASES.to_vec()
    } else {
        engine_test::RELEASES.iter().copied().filter(|r| args.releases.iter().any(|w| w == r)).collect()
    };
    let mut rows = Vec::with_capacity(releases.len());
    for release in releases {
        println!("\n==> vllm-matrix: vLLM {release}");
        let started = Instant::now();
        let outcome = python::check_release(&root, release, &[]);
        let work = python::check_dir(&root, release);
        let row = Row {
            release: release.to_owned(),
            scheduler: Counts::read(&work.join("scheduler.counts")),
            unit: Counts::read(&work.join("unit.counts")),
            error: outcome.err().map(|err| format!("{err:#}").replace('|', "/")),
            minutes: started.elapsed().as_secs_f64() / 60.0,
        };
        println!("<== {}", row.markdown());
        rows.push(row);
        if !args.keep_environments && !engine_test::CI_RELEASES.contains(&release) {
            engine_test::remove_environment(release);
        }
    }
    let mut table = format!("{HEADER}\n");
    for row in &rows {
        let _ = writeln!(table, "{}", row.markdown());
    }
    let path = python::target_dir(&root).join("vllm-matrix.md");
    std::fs::write(&path, &table).with_context(|| format!("writing {}", path.display()))?;
    println!("\n{table}(also in {})", path.display());
    let failed = rows.iter().filter(|row| row.error.is_some()).count();
    println!("vllm-matrix: {} passed, {failed} failed", rows.len() - failed);
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

#[cfg(test)]
mod tests {
    use super::Counts;

    #[test]
    fn counts_are_read_from_name_value_lines() {
        let counts = Counts::parse("passed=31\nfailed=1\nerror=2\nskipped=0\ndeselected=8\nxpassed=4\n").unwrap();
        assert_eq!(counts, Counts { passed: 31, failed: 1, error: 2, skipped: 0, deselected: 8 });
        assert_eq!(counts.failed(), 3);
        assert!(Counts::parse("passed=x").is_err());
        assert!(Counts::parse("passed").is_err());
    }
}
