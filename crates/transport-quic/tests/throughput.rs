//! Throughput of one batch between two transports on loopback, by hand in
//! release mode:
//!
//! ```text
//! cargo test --release -p transport-quic --test throughput -- --ignored --nocapture
//! ```
//!
//! One warm-up batch, then the median of five `batch_write`s: 4,096 × 64 KiB
//! contiguous, and 4,096 × 8 KiB scattered over twice the room in a
//! shuffled order. Each batch runs under a fresh grant over exactly its
//! destinations; issuing and revoking it is timed apart. CPU seconds per GB
//! (both ends in this process) are printed too: on a shared machine they
//! move less than wall time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;

use std::time::{Duration, Instant};

use kv_proto::{BatchWriter, MemoryRegion, RegionAccess, WriteOp};
use test_support::TestBuf;
use transport_quic::{QuicConfig, QuicTransport};

/// CPU time (user + system) this process has used so far.
fn cpu_time() -> Duration {
    // SAFETY: `getrusage` fills the zeroed struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

const N: u64 = 4096;
const BIG: u64 = 64 * 1024;
const SMALL: u64 = 8 * 1024;

async fn run(name: &str, ops_of: impl Fn(u64, u64) -> Vec<WriteOp>, src_len: usize, dst_len: usize) {
    let a = QuicTransport::bind(QuicConfig::default()).await.unwrap();
    let b = QuicTransport::bind(QuicConfig::default()).await.unwrap();
    let mut src = TestBuf::new(src_len);
    for (i, x) in src.bytes_mut().iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    let dst = TestBuf::new(dst_len);
    // SAFETY: both buffers outlive the transports (shut down below first).
    unsafe {
        a.register_regions(&[src.region()], RegionAccess::Source).unwrap();
        b.register_regions(&[dst.region()], RegionAccess::Destination).unwrap();
    }
    let ops = ops_of(src.addr(), dst.addr());
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let ranges: Vec<MemoryRegion> = ops.iter().map(|o| MemoryRegion::new(o.dst, o.len)).collect();
    let endpoint = b.endpoint();
    let (mut times, mut grant_times, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..6 {
        // A grant per pull, as the worker issues them; timed apart.
        let started = Instant::now();
        let grant = b.grant(&ranges, Duration::from_secs(60)).await.unwrap();
        let granted = started.elapsed();
        let (started, cpu_before) = (Instant::now(), cpu_time());
        a.batch_write(&endpoint, &grant, &ops).await.unwrap();
        let (written, cpu_used) = (started.elapsed(), cpu_time() - cpu_before);
        let started = Instant::now();
        b.revoke(&grant.id).await;
        if round > 0 {
            times.push(written);
            grant_times.push(granted + started.elapsed());
            cpu.push(cpu_used);
        }
    }
    let median = |v: &[Duration]| {
        let mut sorted = v.to_vec();
        sorted.sort();
        sorted[sorted.len() / 2]
    };
    let (batch, grant, cpu) = (median(&times), median(&grant_times), median(&cpu));
    println!(
        "BENCH {name}: {} ops, {} MiB, median {batch:?} = {:.3} GB/s, CPU {:.2} s/GB (grant + revoke {grant:?}; all: {times:?})",
        ops.len(),
        total >> 20,
        total as f64 / batch.as_secs_f64() / 1e9,
        cpu.as_secs_f64() / (total as f64 / 1e9),
    );
    a.shutdown().await;
    b.shutdown().await;
    drop((src, dst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "throughput measurement, run by hand in release mode"]
async fn throughput() {
    run(
        "4096 x 64 KiB",
        |s, d| (0..N).map(|k| WriteOp { src: s + k * BIG, dst: d + k * BIG, len: BIG }).collect(),
        (N * BIG) as usize,
        (N * BIG) as usize,
    )
    .await;
    // Scattered: every other 8 KiB block of the destination, shuffled.
    run(
        "4096 x 8 KiB scattered",
        |s, d| {
            (0..N)
                .map(|k| {
                    let j = (k * 2_654_435_761) % N;
                    WriteOp { src: s + k * SMALL, dst: d + j * 2 * SMALL, len: SMALL }
                })
                .collect()
        },
        (N * SMALL) as usize,
        (2 * N * SMALL) as usize,
    )
    .await;
}
