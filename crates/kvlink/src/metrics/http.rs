//! The metrics endpoint: one listener answering `GET /metrics` with the
//! hub's workers (see [`super::exposition`]), bounded like every listener
//! of the project:
//!
//! - a connection first takes a place ([`kv_net::Admission`]: at most
//!   [`MAX_CONNECTIONS`] at once, [`MAX_CONNECTIONS_PER_HOST`] from one
//!   host); past that it gets a 503 in one write that never waits and is
//!   closed;
//! - one request per connection, its head at most [`MAX_REQUEST_BYTES`]
//!   (else a 431), and the whole exchange within [`CONNECTION_DEADLINE`]
//!   from accept (a client that dribbles or does not read is cut there);
//! - after the answer, what the client still sends is read and dropped for
//!   at most [`LINGER`] (so closing does not reset the answer away), then
//!   the connection is closed;
//! - what a client can provoke is logged at debug level through one
//!   [`kv_net::RefusalLog`], at most one line per [`kv_net::LOG_INTERVAL`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kv_net::RefusalLog;
use kv_proto::{HandshakePlace, HandshakePlaces};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::exposition::{Exposition, CONTENT_TYPE};
use super::hub::MetricsHub;
use super::request::{self, Request};

/// Connections served at once; more are refused.
pub const MAX_CONNECTIONS: usize = 16;
/// Connections served at once from one host (a scraper and an operator's
/// curl fit; one host cannot take every place).
pub const MAX_CONNECTIONS_PER_HOST: usize = 8;
/// Bound on a request's head (request line and headers).
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// Bound on a whole exchange, from accept to the last byte of the answer.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(10);
/// Bound on reading what a client sends after its answer.
pub const LINGER: Duration = Duration::from_secs(1);
/// Bound on the bytes read (and dropped) while lingering.
const LINGER_BYTES: usize = 64 * 1024;

/// The endpoint could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for metrics scrapes on {addr}: {error}")]
pub struct EndpointError {
    /// The address asked for.
    pub addr: SocketAddr,
    /// Why (in the message, so not a `source`: one line either way).
    pub error: std::io::Error,
}

/// A bound metrics listener, not yet serving.
#[derive(Debug)]
pub struct MetricsEndpoint {
    listener: TcpListener,
    local: SocketAddr,
}

impl MetricsEndpoint {
    /// Binds `addr` (port 0: any free port).
    pub async fn bind(addr: SocketAddr) -> Result<Self, EndpointError> {
        let listener = TcpListener::bind(addr).await.map_err(|error| EndpointError { addr, error })?;
        let local = listener.local_addr().map_err(|error| EndpointError { addr, error })?;
        Ok(Self { listener, local })
    }

    /// Where scrapers connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Answers scrapes with `hub`'s workers until `stop` is cancelled; then
    /// ends every open connection and returns.
    pub async fn serve(self, hub: MetricsHub, stop: CancellationToken) {
        let places = HandshakePlaces::new(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_HOST);
        let mut admission = kv_net::Admission::new(&self.listener, &places, "metrics").with_refusal(request::BUSY);
        let exposition = Arc::new(Exposition::new(hub));
        let log = Arc::new(RefusalLog::new());
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                (stream, peer, place) = admission.next() => {
                    connections.spawn(connection(stream, peer, place, exposition.clone(), log.clone()));
                }
            }
        }
        connections.shutdown().await;
    }

    /// Serves `hub` on a task of its own until [`RunningEndpoint::stop`].
    pub fn spawn(self, hub: MetricsHub) -> RunningEndpoint {
        let stop = CancellationToken::new();
        let local = self.local;
        let task = tokio::spawn(self.serve(hub, stop.clone()));
        RunningEndpoint { local, stop, task }
    }
}

/// A metrics endpoint serving on its own task.
#[derive(Debug)]
pub struct RunningEndpoint {
    local: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl RunningEndpoint {
    /// Where scrapers connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Stops serving (open connections are ended) and waits for it.
    pub async fn stop(self) {
        self.stop.cancel();
        if let Err(error) = self.task.await {
            tracing::error!(%error, "the metrics endpoint's task failed");
        }
    }
}

/// One connection, holding its place until it is closed.
async fn connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    _place: HandshakePlace,
    exposition: Arc<Exposition>,
    log: Arc<RefusalLog>,
) {
    let deadline = Instant::now() + CONNECTION_DEADLINE;
    let outcome = match tokio::time::timeout_at(deadline, exchange(&mut stream, &exposition)).await {
        Ok(Ok(Some(status))) => {
            tracing::trace!(%peer, status, "metrics scrape answered");
            if !status.starts_with("200") {
                note(&log, &peer, status);
            }
            true
        }
        Ok(Ok(None)) => false,
        Ok(Err(error)) => {
            note(&log, &peer, &error.to_string());
            false
        }
        Err(_) => {
            note(&log, &peer, "no whole request and answer within the deadline");
            false
        }
    };
    if outcome {
        let _ = tokio::time::timeout(LINGER, kv_net::http::linger(&mut stream, LINGER_BYTES)).await;
    }
}

/// A debug line about what a client did, at most one per interval.
fn note(log: &RefusalLog, peer: &SocketAddr, what: &str) {
    if let Some(suppressed) = log.allow(std::time::Instant::now()) {
        tracing::debug!(%peer, what, suppressed, "metrics client");
    }
}

/// Reads one request head and answers it; the status sent, or `None` when
/// the client closed before a whole head.
async fn exchange(stream: &mut TcpStream, exposition: &Exposition) -> std::io::Result<Option<&'static str>> {
    let mut buf = vec![0u8; MAX_REQUEST_BYTES];
    let mut len = 0;
    let head = loop {
        if len == buf.len() {
            break None;
        }
        let n = stream.read(&mut buf[len..]).await?;
        if n == 0 {
            return Ok(None);
        }
        let scanned = len;
        len += n;
        if let Some(end) = kv_net::http::head_end(&buf[..len], scanned) {
            break Some(end);
        }
    };
    let (status, answer) = match head.map(|end| request::parse(&buf[..end])) {
        None => ("431 Request Header Fields Too Large", None),
        Some(Request::Malformed) => ("400 Bad Request", None),
        Some(Request::MethodNotAllowed) => ("405 Method Not Allowed", None),
        Some(Request::NotFound) => ("404 Not Found", None),
        Some(Request::Metrics { head }) => match exposition.render() {
            Ok(text) => ("200 OK", Some(request::response("200 OK", CONTENT_TYPE, text.as_bytes(), head))),
            Err(error) => {
                tracing::error!(%error, "metrics scrape");
                ("500 Internal Server Error", None)
            }
        },
    };
    let answer = answer.unwrap_or_else(|| request::error(status));
    stream.write_all(&answer).await?;
    stream.shutdown().await?;
    Ok(Some(status))
}
