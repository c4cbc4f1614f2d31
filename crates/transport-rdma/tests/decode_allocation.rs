//! What reading a control reply may allocate is bounded by the bytes that
//! arrive, not by the window count the reply claims: a 12-byte header
//! claiming the limit of windows (a million by default) made the sender
//! allocate 20 MiB for a body that never came (found by the `rdma_control`
//! fuzz target).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use test_support::{largest_allocation, reset_peak_heap};
use transport_rdma::control::{read_reply, ControlError, ControlLimits, MAGIC, VERSION};
use transport_rdma::tags::FrameTags;

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
    reset_peak_heap();
    let read = read_reply(&mut reader, &limits, &mut FrameTags::none()).await;
    let largest = largest_allocation();
    assert!(matches!(read, Err(ControlError::PeerClosed)), "{read:?}");
    assert!(largest <= 256 * 1024, "reading a {}-byte reply allocated {largest} bytes at once", header.len());
}
