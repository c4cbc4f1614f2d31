//! [`TcpTransport`]: the [`BatchWriter`] that ties listener, pool and memory
//! together.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kv_proto::{
    BatchWriter, Endpoint, Grant, GrantError, GrantId, MemoryRegion, Protocol, RegionAccess, TransportError, WriteOp,
};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::client::{self, Admitted, Pool};
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

/// A [`BatchWriter`] over TCP: serves peers' batches into its destination
/// memory under the grants it issued, and writes batches from its source
/// memory into peers' memory under the grants they issued.
///
/// Created by [`TcpTransport::bind`] inside a tokio runtime, whose tasks it
/// uses. [`BatchWriter::close`] ends all access to registered memory at once;
/// [`BatchWriter::shutdown`] closes, then stops the listener and every
/// connection and waits for them; dropping the last handle closes too, so no
/// byte of registered memory is touched once the drop has returned.
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

    /// Grants issued and neither revoked nor expired and purged.
    pub fn live_grants(&self) -> usize {
        self.shared.memory.live_grants()
    }

    /// Writes a batch of at least `parallel_min_bytes` over `streams`
    /// connections, refused whole if any part is refused: every part first
    /// asks the receiver to admit it (header and op list, no payload), and
    /// payloads follow only once every part was admitted. Otherwise the
    /// admitted parts are abandoned: their connections close before any
    /// payload byte, so the receiver writes nothing of them.
    async fn write_split(
        &self,
        peer: &Endpoint,
        grant: GrantId,
        ops: &[WriteOp],
        total: u64,
        streams: usize,
    ) -> Result<(), TransportError> {
        let join_error = |join: tokio::task::JoinError| TransportError::Io {
            peer: peer.to_string(),
            source: std::io::Error::other(join),
        };
        // Step 1: every part asks for admission at once, each on its own connection.
        let asks: Vec<JoinHandle<Result<AdmittedPart, TransportError>>> = split::split_by_bytes(ops, total, streams)
            .into_iter()
            .map(|part| {
                let shared = Arc::clone(&self.shared);
                let address = peer.address.clone();
                self.shared.tracker.spawn(async move {
                    let admitted = {
                        let sources = Sources::check(&shared.memory, &part).map_err(source_error)?;
                        client::precheck(&shared, &address, grant, &sources).await?
                    };
                    Ok((admitted, part))
                })
            })
            .collect();
        let mut admitted = Vec::with_capacity(asks.len());
        let mut failure: Option<TransportError> = None;
        for ask in asks {
            match ask.await.unwrap_or_else(|join| Err(join_error(join))) {
                Ok(part) => admitted.push(part),
                Err(error) => failure = Some(more_telling(failure, error)),
            }
        }
        if let Some(error) = failure {
            debug!(peer = %peer, grant = %grant, abandoned = admitted.len(), %error,
                "a part of a split batch was not admitted: abandoning the admitted parts, nothing sent");
            drop(admitted);
            return Err(error);
        }
        // Step 2: every part was admitted: the payloads, each part on its own
        // task so the copies run on several cores; every part is awaited, so
        // on return none is still writing.
        let sends: Vec<JoinHandle<Result<(), TransportError>>> = admitted
            .into_iter()
            .map(|(admitted, part)| {
                let shared = Arc::clone(&self.shared);
                let address = peer.address.clone();
                self.shared.tracker.spawn(async move {
                    let sources = Sources::check(&shared.memory, &part).map_err(source_error)?;
                    client::finish(&shared, &address, admitted, &sources).await
                })
            })
            .collect();
        let mut result = Ok(());
        for send in sends {
            let outcome = send.await.unwrap_or_else(|join| Err(join_error(join)));
            if result.is_ok() {
                result = outcome;
            }
        }
        result
    }
}

/// A part of a split batch the receiver admitted, with its ops.
type AdmittedPart = (Admitted, Vec<WriteOp>);

/// The error a batch reports when several parts failed: a refusal (the
/// peer's verdict on the batch) over a connection error, else the first.
fn more_telling(first: Option<TransportError>, next: TransportError) -> TransportError {
    match first {
        Some(first @ TransportError::Refused { .. }) => first,
        Some(_) if matches!(next, TransportError::Refused { .. }) => next,
        Some(first) => first,
        None => next,
    }
}

fn source_error(error: SourceError) -> TransportError {
    match error {
        SourceError::Outside { addr, len } | SourceError::TotalOverflows { addr, len } => {
            TransportError::SourceOutOfBounds { addr, len }
        }
        SourceError::Closed => TransportError::Shutdown,
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // After this no task touches registered memory, so the caller may
        // free it as soon as the drop returns.
        self.close();
    }
}

#[async_trait]
impl BatchWriter for TcpTransport {
    fn protocol(&self) -> Protocol {
        Protocol::Tcp
    }

    unsafe fn register_regions(&self, regions: &[MemoryRegion], access: RegionAccess) -> Result<(), TransportError> {
        if self.shared.token.is_cancelled() || self.shared.memory.is_closed() {
            return Err(TransportError::Shutdown);
        }
        // SAFETY: the caller guarantees (this method's contract) that each
        // region is valid for reads (and writes, for destinations) until
        // `shutdown().await` or `close()` returned or the last handle was
        // dropped; each of those closes the memory first, which is what
        // `RegisteredMemory::register` requires.
        unsafe { self.shared.memory.register(regions, access) }?;
        Ok(())
    }

    fn endpoint(&self) -> Endpoint {
        // Nothing transport-specific for TCP: the receiver checks every batch
        // against the grant it names.
        self.endpoint.clone()
    }

    async fn grant(&self, ranges: &[MemoryRegion], valid_for: Duration) -> Result<Grant, TransportError> {
        let id = GrantId::random().ok_or(GrantError::NoRandomness)?;
        match self.shared.memory.issue_grant(id, ranges, Instant::now(), valid_for) {
            Ok(()) => {
                debug!(grant = %id, ranges = ranges.len(), ?valid_for, "grant issued");
                Ok(Grant::plain(id))
            }
            Err(GrantError::Closed) => Err(TransportError::Shutdown),
            Err(error) => Err(error.into()),
        }
    }

    async fn revoke(&self, grant: &GrantId) {
        // The fence: returns once no `readv` under the grant is in progress,
        // and none can start (see `memory`).
        let was_live = self.shared.memory.revoke(grant);
        debug!(grant = %grant, was_live, "grant revoked");
    }

    async fn batch_write(&self, peer: &Endpoint, grant: &Grant, ops: &[WriteOp]) -> Result<(), TransportError> {
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
        let sources = Sources::check(&shared.memory, ops).map_err(source_error)?;
        if ops.is_empty() {
            return Ok(());
        }
        let total = sources.total();
        let streams = split::stream_count(total, shared.config.parallel_streams, shared.config.parallel_min_bytes);
        let written = async {
            if streams > 1 {
                self.write_split(peer, grant.id, ops, total, streams).await
            } else {
                client::write_batch(shared, &peer.address, grant.id, &sources).await
            }
        };
        tokio::select! {
            biased;
            () = shared.token.cancelled() => Err(TransportError::Shutdown),
            result = written => result,
        }
    }

    fn close(&self) {
        let shared = &*self.shared;
        shared.token.cancel();
        // Waits for any raw access in progress; none starts after it.
        shared.memory.close();
        shared.pool.clear();
    }

    async fn shutdown(&self) {
        self.close();
        let shared = &*self.shared;
        shared.tracker.close();
        shared.tracker.wait().await;
        debug!(local_addr = %self.local_addr, "data-plane transport shut down");
    }
}
