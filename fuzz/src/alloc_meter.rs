//! A counting global allocator: how many heap bytes one piece of code held
//! at most, so a target can assert that decoding peer input allocates within
//! a bound derived from the input (libFuzzer's `-rss_limit_mb` only catches
//! what exceeds the whole process limit).
//!
//! Counters are per thread (the stable replay runs targets on several test
//! threads at once); a block freed on another thread than the one that
//! allocated it only skews that other thread's count, never the measuring one.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The process's allocator: [`System`], counted.
struct Counting;

thread_local! {
    /// Bytes this thread allocated minus bytes it freed (may go negative).
    static CURRENT: Cell<isize> = const { Cell::new(0) };
    /// The highest `CURRENT` since the last [`measure`] started.
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn add(bytes: isize, peak_extra: isize) {
    // `try_with`: a thread being torn down may still free memory. Const
    // thread locals without destructors do not allocate on first use.
    let _ = CURRENT.try_with(|current| {
        let now = current.get().wrapping_add(bytes);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now.wrapping_add(peak_extra))));
        current.set(now);
    });
}

fn signed(size: usize) -> isize {
    isize::try_from(size).unwrap_or(isize::MAX)
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged; the counting touches only plain thread-local integers.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            add(signed(layout.size()), 0);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            add(signed(layout.size()), 0);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; the caller upholds `dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) };
        add(-signed(layout.size()), 0);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `realloc`'s contract.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            // Both blocks may be live while the bytes are copied.
            add(signed(new_size) - signed(layout.size()), signed(layout.size()));
        }
        new
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` and returns its result with the most heap bytes this thread held
/// during it beyond what it held before.
pub(crate) fn measure<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = CURRENT.with(Cell::get);
    PEAK.with(|peak| peak.set(base));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, usize::try_from(peak.wrapping_sub(base)).unwrap_or(0))
}
