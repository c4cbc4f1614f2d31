//! [`TcpTransport`]: the [`BatchWriter`] that ties listener, pool and memory
//! together.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use kv_proto::{BatchWriter, Endpoint, MemoryRegion, Protocol, TransportError, WriteOp};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::client::{self, Pool};
use crate::config::TcpConfig;
use crate::memory::{LocalMemory, SourceError, Sources};
use crate::server;
use crate::split;

/// State shared by the transport handle, the accept loop and the connection
/// tasks. The tasks hold it, never the [`TcpTransport`], so dropping the last
/// handle stops them.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: TcpConfig,
    pub(crate) memory: LocalMemory,
    pub(crate) token: CancellationToken,
    pub(crate) tracker: TaskTracker,
    pub(crate) pool: Pool,
    pub(crate) conn_limit: Arc<Semaphore>,
    pub(crate) opened: AtomicU64,
    pub(crate) accepted: AtomicU64,
    pub(crate) next_batch_id: AtomicU64,
}

/// A [`BatchWriter`] over TCP: serves peers' batches into the registered
/// memory and writes batches into peers' memory.
///
/// Created by [`TcpTransport::bind`] inside a tokio runtime, whose tasks it
/// uses. [`BatchWriter::shutdown`] stops the listener and every connection and
/// waits for them; dropping the last handle cancels them too, and no byte of
/// registered memory is touched once the drop has returned.
#[derive(Debug)]
pub struct TcpTransport {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    endpoint: Endpoint,
}

impl TcpTransport {
    /// Binds the listener and starts accepting connections on the current
    /// tokio runtime.
    ///
    /// # Errors
    ///
    /// [`TransportError::Io`] if the listener cannot be bound.
    pub async fn bind(config: TcpConfig) -> Result<Arc<Self>, TransportError> {
        let bind_error = |source| TransportError::Io { peer: config.listen_addr.to_string(), source };
        let listener = TcpListener::bind(config.listen_addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let address = match &config.advertise_host {
            Some(host) if host.contains(':') && !host.starts_with('[') => format!("[{host}]:{}", local_addr.port()),
            Some(host) => format!("{host}:{}", local_addr.port()),
            None => {
                if local_addr.ip().is_unspecified() {
                    warn!(%local_addr, "listening on a wildcard address without advertise_host: peers get an unusable endpoint");
                }
                local_addr.to_string()
            }
        };
        let endpoint = Endpoint { protocol: Protocol::Tcp, address, details: Vec::new() };
        let shared = Arc::new(Shared {
            memory: LocalMemory::new(),
            token: CancellationToken::new(),
            tracker: TaskTracker::new(),
            pool: Pool::new(config.max_idle_conns_per_peer),
            conn_limit: Arc::new(Semaphore::new(config.max_connections.min(Semaphore::MAX_PERMITS))),
            opened: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            next_batch_id: AtomicU64::new(0),
            config,
        });
        shared.tracker.spawn(server::accept_loop(Arc::clone(&shared), listener));
        debug!(%local_addr, endpoint = %endpoint, "data-plane listener bound");
        Ok(Arc::new(Self { shared, local_addr, endpoint }))
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The configuration in force.
    pub fn config(&self) -> &TcpConfig {
        &self.shared.config
    }

    /// Outgoing connections opened so far (each completed its preamble
    /// exchange); a pooled connection that is reused does not count again.
    pub fn connections_opened(&self) -> u64 {
        self.shared.opened.load(Ordering::Relaxed)
    }

    /// Incoming connections accepted so far.
    pub fn connections_accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Idle outgoing connections currently pooled, over all peers.
    pub fn idle_connections(&self) -> usize {
        self.shared.pool.len()
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shared.token.cancel();
        // After this no task touches registered memory, so the caller may
        // free it as soon as the drop returns.
        self.shared.memory.close();
        self.shared.pool.clear();
    }
}

#[async_trait]
impl BatchWriter for TcpTransport {
    fn protocol(&self) -> Protocol {
        Protocol::Tcp
    }

    unsafe fn register_regions(&self, regions: &[MemoryRegion]) -> Result<(), TransportError> {
        if self.shared.token.is_cancelled() {
            return Err(TransportError::Shutdown);
        }
        // SAFETY: the caller guarantees (this method's contract) that each
        // region is valid for reads and writes for as long as this writer
        // lives; `Drop` closes the memory before the writer is gone, which is
        // what `LocalMemory::register` requires.
        unsafe { self.shared.memory.register(regions) }?;
        Ok(())
    }

    fn endpoint(&self) -> Endpoint {
        // Advertise the registered regions so a sender spreading a batch over
        // several connections can refuse a bad batch whole (see `split`).
        Endpoint { details: split::encode_regions(&self.shared.memory.regions()), ..self.endpoint.clone() }
    }

    async fn batch_write(&self, peer: &Endpoint, ops: &[WriteOp]) -> Result<(), TransportError> {
        let shared = &*self.shared;
        if shared.token.is_cancelled() {
            return Err(TransportError::Shutdown);
        }
        if peer.protocol != Protocol::Tcp {
            return Err(TransportError::WrongProtocol {
                peer: peer.to_string(),
                expected: Protocol::Tcp,
                got: peer.protocol,
            });
        }
        peer.check_address().map_err(|reason| TransportError::BadEndpoint { peer: peer.to_string(), reason })?;
        let sources = Sources::check(&shared.memory, ops).map_err(|error| match error {
            SourceError::Outside { addr, len } => TransportError::SourceOutOfBounds { addr, len },
            SourceError::TotalOverflows { addr, len } => TransportError::SourceOutOfBounds { addr, len },
            SourceError::Closed => TransportError::Shutdown,
        })?;
        if ops.is_empty() {
            return Ok(());
        }
        let streams =
            split::stream_count(sources.total(), shared.config.parallel_streams, shared.config.parallel_min_bytes);
        let peer_regions = if streams > 1 { split::decode_regions(&peer.details) } else { None };
        let written = async {
            let Some(peer_regions) = peer_regions else {
                return client::write_batch(shared, &peer.address, &sources).await;
            };
            if let Some((index, op)) = split::first_outside(ops, &peer_regions) {
                return Err(TransportError::Refused {
                    peer: peer.to_string(),
                    reason: format!(
                        "op {index}: destination {:#x}+{} is outside the regions the peer advertises",
                        op.dst, op.len
                    ),
                });
            }
            // Each part on its own task, so the parts' copies run on several
            // cores; every part is awaited, so on return none is still writing.
            let tasks: Vec<_> = split::split_by_bytes(ops, sources.total(), streams)
                .into_iter()
                .map(|part| {
                    let shared = Arc::clone(&self.shared);
                    let address = peer.address.clone();
                    self.shared.tracker.spawn(async move {
                        let sources = Sources::check(&shared.memory, &part).map_err(|_| TransportError::Shutdown)?;
                        client::write_batch(&shared, &address, &sources).await
                    })
                })
                .collect();
            let mut result = Ok(());
            for task in tasks {
                let outcome = task.await.unwrap_or_else(|join| {
                    Err(TransportError::Io { peer: peer.to_string(), source: std::io::Error::other(join) })
                });
                if result.is_ok() {
                    result = outcome;
                }
            }
            result
        };
        tokio::select! {
            biased;
            () = shared.token.cancelled() => Err(TransportError::Shutdown),
            result = written => result,
        }
    }

    async fn shutdown(&self) {
        let shared = &*self.shared;
        shared.token.cancel();
        shared.memory.close();
        shared.pool.clear();
        shared.tracker.close();
        shared.tracker.wait().await;
        debug!(local_addr = %self.local_addr, "data-plane transport shut down");
    }
}
