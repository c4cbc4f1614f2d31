//! `kvlink`: move KV caches between a prefill and a decode instance, and
//! measure it.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::IsTerminal;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kv_proto::{KvRole, LayoutKind, Protocol, DEFAULT_BOOTSTRAP_PORT};
use kv_worker::{AuthSecret, CacheDims, CacheShape, ListenerLimits};
use kvlink::control::{check_shape, DEFAULT_CONTROL_PORT};
use kvlink::metrics::{MetricsEndpoint, MetricsHub, RunningEndpoint};
use kvlink::ranks::Split;
use kvlink::runner::{run, RunOptions, RunReport};
use kvlink::serve::{
    ServeOptions, Server, ShapePins, WorkerBounds, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_HANDSHAKES, DEFAULT_MAX_HANDSHAKES_PER_HOST,
};
use kvlink::stats::ProcessFigures;
use kvlink::BlockPattern;

#[derive(Parser, Debug)]
#[command(name = "kvlink", version, about = "Move LLM KV caches from prefill to decode instances, verified.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a prefill and a decode instance over loopback with a
    /// llama-3-8B-shaped cache, move a stream of requests and verify every byte.
    Demo {
        /// Requests to move.
        #[arg(long, default_value_t = 200)]
        requests: usize,
        /// Data-plane transport (`rdma` needs the `rdma` feature and a device).
        #[arg(long, value_enum, default_value = "tcp")]
        protocol: ProtocolArg,
        /// Tokens per block of prefill (and of decode unless
        /// --block-size-decode says otherwise).
        #[arg(long, default_value_t = 16)]
        block_size: u32,
        #[command(flatten)]
        topology: TopologyArgs,
    },
    /// Measure transfers between a prefill and a decode instance: both in
    /// this process, or with --connect one here and one on a `kvlink serve` host.
    Bench(BenchArgs),
    /// Serve one side of a bench between two hosts (like `ib_write_bw`'s
    /// server): prefill (producer) or decode (consumer) for `kvlink bench
    /// --connect` on the other host, with the cache shape it asks for.
    Serve(ServeArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Layout {
    /// Separate K and V regions per layer.
    Split,
    /// One region per layer, K and V together in each block.
    Fused,
    /// One region per layer (MLA latent).
    Mla,
    /// One region per layer, each head's K and V side by side in one row
    /// per token (vLLM's later releases).
    FusedRows,
}

/// How K, V and heads are ordered inside a block.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum TokenOrder {
    /// Token-major (vLLM's default).
    Nhd,
    /// Head-major.
    Hnd,
}

impl From<TokenOrder> for kv_proto::TokenLayout {
    fn from(order: TokenOrder) -> Self {
        match order {
            TokenOrder::Nhd => kv_proto::TokenLayout::Nhd,
            TokenOrder::Hnd => kv_proto::TokenLayout::Hnd,
        }
    }
}

/// How each side is split over workers (all of them in this process).
#[derive(clap::Args, Debug, Clone, Copy)]
struct TopologyArgs {
    /// Tensor-parallel size of prefill: one worker per rank, each holding
    /// its share of the KV heads (replicated past the head count).
    #[arg(long, default_value_t = 1)]
    tp_prefill: u16,
    /// Tensor-parallel size of decode.
    #[arg(long, default_value_t = 1)]
    tp_decode: u16,
    /// Pipeline stages of prefill (each its share of the layers).
    #[arg(long, default_value_t = 1)]
    pp_prefill: u16,
    /// Pipeline stages of decode (must be prefill's).
    #[arg(long, default_value_t = 1)]
    pp_decode: u16,
    /// Tokens per block of decode (default: prefill's).
    #[arg(long)]
    block_size_decode: Option<u32>,
    /// Order of tokens and heads inside a block, on both sides.
    #[arg(long, value_enum, default_value = "nhd")]
    token_layout: TokenOrder,
}

impl TopologyArgs {
    /// Refuses what cannot run, before any worker starts.
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.tp_prefill > 0 && self.tp_decode > 0 && self.pp_prefill > 0 && self.pp_decode > 0,
            "parallel sizes start at 1"
        );
        anyhow::ensure!(self.block_size_decode != Some(0), "--block-size-decode starts at 1");
        anyhow::ensure!(
            self.pp_prefill == self.pp_decode,
            "--pp-prefill {} and --pp-decode {}: pipeline parallelism must be the same on both sides \
             (each decode stage pulls its layers from the same prefill stage)",
            self.pp_prefill,
            self.pp_decode
        );
        Ok(())
    }

    fn apply(&self, opts: &mut RunOptions) {
        opts.prefill_split = Split { tp: self.tp_prefill, pp: self.pp_prefill };
        opts.decode_split = Split { tp: self.tp_decode, pp: self.pp_decode };
        opts.decode_block_size = self.block_size_decode;
        opts.shape = opts.shape.with_token_layout(self.token_layout.into());
    }

    fn is_plain(&self) -> bool {
        self.tp_prefill == 1 && self.tp_decode == 1 && self.pp_prefill == 1 && self.block_size_decode.is_none()
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ProtocolArg {
    Tcp,
    Quic,
    Rdma,
}

impl From<ProtocolArg> for Protocol {
    fn from(p: ProtocolArg) -> Self {
        match p {
            ProtocolArg::Tcp => Protocol::Tcp,
            ProtocolArg::Quic => Protocol::Quic,
            ProtocolArg::Rdma => Protocol::Rdma,
        }
    }
}

impl From<Layout> for LayoutKind {
    fn from(l: Layout) -> Self {
        match l {
            Layout::Split => LayoutKind::SplitKv,
            Layout::Fused => LayoutKind::Fused,
            Layout::Mla => LayoutKind::Mla,
            Layout::FusedRows => LayoutKind::FusedRows,
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum RoleArg {
    /// Serve prefill; the client runs decode and drives the bench.
    Producer,
    /// Serve decode; the client runs prefill and drives the bench.
    Consumer,
}

#[derive(clap::Args, Debug)]
struct BenchArgs {
    /// Run one side here and the other on the `kvlink serve` at HOST[:PORT]
    /// (port 18998 by default); the server's --role decides which. Repeat it
    /// to decode here from several producer servers, requests spread over
    /// them in turn.
    #[arg(long, value_name = "HOST[:PORT]")]
    connect: Vec<String>,
    /// Data-plane transport.
    #[arg(long, value_enum, default_value = "tcp")]
    protocol: ProtocolArg,
    /// Attention layers.
    #[arg(long, default_value_t = 32)]
    layers: u32,
    /// Region layout.
    #[arg(long, value_enum, default_value = "split")]
    layout: Layout,
    /// Tokens per block (of prefill, and of decode unless
    /// --block-size-decode says otherwise).
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
    /// File holding the shared secret of the control connection, the side
    /// channel and the data plane (the `serve` side must use the same).
    #[arg(long, value_name = "PATH")]
    auth_secret_file: Option<std::path::PathBuf>,
    /// TCP with --auth-secret-file: tag every batch's payload too, and
    /// require tagged payloads (this process's workers; a `serve` peer's
    /// decode side must accept them, a producer there must tag them).
    #[arg(long, requires = "auth_secret_file")]
    tcp_payload_auth: bool,
    /// Serve this process's worker metrics (Prometheus text format) at
    /// `http://ADDR/metrics` (port 0: any free port; the address is printed
    /// on stderr once the workers are up).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Keep the metrics endpoint up after the bench, with its totals, until
    /// standard input closes (or Ctrl-C / SIGTERM).
    #[arg(long, requires = "metrics")]
    metrics_hold: bool,
    #[command(flatten)]
    topology: TopologyArgs,
    #[command(flatten)]
    listeners: ListenerArgs,
}

/// The listener limits of the workers a command runs (its side channel's
/// and its data plane's).
#[derive(clap::Args, Debug)]
struct ListenerArgs {
    /// Prefill's side channel: connections in their hello at once (more are
    /// closed at accept).
    #[arg(long, value_name = "N", default_value_t = kv_proto::DEFAULT_MAX_HANDSHAKES)]
    side_channel_max_handshakes: usize,
    /// Prefill's side channel: of those, from one source address (every
    /// peer behind one NAT or pod address shares them).
    #[arg(long, value_name = "N", default_value_t = kv_proto::DEFAULT_MAX_HANDSHAKES_PER_HOST)]
    side_channel_max_handshakes_per_host: usize,
    /// Prefill's side channel: established connections (0 refuses every one).
    #[arg(long, value_name = "N", default_value_t = kv_worker::DEFAULT_SIDE_CHANNEL_MAX_CONNECTIONS)]
    side_channel_max_connections: usize,
    /// The data plane's listener (TCP, QUIC, RDMA control): connections in
    /// their handshake at once.
    #[arg(long, value_name = "N", default_value_t = kv_proto::DEFAULT_MAX_HANDSHAKES)]
    data_max_handshakes: usize,
    /// The data plane's listener: of those, from one source address.
    #[arg(long, value_name = "N", default_value_t = kv_proto::DEFAULT_MAX_HANDSHAKES_PER_HOST)]
    data_max_handshakes_per_host: usize,
    /// The data plane's listener: established connections (0 refuses every one).
    #[arg(long, value_name = "N", default_value_t = ListenerLimits::default().max_connections)]
    data_max_connections: usize,
    /// Prefill's side channel: seconds an incoming connection has for its
    /// whole hello and authentication, from accept.
    #[arg(long, value_name = "SECS", default_value_t = Secs(kv_net::DEFAULT_HANDSHAKE_TIMEOUT))]
    side_channel_handshake_timeout: Secs,
    /// The data plane's listener: seconds an incoming connection has for its
    /// whole handshake and authentication, from accept.
    #[arg(long, value_name = "SECS", default_value_t = Secs(kv_net::DEFAULT_HANDSHAKE_TIMEOUT))]
    data_handshake_timeout: Secs,
}

impl ListenerArgs {
    /// The side channel's limits and the data plane's.
    fn limits(&self) -> (ListenerLimits, ListenerLimits) {
        let side_channel = ListenerLimits {
            max_handshakes: self.side_channel_max_handshakes,
            max_handshakes_per_host: self.side_channel_max_handshakes_per_host,
            max_connections: self.side_channel_max_connections,
            handshake_timeout: self.side_channel_handshake_timeout.0,
        };
        let data = ListenerLimits {
            max_handshakes: self.data_max_handshakes,
            max_handshakes_per_host: self.data_max_handshakes_per_host,
            max_connections: self.data_max_connections,
            handshake_timeout: self.data_handshake_timeout.0,
        };
        (side_channel, data)
    }

    /// Default worker bounds with these limits.
    fn worker_bounds(&self) -> WorkerBounds {
        let (side_channel_limits, data_limits) = self.limits();
        WorkerBounds { side_channel_limits, data_limits, ..WorkerBounds::default() }
    }
}

/// A positive number of seconds on the command line (fractions allowed).
#[derive(Clone, Copy, Debug)]
struct Secs(Duration);

impl std::str::FromStr for Secs {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let secs: f64 = text.parse().map_err(|_| format!("{text:?} is not a number of seconds"))?;
        match Duration::try_from_secs_f64(secs) {
            Ok(d) if !d.is_zero() => Ok(Self(d)),
            _ => Err(format!("{text} is not a positive number of seconds")),
        }
    }
}

impl std::fmt::Display for Secs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0.as_secs_f64())
    }
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// The side this host serves.
    #[arg(long, value_enum, default_value = "producer")]
    role: RoleArg,
    /// Address the listeners bind (default: loopback, this host only).
    /// Between two hosts pass `0.0.0.0` (clients are told the address they
    /// connected to, so the wildcard works) or one of this host's addresses.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    listen: IpAddr,
    /// Control port clients connect to (0: any free port).
    #[arg(long, default_value_t = DEFAULT_CONTROL_PORT)]
    control_port: u16,
    /// Side-channel port of the prefill worker (0: any free port, per session).
    #[arg(long, default_value_t = DEFAULT_BOOTSTRAP_PORT)]
    side_channel_port: u16,
    /// Exit after this many sessions (default: serve until Ctrl-C).
    #[arg(long, value_name = "N")]
    sessions: Option<usize>,
    /// Sessions served at once (producer only): they share one prefill
    /// instance, whose cache is this many times the first client's; a client
    /// whose shape, transport, block pattern or verification differs is
    /// refused while others run.
    #[arg(long, value_name = "N", default_value_t = 1)]
    max_sessions: usize,
    /// Print what the process holds (RSS, open descriptors, threads, tokio
    /// tasks) as a `figures` line when ready and whenever no connection is
    /// open.
    #[arg(long)]
    figures: bool,
    /// Largest cache a client may ask for, GiB.
    #[arg(long, default_value_t = 16)]
    max_cache_gib: u64,
    /// Refuse clients using another transport (default: the client's).
    #[arg(long, value_enum)]
    protocol: Option<ProtocolArg>,
    /// Refuse clients with another layer count (default: the client's shape).
    #[arg(long)]
    layers: Option<u32>,
    /// Refuse clients with another region layout.
    #[arg(long, value_enum)]
    layout: Option<Layout>,
    /// Refuse clients with another block size.
    #[arg(long)]
    block_size: Option<u32>,
    /// Refuse clients with another KV head count.
    #[arg(long)]
    heads: Option<u32>,
    /// Refuse clients with another head dimension.
    #[arg(long)]
    head_dim: Option<u32>,
    /// Refuse clients with another element size.
    #[arg(long)]
    dtype_bytes: Option<u32>,
    /// File holding the shared secret of the control connection, the side
    /// channel and the data plane; clients must use the same.
    #[arg(long, value_name = "PATH")]
    auth_secret_file: Option<std::path::PathBuf>,
    /// TCP with --auth-secret-file: the instances tag every batch's payload
    /// too, and require tagged payloads (a bench client that prefills for a
    /// consumer server must run with --tcp-payload-auth).
    #[arg(long, requires = "auth_secret_file")]
    tcp_payload_auth: bool,
    /// End a session with no call for this long, seconds (clients ping
    /// while they wait on their own side).
    #[arg(long, value_name = "SECS", default_value_t = Secs(DEFAULT_IDLE_TIMEOUT))]
    idle_timeout: Secs,
    /// One bound on a connection's hello and authentication, seconds.
    #[arg(long, value_name = "SECS", default_value_t = Secs(DEFAULT_HANDSHAKE_TIMEOUT))]
    handshake_timeout: Secs,
    /// Consumer: bound on one pull, from asking prefill to its reply, seconds.
    #[arg(long, value_name = "SECS", default_value_t = Secs(WorkerBounds::default().transfer_timeout))]
    transfer_timeout: Secs,
    /// Producer: how long prefilled blocks are held for decode to pull (and
    /// the bound on waiting for a request decode asks for), seconds.
    #[arg(long, value_name = "SECS", default_value_t = Secs(WorkerBounds::default().lease))]
    lease: Secs,
    /// Producer: once decode renews a request it will pull, the blocks are
    /// held this long past its last renewal (within --lease), seconds.
    #[arg(long, value_name = "SECS", default_value_t = Secs(WorkerBounds::default().lease_renewal))]
    lease_renewal: Secs,
    /// Control port: connections in their handshake at once; more are
    /// closed at once.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_HANDSHAKES)]
    max_handshakes: usize,
    /// Control port: connections in their handshake at once from one host.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_HANDSHAKES_PER_HOST)]
    max_handshakes_per_host: usize,
    #[command(flatten)]
    listeners: ListenerArgs,
    /// Serve the sessions' worker metrics (Prometheus text format) at
    /// `http://ADDR/metrics` (port 0: any free port; printed on stderr).
    /// Counts add up over sessions.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Tensor-parallel size of the instance this process is one worker of
    /// (the client's shape is the whole model's; this worker holds its
    /// share of the KV heads).
    #[arg(long, default_value_t = 1)]
    tp_size: u16,
    /// This worker's tensor-parallel rank.
    #[arg(long, default_value_t = 0)]
    tp_rank: u16,
    /// Pipeline stages of the instance (this worker holds its stage's layers).
    #[arg(long, default_value_t = 1)]
    pp_size: u16,
    /// This worker's pipeline stage.
    #[arg(long, default_value_t = 0)]
    pp_rank: u16,
    /// Order of tokens and heads inside this instance's blocks.
    #[arg(long, value_enum, default_value = "nhd")]
    token_layout: TokenOrder,
}

/// Reads a shared secret from a file (surrounding whitespace is not part of it).
fn read_secret(path: Option<&std::path::Path>) -> anyhow::Result<Option<AuthSecret>> {
    let Some(path) = path else { return Ok(None) };
    let text = std::fs::read(path).with_context(|| format!("cannot read the secret file {}", path.display()))?;
    let secret = text.trim_ascii();
    anyhow::ensure!(!secret.is_empty(), "the secret file {} is empty", path.display());
    Ok(Some(AuthSecret::new(secret)))
}

/// Binds the metrics endpoint at `addr` and serves `hub` on it.
async fn start_metrics(addr: SocketAddr, hub: &MetricsHub) -> anyhow::Result<RunningEndpoint> {
    Ok(MetricsEndpoint::bind(addr).await?.spawn(hub.clone()))
}

fn announce_metrics(endpoint: &RunningEndpoint) {
    eprintln!("metrics on http://{}/metrics", endpoint.local_addr());
}

/// Resolves when standard input closes. A thread of its own, not the
/// runtime's blocking pool: a read still waiting when the process ends
/// (on a signal) must not hold the runtime's shutdown.
fn stdin_closed() -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = tx.send(());
    });
    rx
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

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn print_report(title: &str, r: &RunReport) {
    println!("{title}");
    let check = if r.verified { "verified" } else { "received (not verified)" };
    println!("  requests   {} {check}, {} failed, {} corrupt", r.received, r.failed, r.corrupt);
    if r.warmup_failed > 0 || r.received < r.requests {
        println!(
            "  INCOMPLETE {} of {} measured requests received; {} warm-up requests failed",
            r.received, r.requests, r.warmup_failed
        );
    }
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
    let causes = |by_cause: &std::collections::BTreeMap<String, u64>| {
        by_cause.iter().map(|(cause, n)| format!("{cause} {n}")).collect::<Vec<_>>().join(", ")
    };
    if !r.failures.is_empty() {
        println!("  failures   pulls: {} (the decode worker's counts, warm-up included)", causes(&r.failures));
    }
    if !r.send_failures.is_empty() {
        println!("  failures   sends: {} (the prefill worker's counts, warm-up included)", causes(&r.send_failures));
    }
    if let Some(error) = &r.error {
        println!("  ENDED      {error}");
    }
    for mismatch in &r.metrics_mismatch {
        println!("  MISMATCH   {mismatch}");
    }
    for p in &r.peers {
        println!(
            "  server     {}: {:.3} CPU s per GB, peak RSS {:.2} GiB",
            p.addr,
            p.cpu_seconds_per_gb,
            gib(p.peak_rss_bytes)
        );
    }
    let f = &r.figures;
    println!(
        "  process    RSS {:.1} MiB after warm-up, {:.1} MiB at the end; fds {} before, {} after; tokio tasks {} before, {} after",
        mib(f.warm.rss_bytes),
        mib(f.end.rss_bytes),
        f.baseline.open_fds,
        f.after.open_fds,
        f.baseline.tokio_tasks,
        f.after.tokio_tasks
    );
}

async fn demo(requests: usize, protocol: Protocol, block_size: u32, topology: TopologyArgs) -> anyhow::Result<bool> {
    topology.check()?;
    anyhow::ensure!(block_size > 0, "--block-size starts at 1");
    // The runner sizes `num_blocks` for the requests in flight.
    let shape = CacheShape::try_new(CacheDims { block_size, ..CacheShape::llama3_8b(0)?.dims() })?;
    let mut opts = RunOptions {
        requests,
        pattern: BlockPattern::Random,
        prefix_hit_every: 5,
        stall_timeout: Duration::from_secs(30),
        ..RunOptions::new(protocol, shape)
    };
    topology.apply(&mut opts);
    println!(
        "kvlink demo: prefill -> decode over loopback {protocol}, llama-3-8B-shaped cache \
         (32 layers, K/V split, 8 KV heads x 128 dims, bf16, {}-token blocks: {} KiB per block per region)",
        shape.block_size(),
        shape.block_len() / 1024
    );
    if !topology.is_plain() {
        println!(
            "  prefill: {} tensor-parallel x {} pipeline workers; decode: {} x {}, {}-token blocks; {:?} blocks",
            topology.tp_prefill,
            topology.pp_prefill,
            topology.tp_decode,
            topology.pp_decode,
            topology.block_size_decode.unwrap_or(shape.block_size()),
            topology.token_layout
        );
    }
    println!(
        "  {requests} requests of {} prompt tokens, {} in flight, random block ids, every 5th with a partial prefix-cache hit on decode",
        u64::from(shape.block_size()) * opts.blocks_per_request as u64,
        opts.in_flight
    );
    let bar = progress_bar(requests);
    let report = run(&opts, &bar).await.context("demo failed")?;
    bar.finish_and_clear();
    print_report("result:", &report);
    let ok = report.complete();
    println!("{}", if ok { "OK: every byte verified" } else { "FAILED: see the errors above" });
    Ok(ok)
}

async fn bench(args: BenchArgs) -> anyhow::Result<bool> {
    args.topology.check()?;
    anyhow::ensure!(
        args.connect.is_empty() || args.topology.is_plain(),
        "--tp-prefill, --tp-decode, --pp-* and --block-size-decode run both sides here: drop --connect"
    );
    let protocol = Protocol::from(args.protocol);
    let dims = CacheDims {
        kind: args.layout.into(),
        num_layers: args.layers,
        num_blocks: 0,
        block_size: args.block_size,
        num_kv_heads: args.heads,
        head_dim: args.head_dim,
        dtype_bytes: args.dtype_bytes,
    };
    anyhow::ensure!(args.blocks_per_request > 0 && args.requests > 0, "nothing to move");
    // The runner sizes the caches for the requests in flight; check that size now.
    let num_blocks = args
        .blocks_per_request
        .checked_mul(args.in_flight.max(1))
        .and_then(|n| u64::try_from(n).ok()?.checked_add(1))
        .context("--blocks-per-request x --in-flight is too large")?;
    let shape = check_shape(CacheDims { num_blocks, ..dims }, u64::MAX)?;
    let mut opts = RunOptions {
        blocks_per_request: args.blocks_per_request,
        requests: args.requests,
        warmup: args.warmup,
        in_flight: args.in_flight,
        pattern: args.pattern,
        verify: !args.no_verify,
        connect: args.connect.clone(),
        auth_secret: read_secret(args.auth_secret_file.as_deref())?,
        tcp_authenticate_payloads: args.tcp_payload_auth,
        metrics: args.metrics.map(|_| MetricsHub::new()),
        worker_bounds: args.listeners.worker_bounds(),
        ..RunOptions::new(protocol, shape)
    };
    args.topology.apply(&mut opts);
    // Bound before the run (a taken port fails it at once); announced once
    // the workers are on the hub, so a scrape after the line shows them.
    let metrics = match (args.metrics, &opts.metrics) {
        (Some(addr), Some(hub)) => {
            let endpoint = start_metrics(addr, hub).await?;
            let workers =
                if args.connect.is_empty() { opts.prefill_split.workers() + opts.decode_split.workers() } else { 1 };
            let mut exposed = hub.exposed();
            let line = format!("metrics on http://{}/metrics", endpoint.local_addr());
            let announce = tokio::spawn(async move {
                if exposed.wait_for(|n| *n >= workers).await.is_ok() {
                    eprintln!("{line}");
                }
            });
            Some((endpoint, announce))
        }
        _ => None,
    };
    let bar = if args.json { ProgressBar::hidden() } else { progress_bar(args.requests) };
    let report = run(&opts, &bar).await?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let place = match &report.peer {
            Some(peer) => format!(" ({} here, the other side on {peer})", report.side),
            None => String::new(),
        };
        let split = if args.topology.is_plain() {
            String::new()
        } else {
            format!(
                ", TP {}->{} PP {}, {}->{}-token blocks {:?}",
                report.tp.0,
                report.tp.1,
                args.topology.pp_prefill,
                report.block_sizes.0,
                report.block_sizes.1,
                args.topology.token_layout
            )
        };
        print_report(
            &format!(
                "kvlink bench: {protocol}, {} regions x {} B blocks, {} blocks/request, {:?} ids, {} in flight{split}{place}",
                shape.region_count(),
                shape.block_len(),
                args.blocks_per_request,
                args.pattern,
                args.in_flight
            ),
            &report,
        );
    }
    // A server gone mid-run: the report says what happened, and the exit
    // says why in one line, as any other error.
    if let Some(error) = &report.error {
        eprintln!("kvlink: {error}");
    }
    if let Some((endpoint, announce)) = metrics {
        announce.abort();
        if args.metrics_hold {
            use std::io::Write;
            // The report is out before the wait: a script reads it, then scrapes.
            let _ = std::io::stdout().flush();
            let stop = shutdown_signal()?;
            tokio::select! {
                _ = stdin_closed() => {}
                () = stop => {}
            }
        }
        endpoint.stop().await;
    }
    Ok(report.complete())
}

/// A future that resolves on Ctrl-C or SIGTERM; the handlers are in place
/// when this returns (before the ready line, so a signal right after it is
/// a clean stop, not a kill).
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt()).context("cannot watch Ctrl-C")?;
    let mut terminate = signal(SignalKind::terminate()).context("cannot watch SIGTERM")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}

async fn serve(args: ServeArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.tp_rank < args.tp_size && args.pp_rank < args.pp_size,
        "--tp-rank {} of --tp-size {}, --pp-rank {} of --pp-size {}: a rank is below its size",
        args.tp_rank,
        args.tp_size,
        args.pp_rank,
        args.pp_size
    );
    anyhow::ensure!(
        args.side_channel_port != 0 || (args.tp_size == 1 && args.pp_size == 1),
        "a worker of several (--tp-size, --pp-size) needs the instance's --side-channel-port: its peers find it there"
    );
    let opts = ServeOptions {
        role: match args.role {
            RoleArg::Producer => KvRole::Producer,
            RoleArg::Consumer => KvRole::Consumer,
        },
        listen: args.listen,
        control_port: args.control_port,
        side_channel_port: args.side_channel_port,
        place: kv_worker::Placement {
            dp_rank: 0,
            tp_size: args.tp_size,
            tp_rank: args.tp_rank,
            pp_size: args.pp_size,
            pp_rank: args.pp_rank,
        },
        token_layout: args.token_layout.into(),
        sessions: args.sessions,
        max_sessions: args.max_sessions.max(1),
        max_cache_bytes: args.max_cache_gib.saturating_mul(1 << 30),
        pins: ShapePins {
            protocol: args.protocol.map(Protocol::from),
            kind: args.layout.map(LayoutKind::from),
            num_layers: args.layers,
            block_size: args.block_size,
            num_kv_heads: args.heads,
            head_dim: args.head_dim,
            dtype_bytes: args.dtype_bytes,
        },
        idle_timeout: args.idle_timeout.0,
        handshake_timeout: args.handshake_timeout.0,
        worker_bounds: WorkerBounds {
            transfer_timeout: args.transfer_timeout.0,
            lease: args.lease.0,
            lease_renewal: args.lease_renewal.0,
            ..args.listeners.worker_bounds()
        },
        max_handshakes: args.max_handshakes.max(1),
        max_handshakes_per_host: args.max_handshakes_per_host.max(1),
        auth_secret: read_secret(args.auth_secret_file.as_deref())?,
        tcp_authenticate_payloads: args.tcp_payload_auth,
        metrics: args.metrics.map(|_| MetricsHub::new()),
    };
    let stop = shutdown_signal()?;
    let metrics = match (args.metrics, &opts.metrics) {
        (Some(addr), Some(hub)) => Some(start_metrics(addr, hub).await?),
        _ => None,
    };
    if let Some(endpoint) = &metrics {
        announce_metrics(endpoint);
    }
    let server = Server::bind(opts).await?;
    println!("{}", server.ready_line());
    if args.figures {
        println!("figures {}", ProcessFigures::sample());
    }
    // Any peer can provoke refusals: the listeners' one rate limit on them.
    let refusals = kv_net::RefusalLog::new();
    let summary = server
        .run(stop, |s| {
            match (&s.outcome, s.admitted) {
                (Ok(()), _) => println!("session from {}: {} requests, done", s.peer, s.requests),
                (Err(reason), true) => println!("session from {}: {} requests, ended: {reason}", s.peer, s.requests),
                (Err(reason), false) => match refusals.allow(std::time::Instant::now()) {
                    Some(0) => println!("refused {}: {reason}", s.peer),
                    Some(more) => println!("refused {}: {reason} ({more} more refused before)", s.peer),
                    None => {}
                },
            }
            if let Some(idle) = s.idle_figures.filter(|_| args.figures) {
                println!("figures {idle}");
            }
        })
        .await;
    if summary.interrupted {
        println!("stopped after {} sessions", summary.sessions);
    }
    if let Some(endpoint) = metrics {
        endpoint.stop().await;
    }
    Ok(true)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // KVLINK_LOG, as the vLLM package reads it; RUST_LOG as a fallback.
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVLINK_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvlink: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Demo { requests, protocol, block_size, topology } => {
                demo(requests, protocol.into(), block_size, topology).await
            }
            Command::Bench(args) => bench(args).await,
            Command::Serve(args) => serve(args).await,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]

    use super::*;

    #[test]
    fn the_listener_flags_default_to_the_workers_defaults_and_set_them() {
        let Command::Serve(serve) = Cli::try_parse_from(["kvlink", "serve"]).unwrap().command else {
            panic!("not serve")
        };
        assert_eq!(serve.listeners.worker_bounds(), WorkerBounds::default());
        let args = ["kvlink", "bench", "--data-max-handshakes-per-host", "48", "--side-channel-max-connections", "0"];
        let Command::Bench(bench) = Cli::try_parse_from(args).unwrap().command else { panic!("not bench") };
        let bounds = bench.listeners.worker_bounds();
        let defaults = WorkerBounds::default();
        assert_eq!(bounds.data_limits, ListenerLimits { max_handshakes_per_host: 48, ..defaults.data_limits });
        assert_eq!(bounds.side_channel_limits, ListenerLimits { max_connections: 0, ..defaults.side_channel_limits });
    }

    #[test]
    fn payload_tags_are_asked_for_with_a_secret_only() {
        for command in ["serve", "bench"] {
            assert!(Cli::try_parse_from(["kvlink", command, "--tcp-payload-auth"]).is_err(), "{command}: no secret");
            let with_secret = ["kvlink", command, "--tcp-payload-auth", "--auth-secret-file", "/s"];
            let asked = match Cli::try_parse_from(with_secret).unwrap().command {
                Command::Serve(serve) => serve.tcp_payload_auth,
                Command::Bench(bench) => bench.tcp_payload_auth,
                _ => panic!("{command}"),
            };
            assert!(asked, "{command}");
        }
    }
}
