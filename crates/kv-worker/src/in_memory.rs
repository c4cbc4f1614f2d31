//! An in-memory reference [`BatchWriter`]: writers in one process that copy
//! straight between each other's registered regions.
//!
//! It is the reference backend of the transport conformance suite and the
//! transport of the worker's unit tests. It keeps the same contract as the
//! network transports: sources are checked against the writer's own regions,
//! destinations against the peer's, a batch with any op outside is refused
//! whole with nothing written, and writing to a peer that is shut down or
//! dropped fails with [`TransportError::Connect`].
//!
//! There is no in-memory [`Protocol`]: endpoints say [`Protocol::Tcp`] with
//! the address `mem://<name>`, and any other address is a
//! [`TransportError::BadEndpoint`].
//!
//! Copies run synchronously on the calling task, holding the peer's read
//! lock; a peer's shutdown or drop takes the write lock, so once it returns no
//! copy touches its memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

use async_trait::async_trait;
use kv_proto::{BatchWriter, Endpoint, MemoryRegion, Protocol, RegionSet, TransportError, WriteOp};

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
    state: RwLock<NodeState>,
}

#[derive(Debug, Default)]
struct NodeState {
    regions: RegionSet,
    closed: bool,
}

impl Node {
    fn read(&self) -> RwLockReadGuard<'_, NodeState> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, NodeState> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }
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
        let node = Arc::new(Node { name: name.to_owned(), state: RwLock::new(NodeState::default()) });
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

    fn close(&self) {
        self.node.write().closed = true;
        self.network.remove(&self.node);
    }
}

impl Drop for InMemoryWriter {
    fn drop(&mut self) {
        self.close();
    }
}

fn refusal(index: usize, op: &WriteOp) -> String {
    format!("op {index}: destination {:#x}+{} is outside the registered regions", op.dst, op.len)
}

#[async_trait]
impl BatchWriter for InMemoryWriter {
    fn protocol(&self) -> Protocol {
        Protocol::Tcp
    }

    unsafe fn register_regions(&self, regions: &[MemoryRegion]) -> Result<(), TransportError> {
        let mut state = self.node.write();
        if state.closed {
            return Err(TransportError::Shutdown);
        }
        state.regions.insert(regions)?;
        Ok(())
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint { protocol: Protocol::Tcp, address: format!("{MEM_SCHEME}{}", self.node.name), details: Vec::new() }
    }

    async fn batch_write(&self, peer: &Endpoint, ops: &[WriteOp]) -> Result<(), TransportError> {
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
        {
            let own = self.node.read();
            if own.closed {
                return Err(TransportError::Shutdown);
            }
            let mut total = 0u64;
            for op in ops {
                let summed = total.checked_add(op.len);
                if !own.regions.contains(op.src, op.len) || summed.is_none() {
                    return Err(TransportError::SourceOutOfBounds { addr: op.src, len: op.len });
                }
                total = summed.unwrap_or(total);
            }
        }
        if ops.is_empty() {
            return Ok(());
        }
        let gone = || TransportError::Connect { peer: peer.to_string(), reason: "no such in-memory peer".to_owned() };
        let target = self.network.lookup(name).ok_or_else(gone)?;
        let state = target.read();
        if state.closed {
            return Err(gone());
        }
        if let Some((index, op)) = ops.iter().enumerate().find(|(_, op)| !state.regions.contains(op.dst, op.len)) {
            return Err(TransportError::Refused { peer: peer.to_string(), reason: refusal(index, op) });
        }
        for op in ops {
            let (Ok(src), Ok(dst), Ok(len)) =
                (usize::try_from(op.src), usize::try_from(op.dst), usize::try_from(op.len))
            else {
                return Err(TransportError::SourceOutOfBounds { addr: op.src, len: op.len });
            };
            // SAFETY: the source range lies inside a region registered on this
            // writer, valid for reads while the writer lives (it does: `&self`).
            // The destination range lies inside a region registered on the
            // target, valid for writes until the target is closed, and its
            // read lock (held here, with `closed` false) keeps it from closing
            // during the copy. `ptr::copy` tolerates overlap (a writer may
            // write into its own regions).
            unsafe {
                std::ptr::copy(
                    std::ptr::with_exposed_provenance::<u8>(src),
                    std::ptr::with_exposed_provenance_mut::<u8>(dst),
                    len,
                );
            }
        }
        Ok(())
    }

    async fn shutdown(&self) {
        self.close();
    }
}
