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
//! it within one deadline (`connect_timeout`), and takes an established
//! place only once its hello (and proof) succeeded; past `max_connections`
//! it is closed with `CLOSE_BUSY` and the reason. quinn's endpoint has no
//! accept errors to back off from (a failed incoming connection is that
//! connection's alone); after the hello, QUIC's idle timeout ends a
//! connection that carries nothing.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use bytes::Bytes;
use kv_proto::dataplane::{put_verdict, Cursor, OpListBuffer, ReplyStatus};
use kv_proto::{BatchRefusal, DestinationError, GrantId, HandshakePlace};
use quinn::{ConnectionError, Incoming, RecvStream, SendStream, VarInt};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{debug, trace, warn};

use crate::hello;
use crate::memory::Destinations;
use crate::transport::Shared;
use crate::wire::{BatchHeader, ALPN, BATCH_HEADER_LEN, CLOSE_BAD_ALPN, CLOSE_SHUTDOWN, STOP_PROTOCOL, STOP_REFUSED};
use kv_net::{read_exact, write_all, NoRoom, WireError};

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
        )
    }
}

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
        let pressed = shared.handshakes.taken().saturating_mul(2) >= shared.handshakes.limit();
        if pressed && !incoming.remote_address_validated() && incoming.may_retry() {
            shared.retried.fetch_add(1, Ordering::Relaxed);
            if let Err(error) = incoming.retry() {
                error.into_incoming().ignore();
            }
            continue;
        }
        let place = match shared.handshakes.enter(peer.ip()) {
            Ok(place) => place,
            Err(no_place) => {
                let allowed = shared.over_limit.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now());
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
    Arc::clone(&shared.conn_limit).try_acquire_owned().map_err(|_| {
        let allowed = shared.over_limit.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now());
        if let Some(suppressed) = allowed {
            warn!(%peer, limit = shared.config.limits.max_connections, suppressed,
                "connection limit reached, refusing a peer that finished its hello");
        }
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
    let after = shared.config.connect_timeout;
    let deadline = tokio::time::Instant::now() + after;
    let handshake = tokio::select! {
        biased;
        () = shared.token.cancelled() => return None,
        handshake = tokio::time::timeout_at(deadline, connecting) => handshake,
    };
    let conn = match handshake {
        Err(_) => {
            if let Some(suppressed) = allowed(&shared.peer_faults) {
                warn!(%peer, ?after, suppressed, "data-plane handshake timed out");
            }
            return None;
        }
        Ok(Err(error)) => {
            if let Some(suppressed) = allowed(&shared.peer_faults) {
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
        if let Some(suppressed) = allowed(&shared.peer_faults) {
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
            if let Some(suppressed) = allowed(&shared.peer_faults) {
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
            if let Some(suppressed) = allowed(&shared.peer_faults) {
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
                if let Some(suppressed) = allowed(&shared.peer_faults) {
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
            if let Some(suppressed) = allowed(&shared.peer_faults) {
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
            if let Some(suppressed) = allowed(&shared.peer_faults) {
                warn!(%peer, %stream, %error, suppressed, "data-plane batch failed");
            }
        }
    }
}

/// Whether a line `throttle` governs may be logged now (with the count of
/// those left out since the last one).
fn allowed(throttle: &std::sync::Mutex<kv_proto::LogThrottle>) -> Option<u64> {
    throttle.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now())
}

/// One incoming batch on its stream.
struct Batch<'s> {
    shared: &'s Shared,
    peer: SocketAddr,
    send: SendStream,
    recv: RecvStream,
}

/// How the payload of an admitted batch ended.
enum Received {
    /// Every byte landed.
    Complete,
    /// The grant was revoked (or expired and purged) mid-payload: nothing
    /// more landed.
    Revoked,
}

impl Batch<'_> {
    async fn serve(&mut self) -> Result<(), StreamError> {
        let config = &self.shared.config;
        let io_timeout = config.io_timeout;
        let mut header = [0u8; BATCH_HEADER_LEN];
        read_exact(&mut self.recv, &mut header, io_timeout, "batch header").await?;
        let header = BatchHeader::decode(&header);
        let max = config.max_ops_in_force();
        let Some(mut buffer) = OpListBuffer::within(header.op_count, max) else {
            return Err(StreamError::TooManyOps { count: header.op_count, max });
        };

        // A batch for a grant that is not live is refused before its op
        // list is read (and buffered).
        match self.shared.memory.check_grant(&header.grant, Instant::now()) {
            Ok(()) => {}
            Err(DestinationError::Closed) => return Err(StreamError::Closed),
            Err(error) => return self.refuse(&header.grant, &error.to_string()).await,
        }

        // The op list, charged to the transport's budget as it grows, all
        // of it within one deadline.
        let shared = self.shared;
        let deadline = tokio::time::Instant::now() + config.op_list_timeout;
        let mut share = shared.op_lists.share();
        while !buffer.is_complete() {
            let more = buffer.growth();
            if more > 0 {
                if let Err(no_room) = share.grow(more, deadline).await {
                    drop(buffer);
                    share.release();
                    return self.refuse_for_room(&header, no_room).await;
                }
            }
            let read = read_exact(&mut self.recv, buffer.next_chunk(), io_timeout, "op list");
            match tokio::time::timeout_at(deadline, read).await {
                Ok(read) => read?,
                Err(_) => return Err(StreamError::OpListTimeout { after: config.op_list_timeout }),
            }
        }
        let list = buffer.into_entries();

        let destinations =
            match Destinations::admit(&self.shared.memory, &header.grant, list, header.total_bytes, Instant::now()) {
                Ok(destinations) => destinations,
                Err((_, DestinationError::LengthMismatch { declared, sum })) => {
                    return Err(StreamError::LengthMismatch { declared, sum })
                }
                Err((_, DestinationError::Closed)) => return Err(StreamError::Closed),
                Err((list, error)) => {
                    drop(list);
                    share.release();
                    return self.refuse(&header.grant, &error.to_string()).await;
                }
            };
        let received = self.receive_payload(&destinations).await?;
        // The op list is done with: its memory goes back before the verdict.
        let grant = destinations.grant();
        drop(destinations);
        share.release();
        match received {
            Received::Complete => self.reply(ReplyStatus::Ok, "").await,
            // Admitted, then fenced mid-payload: `admit` counted nothing, so
            // the refusal is counted here (an expiry purged mid-payload
            // looks the same as a revocation).
            Received::Revoked if self.shared.memory.is_closed() => {
                self.shared.memory.counters().refused(BatchRefusal::Closed);
                Err(StreamError::Closed)
            }
            Received::Revoked => {
                self.shared.memory.counters().refused(BatchRefusal::UnknownGrant);
                self.refuse(&grant, &format!("grant {grant} was revoked during the batch")).await
            }
        }
    }

    /// Refuses a batch whose op list found no room in the budget (log line
    /// rate-limited): its stream stopped, a `Refused` verdict with the
    /// reason sent.
    async fn refuse_for_room(&mut self, header: &BatchHeader, no_room: NoRoom) -> Result<(), StreamError> {
        let shared = self.shared;
        // The budget is this listener's, not the memory's: counted here.
        shared.memory.counters().refused(BatchRefusal::OpBudget);
        let reason = no_room.reason(header.op_count, shared.op_lists.limit(), shared.config.op_list_timeout);
        let allowed = shared.budget_refusals.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now());
        if let Some(suppressed) = allowed {
            warn!(peer = %self.peer, grant = %header.grant, stream = %self.recv.id(), ops = header.op_count,
                budget = shared.op_lists.limit(), ?no_room, suppressed, "refusing batch: no room for its op list");
        }
        let _ = self.recv.stop(VarInt::from_u32(STOP_REFUSED));
        self.reply(ReplyStatus::Refused, &reason).await
    }

    /// Refuses the batch: logged, its stream stopped (the rest of its
    /// payload is never read), a `Refused` verdict sent.
    async fn refuse(&mut self, grant: &GrantId, reason: &str) -> Result<(), StreamError> {
        if let Some(suppressed) = allowed(&self.shared.batch_refusals) {
            warn!(peer = %self.peer, grant = %grant, stream = %self.recv.id(), %reason, suppressed, "refusing batch");
        }
        let _ = self.recv.stop(VarInt::from_u32(STOP_REFUSED));
        self.reply(ReplyStatus::Refused, reason).await
    }

    /// Copies the payload, chunk by chunk as quinn hands it over, straight
    /// into the admitted destinations while the grant is live.
    async fn receive_payload(&mut self, destinations: &Destinations) -> Result<Received, StreamError> {
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
            let Ok(scattered) = scattered else { return Ok(Received::Revoked) };
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
            Ok(Ok(None)) => Ok(Received::Complete),
        }
    }

    async fn reply(&mut self, status: ReplyStatus, reason: &str) -> Result<(), StreamError> {
        let io_timeout = self.shared.config.io_timeout;
        let mut bytes = Vec::new();
        put_verdict(&mut bytes, status, reason);
        write_all(&mut self.send, &bytes, io_timeout, "reply").await.map_err(StreamError::Reply)?;
        // Finishing fails only if the stream was already reset; the reply
        // is then undeliverable anyway.
        let _ = self.send.finish();
        Ok(())
    }
}
