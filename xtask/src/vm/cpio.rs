//! A writer for the "newc" cpio format, the one the kernel unpacks as an
//! initramfs. Uncompressed: the kernel takes it as is, so building the guest
//! needs neither `cpio` nor `gzip`, and device nodes need no `mknod` on the host.

use std::io::{self, Write};

/// File type bits of `st_mode`.
const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFCHR: u32 = 0o020_000;

/// An archive being written; call [`Archive::finish`] to add the trailer.
pub(crate) struct Archive<W: Write> {
    out: W,
    written: u64,
    next_inode: u32,
}

/// The fields of one entry header that differ between entries.
struct Header<'a> {
    name: &'a str,
    mode: u32,
    size: u32,
    rdev: (u32, u32),
}

impl<W: Write> Archive<W> {
    pub(crate) fn new(out: W) -> Self {
        Self { out, written: 0, next_inode: 1 }
    }

    pub(crate) fn directory(&mut self, name: &str) -> io::Result<()> {
        self.entry(Header { name, mode: S_IFDIR | 0o755, size: 0, rdev: (0, 0) }, &[])
    }

    pub(crate) fn file(&mut self, name: &str, permissions: u32, data: &[u8]) -> io::Result<()> {
        let size = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{name}: too large for cpio")))?;
        self.entry(Header { name, mode: S_IFREG | permissions, size, rdev: (0, 0) }, data)
    }

    pub(crate) fn char_device(&mut self, name: &str, major: u32, minor: u32) -> io::Result<()> {
        self.entry(Header { name, mode: S_IFCHR | 0o600, size: 0, rdev: (major, minor) }, &[])
    }

    /// Writes the trailer entry and returns the writer.
    pub(crate) fn finish(mut self) -> io::Result<W> {
        self.entry(Header { name: "TRAILER!!!", mode: 0, size: 0, rdev: (0, 0) }, &[])?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn entry(&mut self, header: Header<'_>, data: &[u8]) -> io::Result<()> {
        let inode = self.next_inode;
        self.next_inode += 1;
        let name_size = header.name.len() + 1; // with its NUL
        let nlink = if header.mode & S_IFDIR != 0 { 2 } else { 1 };
        let fields = [
            inode,
            header.mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            header.size,
            0, // dev major
            0, // dev minor
            header.rdev.0,
            header.rdev.1,
            u32::try_from(name_size).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name too long"))?,
            0, // check
        ];
        let mut head = String::with_capacity(110);
        head.push_str("070701");
        for field in fields {
            head.push_str(&format!("{field:08x}"));
        }
        self.put(head.as_bytes())?;
        self.put(header.name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Header+name and data are each padded to a multiple of 4 bytes.
    fn pad(&mut self) -> io::Result<()> {
        let rest = (4 - self.written % 4) % 4;
        self.put(&[0; 3][..rest as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_terminated() {
        let mut archive = Archive::new(Vec::new());
        archive.directory("bin").unwrap();
        archive.file("bin/x", 0o755, b"hello").unwrap();
        archive.char_device("dev/console", 5, 1).unwrap();
        let bytes = archive.finish().unwrap();
        assert_eq!(bytes.len() % 4, 0);
        assert!(bytes.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("bin/x\0"));
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!\0"));
        // The header of "bin/x": mode 0o100755 then uid 0; mtime 0, size 5, dev major 0.
        assert!(text.contains(&format!("{:08x}{:08x}", 0o100_755, 0)));
        assert!(text.contains(&format!("{:08x}{:08x}{:08x}", 0, 5, 0)));
    }
}
