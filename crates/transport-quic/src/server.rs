//! The receiving side: the accept loop, one task per incoming connection
//! (handshake and hello, then its streams), and one task per incoming
//! stream (one batch each).
//!
//! A batch is refused whole, before any of its payload is read, if the grant
//! its header names is not live (never issued, revoked, expired) or if any
//! op lies outside that grant; a batch whose grant is revoked mid-payload is
//! stopped, and nothing of it lands after the revocation returned. Every
//! refusal is logged with the peer's address and the grant's short form and
//! answered with a `Refused` verdict.
//!
//! A bad stream (truncated, over the op limit, lengths that do not add up,
//! more payload than announced, stalled past `io_timeout`) is answered with
//! a protocol-error reply where the peer can still read it, stopped, and
//! logged; the connection and its other streams go on. A failed handshake or
//! hello, or a connection that breaks the QUIC protocol, costs only that
//! connection.
//!
//! Admission: an incoming connection holds a handshake place (bounded in
//! total and per source address) from accept until its hello ends, all of
//! it within one deadline (`limits.handshake_timeout`), and takes an established
//! place only once its hello (and proof) succeeded; past `max_connections`
//! it is closed with `CLOSE_BUSY` and the reason. quinn's endpoint has no
//! accept errors to back off from (a failed incoming connection is that
//! connection's alone); after the hello, QUIC's idle timeout ends a
//! connection that carries nothing.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kv_proto::dataplane::{put_verdict, Cursor, ReplyStatus};
use kv_proto::receive::{BatchReceiver, Fault, Framing, PayloadEnd, Refusal, Step};
use kv_proto::{GrantId, HandshakePlace};
use quinn::{ConnectionError, Incoming, RecvStream, SendStream, VarInt};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{debug, trace, warn};

use crate::hello;
use crate::memory::Destinations;
use crate::transport::Shared;
use crate::wire::{BatchHeader, ALPN, CLOSE_BAD_ALPN, CLOSE_SHUTDOWN, STOP_PROTOCOL, STOP_REFUSED};
use kv_net::{carry_out, write_all, Carried, PeerLog, WireError};

/// Received chunks taken from quinn per read (and copied under one hold of
/// the grant).
const CHUNKS_PER_READ: usize = 32;

/// Why a stream's batch failed.
#[derive(Debug, thiserror::Error)]
enum StreamError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("batch announces {count} ops, more than the limit of {max}")]
    TooManyOps { count: u64, max: u64 },
    #[error("op lengths add up to {}, the header says {declared}",
        .sum.map_or_else(|| "more than u64::MAX".to_owned(), |s| s.to_string()))]
    LengthMismatch { declared: u64, sum: Option<u64> },
    #[error("op list not received within {after:?}")]
    OpListTimeout { after: std::time::Duration },
    #[error("more payload than the {total} bytes the header announces")]
    ExtraPayload { total: u64 },
    /// Not `Wire`: a reply that cannot be written is no reason to try
    /// writing another (see `is_peer_fault`).
    #[error(transparent)]
    Reply(WireError),
    /// Any other fault of the batch-receive machine.
    #[error(transparent)]
    Fault(Fault),
    #[error("the transport is shut down")]
    Closed,
}

impl StreamError {
    /// Whether the peer broke the protocol on a stream it may still read: it
    /// then gets a protocol-error reply.
    fn is_peer_fault(&self) -> bool {
        matches!(
            self,
            StreamError::Wire(WireError::Eof { .. } | WireError::Timeout { .. })
                | StreamError::TooManyOps { .. }
                | StreamError::LengthMismatch { .. }
                | StreamError::OpListTimeout { .. }
                | StreamError::ExtraPayload { .. }
                | StreamError::Fault(_)
        )
    }
}

/// Names this listener in kv-net's log lines.
const LISTENER: &str = "quic data plane";

/// Accepts connections until the transport's token is cancelled or the
/// endpoint is closed.
pub(crate) async fn accept_loop(shared: Arc<Shared>) {
    let endpoint = shared.endpoint.clone();
    loop {
        let incoming = tokio::select! {
            biased;
            () = shared.token.cancelled() => break,
            incoming = endpoint.accept() => match incoming {
                Some(incoming) => incoming,
                None => break,
            },
        };
        let peer = incoming.remote_address();
        // Once half the handshake places are taken, a source address must
        // prove it is real before it may take one (a QUIC retry costs it a
        // round trip): a flood from forged addresses cannot fill them.
        let pressed = shared.listener.handshakes.taken().saturating_mul(2) >= shared.listener.handshakes.limit();
        if pressed && !incoming.remote_address_validated() && incoming.may_retry() {
            shared.retried.fetch_add(1, Ordering::Relaxed);
            if let Err(error) = incoming.retry() {
                error.into_incoming().ignore();
            }
            continue;
        }
        let place = match shared.listener.handshakes.enter(peer.ip()) {
            Ok(place) => place,
            Err(no_place) => {
                let allowed = shared.listener.log_allowed(PeerLog::Busy);
                if let Some(suppressed) = allowed {
                    warn!(%peer, reason = %no_place, suppressed, "handshake limit reached, refusing");
                }
                incoming.refuse();
                continue;
            }
        };
        let task_shared = Arc::clone(&shared);
        shared.tracker.spawn(async move { serve_connection(&task_shared, incoming, peer, place).await });
    }
    debug!(local_addr = ?endpoint.local_addr().ok(), "data-plane listener stopped");
}

/// Handshake, ALPN and hello of an incoming connection, within one
/// deadline; then its established place (the handshake place is given back
/// either way).
async fn establish(
    shared: &Shared,
    incoming: Incoming,
    peer: SocketAddr,
    place: HandshakePlace,
) -> Option<(quinn::Connection, OwnedSemaphorePermit)> {
    let established = establish_within_deadline(shared, incoming, peer).await;
    drop(place);
    established
}

/// An established place, or why there is none (rate-limited log line).
fn established_place(shared: &Shared, peer: SocketAddr) -> Result<OwnedSemaphorePermit, String> {
    shared.listener.established.take(LISTENER, peer).ok_or_else(|| {
        "the receiver serves its maximum of data-plane connections (QuicConfig::limits.max_connections) already"
            .to_owned()
    })
}

async fn establish_within_deadline(
    shared: &Shared,
    incoming: Incoming,
    peer: SocketAddr,
) -> Option<(quinn::Connection, OwnedSemaphorePermit)> {
    let connecting = match incoming.accept() {
        Ok(connecting) => connecting,
        Err(error) => {
            debug!(%peer, %error, "incoming connection failed");
            return None;
        }
    };
    let after = shared.config.limits.handshake_timeout;
    let deadline = tokio::time::Instant::now() + after;
    let handshake = tokio::select! {
        biased;
        () = shared.token.cancelled() => return None,
        handshake = tokio::time::timeout_at(deadline, connecting) => handshake,
    };
    let conn = match handshake {
        Err(_) => {
            if let Some(suppressed) = shared.listener.log_allowed(PeerLog::Fault) {
                warn!(%peer, ?after, suppressed, "data-plane handshake timed out");
            }
            return None;
        }
        Ok(Err(error)) => {
            if let Some(suppressed) = shared.listener.log_allowed(PeerLog::Fault) {
                warn!(%peer, %error, suppressed, "data-plane handshake failed");
            }
            return None;
        }
        Ok(Ok(conn)) => conn,
    };
    let alpn = conn
        .handshake_data()
        .and_then(|data| data.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|data| data.protocol);
    if alpn.as_deref() != Some(ALPN) {
        if let Some(suppressed) = shared.listener.log_allowed(PeerLog::Fault) {
            warn!(%peer, ?alpn, suppressed, "peer did not negotiate the data-plane ALPN, closing");
        }
        conn.close(VarInt::from_u32(CLOSE_BAD_ALPN), b"ALPN kvlink-data/2 required");
        return None;
    }
    let greeted = tokio::select! {
        biased;
        () = shared.token.cancelled() => return None,
        greeted = tokio::time::timeout_at(
            deadline,
            hello::server(&conn, shared.config.auth_secret.as_ref(), || established_place(shared, peer)),
        ) => greeted,
    };
    match greeted {
        Err(_) => {
            if let Some(suppressed) = shared.listener.log_allowed(PeerLog::Fault) {
                warn!(%peer, ?after, suppressed, "data-plane hello timed out, closing");
            }
            conn.close(VarInt::from_u32(crate::wire::CLOSE_AUTH), b"hello timed out");
            None
        }
        // Logged (rate-limited) where it was refused.
        Ok(Err(hello::HelloFailure::Busy(_))) => None,
        Ok(Err(error)) => {
            if matches!(error, hello::HelloFailure::BadProof) {
                // A wrong proof, not a peer gone mid-hello (`Truncated`,
                // `Connection`, `Refused`).
                shared.memory.counters().auth_failed();
            }
            if let Some(suppressed) = shared.listener.log_allowed(PeerLog::Fault) {
                warn!(%peer, %error, suppressed, "data-plane hello failed, closing");
            }
            if conn.close_reason().is_none() {
                conn.close(VarInt::from_u32(crate::wire::CLOSE_AUTH), b"hello failed");
            }
            None
        }
        Ok(Ok(permit)) => Some((conn, permit)),
    }
}

async fn serve_connection(shared: &Arc<Shared>, incoming: Incoming, peer: SocketAddr, place: HandshakePlace) {
    let Some((conn, _established)) = establish(shared, incoming, peer, place).await else { return };
    // Proven: the full window and stream limit (see `PRE_HELLO_RECEIVE_WINDOW`).
    conn.set_receive_window(VarInt::from_u32(shared.config.receive_window));
    conn.set_max_concurrent_bi_streams(VarInt::from_u32(shared.config.max_concurrent_streams));
    shared.accepted.fetch_add(1, Ordering::Relaxed);
    debug!(%peer, authenticated = shared.config.auth_secret.is_some(), "data-plane connection accepted");
    loop {
        let accepted = tokio::select! {
            biased;
            () = shared.token.cancelled() => break,
            accepted = conn.accept_bi() => accepted,
        };
        match accepted {
            Ok((send, recv)) => {
                let task_shared = Arc::clone(shared);
                shared.tracker.spawn(async move { serve_stream(&task_shared, peer, send, recv).await });
            }
            Err(ConnectionError::ApplicationClosed(close)) => {
                debug!(%peer, %close, "data-plane connection closed by peer");
                break;
            }
            Err(ConnectionError::TimedOut) => {
                debug!(%peer, "data-plane connection idle, closed");
                break;
            }
            Err(ConnectionError::LocallyClosed) => break,
            Err(error) => {
                if let Some(suppressed) = shared.listener.log_allowed(PeerLog::Fault) {
                    warn!(%peer, %error, suppressed, "data-plane connection lost");
                }
                break;
            }
        }
    }
}

async fn serve_stream(shared: &Shared, peer: SocketAddr, send: SendStream, recv: RecvStream) {
    let mut batch = Batch { shared, peer, send, recv };
    let outcome = tokio::select! {
        biased;
        () = shared.token.cancelled() => Err(StreamError::Closed),
        outcome = batch.serve() => outcome,
    };
    let stream = batch.recv.id();
    match outcome {
        Ok(()) => trace!(%peer, %stream, "batch served"),
        Err(StreamError::Closed) => {
            // Best effort: the endpoint is closing anyway.
            let _ = batch.recv.stop(VarInt::from_u32(CLOSE_SHUTDOWN));
            let _ = batch.send.reset(VarInt::from_u32(CLOSE_SHUTDOWN));
            debug!(%peer, %stream, "batch abandoned: shutting down");
        }
        Err(error) if error.is_peer_fault() => {
            if let Some(suppressed) = shared.listener.log_allowed(PeerLog::Fault) {
                warn!(%peer, %stream, %error, suppressed, "protocol error on data-plane stream");
            }
            let _ = batch.recv.stop(VarInt::from_u32(STOP_PROTOCOL));
            let reason = error.to_string();
            let replied = tokio::select! {
                biased;
                () = shared.token.cancelled() => Err(StreamError::Closed),
                replied = batch.reply(ReplyStatus::ProtocolError, &reason) => replied,
            };
            if let Err(reply_error) = replied {
                debug!(%peer, %stream, error = %reply_error, "cannot report the protocol error to the peer");
            }
        }
        Err(error) => {
            if let Some(suppressed) = shared.listener.log_allowed(PeerLog::Fault) {
                warn!(%peer, %stream, %error, suppressed, "data-plane batch failed");
            }
        }
    }
}

/// One incoming batch on its stream.
struct Batch<'s> {
    shared: &'s Shared,
    peer: SocketAddr,
    send: SendStream,
    recv: RecvStream,
}

impl Batch<'_> {
    async fn serve(&mut self) -> Result<(), StreamError> {
        let shared = self.shared;
        let config = &shared.config;
        let io_timeout = config.io_timeout;
        let limits = config.op_lists.receive_limits(config.auth_secret.is_some());
        let mut rx = BatchReceiver::new(&shared.memory, limits, Framing::StreamPerBatch, BatchHeader::decode);
        // The batch's share of the op-list budget.
        let mut share = shared.listener.op_lists.share();
        loop {
            let header = rx.header().copied();
            let carried = carry_out(rx.next_step(), &mut self.recv, &mut share, io_timeout).await?;
            let step = match carried {
                Carried::Other(step) => step,
                Carried::NoRoom(no_room) => {
                    rx.no_room(no_room);
                    continue;
                }
                Carried::Late => {
                    rx.deadline_passed();
                    continue;
                }
                Carried::Done => {
                    rx.advance(Instant::now());
                    continue;
                }
            };
            match step {
                // Carried out above; a stream carries one batch: nothing to
                // wait for, or to drop.
                Step::Read { .. } | Step::Charge { .. } | Step::AwaitBatch | Step::Discard { .. } => {}
                Step::Refused { refusal, reason } => self.log_refusal(header.as_ref(), refusal, reason),
                // The rest of a refused batch is never read.
                Step::Stop => {
                    let _ = self.recv.stop(VarInt::from_u32(STOP_REFUSED));
                }
                Step::Payload { batch, tag: _ } => {
                    let end = self.receive_payload(&Destinations::new(batch)).await?;
                    rx.payload_end(end);
                    continue;
                }
                // The op list is done with: its memory goes back before the verdict.
                Step::Release => share.release(),
                Step::Reply { status, reason } => {
                    let mut bytes = Vec::new();
                    put_verdict(&mut bytes, status, reason);
                    self.reply_bytes(&bytes).await?;
                }
                Step::Done => return Ok(()),
                Step::Fail(fault) => {
                    return Err(match fault {
                        Fault::TooManyOps { count, max } => StreamError::TooManyOps { count, max },
                        Fault::OpListTimeout { after } => StreamError::OpListTimeout { after },
                        Fault::LengthMismatch { declared, sum } => StreamError::LengthMismatch { declared, sum },
                        Fault::Closed => StreamError::Closed,
                        other => StreamError::Fault(other),
                    })
                }
            }
            rx.advance(Instant::now());
        }
    }

    /// Logs a refused batch (at most one line a second per kind, for all
    /// streams).
    fn log_refusal(&self, header: Option<&BatchHeader>, refusal: &Refusal, reason: &str) {
        let shared = self.shared;
        let (peer, stream) = (self.peer, self.recv.id());
        let (grant, ops) = header.map_or((GrantId::from_bytes([0; 16]), 0), |h| (h.grant, h.op_count));
        match refusal {
            Refusal::NoRoom(no_room) => {
                let allowed = shared.listener.log_allowed(PeerLog::Budget);
                if let Some(suppressed) = allowed {
                    warn!(%peer, %grant, %stream, ops, budget = shared.listener.op_lists.limit(), ?no_room, suppressed,
                        "refusing batch: no room for its op list");
                }
            }
            Refusal::Grant(_) | Refusal::Revoked { .. } => {
                if let Some(suppressed) = shared.listener.log_allowed(PeerLog::Batch) {
                    warn!(%peer, %grant, %stream, %reason, suppressed, "refusing batch");
                }
            }
        }
    }

    /// Copies the payload, chunk by chunk as quinn hands it over, straight
    /// into the admitted destinations while the grant is live.
    async fn receive_payload(&mut self, destinations: &Destinations<'_>) -> Result<PayloadEnd, StreamError> {
        let io_timeout = self.shared.config.io_timeout;
        let total = destinations.total();
        let mut cursor = Cursor::new(total);
        let mut chunks: [Bytes; CHUNKS_PER_READ] = std::array::from_fn(|_| Bytes::new());
        while !cursor.is_done() {
            let got = match tokio::time::timeout(io_timeout, self.recv.read_chunks(&mut chunks)).await {
                Err(_) => return Err(WireError::Timeout { what: "payload", after: io_timeout }.into()),
                Ok(Err(source)) => return Err(WireError::Io { what: "payload", source: source.into() }.into()),
                Ok(Ok(None)) => {
                    return Err(WireError::Eof { what: "payload", partial: cursor.remaining() < total }.into())
                }
                Ok(Ok(Some(got))) => got,
            };
            let received = chunks.get(..got).unwrap_or_default();
            let scattered = destinations.scatter(&mut cursor, received);
            chunks.iter_mut().take(got).for_each(|c| *c = Bytes::new());
            let Ok(scattered) = scattered else { return Ok(PayloadEnd::Revoked { remaining: cursor.remaining() }) };
            self.shared.bytes_received.fetch_add(scattered.copied, Ordering::Relaxed);
            if scattered.extra > 0 {
                return Err(StreamError::ExtraPayload { total });
            }
        }
        // The stream must end with the payload (the FIN usually rides on the
        // last payload packet).
        match tokio::time::timeout(io_timeout, self.recv.read_chunk(1, true)).await {
            Err(_) => Err(WireError::Timeout { what: "end of stream", after: io_timeout }.into()),
            Ok(Err(source)) => Err(WireError::Io { what: "end of stream", source: source.into() }.into()),
            Ok(Ok(Some(_))) => Err(StreamError::ExtraPayload { total }),
            Ok(Ok(None)) => Ok(PayloadEnd::Complete),
        }
    }

    async fn reply(&mut self, status: ReplyStatus, reason: &str) -> Result<(), StreamError> {
        let mut bytes = Vec::new();
        put_verdict(&mut bytes, status, reason);
        self.reply_bytes(&bytes).await
    }

    async fn reply_bytes(&mut self, bytes: &[u8]) -> Result<(), StreamError> {
        let io_timeout = self.shared.config.io_timeout;
        write_all(&mut self.send, bytes, io_timeout, "reply").await.map_err(StreamError::Reply)?;
        // Finishing fails only if the stream was already reset; the reply
        // is then undeliverable anyway.
        let _ = self.send.finish();
        Ok(())
    }
}
