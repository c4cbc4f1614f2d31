//! [`TcpConfig`]: where to listen and every bound the transport keeps.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use kv_net::{
    ListenerLimits, DEFAULT_MAX_OPS_PER_BATCH, DEFAULT_OP_LIST_BUDGET, DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
};
use kv_proto::auth::AuthSecret;

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
    /// handshake place for at most this long. (The sending side bounds its
    /// whole set-up by [`TcpConfig::connect_timeout`].)
    pub handshake_timeout: Duration,
    /// How long the receiver keeps a connection on which no batch is in
    /// progress (default 120 s). Senders learn it at connection set-up and
    /// retire pooled connections after half of it.
    pub idle_timeout: Duration,
    /// Bound on the ops of one incoming batch (peer input; default
    /// [`DEFAULT_MAX_OPS_PER_BATCH`]). A larger batch closes the connection;
    /// a sender learns the bound at connection set-up and fails such a batch
    /// before sending it. Outgoing batches have no cap of their own. The
    /// bound in force is the smaller of this and what the op-list budget
    /// holds ([`TcpConfig::op_list_budget`] / 16).
    pub max_ops_per_batch: u64,
    /// Bytes of op lists (16 per op) that all incoming connections together
    /// may hold at once, when peers must prove the shared secret (default
    /// [`DEFAULT_OP_LIST_BUDGET`]). A connection buffers a batch's op list
    /// as it arrives, because every op is admitted before the first payload
    /// byte is written; its memory is charged to this budget as the list
    /// grows (never more than the count announced), and given back when the
    /// batch is done. A batch whose list does not fit waits for room (within
    /// [`TcpConfig::op_list_timeout`]) or, if it holds an equal share of the
    /// budget or more already, gives way at once; either way it is refused
    /// with the reason.
    pub op_list_budget: u64,
    /// The same budget when peers need not prove a secret (no
    /// [`TcpConfig::auth_secret`]): every connection then counts as
    /// unauthenticated, and gets this smaller budget (default
    /// [`DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET`]). With a secret, no
    /// connection reads an op list before its peer proved it.
    pub unauthenticated_op_list_budget: u64,
    /// One bound on receiving a batch's op list, from its header, waits for
    /// room in the budget included (default 10 s; keep it below the
    /// senders' `io_timeout`, which bounds their stall meanwhile). A list
    /// still waiting for room then is refused; one its peer has not sent
    /// by then is a protocol error. So a peer dribbling its list holds its
    /// share of the budget no longer than this.
    pub op_list_timeout: Duration,
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
    /// The listener's places (default [`ListenerLimits::default`]): a
    /// handshake place, taken at accept (or the connection is closed at
    /// once), is held for at most [`TcpConfig::handshake_timeout`]; an
    /// established place is taken only once the handshake (and, with a
    /// secret, its proof) succeeded, and a connection past
    /// [`ListenerLimits::max_connections`] is told so (accept status 5, or
    /// verdict 2 after the proof) and closed.
    pub limits: ListenerLimits,
}

impl TcpConfig {
    /// The op-list budget in force: [`TcpConfig::op_list_budget`] when peers
    /// must prove a secret, else [`TcpConfig::unauthenticated_op_list_budget`].
    pub fn op_list_budget_in_force(&self) -> u64 {
        kv_net::budget_in_force(self.auth_secret.is_some(), self.op_list_budget, self.unauthenticated_op_list_budget)
    }

    /// The op bound in force for one incoming batch: the smaller of
    /// [`TcpConfig::max_ops_per_batch`] and what the budget in force holds.
    pub fn max_ops_in_force(&self) -> u64 {
        kv_net::max_ops_in_force(self.max_ops_per_batch, self.op_list_budget_in_force())
    }
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
            op_list_budget: DEFAULT_OP_LIST_BUDGET,
            unauthenticated_op_list_budget: DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
            op_list_timeout: Duration::from_secs(10),
            max_idle_conns_per_peer: 4,
            limits: ListenerLimits::default(),
            auth_secret: None,
            parallel_streams: 2,
            parallel_min_bytes: 16 << 20,
        }
    }
}
