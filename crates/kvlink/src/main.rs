//! `kvlink`: move KV caches between a prefill and a decode instance, and
//! measure it.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kv_proto::{LayoutKind, Protocol};
use kv_worker::CacheShape;
use kvlink::runner::{run, RunOptions, RunReport};
use kvlink::BlockPattern;

#[derive(Parser, Debug)]
#[command(name = "kvlink", version, about = "Move LLM KV caches from prefill to decode instances, verified.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a prefill and a decode instance over loopback TCP with a
    /// llama-3-8B-shaped cache, move a stream of requests and verify every byte.
    Demo {
        /// Requests to move.
        #[arg(long, default_value_t = 200)]
        requests: usize,
    },
    /// Measure transfers between a prefill and a decode instance in this process.
    Bench(BenchArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Layout {
    /// Separate K and V regions per layer.
    Split,
    /// One region per layer, K and V together in each block.
    Fused,
    /// One region per layer (MLA latent).
    Mla,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ProtocolArg {
    Tcp,
    Quic,
    Rdma,
}

#[derive(clap::Args, Debug)]
struct BenchArgs {
    /// Data-plane transport.
    #[arg(long, value_enum, default_value = "tcp")]
    protocol: ProtocolArg,
    /// Attention layers.
    #[arg(long, default_value_t = 32)]
    layers: u32,
    /// Region layout.
    #[arg(long, value_enum, default_value = "split")]
    layout: Layout,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV heads.
    #[arg(long, default_value_t = 8)]
    heads: u32,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    head_dim: u32,
    /// Bytes per element.
    #[arg(long, default_value_t = 2)]
    dtype_bytes: u32,
    /// Blocks per request.
    #[arg(long, default_value_t = 64)]
    blocks_per_request: usize,
    /// Measured requests.
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    in_flight: usize,
    /// Block-id pattern.
    #[arg(long, value_enum, default_value = "contiguous")]
    pattern: BlockPattern,
    /// Unmeasured requests first.
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    /// Do not write and check KV patterns.
    #[arg(long)]
    no_verify: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

fn progress_bar(len: usize) -> ProgressBar {
    if !std::io::stdout().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len as u64);
    if let Ok(style) = ProgressStyle::with_template("{spinner} {bar:40} {pos}/{len} requests {elapsed}") {
        bar.set_style(style);
    }
    bar
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn print_report(title: &str, r: &RunReport) {
    println!("{title}");
    let check = if r.verified { "verified" } else { "received (not verified)" };
    println!("  requests   {} {check}, {} failed, {} corrupt", r.received, r.failed, r.corrupt);
    println!(
        "  moved      {:.2} GB in {:.2} s = {:.2} GB/s, {:.0} requests/s",
        r.bytes as f64 / 1e9,
        r.seconds,
        r.gbytes_per_sec,
        r.requests_per_sec
    );
    println!(
        "  latency    p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms (pull start to received)",
        r.latency_ms_p50, r.latency_ms_p90, r.latency_ms_p99
    );
    println!(
        "  cost       {:.0} ops per batch, {:.3} CPU s per GB, peak RSS {:.2} GiB (caches {:.2} GiB)",
        r.ops_per_batch,
        r.cpu_seconds_per_gb,
        gib(r.peak_rss_bytes),
        gib(r.cache_bytes)
    );
}

async fn demo(requests: usize) -> anyhow::Result<bool> {
    let shape = CacheShape::llama3_8b(0);
    let opts = RunOptions {
        protocol: Protocol::Tcp,
        shape,
        blocks_per_request: 64,
        requests,
        warmup: 0,
        in_flight: 4,
        pattern: BlockPattern::Random,
        prefix_hit_every: 5,
        verify: true,
        stall_timeout: Duration::from_secs(30),
    };
    println!(
        "kvlink demo: prefill -> decode over loopback TCP, llama-3-8B-shaped cache \
         (32 layers, K/V split, 8 KV heads x 128 dims, bf16, 16-token blocks: {} KiB per block per region)",
        shape.block_len() / 1024
    );
    println!(
        "  {requests} requests of 1,024 prompt tokens, 4 in flight, random block ids, every 5th with a partial prefix-cache hit on decode"
    );
    let bar = progress_bar(requests);
    let report = run(&opts, &bar).await.context("demo failed")?;
    bar.finish_and_clear();
    print_report("result:", &report);
    let ok = report.failed == 0 && report.corrupt == 0 && report.received == requests;
    println!("{}", if ok { "OK: every byte verified" } else { "FAILED: see the errors above" });
    Ok(ok)
}

async fn bench(args: BenchArgs) -> anyhow::Result<bool> {
    let protocol = match args.protocol {
        ProtocolArg::Tcp => Protocol::Tcp,
        ProtocolArg::Quic => Protocol::Quic,
        ProtocolArg::Rdma => Protocol::Rdma,
    };
    let kind = match args.layout {
        Layout::Split => LayoutKind::SplitKv,
        Layout::Fused => LayoutKind::Fused,
        Layout::Mla => LayoutKind::Mla,
    };
    let shape = CacheShape {
        kind,
        num_layers: args.layers,
        num_blocks: 0,
        block_size: args.block_size,
        num_kv_heads: args.heads,
        head_dim: args.head_dim,
        dtype_bytes: args.dtype_bytes,
    };
    anyhow::ensure!(shape.block_len() > 0 && args.layers > 0, "the cache shape has no bytes");
    anyhow::ensure!(args.blocks_per_request > 0 && args.requests > 0, "nothing to move");
    let opts = RunOptions {
        protocol,
        shape,
        blocks_per_request: args.blocks_per_request,
        requests: args.requests,
        warmup: args.warmup,
        in_flight: args.in_flight,
        pattern: args.pattern,
        prefix_hit_every: 0,
        verify: !args.no_verify,
        stall_timeout: Duration::from_secs(60),
    };
    let bar = if args.json { ProgressBar::hidden() } else { progress_bar(args.requests) };
    let report = run(&opts, &bar).await?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(
            &format!(
                "kvlink bench: {protocol}, {} regions x {} B blocks, {} blocks/request, {:?} ids, {} in flight",
                shape.region_count(),
                shape.block_len(),
                args.blocks_per_request,
                args.pattern,
                args.in_flight
            ),
            &report,
        );
    }
    Ok(report.failed == 0 && report.corrupt == 0)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvlink: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Demo { requests } => demo(requests).await,
            Command::Bench(args) => bench(args).await,
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("kvlink: {e:#}");
            ExitCode::FAILURE
        }
    }
}
