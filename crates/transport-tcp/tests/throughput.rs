//! Loopback throughput of the transport, a measurement run by hand:
//!
//! ```text
//! cargo test --release -p transport-tcp --test throughput -- --ignored --nocapture
//! ```
//!
//! (a) one batch of 2,048 × 64 KiB contiguous ops (128 MiB, split over two
//! connections with the default config), (b) one batch of 4,096 scattered
//! 8 KiB ops (32 MiB, also split). Each figure is the median of 5 runs, each
//! run several batches under one grant that covers exactly the batch's ops;
//! CPU seconds per GB count both ends (they share this process).
//! `BENCH_STREAMS=1` sets the sender's `parallel_streams` (default 2), to
//! compare the one-connection path (no pre-check) with the split one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::time::Instant;

use kv_proto::{BatchWriter, MemoryRegion, RegionAccess, WriteOp};
use test_support::TestBuf;
use transport_tcp::{TcpConfig, TcpTransport};

const RUNS: usize = 5;

async fn measure(label: &str, src_len: usize, dst_len: usize, rounds: usize, make: impl Fn(u64, u64) -> Vec<WriteOp>) {
    // BENCH_STREAMS overrides the sender's parallel_streams (default 2).
    let streams = std::env::var("BENCH_STREAMS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    let a = TcpTransport::bind(TcpConfig { parallel_streams: streams, ..TcpConfig::default() }).await.unwrap();
    let b = TcpTransport::bind(TcpConfig::default()).await.unwrap();
    let src = TestBuf::new(src_len);
    let dst = TestBuf::new(dst_len);
    // SAFETY: the buffers outlive the transports (dropped at the end, before them).
    unsafe { a.register_regions(&[src.region()], RegionAccess::Source) }.unwrap();
    // SAFETY: as above.
    unsafe { b.register_regions(&[dst.region()], RegionAccess::Destination) }.unwrap();
    let ops = make(src.addr(), dst.addr());
    let bytes: u64 = ops.iter().map(|o| o.len).sum();
    let endpoint = b.endpoint();
    let ranges: Vec<MemoryRegion> = ops.iter().map(|o| MemoryRegion::new(o.dst, o.len)).collect();
    let grant = b.grant(&ranges, common::BOUND * 100).await.unwrap();
    a.batch_write(&endpoint, &grant, &ops).await.unwrap();
    let mut rates = Vec::new();
    let mut cpu_per_gb = Vec::new();
    for _ in 0..RUNS {
        let cpu = cpu_seconds();
        let start = Instant::now();
        for _ in 0..rounds {
            a.batch_write(&endpoint, &grant, &ops).await.unwrap();
        }
        let gb = (bytes * rounds as u64) as f64 / 1e9;
        rates.push(gb / start.elapsed().as_secs_f64());
        cpu_per_gb.push((cpu_seconds() - cpu) / gb);
    }
    rates.sort_by(f64::total_cmp);
    cpu_per_gb.sort_by(f64::total_cmp);
    eprintln!(
        "THROUGHPUT {label}: median {:.3} GB/s, {:.3} CPU s/GB (runs {:.3?} GB/s)",
        rates[RUNS / 2],
        cpu_per_gb[RUNS / 2],
        rates
    );
    drop((a, b));
}

/// User and system CPU time of this process so far (both ends of the
/// transfer run in it).
fn cpu_seconds() -> f64 {
    // SAFETY: `getrusage` fills the zeroed struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a `rusage` for RUSAGE_SELF.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) }, 0);
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand with --release"]
async fn throughput() {
    const BIG: usize = 64 << 10;
    const SMALL: usize = 8 << 10;
    measure("contiguous 2048 x 64 KiB", 2048 * BIG, 2048 * BIG, 8, |s, d| {
        (0..2048u64).map(|k| WriteOp { src: s + k * BIG as u64, dst: d + k * BIG as u64, len: BIG as u64 }).collect()
    })
    .await;
    measure("scattered 4096 x 8 KiB", 8192 * SMALL, 8192 * SMALL, 32, |s, d| {
        (0..4096u64)
            .map(|k| WriteOp {
                src: s + 2 * k * SMALL as u64,
                dst: d + ((k * 2503) % 8192) * SMALL as u64,
                len: SMALL as u64,
            })
            .collect()
    })
    .await;
}
