//! Loopback throughput of the QUIC transport: one sender, one receiver, one
//! connection, each side on its own thread and runtime.
//!
//! `cargo run --release -p transport-quic --example throughput [GiB]` prints
//! GB/s for large contiguous ops (8 MiB) and for scattered 8 KiB ops (4,096
//! per batch, sources and destinations non-contiguous, destinations
//! reversed). Compare with `iperf3 -c 127.0.0.1` (single stream) on the same
//! machine.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::time::Instant;

use kv_proto::{BatchWriter, Endpoint, MemoryRegion, WriteOp};
use transport_quic::{QuicConfig, QuicTransport};

const MIB: usize = 1 << 20;
const ALIGN: usize = 4096;

struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len, ALIGN).unwrap();
        // SAFETY: `len` > 0.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        // Touch every page so the first pass does not measure page faults.
        // SAFETY: `ptr` is valid for `len` bytes.
        unsafe { std::ptr::write_bytes(ptr, 1, len) };
        Self { ptr, len }
    }

    fn addr(&self) -> u64 {
        self.ptr.expose_provenance() as u64
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align(self.len, ALIGN).unwrap()) }
    }
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

async fn run(name: &str, a: &QuicTransport, endpoint: &Endpoint, ops: &[WriteOp], total_bytes: u64) {
    let batch_bytes: u64 = ops.iter().map(|op| op.len).sum();
    let rounds = total_bytes.div_ceil(batch_bytes);
    a.batch_write(endpoint, ops).await.unwrap(); // warm-up: connection, page faults
    let (start, cpu) = (Instant::now(), cpu_seconds());
    for _ in 0..rounds {
        a.batch_write(endpoint, ops).await.unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    let moved = (rounds * batch_bytes) as f64;
    println!(
        "{name:<28} {:>6} ops/batch  {:>7.2} GB/s  {:>5.2} CPU-s/GB  ({} batches, {:.2} s)",
        ops.len(),
        moved / secs / 1e9,
        (cpu_seconds() - cpu) / (moved / 1e9),
        rounds,
        secs
    );
}

/// The receiver (D) runs on its own single-threaded runtime and thread, as it
/// would in its own process; the sender (P) on another.
fn main() {
    let gib: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(4);
    let total = gib << 30;
    let dst = Buf::new(256 * MIB);
    let dst_region = MemoryRegion::new(dst.addr(), dst.len as u64);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let receiver = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let b = QuicTransport::bind(QuicConfig::default()).await.unwrap();
            // SAFETY: `dst` outlives this thread (joined before `dst` drops).
            unsafe { b.register_regions(&[dst_region]).unwrap() };
            ready_tx.send(b.endpoint()).unwrap();
            let _ = stop_rx.await;
            b.shutdown().await;
        });
    });
    let endpoint = ready_rx.recv().unwrap();

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let a = QuicTransport::bind(QuicConfig::default()).await.unwrap();
        let src = Buf::new(256 * MIB);
        // SAFETY: `src` outlives `a` (shut down and dropped at the end of this block).
        unsafe { a.register_regions(&[MemoryRegion::new(src.addr(), src.len as u64)]).unwrap() };

        let large: Vec<WriteOp> = (0..32)
            .map(|k| WriteOp {
                src: src.addr() + (k * 8 * MIB) as u64,
                dst: dst.addr() + (k * 8 * MIB) as u64,
                len: (8 * MIB) as u64,
            })
            .collect();
        run("large contiguous (8 MiB)", &a, &endpoint, &large, total).await;

        const BLOCK: usize = 8 * 1024;
        const COUNT: usize = 4096;
        let scattered: Vec<WriteOp> = (0..COUNT)
            .map(|k| WriteOp {
                src: src.addr() + (k * 2 * BLOCK) as u64,
                dst: dst.addr() + ((COUNT - 1 - k) * 3 * BLOCK) as u64,
                len: BLOCK as u64,
            })
            .collect();
        run("scattered (8 KiB)", &a, &endpoint, &scattered, total).await;
        a.shutdown().await;
        drop(a);
    });
    let _ = stop_tx.send(());
    receiver.join().unwrap();
    drop(dst);
}
