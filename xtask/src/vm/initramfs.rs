//! The guest's initramfs: a static busybox, the few modules needed to mount
//! the host's root over virtio-9p, and a stage-1 `/init` that mounts it and
//! switches into it. Everything else the guest runs comes from the host root.
//!
//! Built per run (a few MiB, milliseconds), so it can never be stale.

use std::collections::HashSet;
use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::cpio::Archive;
use super::host::Host;
use super::script;

/// What stage 1 must load, in any order: their dependencies are added from
/// `modules.dep`, dependencies first.
const BOOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p"];

/// Writes the initramfs for `host` to `path`.
pub(crate) fn build(host: &Host, path: &Path) -> Result<()> {
    let modules = boot_modules(&host.kernel.modules_dir)?;
    let mut archive = Archive::new(Vec::with_capacity(8 << 20));
    for dir in ["bin", "dev", "proc", "sys", "newroot", "modules"] {
        archive.directory(dir)?;
    }
    // The kernel opens /dev/console for init's stdio before anything is mounted.
    archive.char_device("dev/console", 5, 1)?;
    let busybox = fs::read(&host.busybox).with_context(|| format!("reading {}", host.busybox.display()))?;
    archive.file("bin/busybox", 0o755, &busybox)?;
    let mut order = String::new();
    for (name, file) in &modules {
        let image = module_image(&host.kernel.modules_dir.join(file))?;
        archive.file(&format!("modules/{name}.ko"), 0o644, &image)?;
        order.push_str(name);
        order.push('\n');
    }
    archive.file("modules/order", 0o644, order.as_bytes())?;
    archive.file("init", 0o755, script::STAGE1_INIT.as_bytes())?;
    let bytes = archive.finish()?;
    fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// `(name, path relative to the module dir)` of [`BOOT_MODULES`] and their
/// dependencies, in load order. Built-in modules are left out.
fn boot_modules(modules_dir: &Path) -> Result<Vec<(String, String)>> {
    let dep_file = modules_dir.join("modules.dep");
    let deps = fs::read_to_string(&dep_file).with_context(|| format!("reading {}", dep_file.display()))?;
    let builtin = fs::read_to_string(modules_dir.join("modules.builtin")).unwrap_or_default();
    let mut ordered = Vec::new();
    let mut seen = HashSet::new();
    for wanted in BOOT_MODULES {
        let entry = deps.lines().find_map(|line| {
            let (module, needs) = line.split_once(':')?;
            (module_name(module) == *wanted).then_some((module, needs))
        });
        let Some((module, needs)) = entry else {
            if builtin.lines().any(|line| module_name(line) == *wanted) {
                continue;
            }
            bail!("module {wanted} is neither in {} nor built in", dep_file.display());
        };
        // modules.dep lists a module's dependencies so that the last must load first.
        for file in needs.split_whitespace().rev().chain([module]) {
            if seen.insert(file.to_owned()) {
                ordered.push((module_name(file), file.to_owned()));
            }
        }
    }
    Ok(ordered)
}

/// `kernel/fs/9p/9p.ko.xz` → `9p`.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// A module's bytes, decompressed (busybox's insmod takes plain ELF only).
fn module_image(path: &Path) -> Result<Vec<u8>> {
    let name = path.to_string_lossy();
    let decompressor = [(".ko.xz", "xz"), (".ko.zst", "zstd"), (".ko.gz", "gzip")]
        .into_iter()
        .find_map(|(suffix, tool)| name.ends_with(suffix).then_some(tool));
    let Some(tool) = decompressor else {
        return fs::read(path).with_context(|| format!("reading {}", path.display()));
    };
    let output = Command::new(tool)
        .args(["-dc", "--"])
        .arg(path)
        .output()
        .with_context(|| format!("`{tool}` is needed to decompress {} (apt-get install {tool})", path.display()))?;
    if !output.status.success() {
        bail!("`{tool} -dc {}` failed ({})", path.display(), output.status);
    }
    Ok(output.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names_drop_dirs_and_suffixes() {
        assert_eq!(module_name("kernel/fs/9p/9p.ko"), "9p");
        assert_eq!(module_name("kernel/net/9p/9pnet_virtio.ko.xz"), "9pnet_virtio");
        assert_eq!(module_name("kernel/drivers/virtio/virtio-pci.ko.zst"), "virtio_pci");
    }

    #[test]
    fn dependencies_load_first_and_once() {
        let dir = std::env::temp_dir().join(format!("xtask-modules-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("modules.dep"),
            "kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/netfs/netfs.ko\n\
             kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
             kernel/net/9p/9pnet_virtio.ko: kernel/net/9p/9pnet.ko kernel/drivers/virtio/virtio.ko\n\
             kernel/net/9p/9pnet.ko:\n",
        )
        .unwrap();
        let names: Vec<String> = boot_modules(&dir).unwrap().into_iter().map(|(name, _)| name).collect();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names, ["virtio_ring", "virtio", "virtio_pci", "9pnet", "9pnet_virtio", "netfs", "9p"]);
    }
}
