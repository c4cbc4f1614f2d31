//! A throw-away QEMU guest with a Soft-RoCE device (`rxe0`), for the RDMA
//! tests: these machines have no RDMA hardware, but a stock Debian kernel's
//! `rdma_rxe` gives a real verbs device.
//!
//! The guest boots the host's own kernel from `/boot` with a tiny initramfs
//! ([`initramfs`]) and runs on the host's root filesystem, shared read-only
//! over virtio-9p, so host-built test binaries and the host's libibverbs run
//! unchanged at their host paths. A per-run directory is shared read-write:
//! the guest's stage 2 script ([`script`]), its output log and its exit status
//! pass through it. One boot runs every program of a [`Job`].
//!
//! Pitfalls this layout avoids:
//! - TCG, not KVM: a nested `/dev/kvm` here may hang a stock kernel, and TCG
//!   boots in seconds anyway.
//! - The guest's `/tmp`, `/run`, `/var/tmp` and `/dev/shm` are fresh tmpfs;
//!   everything else of the host is read-only, so tests must not write
//!   outside those.
//! - The per-run directory's path goes on the kernel command line and into
//!   qemu's `-virtfs` option: only plain path characters are allowed; so do
//!   the paths of [`VmOptions::visible`] (the checkout and target directory,
//!   mounted at their host paths because the guest's `/tmp` is its own).

mod cpio;
pub(crate) mod host;
mod initramfs;
pub(crate) mod script;

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub(crate) use script::{Job, Program};

/// How the guest is sized and bounded.
#[derive(Debug, Clone)]
pub(crate) struct VmOptions {
    /// The whole run, boot to power-off.
    pub(crate) timeout: Duration,
    /// qemu `-m` (e.g. `1G`).
    pub(crate) memory: String,
    pub(crate) cpus: u32,
    /// Keep the per-run directory (console log, scripts) for inspection.
    pub(crate) keep: bool,
    /// Host directories the guest must see at their own paths although they
    /// may lie under a directory the guest replaces with a fresh tmpfs (a
    /// checkout or target directory under `/tmp`): shared read-only and
    /// mounted over the root's view.
    pub(crate) visible: Vec<PathBuf>,
}

/// How a guest run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The guest reported this exit status (0: every program passed).
    Exited(i32),
    /// The run hit [`VmOptions::timeout`].
    TimedOut,
}

/// How often the host looks at the guest's output and at qemu.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Boots the guest from `host`'s tools (see [`host::check`]) under `scratch`,
/// runs `job` in it, streams its output to our stdout and returns how it
/// ended, with the output. Fails if the guest could not be started or set up.
pub(crate) fn run(options: &VmOptions, host: &host::Host, job: &Job, scratch: &Path) -> Result<(Outcome, String)> {
    let run_dir = RunDir::create(scratch, options.keep)?;
    let run_path = run_dir.path_str()?;
    let visible = options.visible.iter().map(|dir| plain_path(dir)).collect::<Result<Vec<_>>>()?;
    initramfs::build(host, &run_dir.path.join("initramfs.cpio"))?;
    fs::write(run_dir.path.join("stage2.sh"), script::stage2(run_path, job))?;
    File::create(run_dir.path.join("output.log"))?;

    let qemu_log = File::create(run_dir.path.join("qemu.log"))?;
    let mut qemu = Command::new(&host.qemu);
    qemu.args(qemu_args(options, host, run_path, &visible))
        .stdin(Stdio::null())
        .stdout(qemu_log.try_clone()?)
        .stderr(qemu_log);
    println!(
        "rdma-vm: booting Linux {} under TCG ({} programs, timeout {}s)",
        host.kernel.version,
        job.programs.len(),
        options.timeout.as_secs()
    );
    let started = Instant::now();
    let mut child = qemu.spawn().with_context(|| format!("starting {}", host.qemu.display()))?;
    let mut log = LogFollower::open(&run_dir.path.join("output.log"))?;
    let timed_out = loop {
        log.forward()?;
        if child.try_wait()?.is_some() {
            break false;
        }
        if started.elapsed() > options.timeout {
            // Best effort: qemu may have exited between the two checks.
            let _ = child.kill();
            let _ = child.wait();
            break true;
        }
        std::thread::sleep(POLL_INTERVAL);
    };
    log.forward()?;
    println!("rdma-vm: guest ran {:.1}s", started.elapsed().as_secs_f64());
    let output = String::from_utf8_lossy(&log.seen).into_owned();
    if timed_out {
        run_dir.print_diagnostics();
        return Ok((Outcome::TimedOut, output));
    }
    match run_dir.guest_status() {
        Some(125) => {
            run_dir.print_diagnostics();
            bail!("the guest could not be set up (exit status 125; see the console tail above)")
        }
        Some(status) => Ok((Outcome::Exited(status), output)),
        None => {
            run_dir.print_diagnostics();
            bail!("the guest reported no exit status (qemu stopped early; see the logs above)")
        }
    }
}

fn qemu_args(options: &VmOptions, host: &host::Host, run_path: &str, visible: &[&str]) -> Vec<String> {
    let share = |path: &str, tag: &str, extra: &str| {
        format!("local,path={path},mount_tag={tag},security_model=none,multidevs=remap{extra}")
    };
    let mut args: Vec<String> = [
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        "max",
        "-m",
        &options.memory,
        "-smp",
        &options.cpus.to_string(),
        "-nodefaults",
        "-display",
        "none",
        "-no-reboot",
        "-kernel",
        &host.kernel.image.to_string_lossy(),
        "-initrd",
        &format!("{run_path}/initramfs.cpio"),
        "-append",
        &format!(
            "console=ttyS0 quiet loglevel=4 panic=-1 {}={run_path} {}={}",
            script::RUN_DIR_PARAM,
            script::VISIBLE_PARAM,
            visible.join(":")
        ),
        "-serial",
        &format!("file:{run_path}/console.log"),
        "-serial",
        &format!("file:{run_path}/serial1.log"),
        "-virtfs",
        &share("/", "hostroot", ",readonly=on"),
        "-virtfs",
        &share(run_path, "run", ""),
    ]
    .map(str::to_owned)
    .to_vec();
    for (index, dir) in visible.iter().enumerate() {
        args.extend(["-virtfs".to_owned(), share(dir, &format!("{}{index}", script::VISIBLE_TAG), ",readonly=on")]);
    }
    args
}

/// `path` as plain text, refused if the kernel command line or qemu's option
/// syntax could misread it.
fn plain_path(path: &Path) -> Result<&str> {
    let text = path.to_str().with_context(|| format!("{} is not UTF-8", path.display()))?;
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._+-".contains(c);
    if !text.starts_with('/') || !text.chars().all(plain) {
        bail!("the path {text} has characters qemu or the kernel command line cannot take");
    }
    Ok(text)
}

/// The per-run directory; removed on drop unless kept.
struct RunDir {
    path: PathBuf,
    keep: bool,
}

impl RunDir {
    fn create(scratch: &Path, keep: bool) -> Result<Self> {
        fs::create_dir_all(scratch).with_context(|| format!("creating {}", scratch.display()))?;
        let scratch = scratch.canonicalize()?;
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let path = scratch.join(format!("run-{}-{stamp}", std::process::id()));
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self { path, keep })
    }

    /// The path as plain text, refused if the kernel command line or qemu's
    /// option syntax could misread it.
    fn path_str(&self) -> Result<&str> {
        plain_path(&self.path)
    }

    /// The status file, else the marker on the second serial port.
    fn guest_status(&self) -> Option<i32> {
        let from_file = fs::read_to_string(self.path.join("status")).ok().and_then(|text| text.trim().parse().ok());
        from_file.or_else(|| {
            let serial = fs::read_to_string(self.path.join("serial1.log")).ok()?;
            serial.lines().rev().find_map(|line| line.trim().strip_prefix(script::EXIT_MARKER)?.trim().parse().ok())
        })
    }

    fn print_diagnostics(&self) {
        for (name, lines) in [("qemu.log", 20), ("console.log", 40)] {
            let text = fs::read_to_string(self.path.join(name)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(lines).collect();
            eprintln!("---- {name} (last {} lines)", tail.len());
            for line in tail.iter().rev() {
                eprintln!("{}", line.trim_end_matches('\r'));
            }
        }
        if self.keep {
            eprintln!("---- run directory kept: {}", self.path.display());
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if self.keep {
            println!("rdma-vm: run directory kept: {}", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Copies what the guest appends to its output log to our stdout, and keeps it.
struct LogFollower {
    file: File,
    position: u64,
    seen: Vec<u8>,
}

impl LogFollower {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { file, position: 0, seen: Vec::new() })
    }

    fn forward(&mut self) -> Result<()> {
        self.file.seek(SeekFrom::Start(self.position))?;
        let mut fresh = Vec::new();
        self.file.read_to_end(&mut fresh)?;
        self.position += fresh.len() as u64;
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(&fresh)?;
        stdout.flush()?;
        self.seen.extend_from_slice(&fresh);
        Ok(())
    }
}
