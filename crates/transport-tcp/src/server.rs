//! The receiving side: the accept loop and one task per incoming connection.
//!
//! A connection's life: the handshake (preamble → accept reply →
//! authentication, all within one overall `limits.handshake_timeout`, holding a
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
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BufMut;
use kv_proto::auth::{self, AuthSecret, Channel, Nonce, Transcript};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::receive::{BatchReceiver, Fault, Framing, PayloadEnd, Refusal, Step};
use kv_proto::session::{BadTag, End as SessionEnd, Session, StreamedFrame};
use kv_proto::{GrantId, HandshakePlace, Revoked, TransportCounters};
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{debug, warn};

use crate::memory::{Destinations, Progress};
use crate::transport::Shared;
use crate::wire::{
    auth_context, encode_reply, Accept, AcceptStatus, BatchHeader, Preamble, AUTH_BUSY, AUTH_FAILED, AUTH_OK,
    AUTH_TAG_LEN, BATCH_HEADER_LEN, CHALLENGE_LEN, PREAMBLE_LEN, VERSION,
};
use kv_net::{carry_out, read_exact, write_all, Admission, Carried, PeerLog, WireError};

/// Scratch buffer for discarding a refused batch's payload.
const DRAIN_CHUNK: usize = 64 * 1024;

/// Names this listener in kv-net's log lines.
const LISTENER: &str = "tcp data plane";

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
    #[error("batch {batch_id}: the payload failed its authentication tag (altered after the handshake; {bad})")]
    BadPayloadTag { batch_id: u64, bad: BadTag },
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

/// Accepts connections until the transport's token is cancelled.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let local = listener.local_addr().ok();
    let mut admission = Admission::new(&listener, &shared.listener.handshakes, LISTENER);
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
    let conn = Connection { shared, peer };
    let outcome = tokio::select! {
        biased;
        () = shared.token.cancelled() => Ok(End::Shutdown),
        outcome = conn.run(&mut stream, place) => outcome,
    };
    match outcome {
        Ok(end) => debug!(%peer, ?end, "data-plane connection closed"),
        Err(error @ ConnError::Abandoned(_)) => debug!(%peer, %error, "data-plane connection closed"),
        Err(error) => {
            let allowed = shared.listener.log_allowed(PeerLog::Fault);
            match allowed {
                Some(suppressed) => warn!(%peer, %error, suppressed, "closing data-plane connection"),
                None => debug!(%peer, %error, "closing data-plane connection"),
            }
        }
    }
}

/// A finished handshake: the established place, the session (with a
/// secret), and whether the sender tags its payloads.
type Handshake = (OwnedSemaphorePermit, Option<Session>, bool);

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
}

/// The batch-receive machine of one connection: it checks every header and
/// op list and tags every reply, once authenticated.
type Receiver<'m> = BatchReceiver<'m, BatchHeader, BATCH_HEADER_LEN>;

impl Connection<'_> {
    async fn run(self, stream: &mut TcpStream, place: HandshakePlace) -> Result<End, ConnError> {
        let deadline = self.shared.config.limits.handshake_timeout;
        let (_established, session, tagged_payloads) = tokio::time::timeout(deadline, self.handshake(stream))
            .await
            .map_err(|_| ConnError::HandshakeTimeout(deadline))??;
        drop(place);
        let shared = self.shared;
        let config = &shared.config;
        let io_timeout = config.io_timeout;
        let limits = config.op_lists.receive_limits(config.auth_secret.is_some());
        let framing = Framing::Connection { session: session.map(Box::new), tagged_payloads };
        let mut rx = Receiver::new(&shared.memory, limits, framing, BatchHeader::decode);
        // The batch in progress's share of the op-list budget.
        let mut share = shared.listener.op_lists.share();
        loop {
            let header = rx.header().copied();
            let batch_id = header.map_or(0, |h| h.batch_id);
            let step = match carry_out(rx.next_step(), stream, &mut share, io_timeout).await? {
                Carried::Done => {
                    rx.advance(Instant::now());
                    continue;
                }
                Carried::Late => {
                    rx.deadline_passed();
                    continue;
                }
                Carried::NoRoom(no_room) => {
                    rx.no_room(no_room);
                    continue;
                }
                Carried::Other(step) => step,
            };
            match step {
                Step::AwaitBatch => {
                    let mut probe = [0u8; 1];
                    match tokio::time::timeout(config.idle_timeout, stream.peek(&mut probe)).await {
                        Err(_) => return Ok(End::Idle),
                        Ok(Ok(0)) => return Ok(End::PeerClosed),
                        Ok(Ok(_)) => {}
                        Ok(Err(source)) => return Err(WireError::Io { what: "batch header", source }.into()),
                    }
                }
                // Carried out above.
                Step::Read { .. } | Step::Charge { .. } => {}
                Step::Refused { refusal, reason } => self.log_refusal(header.as_ref(), refusal, reason),
                Step::Discard { bytes } => drain(stream, bytes, io_timeout).await?,
                // A connection's batches stay in step: nothing is stopped.
                Step::Stop => {}
                Step::Payload { batch, tag } => {
                    let received = receive_payload(stream, &Destinations::new(batch), tag, io_timeout).await;
                    match received {
                        Ok(end) => rx.payload_end(end),
                        Err(ConnError::Wire(WireError::Eof { partial: false, .. }))
                            if header.is_some_and(|h| h.wants_precheck()) =>
                        {
                            return Err(ConnError::Abandoned(batch_id))
                        }
                        Err(error) => return Err(error),
                    }
                    continue;
                }
                // The op list is done with: its memory goes back before the reply.
                Step::Release => share.release(),
                Step::Reply { status, reason } => {
                    let reply = encode_reply(batch_id, status, reason);
                    self.reply(stream, &mut rx, reply).await?;
                }
                // Only a stream's batch is ever done.
                Step::Done => return Ok(End::PeerClosed),
                Step::Fail(fault) => return Err(self.fault(stream, &mut rx, header, fault).await),
            }
            rx.advance(Instant::now());
        }
    }

    /// Preamble, accept reply and (with a secret) authentication; returns the
    /// connection's established place, taken once all of that succeeded
    /// (a peer past the limit is told so), its session, and whether its
    /// payloads are tagged. The caller bounds the whole of it by
    /// `limits.handshake_timeout`.
    async fn handshake(&self, stream: &mut TcpStream) -> Result<Handshake, ConnError> {
        let config = &self.shared.config;
        let io_timeout = config.io_timeout;
        let mut preamble_bytes = [0u8; PREAMBLE_LEN];
        read_exact(stream, &mut preamble_bytes, io_timeout, "preamble").await?;
        let preamble = Preamble::decode(&preamble_bytes).map_err(ConnError::BadMagic)?;
        let next = match preamble.answer_requiring(config.auth_secret.is_some(), config.authenticate_payloads) {
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
            status @ AcceptStatus::PayloadAuthRequired => Err((
                status,
                ConnError::AuthFailed("the sender does not tag its payloads, which this receiver requires"),
            )),
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
            max_ops_per_batch: config.op_lists.max_ops_in_force(config.auth_secret.is_some()),
            idle_timeout_ms: u64::try_from(config.idle_timeout.as_millis()).unwrap_or(u64::MAX),
        }
        .encode();
        write_all(stream, &accept, io_timeout, "accept reply").await?;
        match next {
            Err((_, refusal)) => Err(refusal),
            Ok(AfterAccept::Established(place)) => Ok((place, None, false)),
            Ok(AfterAccept::Authenticate(secret)) => {
                let context = auth_context(&preamble_bytes, &accept);
                let counters = self.shared.memory.counters();
                let (place, session) =
                    authenticate(stream, secret, &client_nonce, &context, io_timeout, counters, || self.establish())
                        .await?;
                Ok((place, Some(session), preamble.announces_payload_auth()))
            }
        }
    }

    /// An established place, or the error that tells why there is none
    /// (rate-limited log line).
    fn establish(&self) -> Result<OwnedSemaphorePermit, ConnError> {
        let established = &self.shared.listener.established;
        established.take(LISTENER, self.peer).ok_or(ConnError::Busy(established.limit()))
    }

    /// Logs a refused batch: at most one line a second for all connections
    /// per kind, with the count left out (a revocation mid-batch is the
    /// receiver's own doing, logged each time).
    fn log_refusal(&self, header: Option<&BatchHeader>, refusal: &Refusal, reason: &str) {
        let shared = self.shared;
        let peer = self.peer;
        let (grant, batch_id, ops) =
            header.map_or((GrantId::from_bytes([0; 16]), 0, 0), |h| (h.grant, h.batch_id, h.op_count));
        match refusal {
            Refusal::Grant(_) => {
                let allowed = shared.listener.log_allowed(PeerLog::Batch);
                if let Some(suppressed) = allowed {
                    warn!(%peer, %grant, batch_id, %reason, suppressed, "refusing batch, nothing written");
                }
            }
            Refusal::NoRoom(no_room) => {
                let allowed = shared.listener.log_allowed(PeerLog::Budget);
                if let Some(suppressed) = allowed {
                    warn!(%peer, %grant, batch_id, ops, budget = shared.listener.op_lists.limit(), ?no_room, suppressed,
                        "refusing batch: no room for its op list");
                }
            }
            Refusal::Revoked { written, remaining } => {
                warn!(%peer, %grant, batch_id, written, remaining,
                    "grant revoked mid-batch: discarding the rest of the payload");
            }
        }
    }

    /// The error that closes the connection for `fault`; where the peer
    /// broke the protocol it is told why first (best effort).
    async fn fault(
        &self,
        stream: &mut TcpStream,
        rx: &mut Receiver<'_>,
        header: Option<BatchHeader>,
        fault: Fault,
    ) -> ConnError {
        let batch_id = header.map_or(0, |h| h.batch_id);
        let error = match fault {
            Fault::BadTag(bad) => return ConnError::BadTag(bad),
            // Its bytes landed inside the grant; the batch fails unanswered.
            Fault::BadPayloadTag(bad) => return ConnError::BadPayloadTag { batch_id, bad },
            Fault::Closed => return ConnError::Closed,
            Fault::Malformed => ConnError::BadBatchHeader {
                batch_id,
                flags: header.map_or(0, |h| h.flags),
                reserved: header.map_or(0, |h| h.reserved),
            },
            Fault::TooManyOps { count, max } => ConnError::TooManyOps { batch_id, count, max },
            Fault::OpListTimeout { after } => ConnError::OpListTimeout { batch_id, after },
            Fault::LengthMismatch { declared, sum } => ConnError::LengthMismatch { batch_id, declared, sum },
        };
        let reply = encode_reply(batch_id, ReplyStatus::ProtocolError, &error.to_string());
        if let Err(reply_error) = self.reply(stream, rx, reply).await {
            debug!(peer = %self.peer, error = %reply_error, "cannot report protocol error to peer");
        }
        error
    }

    /// Writes a reply (tagged on an authenticated connection).
    async fn reply(&self, stream: &mut TcpStream, rx: &mut Receiver<'_>, mut reply: Vec<u8>) -> Result<(), ConnError> {
        if let Some(tag) = rx.seal(&reply) {
            reply.extend_from_slice(&tag);
        }
        write_all(stream, &reply, self.shared.config.io_timeout, "reply").await?;
        Ok(())
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
    destinations: &Destinations<'_>,
    mut tag: Option<&mut StreamedFrame>,
    io_timeout: Duration,
) -> Result<PayloadEnd, ConnError> {
    let total = destinations.total();
    let mut progress = Progress::new(0, total);
    while !progress.is_done() {
        let attempt = stream.try_io(Interest::READABLE, || {
            destinations
                .recv_from(stream.as_fd(), &mut progress, tag.as_deref_mut())
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
            Err(e) if is_revoked(&e) => return Ok(PayloadEnd::Revoked { remaining: progress.payload_remaining() }),
            Err(source) => return Err(WireError::Io { what: "payload", source }.into()),
        }
    }
    Ok(PayloadEnd::Complete)
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
