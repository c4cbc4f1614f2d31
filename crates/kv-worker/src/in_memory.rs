//! An in-memory reference [`BatchWriter`]: writers in one process that copy
//! straight between each other's registered regions.
//!
//! It is the reference backend of the transport conformance suite and the
//! transport of the worker's unit tests. It keeps the same contract as the
//! network transports, through the same [`RegisteredMemory`] checks: sources
//! are checked against the writer's own source regions, destinations against
//! the peer's live grant, a batch with any op outside it (or for an unknown,
//! expired or revoked grant) is refused whole with nothing written, and
//! writing to a peer that is shut down or dropped fails with
//! [`TransportError::Connect`].
//!
//! There is no in-memory [`Protocol`]: endpoints say [`Protocol::Tcp`] with
//! the address `mem://<name>`, and any other address is a
//! [`TransportError::BadEndpoint`].
//!
//! Copies run synchronously on the calling task, one op at a time, each
//! inside the peer's [`kv_proto::GrantAccess::with`]: a revocation, shutdown
//! or drop of the peer waits for the copy in progress, and no copy starts
//! after it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kv_proto::{
    BatchWriter, DestinationError, Endpoint, Grant, GrantId, MemoryRegion, Protocol, RegionAccess, RegisteredMemory,
    TransportError, TransportStats, WriteOp,
};

/// The address scheme of in-memory endpoints.
pub const MEM_SCHEME: &str = "mem://";

/// A registry of in-memory writers that can reach each other by name.
/// Cloning gives another handle to the same registry.
#[derive(Clone, Debug, Default)]
pub struct InMemoryNetwork {
    peers: Arc<Mutex<HashMap<String, Weak<Node>>>>,
}

#[derive(Debug)]
struct Node {
    name: String,
    memory: RegisteredMemory,
}

impl InMemoryNetwork {
    /// An empty network.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Weak<Node>>> {
        self.peers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new writer reachable at `mem://<name>`. A live writer of the same
    /// name is replaced (as a restarted peer takes over its old port): later
    /// batches to that name reach the new writer.
    pub fn writer(&self, name: &str) -> Arc<InMemoryWriter> {
        let node = Arc::new(Node { name: name.to_owned(), memory: RegisteredMemory::new() });
        self.lock().insert(name.to_owned(), Arc::downgrade(&node));
        Arc::new(InMemoryWriter { node, network: self.clone() })
    }

    /// Whether a live writer is registered under `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.lock().get(name).is_some_and(|w| w.strong_count() > 0)
    }

    fn lookup(&self, name: &str) -> Option<Arc<Node>> {
        self.lock().get(name).and_then(Weak::upgrade)
    }

    /// Removes `node`'s entry if it is still the one registered.
    fn remove(&self, node: &Arc<Node>) {
        let mut peers = self.lock();
        if peers.get(&node.name).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(node))) {
            peers.remove(&node.name);
        }
    }
}

/// One in-memory [`BatchWriter`], made by [`InMemoryNetwork::writer`].
#[derive(Debug)]
pub struct InMemoryWriter {
    node: Arc<Node>,
    network: InMemoryNetwork,
}

impl InMemoryWriter {
    /// The name peers reach this writer by.
    pub fn name(&self) -> &str {
        &self.node.name
    }

    /// Grants issued and not yet revoked or expired.
    pub fn live_grants(&self) -> usize {
        self.node.memory.live_grants()
    }
}

impl Drop for InMemoryWriter {
    fn drop(&mut self) {
        self.close();
    }
}

fn refusal(peer: &Endpoint, error: DestinationError) -> TransportError {
    match error {
        DestinationError::Closed => {
            TransportError::Connect { peer: peer.to_string(), reason: "peer is shut down".into() }
        }
        other => TransportError::Refused { peer: peer.to_string(), reason: other.to_string() },
    }
}

#[async_trait]
impl BatchWriter for InMemoryWriter {
    fn protocol(&self) -> Protocol {
        Protocol::Tcp
    }

    unsafe fn register_regions(&self, regions: &[MemoryRegion], access: RegionAccess) -> Result<(), TransportError> {
        if self.node.memory.is_closed() {
            return Err(TransportError::Shutdown);
        }
        // SAFETY: forwarded from the caller (the trait's memory-lifetime
        // rule); `close` runs before the writer is gone.
        unsafe { self.node.memory.register(regions, access) }?;
        Ok(())
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint { protocol: Protocol::Tcp, address: format!("{MEM_SCHEME}{}", self.node.name), details: Vec::new() }
    }

    async fn grant(&self, ranges: &[MemoryRegion], valid_for: Duration) -> Result<Grant, TransportError> {
        Ok(Grant::plain(self.node.memory.grant(ranges, Instant::now(), valid_for)?))
    }

    async fn revoke(&self, grant: &GrantId) {
        self.node.memory.revoke(grant);
    }

    fn stats(&self) -> TransportStats {
        self.node.memory.stats()
    }

    async fn batch_write(&self, peer: &Endpoint, grant: &Grant, ops: &[WriteOp]) -> Result<(), TransportError> {
        if peer.protocol != Protocol::Tcp {
            return Err(TransportError::WrongProtocol {
                peer: peer.to_string(),
                expected: Protocol::Tcp,
                got: peer.protocol,
            });
        }
        let Some(name) = peer.address.strip_prefix(MEM_SCHEME) else {
            return Err(TransportError::BadEndpoint {
                peer: peer.to_string(),
                reason: format!("an in-memory endpoint is {MEM_SCHEME}<name>"),
            });
        };
        let total = self.node.memory.check_sources(ops)?;
        if ops.is_empty() {
            return Ok(());
        }
        let gone = || TransportError::Connect { peer: peer.to_string(), reason: "no such in-memory peer".to_owned() };
        let target = self.network.lookup(name).ok_or_else(gone)?;
        let access = target
            .memory
            .admit(&grant.id, ops.iter().map(|op| (op.dst, op.len)), total, Instant::now())
            .map_err(|e| refusal(peer, e))?;
        for op in ops {
            let (Ok(src), Ok(dst), Ok(len)) =
                (usize::try_from(op.src), usize::try_from(op.dst), usize::try_from(op.len))
            else {
                return Err(TransportError::SourceOutOfBounds { addr: op.src, len: op.len });
            };
            let copied = self.node.memory.read_sources(|| {
                access.with(|| {
                    // SAFETY: the source range was checked inside a source
                    // region of this writer, readable while its memory is
                    // open (`read_sources` holds that). The destination range
                    // was admitted inside a live grant of the target, writable
                    // while the grant is live (`with` holds that; revoke and
                    // close wait for this copy). `ptr::copy` tolerates
                    // overlap, though a grant never covers a source.
                    unsafe {
                        std::ptr::copy(
                            std::ptr::with_exposed_provenance::<u8>(src),
                            std::ptr::with_exposed_provenance_mut::<u8>(dst),
                            len,
                        );
                    }
                })
            });
            match copied {
                Err(_) => return Err(TransportError::Shutdown),
                Ok(Err(_)) => {
                    return Err(TransportError::Refused {
                        peer: peer.to_string(),
                        reason: format!("grant {} was revoked during the batch", grant.id),
                    })
                }
                Ok(Ok(())) => {}
            }
        }
        Ok(())
    }

    fn close(&self) {
        self.node.memory.close();
        self.network.remove(&self.node);
    }

    async fn shutdown(&self) {
        self.close();
    }
}
