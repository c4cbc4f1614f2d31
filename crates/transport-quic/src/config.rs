//! [`QuicConfig`]: where to listen and every bound the transport keeps.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use kv_net::{
    ListenerLimits, DEFAULT_MAX_OPS_PER_BATCH, DEFAULT_OP_LIST_BUDGET, DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
};
use kv_proto::auth::AuthSecret;

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
    /// their own. The bound in force is the smaller of this and what the
    /// op-list budget holds ([`QuicConfig::op_list_budget`] / 16).
    pub max_ops_per_batch: u64,
    /// Bytes of op lists (16 per op) that all incoming streams together may
    /// hold at once, when peers must prove the shared secret (default
    /// [`DEFAULT_OP_LIST_BUDGET`]). A stream buffers its batch's op list as
    /// it arrives, and only once the grant its header names is live; its
    /// memory is charged to this budget as the list grows (never more than
    /// the count announced) and given back when the batch is done. A batch
    /// whose list does not fit waits for room (within
    /// [`QuicConfig::op_list_timeout`]) or, if it holds an equal share of
    /// the budget or more already, gives way at once; either way it is
    /// refused with the reason. (The
    /// bytes quinn itself buffers for a stream are bounded by the receive
    /// windows below, not by this budget.)
    pub op_list_budget: u64,
    /// The same budget when peers need not prove a secret (no
    /// [`QuicConfig::auth_secret`]): every connection then counts as
    /// unauthenticated, and gets this smaller budget (default
    /// [`DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET`]). With a secret, no stream
    /// is served before its connection's hello proved it.
    pub unauthenticated_op_list_budget: u64,
    /// One bound on receiving a batch's op list, from its header, waits for
    /// room in the budget included (default 10 s; keep it below the
    /// senders' `io_timeout`). A list still waiting for room then is
    /// refused; one its peer has not sent by then is a protocol error. So a
    /// peer dribbling its list holds its share of the budget no longer than
    /// this.
    pub op_list_timeout: Duration,
    /// Batches one peer may have in flight on one connection (QUIC
    /// bidirectional stream limit; default 64). A sender past it waits for a
    /// stream to finish, within [`QuicConfig::io_timeout`].
    pub max_concurrent_streams: u32,
    /// The listener's places (default [`ListenerLimits::default`]): a
    /// handshake place covers the QUIC/TLS handshake and the hello, for at
    /// most [`QuicConfig::connect_timeout`]; a connection past
    /// [`ListenerLimits::max_handshakes`] is refused at once (QUIC
    /// `CONNECTION_REFUSED`), and once half of them are taken, one from an
    /// address not yet proven is first sent a QUIC retry (it proves its
    /// source address with one more round trip), so forged source
    /// addresses cannot fill them. An established place is taken only once
    /// the hello (with the proof of the secret, if one is configured)
    /// succeeded; a connection past [`ListenerLimits::max_connections`] is
    /// closed with code `CLOSE_BUSY` and the reason, in place of the
    /// hello's last answer.
    pub limits: ListenerLimits,
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

impl QuicConfig {
    /// The op-list budget in force: [`QuicConfig::op_list_budget`] when
    /// peers must prove a secret, else
    /// [`QuicConfig::unauthenticated_op_list_budget`].
    pub fn op_list_budget_in_force(&self) -> u64 {
        kv_net::budget_in_force(self.auth_secret.is_some(), self.op_list_budget, self.unauthenticated_op_list_budget)
    }

    /// The op bound in force for one incoming batch (and advertised): the
    /// smaller of [`QuicConfig::max_ops_per_batch`] and what the budget in
    /// force holds.
    pub fn max_ops_in_force(&self) -> u64 {
        kv_net::max_ops_in_force(self.max_ops_per_batch, self.op_list_budget_in_force())
    }
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
            op_list_budget: DEFAULT_OP_LIST_BUDGET,
            unauthenticated_op_list_budget: DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
            op_list_timeout: Duration::from_secs(10),
            max_concurrent_streams: 64,
            limits: ListenerLimits::default(),
            stream_receive_window: 16 << 20,
            receive_window: 64 << 20,
            send_window: 64 << 20,
            socket_buffer: 4 << 20,
            auth_secret: None,
        }
    }
}
