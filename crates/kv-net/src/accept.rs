//! Admitting connections on a listener: every connection first gets a
//! handshake place ([`HandshakePlaces`]: bounded in total and per source
//! host) or is closed at once; what peers can provoke (refusals, accept
//! errors) is logged through a [`RefusalLog`] each, at most once per
//! [`crate::LOG_INTERVAL`] with the count left out; an accept error (out of
//! descriptors and the like) backs off for [`ACCEPT_BACKOFF`] instead of
//! spinning. One copy for every listener: the TCP data plane, RDMA's control
//! port, the side channel, the bench's control port, the metrics endpoint.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kv_proto::{HandshakePlace, HandshakePlaces};
use tokio::net::{TcpListener, TcpStream};

use crate::RefusalLog;

/// How long the listener waits after a failed accept: long enough for
/// closing connections to give descriptors back, short enough that a new
/// connection barely notices.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// One listener's admission of new connections.
#[derive(Debug)]
pub struct Admission<'a> {
    listener: &'a TcpListener,
    places: &'a HandshakePlaces,
    /// Names the listener in log lines.
    name: &'static str,
    /// Written (best effort, never waiting) to a connection refused for
    /// want of a handshake place, before it is closed.
    refusal: &'a [u8],
    refusals: RefusalLog,
    accept_errors: RefusalLog,
}

impl<'a> Admission<'a> {
    /// Admits connections of `listener` into `places`; `name` names the
    /// listener in log lines.
    pub fn new(listener: &'a TcpListener, places: &'a HandshakePlaces, name: &'static str) -> Self {
        Self { listener, places, name, refusal: &[], refusals: RefusalLog::new(), accept_errors: RefusalLog::new() }
    }

    /// Tells each connection refused a handshake place why, with `reply`.
    pub fn with_refusal(mut self, reply: &'a [u8]) -> Self {
        self.refusal = reply;
        self
    }

    /// The next connection that got a handshake place. Refused connections
    /// and accept errors are handled here and never returned. Cancel-safe:
    /// the caller selects it against its shutdown.
    pub async fn next(&mut self) -> (TcpStream, SocketAddr, HandshakePlace) {
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => match self.places.enter(peer.ip()) {
                    Ok(place) => return (stream, peer, place),
                    Err(no_place) => {
                        if !self.refusal.is_empty() {
                            let _ = stream.try_write(self.refusal);
                        }
                        if let Some(suppressed) = self.refusals.allow(Instant::now()) {
                            tracing::warn!(listener = self.name, %peer, reason = %no_place, suppressed,
                                "handshake limit reached, closing new connections");
                        }
                    }
                },
                Err(error) => {
                    if let Some(suppressed) = self.accept_errors.allow(Instant::now()) {
                        tracing::warn!(listener = self.name, %error, suppressed, "accept failed");
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }
}
