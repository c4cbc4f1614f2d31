//! Runs every committed corpus file through its target's checks, on the
//! ordinary (stable) toolchain: `cargo xtask fuzz --replay`, or
//! `cargo test --manifest-path fuzz/Cargo.toml --no-default-features`.
//!
//! The targets are the same functions the libFuzzer binaries call, so a
//! check that no longer compiles or no longer holds for a kept input fails
//! here without nightly. Inputs in `artifacts-found/` (known bugs, not yet
//! fixed) are not replayed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn corpus_files(target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join("corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Runs `target` on every file of its corpus; a failing file is named.
fn replay(name: &str) {
    let (_, target) = kvlink_fuzz::TARGETS.iter().find(|(n, _)| *n == name).expect("a target of that name");
    let files = corpus_files(name);
    assert!(!files.is_empty(), "corpus/{name} holds no input");
    let mut failed = Vec::new();
    for file in &files {
        let data = std::fs::read(file).unwrap();
        if std::panic::catch_unwind(|| target(&data)).is_err() {
            failed.push(file.display().to_string());
        }
    }
    assert!(failed.is_empty(), "{name}: {} of {} inputs failed: {failed:#?}", failed.len(), files.len());
    eprintln!("{name}: {} inputs replayed", files.len());
}

macro_rules! replay_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                replay(stringify!($name));
            }
        )*

        /// Every target has a binary, a corpus and a replay test, and
        /// nothing else has.
        #[test]
        fn every_target_is_replayed_and_built() {
            let tested: Vec<&str> = vec![$(stringify!($name)),*];
            let targets: Vec<&str> = kvlink_fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
            assert_eq!(tested, targets, "replay tests and TARGETS differ");
            let listed = |dir: &Path, strip: &str| -> Vec<String> {
                let mut names: Vec<String> = std::fs::read_dir(dir)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().trim_end_matches(strip).to_owned())
                    .collect();
                names.sort();
                names
            };
            let mut sorted = targets.clone();
            sorted.sort_unstable();
            assert_eq!(listed(&fuzz_dir().join("fuzz_targets"), ".rs"), sorted, "fuzz_targets/ and TARGETS differ");
            assert_eq!(listed(&fuzz_dir().join("corpus"), ""), sorted, "corpus/ and TARGETS differ");
        }
    };
}

replay_tests!(
    side_channel_frame,
    side_channel_message,
    auth,
    transfer_config_json,
    transfer_params_json,
    bootstrap_http,
    registered_memory,
    dataplane,
    cores,
    tcp_dataplane,
    quic_dataplane,
    rdma_control,
    bench_control,
);
