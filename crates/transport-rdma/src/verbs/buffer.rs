//! Memory this crate allocates and registers itself, with safe, bounds-checked
//! copies in and out: for tests, benches and bounce buffers, where no caller
//! owns the memory already.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use super::{Access, MemoryRegion, ProtectionDomain, VerbsError};

/// Alignment of the allocation: a page, as registration pins whole pages.
const PAGE: usize = 4096;

/// Zeroed, page-aligned memory owned by this value.
struct Allocation {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: allocated in `RegisteredBuffer::new` with this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// A registered buffer. Its bytes are only ever reached through raw
/// pointers (never Rust references), so a device or peer writing them while
/// it is registered is no aliasing violation.
pub struct RegisteredBuffer {
    // Field order is drop order: deregister before freeing.
    region: MemoryRegion,
    memory: Allocation,
}

// SAFETY: the buffer owns its allocation; every access copies through raw
// pointers under the bounds checks below, from any thread.
unsafe impl Send for RegisteredBuffer {}
// SAFETY: as above; `&self` methods only copy bytes in or out.
unsafe impl Sync for RegisteredBuffer {}

impl std::fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer").field("region", &self.region).finish()
    }
}

impl RegisteredBuffer {
    /// Allocates `len` zeroed bytes and registers them with `access`.
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize, access: Access) -> Result<Self, VerbsError> {
        let layout = Layout::from_size_align(len.max(1), PAGE)
            .map_err(|err| VerbsError::OutOfRange(format!("buffer of {len} bytes: {err}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
            .ok_or_else(|| VerbsError::OutOfRange(format!("cannot allocate {len} bytes")))?;
        let memory = Allocation { ptr, layout };
        let addr = ptr.as_ptr() as u64;
        // SAFETY: the allocation is ours and is freed only after the region
        // (field order); its bytes are never referenced, only copied.
        let region = unsafe { pd.register(addr, len as u64, access) }?;
        Ok(Self { region, memory })
    }

    /// The registration (keys, address, length).
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len() as usize
    }

    /// Whether it has no bytes (never: empty registrations are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), VerbsError> {
        self.check(offset, data.len())?;
        // SAFETY: `offset + data.len()` is within the allocation (checked);
        // `data` is a distinct Rust slice, so the ranges cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.memory.ptr.as_ptr().add(offset), data.len()) };
        Ok(())
    }

    /// Copies `out.len()` bytes out from `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), VerbsError> {
        self.check(offset, out.len())?;
        // SAFETY: as in `write`, the other way round.
        unsafe { std::ptr::copy_nonoverlapping(self.memory.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// A copy of every byte.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.len()];
        // The range is the whole buffer: it cannot be out of bounds.
        let _ = self.read(0, &mut out);
        out
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), VerbsError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(VerbsError::OutOfRange(format!("{len} bytes at {offset} exceed a buffer of {}", self.len()))),
        }
    }
}
