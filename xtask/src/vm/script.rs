//! The guest's two shell stages.
//!
//! Stage 1 (`/init` in the initramfs, run by busybox) mounts the host root
//! read-only over 9p, gives it fresh tmpfs scratch directories, mounts the
//! per-run directory read-write at its host path and switches into the host
//! root. Stage 2 (written per run into that directory, run by the host's
//! `/bin/sh`) brings up Soft-RoCE on loopback, runs the test programs one
//! after the other with their output appended to `output.log`, writes the
//! status to `status` and powers the guest off.
//!
//! Exit status: the first failing program's, 0 if all passed, 125 when the
//! guest could not be set up. A line `KVLINK-GUEST-EXIT: N` on the second
//! serial port repeats it, in case the 9p write is lost at power-off.

use std::fmt::Write as _;

/// The marker line on the guest's second serial port.
pub(crate) const EXIT_MARKER: &str = "KVLINK-GUEST-EXIT: ";

/// The kernel command-line parameter naming the per-run directory.
pub(crate) const RUN_DIR_PARAM: &str = "kvlink.run";

/// The kernel command-line parameter listing (`:`-separated) the host
/// directories mounted read-only at their own paths over the root's view.
pub(crate) const VISIBLE_PARAM: &str = "kvlink.visible";

/// The 9p mount tag prefix of those directories (`visible0`, `visible1`, ...).
pub(crate) const VISIBLE_TAG: &str = "visible";

/// Stage 1, PID 1 of the initramfs.
pub(crate) const STAGE1_INIT: &str = r#"#!/bin/busybox sh
# kvlink RDMA test guest, stage 1: mount the host root and switch into it.
/bin/busybox --install -s /bin
export PATH=/bin
say() { echo "guest-init: $*"; }
give_up() {
    say "FAILED: $*"
    for tty in /dev/ttyS1 /newroot/dev/ttyS1; do [ -c "$tty" ] && echo "KVLINK-GUEST-EXIT: 125" > "$tty"; done
    poweroff -f
}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r module; do
    insmod "/modules/$module.ko" || give_up "insmod $module"
done < /modules/order
run_dir=$(tr ' ' '\n' < /proc/cmdline | sed -n 's/^kvlink\.run=//p')
[ -n "$run_dir" ] || give_up "no kvlink.run= on the kernel command line"
visible=$(tr ' ' '\n' < /proc/cmdline | sed -n 's/^kvlink\.visible=//p')
opts=trans=virtio,version=9p2000.L,msize=262144
tries=0
until mount -t 9p -o "$opts,ro,cache=loose" hostroot /newroot 2>/dev/null; do
    tries=$((tries + 1))
    [ "$tries" -lt 50 ] || give_up "cannot mount the host root"
    sleep 0.1
done
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
mount -t tmpfs -o mode=1777 tmpfs /newroot/var/tmp
mount -t tmpfs -o mode=755 tmpfs /newroot/run
for fs in dev proc sys; do mount --move "/$fs" "/newroot/$fs"; done
mkdir -p /newroot/dev/shm /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
# The checkout and target directory, which may lie under the fresh /tmp.
index=0
for dir in $(echo "$visible" | tr ':' ' '); do
    mkdir -p "/newroot$dir" 2>/dev/null
    mount -t 9p -o "$opts,ro,cache=loose" "visible$index" "/newroot$dir" || give_up "cannot mount $dir"
    index=$((index + 1))
done
mkdir -p "/newroot$run_dir" 2>/dev/null
mount -t 9p -o "$opts,cache=none" run "/newroot$run_dir" || give_up "cannot mount the run directory"
exec switch_root /newroot /bin/sh "$run_dir/stage2.sh"
"#;

/// One program for stage 2 to run.
#[derive(Debug, Clone)]
pub(crate) struct Program {
    /// Shown in the output header.
    pub(crate) label: String,
    pub(crate) path: String,
    /// Working directory (cargo runs test binaries from their package root).
    pub(crate) cwd: String,
    /// Its own arguments, before the job's (e.g. a test-name filter).
    pub(crate) args: Vec<String>,
}

/// What stage 2 runs, and with what.
#[derive(Debug, Clone, Default)]
pub(crate) struct Job {
    pub(crate) programs: Vec<Program>,
    /// Passed to every program.
    pub(crate) args: Vec<String>,
    /// Exported before the programs run (after the RXE_* variables).
    pub(crate) env: Vec<(String, String)>,
}

/// The Soft-RoCE link: rxe0 on the guest's loopback. The guest has no NIC, so
/// nothing can leave it; raw verbs work on loopback (rdma_cm does not).
const RXE_DEVICE: &str = "rxe0";
const RXE_NETDEV: &str = "lo";
const RXE_IPV4: [u8; 4] = [127, 0, 0, 1];

/// Single-quotes `text` for the shell.
pub(crate) fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The sysfs spelling of the IPv4-mapped GID of `ip`.
fn mapped_gid(ip: [u8; 4]) -> String {
    format!("0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}", ip[0], ip[1], ip[2], ip[3])
}

/// Stage 2 for `job`, with the per-run directory `run_dir`.
pub(crate) fn stage2(run_dir: &str, job: &Job) -> String {
    let ip = RXE_IPV4.map(|octet| octet.to_string()).join(".");
    let mut script = String::new();
    let _ = write!(
        script,
        r#"#!/bin/sh
# kvlink RDMA test guest, stage 2 (PID 1 on the host root): Soft-RoCE up, programs run, power off.
RUN_DIR={run_dir}
LOG="$RUN_DIR/output.log"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
power_off() {{
    echo "$1" > "$RUN_DIR/status"
    sync
    echo "{marker}$1" > /dev/ttyS1
    # Synchronous: the reboot system call, straight from the static busybox.
    exec /bin/busybox poweroff -f
}}
rxe_up() {{
    hostname kvlink-rdma-guest
    ip link set lo up || return 1
    modprobe rdma_rxe || return 1
    rdma link add {device} type rxe netdev {netdev} || return 1
    port=/sys/class/infiniband/{device}/ports/1
    tries=0
    while [ "$tries" -lt 100 ]; do
        gid_index=$(grep -lx {gid} "$port"/gids/* 2>/dev/null | head -n 1)
        case "$(cat "$port/state" 2>/dev/null)" in *ACTIVE*) [ -n "$gid_index" ] && break ;; esac
        tries=$((tries + 1))
        sleep 0.1
    done
    [ -n "$gid_index" ] || {{ echo "{device}: port not ACTIVE or no GID for {ip}"; return 1; }}
    export RXE_DEV={device} RXE_NETDEV={netdev} RXE_IP={ip} RXE_GID_INDEX="${{gid_index##*/}}"
    # What kvlink's RDMA transport reads (transport_rdma::RdmaConfig::with_env).
    export KVLINK_RDMA_DEVICE={device} KVLINK_RDMA_GID_INDEX="$RXE_GID_INDEX"
    # Registering memory pins it.
    ulimit -l unlimited
}}
echo "guest: $(cut -d' ' -f1 /proc/uptime)s after boot, bringing up {device}" > /dev/console
rxe_up >> "$LOG" 2>&1 || {{ echo "guest: Soft-RoCE setup failed" >> "$LOG"; power_off 125; }}
"#,
        run_dir = quote(run_dir),
        marker = EXIT_MARKER,
        device = RXE_DEVICE,
        netdev = RXE_NETDEV,
        gid = mapped_gid(RXE_IPV4),
    );
    for (key, value) in &job.env {
        let _ = writeln!(script, "export {key}={}", quote(value));
    }
    let args: String = job.args.iter().map(|arg| format!(" {}", quote(arg))).collect();
    let total = job.programs.len();
    script.push_str("first_failure=0\n{\n");
    for (index, program) in job.programs.iter().enumerate() {
        let own: String = program.args.iter().map(|arg| format!(" {}", quote(arg))).collect();
        let _ = write!(
            script,
            r#"echo "==> [{n}/{total}] {label}"
(cd {cwd} && exec {path}{own}{args}) < /dev/null
status=$?
echo "<== [{n}/{total}] {label}: exit status $status"
[ "$status" -eq 0 ] || [ "$first_failure" -ne 0 ] || first_failure=$status
"#,
            n = index + 1,
            label = program.label.replace(['"', '$', '`', '\\'], "_"),
            cwd = quote(&program.cwd),
            path = quote(&program.path),
        );
    }
    script.push_str("} >> \"$LOG\" 2>&1\n");
    script.push_str("echo \"guest: programs done after $(cut -d' ' -f1 /proc/uptime)s\" > /dev/console\n");
    script.push_str("power_off \"$first_failure\"\n");
    script
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_single_quotes() {
        assert_eq!(quote("a'b c"), r"'a'\''b c'");
    }

    #[test]
    fn loopback_gid_matches_sysfs_spelling() {
        assert_eq!(mapped_gid([127, 0, 0, 1]), "0000:0000:0000:0000:0000:ffff:7f00:0001");
    }

    #[test]
    fn stage2_runs_every_program_with_the_args() {
        let job = Job {
            programs: vec![
                Program { label: "lib".into(), path: "/t/lib-1".into(), cwd: "/w/c".into(), args: vec![] },
                Program {
                    label: "loopback".into(),
                    path: "/t/loopback-2".into(),
                    cwd: "/w/c".into(),
                    args: vec!["rdma".into()],
                },
            ],
            args: vec!["--nocapture".into()],
            env: vec![("RUST_LOG".into(), "debug".into())],
        };
        let script = stage2("/r", &job);
        assert!(script.contains("(cd '/w/c' && exec '/t/lib-1' '--nocapture') < /dev/null"));
        assert!(script.contains("(cd '/w/c' && exec '/t/loopback-2' 'rdma' '--nocapture') < /dev/null"));
        assert!(script.contains("export KVLINK_RDMA_DEVICE=rxe0"));
        assert!(script.contains("export RUST_LOG='debug'"));
        assert!(script.contains("RUN_DIR='/r'"));
    }
}
