//! Network namespaces of a test's own: two joined by a veth pair (made and
//! removed by the test), nftables rules inside them, and running a closure
//! with its sockets inside one.

use std::process::Command;

/// Two network namespaces joined by a veth pair, removed on drop (also on
/// panic). Addresses are 10.201.N.1 and .2/24, inside these namespaces only.
pub struct Namespaces {
    names: Vec<String>,
    subnet: String,
}

impl Namespaces {
    fn ip(args: &[&str]) -> Result<(), String> {
        run("ip", args)
    }

    /// `None` (after a skip message) when namespaces cannot be made here;
    /// panics if making them fails half-way.
    pub fn create(tag: &str) -> Option<Self> {
        let pid = std::process::id();
        let a = format!("kvl-{tag}-a-{pid}");
        if let Err(e) = Self::ip(&["netns", "add", &a]) {
            eprintln!("SKIPPED: cannot create network namespaces (needs root and iproute2): {e}");
            return None;
        }
        let mut ns = Self { names: vec![a.clone()], subnet: format!("10.201.{}", pid % 200 + 1) };
        let b = format!("kvl-{tag}-b-{pid}");
        Self::ip(&["netns", "add", &b]).unwrap();
        ns.names.push(b.clone());
        // Interface names are at most 15 bytes.
        let (va, vb) = (format!("kv{tag}a{}", pid % 1_000_000), format!("kv{tag}b{}", pid % 1_000_000));
        Self::ip(&["link", "add", &va, "netns", &a, "type", "veth", "peer", "name", &vb, "netns", &b]).unwrap();
        for (ns_name, dev, host) in [(&a, &va, 1), (&b, &vb, 2)] {
            let addr = format!("{}.{host}/24", ns.subnet);
            Self::ip(&["-n", ns_name, "addr", "add", &addr, "dev", dev]).unwrap();
            Self::ip(&["-n", ns_name, "link", "set", dev, "up"]).unwrap();
            Self::ip(&["-n", ns_name, "link", "set", "lo", "up"]).unwrap();
        }
        Some(ns)
    }

    pub fn a(&self) -> &str {
        &self.names[0]
    }

    pub fn b(&self) -> &str {
        &self.names[1]
    }

    /// Host `n` of the pair's subnet (1 is in `a`, 2 in `b`).
    pub fn host(&self, n: u8) -> String {
        format!("{}.{n}", self.subnet)
    }

    /// Runs `nft` with `args` inside namespace `ns`; `None` (after a skip
    /// message) when nftables cannot be used there.
    pub fn nft(ns: &str, args: &str) -> Option<()> {
        let mut all = vec!["netns", "exec", ns, "nft"];
        all.extend(args.split_whitespace());
        match run("ip", &all) {
            Ok(()) => Some(()),
            Err(e) => {
                eprintln!("SKIPPED: cannot use nftables in a test namespace: {e}");
                None
            }
        }
    }

    /// Sets `key` to `value` with sysctl(8) inside namespace `ns` (the
    /// network settings are the namespace's own).
    pub fn sysctl(ns: &str, key: &str, value: &str) {
        run("ip", &["netns", "exec", ns, "sysctl", "-qw", &format!("{key}={value}")]).unwrap();
    }

    /// Runs `f` on a thread of its own whose sockets live in namespace `ns`
    /// (setns(2) moves only the calling thread); returns its result.
    pub fn within<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{ns}");
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("cannot open {path}: {e}"));
                let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
                // SAFETY: setns(2) on a namespace file we hold open; it only
                // changes this thread's network namespace.
                assert_eq!(unsafe { libc::setns(fd, libc::CLONE_NEWNET) }, 0, "setns {path}");
                f()
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
        })
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in &self.names {
            if let Err(e) = Self::ip(&["netns", "del", name]) {
                eprintln!("cannot remove network namespace {name}: {e}");
            }
        }
    }
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program).args(args).output().map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}
