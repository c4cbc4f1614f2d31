//! [`QuicConfig`]: where to listen and every bound the transport keeps.

use std::net::SocketAddr;
use std::time::Duration;

use kv_net::{ListenerLimits, OpListLimits};
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
    /// One deadline for establishing an outgoing connection: name
    /// resolution, the QUIC/TLS handshake and the hello (with the
    /// shared-secret exchange, if any; default 5 s). No batch is sent or
    /// served on a connection before its hello completed. (The receiving
    /// side's deadline is [`ListenerLimits::handshake_timeout`].)
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
    /// The bounds on the op lists incoming streams buffer (default
    /// [`OpListLimits::default`]): ops per batch (a larger batch gets a
    /// protocol error on its stream; the bound in force is advertised in
    /// the endpoint details), the budget all incoming streams share,
    /// smaller when peers need not prove a secret (no
    /// [`QuicConfig::auth_secret`]), and one deadline per list. (The bytes
    /// quinn itself buffers for a stream are bounded by the receive windows
    /// below, not by this budget.)
    pub op_lists: OpListLimits,
    /// Batches one peer may have in flight on one connection (QUIC
    /// bidirectional stream limit; default 64). A sender past it waits for a
    /// stream to finish, within [`QuicConfig::io_timeout`].
    pub max_concurrent_streams: u32,
    /// The listener's places (default [`ListenerLimits::default`]): a
    /// handshake place covers the QUIC/TLS handshake and the hello, for at
    /// most [`ListenerLimits::handshake_timeout`]; a connection past
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

impl Default for QuicConfig {
    fn default() -> Self {
        Self {
            listen_addr: kv_net::DEFAULT_LISTEN_ADDR,
            advertise_host: None,
            connect_timeout: kv_net::DEFAULT_CONNECT_TIMEOUT,
            io_timeout: kv_net::DEFAULT_IO_TIMEOUT,
            idle_timeout: kv_net::DEFAULT_IDLE_TIMEOUT,
            op_lists: OpListLimits::default(),
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
