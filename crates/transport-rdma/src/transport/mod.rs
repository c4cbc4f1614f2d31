//! [`RdmaTransport`]: the [`BatchWriter`] over verbs. The receiver's side
//! (control listener, window binding, the fence) is in [`server`], the
//! sender's (connections, opened grants, batches) in [`client`], the queue
//! pair loop in [`link`].

mod client;
mod link;
mod server;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use kv_proto::{
    BatchWriter, Endpoint, Grant, GrantError, GrantId, MemoryRegion, Protocol, RegionAccess, RegisteredMemory,
    TransportError, TransportStats, WriteOp,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::RdmaConfig;
use crate::control::ControlLimits;
use crate::details::EndpointDetails;
use crate::fence::{FenceBook, LinkId, SpecError, WindowPool};
use crate::plan::SendQueueConfig;
use crate::region::{LocalRegion, RegionTable};
use crate::verbs::{
    register_checked, Device, GidChoice, MemoryRegion as Registration, MemoryWindow, ProtectionDomain, QpCapacity,
    RegisterError,
};
use link::Link;

/// One grant's lock (its opens and its revocation run one at a time) and
/// the token that stops its expiry timer.
#[derive(Debug)]
pub(crate) struct GrantSlot {
    lock: tokio::sync::Mutex<()>,
    expiry: CancellationToken,
}

/// The receiver's windows: the book of bound ones and the free pool.
#[derive(Debug)]
pub(crate) struct Fence {
    book: FenceBook<MemoryWindow, Arc<GrantSlot>>,
    pool: WindowPool<MemoryWindow>,
}

/// The device registrations, by access.
#[derive(Debug, Default)]
pub(crate) struct Registrations {
    /// Sources (local access only), and the table the planner reads.
    sources: Vec<Arc<Registration>>,
    local: Arc<RegionTable<LocalRegion>>,
    /// Destinations (`Windowed`: writable only through windows), in
    /// registration order (a window spec names one by position).
    destinations: Vec<Arc<Registration>>,
}

/// State shared by the transport handle, the accept loop, the connection
/// tasks and the expiry timers. Tasks hold it, never the [`RdmaTransport`],
/// so dropping the last handle closes everything.
#[derive(Debug)]
pub(crate) struct Shared {
    config: RdmaConfig,
    memory: RegisteredMemory,
    token: CancellationToken,
    tracker: TaskTracker,
    // Field order is drop order, children before parents: the fence's
    // windows and the links' queue pairs before the registrations they use,
    // all of them before the protection domain and the device.
    fence: Mutex<Fence>,
    links: Mutex<HashMap<LinkId, Weak<Link>>>,
    peers: client::Peers,
    registrations: Mutex<Registrations>,
    pd: Arc<ProtectionDomain>,
    device: Arc<Device>,
    capacity: QpCapacity,
    queue: SendQueueConfig,
    control: ControlLimits,
    /// Places for established incoming control connections, with the line
    /// about a peer refused one.
    established: kv_net::EstablishedPlaces,
    /// Places for incoming control connections in their handshake.
    handshakes: kv_proto::HandshakePlaces,
    next_link: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn fence(&self) -> MutexGuard<'_, Fence> {
        lock(&self.fence)
    }

    fn registrations(&self) -> MutexGuard<'_, Registrations> {
        lock(&self.registrations)
    }

    /// A new, unconnected link, registered so `close` can destroy it.
    fn new_link(&self) -> Result<Arc<Link>, crate::verbs::VerbsError> {
        let id = self.next_link.fetch_add(1, Ordering::Relaxed);
        let psn = kv_proto::random::array::<4>().map_or(0x5a5a, u32::from_le_bytes) & 0x00ff_ffff;
        let link = Arc::new(Link::new(id, &self.pd, self.capacity, psn)?);
        {
            let mut links = lock(&self.links);
            links.retain(|_, link| link.strong_count() > 0);
            links.insert(id, Arc::downgrade(&link));
        }
        // A close that ran before the insert did not see it.
        if self.token.is_cancelled() {
            link.kill();
        }
        Ok(link)
    }

    fn add_registrations(&self, fresh: Vec<Arc<Registration>>, access: RegionAccess) -> Result<(), TransportError> {
        let mut registrations = self.registrations();
        if self.memory.is_closed() {
            return Err(TransportError::Shutdown);
        }
        match access {
            RegionAccess::Source => {
                registrations.sources.extend(fresh);
                let local: Vec<LocalRegion> = registrations.sources.iter().map(|r| r.local()).collect();
                let table = RegionTable::new(local).map_err(|e| device_error(self.device.name(), e))?;
                registrations.local = Arc::new(table);
            }
            RegionAccess::Destination => registrations.destinations.extend(fresh),
        }
        Ok(())
    }

    fn link(&self, id: LinkId) -> Option<Arc<Link>> {
        lock(&self.links).get(&id).and_then(Weak::upgrade)
    }

    /// Ends all access, synchronously: see [`BatchWriter::close`].
    fn close(&self) {
        self.memory.close();
        self.token.cancel();
        // 1. Every queue pair to the error state: after this the device
        //    neither reads nor writes registered memory for any of them, and
        //    no window opens anything (a window works only on its queue pair).
        let links: Vec<Arc<Link>> = lock(&self.links).values().filter_map(Weak::upgrade).collect();
        links.iter().for_each(|link| link.kill());
        // 2. Every window (each holds the region and the queue pair it is
        //    bound to, which go only after it).
        let (bound, free) = {
            let mut fence = self.fence();
            (fence.book.close(), fence.pool.drain())
        };
        drop(bound);
        drop(free);
        // 3. The queue pairs, then the registrations (a batch or an open
        //    still holding one lets go of it soon; nothing can use it).
        links.iter().for_each(|link| link.release());
        self.peers.clear();
        let registrations = std::mem::take(&mut *self.registrations());
        drop(registrations);
    }
}

/// A [`BatchWriter`] over RDMA verbs: one-sided RDMA WRITEs into the
/// receiver's memory through memory windows bound per grant (see the crate
/// docs for the fence and its cost).
///
/// Created by [`RdmaTransport::bind`] inside a tokio runtime, whose tasks it
/// uses. [`BatchWriter::close`] (and the drop of the last handle) destroys
/// every queue pair, window and registration synchronously;
/// [`BatchWriter::shutdown`] also waits for the transport's tasks.
#[derive(Debug)]
pub struct RdmaTransport {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    endpoint: Endpoint,
}

fn device_error(device: &str, err: impl std::fmt::Display) -> TransportError {
    TransportError::Io { peer: format!("rdma device {device}"), source: std::io::Error::other(err.to_string()) }
}

impl RdmaTransport {
    /// Opens the device, binds the control listener and starts accepting
    /// peers on the current tokio runtime.
    ///
    /// # Errors
    ///
    /// [`TransportError::Io`] if the device cannot be opened (or has no
    /// memory windows, which the grant fence needs) or the listener cannot
    /// be bound.
    pub async fn bind(config: RdmaConfig) -> Result<Arc<Self>, TransportError> {
        let bind_error = |source| TransportError::Io { peer: config.listen_addr.to_string(), source };
        let listener = TcpListener::bind(config.listen_addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let address = kv_net::advertised_address(config.advertise_host.as_deref(), local_addr);
        // RoCE: the GID of the address peers reach us at, unless told.
        let advertised = config.advertise_host.as_deref().and_then(|host| host.parse::<IpAddr>().ok());
        let gid = match (config.gid_index, local_addr.ip(), advertised) {
            (Some(index), _, _) => GidChoice::Index(index),
            (None, IpAddr::V4(ip), _) if !ip.is_unspecified() => GidChoice::Ipv4(ip),
            (None, _, Some(IpAddr::V4(ip))) => GidChoice::Ipv4(ip),
            (None, _, _) => GidChoice::Index(0),
        };
        let name = config.device.clone().unwrap_or_else(|| "(first device)".to_owned());
        let device =
            Device::open_with(config.device.as_deref(), config.port, gid).map_err(|e| device_error(&name, e))?;
        let limits = device.limits();
        if limits.max_mw == 0 {
            return Err(device_error(device.name(), "the device has no memory windows, which the grant fence needs"));
        }
        let pd = ProtectionDomain::new(&device).map_err(|e| device_error(device.name(), e))?;
        let depth = config.send_queue_depth.clamp(1, limits.max_qp_wr.saturating_sub(16).max(1));
        let capacity = QpCapacity { max_send_wr: depth, max_send_sge: config.max_sge.clamp(1, limits.max_sge.max(1)) };
        let max_wr_bytes = config.max_wr_bytes.clamp(1, limits.max_msg_bytes.max(1));
        let queue =
            SendQueueConfig::new(capacity.max_send_sge, max_wr_bytes, config.signal_interval.clamp(1, depth), depth)
                .map_err(|e| device_error(device.name(), e))?;
        let control = ControlLimits { max_windows: config.max_windows_per_grant.min(limits.max_mw) };
        let instance = kv_proto::random::array::<8>()
            .map(u64::from_le_bytes)
            .ok_or_else(|| device_error(device.name(), "no OS randomness for the transport's instance number"))?;
        let endpoint = Endpoint { protocol: Protocol::Rdma, address, details: EndpointDetails { instance }.encode() };
        let shared = Arc::new(Shared {
            memory: RegisteredMemory::new(),
            token: CancellationToken::new(),
            tracker: TaskTracker::new(),
            fence: Mutex::new(Fence { book: FenceBook::new(), pool: WindowPool::new(config.window_pool) }),
            links: Mutex::new(HashMap::new()),
            peers: client::Peers::default(),
            registrations: Mutex::new(Registrations::default()),
            pd,
            device,
            capacity,
            queue,
            control,
            // 0 refuses every sender, as on TCP and QUIC.
            established: kv_net::EstablishedPlaces::new(&config.limits),
            handshakes: config.limits.handshake_places(),
            next_link: AtomicU64::new(1),
            config,
        });
        shared.tracker.spawn(server::accept_loop(Arc::clone(&shared), listener));
        tracing::debug!(%local_addr, endpoint = %endpoint, device = shared.device.name(), ?capacity, "rdma transport bound");
        Ok(Arc::new(Self { shared, local_addr, endpoint }))
    }

    /// The address the control listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The configuration in force.
    pub fn config(&self) -> &RdmaConfig {
        &self.shared.config
    }

    /// The device in use.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// Grants issued and neither revoked nor expired.
    pub fn live_grants(&self) -> usize {
        self.shared.fence().book.grants()
    }

    /// Memory windows bound (over all grants and connections).
    pub fn bound_windows(&self) -> usize {
        self.shared.fence().book.windows()
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.shared.close();
    }
}

#[async_trait]
impl BatchWriter for RdmaTransport {
    fn protocol(&self) -> Protocol {
        Protocol::Rdma
    }

    // The trait declares this method `unsafe`; its one unsafe block forwards
    // the caller's contract to the verbs layer, where the registering is.
    #[allow(unsafe_code)]
    unsafe fn register_regions(&self, regions: &[MemoryRegion], access: RegionAccess) -> Result<(), TransportError> {
        let shared = &*self.shared;
        if shared.memory.is_closed() {
            return Err(TransportError::Shutdown);
        }
        // SAFETY: the caller guarantees (this method's contract) that each
        // region stays valid until `close` returned or the last handle was
        // dropped; `close` closes the bookkeeping and destroys every queue
        // pair, window and registration before it returns.
        let fresh =
            unsafe { register_checked(&shared.pd, &shared.memory, regions, access) }.map_err(|err| match err {
                RegisterError::Regions(err) => TransportError::Registration(err),
                RegisterError::Device(err) => device_error(shared.device.name(), err),
            })?;
        shared.add_registrations(fresh, access)?;
        tracing::debug!(regions = regions.len(), ?access, "rdma regions registered");
        Ok(())
    }

    fn endpoint(&self) -> Endpoint {
        self.endpoint.clone()
    }

    async fn grant(&self, ranges: &[MemoryRegion], valid_for: Duration) -> Result<Grant, TransportError> {
        let shared = &self.shared;
        if shared.memory.is_closed() {
            return Err(TransportError::Shutdown);
        }
        let issued = Instant::now();
        let id = shared.memory.grant(ranges, issued, valid_for)?;
        let destinations: Vec<MemoryRegion> =
            shared.registrations().destinations.iter().map(|r| MemoryRegion::new(r.addr(), r.len())).collect();
        let specs = match crate::fence::window_specs(ranges, &destinations) {
            Ok(specs) => specs,
            Err(err) => {
                shared.memory.revoke(&id);
                return Err(match err {
                    SpecError::Outside { addr, len } => GrantError::OutsideDestinations { addr, len },
                    SpecError::Overlap { first, second } => GrantError::Overlap { first, second },
                }
                .into());
            }
        };
        let windows = specs.len();
        let slot = Arc::new(GrantSlot { lock: tokio::sync::Mutex::new(()), expiry: shared.token.child_token() });
        if shared.fence().book.insert(id, specs, Arc::clone(&slot)).is_err() {
            shared.memory.revoke(&id);
            return Err(TransportError::Shutdown);
        }
        // The expiry fences the windows as a revocation does, at the same
        // instant the bookkeeping stops admitting the grant.
        let timer = Arc::clone(shared);
        // (The bookkeeping caps an overflowing validity at a year; so does this.)
        let expires = issued.checked_add(valid_for).unwrap_or(issued + Duration::from_secs(365 * 24 * 3600));
        shared.tracker.spawn(async move {
            tokio::select! {
                () = slot.expiry.cancelled() => {}
                () = tokio::time::sleep_until(expires.into()) => server::revoke(&timer, &id, "expired").await,
            }
        });
        tracing::debug!(grant = %id, windows, ?valid_for, "grant issued");
        Ok(Grant::plain(id))
    }

    async fn revoke(&self, grant: &GrantId) {
        server::revoke(&self.shared, grant, "revoked").await;
    }

    async fn batch_write(&self, peer: &Endpoint, grant: &Grant, ops: &[WriteOp]) -> Result<(), TransportError> {
        let shared = &self.shared;
        tokio::select! {
            biased;
            () = shared.token.cancelled() => Err(TransportError::Shutdown),
            result = client::batch_write(shared, peer, grant, ops) => result,
        }
    }

    fn stats(&self) -> TransportStats {
        // The memory counts what its checks refuse; the control connections
        // add what they refuse themselves (see `server`, `client`).
        self.shared.memory.stats()
    }

    fn close(&self) {
        self.shared.close();
    }

    async fn shutdown(&self) {
        let shared = &*self.shared;
        shared.close();
        shared.tracker.close();
        shared.tracker.wait().await;
        tracing::debug!(local_addr = %self.local_addr, "rdma transport shut down");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn instance_numbers_come_from_the_os() {
        assert!(kv_proto::random::array::<8>().is_some());
    }
}
