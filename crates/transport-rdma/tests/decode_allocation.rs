//! What reading a control reply may allocate is bounded by the bytes that
//! arrive, not by the window count the reply claims: a 12-byte header
//! claiming the limit of windows (a million by default) made the sender
//! allocate 20 MiB for a body that never came (found by the `rdma_control`
//! fuzz target).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use transport_rdma::control::{read_reply, ControlError, ControlLimits, MAGIC, VERSION};

/// Counts the largest single allocation made while armed.
struct Meter;

static ARMED: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Meter {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) > 0 {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        // SAFETY: the caller's contract for `alloc` is forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) > 0 {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ARMED.load(Ordering::Relaxed) > 0 {
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Meter = Meter;

#[tokio::test(flavor = "current_thread")]
async fn a_claimed_window_count_allocates_nothing_before_its_bytes_are_there() {
    let limits = ControlLimits { max_windows: 1 << 20 };
    let mut header = Vec::new();
    header.extend_from_slice(&MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&0u16.to_le_bytes()); // status: windows
    header.extend_from_slice(&limits.max_windows.to_le_bytes());
    header.extend_from_slice(&[0u8; 40]); // two windows' bytes, then the peer stops
    let mut reader = &header[..];
    ARMED.store(1, Ordering::SeqCst);
    let read = read_reply(&mut reader, &limits).await;
    ARMED.store(0, Ordering::SeqCst);
    assert!(matches!(read, Err(ControlError::PeerClosed)), "{read:?}");
    let largest = LARGEST.load(Ordering::SeqCst);
    assert!(largest <= 256 * 1024, "reading a {}-byte reply allocated {largest} bytes at once", header.len());
}
