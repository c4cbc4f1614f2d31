//! What the host must provide to boot the Soft-RoCE guest, found or refused
//! with one line that names the Debian package to install.
//!
//! The guest runs the host's own root filesystem (shared read-only), so every
//! tool it uses must be installed on the host: qemu to run it, a Debian
//! kernel that ships `rdma_rxe`, a static busybox for the initramfs, and, in
//! the guest, `modprobe`, `ip`, `rdma` and the libibverbs rxe provider.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Everything the guest is built from.
#[derive(Debug)]
pub(crate) struct Host {
    pub(crate) qemu: PathBuf,
    pub(crate) busybox: PathBuf,
    pub(crate) kernel: GuestKernel,
}

/// A kernel from `/boot` whose modules include `rdma_rxe`.
#[derive(Debug)]
pub(crate) struct GuestKernel {
    pub(crate) version: String,
    pub(crate) image: PathBuf,
    pub(crate) modules_dir: PathBuf,
}

/// Finds the host's tools, or fails with one line naming the missing package.
pub(crate) fn check(kernel_version: Option<&str>) -> Result<Host> {
    let qemu = find_in_path("qemu-system-x86_64")
        .context("qemu-system-x86_64 not found in PATH (apt-get install qemu-system-x86)")?;
    let busybox = static_busybox()?;
    let kernel = guest_kernel(kernel_version)?;
    for (tool, package) in [("modprobe", "kmod"), ("ip", "iproute2"), ("rdma", "iproute2")] {
        find_in_path(tool).with_context(|| format!("`{tool}` not found in PATH (apt-get install {package})"))?;
    }
    if !Path::new("/etc/libibverbs.d/rxe.driver").exists() {
        bail!("the libibverbs rxe provider is not installed (apt-get install rdma-core ibverbs-providers)");
    }
    Ok(Host { qemu, busybox, kernel })
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    // The guest's PATH covers the sbin directories too, so look there as well.
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// `/bin/busybox`, statically linked (the initramfs has no libc) and with `switch_root`.
fn static_busybox() -> Result<PathBuf> {
    const HINT: &str = "(apt-get install busybox-static)";
    let path = PathBuf::from("/bin/busybox");
    let image = fs::read(&path).with_context(|| format!("{} not found {HINT}", path.display()))?;
    if has_interpreter(&image) {
        bail!("{} is dynamically linked; the guest's initramfs needs a static one {HINT}", path.display());
    }
    if !image.windows(b"switch_root".len()).any(|window| window == b"switch_root") {
        bail!("{} has no switch_root applet {HINT}", path.display());
    }
    Ok(path)
}

/// Whether a 64-bit little-endian ELF image asks for a program interpreter
/// (a `PT_INTERP` program header): that is, whether it is dynamically linked.
fn has_interpreter(image: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    let read = |at: usize, len: usize| image.get(at..at + len);
    let u16_at = |at| read(at, 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let (Some(b"\x7fELF"), Some(phoff), Some(entry_size), Some(count)) =
        (read(0, 4), read(0x20, 8), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    let mut offset_bytes = [0u8; 8];
    offset_bytes.copy_from_slice(phoff);
    let Ok(table) = usize::try_from(u64::from_le_bytes(offset_bytes)) else { return false };
    (0..count).any(|index| {
        read(table + index * entry_size, 4).is_some_and(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) == PT_INTERP)
    })
}

/// The newest `/boot/vmlinuz-*` whose module tree has `rdma_rxe` (or the one asked for).
fn guest_kernel(wanted: Option<&str>) -> Result<GuestKernel> {
    const HINT: &str = "(apt-get install linux-image-amd64)";
    let mut versions: Vec<String> = fs::read_dir("/boot")
        .with_context(|| format!("cannot list /boot {HINT}"))?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_prefix("vmlinuz-").map(str::to_owned))
        .filter(|version| wanted.is_none_or(|wanted| wanted == version))
        .collect();
    versions.sort_by_key(|version| std::cmp::Reverse(version_key(version)));
    for version in versions {
        let modules_dir = PathBuf::from("/lib/modules").join(&version);
        let has_rxe = fs::read_to_string(modules_dir.join("modules.dep"))
            .is_ok_and(|deps| deps.lines().any(|line| line.contains("/rdma_rxe.ko")));
        if has_rxe {
            let image = PathBuf::from(format!("/boot/vmlinuz-{version}"));
            return Ok(GuestKernel { version, image, modules_dir });
        }
    }
    match wanted {
        Some(version) => bail!("no /boot/vmlinuz-{version} with rdma_rxe in /lib/modules/{version} {HINT}"),
        None => bail!("no /boot/vmlinuz-* whose modules include rdma_rxe {HINT}"),
    }
}

/// Orders kernel versions numerically ("6.10.0" after "6.9.0").
fn version_key(version: &str) -> Vec<u64> {
    version.split(|c: char| !c.is_ascii_digit()).filter_map(|part| part.parse().ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_sort_numerically() {
        let mut versions = vec!["6.9.0-1-amd64", "6.10.0-2-amd64", "6.1.0-57-amd64"];
        versions.sort_by_key(|version| std::cmp::Reverse(version_key(version)));
        assert_eq!(versions, ["6.10.0-2-amd64", "6.9.0-1-amd64", "6.1.0-57-amd64"]);
    }

    #[test]
    fn detects_a_dynamic_elf() {
        // A minimal ELF64 header with one PT_INTERP program header right after it.
        let mut image = vec![0u8; 0x40 + 0x38];
        image[..4].copy_from_slice(b"\x7fELF");
        image[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes());
        image[0x36..0x38].copy_from_slice(&0x38u16.to_le_bytes());
        image[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        image[0x40..0x44].copy_from_slice(&3u32.to_le_bytes());
        assert!(has_interpreter(&image));
        image[0x40..0x44].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
        assert!(!has_interpreter(&image));
        assert!(!has_interpreter(b"not an elf"));
    }
}
