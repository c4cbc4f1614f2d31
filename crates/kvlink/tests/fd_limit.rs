//! `kvlink serve --role producer` at its file-descriptor limit: a process
//! started with a low `RLIMIT_NOFILE`, its side channel (and its control
//! port) hammered with connections from many loopback hosts until `accept`
//! fails with "Too many open files". Its accept loops must back off instead
//! of spinning (CPU time far below one core over the attack), log a bounded
//! number of lines, and serve an honest bench once the attack stops.
//!
//! One test in this binary: it measures a child process, and its attack
//! holds thousands of sockets.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::{assert_all_verified, hello_json, reply_within, send_frame, try_connect_from, Proc, BOUND, KVLINK};
use test_support::process::{cpu_time, open_fds};

/// The serve process's descriptor limit: room for its runtime, listeners and
/// one bench session (about 30), far less than its handshake places (64 on
/// the control port, 64 on the side channel).
const NOFILE: u64 = 64;
/// How long the attack lasts.
const ATTACK: Duration = Duration::from_secs(3);
/// Bound on attack connections per listener (the kernel's backlog takes
/// about a thousand once the server cannot accept).
const MAX_ATTACK_CONNECTIONS: usize = 2000;
/// The CPU the server may spend over the attack, as a share of one core: a
/// busy accept loop spends about 1.0.
const MAX_CORE_SHARE: f64 = 0.3;
/// Log lines (stdout and stderr) the whole run may produce.
const MAX_LOG_LINES: usize = 25;

/// Opens connections to `to` from 127.0.0.2..=127.0.0.17 in turn until
/// `stop`, and keeps them; returns them.
fn hammer(to: SocketAddr, stop: Arc<AtomicBool>) -> Vec<TcpStream> {
    let mut held = Vec::new();
    let mut host = 0u8;
    while !stop.load(Ordering::Relaxed) && held.len() < MAX_ATTACK_CONNECTIONS {
        host = (host + 1) % 16;
        // Once the backlog is full the server's kernel drops SYNs: give up
        // on that one quickly and try the next.
        if let Ok(s) = try_connect_from(Ipv4Addr::new(127, 0, 0, 2 + host), to, Duration::from_millis(200)) {
            held.push(s);
        }
    }
    held
}

/// Raises this process's own soft descriptor limit to its hard limit (the
/// attack holds a few thousand sockets).
fn raise_own_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit write and read only `limit`.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = limit.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
}

#[test]
fn at_the_descriptor_limit_serve_neither_spins_nor_floods_its_log() {
    raise_own_limit();
    let mut cmd = Command::new(KVLINK);
    cmd.args(["serve", "--role", "producer", "--listen", "127.0.0.1", "--control-port", "0"]);
    cmd.args(["--side-channel-port", "0"]);
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls setrlimit, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: NOFILE, rlim_max: NOFILE };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let mut serve = Proc::spawn_command("kvlink serve", cmd);
    let ready = serve.line();
    let control: SocketAddr =
        ready.split_whitespace().find_map(|w| w.strip_prefix("control=")).unwrap().parse().unwrap();
    let pid = serve.pid();
    let idle_fds = open_fds(pid);

    // A session of our own, so the side channel is up; one prefilled
    // request names its port.
    let mut session = TcpStream::connect(control).unwrap();
    send_frame(&mut session, &hello_json(None));
    assert_eq!(reply_within(&mut session, BOUND).unwrap()["type"], "welcome");
    let prefill = serde_json::json!({"type": "prefill", "prompts": [{"id": "x", "prompt_len": 16, "seed": 1}]});
    send_frame(&mut session, prefill.to_string().as_bytes());
    let prefilled = reply_within(&mut session, BOUND).unwrap();
    let port = prefilled["items"][0]["params"]["remote_port"].as_u64().unwrap();
    let side_channel = SocketAddr::from(([127, 0, 0, 1], u16::try_from(port).unwrap()));

    let stop = Arc::new(AtomicBool::new(false));
    let cpu_before = cpu_time(pid);
    let started = Instant::now();
    let attackers: Vec<_> = [side_channel, control]
        .into_iter()
        .map(|to| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || hammer(to, stop))
        })
        .collect();
    // The attack's length: the attackers stop on their own once told.
    thread::sleep(ATTACK);
    let cpu = cpu_time(pid).saturating_sub(cpu_before);
    let wall = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let held: Vec<Vec<TcpStream>> = attackers.into_iter().map(|a| a.join().unwrap()).collect();
    let share = cpu.as_secs_f64() / wall.as_secs_f64();
    eprintln!(
        "attack: {} side-channel and {} control connections in {wall:?}; serve used {cpu:?} CPU ({:.1} % of a core), \
         {} descriptors open at the end (limit {NOFILE})",
        held[0].len(),
        held[1].len(),
        share * 100.0,
        open_fds(pid)
    );
    assert!(share < MAX_CORE_SHARE, "serve spent {cpu:?} of CPU in {wall:?} at its descriptor limit");

    // The attack stops; our session ends; an honest bench is served.
    drop(held);
    send_frame(&mut session, br#"{"type":"bye"}"#);
    assert_eq!(reply_within(&mut session, BOUND).unwrap()["type"], "bye");
    drop(session);
    let target = control.to_string();
    let honest = common::bench(
        None,
        &["--connect", &target, "--requests", "20", "--json", "--layers", "4", "--heads", "1", "--head-dim", "64"],
    );
    assert_all_verified(20, &honest, "decode");
    // Everything the attack opened is closed again.
    let deadline = Instant::now() + BOUND;
    while open_fds(pid) > idle_fds {
        assert!(Instant::now() < deadline, "{} descriptors open, {idle_fds} before the attack", open_fds(pid));
        thread::sleep(Duration::from_millis(20));
    }
    serve.terminate();
    let (status, stdout, stderr) = serve.finish();
    assert!(status.success(), "{status}\nstdout: {stdout}\nstderr: {stderr}");
    let lines = stdout.lines().count() + stderr.lines().count();
    eprintln!("{lines} log lines:\n{stdout}\n{stderr}");
    assert!(stderr.contains("Too many open files"), "the attack never reached the limit:\n{stderr}");
    assert!(lines <= MAX_LOG_LINES, "{lines} log lines");
}
