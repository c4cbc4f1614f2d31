//! The sending side: the per-peer pool of idle connections and of places for
//! connections in their handshake, connection set-up (with authentication,
//! tried again when the receiver had no handshake place for this host), one
//! batch on one connection, and the two steps of a pre-checked part of a
//! split batch.

use std::collections::HashMap;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut};
use kv_net::{read_exact, write_all, WireError};
use kv_proto::auth::{self, Channel, Nonce, Transcript};
use kv_proto::dataplane::{put_op_list, ReplyStatus};
use kv_proto::session::{End, Session, StreamedFrame, FRAME_TAG_LEN};
use kv_proto::{GrantId, TransportError};
use socket2::SockRef;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::debug;

use crate::memory::{is_closed_error, send_to, Progress, Sources};
use crate::transport::Shared;
use crate::wire::{
    auth_context, Accept, AcceptStatus, BatchHeader, Preamble, ReplyHeader, ACCEPT_LEN, AUTH_BUSY, AUTH_OK,
    AUTH_TAG_LEN, BATCH_FLAG_PRECHECK, BATCH_HEADER_LEN, CHALLENGE_LEN, FLAG_AUTH, FLAG_PAYLOAD_AUTH, MAX_REASON_LEN,
    OP_LEN, REPLY_HEADER_LEN, VERSION,
};

/// Header-and-op-list buffer capacity kept on a pooled connection; a larger
/// one (a batch of more than 64 Ki ops) is freed after use.
const KEEP_BUF_CAPACITY: usize = 1024 * 1024;

/// The first wait before trying a connection again that the receiver closed
/// for want of a handshake place; each further wait doubles, up to
/// [`RETRY_MAX`]. A place frees as soon as another connection's handshake
/// ends, which takes a round trip or a few on a healthy receiver.
const RETRY_FIRST: Duration = Duration::from_millis(5);
/// The longest wait between two tries (all of them within `connect_timeout`).
const RETRY_MAX: Duration = Duration::from_millis(200);

/// An outgoing connection that completed the handshake.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: TcpStream,
    /// The peer's bound on ops per batch.
    max_ops: u64,
    /// Retire the connection once idle this long (half the peer's idle timeout).
    retire_after: Duration,
    last_used: Instant,
    /// Header and op list of the batch in flight, reused.
    buf: Vec<u8>,
    /// Tags every header, op list and reply, once authenticated.
    session: Option<Session>,
    /// Whether every payload is followed by its tag (announced in the
    /// preamble).
    tagged_payloads: bool,
}

impl Conn {
    /// Whether a pooled connection can carry another batch: not idle too
    /// long, and the peer has neither closed it nor sent anything unasked.
    fn is_reusable(&self) -> bool {
        if self.last_used.elapsed() >= self.retire_after {
            return false;
        }
        // A non-blocking peek straight on the socket (tokio's cached
        // readiness may not have seen a FIN yet): WouldBlock means open and
        // quiet.
        let mut probe = [MaybeUninit::<u8>::uninit(); 1];
        matches!(SockRef::from(&self.stream).peek(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Puts the batch header and the op list of `sources` into `buf`.
    fn encode_batch(&mut self, batch_id: u64, flags: u32, grant: GrantId, sources: &Sources<'_, '_>) {
        let ops = sources.ops();
        let header = BatchHeader {
            batch_id,
            flags,
            reserved: 0,
            op_count: ops.len() as u64,
            total_bytes: sources.total(),
            grant,
        };
        self.buf.clear();
        self.buf.reserve(BATCH_HEADER_LEN + ops.len() * OP_LEN + 2 * FRAME_TAG_LEN);
        let header = header.encode();
        self.buf.put_slice(&header);
        if let Some(session) = &mut self.session {
            self.buf.put_slice(&session.send.seal(&[&header]));
        }
        let op_list = self.buf.len();
        put_op_list(&mut self.buf, ops);
        if let Some(session) = &mut self.session {
            let tag = session.send.seal(&[&self.buf[op_list..]]);
            self.buf.put_slice(&tag);
        }
    }
}

impl Conn {
    /// The tag of the payload of `batch_id`, begun as the next frame this
    /// end sends (right after its header and op list), where payloads are
    /// tagged.
    fn begin_payload_tag(&self, batch_id: u64) -> Option<StreamedFrame> {
        let session = self.session.as_ref().filter(|_| self.tagged_payloads)?;
        Some(session.send.begin_streamed(batch_id))
    }

    /// Sends the tag of a payload just sent, if it was tagged.
    async fn send_payload_tag(
        &mut self,
        frame: Option<StreamedFrame>,
        peer: &str,
        io_timeout: Duration,
    ) -> Result<(), TransportError> {
        let (Some(frame), Some(session)) = (frame, self.session.as_mut()) else { return Ok(()) };
        let tag = session.send.seal_streamed(frame);
        write_all(&mut self.stream, &tag, io_timeout, "payload tag").await.map_err(|e| wire_error(peer, e))
    }
}

/// Idle outgoing connections, and places for connections in their
/// handshake, by peer address.
#[derive(Debug)]
pub(crate) struct Pool {
    idle: Mutex<HashMap<String, Vec<Conn>>>,
    max_per_peer: usize,
    /// Each peer's places for connections in their handshake; a peer's
    /// entry goes once no place of it is held.
    connecting: Mutex<HashMap<String, Arc<Semaphore>>>,
    max_connecting_per_peer: usize,
}

impl Pool {
    /// A pool keeping at most `max_per_peer` idle connections per peer, and
    /// at most `max_connecting_per_peer` (at least 1) connections to one
    /// peer in their handshake.
    pub(crate) fn new(max_per_peer: usize, max_connecting_per_peer: usize) -> Self {
        Self {
            idle: Mutex::new(HashMap::new()),
            max_per_peer,
            connecting: Mutex::new(HashMap::new()),
            max_connecting_per_peer: max_connecting_per_peer.clamp(1, Semaphore::MAX_PERMITS),
        }
    }

    /// A place for one connection to `peer` in its handshake, once one is
    /// free (the caller bounds the wait).
    async fn handshake_place(&self, peer: &str) -> Result<OwnedSemaphorePermit, TransportError> {
        let places = {
            let mut connecting = self.connecting.lock().unwrap_or_else(PoisonError::into_inner);
            // A peer no connection is being opened to holds no entry (a
            // place holds its semaphore, so the map's is then the only one).
            connecting.retain(|_, places| Arc::strong_count(places) > 1);
            let max = self.max_connecting_per_peer;
            Arc::clone(connecting.entry(peer.to_owned()).or_insert_with(|| Arc::new(Semaphore::new(max))))
        };
        // Never closed: an error cannot happen, and would mean shut down.
        places.acquire_owned().await.map_err(|_| TransportError::Shutdown)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<Conn>>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently used live connection to `peer`, if any.
    fn take(&self, peer: &str) -> Option<Conn> {
        loop {
            let conn = {
                let mut idle = self.lock();
                let conns = idle.get_mut(peer)?;
                let conn = conns.pop();
                if conns.is_empty() {
                    idle.remove(peer);
                }
                conn?
            };
            if conn.is_reusable() {
                return Some(conn);
            }
            debug!(peer, "dropping stale pooled connection");
        }
    }

    /// Keeps `conn` for reuse if `peer` has room. Idle connections of every
    /// peer that closed or outlived their use are dropped meanwhile: a peer
    /// that went away (its process died, its port changed) is never asked
    /// for again, and its connections must not stay open.
    fn put(&self, peer: &str, mut conn: Conn) {
        if self.max_per_peer == 0 {
            return;
        }
        if conn.buf.capacity() > KEEP_BUF_CAPACITY {
            conn.buf = Vec::new();
        }
        conn.last_used = Instant::now();
        let mut idle = self.lock();
        idle.retain(|_, conns| {
            conns.retain(Conn::is_reusable);
            !conns.is_empty()
        });
        let conns = idle.entry(peer.to_owned()).or_default();
        if conns.len() < self.max_per_peer {
            conns.push(conn);
        }
    }

    /// Idle connections held, over all peers.
    pub(crate) fn len(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// Drops every idle connection.
    pub(crate) fn clear(&self) {
        self.lock().clear();
    }
}

/// A pooled connection, or a new one; whether it was pooled.
async fn checkout(shared: &Shared, peer: &str, pooled: &mut Option<Conn>) -> Result<(Conn, bool), TransportError> {
    match pooled.take() {
        Some(conn) => Ok((conn, true)),
        None => connect(shared, peer).await,
    }
}

/// `Refused` if the batch has more ops than the peer accepts.
fn check_op_limit(conn: &Conn, peer: &str, sources: &Sources<'_, '_>) -> Result<(), TransportError> {
    let count = sources.ops().len() as u64;
    let limit = conn.max_ops;
    if count > limit {
        return Err(TransportError::Refused {
            peer: peer.to_owned(),
            reason: format!("a batch of {count} ops exceeds the peer's limit of {limit} ops per batch"),
        });
    }
    Ok(())
}

/// Writes one checked batch to `peer` under `grant` (header, op list and
/// payload in one go, then the acknowledgement), on a pooled connection or a
/// new one.
pub(crate) async fn write_batch(
    shared: &Shared,
    peer: &str,
    grant: GrantId,
    sources: &Sources<'_, '_>,
) -> Result<(), TransportError> {
    let batch_id = shared.next_batch_id.fetch_add(1, Ordering::Relaxed);
    let io_timeout = shared.config.io_timeout;
    let mut pooled = shared.pool.take(peer);
    loop {
        let (mut conn, reused) = checkout(shared, peer, &mut pooled).await?;
        if let Err(refused) = check_op_limit(&conn, peer, sources) {
            shared.pool.put(peer, conn);
            return Err(refused);
        }
        conn.encode_batch(batch_id, 0, grant, sources);
        let mut tag = conn.begin_payload_tag(batch_id);
        let sent = async {
            let progress = Progress::new(conn.buf.len(), sources.total());
            send(&conn.stream, peer, sources, &conn.buf, progress, io_timeout, tag.as_mut()).await?;
            conn.send_payload_tag(tag, peer, io_timeout).await?;
            read_reply(shared, &mut conn, peer, batch_id).await
        }
        .await;
        match sent {
            Ok(()) => {
                shared.pool.put(peer, conn);
                return Ok(());
            }
            Err(refused @ TransportError::Refused { .. }) => {
                shared.pool.put(peer, conn);
                return Err(refused);
            }
            // A pooled connection the peer closed meanwhile (restart, idle
            // timeout racing the liveness probe): writes are idempotent, so
            // the batch is sent again, once, on a new connection.
            Err(error) if reused && is_stale(&error) => {
                debug!(peer, %error, "pooled connection was closed by the peer, retrying on a new one");
            }
            Err(error) => return Err(error),
        }
    }
}

/// A part of a split batch whose header (asking for an admission verdict)
/// and op list are sent; [`verdict`] reads the receiver's answer.
#[derive(Debug)]
pub(crate) struct Asked {
    conn: Conn,
    reused: bool,
    batch_id: u64,
}

/// A part of a split batch that the receiver admitted: its payload may
/// follow on `conn`. Dropping it abandons the part (the connection closes
/// before any payload byte, and the receiver writes nothing).
#[derive(Debug)]
pub(crate) struct Admitted {
    conn: Conn,
    batch_id: u64,
}

/// Sends the header (asking for an admission verdict) and the op list of
/// one part of a split batch, on a pooled connection or a new one. The
/// verdict is read by [`verdict`], so the parts' questions travel at once.
pub(crate) async fn ask(
    shared: &Shared,
    peer: &str,
    grant: GrantId,
    sources: &Sources<'_, '_>,
) -> Result<Asked, TransportError> {
    let batch_id = shared.next_batch_id.fetch_add(1, Ordering::Relaxed);
    let (conn, reused) = checkout(shared, peer, &mut shared.pool.take(peer)).await?;
    send_question(shared, peer, grant, sources, conn, reused, batch_id).await
}

async fn send_question(
    shared: &Shared,
    peer: &str,
    grant: GrantId,
    sources: &Sources<'_, '_>,
    mut conn: Conn,
    reused: bool,
    batch_id: u64,
) -> Result<Asked, TransportError> {
    if let Err(refused) = check_op_limit(&conn, peer, sources) {
        shared.pool.put(peer, conn);
        return Err(refused);
    }
    conn.encode_batch(batch_id, BATCH_FLAG_PRECHECK, grant, sources);
    let prefix = Progress::new(conn.buf.len(), 0);
    send(&conn.stream, peer, sources, &conn.buf, prefix, shared.config.io_timeout, None).await?;
    Ok(Asked { conn, reused, batch_id })
}

/// Reads the admission verdict of an [`ask`]ed part. `Refused` leaves the
/// connection pooled: nothing of the part is sent after a refusal. A pooled
/// connection the peer had closed is asked again, once, on a new one
/// (nothing of the part was admitted on it).
pub(crate) async fn verdict(
    shared: &Shared,
    peer: &str,
    grant: GrantId,
    sources: &Sources<'_, '_>,
    asked: Asked,
) -> Result<Admitted, TransportError> {
    let mut asked = asked;
    loop {
        let Asked { mut conn, reused, batch_id } = asked;
        match read_reply(shared, &mut conn, peer, batch_id).await {
            Ok(()) => return Ok(Admitted { conn, batch_id }),
            Err(refused @ TransportError::Refused { .. }) => {
                shared.pool.put(peer, conn);
                return Err(refused);
            }
            Err(error) if reused && is_stale(&error) => {
                debug!(peer, %error, "pooled connection was closed by the peer, asking again on a new one");
                let (conn, reused) = connect(shared, peer).await?;
                asked = send_question(shared, peer, grant, sources, conn, reused, batch_id).await?;
            }
            Err(error) => return Err(error),
        }
    }
}

/// Sends an admitted part's payload and waits for its acknowledgement.
pub(crate) async fn finish(
    shared: &Shared,
    peer: &str,
    admitted: Admitted,
    sources: &Sources<'_, '_>,
) -> Result<(), TransportError> {
    let io_timeout = shared.config.io_timeout;
    let Admitted { mut conn, batch_id } = admitted;
    let mut tag = conn.begin_payload_tag(batch_id);
    send(&conn.stream, peer, sources, &[], Progress::new(0, sources.total()), io_timeout, tag.as_mut()).await?;
    conn.send_payload_tag(tag, peer, io_timeout).await?;
    let result = read_reply(shared, &mut conn, peer, batch_id).await;
    if matches!(result, Ok(()) | Err(TransportError::Refused { .. })) {
        shared.pool.put(peer, conn);
    }
    result
}

fn is_stale(error: &TransportError) -> bool {
    match error {
        TransportError::PeerClosed { .. } => true,
        TransportError::Io { source, .. } => matches!(
            source.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted | io::ErrorKind::BrokenPipe
        ),
        _ => false,
    }
}

/// A connection to `peer` that completed its handshake, all within
/// `connect_timeout`: it waits for one of the peer's handshake places
/// ([`TcpConfig::max_connecting_per_peer`](crate::TcpConfig)), then takes a
/// connection another batch put back meanwhile, if any (whether it did is
/// returned), or opens one. A connection the receiver closed before its
/// accept reply (no handshake place for this host) is tried again after a
/// backoff.
async fn connect(shared: &Shared, peer: &str) -> Result<(Conn, bool), TransportError> {
    let after = shared.config.connect_timeout;
    let mut refused: Option<TransportError> = None;
    let attempts = async {
        let mut backoff = RETRY_FIRST;
        loop {
            let place = shared.pool.handshake_place(peer).await?;
            if let Some(conn) = shared.pool.take(peer) {
                return Ok((conn, true));
            }
            match open(shared, peer).await {
                Ok(conn) => return Ok((conn, false)),
                Err(Opening::NoPlace(error)) => {
                    drop(place);
                    debug!(peer, %error, ?backoff, "the receiver closed a new connection before answering; trying again");
                    refused = Some(error);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
                Err(Opening::Failed(error)) => return Err(error),
            }
        }
    };
    let connected = tokio::time::timeout(after, attempts).await;
    let (conn, reused) = match connected {
        Ok(connected) => connected?,
        Err(_) => {
            return Err(match refused {
                Some(TransportError::Connect { peer, reason }) => TransportError::Connect {
                    peer,
                    reason: format!(
                        "{reason}, every try for {after:?} (its handshake places for this host stay taken: see \
                         its limits.max_handshakes_per_host)"
                    ),
                },
                _ => TransportError::Timeout { peer: peer.to_owned(), what: "connect", after },
            })
        }
    };
    if !reused {
        shared.opened.fetch_add(1, Ordering::Relaxed);
        debug!(peer, "data-plane connection opened");
    }
    Ok((conn, reused))
}

/// How opening a connection failed.
enum Opening {
    /// The receiver closed it before its accept reply: no handshake place
    /// for this host now (or it is going away). Worth another try.
    NoPlace(TransportError),
    /// Any other failure: the answer stands.
    Failed(TransportError),
}

impl From<TransportError> for Opening {
    fn from(error: TransportError) -> Self {
        Opening::Failed(error)
    }
}

/// Whether `error`, before the accept reply, is the receiver closing the
/// connection at once (what it does to a connection it has no handshake
/// place for).
fn closed_at_once(error: &WireError) -> bool {
    match error {
        WireError::Eof { .. } => true,
        WireError::Io { source, .. } => matches!(
            source.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted | io::ErrorKind::BrokenPipe
        ),
        WireError::Timeout { .. } => false,
    }
}

async fn open(shared: &Shared, peer: &str) -> Result<Conn, Opening> {
    let connect_error = |reason: String| TransportError::Connect { peer: peer.to_owned(), reason };
    let wire = |e: WireError| connect_error(e.to_string());
    let before_reply = |e: WireError| {
        if closed_at_once(&e) {
            Opening::NoPlace(connect_error(format!("the receiver closed the connection before answering ({e})")))
        } else {
            Opening::Failed(wire(e))
        }
    };
    let mut stream = TcpStream::connect(peer).await.map_err(|e| connect_error(e.to_string()))?;
    stream.set_nodelay(true).map_err(|e| connect_error(format!("cannot set TCP_NODELAY: {e}")))?;
    let io_timeout = shared.config.io_timeout;
    let secret = shared.config.auth_secret.as_ref();
    let client_nonce: Nonce = match secret {
        Some(_) => auth::fresh_nonce().ok_or_else(|| connect_error("no OS randomness for the nonce".to_owned()))?,
        None => [0u8; AUTH_TAG_LEN],
    };
    // Payload tags need the session a secret makes (`bind` checks it).
    let tagged_payloads = secret.is_some() && shared.config.authenticate_payloads;
    let flags = match (secret.is_some(), tagged_payloads) {
        (true, true) => FLAG_AUTH | FLAG_PAYLOAD_AUTH,
        (true, false) => FLAG_AUTH,
        (false, _) => 0,
    };
    let preamble = Preamble { version: VERSION, flags }.encode();
    let mut opening = Vec::with_capacity(preamble.len() + AUTH_TAG_LEN);
    opening.put_slice(&preamble);
    if secret.is_some() {
        opening.put_slice(&client_nonce);
    }
    write_all(&mut stream, &opening, io_timeout, "preamble").await.map_err(before_reply)?;
    let mut accept_bytes = [0u8; ACCEPT_LEN];
    read_exact(&mut stream, &mut accept_bytes, io_timeout, "accept reply").await.map_err(before_reply)?;
    let accept = Accept::decode(&accept_bytes)
        .map_err(|magic| connect_error(format!("not a kvlink data-plane listener (magic {magic:02x?})")))?;
    let protocol_error = |reason: String| TransportError::Protocol { peer: peer.to_owned(), reason };
    match accept.status {
        AcceptStatus::Accepted if accept.version == VERSION => {}
        AcceptStatus::Accepted | AcceptStatus::UnsupportedVersion => {
            return Err(protocol_error(format!(
                "peer speaks data-plane version {}, this build speaks {VERSION}",
                accept.version
            ))
            .into())
        }
        AcceptStatus::UnsupportedFlags => {
            return Err(protocol_error("peer refused the preamble flags".to_owned()).into())
        }
        AcceptStatus::AuthRequired => {
            return Err(
                connect_error("peer requires the data-plane shared secret; none is configured here".to_owned()).into()
            )
        }
        AcceptStatus::AuthUnavailable => {
            return Err(connect_error(
                "peer has no data-plane shared secret; refusing to write to an unauthenticated peer".to_owned(),
            )
            .into())
        }
        AcceptStatus::Busy => return Err(busy(peer).into()),
        AcceptStatus::PayloadAuthRequired => {
            return Err(connect_error(
                "peer requires authenticated payloads (TcpConfig::authenticate_payloads); this sender does not tag \
                 them"
                    .to_owned(),
            )
            .into())
        }
        AcceptStatus::Unknown(code) => return Err(protocol_error(format!("unknown accept status {code}")).into()),
    }
    let mut session = None;
    if let Some(secret) = secret {
        let mut challenge = [0u8; CHALLENGE_LEN];
        read_exact(&mut stream, &mut challenge, io_timeout, "authentication challenge").await.map_err(wire)?;
        let mut server_nonce: Nonce = [0u8; AUTH_TAG_LEN];
        let mut server_proof = &challenge[..];
        server_proof.copy_to_slice(&mut server_nonce);
        let context = auth_context(&preamble, &accept_bytes);
        let transcript = Transcript {
            channel: Channel::DataTcp,
            client_nonce: &client_nonce,
            server_nonce: &server_nonce,
            context: &context,
        };
        if !auth::verify_server_proof(secret, &transcript, server_proof) {
            // The receiver's own proof is wrong: counted here, on this side.
            shared.memory.counters().auth_failed();
            return Err(connect_error("peer failed to prove the data-plane shared secret".to_owned()).into());
        }
        let proof = auth::client_proof(secret, &transcript);
        write_all(&mut stream, &proof, io_timeout, "authentication proof").await.map_err(wire)?;
        let mut verdict = [0u8; 1];
        read_exact(&mut stream, &mut verdict, io_timeout, "authentication verdict").await.map_err(wire)?;
        match verdict[0] {
            AUTH_OK => {}
            AUTH_BUSY => return Err(busy(peer).into()),
            _ => return Err(connect_error("peer refused our data-plane authentication".to_owned()).into()),
        }
        // Every header, op list and reply from now on carries its tag.
        session = Some(
            Session::derive(secret, &transcript, End::Client)
                .ok_or_else(|| connect_error("cannot derive the data-plane session keys".to_owned()))?,
        );
    }
    Ok(Conn {
        stream,
        max_ops: accept.max_ops_per_batch,
        retire_after: Duration::from_millis(accept.idle_timeout_ms / 2),
        last_used: Instant::now(),
        buf: Vec::new(),
        session,
        tagged_payloads,
    })
}

/// The receiver serves its most connections already.
fn busy(peer: &str) -> TransportError {
    TransportError::Connect {
        peer: peer.to_owned(),
        reason: "the receiver serves its maximum of data-plane connections (TcpConfig::limits.max_connections) already"
            .to_owned(),
    }
}

fn wire_error(peer: &str, error: WireError) -> TransportError {
    let peer = peer.to_owned();
    match error {
        WireError::Timeout { what, after } => TransportError::Timeout { peer, what, after },
        WireError::Eof { .. } => TransportError::PeerClosed { peer },
        WireError::Io { source, .. } => TransportError::Io { peer, source },
    }
}

/// Sends `prefix` then the payload from `progress` on, with vectored
/// writes straight from the source memory, feeding the payload to `tag`
/// where it is tagged; each stall bounded by `io_timeout`.
async fn send(
    stream: &TcpStream,
    peer: &str,
    sources: &Sources<'_, '_>,
    prefix: &[u8],
    mut progress: Progress,
    io_timeout: Duration,
    mut tag: Option<&mut StreamedFrame>,
) -> Result<(), TransportError> {
    while !progress.is_done() {
        let attempt = stream
            .try_io(Interest::WRITABLE, || send_to(sources, stream.as_fd(), prefix, &mut progress, tag.as_deref_mut()));
        match attempt {
            Ok(0) => {
                let source = io::Error::new(io::ErrorKind::WriteZero, "the socket accepted no bytes");
                return Err(TransportError::Io { peer: peer.to_owned(), source });
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                match tokio::time::timeout(io_timeout, stream.writable()).await {
                    Err(_) => {
                        return Err(wire_error(peer, WireError::Timeout { what: "payload write", after: io_timeout }))
                    }
                    Ok(Err(source)) => return Err(TransportError::Io { peer: peer.to_owned(), source }),
                    Ok(Ok(())) => {}
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_closed_error(&e) => return Err(TransportError::Shutdown),
            Err(source) => return Err(TransportError::Io { peer: peer.to_owned(), source }),
        }
    }
    Ok(())
}

/// Reads the receiver's reply to `batch_id` (an acknowledgement, or the
/// admission verdict of a pre-checked part); `Ok` only for status Ok. A
/// reply that fails its tag is counted ([`kv_proto::TransportCounters::tag_failed`]).
async fn read_reply(shared: &Shared, conn: &mut Conn, peer: &str, batch_id: u64) -> Result<(), TransportError> {
    let io_timeout = shared.config.io_timeout;
    let stream = &mut conn.stream;
    let mut header = [0u8; REPLY_HEADER_LEN];
    read_exact(stream, &mut header, io_timeout, "acknowledgement").await.map_err(|e| wire_error(peer, e))?;
    let reply = ReplyHeader::decode(&header);
    let protocol_error = |reason: String| TransportError::Protocol { peer: peer.to_owned(), reason };
    let reason_len = reply.reason_len as usize;
    if reason_len > MAX_REASON_LEN {
        return Err(protocol_error(format!("reply reason of {reason_len} bytes exceeds {MAX_REASON_LEN}")));
    }
    let mut reason = [0u8; MAX_REASON_LEN];
    let reason = reason.get_mut(..reason_len).unwrap_or_default();
    read_exact(stream, reason, io_timeout, "reply reason").await.map_err(|e| wire_error(peer, e))?;
    if let Some(session) = &mut conn.session {
        let mut tag = [0u8; FRAME_TAG_LEN];
        read_exact(stream, &mut tag, io_timeout, "reply tag").await.map_err(|e| wire_error(peer, e))?;
        session.recv.open(&[&header, reason], &tag).map_err(|bad| {
            shared.memory.counters().tag_failed();
            protocol_error(bad.to_string())
        })?;
    }
    let reason = String::from_utf8_lossy(reason).into_owned();
    if reply.batch_id != batch_id {
        return Err(protocol_error(format!(
            "reply names batch {} while batch {batch_id} is in flight",
            reply.batch_id
        )));
    }
    match reply.status {
        ReplyStatus::Ok => Ok(()),
        ReplyStatus::Refused => Err(TransportError::Refused { peer: peer.to_owned(), reason }),
        ReplyStatus::ProtocolError => Err(protocol_error(format!("the peer closed the connection: {reason}"))),
        ReplyStatus::Unknown(code) => Err(protocol_error(format!("unknown reply status {code}"))),
    }
}
