//! `kvlink serve`: one half of a two-host bench. The server listens for
//! control connections (see [`crate::control`]); it starts an instance of
//! its role with the client's cache shape, prefills (producer) or pulls
//! (consumer) what the client asks, and shuts the instance down when the
//! session ends. At most [`ServeOptions::max_sessions`] sessions run at once
//! (others are refused as busy); a producer's concurrent sessions share one
//! prefill instance (one side channel, one cache sized for all of them), as
//! one prefill engine serves several decode engines, and a session whose
//! shape, transport, block pattern or verification differs from the running
//! one's is refused while that one runs.
//!
//! Bounds: a connection first needs a handshake place (at most
//! [`ServeOptions::max_handshakes`], [`ServeOptions::max_handshakes_per_host`]
//! of them from one host; past either it is closed at once), and must finish
//! its hello, the shared-secret exchange and the checks within one deadline
//! ([`ServeOptions::handshake_timeout`], from accept, not per read); frames
//! before that are bounded by [`crate::control::MAX_HANDSHAKE_FRAME_LEN`]. An
//! established session with no call for [`ServeOptions::idle_timeout`] is
//! ended, so an idle client holds the one session slot no longer than that.
//! A failed `accept` (out of descriptors) backs off instead of spinning, and
//! every log line a peer can provoke is rate-limited.
//!
//! Addresses: the instance's listeners bind the `listen` address; what the
//! peer must reach (the side channel named in the params, or the data
//! endpoint) is advertised as the address the client connected to, so a
//! wildcard `listen` works across hosts without further flags.

use std::collections::HashSet;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use kv_net::RefusalLog;
use kv_proto::auth::{self, Channel, Transcript};
use kv_proto::{HandshakePlace, HandshakePlaces, KvRole, KvTransferParams, LayoutKind, Protocol};
use kv_worker::{AuthSecret, CacheDims, CacheShape, ListenerLimits, WorkerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::codec::{Framed, LengthDelimitedCodec};
use tokio_util::sync::CancellationToken;

use crate::blocks::BlockPattern;
use crate::control::{
    check_shape, decode_client_msg, handshake_codec, ClientMsg, PrefilledItem, ServerMsg, CONTROL_VERSION,
    MAX_FRAME_LEN, MAX_REQUESTS_PER_CALL,
};
use crate::engine::{DecodeInstance, PrefillInstance, PromptSpec, PullSpec};
use crate::stats::{peak_rss_bytes, process_cpu_time, ProcessFigures};

/// Bound on sending one reply.
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on any wait a client asks for (`drain`, `complete`), and on
/// waiting for prefill blocks to be freed before a `prefill`.
const MAX_WAIT: Duration = Duration::from_secs(120);

/// Bound on waiting for the last connection's task to be released before
/// sampling the idle server's figures.
const SETTLE_BOUND: Duration = Duration::from_secs(1);

/// Default [`ServeOptions::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default [`ServeOptions::handshake_timeout`].
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`ServeOptions::max_handshakes`] (every listener's).
pub const DEFAULT_MAX_HANDSHAKES: usize = kv_proto::DEFAULT_MAX_HANDSHAKES;
/// Default [`ServeOptions::max_handshakes_per_host`].
pub const DEFAULT_MAX_HANDSHAKES_PER_HOST: usize = 8;

/// Shape figures a server insists on (unset: adopt the client's).
#[derive(Clone, Debug, Default)]
pub struct ShapePins {
    /// Data-plane transport.
    pub protocol: Option<Protocol>,
    /// Region layout.
    pub kind: Option<LayoutKind>,
    /// Attention layers.
    pub num_layers: Option<u32>,
    /// Tokens per block.
    pub block_size: Option<u32>,
    /// KV heads.
    pub num_kv_heads: Option<u32>,
    /// Head dimension.
    pub head_dim: Option<u32>,
    /// Bytes per element.
    pub dtype_bytes: Option<u32>,
}

impl ShapePins {
    /// Every pinned figure `shape` and `protocol` differ on, as one line.
    fn check(&self, protocol: Protocol, shape: &CacheShape) -> Result<(), String> {
        fn diff<T: PartialEq + std::fmt::Debug>(out: &mut Vec<String>, name: &str, pin: Option<T>, got: T) {
            if let Some(pin) = pin.filter(|pin| *pin != got) {
                out.push(format!("{name} {got:?} (client) vs {pin:?} (server)"));
            }
        }
        let mut out = Vec::new();
        diff(&mut out, "protocol", self.protocol, protocol);
        diff(&mut out, "layout", self.kind, shape.kind());
        diff(&mut out, "layers", self.num_layers, shape.num_layers());
        diff(&mut out, "block_size", self.block_size, shape.block_size());
        diff(&mut out, "heads", self.num_kv_heads, shape.num_kv_heads());
        diff(&mut out, "head_dim", self.head_dim, shape.head_dim());
        diff(&mut out, "dtype_bytes", self.dtype_bytes, shape.dtype_bytes());
        if out.is_empty() {
            Ok(())
        } else {
            Err(format!("layout mismatch between P and D: {}", out.join(", ")))
        }
    }
}

/// What to serve.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// `Producer` (serves prefill; the client decodes) or `Consumer`
    /// (serves decode; the client prefills).
    pub role: KvRole,
    /// Address every listener binds.
    pub listen: IpAddr,
    /// Control port (0: any).
    pub control_port: u16,
    /// Side-channel base port of the producer's instance (0: any, per
    /// session); its worker listens on it plus its place's
    /// `pp_rank * tp_size + tp_rank`.
    pub side_channel_port: u16,
    /// Where this process's worker sits in its instance: the client's
    /// shape is the whole model's, this worker holds its share of the
    /// heads and its stage's layers (one process per rank; the client
    /// drives every rank's process alike).
    pub place: kv_worker::Placement,
    /// How this instance's blocks order tokens and heads (a property of
    /// its engine, like its place): the client's shape is laid out so here.
    pub token_layout: kv_proto::TokenLayout,
    /// Stop after this many sessions (`None`: until shut down).
    pub sessions: Option<usize>,
    /// Sessions served at once (at least 1). A producer's share one prefill
    /// instance whose cache holds this many times the first client's blocks;
    /// a consumer serves one at a time.
    pub max_sessions: usize,
    /// Bound on the cache a client may ask for, bytes.
    pub max_cache_bytes: u64,
    /// Shape figures the server insists on.
    pub pins: ShapePins,
    /// Bound on an established session's silence between calls: the
    /// session is then ended and its slot freed. The client learns it in
    /// the welcome and pings while it waits on its own side.
    pub idle_timeout: Duration,
    /// One bound on a connection's whole handshake (hello, shared-secret
    /// exchange, checks and the refusal if any), from accept.
    pub handshake_timeout: Duration,
    /// The instance's bounds on a pull (consumer: its transfer timeout) and
    /// on holding prefilled blocks for decode (producer: its lease).
    pub worker_bounds: WorkerBounds,
    /// Bound on connections in their handshake at once; past it a new
    /// connection is closed at once.
    pub max_handshakes: usize,
    /// Bound on connections in their handshake at once from one host (IP
    /// address), so one host cannot take every place.
    pub max_handshakes_per_host: usize,
    /// Shared secret of the control channel (clients must prove it before
    /// the server does anything for them) and of the worker's side channel
    /// and data plane.
    pub auth_secret: Option<AuthSecret>,
    /// The instances' TCP data plane tags every batch's payload too, and
    /// requires tagged payloads ([`WorkerConfig::tcp_authenticate_payloads`];
    /// only with `auth_secret`).
    pub tcp_authenticate_payloads: bool,
    /// Where each session's instance shows its worker (a metrics endpoint's
    /// hub; the worker's counts stay there after the instance shuts down).
    pub metrics: Option<crate::metrics::MetricsHub>,
}

/// The worker bounds a server's instances (and a bench's own) run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerBounds {
    /// D's bound on one pull ([`WorkerConfig::transfer_timeout`]).
    pub transfer_timeout: Duration,
    /// P's lease on a prefilled request's blocks, and its bound on waiting
    /// for a request to be ready ([`WorkerConfig::abort_request_timeout`]).
    pub lease: Duration,
    /// P's hold on a request past a decode instance's last renewal of it
    /// ([`WorkerConfig::lease_renewal`]).
    pub lease_renewal: Duration,
    /// P's side-channel listener ([`WorkerConfig::side_channel_limits`]).
    pub side_channel_limits: ListenerLimits,
    /// The data-plane listener ([`WorkerConfig::data_limits`]).
    pub data_limits: ListenerLimits,
}

impl WorkerBounds {
    /// Sets these bounds in `config` (each role reads those it has use for).
    pub fn apply_to(&self, config: &mut WorkerConfig) {
        config.transfer_timeout = self.transfer_timeout;
        config.abort_request_timeout = self.lease;
        config.lease_renewal = self.lease_renewal;
        config.side_channel_limits = self.side_channel_limits;
        config.data_limits = self.data_limits;
    }
}

impl Default for WorkerBounds {
    fn default() -> Self {
        let defaults = WorkerConfig::loopback(KvRole::Producer, "defaults");
        Self {
            transfer_timeout: defaults.transfer_timeout,
            lease: defaults.abort_request_timeout,
            lease_renewal: defaults.lease_renewal,
            side_channel_limits: defaults.side_channel_limits,
            data_limits: defaults.data_limits,
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A port is taken.
    #[error("{what} port {port} on {ip} is already in use (another kvlink serve?)")]
    PortInUse {
        /// Which listener.
        what: &'static str,
        /// The address.
        ip: IpAddr,
        /// The port.
        port: u16,
    },
    /// Any other bind failure.
    #[error("cannot listen for {what} connections on {addr}: {error}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why (in the message, so not a `source`: one line either way).
        error: std::io::Error,
    },
    /// Only producer and consumer are served.
    #[error("role {0} cannot be served: use producer or consumer")]
    Role(KvRole),
    /// A consumer serves one session at a time.
    #[error("a consumer serves one session at a time (--max-sessions {0}); only a producer shares its instance")]
    SharedConsumer(usize),
    /// The base side-channel port plus this worker's rank is not a port.
    #[error("--side-channel-port {base} plus this worker's rank ({rank}) is past port 65535")]
    SideChannelPortOverflow {
        /// The base port.
        base: u16,
        /// The worker's place among the instance's workers.
        rank: u32,
    },
}

fn bind_error(what: &'static str, addr: SocketAddr, source: std::io::Error) -> ServeError {
    if source.kind() == std::io::ErrorKind::AddrInUse {
        ServeError::PortInUse { what, ip: addr.ip(), port: addr.port() }
    } else {
        ServeError::Bind { what, addr, error: source }
    }
}

/// How one connection ended.
#[derive(Clone, Debug)]
pub struct SessionReport {
    /// The client.
    pub peer: SocketAddr,
    /// Whether its hello was accepted (refused connections do not count as sessions).
    pub admitted: bool,
    /// Requests it prefilled or pulled.
    pub requests: usize,
    /// `Ok` when the client said bye; otherwise why it ended.
    pub outcome: Result<(), String>,
    /// What the process held once this connection was gone, if no other
    /// connection was open then (the server idle again).
    pub idle_figures: Option<ProcessFigures>,
}

/// How the server ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeSummary {
    /// Sessions served.
    pub sessions: usize,
    /// Whether it stopped on the shutdown signal (rather than `sessions`).
    pub interrupted: bool,
}

/// A bound, not yet running, server.
pub struct Server {
    listener: TcpListener,
    control: SocketAddr,
    opts: ServeOptions,
}

impl Server {
    /// Binds the control listener (and checks the side-channel port is free).
    pub async fn bind(opts: ServeOptions) -> Result<Self, ServeError> {
        if !matches!(opts.role, KvRole::Producer | KvRole::Consumer) {
            return Err(ServeError::Role(opts.role));
        }
        if opts.role == KvRole::Consumer && opts.max_sessions > 1 {
            return Err(ServeError::SharedConsumer(opts.max_sessions));
        }
        let addr = SocketAddr::new(opts.listen, opts.control_port);
        let listener = TcpListener::bind(addr).await.map_err(|e| bind_error("control", addr, e))?;
        let control = listener.local_addr().map_err(|error| ServeError::Bind { what: "control", addr, error })?;
        if opts.role == KvRole::Producer && opts.side_channel_port != 0 {
            // Each session's worker binds it; say now if that cannot work.
            let port = own_side_channel_port(&opts).ok_or(ServeError::SideChannelPortOverflow {
                base: opts.side_channel_port,
                rank: opts.place.global_rank(),
            })?;
            let addr = SocketAddr::new(opts.listen, port);
            drop(std::net::TcpListener::bind(addr).map_err(|e| bind_error("side-channel", addr, e))?);
        }
        Ok(Self { listener, control, opts })
    }

    /// Where clients connect.
    pub fn control_addr(&self) -> SocketAddr {
        self.control
    }

    /// The line `kvlink serve` prints once it accepts connections.
    pub fn ready_line(&self) -> String {
        let mut line = format!("listening control={}", self.control);
        if self.opts.role == KvRole::Producer {
            let ip = self.opts.listen;
            let host = if ip.is_ipv6() { format!("[{ip}]") } else { ip.to_string() };
            let port = match self.opts.side_channel_port {
                0 => "auto".to_owned(),
                _ => own_side_channel_port(&self.opts).map_or_else(|| "none".to_owned(), |port| port.to_string()),
            };
            line.push_str(&format!(" side_channel={host}:{port}"));
        }
        let place = self.opts.place;
        if place.tp_size > 1 || place.pp_size > 1 {
            line.push_str(&format!(" tp={}/{} pp={}/{}", place.tp_rank, place.tp_size, place.pp_rank, place.pp_size));
        }
        let role = if self.opts.role == KvRole::Producer { "producer" } else { "consumer" };
        line.push_str(&format!(" role={role}"));
        line
    }

    /// Serves sessions (at most `max_sessions` at once) until `shutdown`
    /// resolves or the configured number of sessions ended; calls
    /// `on_session` as each connection ends. A running session is ended (its
    /// worker shut down) before this returns.
    pub async fn run<F, S>(self, shutdown: F, mut on_session: S) -> ServeSummary
    where
        F: Future<Output = ()>,
        S: FnMut(&SessionReport),
    {
        let Self { listener, opts, .. } = self;
        let limit = opts.sessions;
        let handshakes = HandshakePlaces::new(opts.max_handshakes, opts.max_handshakes_per_host);
        let opts = Arc::new(opts);
        let cancel = CancellationToken::new();
        let mut connections = JoinSet::new();
        let instances = Arc::new(Instances::new(opts.max_sessions));
        // Any peer can provoke refusals at will: one rate limit for all of them.
        let refusals = Arc::new(RefusalLog::new());
        let over_limit_reply = error_frame(&format!(
            "too many connections in their handshake (at most {} at once, {} from one host); try again",
            opts.max_handshakes, opts.max_handshakes_per_host
        ));
        // A client refused a handshake place is told why, with one write
        // that never waits (best effort), then closed.
        let mut admission =
            kv_net::Admission::new(&listener, &handshakes, "bench control").with_refusal(&over_limit_reply);
        let mut summary = ServeSummary { sessions: 0, interrupted: false };
        tokio::pin!(shutdown);
        while limit.is_none_or(|n| summary.sessions < n) {
            let admitted = tokio::select! {
                () = &mut shutdown => {
                    summary.interrupted = true;
                    break;
                }
                Some(joined) = connections.join_next(), if !connections.is_empty() => {
                    ended(joined, connections.is_empty(), &mut summary, &mut on_session).await;
                    continue;
                }
                admitted = admission.next() => admitted,
            };
            let (stream, peer, place) = admitted;
            let (opts, cancel, instances) = (opts.clone(), cancel.child_token(), instances.clone());
            let refusals = refusals.clone();
            connections.spawn(async move { session(stream, peer, opts, cancel, &instances, place, &refusals).await });
        }
        drop(listener);
        cancel.cancel();
        // Every connection task ends on the cancel (a session shuts its worker down first).
        while let Some(joined) = connections.join_next().await {
            ended(joined, connections.is_empty(), &mut summary, &mut on_session).await;
        }
        summary
    }
}

/// Counts and reports a connection that ended; `idle` when it was the last
/// one open (its task joined, so what it held is given back: with no
/// connection open the server runs no task).
async fn ended(
    joined: Result<SessionReport, tokio::task::JoinError>,
    idle: bool,
    summary: &mut ServeSummary,
    on_session: &mut impl FnMut(&SessionReport),
) {
    let mut report = match joined {
        Ok(report) => report,
        Err(error) => {
            tracing::error!(%error, "a control connection task failed");
            return;
        }
    };
    if report.admitted {
        summary.sessions += 1;
    }
    if idle {
        report.idle_figures = Some(ProcessFigures::settled(0, SETTLE_BOUND).await);
    }
    on_session(&report);
}

type Conn = Framed<TcpStream, LengthDelimitedCodec>;

/// An `error` reply as a whole frame, to write without a codec.
fn error_frame(message: &str) -> Vec<u8> {
    let body = serde_json::to_vec(&ServerMsg::Error { message: message.to_owned() }).unwrap_or_default();
    let mut frame = u32::try_from(body.len()).unwrap_or(0).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame
}

async fn send(conn: &mut Conn, msg: &ServerMsg) -> Result<(), String> {
    let frame = serde_json::to_vec(msg).map_err(|e| format!("cannot encode a reply: {e}"))?;
    match tokio::time::timeout(SEND_TIMEOUT, conn.send(Bytes::from(frame))).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("cannot send a reply: {e}")),
        Err(_) => Err(format!("the client did not take a reply within {SEND_TIMEOUT:?}")),
    }
}

/// The next message: `Ok(None)` at a clean end of stream.
async fn read(conn: &mut Conn) -> Result<Option<ClientMsg>, String> {
    match conn.next().await {
        None => Ok(None),
        Some(Err(e)) => Err(format!("bad frame: {e}")),
        Some(Ok(frame)) => decode_client_msg(&frame).map(Some).map_err(|e| format!("bad message: {e}")),
    }
}

/// An instance of the server's role.
enum Instance {
    Prefill(PrefillInstance),
    Decode(DecodeInstance),
}

impl Instance {
    async fn shutdown(self) {
        match self {
            Instance::Prefill(p) => p.shutdown().await,
            Instance::Decode(d) => d.shutdown().await,
        }
    }
}

/// What sessions sharing an instance must agree on: everything their hello
/// asks but the number of blocks (the first session's sizes the cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Terms {
    shape: CacheShape,
    pattern: BlockPattern,
    protocol: Protocol,
    verify: bool,
}

impl Terms {
    fn of(a: &Admitted) -> Self {
        Self { shape: a.shape, pattern: a.pattern, protocol: a.protocol, verify: a.verify }
    }

    /// `Ok` if a session asking `other` may share an instance started for
    /// these terms; otherwise every difference, as one line.
    fn admit(&self, other: &Terms) -> Result<(), String> {
        let s = &self.shape;
        let pins = ShapePins {
            protocol: Some(self.protocol),
            kind: Some(s.kind()),
            num_layers: Some(s.num_layers()),
            block_size: Some(s.block_size()),
            num_kv_heads: Some(s.num_kv_heads()),
            head_dim: Some(s.head_dim()),
            dtype_bytes: Some(s.dtype_bytes()),
        };
        let mut out: Vec<String> = pins.check(other.protocol, &other.shape).err().into_iter().collect();
        if self.pattern != other.pattern {
            out.push(format!("block pattern {:?} (client) vs {:?} (running)", other.pattern, self.pattern));
        }
        if self.verify != other.verify {
            out.push(format!("verify {} (client) vs {} (running)", other.verify, self.verify));
        }
        if out.is_empty() {
            Ok(())
        } else {
            Err(format!("busy: serving a session this one cannot share the instance with: {}", out.join("; ")))
        }
    }
}

/// The running instance and how many sessions use it.
struct Running {
    terms: Terms,
    /// The instance's cache (sized for every session that may share it).
    shape: CacheShape,
    instance: Arc<tokio::sync::Mutex<Instance>>,
    sessions: usize,
}

/// The server's one instance: started by the first session, shared by the
/// sessions that join while it runs (at most `max_sessions`, each holding
/// one of `slots`), shut down by the last one to leave. Starting and
/// shutting down happen under the `running` lock, so a session never starts
/// a second instance beside one still shutting down (the side-channel port).
struct Instances {
    slots: Arc<Semaphore>,
    max_sessions: usize,
    running: tokio::sync::Mutex<Option<Running>>,
}

impl Instances {
    fn new(max_sessions: usize) -> Self {
        let max_sessions = max_sessions.clamp(1, Semaphore::MAX_PERMITS);
        Self { slots: Arc::new(Semaphore::new(max_sessions)), max_sessions, running: tokio::sync::Mutex::new(None) }
    }

    /// A session slot, or why there is none.
    fn slot(&self) -> Result<OwnedSemaphorePermit, String> {
        self.slots.clone().try_acquire_owned().map_err(|_| match self.max_sessions {
            1 => "busy: serving another session; try again when it ends".to_owned(),
            n => format!("busy: serving {n} sessions, the most this server runs at once; try again when one ends"),
        })
    }

    /// Whether a session asking `terms` could join the running instance, or
    /// start one, now.
    async fn check(&self, terms: &Terms, opts: &ServeOptions) -> Result<(), String> {
        match &*self.running.lock().await {
            Some(running) => running.terms.admit(terms),
            None => self.instance_shape(terms.shape, opts).map(drop),
        }
    }

    /// The cache of an instance started for a session asking `shape`: room
    /// for every session that may share it.
    fn instance_shape(&self, shape: CacheShape, opts: &ServeOptions) -> Result<CacheShape, String> {
        if self.max_sessions == 1 {
            return Ok(shape);
        }
        let n = self.max_sessions;
        let blocks = shape.num_blocks().saturating_mul(n as u64);
        check_shape(CacheDims { num_blocks: blocks, ..shape.dims() }, opts.max_cache_bytes).map_err(|e| {
            format!("a cache for {n} sessions of this shape (--max-sessions): {e} (the server's --max-cache-gib)")
        })
    }

    /// Joins the running instance, or starts one.
    async fn join(&self, opts: &ServeOptions, admitted: Admitted, local_ip: IpAddr) -> Result<Served, String> {
        let terms = Terms::of(&admitted);
        let mut running = self.running.lock().await;
        if let Some(r) = running.as_mut() {
            r.terms.admit(&terms)?;
            r.sessions += 1;
            return Ok(Served::new(r.instance.clone(), r.shape, admitted.slot));
        }
        let shape = self.instance_shape(admitted.shape, opts)?;
        let instance = start(opts, &terms, shape, local_ip).await?;
        let instance = Arc::new(tokio::sync::Mutex::new(instance));
        *running = Some(Running { terms, shape, instance: instance.clone(), sessions: 1 });
        Ok(Served::new(instance, shape, admitted.slot))
    }

    /// Leaves the instance; the last session to leave shuts it down. Its
    /// slot is given back after that.
    async fn leave(&self, served: Served) {
        let Served { instance, slot, .. } = served;
        let mut running = self.running.lock().await;
        let last = running.as_mut().is_some_and(|r| {
            r.sessions = r.sessions.saturating_sub(1);
            r.sessions == 0
        });
        drop(instance);
        if let Some(r) = running.take_if(|_| last) {
            match Arc::try_unwrap(r.instance) {
                Ok(instance) => instance.into_inner().shutdown().await,
                // Not reached: every session's handle is dropped before it leaves.
                Err(_) => {
                    tracing::error!("an instance outlived its sessions; its worker closes when the last handle drops")
                }
            }
        }
        drop(running);
        drop(slot);
    }
}

/// One session's use of the instance.
struct Served {
    instance: Arc<tokio::sync::Mutex<Instance>>,
    /// The instance's cache shape.
    shape: CacheShape,
    /// Requests this session asked for.
    requests: usize,
    /// This session's prefilled requests the instance may still hold (a
    /// producer's instance holds every session's).
    held: HashSet<kv_proto::ReqId>,
    /// The session's slot.
    slot: OwnedSemaphorePermit,
}

fn canonical(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// What an admitted hello asks for, and the session slot it holds.
struct Admitted {
    shape: CacheShape,
    pattern: BlockPattern,
    protocol: Protocol,
    verify: bool,
    slot: OwnedSemaphorePermit,
}

/// The hello, the shared-secret exchange (with a secret), the checks and the
/// session slot: everything before the server starts or joins an instance.
/// The caller bounds all of it by one deadline.
async fn handshake(conn: &mut Conn, opts: &ServeOptions, instances: &Instances) -> Result<Admitted, String> {
    let frame = match conn.next().await {
        None => return Err("closed before hello".to_owned()),
        Some(Err(e)) => return Err(format!("bad frame: {e}")),
        Some(Ok(frame)) => frame.freeze(),
    };
    let hello = decode_client_msg(&frame).map_err(|e| format!("bad message: {e}"))?;
    let ClientMsg::Hello { version, shape, pattern, protocol, verify, client_nonce } = hello else {
        return Err("the first message must be hello".to_owned());
    };
    if version != CONTROL_VERSION {
        return Err(format!("control protocol version mismatch: client {version}, server {CONTROL_VERSION}"));
    }
    match (&opts.auth_secret, client_nonce) {
        (None, None) => {}
        (Some(_), None) => {
            return Err("this server requires the shared secret: run the bench with --auth-secret-file \
                        naming the server's secret"
                .to_owned())
        }
        (None, Some(_)) => {
            return Err("this server has no shared secret but the client has one: \
                        give both the same --auth-secret-file, or neither"
                .to_owned())
        }
        (Some(secret), Some(client_nonce)) => authenticate(conn, secret, &client_nonce, &frame).await?,
    }
    let shape = check_shape(shape.into(), opts.max_cache_bytes).map_err(|e| match e {
        crate::control::ShapeError::OverLimit { what: "bytes", .. } => format!("{e} (the server's --max-cache-gib)"),
        e => e.to_string(),
    })?;
    opts.pins.check(protocol, &shape)?;
    let slot = instances.slot()?;
    let admitted = Admitted { shape, pattern, protocol, verify, slot };
    instances.check(&Terms::of(&admitted), opts).await?;
    Ok(admitted)
}

/// Proves the shared secret to the client and checks its proof, both bound
/// to this channel, both nonces and the hello frame as received.
async fn authenticate(
    conn: &mut Conn,
    secret: &AuthSecret,
    client_nonce: &auth::Nonce,
    hello: &[u8],
) -> Result<(), String> {
    let server_nonce = auth::fresh_nonce().ok_or("no OS randomness for a nonce")?;
    let transcript =
        Transcript { channel: Channel::Control, client_nonce, server_nonce: &server_nonce, context: hello };
    let challenge = ServerMsg::Challenge { server_nonce, server_proof: auth::server_proof(secret, &transcript) };
    send(conn, &challenge).await?;
    let proof = match read(conn).await? {
        None => return Err("closed during authentication".to_owned()),
        Some(ClientMsg::Proof { proof }) => proof,
        Some(_) => return Err("expected the authentication proof".to_owned()),
    };
    if auth::verify_client_proof(secret, &transcript, &proof) {
        Ok(())
    } else {
        Err("control authentication failed: the client's proof does not match this server's secret".to_owned())
    }
}

/// The port this server's producer worker listens on: the base plus its
/// place among the instance's workers (`None` past 65535: `bind` refuses it).
fn own_side_channel_port(opts: &ServeOptions) -> Option<u16> {
    kv_proto::topology::side_channel_port(opts.side_channel_port, opts.place.global_rank())
}

/// Starts an instance of the server's role with this worker's share of the
/// model `shape`.
async fn start(opts: &ServeOptions, terms: &Terms, shape: CacheShape, local_ip: IpAddr) -> Result<Instance, String> {
    let Terms { pattern, protocol, verify, .. } = *terms;
    let model = shape.with_token_layout(opts.token_layout);
    let shape = crate::engine::rank_shape(model, opts.place).map_err(|e| e.to_string())?;
    let ranked = |config| crate::engine::rank_config(config, &model, opts.place);
    Ok(match opts.role {
        KvRole::Producer => {
            let mut config = WorkerConfig::loopback(KvRole::Producer, "kvlink-serve-prefill");
            config.protocol = protocol;
            config.side_channel_bind = opts.listen;
            config.side_channel_base_port = opts.side_channel_port;
            config.auth_secret = opts.auth_secret.clone();
            config.tcp_authenticate_payloads = opts.tcp_authenticate_payloads;
            config.data_listen = SocketAddr::new(opts.listen, 0);
            opts.worker_bounds.apply_to(&mut config);
            let mut p = PrefillInstance::start_advertising(ranked(config), shape, pattern, 1, Some(local_ip))
                .await
                .map_err(|e| format!("prefill: {e}"))?;
            p.set_write_patterns(verify);
            if let Some(hub) = &opts.metrics {
                p.expose(hub);
            }
            Instance::Prefill(p)
        }
        _ => {
            let mut config = WorkerConfig::loopback(KvRole::Consumer, "kvlink-serve-decode");
            config.protocol = protocol;
            config.data_listen = SocketAddr::new(opts.listen, 0);
            config.data_advertise_host = Some(local_ip.to_string());
            config.auth_secret = opts.auth_secret.clone();
            config.tcp_authenticate_payloads = opts.tcp_authenticate_payloads;
            opts.worker_bounds.apply_to(&mut config);
            let mut d =
                DecodeInstance::start(ranked(config), shape, pattern, 2).await.map_err(|e| format!("decode: {e}"))?;
            d.set_verify(verify);
            if let Some(hub) = &opts.metrics {
                d.expose(hub);
            }
            Instance::Decode(d)
        }
    })
}

fn wait_of(timeout_ms: u64) -> Duration {
    Duration::from_millis(timeout_ms).min(MAX_WAIT)
}

fn blocks_needed(shape: &CacheShape, prompt_len: usize) -> usize {
    prompt_len.div_ceil(shape.block_size().max(1) as usize)
}

impl Served {
    fn new(instance: Arc<tokio::sync::Mutex<Instance>>, shape: CacheShape, slot: OwnedSemaphorePermit) -> Self {
        Self { instance, shape, requests: 0, held: HashSet::new(), slot }
    }

    async fn handle(&mut self, msg: ClientMsg, peer_ip: IpAddr) -> Result<ServerMsg, String> {
        // Calls that need no instance do not wait for other sessions' calls.
        match msg {
            ClientMsg::Stats => {
                return Ok(ServerMsg::Stats {
                    cpu_seconds: process_cpu_time().as_secs_f64(),
                    peak_rss_bytes: peak_rss_bytes(),
                    figures: Some(ProcessFigures::sample()),
                })
            }
            ClientMsg::Ping => return Ok(ServerMsg::Pong),
            ClientMsg::Hello { .. } => return Err("hello sent twice".to_owned()),
            ClientMsg::Proof { .. } => return Err("an authentication proof outside the handshake".to_owned()),
            ClientMsg::Bye => return Ok(ServerMsg::Bye),
            _ => {}
        }
        let mut instance = self.instance.lock().await;
        let role = match &*instance {
            Instance::Prefill(_) => "producer",
            Instance::Decode(_) => "consumer",
        };
        if let Instance::Prefill(p) = &mut *instance {
            p.reap();
            self.held.retain(|id| p.blocks_of(id).is_some());
        }
        match (msg, &mut *instance) {
            (ClientMsg::Prefill { prompts }, Instance::Prefill(p)) => {
                let reply = prefill(p, &self.shape, &prompts).await?;
                self.requests += prompts.len();
                self.held.extend(prompts.into_iter().map(|spec| spec.id).filter(|id| p.blocks_of(id).is_some()));
                Ok(reply)
            }
            (ClientMsg::Drain { timeout_ms }, Instance::Prefill(p)) => {
                // This session's requests only: others' are their own business.
                let deadline = Instant::now() + wait_of(timeout_ms);
                while !self.held.is_empty() && Instant::now() < deadline {
                    p.reap_wait(deadline.saturating_duration_since(Instant::now())).await;
                    self.held.retain(|id| p.blocks_of(id).is_some());
                }
                Ok(ServerMsg::Drained { held: self.held.len() })
            }
            (ClientMsg::Schedule { pulls }, Instance::Decode(d)) => {
                let n = pulls.len();
                let reply = schedule(d, &self.shape, pulls, peer_ip)?;
                self.requests += n;
                Ok(reply)
            }
            (ClientMsg::Watch { pulls }, Instance::Decode(d)) => {
                let specs = pull_specs(pulls, peer_ip)?;
                d.watch(&specs).map_err(|e| e.to_string())?;
                Ok(ServerMsg::Watching { requests: specs.len() })
            }
            (ClientMsg::Complete { timeout_ms }, Instance::Decode(d)) => {
                Ok(ServerMsg::Completions { items: d.complete(wait_of(timeout_ms)).await })
            }
            (ClientMsg::Schedule { .. } | ClientMsg::Watch { .. } | ClientMsg::Complete { .. }, _) => {
                Err(format!("this server is a {role}: it does not decode (run the bench's decode side here)"))
            }
            _ => Err(format!("this server is a {role}: it does not prefill (run the bench's prefill side here)")),
        }
    }
}

async fn prefill(p: &mut PrefillInstance, shape: &CacheShape, prompts: &[PromptSpec]) -> Result<ServerMsg, String> {
    if prompts.len() > MAX_REQUESTS_PER_CALL {
        return Err(format!("{} requests in one call, more than {MAX_REQUESTS_PER_CALL}", prompts.len()));
    }
    let mut seen = HashSet::with_capacity(prompts.len());
    let mut needed = 0usize;
    for spec in prompts {
        if spec.prompt_len == 0 {
            return Err(format!("request {}: empty prompt", spec.id));
        }
        if !seen.insert(&spec.id) || p.blocks_of(&spec.id).is_some() {
            return Err(format!("request {}: duplicate id", spec.id));
        }
        needed = needed.saturating_add(blocks_needed(shape, spec.prompt_len));
    }
    if needed as u64 > shape.num_blocks() {
        return Err(format!("the requests need {needed} blocks, the cache has {}", shape.num_blocks()));
    }
    // Blocks come back as decode pulls them; wait (bounded) for room.
    let deadline = Instant::now() + MAX_WAIT;
    while p.free_blocks() < needed {
        if Instant::now() >= deadline {
            return Err(format!(
                "no room for {needed} blocks within {MAX_WAIT:?}: {} free, {} requests still held for decode",
                p.free_blocks(),
                p.held()
            ));
        }
        p.reap_wait(deadline.saturating_duration_since(Instant::now())).await;
    }
    let done = p.prefill(prompts).map_err(|e| e.to_string())?;
    let items = done
        .into_iter()
        .map(|(spec, params)| PrefilledItem {
            blocks: p.blocks_of(&spec.id).map(<[_]>::to_vec).unwrap_or_default(),
            id: spec.id,
            // Serializing plain bools, strings and integers cannot fail.
            params: serde_json::to_value(&params).unwrap_or_default(),
        })
        .collect();
    Ok(ServerMsg::Prefilled { items })
}

/// The pulls a client asks for, checked: well-formed, no duplicate, and
/// params that point at the client itself (a consumer server pulls only
/// from the host that drives it).
fn pull_specs(pulls: Vec<crate::control::WirePull>, peer_ip: IpAddr) -> Result<Vec<PullSpec>, String> {
    if pulls.len() > MAX_REQUESTS_PER_CALL {
        return Err(format!("{} requests in one call, more than {MAX_REQUESTS_PER_CALL}", pulls.len()));
    }
    let mut seen = HashSet::with_capacity(pulls.len());
    let mut specs = Vec::with_capacity(pulls.len());
    for w in pulls {
        let id = &w.id;
        if w.prompt_len == 0 || w.prefix_hit_tokens > w.prompt_len {
            return Err(format!("request {id}: prompt of {} tokens with {} cached", w.prompt_len, w.prefix_hit_tokens));
        }
        if !seen.insert(id.clone()) {
            return Err(format!("request {id}: duplicate id"));
        }
        let params = KvTransferParams::from_value(&w.params).map_err(|e| format!("request {id}: {e}"))?;
        let host = params.remote().map(|(host, _)| host.to_owned()).unwrap_or_default();
        if !params.do_remote_prefill || host.parse::<IpAddr>().ok().map(canonical) != Some(peer_ip) {
            return Err(format!(
                "request {id}: its params do not point at this client ({peer_ip}) with do_remote_prefill: {}",
                params.to_json()
            ));
        }
        specs.push(PullSpec {
            id: w.id,
            prompt_len: w.prompt_len,
            seed: w.seed,
            params,
            prefix_hit_tokens: w.prefix_hit_tokens,
        });
    }
    Ok(specs)
}

fn schedule(
    d: &mut DecodeInstance,
    shape: &CacheShape,
    pulls: Vec<crate::control::WirePull>,
    peer_ip: IpAddr,
) -> Result<ServerMsg, String> {
    let specs = pull_specs(pulls, peer_ip)?;
    if let Some(spec) = specs.iter().find(|s| d.blocks_of(&s.id).is_some()) {
        return Err(format!("request {}: duplicate id", spec.id));
    }
    let needed = specs.iter().fold(0usize, |sum, s| sum.saturating_add(blocks_needed(shape, s.prompt_len)));
    if needed > d.free_blocks() {
        return Err(format!("no room for {needed} blocks: {} free", d.free_blocks()));
    }
    d.schedule(&specs).map_err(|e| e.to_string())?;
    let blocks = specs.iter().map(|s| d.blocks_of(&s.id).map(<[_]>::to_vec).unwrap_or_default()).collect();
    Ok(ServerMsg::Scheduled { blocks })
}

/// How a session ended.
enum End {
    /// The client said bye.
    Bye,
    /// Refused: the client is told why.
    Refused(String),
    /// The client is gone or silent.
    Gone(String),
}

/// Serves one control connection. `place` bounds the connections in their
/// handshake; it is given back once the handshake is over.
async fn session(
    stream: TcpStream,
    peer: SocketAddr,
    opts: Arc<ServeOptions>,
    cancel: CancellationToken,
    instances: &Instances,
    place: HandshakePlace,
    refusals: &RefusalLog,
) -> SessionReport {
    let mut report = SessionReport { peer, admitted: false, requests: 0, outcome: Ok(()), idle_figures: None };
    let local_ip = match stream.local_addr() {
        Ok(addr) => canonical(addr.ip()),
        Err(e) => {
            report.outcome = Err(format!("control socket: {e}"));
            return report;
        }
    };
    let peer_ip = canonical(peer.ip());
    let _ = stream.set_nodelay(true);
    let mut conn = Framed::new(stream, handshake_codec());
    let deadline = Instant::now() + opts.handshake_timeout;
    let admitted = tokio::select! {
        () = cancel.cancelled() => Err("server shutting down".to_owned()),
        r = tokio::time::timeout_at(deadline, handshake(&mut conn, &opts, instances)) => match r {
            Err(_) => Err(format!("handshake not completed within {:?}", opts.handshake_timeout)),
            Ok(r) => r,
        },
    };
    let admitted = match admitted {
        Ok(admitted) => admitted,
        Err(reason) => {
            if let Some(suppressed) = refusals.allow(std::time::Instant::now()) {
                tracing::warn!(%peer, %reason, suppressed, "control connection refused");
            }
            // Within the same deadline: a client that does not read its
            // refusal holds its place no longer.
            let refusal = ServerMsg::Error { message: reason.clone() };
            let _ = tokio::time::timeout_at(deadline, send(&mut conn, &refusal)).await;
            report.outcome = Err(reason);
            return report;
        }
    };
    drop(place);
    conn.codec_mut().set_max_frame_length(MAX_FRAME_LEN);
    let mut served = match instances.join(&opts, admitted, local_ip).await {
        Ok(served) => served,
        Err(reason) => {
            if let Some(suppressed) = refusals.allow(std::time::Instant::now()) {
                tracing::warn!(%peer, %reason, suppressed, "cannot start a session");
            }
            let _ = send(&mut conn, &ServerMsg::Error { message: reason.clone() }).await;
            report.outcome = Err(reason);
            return report;
        }
    };
    report.admitted = true;
    let role = if opts.role == KvRole::Producer { "producer" } else { "consumer" };
    tracing::info!(%peer, role, shape = ?served.shape, "session started");
    let idle_timeout_ms = u64::try_from(opts.idle_timeout.as_millis()).unwrap_or(u64::MAX);
    let welcome = ServerMsg::Welcome { version: CONTROL_VERSION, role: opts.role, idle_timeout_ms };
    let end = match send(&mut conn, &welcome).await {
        Err(reason) => End::Gone(reason),
        Ok(()) => serve_calls(&mut served, &mut conn, peer_ip, &opts, &cancel).await,
    };
    report.requests = served.requests;
    // Down (and the slot free) before the last reply: a client that read it
    // may start the next session at once.
    instances.leave(served).await;
    let last = match end {
        End::Bye => Ok(ServerMsg::Bye),
        End::Refused(reason) => Err((Some(ServerMsg::Error { message: reason.clone() }), reason)),
        End::Gone(reason) => Err((None, reason)),
    };
    match last {
        Ok(bye) => {
            let _ = send(&mut conn, &bye).await;
        }
        Err((reply, reason)) => {
            tracing::warn!(%peer, %reason, "session ended");
            if let Some(reply) = reply {
                let _ = send(&mut conn, &reply).await;
            }
            report.outcome = Err(reason);
        }
    }
    report
}

/// Answers calls until bye, an error, silence or shutdown.
async fn serve_calls(
    served: &mut Served,
    conn: &mut Conn,
    peer_ip: IpAddr,
    opts: &ServeOptions,
    cancel: &CancellationToken,
) -> End {
    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => return End::Refused("server shutting down".to_owned()),
            r = tokio::time::timeout(opts.idle_timeout, read(conn)) => r,
        };
        let msg = match msg {
            Err(_) => return End::Refused(format!("idle: no call within {:?}; session ended", opts.idle_timeout)),
            Ok(Ok(None)) => return End::Gone("the client closed the connection without bye".to_owned()),
            Ok(Ok(Some(ClientMsg::Bye))) => return End::Bye,
            Ok(Ok(Some(msg))) => msg,
            Ok(Err(reason)) => return End::Refused(reason),
        };
        let reply = tokio::select! {
            () = cancel.cancelled() => return End::Refused("server shutting down".to_owned()),
            r = served.handle(msg, peer_ip) => r,
        };
        match reply {
            Ok(reply) => {
                if let Err(reason) = send(conn, &reply).await {
                    return End::Gone(reason);
                }
            }
            Err(reason) => return End::Refused(reason),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_share_an_instance_only_on_the_same_terms() {
        let shape = CacheShape::llama3_8b(10).unwrap();
        let terms = Terms { shape, pattern: BlockPattern::Random, protocol: Protocol::Tcp, verify: true };
        // The number of blocks is not a term: the first session sized the cache.
        assert_eq!(terms.admit(&Terms { shape: CacheShape::llama3_8b(99).unwrap(), ..terms }), Ok(()));
        let other = Terms { pattern: BlockPattern::Contiguous, protocol: Protocol::Quic, verify: false, ..terms };
        let refusal = terms.admit(&other).unwrap_err();
        for needle in
            ["busy: ", "protocol Quic (client) vs Tcp", "block pattern Contiguous (client) vs Random", "verify false"]
        {
            assert!(refusal.contains(needle), "{refusal:?} lacks {needle:?}");
        }
    }

    #[test]
    fn pins_name_every_difference() {
        let shape = CacheShape::llama3_8b(10).unwrap();
        assert_eq!(ShapePins::default().check(Protocol::Tcp, &shape), Ok(()));
        let pins = ShapePins { num_layers: Some(32), head_dim: Some(64), dtype_bytes: Some(1), ..ShapePins::default() };
        assert_eq!(
            pins.check(Protocol::Tcp, &shape),
            Err("layout mismatch between P and D: head_dim 128 (client) vs 64 (server), dtype_bytes 2 (client) vs 1 (server)"
                .to_owned())
        );
    }
}
