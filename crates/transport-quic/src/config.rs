//! [`QuicConfig`]: where to listen and every bound the transport keeps.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use kv_proto::auth::AuthSecret;

/// Default bound on the ops of one incoming batch (16 Mi ops: a 256 MiB op list).
pub const DEFAULT_MAX_OPS_PER_BATCH: u64 = 16 * 1024 * 1024;

/// Configuration of a [`crate::QuicTransport`]. Every wait the transport
/// makes is bounded by one of these durations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuicConfig {
    /// Where the UDP socket binds (default `127.0.0.1:0`: loopback, any free
    /// port). The socket serves incoming and outgoing connections alike.
    pub listen_addr: SocketAddr,
    /// Host put in the advertised [`kv_proto::Endpoint`] (default: the bound
    /// IP). Set it when binding a wildcard address such as `0.0.0.0`.
    pub advertise_host: Option<String>,
    /// One deadline for establishing a connection: name resolution, the
    /// QUIC/TLS handshake and the hello (with the shared-secret exchange, if
    /// any), on either side (default 5 s). No batch is sent or served on a
    /// connection before its hello completed.
    pub connect_timeout: Duration,
    /// Bound on the data plane's waits (default 30 s).
    ///
    /// Sender, while its payload flows (a free stream slot, flow-control
    /// credit, the peer's acknowledgement of every byte): a stall bound, any
    /// acknowledgement or credit from the peer restarts it, so a large batch
    /// on a slow link is not cut off. Once the peer has acknowledged the whole
    /// payload (or stopped the stream), the reply must arrive within this
    /// absolute bound: a receiver that keeps acknowledging but never answers
    /// cannot hold the batch (and the sender's blocks) any longer.
    ///
    /// Receiver: a bound on each wait for the next bytes of a stream, and on
    /// writing a reply.
    pub io_timeout: Duration,
    /// QUIC idle timeout: a connection with no packets either way for this
    /// long is closed (default 120 s). No keep-alives are sent; a sender
    /// reconnects on its next batch.
    pub idle_timeout: Duration,
    /// Bound on the ops of one incoming batch (peer input; default
    /// [`DEFAULT_MAX_OPS_PER_BATCH`]). A larger batch gets a protocol error
    /// on its stream. Advertised in the endpoint details, so a sender fails
    /// such a batch before sending it. Outgoing batches have no cap of
    /// their own.
    ///
    /// A stream buffers its batch's op list (16 bytes per op) as it arrives,
    /// and only once the grant its header names is live (a batch for an
    /// unknown grant is refused after its header), so the receiver's op-list
    /// memory is bounded by `max_connections × max_concurrent_streams ×
    /// max_ops_per_batch × 16` bytes, reached only by peers that name a live
    /// grant and actually send that much; lower any bound to lower it.
    pub max_ops_per_batch: u64,
    /// Batches one peer may have in flight on one connection (QUIC
    /// bidirectional stream limit; default 64). A sender past it waits for a
    /// stream to finish, within [`QuicConfig::io_timeout`].
    pub max_concurrent_streams: u32,
    /// Bound on concurrently served incoming connections (default 1024);
    /// handshakes past it are refused.
    pub max_connections: usize,
    /// Flow-control window of one stream (default 16 MiB).
    pub stream_receive_window: u32,
    /// Flow-control window of one connection, over all its streams
    /// (default 64 MiB).
    pub receive_window: u32,
    /// Bytes a connection buffers unacknowledged on the sending side
    /// (default 64 MiB).
    pub send_window: u64,
    /// Requested size of the UDP socket's kernel send and receive buffers
    /// (default 4 MiB; the kernel caps it at `net.core.rmem_max` /
    /// `wmem_max`).
    pub socket_buffer: usize,
    /// The data plane's shared secret (default none). When set, a connection
    /// serves or carries batches only after a mutual challenge–response on
    /// its first stream, bound to that TLS connection; a peer without the
    /// secret (or with another) is refused, and so is a peer that has one
    /// when this side has none. See the crate documentation.
    pub auth_secret: Option<AuthSecret>,
}

impl Default for QuicConfig {
    fn default() -> Self {
        Self {
            listen_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            advertise_host: None,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(120),
            max_ops_per_batch: DEFAULT_MAX_OPS_PER_BATCH,
            max_concurrent_streams: 64,
            max_connections: 1024,
            stream_receive_window: 16 << 20,
            receive_window: 64 << 20,
            send_window: 64 << 20,
            socket_buffer: 4 << 20,
            auth_secret: None,
        }
    }
}
