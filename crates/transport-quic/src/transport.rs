//! [`QuicTransport`]: the [`BatchWriter`] that ties endpoint, connections,
//! memory and grants together.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use kv_proto::{
    BatchWriter, Endpoint, Grant, GrantId, MemoryRegion, Protocol, RegionAccess, TransportError, TransportStats,
    WriteOp,
};
use quinn::crypto::rustls::QuicServerConfig;
use quinn::{IdleTimeout, TransportConfig, VarInt};
use rustls::crypto::CryptoProvider;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::client::{self, Connections};
use crate::config::QuicConfig;
use crate::details::{EndpointDetails, Fingerprint};
use crate::memory::{LocalMemory, Sources};
use crate::server;
use crate::tls;
use crate::wire::CLOSE_SHUTDOWN;
use kv_net::DataListener;

/// State shared by the transport handle, the accept loop and the connection
/// and stream tasks. The tasks hold it, never the [`QuicTransport`], so
/// dropping the last handle stops them.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: QuicConfig,
    pub(crate) memory: LocalMemory,
    pub(crate) token: CancellationToken,
    pub(crate) tracker: TaskTracker,
    pub(crate) endpoint: quinn::Endpoint,
    pub(crate) local_addr: SocketAddr,
    pub(crate) provider: Arc<CryptoProvider>,
    /// Transport parameters of outgoing connections (the peer opens no
    /// streams on them).
    pub(crate) client_transport_config: Arc<TransportConfig>,
    pub(crate) connections: Connections,
    /// The listener's places (a handshake place covers the hello too), the
    /// op-list budget its streams share, and the throttles of the log lines
    /// peers can provoke (connections over a limit, failed handshakes and
    /// hellos, protocol errors, refused batches).
    pub(crate) listener: DataListener,
    pub(crate) opened: AtomicU64,
    pub(crate) accepted: AtomicU64,
    /// Incoming connections asked to prove their source address first.
    pub(crate) retried: AtomicU64,
    /// Payload bytes peers wrote into this transport's memory.
    pub(crate) bytes_received: AtomicU64,
}

/// A [`BatchWriter`] over QUIC: serves peers' batches into the registered
/// memory and writes batches into peers' memory, over one UDP socket.
///
/// Created by [`QuicTransport::bind`] inside a tokio runtime, whose tasks it
/// uses. [`BatchWriter::shutdown`] closes the endpoint and every connection
/// and waits for the tasks; dropping the last handle closes them too, and no
/// byte of registered memory is touched once the drop has returned.
#[derive(Debug)]
pub struct QuicTransport {
    shared: Arc<Shared>,
    address: String,
    fingerprint: Fingerprint,
}

/// How many bytes a peer may have sent on a connection and not yet had read
/// before its hello succeeded (quinn buffers them): peers that never prove
/// the secret hold at most this each, times the handshake places, instead of
/// a full receive window each. Raised to [`QuicConfig::receive_window`],
/// with the stream limit, once the hello succeeds.
pub(crate) const PRE_HELLO_RECEIVE_WINDOW: u32 = 64 * 1024;

/// quinn's transport parameters from the configuration; `incoming_streams`
/// is how many bidirectional streams the peer may have open at once.
fn transport_config(config: &QuicConfig, incoming_streams: u32) -> TransportConfig {
    let mut t = TransportConfig::default();
    t.max_concurrent_bidi_streams(VarInt::from_u32(incoming_streams))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .max_idle_timeout(Some(IdleTimeout::try_from(config.idle_timeout).unwrap_or(IdleTimeout::from(VarInt::MAX))))
        .keep_alive_interval(None)
        .stream_receive_window(VarInt::from_u32(config.stream_receive_window))
        .receive_window(VarInt::from_u32(config.receive_window))
        .send_window(config.send_window)
        .datagram_receive_buffer_size(None);
    t
}

/// The UDP socket, with the requested kernel buffers.
fn bind_socket(addr: SocketAddr, buffer: usize) -> io::Result<std::net::UdpSocket> {
    let socket =
        socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
    if let Err(error) = socket.set_recv_buffer_size(buffer) {
        debug!(%addr, %error, "cannot size the UDP receive buffer");
    }
    if let Err(error) = socket.set_send_buffer_size(buffer) {
        debug!(%addr, %error, "cannot size the UDP send buffer");
    }
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

impl QuicTransport {
    /// Makes a fresh self-signed certificate, binds the UDP socket and starts
    /// accepting connections on the current tokio runtime.
    ///
    /// # Errors
    ///
    /// [`TransportError::Io`] if there is no tokio runtime, the certificate
    /// or TLS configuration cannot be made, or the socket cannot be bound.
    pub async fn bind(config: QuicConfig) -> Result<Arc<Self>, TransportError> {
        let bind_error = |source| TransportError::Io { peer: config.listen_addr.to_string(), source };
        tokio::runtime::Handle::try_current().map_err(|e| bind_error(io::Error::other(e)))?;
        let identity = tls::generate_identity().map_err(|e| bind_error(io::Error::other(e)))?;
        let provider = tls::provider();
        // Until its hello (and proof) succeeds, a peer may open only the
        // hello's stream and have little in flight: see `PRE_HELLO_RECEIVE_WINDOW`.
        let mut server_transport = transport_config(&config, 1);
        server_transport.receive_window(VarInt::from_u32(PRE_HELLO_RECEIVE_WINDOW.min(config.receive_window)));
        let server_transport = Arc::new(server_transport);
        let client_transport_config = Arc::new(transport_config(&config, 0));
        let crypto =
            tls::server_crypto(Arc::clone(&provider), &identity).map_err(|e| bind_error(io::Error::other(e)))?;
        let crypto = QuicServerConfig::try_from(crypto).map_err(|e| bind_error(io::Error::other(e)))?;
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server_config.transport_config(server_transport);
        let socket = bind_socket(config.listen_addr, config.socket_buffer).map_err(bind_error)?;
        let endpoint = quinn::Endpoint::new(
            quinn::EndpointConfig::default(),
            Some(server_config),
            socket,
            Arc::new(quinn::TokioRuntime),
        )
        .map_err(bind_error)?;
        let local_addr = endpoint.local_addr().map_err(bind_error)?;
        let address = kv_net::advertised_address(config.advertise_host.as_deref(), local_addr);
        let shared = Arc::new(Shared {
            memory: LocalMemory::new(),
            token: CancellationToken::new(),
            tracker: TaskTracker::new(),
            endpoint,
            local_addr,
            provider,
            client_transport_config,
            connections: Connections::default(),
            listener: DataListener::new(&config.limits, &config.op_lists, config.auth_secret.is_some()),
            opened: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            config,
        });
        shared.tracker.spawn(server::accept_loop(Arc::clone(&shared)));
        debug!(%local_addr, %address, "data-plane QUIC endpoint bound");
        Ok(Arc::new(Self { shared, address, fingerprint: identity.fingerprint }))
    }

    /// The address the UDP socket is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local_addr
    }

    /// The configuration in force.
    pub fn config(&self) -> &QuicConfig {
        &self.shared.config
    }

    /// The SHA-256 of this transport's certificate (advertised in its
    /// endpoint details; senders pin it).
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// Outgoing connections opened so far (each completed its handshake).
    pub fn connections_opened(&self) -> u64 {
        self.shared.opened.load(Ordering::Relaxed)
    }

    /// Incoming connections accepted so far (each completed its handshake
    /// and its hello, authentication included).
    pub fn connections_accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Incoming connections asked to prove their source address (a QUIC
    /// retry) before they could take a handshake place, so far.
    pub fn connections_retried(&self) -> u64 {
        self.shared.retried.load(Ordering::Relaxed)
    }

    /// Payload bytes peers have written into this transport's memory so far
    /// (each inside a live grant).
    pub fn bytes_received(&self) -> u64 {
        self.shared.bytes_received.load(Ordering::Relaxed)
    }

    /// The op-list budget incoming batches share: the bytes they hold now
    /// and the most they ever held at once (its limit is the budget in
    /// force, [`kv_net::OpListLimits::budget_in_force`]).
    pub fn op_list_budget(&self) -> &kv_net::OpListBudget {
        &self.shared.listener.op_lists
    }

    /// Grants issued and neither revoked nor expired and purged.
    pub fn live_grants(&self) -> usize {
        self.shared.memory.live_grants()
    }

    /// Outgoing connections currently held open for reuse.
    pub fn open_connections(&self) -> usize {
        self.shared.connections.open()
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        BatchWriter::close(self);
    }
}

#[async_trait]
impl BatchWriter for QuicTransport {
    fn protocol(&self) -> Protocol {
        Protocol::Quic
    }

    unsafe fn register_regions(&self, regions: &[MemoryRegion], access: RegionAccess) -> Result<(), TransportError> {
        // SAFETY: forwarded from the caller (the trait's memory-lifetime
        // rule: valid until `shutdown` or `close` returned or the last handle
        // was dropped); `close`, which `shutdown` and `Drop` call, closes
        // the memory before any of those returns, as `register` requires.
        unsafe { self.shared.memory.register_while_open(regions, access) }
    }

    fn endpoint(&self) -> Endpoint {
        let config = &self.shared.config;
        let max_ops_per_batch = config.op_lists.max_ops_in_force(config.auth_secret.is_some());
        let details = EndpointDetails { fingerprint: self.fingerprint, max_ops_per_batch };
        Endpoint { protocol: Protocol::Quic, address: self.address.clone(), details: details.encode() }
    }

    async fn grant(&self, ranges: &[MemoryRegion], valid_for: Duration) -> Result<Grant, TransportError> {
        kv_net::issue_grant(&self.shared.memory, ranges, valid_for)
    }

    async fn revoke(&self, grant: &GrantId) {
        // The fence: waits for a copy under this grant in progress (a short
        // synchronous copy of one read's chunks), and none starts after.
        kv_net::revoke_grant(&self.shared.memory, grant);
    }

    async fn batch_write(&self, peer: &Endpoint, grant: &Grant, ops: &[WriteOp]) -> Result<(), TransportError> {
        let shared = &*self.shared;
        if shared.token.is_cancelled() {
            return Err(TransportError::Shutdown);
        }
        peer.check_for(Protocol::Quic)?;
        let label = peer.to_string();
        let details = EndpointDetails::decode(&peer.details)
            .map_err(|e| TransportError::BadEndpoint { peer: label.clone(), reason: e.to_string() })?;
        let sources = Sources::check(&shared.memory, ops)?;
        if ops.is_empty() {
            return Ok(());
        }
        let count = ops.len() as u64;
        if count > details.max_ops_per_batch {
            return Err(TransportError::Refused {
                peer: label,
                reason: format!(
                    "a batch of {count} ops exceeds the peer's limit of {} ops per batch",
                    details.max_ops_per_batch
                ),
            });
        }
        // Dropping the write (shutdown here, or the caller dropping this
        // future) resets its stream: the receiver stops at once.
        tokio::select! {
            biased;
            () = shared.token.cancelled() => Err(TransportError::Shutdown),
            result = client::write_batch(shared, &label, &peer.address, details.fingerprint, &grant.id, &sources) => result,
        }
    }

    fn stats(&self) -> TransportStats {
        // The memory counts what its checks refuse; the listener and the
        // hello add what they refuse themselves (see `server`, `client`).
        self.shared.memory.stats()
    }

    fn close(&self) {
        let shared = &*self.shared;
        // Close first, so peers get the shutdown code rather than the
        // implicit close of a connection whose task let go of it.
        shared.endpoint.close(VarInt::from_u32(CLOSE_SHUTDOWN), b"shutdown");
        shared.token.cancel();
        // After this no task touches registered memory and no grant is live.
        shared.memory.close();
        shared.connections.clear();
    }

    async fn shutdown(&self) {
        BatchWriter::close(self);
        let shared = &*self.shared;
        shared.tracker.close();
        shared.tracker.wait().await;
        // The close frames are already queued; quinn's endpoint driver keeps
        // the socket for as long as connections drain, so nothing here waits
        // for that.
        debug!(local_addr = %shared.local_addr, "data-plane transport shut down");
    }
}
