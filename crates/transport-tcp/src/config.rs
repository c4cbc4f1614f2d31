//! [`TcpConfig`]: where to listen and every bound the transport keeps.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use kv_proto::auth::AuthSecret;

/// Default bound on the ops of one incoming batch (16 Mi ops: a 256 MiB op list).
pub const DEFAULT_MAX_OPS_PER_BATCH: u64 = 16 * 1024 * 1024;

/// Configuration of a [`crate::TcpTransport`]. Every wait the transport makes
/// is bounded by one of these durations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpConfig {
    /// Where the data-plane listener binds (default `127.0.0.1:0`: loopback,
    /// any free port).
    pub listen_addr: SocketAddr,
    /// Host put in the advertised [`kv_proto::Endpoint`] (default: the bound
    /// IP). Set it when binding a wildcard address such as `0.0.0.0`.
    pub advertise_host: Option<String>,
    /// Bound on establishing an outgoing connection, name resolution
    /// included (default 5 s).
    pub connect_timeout: Duration,
    /// Bound on any single stalled read, write or acknowledgement wait after
    /// the handshake, on either side (default 30 s). Progress restarts the
    /// clock, so a large batch on a slow link is not cut off.
    pub io_timeout: Duration,
    /// One overall bound on an incoming connection's handshake: preamble,
    /// accept reply and authentication together, from the moment the
    /// connection is accepted (default 10 s). It does not restart on
    /// progress, so a peer dribbling its handshake byte by byte holds a
    /// connection slot for at most this long. (The sending side bounds its
    /// whole set-up by [`TcpConfig::connect_timeout`].)
    pub handshake_timeout: Duration,
    /// How long the receiver keeps a connection on which no batch is in
    /// progress (default 120 s). Senders learn it at connection set-up and
    /// retire pooled connections after half of it.
    pub idle_timeout: Duration,
    /// Bound on the ops of one incoming batch (peer input; default
    /// [`DEFAULT_MAX_OPS_PER_BATCH`]). A larger batch closes the connection;
    /// a sender learns the bound at connection set-up and fails such a batch
    /// before sending it. Outgoing batches have no cap of their own.
    ///
    /// A connection buffers a batch's op list (16 bytes per op) as it
    /// arrives, so the receiver's op-list memory is bounded by
    /// `max_connections × max_ops_per_batch × 16` bytes, reached only by peers
    /// that actually send that much; lower either bound to lower it.
    pub max_ops_per_batch: u64,
    /// Idle outgoing connections kept per peer for reuse (default 4).
    pub max_idle_conns_per_peer: usize,
    /// Connections one large batch is spread over (default 2). A batch of at
    /// least [`TcpConfig::parallel_min_bytes`] is cut into this many parts of
    /// about equal bytes, each written on its own pooled connection at once;
    /// every part is admitted by the receiver before any part's payload is
    /// sent (one extra round trip), and the batch succeeds when every part
    /// is acknowledged. One stream is bound by one core's copy rate; 1
    /// disables splitting.
    pub parallel_streams: usize,
    /// Smallest batch, in payload bytes, that is spread over
    /// [`TcpConfig::parallel_streams`] connections (default 16 MiB).
    pub parallel_min_bytes: u64,
    /// Shared secret (default none). When set, the receiver serves only
    /// senders that prove it and the sender writes only to receivers that
    /// prove it (transcript-bound challenge–response at connection set-up,
    /// see the crate docs).
    pub auth_secret: Option<AuthSecret>,
    /// Bound on concurrently served incoming connections (default 1024);
    /// connections past it are closed at once. A connection holds its slot
    /// during the handshake for at most [`TcpConfig::handshake_timeout`].
    pub max_connections: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            listen_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            advertise_host: None,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            max_ops_per_batch: DEFAULT_MAX_OPS_PER_BATCH,
            max_idle_conns_per_peer: 4,
            max_connections: 1024,
            auth_secret: None,
            parallel_streams: 2,
            parallel_min_bytes: 16 << 20,
        }
    }
}
