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
use crate::memory::{LocalMemory, SourceError};
use crate::server;

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

/// Checks that `address` has the `host:port` shape.
fn check_address(address: &str) -> Result<(), String> {
    let (host, port) = address.rsplit_once(':').ok_or("expected host:port")?;
    if host.is_empty() {
        return Err("empty host".to_owned());
    }
    match port.parse::<u16>() {
        Ok(0) | Err(_) => Err(format!("bad port {port:?}")),
        Ok(_) => Ok(()),
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
        self.endpoint.clone()
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
        check_address(&peer.address)
            .map_err(|reason| TransportError::BadEndpoint { peer: peer.to_string(), reason })?;
        let sources = shared.memory.sources(ops).map_err(|error| match error {
            SourceError::Outside { addr, len } => TransportError::SourceOutOfBounds { addr, len },
            SourceError::TotalOverflows { addr, len } => TransportError::SourceOutOfBounds { addr, len },
            SourceError::Closed => TransportError::Shutdown,
        })?;
        if ops.is_empty() {
            return Ok(());
        }
        tokio::select! {
            biased;
            () = shared.token.cancelled() => Err(TransportError::Shutdown),
            result = client::write_batch(shared, &peer.address, &sources) => result,
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

#[cfg(test)]
mod tests {
    use super::check_address;

    #[test]
    fn addresses_are_checked() {
        assert!(check_address("127.0.0.1:9000").is_ok());
        assert!(check_address("[::1]:9000").is_ok());
        assert!(check_address("decode-0.example:9000").is_ok());
        for bad in ["", "host", ":9000", "host:", "host:0", "host:70000", "mem://x"] {
            assert!(check_address(bad).is_err(), "{bad:?} accepted");
        }
    }
}
