//! What decoding a frame may allocate is bounded by the frame, not by the
//! lengths the frame claims: a 50-byte hello claiming a 240 MiB engine id
//! allocated 240 MiB before the decoder found the bytes missing (found by
//! the `side_channel_frame` fuzz target).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kv_proto::FrameCodec;

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

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Meter = Meter;

#[test]
fn a_claimed_string_length_allocates_nothing_before_its_bytes_are_there() {
    let mut frame = Vec::new();
    frame.extend_from_slice(b"KVLK");
    frame.extend_from_slice(&kv_proto::PROTOCOL_VERSION.to_be_bytes());
    frame.extend_from_slice(&[0, 0]);
    let mut body = vec![0u8]; // SideMessage::Hello
    body.extend_from_slice(&[0u8; 32]); // client_nonce
    body.extend_from_slice(&[0xfc, 0x00, 0x00, 0x00, 0x0f]); // engine_id length: 0x0f000000
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    let codec = FrameCodec::default();
    ARMED.store(1, Ordering::SeqCst);
    let decoded = codec.decode_exact(&frame);
    ARMED.store(0, Ordering::SeqCst);
    assert!(decoded.is_err(), "{decoded:?}");
    let largest = LARGEST.load(Ordering::SeqCst);
    assert!(largest < 64 * 1024, "decoding a {}-byte frame allocated {largest} bytes at once", frame.len());
}
