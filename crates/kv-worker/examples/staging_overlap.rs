//! How much host staging's pieces overlap copies with the wire within one
//! request, measured on the CPU: a prefill and a decode [`StagedWorker`]
//! over loopback TCP in this process, each with a simulated copy engine
//! (one thread running copy orders in order, each taking a fixed time per
//! byte, as a GPU's copy engine does, and copying the bytes for real).
//!
//! For one large request it prints the end-to-end time (P's engine hands
//! the request over → D's engine hears it received, every byte checked)
//! of: each copy alone, the wire alone (copies instant; whole and in
//! pieces), staging whole requests (copy, then wire, then copy) and
//! staging in pieces, with the ratio of each rate to the slowest of the
//! three alone (the wire at its best). Medians of
//! `--runs` requests over one pair of workers, after one to warm up.
//!
//! ```text
//! cargo run --release -p kv-worker --example staging_overlap -- [--mib 128] [--copy-gbps 2] [--piece-mib 8] [--runs 5]
//! ```
// A benchmark's report is its output.
#![allow(clippy::print_stdout)]

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_proto::{BlockId, ConnectorMetadata, KvRole, LayoutKind, RecvReqMeta, RemotePrefill, ReqId, SendUpdate};
use kv_worker::staging::{CopyDirection, CopyOrder, CopyWork, StagedWorker};
use kv_worker::{pattern, CacheDims, CacheShape, OwnedKvCache, Worker, WorkerConfig};

/// Tokens per block, heads and head size of the simulated model: blocks of
/// 32 KiB per region, 16 regions (8 layers, K and V): 512 KiB per slot.
const DIMS: (u32, u32, u32, u32) = (8, 16, 8, 128);

fn shape(num_blocks: u64) -> CacheShape {
    let (num_layers, block_size, num_kv_heads, head_dim) = DIMS;
    CacheShape::try_new(CacheDims {
        kind: LayoutKind::SplitKv,
        num_layers,
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        dtype_bytes: 2,
    })
    .unwrap_or_else(|e| panic!("shape: {e}"))
}

/// A copy engine: runs orders in the order given, `ns_per_byte` each byte
/// (a sleep: the copy engine is not the CPU), and copies the blocks.
struct CopyEngine {
    orders: mpsc::Sender<CopyOrder>,
    done: mpsc::Receiver<u64>,
}

impl CopyEngine {
    fn start(device: Arc<OwnedKvCache>, staging: Arc<OwnedKvCache>, ns_per_byte: f64) -> Self {
        let (orders, rx) = mpsc::channel::<CopyOrder>();
        let (tx, done) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; device.block_len()];
            let regions = device.shape().region_count() as usize;
            for order in rx {
                let started = Instant::now();
                let bytes = (order.pairs.len() * regions * device.block_len()) as f64;
                for region in 0..regions {
                    for &(dev, slot) in &order.pairs {
                        // SAFETY: the staging core orders a copy only of
                        // blocks no transfer touches while it runs.
                        let copied = unsafe {
                            match order.direction {
                                CopyDirection::ToStaging => device
                                    .read_block(region, dev, &mut buf)
                                    .and_then(|()| staging.write_block(region, slot, &buf)),
                                CopyDirection::ToDevice => staging
                                    .read_block(region, slot, &mut buf)
                                    .and_then(|()| device.write_block(region, dev, &buf)),
                            }
                        };
                        copied.unwrap_or_else(|e| panic!("copy: {e}"));
                    }
                }
                let took = Duration::from_secs_f64(bytes * ns_per_byte / 1e9);
                std::thread::sleep(took.saturating_sub(started.elapsed()));
                if tx.send(order.id).is_err() {
                    return;
                }
            }
        });
        Self { orders, done }
    }
}

/// One instance: its "device" cache, its staged worker, its copy engine.
struct Side {
    device: Arc<OwnedKvCache>,
    staged: StagedWorker,
    engine: CopyEngine,
    waiting: VecDeque<CopyOrder>,
}

impl Side {
    async fn start(role: KvRole, slots: u64, device_blocks: u64, piece_bytes: u64, ns_per_byte: f64) -> Self {
        let device = Arc::new(OwnedKvCache::allocate(shape(device_blocks)).unwrap_or_else(|e| panic!("{e}")));
        let staging = Arc::new(OwnedKvCache::allocate(shape(slots)).unwrap_or_else(|e| panic!("{e}")));
        let config = WorkerConfig { piece_bytes, ..WorkerConfig::loopback(role, &format!("{role}")) };
        let worker = Worker::start(config, staging.clone()).await.unwrap_or_else(|e| panic!("{e}"));
        let engine = CopyEngine::start(device.clone(), staging, ns_per_byte);
        Self { device, staged: StagedWorker::new(worker, Duration::from_secs(30)), engine, waiting: VecDeque::new() }
    }

    fn queue(&mut self, work: CopyWork) {
        self.waiting.extend(work.copies);
    }

    /// Hands ordered copies to the engine, reports finished ones; what the
    /// engine hears.
    fn pump(&mut self) -> kv_worker::Finished {
        while let Some(order) = self.waiting.pop_front() {
            let _ = self.engine.orders.send(order);
        }
        let done: Vec<u64> = self.engine.done.try_iter().collect();
        if !done.is_empty() {
            let work = self.staged.copies_done(done);
            self.queue(work);
        }
        let (finished, work) = self.staged.get_finished();
        self.queue(work);
        finished
    }
}

/// A prefill and a decode side, connected.
struct Pair {
    p: Side,
    d: Side,
    blocks: u32,
}

impl Pair {
    async fn start(blocks: u32, piece_bytes: u64, ns_per_byte: f64) -> Self {
        let device_blocks = u64::from(blocks) * 2;
        let p = Side::start(KvRole::Producer, blocks.into(), device_blocks, piece_bytes, ns_per_byte).await;
        let d = Side::start(KvRole::Consumer, blocks.into(), device_blocks, piece_bytes, ns_per_byte).await;
        Self { p, d, blocks }
    }

    /// One request of all the pair's blocks from P to D (request `n`, its
    /// own bytes). Returns the time from P's engine handing it over to D's
    /// engine hearing it received.
    async fn transfer(&mut self, n: u64) -> Duration {
        let (p, d, blocks) = (&mut self.p, &mut self.d, self.blocks);
        // Scattered blocks on both devices, as a busy engine's free list gives them.
        let p_blocks: Vec<BlockId> = (0..blocks).map(|i| 2 * i + 1).collect();
        let d_blocks: Vec<BlockId> = (0..blocks).map(|i| 2 * (blocks - 1 - i)).collect();
        fill(&p.device, n, &p_blocks);
        let p_req = ReqId::new(format!("p-req-{n}"));
        let mut expect = ConnectorMetadata::default();
        expect.reqs_to_send.insert(p_req.clone(), SendUpdate::Expect);
        let work = p.staged.start_load_kv(&expect);
        p.queue(work);
        let addr = p.staged.worker().side_channel_addr().unwrap_or_else(|| panic!("P has no side channel"));
        let started = Instant::now();
        let mut ready = ConnectorMetadata::default();
        ready.reqs_to_send.insert(p_req.clone(), SendUpdate::Ready { block_ids: p_blocks });
        let work = p.staged.start_load_kv(&ready);
        p.queue(work);
        // D asks at once (the proxy forwards P's answer right away).
        let remote = RemotePrefill {
            remote_host: addr.ip().to_string(),
            remote_port: addr.port(),
            remote_request_id: p_req,
            remote_engine_id: None,
            remote_renewal_key: None,
            bootstrap: None,
        };
        let mut pull = ConnectorMetadata::default();
        let local_block_ids = d_blocks.clone();
        pull.reqs_to_recv
            .insert(ReqId::new(format!("d-req-{n}")), RecvReqMeta { local_block_ids, first_token: None, remote });
        let work = d.staged.start_load_kv(&pull);
        d.queue(work);
        let deadline = started + Duration::from_secs(120);
        let took = loop {
            p.pump();
            let heard = d.pump();
            if !heard.failed_receiving.is_empty() {
                panic!("the pull failed: {heard:?}");
            }
            if !heard.receiving.is_empty() {
                break started.elapsed();
            }
            assert!(Instant::now() < deadline, "no transfer within 120 s");
            tokio::time::sleep(Duration::from_micros(200)).await;
        };
        assert!(holds(&d.device, n, &d_blocks), "D's blocks do not hold P's KV");
        // P's slots come back before the next request.
        while p.staged.staging_state().0 > 0 {
            assert!(Instant::now() < deadline, "P's slots never came back");
            p.pump();
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        took
    }

    async fn stop(self) {
        self.p.staged.shutdown().await;
        self.d.staged.shutdown().await;
    }
}

/// The median time of `runs` requests over one pair, after one to warm up
/// (connections made, memory touched).
async fn measure(blocks: u32, piece_bytes: u64, ns_per_byte: f64, runs: usize) -> Duration {
    let mut pair = Pair::start(blocks, piece_bytes, ns_per_byte).await;
    pair.transfer(0).await;
    let mut times = Vec::with_capacity(runs);
    for n in 1..=runs {
        times.push(pair.transfer(n as u64).await);
    }
    pair.stop().await;
    median(times)
}

fn fill(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) {
    let mut buf = vec![0u8; cache.block_len()];
    for region in 0..cache.shape().region_count() {
        for (position, &block) in blocks.iter().enumerate() {
            pattern::fill(&mut buf, pattern::block_seed(seed, region, position as u32));
            // SAFETY: no copy or transfer touches the cache yet.
            unsafe { cache.write_block(region as usize, block, &buf) }.unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

fn holds(cache: &OwnedKvCache, seed: u64, blocks: &[BlockId]) -> bool {
    let mut buf = vec![0u8; cache.block_len()];
    (0..cache.shape().region_count()).all(|region| {
        blocks.iter().enumerate().all(|(position, &block)| {
            // SAFETY: the pull was reported: nothing writes the block any more.
            unsafe { cache.read_block(region as usize, block, &mut buf) }.unwrap_or_else(|e| panic!("{e}"));
            pattern::matches(&buf, pattern::block_seed(seed, region, position as u32))
        })
    })
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort_unstable();
    xs[xs.len() / 2]
}

fn arg(args: &[String], name: &str, default: f64) -> f64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().unwrap_or_else(|e| panic!("{name} {v}: {e}")))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mib = arg(&args, "--mib", 128.0);
    let copy_gbps = arg(&args, "--copy-gbps", 2.0);
    let piece_mib = arg(&args, "--piece-mib", 8.0);
    let runs = arg(&args, "--runs", 5.0) as usize;
    let slot_bytes = shape(1).region_len() * u64::from(shape(1).region_count());
    let blocks = ((mib * (1 << 20) as f64) / slot_bytes as f64).ceil().max(1.0) as u32;
    let bytes = u64::from(blocks) * slot_bytes;
    let ns_per_byte = 1.0 / copy_gbps;
    let piece_bytes = (piece_mib * (1 << 20) as f64) as u64;
    let gb_s = |t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;

    let copy = Duration::from_secs_f64(bytes as f64 * ns_per_byte / 1e9);
    let mut results = Vec::new();
    for (name, piece, ns) in [
        ("wire alone, whole", 0, 0.0),
        ("wire alone, in pieces", piece_bytes, 0.0),
        ("staged, whole", 0, ns_per_byte),
        ("staged, in pieces", piece_bytes, ns_per_byte),
    ] {
        results.push((name, measure(blocks, piece, ns, runs).await));
    }
    // The wire alone at its best, whole or in pieces.
    let wire = results[0].1.min(results[1].1);
    let slowest = copy.max(wire);
    println!(
        "one request of {:.1} MiB ({blocks} blocks of {} KiB), copies at {copy_gbps} GB/s each way, pieces of {piece_mib} MiB; median of {runs}",
        bytes as f64 / (1 << 20) as f64,
        slot_bytes >> 10
    );
    println!("  {:<28} {:>9.1} ms  {:>6.2} GB/s", "each copy alone", copy.as_secs_f64() * 1e3, gb_s(copy));
    for (name, t) in &results {
        println!(
            "  {:<28} {:>9.1} ms  {:>6.2} GB/s  ratio to the slowest alone: {:.2}",
            name,
            t.as_secs_f64() * 1e3,
            gb_s(*t),
            slowest.as_secs_f64() / t.as_secs_f64()
        );
    }
    println!(
        "  sum of the three alone      {:>9.1} ms; the slowest alone {:.1} ms",
        (2 * copy + wire).as_secs_f64() * 1e3,
        slowest.as_secs_f64() * 1e3
    );
}
