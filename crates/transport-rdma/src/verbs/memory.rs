//! Protection domain and memory regions.

use std::sync::Arc;

use sideway::ibverbs::memory_region::MemoryRegion as SidewayMr;
use sideway::ibverbs::protection_domain::ProtectionDomain as SidewayPd;
use sideway::ibverbs::AccessFlags;

use kv_proto::{MemoryRegion as Range, RegionAccess, RegionError, RegionSet, RegisteredMemory};

use super::{Device, VerbsError};
use crate::region::{LocalRegion, RemoteRegion};

/// What the device may do with a registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read locally (the source of our writes); a peer can never write it.
    Source,
    /// Written by peers' RDMA WRITEs through the region's own rkey
    /// (`LOCAL_WRITE | REMOTE_WRITE`): any peer holding the rkey may write
    /// any byte of it, for as long as it is registered. Tests only; the
    /// transport uses [`Access::Windowed`].
    Destination,
    /// Written by peers only through memory windows bound on it
    /// (`LOCAL_WRITE | MW_BIND`, no `REMOTE_WRITE`): the region's own rkey
    /// opens nothing, so a peer can write only while a window is bound, and
    /// only on the queue pair it is bound on (see [`super::MemoryWindow`]).
    Windowed,
}

impl Access {
    fn flags(self) -> AccessFlags {
        match self {
            // Local read is always allowed; no flag grants anything more.
            Access::Source => AccessFlags::none(),
            Access::Destination => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
            Access::Windowed => AccessFlags::LocalWrite | AccessFlags::MemoryWindowBind,
        }
    }
}

/// A protection domain: queue pairs reach only memory regions of their own.
pub struct ProtectionDomain {
    pd: Arc<SidewayPd>,
    device: Arc<Device>,
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain").field("device", &self.device.name()).finish_non_exhaustive()
    }
}

impl ProtectionDomain {
    /// Allocates a protection domain on `device`.
    pub fn new(device: &Arc<Device>) -> Result<Arc<Self>, VerbsError> {
        let pd = device.context().alloc_pd().map_err(|err| VerbsError::sideway("ibv_alloc_pd", err))?;
        Ok(Arc::new(Self { pd, device: Arc::clone(device) }))
    }

    /// The device it lives on.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Registers `[addr, addr + len)` with `access`.
    ///
    /// # Safety
    ///
    /// The range must be mapped memory that stays mapped (not freed, not
    /// unmapped) until the returned region and every work request using it
    /// are gone. With [`Access::Destination`] a peer may write any byte of
    /// the range at any time while it is registered: no Rust reference to
    /// that memory may be alive while a write can land.
    pub unsafe fn register(self: &Arc<Self>, addr: u64, len: u64, access: Access) -> Result<MemoryRegion, VerbsError> {
        let (Ok(ptr), Ok(size)) = (usize::try_from(addr), usize::try_from(len)) else {
            return Err(VerbsError::OutOfRange(format!("region {addr:#x}+{len} does not fit the address space")));
        };
        if size == 0 || ptr.checked_add(size).is_none() {
            return Err(VerbsError::OutOfRange(format!("region {addr:#x}+{len} is empty or wraps")));
        }
        // SAFETY: the caller guarantees the range is mapped and outlives the
        // registration (this function's own contract).
        let mr = unsafe { self.pd.reg_mr(ptr, size, access.flags()) }
            .map_err(|err| VerbsError::sideway("ibv_reg_mr", err))?;
        tracing::debug!(addr, len, ?access, lkey = mr.lkey(), rkey = mr.rkey(), "memory registered");
        Ok(MemoryRegion { mr, addr, len, access, _pd: Arc::clone(self) })
    }

    pub(super) fn raw(&self) -> &Arc<SidewayPd> {
        &self.pd
    }
}

/// A registered memory region; deregistered on drop (after which the device
/// touches the memory no more).
pub struct MemoryRegion {
    mr: Arc<SidewayMr>,
    addr: u64,
    len: u64,
    access: Access,
    _pd: Arc<ProtectionDomain>,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("access", &self.access)
            .field("lkey", &self.lkey())
            .finish_non_exhaustive()
    }
}

impl MemoryRegion {
    /// First byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: empty regions are refused at registration.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How it was registered.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Local key (scatter-gather entries).
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// Remote key (what a peer writes with; useless for a source region).
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The region as the planner's local side.
    pub fn local(&self) -> LocalRegion {
        LocalRegion { addr: self.addr, len: self.len, lkey: self.lkey() }
    }

    /// The region as a peer sees it, to advertise in the handshake.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion { addr: self.addr, len: self.len, rkey: self.rkey() }
    }

    /// Whether `[addr, addr + len)` lies inside the region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }

    /// The raw `ibv_mr`, for a bind work request. Valid while `self` lives.
    pub(super) fn raw(&self) -> *mut rdma_mummy_sys::ibv_mr {
        // SAFETY: only the pointer is taken; it is dereferenced (by the
        // provider) while the caller still holds `self`, which keeps the
        // registration alive.
        unsafe { self.mr.mr() }.as_ptr()
    }
}

/// Why [`register_checked`] refused.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The bookkeeping refuses the regions (overlap, empty, wrapping).
    #[error(transparent)]
    Regions(#[from] RegionError),
    /// The device refused one.
    #[error(transparent)]
    Device(#[from] VerbsError),
}

/// Registers `regions` with `access` in `memory` (the grant bookkeeping)
/// and with the device: sources with local access only, destinations
/// [`Access::Windowed`] (writable by peers only through memory windows).
/// Regions `memory` already holds with that access are not registered again.
/// The bookkeeping is checked first, so nothing reaches the device for
/// regions it refuses. Returns the new device registrations.
///
/// # Safety
///
/// Each region must be valid for reads (and writes, for destinations) until
/// `memory` is closed and every returned registration, every memory window
/// bound on one, and every queue pair of `pd` are gone (the transport's
/// `close` does all of that before it returns).
pub unsafe fn register_checked(
    pd: &Arc<ProtectionDomain>,
    memory: &RegisteredMemory,
    regions: &[Range],
    access: RegionAccess,
) -> Result<Vec<Arc<MemoryRegion>>, RegisterError> {
    let existing = memory.regions(access);
    let mut check = RegionSet::new();
    check.insert(&existing)?;
    check.insert(regions)?;
    let device_access = match access {
        RegionAccess::Source => Access::Source,
        RegionAccess::Destination => Access::Windowed,
    };
    let mut fresh: Vec<Arc<MemoryRegion>> = Vec::new();
    for region in regions {
        if existing.contains(region) || fresh.iter().any(|r| r.addr() == region.addr && r.len() == region.len) {
            continue;
        }
        // SAFETY: the caller's contract covers every region given, for as
        // long as a registration of it lives.
        fresh.push(Arc::new(unsafe { pd.register(region.addr, region.len, device_access) }?));
    }
    // SAFETY: as above; `memory` is closed before the registrations go.
    unsafe { memory.register(regions, access) }?;
    Ok(fresh)
}
