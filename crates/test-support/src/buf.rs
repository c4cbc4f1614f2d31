//! [`TestBuf`]: zeroed, page-aligned memory a test registers with a
//! transport and reads back once nothing writes into it.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use kv_proto::MemoryRegion;

/// Page alignment, as engine caches and RDMA registrations have.
const ALIGN: usize = 4096;

/// A zeroed, page-aligned allocation that transports read from and write
/// into. It is only ever viewed as a slice while no transfer into it is in
/// flight (the tests look after `batch_write` returned or the grant was
/// revoked), or byte by byte through [`TestBuf::peek_volatile`].
pub struct TestBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl TestBuf {
    /// `len` zeroed bytes; `len` must not be zero.
    pub fn new(len: usize) -> Self {
        assert!(len > 0, "a test buffer holds at least one byte");
        let layout = Layout::from_size_align(len, ALIGN).unwrap();
        // SAFETY: `len` > 0, so the layout is not zero-sized.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).expect("allocation failed");
        Self { ptr, len }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: a test buffer holds at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Its first byte's address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr().expose_provenance() as u64
    }

    /// The address of byte `offset`.
    pub fn at(&self, offset: usize) -> u64 {
        self.addr() + offset as u64
    }

    /// The address one past its last byte.
    pub fn end(&self) -> u64 {
        self.addr() + self.len as u64
    }

    /// All of it, as a region to register or grant.
    pub fn region(&self) -> MemoryRegion {
        MemoryRegion::new(self.addr(), self.len as u64)
    }

    /// Its bytes (only while no transfer into it is in flight).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation is `len` bytes, live until drop; tests read
        // only while no transfer into it is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Its bytes, to fill before a transfer reads them.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Whether every byte is still zero.
    pub fn is_zero(&self) -> bool {
        self.bytes().iter().all(|&b| b == 0)
    }

    /// Byte `i`, read while the kernel may be writing into the buffer (a
    /// volatile read through the raw pointer; no reference is made).
    pub fn peek_volatile(&self, i: usize) -> u8 {
        assert!(i < self.len);
        // SAFETY: `i` is inside the live allocation; a volatile read of a u8
        // is a plain load the compiler cannot elide or merge.
        unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(i)) }
    }
}

impl Drop for TestBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).unwrap();
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}
