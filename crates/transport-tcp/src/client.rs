//! The sending side: the per-peer pool of idle connections, connection
//! set-up, and one batch on one connection.

use std::collections::HashMap;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kv_proto::auth;
use kv_proto::TransportError;
use socket2::SockRef;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tracing::debug;

use crate::io::{read_exact, write_all, WireError};
use crate::memory::{is_closed_error, Cursor, Sources};
use crate::nonce;
use crate::transport::Shared;
use crate::wire::{
    encode_op, Accept, AcceptStatus, BatchHeader, Preamble, ReplyHeader, ReplyStatus, ACCEPT_LEN, AUTH_OK,
    AUTH_TAG_LEN, BATCH_HEADER_LEN, FLAG_AUTH, MAX_REASON_LEN, OP_LEN, PREAMBLE_LEN, REPLY_HEADER_LEN, VERSION,
};

/// Header-and-op-list buffer capacity kept on a pooled connection; a larger
/// one (a batch of more than 64 Ki ops) is freed after use.
const KEEP_BUF_CAPACITY: usize = 1024 * 1024;

/// An outgoing connection that completed the preamble exchange.
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
}

/// Idle outgoing connections, by peer address.
#[derive(Debug)]
pub(crate) struct Pool {
    idle: Mutex<HashMap<String, Vec<Conn>>>,
    max_per_peer: usize,
}

impl Pool {
    /// A pool keeping at most `max_per_peer` idle connections per peer.
    pub(crate) fn new(max_per_peer: usize) -> Self {
        Self { idle: Mutex::new(HashMap::new()), max_per_peer }
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

    /// Keeps `conn` for reuse if `peer` has room.
    fn put(&self, peer: &str, mut conn: Conn) {
        if self.max_per_peer == 0 {
            return;
        }
        if conn.buf.capacity() > KEEP_BUF_CAPACITY {
            conn.buf = Vec::new();
        }
        conn.last_used = Instant::now();
        let mut idle = self.lock();
        let conns = idle.entry(peer.to_owned()).or_default();
        conns.retain(|c| c.last_used.elapsed() < c.retire_after);
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

/// Writes one checked batch to `peer`, on a pooled connection or a new one.
pub(crate) async fn write_batch(shared: &Shared, peer: &str, sources: &Sources<'_, '_>) -> Result<(), TransportError> {
    let batch_id = shared.next_batch_id.fetch_add(1, Ordering::Relaxed);
    let mut pooled = shared.pool.take(peer);
    loop {
        let reused = pooled.is_some();
        let mut conn = match pooled.take() {
            Some(conn) => conn,
            None => connect(shared, peer).await?,
        };
        let count = sources.ops().len() as u64;
        let limit = conn.max_ops;
        if count > limit {
            shared.pool.put(peer, conn);
            return Err(TransportError::Refused {
                peer: peer.to_owned(),
                reason: format!("a batch of {count} ops exceeds the peer's limit of {limit} ops per batch"),
            });
        }
        match send_batch(shared, &mut conn, peer, sources, batch_id).await {
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

/// Opens a connection and exchanges preamble and accept reply, all bounded
/// by `connect_timeout`.
async fn connect(shared: &Shared, peer: &str) -> Result<Conn, TransportError> {
    let after = shared.config.connect_timeout;
    let conn = tokio::time::timeout(after, open(shared, peer)).await.map_err(|_| TransportError::Timeout {
        peer: peer.to_owned(),
        what: "connect",
        after,
    })??;
    shared.opened.fetch_add(1, Ordering::Relaxed);
    debug!(peer, "data-plane connection opened");
    Ok(conn)
}

async fn open(shared: &Shared, peer: &str) -> Result<Conn, TransportError> {
    let connect_error = |reason: String| TransportError::Connect { peer: peer.to_owned(), reason };
    let mut stream = TcpStream::connect(peer).await.map_err(|e| connect_error(e.to_string()))?;
    stream.set_nodelay(true).map_err(|e| connect_error(format!("cannot set TCP_NODELAY: {e}")))?;
    let io_timeout = shared.config.io_timeout;
    let secret = shared.config.auth_secret.as_ref();
    let client_nonce = match secret {
        Some(_) => nonce::fresh().ok_or_else(|| connect_error("no OS randomness for the nonce".to_owned()))?,
        None => [0u8; AUTH_TAG_LEN],
    };
    let mut opening = Vec::with_capacity(PREAMBLE_LEN + AUTH_TAG_LEN);
    let flags = if secret.is_some() { FLAG_AUTH } else { 0 };
    opening.extend_from_slice(&Preamble { version: VERSION, flags }.encode());
    if secret.is_some() {
        opening.extend_from_slice(&client_nonce);
    }
    write_all(&mut stream, &opening, io_timeout, "preamble").await.map_err(|e| connect_error(e.to_string()))?;
    let mut reply = [0u8; ACCEPT_LEN];
    read_exact(&mut stream, &mut reply, io_timeout, "accept reply").await.map_err(|e| connect_error(e.to_string()))?;
    let accept = Accept::decode(&reply)
        .map_err(|magic| connect_error(format!("not a kvlink data-plane listener (magic {magic:02x?})")))?;
    let protocol_error = |reason: String| TransportError::Protocol { peer: peer.to_owned(), reason };
    match accept.status {
        AcceptStatus::Accepted if accept.version == VERSION => {}
        AcceptStatus::Accepted | AcceptStatus::UnsupportedVersion => {
            return Err(protocol_error(format!(
                "peer speaks data-plane version {}, this build speaks {VERSION}",
                accept.version
            )))
        }
        AcceptStatus::UnsupportedFlags => return Err(protocol_error("peer refused the preamble flags".to_owned())),
        AcceptStatus::AuthRequired => {
            return Err(connect_error("peer requires the data-plane shared secret; none is configured here".to_owned()))
        }
        AcceptStatus::AuthUnavailable => {
            return Err(connect_error(
                "peer has no data-plane shared secret; refusing to write to an unauthenticated peer".to_owned(),
            ))
        }
        AcceptStatus::Unknown(code) => return Err(protocol_error(format!("unknown accept status {code}"))),
    }
    if let Some(secret) = secret {
        let mut challenge = [0u8; 2 * AUTH_TAG_LEN];
        read_exact(&mut stream, &mut challenge, io_timeout, "authentication challenge")
            .await
            .map_err(|e| connect_error(e.to_string()))?;
        let (server_nonce, server_proof) = challenge.split_at(AUTH_TAG_LEN);
        let mut server_nonce_arr = [0u8; AUTH_TAG_LEN];
        server_nonce_arr.copy_from_slice(server_nonce);
        let mut server_proof_arr = [0u8; AUTH_TAG_LEN];
        server_proof_arr.copy_from_slice(server_proof);
        let expected = auth::server_proof(secret.bytes(), &client_nonce, &server_nonce_arr);
        if !auth::proofs_match(&expected, &server_proof_arr) {
            return Err(connect_error("peer failed to prove the data-plane shared secret".to_owned()));
        }
        let proof = auth::client_proof(secret.bytes(), &server_nonce_arr, &client_nonce);
        write_all(&mut stream, &proof, io_timeout, "authentication proof")
            .await
            .map_err(|e| connect_error(e.to_string()))?;
        let mut verdict = [0u8; 1];
        read_exact(&mut stream, &mut verdict, io_timeout, "authentication verdict")
            .await
            .map_err(|e| connect_error(e.to_string()))?;
        if verdict[0] != AUTH_OK {
            return Err(connect_error("peer refused our data-plane authentication".to_owned()));
        }
    }
    Ok(Conn {
        stream,
        max_ops: accept.max_ops_per_batch,
        retire_after: Duration::from_millis(accept.idle_timeout_ms / 2),
        last_used: Instant::now(),
        buf: Vec::new(),
    })
}

fn wire_error(peer: &str, error: WireError) -> TransportError {
    let peer = peer.to_owned();
    match error {
        WireError::Timeout { what, after } => TransportError::Timeout { peer, what, after },
        WireError::Eof { .. } => TransportError::PeerClosed { peer },
        WireError::Io { source, .. } => TransportError::Io { peer, source },
    }
}

/// Sends header, op list and payload, then waits for the acknowledgement.
async fn send_batch(
    shared: &Shared,
    conn: &mut Conn,
    peer: &str,
    sources: &Sources<'_, '_>,
    batch_id: u64,
) -> Result<(), TransportError> {
    let io_timeout = shared.config.io_timeout;
    let ops = sources.ops();
    let header = BatchHeader { batch_id, op_count: ops.len() as u64, total_bytes: sources.total() };
    conn.buf.clear();
    conn.buf.reserve(BATCH_HEADER_LEN + ops.len() * OP_LEN);
    conn.buf.extend_from_slice(&header.encode());
    for op in ops {
        conn.buf.extend_from_slice(&encode_op(op.dst, op.len));
    }

    let stream = &conn.stream;
    let prefix = conn.buf.as_slice();
    let mut cursor = Cursor::new(prefix.len(), sources.total());
    while !cursor.is_done() {
        match stream.try_io(Interest::WRITABLE, || sources.send_to(stream.as_fd(), prefix, &mut cursor)) {
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

    let mut reply = [0u8; REPLY_HEADER_LEN];
    read_exact(&mut conn.stream, &mut reply, io_timeout, "acknowledgement").await.map_err(|e| wire_error(peer, e))?;
    let reply = ReplyHeader::decode(&reply);
    let protocol_error = |reason: String| TransportError::Protocol { peer: peer.to_owned(), reason };
    let reason_len = reply.reason_len as usize;
    if reason_len > MAX_REASON_LEN {
        return Err(protocol_error(format!("reply reason of {reason_len} bytes exceeds {MAX_REASON_LEN}")));
    }
    let mut reason = vec![0u8; reason_len];
    read_exact(&mut conn.stream, &mut reason, io_timeout, "reply reason").await.map_err(|e| wire_error(peer, e))?;
    let reason = String::from_utf8_lossy(&reason).into_owned();
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
