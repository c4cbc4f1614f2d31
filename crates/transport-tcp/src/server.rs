//! The receiving side: the accept loop and one task per incoming connection.
//!
//! A connection's life: the handshake (preamble → accept reply →
//! authentication, all within one overall `handshake_timeout`, holding a
//! handshake place taken at accept), then, holding an established place
//! taken only once the handshake succeeded, batches
//! until the peer closes, the connection idles past `idle_timeout`, the peer
//! breaks the protocol, or the transport shuts down. Each batch's op list is
//! admitted against the grant it names before a payload byte is read, and
//! the payload lands only inside that grant while it is live. A broken
//! connection is logged and closed; it never affects the listener or other
//! connections.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use bytes::BufMut;
use kv_proto::auth::{self, AuthSecret, Channel, Nonce, Transcript};
use kv_proto::dataplane::{OpListBuffer, ReplyStatus};
use kv_proto::session::{BadTag, End as SessionEnd, Session, FRAME_TAG_LEN};
use kv_proto::{BatchRefusal, HandshakePlace, Revoked, TransportCounters};
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{debug, warn};

use crate::memory::{DestinationError, Destinations, Progress};
use crate::transport::Shared;
use crate::wire::{
    auth_context, encode_reply, Accept, AcceptStatus, BatchHeader, Preamble, AUTH_BUSY, AUTH_FAILED, AUTH_OK,
    AUTH_TAG_LEN, BATCH_HEADER_LEN, CHALLENGE_LEN, OP_LEN, PREAMBLE_LEN, VERSION,
};
use kv_net::{read_exact, write_all, Admission, NoRoom, Share, WireError};

/// Scratch buffer for discarding a refused batch's payload.
const DRAIN_CHUNK: usize = 64 * 1024;

/// Why an incoming connection was closed.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("handshake not completed within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("bad preamble magic {0:02x?} (not a kvlink data-plane client?)")]
    BadMagic([u8; 4]),
    #[error("peer speaks data-plane version {0}, this build speaks {VERSION}")]
    UnsupportedVersion(u16),
    #[error("peer requested unknown preamble flags {0:#06x}")]
    UnsupportedFlags(u16),
    #[error("batch {batch_id}: unknown batch flags {flags:#x} or a non-zero reserved field {reserved:#x}")]
    BadBatchHeader { batch_id: u64, flags: u32, reserved: u32 },
    #[error("batch {batch_id} announces {count} ops, more than the limit of {max}")]
    TooManyOps { batch_id: u64, count: u64, max: u64 },
    #[error("batch {batch_id}: op lengths add up to {}, the header says {declared}",
        .sum.map_or_else(|| "more than u64::MAX".to_owned(), |s| s.to_string()))]
    LengthMismatch { batch_id: u64, declared: u64, sum: Option<u64> },
    #[error("batch {batch_id}: op list not received within {after:?}")]
    OpListTimeout { batch_id: u64, after: Duration },
    #[error("data-plane authentication failed: {0}")]
    AuthFailed(&'static str),
    #[error("data-plane {0}")]
    BadTag(#[from] BadTag),
    #[error("{0} established connections already; told the peer so")]
    Busy(usize),
    #[error("the sender abandoned admitted batch {0} before its payload (another part of it was refused)")]
    Abandoned(u64),
    #[error("the transport is shut down")]
    Closed,
}

/// How a connection ended without error.
#[derive(Debug, Clone, Copy)]
enum End {
    PeerClosed,
    Idle,
    Shutdown,
}

/// How the payload of an admitted batch ended.
enum Received {
    /// Every byte is in memory.
    All,
    /// The grant was revoked (or the memory closed) with `remaining` bytes
    /// unread; none of them was written.
    Revoked { remaining: u64 },
}

/// Accepts connections until the transport's token is cancelled.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let local = listener.local_addr().ok();
    let mut admission = Admission::new(&listener, &shared.handshakes, "tcp data plane");
    loop {
        let (stream, peer, place) = tokio::select! {
            biased;
            () = shared.token.cancelled() => break,
            admitted = admission.next() => admitted,
        };
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        let task_shared = Arc::clone(&shared);
        shared.tracker.spawn(async move { serve(&task_shared, stream, peer, place).await });
    }
    debug!(listener = ?local, "data-plane listener stopped");
}

async fn serve(shared: &Shared, mut stream: TcpStream, peer: SocketAddr, place: HandshakePlace) {
    if let Err(error) = stream.set_nodelay(true) {
        debug!(%peer, %error, "cannot set TCP_NODELAY");
    }
    let conn = Connection { shared, peer, session: None };
    let outcome = tokio::select! {
        biased;
        () = shared.token.cancelled() => Ok(End::Shutdown),
        outcome = conn.run(&mut stream, place) => outcome,
    };
    match outcome {
        Ok(end) => debug!(%peer, ?end, "data-plane connection closed"),
        Err(error @ ConnError::Abandoned(_)) => debug!(%peer, %error, "data-plane connection closed"),
        Err(error) => {
            let allowed = shared.closed_in_error.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now());
            match allowed {
                Some(suppressed) => warn!(%peer, %error, suppressed, "closing data-plane connection"),
                None => debug!(%peer, %error, "closing data-plane connection"),
            }
        }
    }
}

/// What follows an accept reply that accepts.
enum AfterAccept<'a> {
    /// Nothing: the connection is established (no secret configured).
    Established(OwnedSemaphorePermit),
    /// The sender proves the secret.
    Authenticate(&'a AuthSecret),
}

struct Connection<'s> {
    shared: &'s Shared,
    peer: SocketAddr,
    /// Checks every header and op list, tags every reply, once authenticated.
    session: Option<Session>,
}

impl Connection<'_> {
    async fn run(mut self, stream: &mut TcpStream, place: HandshakePlace) -> Result<End, ConnError> {
        let deadline = self.shared.config.handshake_timeout;
        let (_established, session) = tokio::time::timeout(deadline, self.handshake(stream))
            .await
            .map_err(|_| ConnError::HandshakeTimeout(deadline))??;
        drop(place);
        self.session = session;

        let config = &self.shared.config;
        loop {
            let mut probe = [0u8; 1];
            match tokio::time::timeout(config.idle_timeout, stream.peek(&mut probe)).await {
                Err(_) => return Ok(End::Idle),
                Ok(Ok(0)) => return Ok(End::PeerClosed),
                Ok(Ok(_)) => {}
                Ok(Err(source)) => return Err(WireError::Io { what: "batch header", source }.into()),
            }
            let mut header = [0u8; BATCH_HEADER_LEN];
            read_exact(stream, &mut header, config.io_timeout, "batch header").await?;
            if let Some(session) = &mut self.session {
                let mut tag = [0u8; FRAME_TAG_LEN];
                read_exact(stream, &mut tag, config.io_timeout, "batch header tag").await?;
                session.recv.open(&[&header], &tag)?;
            }
            self.batch(stream, BatchHeader::decode(&header)).await?;
        }
    }

    /// Preamble, accept reply and (with a secret) authentication; returns the
    /// connection's established place, taken once all of that succeeded
    /// (a peer past the limit is told so). The caller bounds the whole of it
    /// by `handshake_timeout`.
    async fn handshake(&self, stream: &mut TcpStream) -> Result<(OwnedSemaphorePermit, Option<Session>), ConnError> {
        let config = &self.shared.config;
        let io_timeout = config.io_timeout;
        let mut preamble_bytes = [0u8; PREAMBLE_LEN];
        read_exact(stream, &mut preamble_bytes, io_timeout, "preamble").await?;
        let preamble = Preamble::decode(&preamble_bytes).map_err(ConnError::BadMagic)?;
        let next = match preamble.answer(config.auth_secret.is_some()) {
            AcceptStatus::Accepted => match &config.auth_secret {
                Some(secret) => Ok(AfterAccept::Authenticate(secret)),
                // Without a secret the handshake ends with the accept reply:
                // the established place is taken before it is written.
                None => match self.establish() {
                    Ok(place) => Ok(AfterAccept::Established(place)),
                    Err(busy) => Err((AcceptStatus::Busy, busy)),
                },
            },
            status @ AcceptStatus::UnsupportedVersion => Err((status, ConnError::UnsupportedVersion(preamble.version))),
            status @ AcceptStatus::AuthRequired => {
                Err((status, ConnError::AuthFailed("the sender has no shared secret")))
            }
            status @ AcceptStatus::AuthUnavailable => {
                Err((status, ConnError::AuthFailed("no shared secret is configured here")))
            }
            status @ (AcceptStatus::UnsupportedFlags | AcceptStatus::Busy | AcceptStatus::Unknown(_)) => {
                Err((status, ConnError::UnsupportedFlags(preamble.flags)))
            }
        };
        let mut client_nonce: Nonce = [0u8; AUTH_TAG_LEN];
        if let Ok(AfterAccept::Authenticate(_)) = next {
            read_exact(stream, &mut client_nonce, io_timeout, "authentication nonce").await?;
        }
        let accept = Accept {
            version: VERSION,
            status: next.as_ref().map_or_else(|(status, _)| *status, |_| AcceptStatus::Accepted),
            max_ops_per_batch: config.max_ops_in_force(),
            idle_timeout_ms: u64::try_from(config.idle_timeout.as_millis()).unwrap_or(u64::MAX),
        }
        .encode();
        write_all(stream, &accept, io_timeout, "accept reply").await?;
        match next {
            Err((_, refusal)) => Err(refusal),
            Ok(AfterAccept::Established(place)) => Ok((place, None)),
            Ok(AfterAccept::Authenticate(secret)) => {
                let context = auth_context(&preamble_bytes, &accept);
                let counters = self.shared.memory.counters();
                let (place, session) =
                    authenticate(stream, secret, &client_nonce, &context, io_timeout, counters, || self.establish())
                        .await?;
                Ok((place, Some(session)))
            }
        }
    }

    /// An established place, or the error that tells why there is none
    /// (rate-limited log line).
    fn establish(&self) -> Result<OwnedSemaphorePermit, ConnError> {
        let shared = self.shared;
        Arc::clone(&shared.conn_limit).try_acquire_owned().map_err(|_| {
            let allowed = shared.busy_refusals.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now());
            if let Some(suppressed) = allowed {
                warn!(peer = %self.peer, limit = shared.config.limits.max_connections, suppressed,
                    "connection limit reached, refusing a peer that finished its handshake");
            }
            ConnError::Busy(shared.config.limits.max_connections)
        })
    }

    async fn batch(&mut self, stream: &mut TcpStream, header: BatchHeader) -> Result<(), ConnError> {
        let shared = self.shared;
        let io_timeout = shared.config.io_timeout;
        let max = shared.config.max_ops_in_force();
        let batch_id = header.batch_id;
        if !header.is_well_formed() {
            let error = ConnError::BadBatchHeader { batch_id, flags: header.flags, reserved: header.reserved };
            return Err(self.protocol_error(stream, batch_id, error).await);
        }
        let Some(mut buffer) = OpListBuffer::within(header.op_count, max) else {
            let error = ConnError::TooManyOps { batch_id, count: header.op_count, max };
            return Err(self.protocol_error(stream, batch_id, error).await);
        };

        // A batch for a grant that is not live is refused before its op list
        // is buffered (the list and the payload are read and discarded).
        match shared.memory.check_grant(&header.grant, Instant::now()) {
            Ok(()) => {}
            Err(DestinationError::Closed) => return Err(ConnError::Closed),
            Err(refusal) => return self.refuse(stream, &header, Some(buffer.count()), &refusal.to_string()).await,
        }

        // The op list, charged to the transport's budget as it grows, all
        // of it within one deadline.
        let deadline = tokio::time::Instant::now() + shared.config.op_list_timeout;
        let mut share = shared.op_lists.share();
        while !buffer.is_complete() {
            let more = buffer.growth();
            if more > 0 {
                if let Err(no_room) = share.grow(more, deadline).await {
                    let unread = buffer.count() - buffer.filled();
                    drop(buffer);
                    share.release();
                    return self.refuse_for_room(stream, &header, Some(unread), no_room).await;
                }
            }
            let read = read_exact(stream, buffer.next_chunk(), io_timeout, "op list");
            match tokio::time::timeout_at(deadline, read).await {
                Ok(read) => read?,
                Err(_) => {
                    let error = ConnError::OpListTimeout { batch_id, after: shared.config.op_list_timeout };
                    return Err(self.protocol_error(stream, batch_id, error).await);
                }
            }
        }
        let list = buffer.into_entries();
        if let Some(session) = &mut self.session {
            let mut tag = [0u8; FRAME_TAG_LEN];
            read_exact(stream, &mut tag, io_timeout, "op list tag").await?;
            session.recv.open(&[list.as_flattened()], &tag)?;
        }

        // The grant check: every op inside the named, live grant, before a
        // payload byte is read.
        let admitted = Destinations::admit(&shared.memory, &header.grant, list, header.total_bytes, Instant::now());
        match admitted {
            Ok(destinations) => self.write_admitted(stream, &header, destinations, &mut share).await,
            Err((_, DestinationError::LengthMismatch { declared, sum })) => {
                let error = ConnError::LengthMismatch { batch_id, declared, sum };
                Err(self.protocol_error(stream, batch_id, error).await)
            }
            Err((_, DestinationError::Closed)) => Err(ConnError::Closed),
            Err((list, refusal)) => {
                drop(list);
                share.release();
                self.refuse(stream, &header, None, &refusal.to_string()).await
            }
        }
    }

    /// Refuses a batch (logged, at most one line a second for all
    /// connections, with the count left out), discarding the `unread`
    /// op-list entries not read yet and, unless it was pre-checked, its
    /// payload, so the connection stays usable.
    async fn refuse(
        &mut self,
        stream: &mut TcpStream,
        header: &BatchHeader,
        unread: Option<usize>,
        reason: &str,
    ) -> Result<(), ConnError> {
        let batch_id = header.batch_id;
        let allowed = self.shared.batch_refusals.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now());
        if let Some(suppressed) = allowed {
            warn!(peer = %self.peer, grant = %header.grant, batch_id, %reason, suppressed, "refusing batch, nothing written");
        }
        self.discard(stream, header, unread).await?;
        self.reply(stream, batch_id, ReplyStatus::Refused, reason).await
    }

    /// Reads and discards the `unread` op-list entries of a refused batch
    /// (and their tag; `None`: the op list was read whole) and, unless it
    /// was pre-checked (no payload follows a refusal then), its payload.
    async fn discard(
        &mut self,
        stream: &mut TcpStream,
        header: &BatchHeader,
        unread: Option<usize>,
    ) -> Result<(), ConnError> {
        let io_timeout = self.shared.config.io_timeout;
        if let Some(unread) = unread {
            drain(stream, unread as u64 * OP_LEN as u64, io_timeout).await?;
            if let Some(session) = &mut self.session {
                // The op list is discarded unread, and so is its tag.
                drain(stream, FRAME_TAG_LEN as u64, io_timeout).await?;
                session.recv.skip();
            }
        }
        if !header.wants_precheck() {
            drain(stream, header.total_bytes, io_timeout).await?;
        }
        Ok(())
    }

    /// Refuses a batch whose op list found no room in the budget (log line
    /// rate-limited); the rest of it is discarded.
    async fn refuse_for_room(
        &mut self,
        stream: &mut TcpStream,
        header: &BatchHeader,
        unread: Option<usize>,
        no_room: NoRoom,
    ) -> Result<(), ConnError> {
        let shared = self.shared;
        // The budget is this listener's, not the memory's: counted here.
        shared.memory.counters().refused(BatchRefusal::OpBudget);
        let reason = no_room.reason(header.op_count, shared.op_lists.limit(), shared.config.op_list_timeout);
        let allowed = shared.budget_refusals.lock().unwrap_or_else(PoisonError::into_inner).allow(Instant::now());
        if let Some(suppressed) = allowed {
            warn!(peer = %self.peer, grant = %header.grant, batch_id = header.batch_id, ops = header.op_count,
                budget = shared.op_lists.limit(), ?no_room, suppressed, "refusing batch: no room for its op list");
        }
        self.discard(stream, header, unread).await?;
        self.reply(stream, header.batch_id, ReplyStatus::Refused, &reason).await
    }

    /// Receives an admitted batch's payload under its grant and replies.
    async fn write_admitted(
        &mut self,
        stream: &mut TcpStream,
        header: &BatchHeader,
        destinations: Destinations,
        share: &mut Share<'_>,
    ) -> Result<(), ConnError> {
        let io_timeout = self.shared.config.io_timeout;
        let batch_id = header.batch_id;
        if header.wants_precheck() {
            self.reply(stream, batch_id, ReplyStatus::Ok, "").await?;
        }
        let received = receive_payload(stream, &destinations, io_timeout).await;
        // The op list is done with: its memory goes back before the reply.
        let total = destinations.total();
        drop(destinations);
        share.release();
        match received {
            Ok(Received::All) => self.reply(stream, batch_id, ReplyStatus::Ok, "").await,
            Ok(Received::Revoked { remaining }) => {
                // Admitted, then fenced mid-payload: `admit` counted nothing,
                // so the refusal is counted here.
                let counters = self.shared.memory.counters();
                if self.shared.memory.is_closed() {
                    counters.refused(BatchRefusal::Closed);
                    return Err(ConnError::Closed);
                }
                counters.refused(BatchRefusal::UnknownGrant);
                let reason = format!("grant {} was revoked during the batch", header.grant);
                let written = total - remaining;
                warn!(peer = %self.peer, grant = %header.grant, batch_id, written, remaining,
                    "grant revoked mid-batch: discarding the rest of the payload");
                drain(stream, remaining, io_timeout).await?;
                self.reply(stream, batch_id, ReplyStatus::Refused, &reason).await
            }
            Err(ConnError::Wire(WireError::Eof { partial: false, .. })) if header.wants_precheck() => {
                Err(ConnError::Abandoned(batch_id))
            }
            Err(error) => Err(error),
        }
    }

    async fn reply(
        &mut self,
        stream: &mut TcpStream,
        batch_id: u64,
        status: ReplyStatus,
        reason: &str,
    ) -> Result<(), ConnError> {
        let io_timeout = self.shared.config.io_timeout;
        let mut reply = encode_reply(batch_id, status, reason);
        if let Some(session) = &mut self.session {
            let tag = session.send.seal(&[&reply]);
            reply.extend_from_slice(&tag);
        }
        write_all(stream, &reply, io_timeout, "reply").await?;
        Ok(())
    }

    /// Tells the peer why its connection is being closed (best effort) and
    /// returns the error that closes it.
    async fn protocol_error(&mut self, stream: &mut TcpStream, batch_id: u64, error: ConnError) -> ConnError {
        if let Err(reply_error) = self.reply(stream, batch_id, ReplyStatus::ProtocolError, &error.to_string()).await {
            debug!(peer = %self.peer, error = %reply_error, "cannot report protocol error to peer");
        }
        error
    }
}

/// Proves the shared secret to the sender and checks its proof, both bound
/// to the whole transcript (this channel, both nonces, `context`); then
/// takes the connection's established place with `establish` (a sender
/// past the limit is told so), and derives the session that checks every
/// later header and op list. Nothing of a batch is read before this returns
/// `Ok`. A proof that does not verify is counted in `counters`.
async fn authenticate(
    stream: &mut TcpStream,
    secret: &AuthSecret,
    client_nonce: &Nonce,
    context: &[u8],
    io_timeout: Duration,
    counters: &TransportCounters,
    establish: impl FnOnce() -> Result<OwnedSemaphorePermit, ConnError>,
) -> Result<(OwnedSemaphorePermit, Session), ConnError> {
    let server_nonce = auth::fresh_nonce().ok_or(ConnError::AuthFailed("no OS randomness for the nonce"))?;
    let transcript = Transcript { channel: Channel::DataTcp, client_nonce, server_nonce: &server_nonce, context };
    let mut challenge = [0u8; CHALLENGE_LEN];
    let mut out = &mut challenge[..];
    out.put_slice(&server_nonce);
    out.put_slice(&auth::server_proof(secret, &transcript));
    write_all(stream, &challenge, io_timeout, "authentication challenge").await?;
    let mut proof = [0u8; AUTH_TAG_LEN];
    read_exact(stream, &mut proof, io_timeout, "authentication proof").await?;
    let verdict = if auth::verify_client_proof(secret, &transcript, &proof) {
        establish()
    } else {
        // A wrong proof, not a peer gone mid-handshake (that fails the read
        // above): counted before the verdict, which the peer may not read.
        counters.auth_failed();
        Err(ConnError::AuthFailed("the sender's proof does not match this connection's transcript and secret"))
    };
    let byte = match &verdict {
        Ok(_) => AUTH_OK,
        Err(ConnError::Busy(_)) => AUTH_BUSY,
        Err(_) => AUTH_FAILED,
    };
    write_all(stream, &[byte], io_timeout, "authentication verdict").await?;
    let session = Session::derive(secret, &transcript, SessionEnd::Server)
        .ok_or(ConnError::AuthFailed("cannot derive the session keys"))?;
    Ok((verdict?, session))
}

fn is_revoked(error: &io::Error) -> bool {
    error.get_ref().is_some_and(|inner| inner.is::<Revoked>())
}

/// Reads the payload straight into the admitted destinations while the
/// grant is live.
async fn receive_payload(
    stream: &TcpStream,
    destinations: &Destinations,
    io_timeout: Duration,
) -> Result<Received, ConnError> {
    let total = destinations.total();
    let mut progress = Progress::new(0, total);
    while !progress.is_done() {
        let attempt = stream.try_io(Interest::READABLE, || {
            destinations
                .recv_from(stream.as_fd(), &mut progress)
                .unwrap_or_else(|revoked| Err(io::Error::other(revoked)))
        });
        match attempt {
            Ok(0) => {
                let partial = progress.payload_remaining() < total;
                return Err(WireError::Eof { what: "payload", partial }.into());
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                match tokio::time::timeout(io_timeout, stream.readable()).await {
                    Err(_) => return Err(WireError::Timeout { what: "payload", after: io_timeout }.into()),
                    Ok(Err(source)) => return Err(WireError::Io { what: "payload", source }.into()),
                    Ok(Ok(())) => {}
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_revoked(&e) => return Ok(Received::Revoked { remaining: progress.payload_remaining() }),
            Err(source) => return Err(WireError::Io { what: "payload", source }.into()),
        }
    }
    Ok(Received::All)
}

/// Reads and discards `total` payload bytes (a refused batch, or the rest of
/// one whose grant was revoked), so the connection stays in step and usable.
async fn drain(stream: &mut TcpStream, total: u64, io_timeout: Duration) -> Result<(), ConnError> {
    let chunk = usize::try_from(total).map_or(DRAIN_CHUNK, |t| t.min(DRAIN_CHUNK));
    let mut scratch = vec![0u8; chunk];
    let mut left = total;
    while left > 0 {
        let n = usize::try_from(left).map_or(chunk, |l| l.min(chunk));
        let part = scratch.get_mut(..n).unwrap_or_default();
        read_exact(stream, part, io_timeout, "discarded payload").await?;
        left -= n as u64;
    }
    Ok(())
}
