//! [`TcpConfig`]: where to listen and every bound the transport keeps.

use std::net::SocketAddr;
use std::time::Duration;

use kv_net::{ListenerLimits, OpListLimits};
use kv_proto::auth::AuthSecret;

/// Default [`TcpConfig::max_connecting_per_peer`]: half the handshake
/// places a default receiver gives one host.
pub const DEFAULT_MAX_CONNECTING_PER_PEER: usize = kv_proto::DEFAULT_MAX_HANDSHAKES_PER_HOST / 2;

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
    /// How long the receiver keeps a connection on which no batch is in
    /// progress (default 120 s). Senders learn it at connection set-up and
    /// retire pooled connections after half of it.
    pub idle_timeout: Duration,
    /// The bounds on the op lists incoming batches buffer (default
    /// [`OpListLimits::default`]): ops per batch (a larger batch closes the
    /// connection; senders learn the bound in force from the accept reply),
    /// the budget all incoming connections share, smaller when peers need
    /// not prove a secret (no [`TcpConfig::auth_secret`]), and one deadline
    /// per list.
    pub op_lists: OpListLimits,
    /// Idle outgoing connections kept per peer for reuse (default 4).
    pub max_idle_conns_per_peer: usize,
    /// Outgoing connections to one peer in their handshake at once (default
    /// [`DEFAULT_MAX_CONNECTING_PER_PEER`], at least 1): a receiver admits
    /// only so many handshakes from one source host
    /// ([`ListenerLimits::max_handshakes_per_host`], 16 by default), so a
    /// sender that starts many batches at once, each on its own connections,
    /// keeps below that and lets the others wait (within
    /// [`TcpConfig::connect_timeout`]); one that finishes its handshake or
    /// finds a connection another batch put back gives its place to the
    /// next. A connection the receiver closes before answering (its places
    /// for this host are taken, by other senders on the same address) is
    /// tried again after a short backoff, within the same bound.
    pub max_connecting_per_peer: usize,
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
    /// Authenticated payloads (default off; needs [`TcpConfig::auth_secret`],
    /// or [`crate::TcpTransport::bind`] fails). With a secret, every batch
    /// header, op list and reply carries a tag, but the payload bytes do
    /// not: anyone on the path who lets the handshake through could alter
    /// them and they would land (inside the grant the authenticated op list
    /// names). With this on, the sender follows each payload with its tag
    /// (a frame of the session, over the batch id and the payload, so it
    /// cannot be replayed or moved) and asks for it in its preamble; the
    /// receiver requires it from every sender and checks the tag over the
    /// bytes as they landed, inside the grant. A payload that fails makes
    /// its batch fail and closes the connection: its bytes landed inside
    /// the grant only, and the puller reports those blocks failed after
    /// revoking it. A receiver checks the tags of any sender that asks,
    /// with this on or off. Costs a pass of keyed BLAKE3 over every payload
    /// byte on each side, after a copy out of the registered memory (see
    /// the README's figures). Payloads are not encrypted: QUIC's TLS does
    /// that.
    pub authenticate_payloads: bool,
    /// The listener's places and its handshake deadline (default
    /// [`ListenerLimits::default`]): a handshake place, taken at accept (or
    /// the connection is closed at once), is held for at most
    /// [`ListenerLimits::handshake_timeout`] (preamble, accept reply and
    /// authentication together; the sending side bounds its whole set-up
    /// by [`TcpConfig::connect_timeout`]); an
    /// established place is taken only once the handshake (and, with a
    /// secret, its proof) succeeded, and a connection past
    /// [`ListenerLimits::max_connections`] is told so (accept status 5, or
    /// verdict 2 after the proof) and closed.
    pub limits: ListenerLimits,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            listen_addr: kv_net::DEFAULT_LISTEN_ADDR,
            advertise_host: None,
            connect_timeout: kv_net::DEFAULT_CONNECT_TIMEOUT,
            io_timeout: kv_net::DEFAULT_IO_TIMEOUT,
            idle_timeout: kv_net::DEFAULT_IDLE_TIMEOUT,
            op_lists: OpListLimits::default(),
            max_idle_conns_per_peer: 4,
            max_connecting_per_peer: DEFAULT_MAX_CONNECTING_PER_PEER,
            limits: ListenerLimits::default(),
            auth_secret: None,
            authenticate_payloads: false,
            parallel_streams: 2,
            parallel_min_bytes: 16 << 20,
        }
    }
}
