//! The sending side: one reused connection per peer, and one batch on one
//! new bidirectional stream of it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use kv_proto::dataplane::{
    decode_verdict_header, put_op_list, Cursor, ReplyStatus, MAX_REASON_LEN, OP_LEN, VERDICT_HEADER_LEN,
};
use kv_proto::{GrantId, TransportError};
use quinn::{Connection, ConnectionError, ReadError, ReadExactError, RecvStream, SendStream, VarInt, WriteError};
use tracing::{debug, warn};

use crate::details::Fingerprint;
use crate::hello;
use crate::io::until_stalled;
use crate::memory::{self, Sources};
use crate::tls;
use crate::transport::Shared;
use crate::wire::{BatchHeader, ALPN, BATCH_HEADER_LEN, CLOSE_BAD_ALPN, CLOSE_SHUTDOWN, RESET_CANCELLED, SERVER_NAME};

/// Payload bytes gathered from source memory into one chunk handed to quinn.
const CHUNK: usize = 256 * 1024;

/// Which connection serves a peer: its address and the certificate pinned.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PeerKey {
    address: String,
    fingerprint: Fingerprint,
}

/// A peer's connection, if one is open; locked while connecting so that
/// concurrent batches to a new peer share one handshake.
type Slot = Arc<tokio::sync::Mutex<Option<Connection>>>;

/// Outgoing connections, one per peer.
#[derive(Debug, Default)]
pub(crate) struct Connections {
    slots: Mutex<HashMap<PeerKey, Slot>>,
}

impl Connections {
    fn lock(&self) -> MutexGuard<'_, HashMap<PeerKey, Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn slot(&self, key: &PeerKey) -> Slot {
        Arc::clone(self.lock().entry(key.clone()).or_default())
    }

    /// Drops `conn` from `key`'s slot if it is still there (the next batch
    /// reconnects); batches in flight on it go on.
    async fn forget(&self, key: &PeerKey, conn: &Connection) {
        let slot = self.slot(key);
        // Waits at most for another batch's connection attempt.
        let mut held = slot.lock().await;
        if held.as_ref().is_some_and(|c| c.stable_id() == conn.stable_id()) {
            *held = None;
            drop(held);
            self.remove_if_empty(key, &slot);
        }
    }

    /// Removes `key`'s entry if it is still `slot` and holds no connection,
    /// so peers that are gone do not accumulate.
    fn remove_if_empty(&self, key: &PeerKey, slot: &Slot) {
        let mut slots = self.lock();
        let empty = slots.get(key).is_some_and(|s| Arc::ptr_eq(s, slot) && s.try_lock().is_ok_and(|h| h.is_none()));
        if empty {
            slots.remove(key);
        }
    }

    /// Outgoing connections currently held open.
    pub(crate) fn open(&self) -> usize {
        self.lock()
            .values()
            .filter(|slot| slot.try_lock().is_ok_and(|held| held.as_ref().is_some_and(|c| c.close_reason().is_none())))
            .count()
    }

    /// Drops every connection.
    pub(crate) fn clear(&self) {
        self.lock().clear();
    }
}

/// How one attempt at a batch failed.
enum Failure {
    /// The connection is gone: forget it (and retry once if it was reused).
    Lost(ConnectionError),
    /// The peer stopped making progress: forget the connection, fail.
    Stalled(TransportError),
    /// The batch failed; the connection is fine.
    Batch(TransportError),
}

/// Writes one checked batch under `grant` to the peer at `address` whose
/// certificate has SHA-256 `fingerprint`, on its connection or a new one.
pub(crate) async fn write_batch(
    shared: &Shared,
    label: &str,
    address: &str,
    fingerprint: Fingerprint,
    grant: &GrantId,
    sources: &Sources<'_, '_>,
) -> Result<(), TransportError> {
    let key = PeerKey { address: address.to_owned(), fingerprint };
    let mut retried = false;
    loop {
        let (conn, reused) = connection(shared, &key, label).await?;
        match send_batch(shared, &conn, label, grant, sources).await {
            Ok(()) => return Ok(()),
            Err(Failure::Batch(error)) => return Err(error),
            Err(Failure::Stalled(error)) => {
                shared.connections.forget(&key, &conn).await;
                return Err(error);
            }
            Err(Failure::Lost(error)) => {
                shared.connections.forget(&key, &conn).await;
                // A connection the peer closed meanwhile (restart, idle
                // timeout): writes are idempotent, so the batch is sent again,
                // once, on a new connection (under the same grant, so the
                // receiver checks it again).
                if reused && !retried && !matches!(error, ConnectionError::LocallyClosed) {
                    debug!(peer = label, grant = %grant, %error, "reused connection was lost, retrying on a new one");
                    retried = true;
                    continue;
                }
                return Err(lost(shared, label, error));
            }
        }
    }
}

/// The error a lost connection reports.
fn lost(shared: &Shared, peer: &str, error: ConnectionError) -> TransportError {
    let peer = peer.to_owned();
    match error {
        ConnectionError::LocallyClosed => TransportError::Shutdown,
        ConnectionError::TimedOut => {
            TransportError::Timeout { peer, what: "connection (QUIC idle timeout)", after: shared.config.idle_timeout }
        }
        ConnectionError::ApplicationClosed(_) | ConnectionError::Reset => TransportError::PeerClosed { peer },
        other => TransportError::Io { peer, source: std::io::Error::other(other) },
    }
}

/// The open connection to `key`, or a new one; `true` if it was open before.
async fn connection(shared: &Shared, key: &PeerKey, label: &str) -> Result<(Connection, bool), TransportError> {
    let slot = shared.connections.slot(key);
    // Waits at most for another batch's connection attempt, itself bounded
    // by `connect_timeout`.
    let mut held = slot.lock().await;
    if let Some(conn) = held.as_ref().filter(|c| c.close_reason().is_none()) {
        return Ok((conn.clone(), true));
    }
    *held = None;
    let after = shared.config.connect_timeout;
    let connected = tokio::time::timeout(after, connect(shared, key, label))
        .await
        .map_err(|_| TransportError::Timeout { peer: label.to_owned(), what: "connect", after })
        .and_then(|connected| connected);
    let conn = match connected {
        Ok(conn) => conn,
        Err(error) => {
            drop(held);
            shared.connections.remove_if_empty(key, &slot);
            return Err(error);
        }
    };
    shared.opened.fetch_add(1, Ordering::Relaxed);
    debug!(peer = label, remote = %conn.remote_address(), "data-plane connection opened");
    *held = Some(conn.clone());
    Ok((conn, false))
}

async fn connect(shared: &Shared, key: &PeerKey, label: &str) -> Result<Connection, TransportError> {
    let connect_error = |reason: String| TransportError::Connect { peer: label.to_owned(), reason };
    let resolved: Vec<SocketAddr> = tokio::net::lookup_host(key.address.as_str())
        .await
        .map_err(|e| connect_error(format!("cannot resolve {}: {e}", key.address)))?
        .collect();
    // Prefer the family the socket is bound to.
    let v4 = shared.local_addr.is_ipv4();
    let addr = resolved
        .iter()
        .find(|a| a.is_ipv4() == v4)
        .or(resolved.first())
        .copied()
        .ok_or_else(|| connect_error(format!("{} resolves to no address", key.address)))?;
    let mut config = tls::pinned_client_config_with(Arc::clone(&shared.provider), key.fingerprint)
        .map_err(|e| connect_error(format!("TLS configuration: {e}")))?;
    config.transport_config(Arc::clone(&shared.client_transport_config));
    let connecting = shared
        .endpoint
        .connect_with(config, addr, SERVER_NAME)
        .map_err(|e| connect_error(format!("cannot connect to {addr}: {e}")))?;
    let conn = connecting.await.map_err(|e| match e {
        ConnectionError::LocallyClosed => TransportError::Shutdown,
        e => connect_error(format!("QUIC/TLS handshake with {addr} failed: {e}")),
    })?;
    let alpn = conn
        .handshake_data()
        .and_then(|data| data.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|data| data.protocol);
    if alpn.as_deref() != Some(ALPN) {
        conn.close(VarInt::from_u32(CLOSE_BAD_ALPN), b"ALPN kvlink-data/2 required");
        return Err(connect_error(format!("{addr} did not negotiate ALPN kvlink-data/2")));
    }
    // Within the caller's `connect_timeout`, like the handshake.
    if let Err(error) = hello::client(&conn, shared.config.auth_secret.as_ref()).await {
        if matches!(error, hello::HelloFailure::BadProof) {
            // The receiver's own proof is wrong: counted here, on this side.
            shared.memory.counters().auth_failed();
        }
        warn!(peer = label, remote = %addr, %error, "data-plane hello failed");
        if conn.close_reason().is_none() {
            conn.close(VarInt::from_u32(crate::wire::CLOSE_AUTH), b"hello failed");
        }
        return Err(connect_error(format!("data-plane hello with {addr} failed: {error}")));
    }
    Ok(conn)
}

/// One batch's stream. Dropped before the receiver's verdict (an error, a
/// bound run out, the `batch_write` future dropped), it resets the sending
/// side and stops the receiving side, so the receiver abandons the batch at
/// once instead of taking a truncated stream for a finished one (quinn
/// finishes a dropped stream).
struct BatchStream {
    send: SendStream,
    recv: RecvStream,
    answered: bool,
}

impl Drop for BatchStream {
    fn drop(&mut self) {
        if !self.answered {
            // Both fail only if the stream is already closed that way.
            let _ = self.send.reset(VarInt::from_u32(RESET_CANCELLED));
            let _ = self.recv.stop(VarInt::from_u32(RESET_CANCELLED));
        }
    }
}

/// Why a write on the batch's stream ended early.
enum WriteEnd {
    /// The receiver stopped the stream: its reply says why.
    Stopped,
    Failed(Failure),
}

fn write_failure(label: &str, error: WriteError) -> WriteEnd {
    match error {
        WriteError::Stopped(_) => WriteEnd::Stopped,
        WriteError::ConnectionLost(e) => WriteEnd::Failed(Failure::Lost(e)),
        other => WriteEnd::Failed(Failure::Batch(TransportError::Protocol {
            peer: label.to_owned(),
            reason: format!("stream write failed: {other}"),
        })),
    }
}

/// One write, bounded by the peer's progress: fails if the connection shows
/// none for `io_timeout`.
async fn write(
    shared: &Shared,
    conn: &Connection,
    send: &mut SendStream,
    label: &str,
    chunk: Bytes,
) -> Result<(), WriteEnd> {
    let after = shared.config.io_timeout;
    match until_stalled(conn, after, send.write_chunk(chunk)).await {
        None => Err(WriteEnd::Failed(Failure::Stalled(TransportError::Timeout {
            peer: label.to_owned(),
            what: "payload write",
            after,
        }))),
        Some(Err(error)) => Err(write_failure(label, error)),
        Some(Ok(())) => Ok(()),
    }
}

/// Sends header, op list and payload on a new stream, then waits for the
/// receiver's reply: `Ok` only once it says every byte is in its memory.
///
/// Bounds: while the payload flows (a stream slot, every write, then the
/// peer's acknowledgement of the whole stream) the wait ends if the
/// connection shows no progress for `io_timeout`; from the moment the peer
/// acknowledged the whole payload (or stopped the stream), its reply must
/// arrive within `io_timeout`, however much else it acknowledges.
async fn send_batch(
    shared: &Shared,
    conn: &Connection,
    label: &str,
    grant: &GrantId,
    sources: &Sources<'_, '_>,
) -> Result<(), Failure> {
    let after = shared.config.io_timeout;
    let stalled = |what| Failure::Stalled(TransportError::Timeout { peer: label.to_owned(), what, after });
    let (send, recv) = match until_stalled(conn, after, conn.open_bi()).await {
        None => return Err(stalled("a free stream on the connection")),
        Some(Err(error)) => return Err(Failure::Lost(error)),
        Some(Ok(streams)) => streams,
    };
    let mut stream = BatchStream { send, recv, answered: false };

    let ops = sources.ops();
    let mut prefix = Vec::with_capacity(BATCH_HEADER_LEN + ops.len() * OP_LEN);
    BatchHeader { grant: *grant, op_count: ops.len() as u64, total_bytes: sources.total() }.put(&mut prefix);
    put_op_list(&mut prefix, ops);
    let send = &mut stream.send;
    let sent = async {
        write(shared, conn, send, label, Bytes::from(prefix)).await?;
        let mut cursor = Cursor::new(sources.total());
        while !cursor.is_done() {
            let chunk = memory::gather(sources, &mut cursor, CHUNK)
                .map_err(|_| WriteEnd::Failed(Failure::Batch(TransportError::Shutdown)))?;
            write(shared, conn, send, label, chunk).await?;
        }
        // Fails only if the stream was stopped or reset: the reply says why.
        let _ = send.finish();
        Ok(())
    };
    match sent.await {
        Ok(()) | Err(WriteEnd::Stopped) => {}
        Err(WriteEnd::Failed(failure)) => return Err(failure),
    }

    // Resolves once the peer acknowledged every byte of the stream, or
    // stopped it.
    let delivered = stream.send.stopped();
    let reply = read_reply(&mut stream.recv, label);
    tokio::pin!(reply);
    let early = tokio::select! {
        biased;
        replied = &mut reply => Some(replied),
        delivered = until_stalled(conn, after, delivered) => match delivered {
            None => return Err(stalled("delivery of the payload")),
            Some(_) => None,
        },
    };
    let replied = match early {
        Some(replied) => replied,
        None => tokio::time::timeout(after, reply).await.map_err(|_| stalled("reply"))?,
    };
    // Any verdict, even a refusal, ends the stream cleanly.
    if !matches!(replied, Err(Failure::Lost(_)) | Err(Failure::Stalled(_))) {
        stream.answered = true;
    }
    replied
}

fn read_failure(label: &str, what: &str, error: ReadExactError) -> Failure {
    let peer = label.to_owned();
    match error {
        ReadExactError::ReadError(ReadError::ConnectionLost(e)) => Failure::Lost(e),
        ReadExactError::ReadError(ReadError::Reset(code)) if code.into_inner() == u64::from(CLOSE_SHUTDOWN) => {
            Failure::Batch(TransportError::PeerClosed { peer })
        }
        ReadExactError::FinishedEarly(_) => Failure::Batch(TransportError::Protocol {
            peer,
            reason: format!("the stream ended before the {what} was complete"),
        }),
        ReadExactError::ReadError(other) => {
            Failure::Batch(TransportError::Protocol { peer, reason: format!("reading the {what}: {other}") })
        }
    }
}

/// Reads the receiver's verdict (unbounded: the caller bounds it).
async fn read_reply(recv: &mut RecvStream, label: &str) -> Result<(), Failure> {
    let mut header = [0u8; VERDICT_HEADER_LEN];
    recv.read_exact(&mut header).await.map_err(|e| read_failure(label, "reply", e))?;
    let (status, reason_len) = decode_verdict_header(&header);
    let protocol_error = |reason: String| Failure::Batch(TransportError::Protocol { peer: label.to_owned(), reason });
    let reason_len = reason_len as usize;
    if reason_len > MAX_REASON_LEN {
        return Err(protocol_error(format!("reply reason of {reason_len} bytes exceeds {MAX_REASON_LEN}")));
    }
    let mut reason = vec![0u8; reason_len];
    recv.read_exact(&mut reason).await.map_err(|e| read_failure(label, "reply reason", e))?;
    let reason = String::from_utf8_lossy(&reason).into_owned();
    match status {
        ReplyStatus::Ok => Ok(()),
        ReplyStatus::Refused => Err(Failure::Batch(TransportError::Refused { peer: label.to_owned(), reason })),
        ReplyStatus::ProtocolError => Err(protocol_error(format!("the peer reports a protocol error: {reason}"))),
        ReplyStatus::Unknown(code) => Err(protocol_error(format!("unknown reply status {code}"))),
    }
}
