//! [`TcpTransport`]: the [`BatchWriter`] that ties listener, pool and memory
//! together.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use kv_proto::{
    BatchWriter, Endpoint, Grant, GrantId, MemoryRegion, Protocol, RegionAccess, TransportError, TransportStats,
    WriteOp,
};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::client::{self, Pool};
use crate::config::TcpConfig;
use crate::memory::{LocalMemory, Sources};
use crate::server;
use crate::split;
use kv_net::DataListener;

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
    /// The listener's places, the op-list budget its connections share,
    /// and the throttles of the log lines peers can provoke (connections
    /// closed for an error among them: any host that reaches the port can
    /// end connections badly, as fast as it opens them).
    pub(crate) listener: DataListener,
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
    /// [`TransportError::Io`] if the listener cannot be bound, or
    /// [`TcpConfig::authenticate_payloads`] is set without a secret.
    pub async fn bind(config: TcpConfig) -> Result<Arc<Self>, TransportError> {
        let bind_error = |source| TransportError::Io { peer: config.listen_addr.to_string(), source };
        if config.authenticate_payloads && config.auth_secret.is_none() {
            let reason = "TcpConfig::authenticate_payloads needs a shared secret (TcpConfig::auth_secret)";
            return Err(bind_error(std::io::Error::new(std::io::ErrorKind::InvalidInput, reason)));
        }
        let listener = TcpListener::bind(config.listen_addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let address = kv_net::advertised_address(config.advertise_host.as_deref(), local_addr);
        let endpoint = Endpoint { protocol: Protocol::Tcp, address, details: Vec::new() };
        let shared = Arc::new(Shared {
            memory: LocalMemory::new(),
            token: CancellationToken::new(),
            tracker: TaskTracker::new(),
            pool: Pool::new(config.max_idle_conns_per_peer, config.max_connecting_per_peer),
            listener: DataListener::new(&config.limits, &config.op_lists, config.auth_secret.is_some()),
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

    /// Writes a batch of at least `parallel_min_bytes` over `streams`
    /// connections, refused whole if any part is refused: each part, on its
    /// own task and connection, asks the receiver to admit it (header and op
    /// list, no payload) and waits at a [`Gate`]; payloads follow only once
    /// every part was admitted. Otherwise the admitted parts are abandoned:
    /// their connections close before any payload byte, so the receiver
    /// writes nothing of them.
    async fn write_split(
        &self,
        peer: &Endpoint,
        grant: GrantId,
        ops: &[WriteOp],
        total: u64,
        streams: usize,
    ) -> Result<(), TransportError> {
        let parts = split::split_by_bytes(ops, total, streams);
        let gate = Arc::new(Gate::new(parts.len()));
        // Bound on waiting at the gate: the slowest part's question and
        // verdict, a reconnect included.
        let config = &self.shared.config;
        let gate_bound = 2 * (config.connect_timeout + config.io_timeout);
        // Each part on its own task, so the copies run on several cores;
        // every part is awaited, so on return none is still writing, and
        // dropping this future aborts them (it stops the batch).
        let tasks: Vec<AbortOnDropHandle<Result<(), PartError>>> = parts
            .into_iter()
            .map(|part| {
                let shared = Arc::clone(&self.shared);
                let address = peer.address.clone();
                let gate = Arc::clone(&gate);
                AbortOnDropHandle::new(self.shared.tracker.spawn(async move {
                    let sources = match Sources::check(&shared.memory, &part) {
                        Ok(sources) => sources,
                        Err(error) => {
                            gate.close();
                            return Err(PartError::Failed(error.into()));
                        }
                    };
                    let admitted = match client::ask(&shared, &address, grant, &sources).await {
                        Ok(asked) => client::verdict(&shared, &address, grant, &sources, asked).await,
                        Err(error) => Err(error),
                    };
                    let admitted = match admitted {
                        Ok(admitted) => admitted,
                        Err(error) => {
                            gate.close();
                            return Err(PartError::Failed(error));
                        }
                    };
                    if !gate.admitted(gate_bound).await {
                        // Another part was not admitted (or the gate timed
                        // out): drop this part's connection before its payload.
                        drop(admitted);
                        return Err(PartError::Abandoned);
                    }
                    client::finish(&shared, &address, admitted, &sources).await.map_err(PartError::Failed)
                }))
            })
            .collect();
        // Open the gate from here once every part was admitted (or leave it
        // closed): the parts are then woken from this task, as spawning them
        // would, and not all onto the worker of the last part admitted.
        if !gate.decide(gate_bound).await {
            debug!(peer = %peer, grant = %grant, "not every part of a split batch was admitted in time");
        }
        let mut failure: Option<TransportError> = None;
        let mut abandoned = 0;
        for task in tasks {
            let outcome = task.await.unwrap_or_else(|join| {
                Err(PartError::Failed(TransportError::Io {
                    peer: peer.to_string(),
                    source: std::io::Error::other(join),
                }))
            });
            match outcome {
                Ok(()) => {}
                Err(PartError::Abandoned) => abandoned += 1,
                Err(PartError::Failed(error)) => failure = Some(more_telling(failure, error)),
            }
        }
        if abandoned > 0 && failure.is_none() {
            // Every part was admitted, but not all before the gate's bound.
            failure = Some(TransportError::Timeout {
                peer: peer.to_string(),
                what: "admission of every part of a split batch",
                after: gate_bound,
            });
        }
        match failure {
            Some(error) => {
                if !gate.opened() {
                    debug!(peer = %peer, grant = %grant, %error,
                        "a part of a split batch was not admitted: the admitted parts were abandoned, nothing sent");
                }
                Err(error)
            }
            None => Ok(()),
        }
    }
}

/// How one part of a split batch ended, if not with success.
enum PartError {
    /// Another part was not admitted; this one sent no payload.
    Abandoned,
    /// This part failed (refused, or a connection error).
    Failed(TransportError),
}

/// Where the parts of a split batch meet once the receiver answered each:
/// the batch's own task opens it when every part is admitted, and it closes
/// for good as soon as one part is not.
#[derive(Debug)]
struct Gate {
    parts: usize,
    admitted: AtomicUsize,
    /// Every part was admitted, or one was not: the batch's task decides.
    reported: Notify,
    state: watch::Sender<GateState>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GateState {
    Waiting,
    Open,
    Closed,
}

impl Gate {
    fn new(parts: usize) -> Self {
        Self {
            parts,
            admitted: AtomicUsize::new(0),
            reported: Notify::new(),
            state: watch::Sender::new(GateState::Waiting),
        }
    }

    /// Moves a waiting gate to `to`; a decided gate stays as it is.
    fn set(&self, to: GateState) {
        self.state.send_if_modified(|state| {
            let waiting = *state == GateState::Waiting;
            if waiting {
                *state = to;
            }
            waiting
        });
    }

    /// A part was not admitted: no part sends its payload.
    fn close(&self) {
        self.set(GateState::Closed);
        self.reported.notify_one();
    }

    /// Waits (at most `bound`) until every part was admitted or one was
    /// not, opens the gate in the first case, and returns whether it is open.
    async fn decide(&self, bound: Duration) -> bool {
        if tokio::time::timeout(bound, self.reported.notified()).await.is_ok()
            && self.admitted.load(Ordering::Acquire) == self.parts
        {
            self.set(GateState::Open);
        } else {
            self.set(GateState::Closed);
        }
        self.opened()
    }

    /// Whether every part was admitted.
    fn opened(&self) -> bool {
        *self.state.borrow() == GateState::Open
    }

    /// A part was admitted: waits (at most `bound`) until the gate is
    /// decided, and returns whether it opened.
    async fn admitted(&self, bound: Duration) -> bool {
        let mut state = self.state.subscribe();
        if self.admitted.fetch_add(1, Ordering::AcqRel) + 1 == self.parts {
            self.reported.notify_one();
        }
        let decided = tokio::time::timeout(bound, state.wait_for(|s| *s != GateState::Waiting)).await;
        match decided {
            Ok(Ok(state)) => *state == GateState::Open,
            Ok(Err(_)) | Err(_) => {
                self.close();
                self.opened()
            }
        }
    }
}

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
        // SAFETY: the caller guarantees (this method's contract) that each
        // region is valid for reads (and writes, for destinations) until
        // `shutdown().await` or `close()` returned or the last handle was
        // dropped; each of those closes the memory first, which is what
        // `RegisteredMemory::register` requires.
        unsafe { self.shared.memory.register_while_open(regions, access) }
    }

    fn endpoint(&self) -> Endpoint {
        // Nothing transport-specific for TCP: the receiver checks every batch
        // against the grant it names.
        self.endpoint.clone()
    }

    async fn grant(&self, ranges: &[MemoryRegion], valid_for: Duration) -> Result<Grant, TransportError> {
        kv_net::issue_grant(&self.shared.memory, ranges, valid_for)
    }

    async fn revoke(&self, grant: &GrantId) {
        // The fence: returns once no `readv` under the grant is in progress,
        // and none can start (see `memory`).
        kv_net::revoke_grant(&self.shared.memory, grant);
    }

    async fn batch_write(&self, peer: &Endpoint, grant: &Grant, ops: &[WriteOp]) -> Result<(), TransportError> {
        let shared = &*self.shared;
        if shared.token.is_cancelled() {
            return Err(TransportError::Shutdown);
        }
        peer.check_for(Protocol::Tcp)?;
        let sources = Sources::check(&shared.memory, ops)?;
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

    fn stats(&self) -> TransportStats {
        // The memory counts what its checks refuse; the listener and the
        // handshakes add what they refuse themselves (see `server`, `client`).
        self.shared.memory.stats()
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
