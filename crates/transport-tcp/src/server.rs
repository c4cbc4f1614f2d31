//! The receiving side: the accept loop and one task per incoming connection.
//!
//! A connection's life: preamble → accept reply → batches until the peer
//! closes, the connection idles past `idle_timeout`, the peer breaks the
//! protocol, or the transport shuts down. A broken connection is logged and
//! closed; it never affects the listener or other connections.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kv_proto::auth::{self, AuthSecret};
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use crate::io::{read_exact, write_all, WireError};
use crate::memory::{is_closed_error, Cursor, DestinationError, Destinations};
use crate::nonce;
use crate::transport::Shared;
use crate::wire::{
    encode_reply, Accept, AcceptStatus, BatchHeader, Preamble, ReplyStatus, AUTH_FAILED, AUTH_OK, AUTH_TAG_LEN,
    BATCH_HEADER_LEN, FLAG_AUTH, OP_LEN, PREAMBLE_LEN, SUPPORTED_FLAGS, VERSION,
};

/// Pause after a failed `accept` (e.g. out of file descriptors) so the loop
/// does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Op-list entries read (and grown into) per step: memory follows the bytes
/// that actually arrive, not the count a peer announces.
const OPS_PER_READ: usize = 64 * 1024;
/// Op-list entries kept allocated between batches (1 MiB); a larger list is
/// freed once its batch is done.
const KEEP_OPS_CAPACITY: usize = 64 * 1024;
/// Scratch buffer for discarding a refused batch's payload.
const DRAIN_CHUNK: usize = 64 * 1024;

/// Why an incoming connection was closed.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("bad preamble magic {0:02x?} (not a kvlink data-plane client?)")]
    BadMagic([u8; 4]),
    #[error("peer speaks data-plane version {0}, this build speaks {VERSION}")]
    UnsupportedVersion(u16),
    #[error("peer requested unknown preamble flags {0:#06x}")]
    UnsupportedFlags(u16),
    #[error("batch {batch_id} announces {count} ops, more than the limit of {max}")]
    TooManyOps { batch_id: u64, count: u64, max: u64 },
    #[error("batch {batch_id}: op lengths add up to {}, the header says {declared}",
        .sum.map_or_else(|| "more than u64::MAX".to_owned(), |s| s.to_string()))]
    LengthMismatch { batch_id: u64, declared: u64, sum: Option<u64> },
    #[error("data-plane authentication failed: {0}")]
    AuthFailed(&'static str),
    #[error("the transport is shut down")]
    Closed,
}

/// Proves the shared secret to the sender and checks its proof; nothing of
/// a batch is read before this returns `Ok`.
async fn authenticate(
    stream: &mut TcpStream,
    secret: &AuthSecret,
    client_nonce: &[u8; AUTH_TAG_LEN],
    io_timeout: Duration,
) -> Result<(), ConnError> {
    let server_nonce = nonce::fresh().ok_or(ConnError::AuthFailed("no OS randomness for the nonce"))?;
    let mut challenge = [0u8; 2 * AUTH_TAG_LEN];
    challenge[..AUTH_TAG_LEN].copy_from_slice(&server_nonce);
    challenge[AUTH_TAG_LEN..].copy_from_slice(&auth::server_proof(secret.bytes(), client_nonce, &server_nonce));
    write_all(stream, &challenge, io_timeout, "authentication challenge").await?;
    let mut proof = [0u8; AUTH_TAG_LEN];
    read_exact(stream, &mut proof, io_timeout, "authentication proof").await?;
    let ok = auth::proofs_match(&auth::client_proof(secret.bytes(), &server_nonce, client_nonce), &proof);
    write_all(stream, &[if ok { AUTH_OK } else { AUTH_FAILED }], io_timeout, "authentication verdict").await?;
    if ok {
        Ok(())
    } else {
        Err(ConnError::AuthFailed("the sender's proof does not match the shared secret"))
    }
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
    loop {
        let accepted = tokio::select! {
            biased;
            () = shared.token.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let Ok(permit) = Arc::clone(&shared.conn_limit).try_acquire_owned() else {
                    warn!(%peer, limit = shared.config.max_connections, "connection limit reached, closing");
                    continue;
                };
                shared.accepted.fetch_add(1, Ordering::Relaxed);
                let task_shared = Arc::clone(&shared);
                shared.tracker.spawn(async move {
                    serve(&task_shared, stream, peer).await;
                    drop(permit);
                });
            }
            Err(error) => {
                warn!(listener = ?local, %error, "accept failed");
                tokio::select! {
                    biased;
                    () = shared.token.cancelled() => break,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
            }
        }
    }
    debug!(listener = ?local, "data-plane listener stopped");
}

async fn serve(shared: &Shared, mut stream: TcpStream, peer: SocketAddr) {
    if let Err(error) = stream.set_nodelay(true) {
        debug!(%peer, %error, "cannot set TCP_NODELAY");
    }
    let conn = Connection { shared, peer, ops: Vec::new() };
    let outcome = tokio::select! {
        biased;
        () = shared.token.cancelled() => Ok(End::Shutdown),
        outcome = conn.run(&mut stream) => outcome,
    };
    match outcome {
        Ok(end) => debug!(%peer, ?end, "data-plane connection closed"),
        Err(error) => warn!(%peer, %error, "closing data-plane connection"),
    }
}

struct Connection<'s> {
    shared: &'s Shared,
    peer: SocketAddr,
    /// The op list, reused from batch to batch.
    ops: Vec<[u8; OP_LEN]>,
}

impl Connection<'_> {
    async fn run(mut self, stream: &mut TcpStream) -> Result<End, ConnError> {
        let config = &self.shared.config;
        let io_timeout = config.io_timeout;
        let mut preamble = [0u8; PREAMBLE_LEN];
        read_exact(stream, &mut preamble, io_timeout, "preamble").await?;
        let preamble = Preamble::decode(&preamble).map_err(ConnError::BadMagic)?;
        let announced_auth = preamble.flags & FLAG_AUTH != 0;
        let (status, refusal) = if preamble.version != VERSION {
            (AcceptStatus::UnsupportedVersion, Some(ConnError::UnsupportedVersion(preamble.version)))
        } else if preamble.flags & !SUPPORTED_FLAGS != 0 {
            (AcceptStatus::UnsupportedFlags, Some(ConnError::UnsupportedFlags(preamble.flags)))
        } else if config.auth_secret.is_some() && !announced_auth {
            (AcceptStatus::AuthRequired, Some(ConnError::AuthFailed("the sender has no shared secret")))
        } else if config.auth_secret.is_none() && announced_auth {
            (AcceptStatus::AuthUnavailable, Some(ConnError::AuthFailed("no shared secret is configured here")))
        } else {
            (AcceptStatus::Accepted, None)
        };
        let mut client_nonce = [0u8; AUTH_TAG_LEN];
        if refusal.is_none() && announced_auth {
            read_exact(stream, &mut client_nonce, io_timeout, "authentication nonce").await?;
        }
        let accept = Accept {
            version: VERSION,
            status,
            max_ops_per_batch: config.max_ops_per_batch,
            idle_timeout_ms: u64::try_from(config.idle_timeout.as_millis()).unwrap_or(u64::MAX),
        };
        write_all(stream, &accept.encode(), io_timeout, "accept reply").await?;
        if let Some(refusal) = refusal {
            return Err(refusal);
        }
        if let Some(secret) = &config.auth_secret {
            authenticate(stream, secret, &client_nonce, io_timeout).await?;
        }

        loop {
            let mut probe = [0u8; 1];
            match tokio::time::timeout(config.idle_timeout, stream.peek(&mut probe)).await {
                Err(_) => return Ok(End::Idle),
                Ok(Ok(0)) => return Ok(End::PeerClosed),
                Ok(Ok(_)) => {}
                Ok(Err(source)) => return Err(WireError::Io { what: "batch header", source }.into()),
            }
            let mut header = [0u8; BATCH_HEADER_LEN];
            read_exact(stream, &mut header, io_timeout, "batch header").await?;
            self.batch(stream, BatchHeader::decode(&header)).await?;
        }
    }

    async fn batch(&mut self, stream: &mut TcpStream, header: BatchHeader) -> Result<(), ConnError> {
        let io_timeout = self.shared.config.io_timeout;
        let max = self.shared.config.max_ops_per_batch;
        let batch_id = header.batch_id;
        let count = match usize::try_from(header.op_count) {
            Ok(count) if header.op_count <= max => count,
            _ => {
                let error = ConnError::TooManyOps { batch_id, count: header.op_count, max };
                return Err(self.protocol_error(stream, batch_id, error).await);
            }
        };

        self.ops.clear();
        while self.ops.len() < count {
            let start = self.ops.len();
            self.ops.resize(start + (count - start).min(OPS_PER_READ), [0; OP_LEN]);
            let fresh = self.ops.get_mut(start..).unwrap_or_default();
            read_exact(stream, fresh.as_flattened_mut(), io_timeout, "op list").await?;
        }

        let list = std::mem::take(&mut self.ops);
        let result = match Destinations::check(&self.shared.memory, list, header.total_bytes) {
            Ok(destinations) => {
                let received = receive_payload(stream, &destinations, io_timeout).await;
                self.ops = destinations.into_list();
                received?;
                self.reply(stream, batch_id, ReplyStatus::Ok, "").await
            }
            Err((list, DestinationError::Outside { index, dst, len })) => {
                self.ops = list;
                let reason = format!("op {index}: destination {dst:#x}+{len} is outside the registered regions");
                warn!(peer = %self.peer, batch_id, %reason, "refusing batch");
                drain(stream, header.total_bytes, io_timeout).await?;
                self.reply(stream, batch_id, ReplyStatus::Refused, &reason).await
            }
            Err((list, DestinationError::LengthMismatch { declared, sum })) => {
                self.ops = list;
                let error = ConnError::LengthMismatch { batch_id, declared, sum };
                Err(self.protocol_error(stream, batch_id, error).await)
            }
            Err((_, DestinationError::Closed)) => Err(ConnError::Closed),
        };
        if self.ops.capacity() > KEEP_OPS_CAPACITY {
            self.ops = Vec::new();
        }
        result
    }

    async fn reply(
        &self,
        stream: &mut TcpStream,
        batch_id: u64,
        status: ReplyStatus,
        reason: &str,
    ) -> Result<(), ConnError> {
        let io_timeout = self.shared.config.io_timeout;
        write_all(stream, &encode_reply(batch_id, status, reason), io_timeout, "reply").await?;
        Ok(())
    }

    /// Tells the peer why its connection is being closed (best effort) and
    /// returns the error that closes it.
    async fn protocol_error(&self, stream: &mut TcpStream, batch_id: u64, error: ConnError) -> ConnError {
        if let Err(reply_error) = self.reply(stream, batch_id, ReplyStatus::ProtocolError, &error.to_string()).await {
            debug!(peer = %self.peer, error = %reply_error, "cannot report protocol error to peer");
        }
        error
    }
}

/// Reads the payload straight into the checked destinations.
async fn receive_payload(
    stream: &TcpStream,
    destinations: &Destinations<'_>,
    io_timeout: Duration,
) -> Result<(), ConnError> {
    let mut cursor = Cursor::new(0, destinations.total());
    while !cursor.is_done() {
        match stream.try_io(Interest::READABLE, || destinations.recv_from(stream.as_fd(), &mut cursor)) {
            Ok(0) => return Err(WireError::Eof { what: "payload", partial: true }.into()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                match tokio::time::timeout(io_timeout, stream.readable()).await {
                    Err(_) => return Err(WireError::Timeout { what: "payload", after: io_timeout }.into()),
                    Ok(Err(source)) => return Err(WireError::Io { what: "payload", source }.into()),
                    Ok(Ok(())) => {}
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_closed_error(&e) => return Err(ConnError::Closed),
            Err(source) => return Err(WireError::Io { what: "payload", source }.into()),
        }
    }
    Ok(())
}

/// Reads and discards a refused batch's payload, so the connection stays in
/// step and usable.
async fn drain(stream: &mut TcpStream, total: u64, io_timeout: Duration) -> Result<(), ConnError> {
    let chunk = usize::try_from(total).map_or(DRAIN_CHUNK, |t| t.min(DRAIN_CHUNK));
    let mut scratch = vec![0u8; chunk];
    let mut left = total;
    while left > 0 {
        let n = usize::try_from(left).map_or(chunk, |l| l.min(chunk));
        let part = scratch.get_mut(..n).unwrap_or_default();
        read_exact(stream, part, io_timeout, "refused payload").await?;
        left -= n as u64;
    }
    Ok(())
}
