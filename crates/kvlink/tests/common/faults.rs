//! What the fault tests share: their bounds, the survivor's footprint
//! (descriptors and resident set, from `/proc/<pid>/`), stalling a batch
//! half-way, and P's log lines about failed sends.

use std::time::{Duration, Instant};

use kv_proto::ReqId;

use test_support::process::{open_fds, read_bytes, rss_bytes};

use super::proxy::{shape, tally, Proxy, BATCH, BLOCKS_PER_REQUEST};
use super::{Proc, BOUND};

/// D's bound on one pull (`--transfer-timeout`), where a test relies on it.
pub const TRANSFER_TIMEOUT: Duration = Duration::from_secs(2);
/// Longer than [`TRANSFER_TIMEOUT`]: how long a stopped process stays stopped.
pub const STOP: Duration = Duration::from_secs(3);
/// Grace on top of a bound for a loaded machine (process scheduling, a
/// debug build); far below the bounds a missed event would fall back to
/// (60 s default transfer timeout, 480 s lease).
pub const SLACK: Duration = Duration::from_secs(5);
/// `RUST_LOG` of the servers: P's admission of a transfer request is a
/// debug line.
pub const LOG: &str = "info,kv_worker=debug";
/// Descriptors a survivor may hold above its baseline.
pub const FD_SLACK: usize = 0;
/// Resident memory a survivor may hold above its baseline.
pub const RSS_SLACK: u64 = 16 << 20;
/// Payload D must have read of a batch (32 MiB) for it to count as
/// moving: two blocks.
pub const PART_OF_A_BATCH: u64 = 512 << 10;

/// A process's descriptors and resident set.
#[derive(Clone, Copy, Debug)]
pub struct Footprint {
    pub fds: usize,
    pub rss: u64,
}

pub fn footprint(p: &Proc) -> Footprint {
    Footprint { fds: open_fds(p.pid()), rss: rss_bytes(p.pid()) }
}

/// Waits (bounded) until `p` is back near `base`.
pub fn assert_back_to(p: &Proc, base: Footprint) {
    assert_back_to_with(p, base, 0);
}

/// Like [`assert_back_to`], allowing `more_fds` descriptors the process
/// holds for a bounded time by design (say, connections its idle timeout
/// closes).
pub fn assert_back_to_with(p: &Proc, base: Footprint, more_fds: usize) {
    let deadline = Instant::now() + SLACK;
    loop {
        let now = footprint(p);
        if now.fds <= base.fds + FD_SLACK + more_fds && now.rss <= base.rss + RSS_SLACK {
            eprintln!("survivor {base:?} before, {now:?} after");
            return;
        }
        assert!(Instant::now() < deadline, "survivor leaks: {base:?} before the fault, {now:?} {SLACK:?} after");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends a batch and stops it half-way: once D read part of its payload, D
/// is stopped (it can neither read the rest nor acknowledge it). If D had
/// read the whole payload already, that batch ends normally and another is
/// tried. Returns the stalled batch's requests, D left stopped.
pub fn send_and_stall(rt: &tokio::runtime::Runtime, proxy: &mut Proxy, d: &Proc) -> Vec<ReqId> {
    let shape = shape();
    let batch_bytes = (BATCH * BLOCKS_PER_REQUEST) as u64 * shape.block_len() * u64::from(shape.region_count());
    for _ in 0..5 {
        let before = read_bytes(d.pid());
        let ids = rt.block_on(proxy.send());
        let deadline = Instant::now() + BOUND;
        // Polled without pause: the batch takes milliseconds.
        while read_bytes(d.pid()) < before + PART_OF_A_BATCH {
            assert!(Instant::now() < deadline, "D read no payload within {BOUND:?}");
        }
        d.stop();
        if read_bytes(d.pid()) < before + batch_bytes {
            return ids;
        }
        eprintln!("D read the whole batch before it stopped; another one");
        d.signal(libc::SIGCONT);
        let ended = rt.block_on(proxy.outcomes(&ids, BOUND));
        assert_eq!(tally(&ended), (ids.len(), 0, 0), "{ended:?}");
    }
    panic!("every batch went through before D stopped")
}

/// Waits (bounded) for P's log line about failing to send each of `ids`
/// with `reason` (P logs its own id of each).
pub fn assert_p_failed_sending(p: &Proc, ids: &[ReqId], reason: &str) {
    let on_p: Vec<ReqId> = ids.iter().map(kvlink::PrefillInstance::internal_id).collect();
    let ids: Vec<&str> = on_p.iter().map(ReqId::as_str).collect();
    p.wait_log_each(&["sending KV failed", reason], &ids, SLACK);
}

/// How long a watched request waits before D pulls it: several of P's
/// renewal periods (1 s in the tests that use it).
pub const WATCHED_FOR: Duration = Duration::from_secs(4);

/// Sleeps out the rest of [`WATCHED_FOR`]: time passing is what is under
/// test, not a wait for an event.
pub fn stay_renewed(since: Instant) {
    std::thread::sleep(WATCHED_FOR.saturating_sub(since.elapsed()));
}

/// Sleeps out the rest of a stop: the fault itself, not a wait for an event.
pub fn stay_stopped(since: Instant) {
    std::thread::sleep(STOP.saturating_sub(since.elapsed()));
}
