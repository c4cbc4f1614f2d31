//! What `/proc` says of a process: this one (`std::process::id()`) or a
//! child a test started (its descriptors, resident memory, bytes read, CPU
//! time, whether it is stopped). Linux only, as the tests that use it.

use std::time::Duration;

fn read(pid: u32, file: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap_or_else(|e| panic!("/proc/{pid}/{file}: {e}"))
}

/// Open file descriptors of process `pid`.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`), in bytes.
fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = read(pid, "status");
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    kib.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() * 1024
}

/// Resident memory of process `pid`, bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS:")
}

/// The peak of resident memory of process `pid` since it started or since
/// its peak was last reset, bytes.
pub fn peak_rss_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmHWM:")
}

/// Bytes process `pid` has read through system calls (`rchar`: sockets
/// included).
pub fn read_bytes(pid: u32) -> u64 {
    read(pid, "io").lines().find_map(|l| l.strip_prefix("rchar:")).unwrap().trim().parse().unwrap()
}

/// The fields of a `stat` file after the command name (which may hold
/// spaces and parentheses): the state first.
fn stat_fields(stat: &str) -> Vec<&str> {
    stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default()
}

/// User plus system CPU time of process `pid`.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = read(pid, "stat");
    let fields = stat_fields(&stat);
    // utime and stime are the 12th and 13th fields after the name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory effects.
    let per_sec = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap();
    Duration::from_secs_f64(ticks as f64 / per_sec as f64)
}

/// Whether every thread of process `pid` is stopped (SIGSTOP takes effect
/// after kill(2) returns, thread by thread).
pub fn all_threads_stopped(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().all(|task| {
        let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
        stat_fields(&stat).first().is_some_and(|state| state.starts_with('T'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        assert!(open_fds(me) >= 3);
        assert!(rss_bytes(me) > 0 && peak_rss_bytes(me) >= rss_bytes(me) / 2);
        assert!(!all_threads_stopped(me));
        let _ = (read_bytes(me), cpu_time(me));
    }

    #[test]
    fn the_command_name_may_hold_parentheses_and_spaces() {
        let stat = "42 (a) b (c)) T 1 2 3";
        assert_eq!(stat_fields(stat), ["T", "1", "2", "3"]);
    }
}
