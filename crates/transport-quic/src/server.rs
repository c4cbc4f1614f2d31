//! The receiving side: the accept loop, one task per incoming connection,
//! and one task per incoming stream (one batch each).
//!
//! A bad stream (truncated, over the op limit, lengths that do not add up,
//! more payload than announced, stalled past `io_timeout`) is answered with
//! a protocol-error reply where the peer can still read it, stopped, and
//! logged; the connection and its other streams go on. A failed handshake or
//! a connection that breaks the QUIC protocol costs only that connection.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use quinn::{ConnectionError, Incoming, RecvStream, SendStream, VarInt};
use tracing::{debug, trace, warn};

use crate::io::{read_full, WireError};
use crate::memory::{Cursor, DestinationError, Destinations};
use crate::transport::Shared;
use crate::wire::{
    encode_reply, BatchHeader, ReplyStatus, ALPN, BATCH_HEADER_LEN, CLOSE_SHUTDOWN, OP_LEN, STOP_PROTOCOL, STOP_REFUSED,
};

/// Op-list entries read (and grown into) per step: memory follows the bytes
/// that actually arrive, not the count a peer announces.
const OPS_PER_READ: usize = 64 * 1024;
/// Received chunks taken from quinn per read.
const CHUNKS_PER_READ: usize = 32;
/// Connection close code for a handshake that did not negotiate [`ALPN`].
const CLOSE_BAD_ALPN: u32 = 4;

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
    #[error("more payload than the {total} bytes the header announces")]
    ExtraPayload { total: u64 },
    #[error("writing the reply: {0}")]
    Reply(#[source] quinn::WriteError),
    #[error("writing the reply timed out")]
    ReplyTimeout,
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
        let Ok(permit) = Arc::clone(&shared.conn_limit).try_acquire_owned() else {
            warn!(%peer, limit = shared.config.max_connections, "connection limit reached, refusing");
            incoming.refuse();
            continue;
        };
        let task_shared = Arc::clone(&shared);
        shared.tracker.spawn(async move {
            serve_connection(&task_shared, incoming, peer).await;
            drop(permit);
        });
    }
    debug!(local_addr = ?endpoint.local_addr().ok(), "data-plane listener stopped");
}

async fn serve_connection(shared: &Arc<Shared>, incoming: Incoming, peer: SocketAddr) {
    let connecting = match incoming.accept() {
        Ok(connecting) => connecting,
        Err(error) => {
            debug!(%peer, %error, "incoming connection failed");
            return;
        }
    };
    let after = shared.config.connect_timeout;
    let handshake = tokio::select! {
        biased;
        () = shared.token.cancelled() => return,
        handshake = tokio::time::timeout(after, connecting) => handshake,
    };
    let conn = match handshake {
        Err(_) => {
            warn!(%peer, ?after, "data-plane handshake timed out");
            return;
        }
        Ok(Err(error)) => {
            warn!(%peer, %error, "data-plane handshake failed");
            return;
        }
        Ok(Ok(conn)) => conn,
    };
    let alpn = conn
        .handshake_data()
        .and_then(|data| data.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|data| data.protocol);
    if alpn.as_deref() != Some(ALPN) {
        warn!(%peer, ?alpn, "peer did not negotiate the data-plane ALPN, closing");
        conn.close(VarInt::from_u32(CLOSE_BAD_ALPN), b"ALPN kvlink-data/1 required");
        return;
    }
    shared.accepted.fetch_add(1, Ordering::Relaxed);
    debug!(%peer, "data-plane connection accepted");
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
                warn!(%peer, %error, "data-plane connection lost");
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
            warn!(%peer, %stream, %error, "protocol error on data-plane stream");
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
        Err(error) => warn!(%peer, %stream, %error, "data-plane batch failed"),
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
        let config = &self.shared.config;
        let io_timeout = config.io_timeout;
        let mut header = [0u8; BATCH_HEADER_LEN];
        read_full(&mut self.recv, &mut header, io_timeout, "batch header").await?;
        let header = BatchHeader::decode(&header);
        let max = config.max_ops_per_batch;
        let count = match usize::try_from(header.op_count) {
            Ok(count) if header.op_count <= max => count,
            _ => return Err(StreamError::TooManyOps { count: header.op_count, max }),
        };

        let mut list: Vec<[u8; OP_LEN]> = Vec::new();
        while list.len() < count {
            let start = list.len();
            list.resize(start + (count - start).min(OPS_PER_READ), [0; OP_LEN]);
            let fresh = list.get_mut(start..).unwrap_or_default();
            read_full(&mut self.recv, fresh.as_flattened_mut(), io_timeout, "op list").await?;
        }

        match Destinations::check(&self.shared.memory, list, header.total_bytes) {
            Ok(destinations) => {
                self.receive_payload(&destinations).await?;
                drop(destinations);
                self.reply(ReplyStatus::Ok, "").await
            }
            Err((_, DestinationError::Outside { index, dst, len })) => {
                let reason = format!("op {index}: destination {dst:#x}+{len} is outside the registered regions");
                warn!(peer = %self.peer, stream = %self.recv.id(), %reason, "refusing batch");
                // Nothing of it is read: the sender stops on STOP_SENDING and
                // reads this reply.
                let _ = self.recv.stop(VarInt::from_u32(STOP_REFUSED));
                self.reply(ReplyStatus::Refused, &reason).await
            }
            Err((_, DestinationError::LengthMismatch { declared, sum })) => {
                Err(StreamError::LengthMismatch { declared, sum })
            }
            Err((_, DestinationError::Closed)) => Err(StreamError::Closed),
        }
    }

    /// Copies the payload, chunk by chunk as quinn hands it over, straight
    /// into the checked destinations.
    async fn receive_payload(&mut self, destinations: &Destinations<'_>) -> Result<(), StreamError> {
        let io_timeout = self.shared.config.io_timeout;
        let total = destinations.total();
        let mut cursor = Cursor::new(total);
        let mut chunks: [Bytes; CHUNKS_PER_READ] = std::array::from_fn(|_| Bytes::new());
        while !cursor.is_done() {
            let got = match tokio::time::timeout(io_timeout, self.recv.read_chunks(&mut chunks)).await {
                Err(_) => return Err(WireError::Timeout { what: "payload", after: io_timeout }.into()),
                Ok(Err(source)) => return Err(WireError::Read { what: "payload", source }.into()),
                Ok(Ok(None)) => {
                    return Err(WireError::Eof { what: "payload", partial: cursor.remaining() < total }.into())
                }
                Ok(Ok(Some(got))) => got,
            };
            for chunk in chunks.iter_mut().take(got) {
                let data = std::mem::take(chunk);
                let copied = destinations.scatter(&mut cursor, &data).map_err(|_| StreamError::Closed)?;
                if copied < data.len() {
                    return Err(StreamError::ExtraPayload { total });
                }
            }
        }
        // The stream must end with the payload (the FIN usually rides on the
        // last payload packet).
        match tokio::time::timeout(io_timeout, self.recv.read_chunk(1, true)).await {
            Err(_) => Err(WireError::Timeout { what: "end of stream", after: io_timeout }.into()),
            Ok(Err(source)) => Err(WireError::Read { what: "end of stream", source }.into()),
            Ok(Ok(Some(_))) => Err(StreamError::ExtraPayload { total }),
            Ok(Ok(None)) => Ok(()),
        }
    }

    async fn reply(&mut self, status: ReplyStatus, reason: &str) -> Result<(), StreamError> {
        let io_timeout = self.shared.config.io_timeout;
        let bytes = encode_reply(status, reason);
        match tokio::time::timeout(io_timeout, self.send.write_all(&bytes)).await {
            Err(_) => return Err(StreamError::ReplyTimeout),
            Ok(Err(error)) => return Err(StreamError::Reply(error)),
            Ok(Ok(())) => {}
        }
        // Finishing fails only if the stream was already reset; the reply
        // is then undeliverable anyway.
        let _ = self.send.finish();
        Ok(())
    }
}
