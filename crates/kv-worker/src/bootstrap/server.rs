//! The bootstrap server on a prefill instance: `POST /register`,
//! `GET /query` and `GET /health` over HTTP/1.1, one request per
//! connection, bounded like every listener of the project:
//!
//! - a connection first takes a place ([`kv_net::Admission`]: at most
//!   [`BootstrapLimits::max_connections`] at once,
//!   [`BootstrapLimits::max_connections_per_host`] from one host); past that
//!   it gets a 503 in one write that never waits and is closed;
//! - a request head is at most [`BootstrapLimits::max_head_bytes`] (else
//!   431), a body at most [`BootstrapLimits::max_body_bytes`] and framed by
//!   `Content-Length` (else 413, 411), and the whole exchange, from accept
//!   to the answer's last byte, fits [`BootstrapLimits::deadline`] (a client
//!   that dribbles is cut there, with a 408 if it can be written at once);
//! - after the answer, what the client still sends is read and dropped for
//!   at most [`BootstrapLimits::linger`], so closing does not reset the
//!   answer away.
//!
//! With a shared secret, a registration needs its proof
//! ([`kv_proto::bootstrap::PROOF_HEADER`]; else 403). Every answer is JSON;
//! errors are `{"detail": "..."}` as FastAPI writes them.
//!
//! What this file must never do: answer `/query` before every expected
//! worker registered; log a client's text unescaped (engine ids appear
//! escaped, addresses only once parsed, anything else not at all); log what
//! a client can provoke more than once per [`kv_net::LOG_INTERVAL`] per kind;
//! hold the registry's lock across an await.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kv_net::RefusalLog;
use kv_proto::auth::AuthSecret;
use kv_proto::bootstrap::{
    detail_json, verify_registration_proof, BootstrapRegistry, Expected, Missing, RegisterRefusal, Registration,
    PROOF_HEADER, REGISTERED_JSON,
};
use kv_proto::{HandshakePlace, HandshakePlaces};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{read_body, read_head, Head, HeadRead};

/// Bounds on the bootstrap server's connections; tests shorten them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootstrapLimits {
    /// Connections served at once; more are refused with a 503.
    pub max_connections: usize,
    /// Connections served at once from one host (every worker of a node
    /// registers from the same host; a refused one retries).
    pub max_connections_per_host: usize,
    /// Bound on a request's head (request line and headers).
    pub max_head_bytes: usize,
    /// Bound on a request's body.
    pub max_body_bytes: usize,
    /// Bound on a whole exchange, from accept to the answer's last byte.
    pub deadline: Duration,
    /// Bound on reading what a client sends after its answer.
    pub linger: Duration,
}

impl Default for BootstrapLimits {
    fn default() -> Self {
        Self {
            max_connections: kv_proto::DEFAULT_MAX_HANDSHAKES,
            max_connections_per_host: kv_proto::DEFAULT_MAX_HANDSHAKES_PER_HOST,
            max_head_bytes: 8 * 1024,
            max_body_bytes: kv_proto::bootstrap::MAX_REGISTRATION_BYTES,
            deadline: Duration::from_secs(10),
            linger: Duration::from_secs(1),
        }
    }
}

/// Bound on the bytes read (and dropped) while lingering.
const LINGER_BYTES: usize = 64 * 1024;

/// The server could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for bootstrap registrations and queries on {addr}: {error}")]
pub struct BootstrapServerError {
    /// The address asked for.
    pub addr: SocketAddr,
    /// Why (in the message, so not a `source`: one line either way).
    pub error: std::io::Error,
}

/// The registry shared by the server's connections and the local process.
#[derive(Clone, Debug)]
pub struct BootstrapHandle {
    registry: Arc<Mutex<BootstrapRegistry>>,
}

impl BootstrapHandle {
    fn new(expected: Expected) -> Self {
        Self { registry: Arc::new(Mutex::new(BootstrapRegistry::new(expected))) }
    }

    fn with<T>(&self, f: impl FnOnce(&mut BootstrapRegistry) -> T) -> T {
        // A panic elsewhere while holding it leaves a consistent registry (each change is one insert).
        f(&mut self.registry.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Registers a worker of this process without HTTP, decided as a
    /// registration over HTTP is (and logged alike).
    pub fn register(&self, reg: &Registration) -> Result<(), RegisterRefusal> {
        let (result, newly, complete) = self.with(|r| {
            let before = r.registered();
            let result = r.register(reg);
            (result, r.registered() > before, r.is_complete())
        });
        if newly {
            tracing::info!(
                engine_id = ?reg.engine_id.as_str(),
                dp_rank = reg.dp_rank,
                tp_rank = reg.tp_rank,
                pp_rank = reg.pp_rank,
                addr = %reg.addr,
                "prefill worker registered"
            );
            if complete {
                tracing::info!("every prefill worker registered; the bootstrap server answers queries");
            }
        }
        result
    }

    /// Whether every expected worker registered.
    pub fn is_complete(&self) -> bool {
        self.with(|r| r.is_complete())
    }

    /// What is still missing.
    pub fn missing(&self) -> Missing {
        self.with(|r| r.missing())
    }

    /// The `/query` reply, once complete.
    pub fn query_json(&self) -> Option<String> {
        self.with(|r| r.query_json())
    }
}

/// A bound bootstrap server, not yet serving.
#[derive(Debug)]
pub struct BootstrapServer {
    listener: TcpListener,
    local: SocketAddr,
    handle: BootstrapHandle,
    secret: Option<AuthSecret>,
    limits: BootstrapLimits,
}

impl BootstrapServer {
    /// Binds `addr` (port 0: any free port) for a registry waiting for
    /// `expected`; with `secret`, registrations must prove it.
    pub async fn bind(
        addr: SocketAddr,
        expected: Expected,
        secret: Option<AuthSecret>,
    ) -> Result<Self, BootstrapServerError> {
        let listener = TcpListener::bind(addr).await.map_err(|error| BootstrapServerError { addr, error })?;
        let local = listener.local_addr().map_err(|error| BootstrapServerError { addr, error })?;
        Ok(Self { listener, local, handle: BootstrapHandle::new(expected), secret, limits: BootstrapLimits::default() })
    }

    /// Serves under `limits` instead of the defaults.
    pub fn with_limits(mut self, limits: BootstrapLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Where clients connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The registry, for registering this process's own workers.
    pub fn handle(&self) -> BootstrapHandle {
        self.handle.clone()
    }

    /// Serves until `stop` is cancelled; then ends every open connection
    /// and returns.
    pub async fn serve(self, stop: CancellationToken) {
        let limits = self.limits.clone();
        let places = HandshakePlaces::new(limits.max_connections, limits.max_connections_per_host);
        let busy = answer(503, &detail_json("the bootstrap server is busy; try again"), &[("Retry-After", "1")]);
        let mut admission = kv_net::Admission::new(&self.listener, &places, "bootstrap").with_refusal(&busy);
        let shared = Arc::new(Shared {
            handle: self.handle,
            secret: self.secret,
            limits,
            client_faults: RefusalLog::new(),
            refused_registrations: RefusalLog::new(),
        });
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                (stream, peer, place) = admission.next() => {
                    connections.spawn(connection(stream, peer, place, shared.clone()));
                }
            }
        }
        connections.shutdown().await;
    }

    /// Serves on a task of its own until [`RunningBootstrap::stop`].
    pub fn spawn(self) -> RunningBootstrap {
        let stop = CancellationToken::new();
        let local = self.local;
        let handle = self.handle.clone();
        let task = tokio::spawn(self.serve(stop.clone()));
        RunningBootstrap { local, handle, stop, task }
    }
}

/// A bootstrap server serving on its own task.
#[derive(Debug)]
pub struct RunningBootstrap {
    local: SocketAddr,
    handle: BootstrapHandle,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl RunningBootstrap {
    /// Where clients connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The registry, for registering this process's own workers.
    pub fn handle(&self) -> BootstrapHandle {
        self.handle.clone()
    }

    /// Stops serving (open connections are ended) and waits for it.
    pub async fn stop(self) {
        self.stop.cancel();
        if let Err(error) = self.task.await {
            tracing::error!(%error, "the bootstrap server's task failed");
        }
    }
}

/// What every connection of one server shares.
#[derive(Debug)]
struct Shared {
    handle: BootstrapHandle,
    secret: Option<AuthSecret>,
    limits: BootstrapLimits,
    /// Malformed, oversized or slow requests (debug lines).
    client_faults: RefusalLog,
    /// Registrations refused (warn lines: a worker may be misconfigured).
    refused_registrations: RefusalLog,
}

impl Shared {
    /// A debug line about what a client did, at most one per interval.
    fn fault(&self, peer: &SocketAddr, what: &str) {
        if let Some(suppressed) = self.client_faults.allow(std::time::Instant::now()) {
            tracing::debug!(%peer, what, suppressed, "bootstrap client");
        }
    }
}

/// A whole answer: status line, headers, JSON body; the connection closes after it.
fn answer(status: u16, body: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        reason(status),
        body.len()
    );
    for (name, value) in extra {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(body);
    out.into_bytes()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Content Too Large",
        422 => "Unprocessable Entity",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

/// An error answer `{"detail": text}`.
fn refuse(status: u16, text: &str) -> Vec<u8> {
    answer(status, &detail_json(text), &[])
}

/// A request refused before it is served.
#[derive(Clone, Copy, Debug)]
struct Refused {
    status: u16,
    why: &'static str,
    /// The methods a 405's path takes.
    allow: Option<&'static str>,
}

impl Refused {
    const fn new(status: u16, why: &'static str) -> Self {
        Self { status, why, allow: None }
    }

    fn answer(&self) -> Vec<u8> {
        let extra: &[(&str, &str)] = match self.allow {
            Some(methods) => &[("Allow", methods)],
            None => &[],
        };
        answer(self.status, &detail_json(self.why), extra)
    }
}

/// What a client asked for, once its request was read whole.
enum Request {
    Register { body: Vec<u8>, proof: Option<String> },
    Query,
    Health,
}

/// One connection, holding its place until it is closed.
async fn connection(mut stream: TcpStream, peer: SocketAddr, _place: HandshakePlace, shared: Arc<Shared>) {
    let deadline = Instant::now() + shared.limits.deadline;
    let answer = match tokio::time::timeout_at(deadline, read_request(&mut stream, &shared.limits)).await {
        Err(_) => {
            shared.fault(&peer, "no whole request within the deadline");
            // Best effort, never waiting: the deadline is spent.
            let _ = stream.try_write(&refuse(408, "no whole request within the deadline"));
            return;
        }
        Ok(Err(error)) => {
            shared.fault(&peer, &error.to_string());
            return;
        }
        Ok(Ok(None)) => return,
        Ok(Ok(Some(Err(refused)))) => {
            shared.fault(&peer, refused.why);
            refused.answer()
        }
        Ok(Ok(Some(Ok(request)))) => respond(request, peer, &shared),
    };
    let written = tokio::time::timeout_at(deadline, async {
        stream.write_all(&answer).await?;
        stream.shutdown().await
    })
    .await;
    match written {
        Ok(Ok(())) => {
            let _ = tokio::time::timeout(shared.limits.linger, kv_net::http::linger(&mut stream, LINGER_BYTES)).await;
        }
        Ok(Err(error)) => shared.fault(&peer, &error.to_string()),
        Err(_) => shared.fault(&peer, "the answer was not taken within the deadline"),
    }
}

/// Reads one request: `None` when the client closed before a whole head,
/// `Some(Err)` for a request refused before it is served (status and why).
async fn read_request(
    stream: &mut TcpStream,
    limits: &BootstrapLimits,
) -> std::io::Result<Option<Result<Request, Refused>>> {
    let (buf, end) = match read_head(stream, limits.max_head_bytes).await? {
        HeadRead::Whole { buf, end } => (buf, end),
        HeadRead::TooLarge => return Ok(Some(Err(Refused::new(431, "the request head is too large")))),
        HeadRead::Closed { .. } => return Ok(None),
    };
    let head = match Head::parse(&buf[..end]) {
        Ok(head) => head,
        Err(why) => return Ok(Some(Err(Refused::new(400, why)))),
    };
    let mut parts = head.first.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Ok(Some(Err(Refused::new(400, "the request line is not METHOD TARGET HTTP/1.x"))));
    };
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1")
        || method.is_empty()
        || !method.bytes().all(|b| b.is_ascii_uppercase())
    {
        return Ok(Some(Err(Refused::new(400, "the request line is not METHOD TARGET HTTP/1.x"))));
    }
    let path = target.split_once('?').map_or(target, |(path, _)| path);
    let wanted = match (path, method) {
        ("/register", "POST") => None,
        ("/query", "GET") => return Ok(Some(Ok(Request::Query))),
        ("/health", "GET") => return Ok(Some(Ok(Request::Health))),
        ("/register", _) => Some(Refused { status: 405, why: "Method Not Allowed", allow: Some("POST") }),
        ("/query" | "/health", _) => Some(Refused { status: 405, why: "Method Not Allowed", allow: Some("GET") }),
        _ => Some(Refused::new(404, "Not Found")),
    };
    if let Some(refused) = wanted {
        return Ok(Some(Err(refused)));
    }
    if head.has_transfer_encoding() {
        return Ok(Some(Err(Refused::new(411, "a registration needs a Content-Length body (no transfer coding)"))));
    }
    let length = match head.content_length() {
        Ok(Some(length)) => length,
        Ok(None) => return Ok(Some(Err(Refused::new(411, "a registration needs a Content-Length body")))),
        Err(why) => return Ok(Some(Err(Refused::new(400, why)))),
    };
    let Some(length) = usize::try_from(length).ok().filter(|&l| l <= limits.max_body_bytes) else {
        return Ok(Some(Err(Refused::new(413, "the registration body is too large"))));
    };
    let proof = match head.header(PROOF_HEADER) {
        Ok(proof) => proof.map(str::to_owned),
        Err(why) => return Ok(Some(Err(Refused::new(400, why)))),
    };
    if head.header("expect").ok().flatten().is_some_and(|v| v.eq_ignore_ascii_case("100-continue")) {
        stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").await?;
    }
    let body = read_body(stream, &buf[end..], length).await?;
    Ok(Some(Ok(Request::Register { body, proof })))
}

/// The answer to a request read whole.
fn respond(request: Request, peer: SocketAddr, shared: &Shared) -> Vec<u8> {
    match request {
        Request::Query => match shared.handle.query_json() {
            Some(json) => answer(200, &json, &[]),
            None => not_ready(&shared.handle.missing()),
        },
        Request::Health => {
            if shared.handle.is_complete() {
                answer(200, REGISTERED_JSON, &[])
            } else {
                not_ready(&shared.handle.missing())
            }
        }
        Request::Register { body, proof } => register(&body, proof.as_deref(), peer, shared),
    }
}

/// 503 while workers are missing (routers retry it; they would keep an
/// incomplete 200 for good).
fn not_ready(missing: &Missing) -> Vec<u8> {
    let text = format!("the bootstrap registry is not complete: {missing}");
    answer(503, &detail_json(&text), &[("Retry-After", "1")])
}

fn register(body: &[u8], proof: Option<&str>, peer: SocketAddr, shared: &Shared) -> Vec<u8> {
    if let Some(secret) = &shared.secret {
        let refused = match proof {
            None => Some("this deployment has a shared secret: a registration must carry its proof (X-Kvlink-Proof)"),
            Some(proof) if !verify_registration_proof(secret, body, proof) => {
                Some("the registration's proof (X-Kvlink-Proof) is wrong")
            }
            Some(_) => None,
        };
        if let Some(text) = refused {
            if let Some(suppressed) = shared.refused_registrations.allow(std::time::Instant::now()) {
                tracing::warn!(%peer, suppressed, "bootstrap registration refused: its proof is missing or wrong");
            }
            return refuse(403, text);
        }
    }
    let reg = match Registration::parse(body) {
        Ok(reg) => reg,
        Err(error) => {
            // The error describes the client's text by type or escaped.
            shared.fault(&peer, &error.to_string());
            return refuse(422, &error.to_string());
        }
    };
    match shared.handle.register(&reg) {
        Ok(()) => answer(200, REGISTERED_JSON, &[]),
        Err(refusal) => {
            if let Some(suppressed) = shared.refused_registrations.allow(std::time::Instant::now()) {
                // The refusal's text shows the client's engine ids escaped.
                tracing::warn!(%peer, reason = %refusal, suppressed, "bootstrap registration refused");
            }
            refuse(400, &refusal.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn answers_say_their_length_and_close() {
        let a = String::from_utf8(answer(503, r#"{"detail":"x"}"#, &[("Retry-After", "1")])).unwrap();
        assert!(a.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{a}");
        assert!(a.contains("Content-Length: 14\r\n") && a.contains("Connection: close\r\n"), "{a}");
        assert!(a.contains("Retry-After: 1\r\n") && a.ends_with("\r\n\r\n{\"detail\":\"x\"}"), "{a}");
    }
}
