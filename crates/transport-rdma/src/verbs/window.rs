//! Type-2 memory windows: a remote key over part of a [`Access::Windowed`]
//! region, bound by a work request on one queue pair and usable only there,
//! until a `LOCAL_INV` work request on that queue pair invalidates it.
//!
//! sideway 0.4 wraps no memory-window calls, so this module makes the raw
//! ones (`ibv_alloc_mw`, `ibv_dealloc_mw`); binding and invalidating are work
//! requests ([`super::QueuePair::post_binds`],
//! [`super::QueuePair::post_invalidates`]).
//!
//! Ownership: a window holds the protection domain it was allocated in, and,
//! while bound, the memory region and the queue pair it is bound to, so
//! neither is destroyed under a bound window (the device refuses to
//! deregister such a region, and destroying such a queue pair waits in the
//! kernel for its windows). Dropping a window deallocates it, which also
//! unbinds it.
//!
//! [`Access::Windowed`]: super::Access::Windowed

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys::{ibv_alloc_mw, ibv_dealloc_mw, ibv_mw, ibv_mw_type};

use super::{MemoryRegion, ProtectionDomain, QpHold, VerbsError};

/// What a window is bound to.
#[derive(Debug)]
struct Binding {
    /// Held, not read: the region and the queue pair outlive the binding.
    _region: Arc<MemoryRegion>,
    _qp: QpHold,
    addr: u64,
    len: u64,
}

/// A type-2 memory window, deallocated on drop.
pub struct MemoryWindow {
    mw: NonNull<ibv_mw>,
    bound: Option<Binding>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: the `ibv_mw` is the provider's object, used by us only through
// `&mut self` (its rkey field) or read through `&self`; libibverbs objects
// may be used from any thread.
unsafe impl Send for MemoryWindow {}
// SAFETY: `&self` methods only read the rkey field, which is written only
// through `&mut self`.
unsafe impl Sync for MemoryWindow {}

impl std::fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryWindow")
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("bound", &self.bound.as_ref().map(|b| (b.addr, b.len)))
            .finish()
    }
}

impl MemoryWindow {
    /// Allocates an unbound type-2 window in `pd`.
    pub fn alloc(pd: &Arc<ProtectionDomain>) -> Result<Self, VerbsError> {
        // SAFETY: the PD is alive (we hold its Arc for the window's life).
        let raw = unsafe { ibv_alloc_mw(pd.raw().pd().as_ptr(), ibv_mw_type::IBV_MW_TYPE_2) };
        let mw = NonNull::new(raw).ok_or_else(|| VerbsError::Call {
            call: "ibv_alloc_mw(type 2)",
            source: std::io::Error::last_os_error(),
        })?;
        Ok(Self { mw, bound: None, _pd: Arc::clone(pd) })
    }

    /// The window's current remote key (the one peers write with while it
    /// is bound).
    pub fn rkey(&self) -> u32 {
        // SAFETY: the window is allocated until drop; the field is plain data.
        unsafe { self.mw.as_ref().rkey }
    }

    /// The key the next bind must give it: the same index (upper 24 bits),
    /// the next 8-bit key, so a key of an earlier binding never opens it again.
    pub fn next_rkey(&self) -> u32 {
        let rkey = self.rkey();
        (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
    }

    /// The range it is bound to, if a bind completed and no invalidation since.
    pub fn bound_range(&self) -> Option<(u64, u64)> {
        self.bound.as_ref().map(|b| (b.addr, b.len))
    }

    /// Records a bind that completed successfully on the queue pair `qp`
    /// holds: the window now covers `[addr, addr + len)` of `region` under
    /// `rkey`.
    pub fn set_bound(&mut self, region: Arc<MemoryRegion>, qp: QpHold, addr: u64, len: u64, rkey: u32) {
        // SAFETY: the window is allocated; a type-2 bind changes the key in
        // the device, and the next bind names the current one through this
        // field (as `ibv_bind_mw` updates it for type 1).
        unsafe { self.mw.as_mut().rkey = rkey };
        self.bound = Some(Binding { _region: region, _qp: qp, addr, len });
    }

    /// Records an invalidation that completed successfully: the window is
    /// free to bind again and no longer holds its region.
    pub fn set_invalidated(&mut self) {
        self.bound = None;
    }

    pub(super) fn raw(&self) -> *mut ibv_mw {
        self.mw.as_ptr()
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: allocated by `ibv_alloc_mw`, deallocated once, here. Its
        // binding (if any) ends with it; `bound` (the region's Arc) is
        // dropped after this, so the region outlives the window.
        let code = unsafe { ibv_dealloc_mw(self.mw.as_ptr()) };
        if code != 0 {
            tracing::warn!(rkey = self.rkey(), code, "ibv_dealloc_mw failed");
        }
    }
}
