//! D's side-channel client: one connection per prefill worker, reused across
//! steps, carrying many transfer requests at once (replies matched by id).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{SinkExt, StreamExt};
use kv_proto::auth::{self, Channel, Transcript};
use kv_proto::session::{End, Session};
use kv_proto::{
    FailureCause, FrameCodec, Hello, HelloReply, KeepAlive, Renewing, SideMessage, XferProgress, XferReply, XferRequest,
};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Mutex};
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::AuthSecret;
use crate::receiver::{PeerInfo, SideChannelAddr};
use crate::side_channel::reuse::{Idleness, RefusalMemory};
use crate::side_channel::{SideChannelCodec, SideChannelError};

/// Where P's progress on one transfer request goes (called by the
/// connection's reader, in the order P sent it, before the reply).
pub(crate) type ProgressSink = Arc<dyn Fn(XferProgress) + Send + Sync>;

/// A transfer request awaiting its reply, and where its progress goes.
type Pending = (oneshot::Sender<Result<XferReply, Unanswered>>, Option<ProgressSink>);

/// Why a transfer request brought no reply: a cause to count it under and
/// the reason to log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PullError {
    pub(crate) cause: FailureCause,
    pub(crate) reason: String,
}

impl PullError {
    pub(crate) fn new(cause: FailureCause, reason: impl Into<String>) -> Self {
        Self { cause, reason: reason.into() }
    }

    fn lost(reason: impl Into<String>) -> Self {
        Self::new(FailureCause::ConnectionLost, reason)
    }
}

/// Why a transfer request got no reply.
enum Unanswered {
    /// P refused it (the reason is P's).
    Refused(String),
    /// The connection ended first (a frame that failed its tag: `AuthFailed`).
    ConnectionLost(PullError),
}

/// Why a connection could not be set up.
struct HandshakeFailure {
    error: PullError,
    /// P answered and said no (or spoke another protocol): asking again at
    /// once would get the same answer.
    refused: bool,
    /// A frame failed its tag (counted as a tag failure, not as a peer that
    /// failed authentication).
    bad_tag: bool,
}

impl HandshakeFailure {
    fn io(reason: impl Into<String>) -> Self {
        Self { error: PullError::lost(reason), refused: false, bad_tag: false }
    }

    fn refused(cause: FailureCause, reason: impl Into<String>) -> Self {
        Self { error: PullError::new(cause, reason), refused: true, bad_tag: false }
    }
}

/// What P's hello reply granted a connection.
struct Accepted {
    idle_timeout: Duration,
    lease_renewal: Duration,
    peer: PeerInfo,
}

/// What a client needs to open connections.
#[derive(Clone, Debug)]
pub(crate) struct ClientSettings {
    pub(crate) hello: Hello,
    pub(crate) connect_timeout: std::time::Duration,
    pub(crate) max_frame_len: usize,
    pub(crate) auth_secret: Option<AuthSecret>,
    /// Where this client's live connections and failed authentications count.
    pub(crate) counts: Arc<crate::side_channel::Counts>,
}

/// A handle on one prefill worker's side channel.
pub(crate) struct SideChannelClient {
    peer: SideChannelAddr,
    settings: ClientSettings,
    cancel: CancellationToken,
    tracker: TaskTracker,
    conn: Mutex<Option<Arc<Connection>>>,
    /// P's last refusal, while it stands.
    refused: std::sync::Mutex<RefusalMemory<PullError>>,
}

type Sink = SplitSink<Framed<TcpStream, SideChannelCodec>, SideMessage>;

/// One live connection: requests are written by the requesting task itself
/// (no hand-off to a writer task), replies are routed by a reader task.
struct Connection {
    /// `None` once the reader has ended: the socket is closed then, not
    /// kept open (half-closed by a dead peer) until the next request.
    sink: Mutex<Option<Sink>>,
    /// Replies awaited, by `xfer_id`; `None` once the reader has ended.
    pending: std::sync::Mutex<Option<HashMap<u64, Pending>>>,
    /// When a request was last sent or a reply last received, and how idle
    /// it may get.
    idleness: std::sync::Mutex<Idleness>,
    /// Ends the reader when the connection is retired.
    retired: CancellationToken,
    /// How long one renewal holds a request on P (zero: P wants none).
    lease_renewal: Duration,
    /// What P's hello said of its place and cache.
    peer: PeerInfo,
    /// Counts this connection among the live ones while it lives.
    _open: crate::side_channel::OpenConnection,
}

impl Connection {
    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Option<HashMap<u64, Pending>>> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock_idleness(&self) -> std::sync::MutexGuard<'_, Idleness> {
        self.idleness.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A request was sent or a reply received at `now`.
    fn touch(&self, now: Instant) {
        self.lock_idleness().touch(now);
    }

    /// Whether it can carry another request at `now`: its reader is alive,
    /// and it has not sat idle long enough that P may be closing it.
    fn usable(&self, now: Instant) -> bool {
        let in_flight = match self.lock_pending().as_ref() {
            None => return false,
            Some(pending) => pending.len(),
        };
        self.lock_idleness().usable(in_flight, now)
    }
}

impl SideChannelClient {
    pub(crate) fn new(
        peer: SideChannelAddr,
        settings: ClientSettings,
        cancel: CancellationToken,
        tracker: TaskTracker,
    ) -> Arc<Self> {
        let refused = std::sync::Mutex::new(RefusalMemory::new());
        Arc::new(Self { peer, settings, cancel, tracker, conn: Mutex::new(None), refused })
    }

    /// Sends one transfer request and waits for its reply (unbounded here:
    /// the caller bounds it with the transfer timeout; dropping the future
    /// forgets the request). P's progress on it, if any, goes to `progress`.
    pub(crate) async fn request(
        &self,
        request: XferRequest,
        progress: Option<ProgressSink>,
    ) -> Result<XferReply, PullError> {
        let xfer_id = request.xfer_id;
        // A reused connection may have died since its last use, also without
        // this end knowing (P's end reset, ours not): retry once on a fresh
        // one. Safe even if P read the first copy: a request P already
        // claimed fails on the second (in flight, or no longer known), both
        // name the same grant, and the outcome is fenced.
        for attempt in 0..2 {
            let now = Instant::now();
            let (conn, reused) = self.connection(attempt > 0, now).await?;
            let (tx, rx) = oneshot::channel();
            match conn.lock_pending().as_mut() {
                Some(pending) => pending.insert(xfer_id, (tx, progress.clone())),
                None => continue, // its reader ended: the connection is gone
            };
            let _waiting = Waiting { conn: &conn, xfer_id };
            conn.touch(now);
            let mut guard = conn.sink.lock().await;
            let Some(sink) = guard.as_mut() else { continue };
            if let Err(e) = sink.send(SideMessage::XferRequest(request.clone())).await {
                if reused && attempt == 0 {
                    continue;
                }
                return Err(PullError::lost(format!("sending to {}: {e}", self.peer)));
            }
            drop(guard);
            return match rx.await {
                Ok(Ok(reply)) => Ok(reply),
                Ok(Err(Unanswered::Refused(reason))) => Err(PullError::new(FailureCause::PeerRefused, reason)),
                Ok(Err(Unanswered::ConnectionLost(error))) if reused && attempt == 0 => {
                    tracing::debug!(peer = %self.peer, xfer_id, reason = %error.reason, "reused side-channel connection lost; retrying on a new one");
                    continue;
                }
                Ok(Err(Unanswered::ConnectionLost(error))) => Err(error),
                Err(_) => Err(PullError::lost(format!("connection to {} closed", self.peer))),
            };
        }
        Err(PullError::lost(format!("connection to {} keeps closing", self.peer)))
    }

    /// Whether no one uses this client now, it holds no live connection
    /// (never connected, or its peer went away) and remembers no refusal:
    /// it may be forgotten.
    pub(crate) fn is_dead(&self) -> bool {
        match self.conn.try_lock() {
            Err(_) => false, // connecting or in use
            Ok(slot) => {
                slot.as_ref().is_none_or(|conn| conn.lock_pending().is_none())
                    && self.recent_refusal(Instant::now()).is_none()
            }
        }
    }

    /// Renews P's hold on `renewals` (no reply), in as many messages as
    /// frames need. Returns how long P holds them from now (zero: P takes
    /// no renewals, and nothing was sent).
    pub(crate) async fn keep_alive(&self, renewals: &[Renewing]) -> Result<Duration, String> {
        let now = Instant::now();
        let (conn, _) = self.connection(false, now).await.map_err(|e| e.reason)?;
        if conn.lease_renewal.is_zero() {
            return Ok(Duration::ZERO);
        }
        let mut guard = conn.sink.lock().await;
        let Some(sink) = guard.as_mut() else { return Err(format!("connection to {} closed", self.peer)) };
        conn.touch(now);
        for chunk in keep_alive_chunks(renewals, self.settings.max_frame_len) {
            sink.send(SideMessage::KeepAlive(KeepAlive { renewals: chunk.to_vec() }))
                .await
                .map_err(|e| format!("renewing on {}: {e}", self.peer))?;
        }
        Ok(conn.lease_renewal)
    }

    /// What this prefill worker's hello says of its instance and cache
    /// (connecting first if no connection is live at `now`).
    pub(crate) async fn peer_info(&self, now: Instant) -> Result<PeerInfo, PullError> {
        let (conn, _) = self.connection(false, now).await?;
        Ok(conn.peer.clone())
    }

    /// The live connection at `now` (and `true`: reused), or a new one.
    async fn connection(&self, fresh: bool, now: Instant) -> Result<(Arc<Connection>, bool), PullError> {
        let mut slot = self.conn.lock().await;
        if let Some(conn) = slot.take() {
            if !fresh && conn.usable(now) {
                *slot = Some(conn.clone());
                return Ok((conn, true));
            }
            conn.retired.cancel();
        }
        if let Some(error) = self.recent_refusal(now) {
            return Err(error);
        }
        let handshake = tokio::time::timeout(self.settings.connect_timeout, self.handshake()).await;
        let answered_at = Instant::now();
        let (framed, Accepted { idle_timeout, lease_renewal, peer }) = match handshake {
            Err(_) => {
                return Err(PullError::lost(format!(
                    "connecting to {} timed out after {:?}",
                    self.peer, self.settings.connect_timeout
                )))
            }
            Ok(Err(failure)) => {
                if failure.bad_tag {
                    self.settings.counts.tag_failed();
                } else if failure.error.cause == FailureCause::AuthFailed {
                    self.settings.counts.auth_failed();
                }
                if failure.refused {
                    tracing::error!(peer = %self.peer, cause = %failure.error.cause, reason = %failure.error.reason, "cannot use this prefill worker");
                    self.lock_refused().remember(failure.error.clone(), answered_at);
                }
                return Err(failure.error);
            }
            Ok(Ok(connected)) => connected,
        };
        let (sink, stream) = framed.split();
        let retired = self.cancel.child_token();
        let conn = Arc::new(Connection {
            sink: Mutex::new(Some(sink)),
            pending: std::sync::Mutex::new(Some(HashMap::new())),
            idleness: std::sync::Mutex::new(Idleness::new(idle_timeout, answered_at)),
            retired: retired.clone(),
            lease_renewal,
            peer,
            _open: self.settings.counts.opened(&self.peer.host),
        });
        let counts = self.settings.counts.clone();
        self.tracker.spawn(read_replies(self.peer.clone(), stream, conn.clone(), retired, counts));
        *slot = Some(conn.clone());
        Ok((conn, false))
    }

    fn lock_refused(&self) -> std::sync::MutexGuard<'_, RefusalMemory<PullError>> {
        self.refused.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// P's refusal, if it still stands at `now`.
    fn recent_refusal(&self, now: Instant) -> Option<PullError> {
        self.lock_refused().recent(now)
    }

    async fn handshake(&self) -> Result<(Framed<TcpStream, SideChannelCodec>, Accepted), HandshakeFailure> {
        let stream = TcpStream::connect((self.peer.host.as_str(), self.peer.port))
            .await
            .map_err(|e| HandshakeFailure::io(format!("cannot connect to prefill side channel {}: {e}", self.peer)))?;
        let _ = stream.set_nodelay(true);
        let mut framed = Framed::new(stream, SideChannelCodec::new(FrameCodec::new(self.settings.max_frame_len)));
        let client_nonce =
            auth::fresh_nonce().ok_or(HandshakeFailure::io("no OS randomness for the side-channel nonce"))?;
        let hello = Hello { client_nonce, ..self.settings.hello.clone() };
        let context = hello.auth_context();
        framed.send(SideMessage::Hello(hello)).await.map_err(|e| HandshakeFailure::io(e.to_string()))?;
        let mut reply = self.next_reply(&mut framed).await?;
        if let HelloReply::Challenge { server_nonce, server_proof } = reply {
            let Some(secret) = &self.settings.auth_secret else {
                return Err(HandshakeFailure::refused(
                    FailureCause::AuthFailed,
                    format!("prefill {} requires the side-channel shared secret; none is configured here", self.peer),
                ));
            };
            let transcript = Transcript {
                channel: Channel::SideChannel,
                client_nonce: &client_nonce,
                server_nonce: &server_nonce,
                context: &context,
            };
            if !auth::verify_server_proof(secret, &transcript, &server_proof) {
                return Err(HandshakeFailure::refused(
                    FailureCause::AuthFailed,
                    format!("prefill {} failed to prove the shared secret", self.peer),
                ));
            }
            let proof = auth::client_proof(secret, &transcript);
            framed.send(SideMessage::AuthProof(proof)).await.map_err(|e| HandshakeFailure::io(e.to_string()))?;
            // Every frame after the proof, both ways, carries its tag.
            let session = Session::derive(secret, &transcript, End::Client)
                .ok_or(HandshakeFailure::io("cannot derive the side-channel session keys"))?;
            framed.codec_mut().seal(session);
            reply = self.next_reply(&mut framed).await?;
        } else if self.settings.auth_secret.is_some() && matches!(reply, HelloReply::Accepted { .. }) {
            return Err(HandshakeFailure::refused(
                FailureCause::AuthFailed,
                format!("prefill {} did not authenticate (no shared secret configured there?)", self.peer),
            ));
        }
        match reply {
            HelloReply::Accepted { engine_id, idle_timeout, lease_renewal, topology, layout } => {
                tracing::debug!(
                    peer = %self.peer,
                    peer_engine = %engine_id,
                    ?idle_timeout,
                    ?lease_renewal,
                    ?topology,
                    "side channel connected"
                );
                Ok((framed, Accepted { idle_timeout, lease_renewal, peer: PeerInfo { engine_id, topology, layout } }))
            }
            HelloReply::Rejected { reason } => {
                let cause = rejection_cause(&reason);
                Err(HandshakeFailure::refused(cause, format!("prefill {} refused: {reason}", self.peer)))
            }
            HelloReply::Challenge { .. } => {
                Err(HandshakeFailure::refused(FailureCause::PeerRefused, format!("{} challenged twice", self.peer)))
            }
        }
    }

    async fn next_reply(
        &self,
        framed: &mut Framed<TcpStream, SideChannelCodec>,
    ) -> Result<HelloReply, HandshakeFailure> {
        match framed.next().await {
            Some(Ok(SideMessage::HelloReply(reply))) => Ok(reply),
            Some(Ok(_)) => Err(HandshakeFailure::refused(
                FailureCause::IncompatiblePeer,
                format!("{} sent something other than a hello reply", self.peer),
            )),
            // The connection failed (P went away mid-hello): ask again later.
            Some(Err(SideChannelError::Io(e))) => {
                Err(HandshakeFailure::io(format!("{} failed during hello: {e}", self.peer)))
            }
            // Undecodable (e.g. another protocol version): P speaks something else.
            Some(Err(e)) if is_bad_tag(&e) => Err(HandshakeFailure {
                bad_tag: true,
                ..HandshakeFailure::refused(FailureCause::AuthFailed, format!("{}: {e}", self.peer))
            }),
            Some(Err(e)) => {
                Err(HandshakeFailure::refused(FailureCause::IncompatiblePeer, format!("{}: {e}", self.peer)))
            }
            None => Err(HandshakeFailure::io(format!("{} closed the connection during hello", self.peer))),
        }
    }
}

/// The cause of P's refusal at the hello, from the reason P gave (P names
/// what it checked: an incompatible peer, a failed proof).
fn rejection_cause(reason: &str) -> FailureCause {
    if reason.starts_with(crate::side_channel::INCOMPATIBLE) || reason.contains("speaks side-channel version") {
        FailureCause::IncompatiblePeer
    } else if reason.contains("authentication") {
        FailureCause::AuthFailed
    } else {
        FailureCause::PeerRefused
    }
}

/// Whether a frame failed its authentication tag (altered or injected).
fn is_bad_tag(error: &SideChannelError) -> bool {
    matches!(error, SideChannelError::Frame(kv_proto::FrameError::BadTag(_)))
}

/// Splits `req_ids` into runs that each fit one frame of `max_frame_len`
/// (and the count bound P decodes).
fn keep_alive_chunks(renewals: &[Renewing], max_frame_len: usize) -> impl Iterator<Item = &[Renewing]> {
    // Per request: its id's bytes, a length prefix of at most 9, and its
    // key; half the frame leaves room for the enum tag and vector length.
    let budget = max_frame_len / 2;
    let mut rest = renewals;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut bytes = 0usize;
        let mut take = 0;
        for renewal in rest.iter().take(kv_proto::MAX_REQUESTS_PER_TRANSFER) {
            bytes = bytes.saturating_add(renewal.req_id.as_str().len() + 9 + kv_proto::RENEWAL_KEY_LEN);
            if take > 0 && bytes > budget {
                break;
            }
            take += 1;
        }
        let (chunk, tail) = rest.split_at(take);
        rest = tail;
        Some(chunk)
    })
}

/// A request awaiting its reply; forgotten when its waiter gives up (the
/// transfer timeout), so a peer that never answers leaves nothing behind.
struct Waiting<'a> {
    conn: &'a Connection,
    xfer_id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(pending) = self.conn.lock_pending().as_mut() {
            pending.remove(&self.xfer_id);
        }
    }
}

/// Routes replies to their waiters until the connection ends, then fails
/// every request still waiting on it and closes the socket.
async fn read_replies(
    peer: SideChannelAddr,
    mut stream: SplitStream<Framed<TcpStream, SideChannelCodec>>,
    conn: Arc<Connection>,
    cancel: CancellationToken,
    conn_counts: Arc<crate::side_channel::Counts>,
) {
    let ended = loop {
        let frame = tokio::select! {
            () = cancel.cancelled() => break PullError::lost("connection retired or decode worker shutting down"),
            frame = stream.next() => frame,
        };
        let (xfer_id, result) = match frame {
            Some(Ok(SideMessage::XferReply(reply))) => (reply.xfer_id, Ok(reply)),
            Some(Ok(SideMessage::XferRefused { xfer_id, reason })) => {
                (xfer_id, Err(Unanswered::Refused(format!("{peer} refused the transfer request: {reason}"))))
            }
            Some(Ok(SideMessage::XferProgress(progress))) => {
                conn.touch(Instant::now());
                let sink = conn.lock_pending().as_ref().and_then(|p| p.get(&progress.xfer_id)?.1.clone());
                match sink {
                    Some(sink) => sink(progress),
                    None => tracing::trace!(%peer, xfer_id = progress.xfer_id, "progress of no pending transfer"),
                }
                continue;
            }
            Some(Ok(_)) => break PullError::lost("unexpected message from prefill"),
            Some(Err(e)) if is_bad_tag(&e) => {
                conn_counts.tag_failed();
                break PullError::new(FailureCause::AuthFailed, format!("frame from prefill failed its tag: {e}"));
            }
            Some(Err(e)) => break PullError::lost(format!("bad frame from prefill: {e}")),
            None => break PullError::lost("prefill closed the connection"),
        };
        conn.touch(Instant::now());
        let waiter = conn.lock_pending().as_mut().and_then(|p| p.remove(&xfer_id));
        match waiter {
            Some((waiter, _)) => {
                let _ = waiter.send(result);
            }
            None => tracing::warn!(%peer, xfer_id, "reply to no pending transfer"),
        }
    };
    let pending = conn.lock_pending().take().unwrap_or_default();
    tracing::debug!(%peer, reason = %ended.reason, pending = pending.len(), "side-channel connection ended");
    for (_, (waiter, _)) in pending {
        let error = PullError::new(ended.cause, format!("{peer}: {}", ended.reason));
        let _ = waiter.send(Err(Unanswered::ConnectionLost(error)));
    }
    // Both halves gone: the socket closes now, not when the next request
    // finds the connection dead (a peer that went away is never asked again).
    drop(conn.sink.lock().await.take());
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_proto::ReqId;

    fn renewals(n: usize) -> Vec<Renewing> {
        let key = kv_proto::RenewalKey::from_bytes([1; kv_proto::RENEWAL_KEY_LEN]);
        (0..n).map(|i| Renewing { req_id: ReqId::new(format!("req-{i:06}")), key }).collect()
    }

    #[test]
    fn keep_alives_split_by_count_and_by_frame_size() {
        let many = renewals(kv_proto::MAX_REQUESTS_PER_TRANSFER + 5);
        let lens: Vec<usize> = keep_alive_chunks(&many, 1 << 24).map(<[Renewing]>::len).collect();
        assert_eq!(lens, [kv_proto::MAX_REQUESTS_PER_TRANSFER, 5]);
        // Each takes 10 bytes of id, 9 of prefix and 16 of key: 10 fit in 700 / 2.
        let lens: Vec<usize> = keep_alive_chunks(&many[..25], 700).map(<[Renewing]>::len).collect();
        assert_eq!(lens, [10, 10, 5]);
        for chunk in keep_alive_chunks(&many[..25], 700) {
            let mut frame = bytes::BytesMut::new();
            let message = SideMessage::KeepAlive(KeepAlive { renewals: chunk.to_vec() });
            assert!(FrameCodec::new(700).encode(&message, &mut frame).is_ok(), "a chunk fits its frame");
        }
        assert_eq!(keep_alive_chunks(&[], 1024).count(), 0);
    }
}
