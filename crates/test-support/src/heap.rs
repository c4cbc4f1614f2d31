//! The counting allocator: the system allocator, plus the bytes handed out
//! and not yet freed, their peak, and the largest single allocation since
//! the last reset. (Written here
//! because the counting allocators on offer either keep no peak or turn
//! every `realloc` into a copy and every `alloc_zeroed` into a memset,
//! which would slow the throughput tests that link this crate.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

pub(crate) struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let live = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(live, Ordering::Relaxed);
    LARGEST.fetch_max(by, Ordering::Relaxed);
}

fn shrank(by: usize) {
    LIVE.fetch_sub(by, Ordering::Relaxed);
}

/// Bytes live now.
pub(crate) fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The most bytes live at once since [`reset_peak`].
pub(crate) fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Restarts the peak from what is live now, and the largest allocation
/// from nothing.
pub(crate) fn reset_peak() {
    PEAK.store(live(), Ordering::Relaxed);
    LARGEST.store(0, Ordering::Relaxed);
}

/// The largest single block handed out (or grown to) since [`reset_peak`].
pub(crate) fn largest() -> usize {
    LARGEST.load(Ordering::Relaxed)
}

// SAFETY: every call is passed on unchanged to `System`, which upholds
// `GlobalAlloc`'s contract; the counters only add and subtract the sizes of
// the layouts `System` succeeded with.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract for `layout`.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc_zeroed`'s contract for `layout`.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a block this allocator (that is,
        // `System`) handed out with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller upholds `realloc`'s contract; `ptr` came from
        // `System` with `layout`.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            grew(new_size);
            shrank(layout.size());
        }
        new
    }
}
