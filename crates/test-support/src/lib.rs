//! What the integration tests of several kvlink crates share, in one place:
//!
//! - [`conformance`]: the contract every `BatchWriter` keeps, as one
//!   function per case, which each backend's own tests run against it
//!   ([`conformance_suite!`] makes one test per case);
//! - [`TestBuf`], [`Node`] and [`pattern`]: registered test memory, a
//!   transport with its buffer, and byte patterns that say which op wrote
//!   them;
//! - how many descriptors and how many live heap bytes this process holds
//!   ([`Resources`], so a test can prove a hostile peer left nothing
//!   behind), peaks under an attack, and running a test alone on a runtime
//!   of its own ([`isolated`]);
//! - [`listener`]: cases about a network transport's listener (admission,
//!   the op-list budget, failed proofs and refused batches counted),
//!   written once against a small trait each transport's tests implement
//!   over their raw clients;
//! - [`stats`]: what a transport's counters should say; [`Logs`]: the log
//!   lines a test provokes, to count;
//! - [`process`]: what `/proc` says of this process or of a child a test
//!   started; [`ports`]: a port a test can free and bind again (a listener
//!   restarted on the same port).
//!
//! Linking this crate makes a counting allocator the test binary's global
//! allocator. It counts bytes handed out and not yet freed, which is what a
//! leak adds to; resident memory also holds what the system allocator keeps
//! of freed memory, which depends on fragmentation and on the machine, so it
//! is only compared against generous bounds (the peak under an attack).
//!
//! Never a dependency of anything but tests: it depends on kv-proto for the
//! trait the suite speaks, which is why no library may depend on it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod buf;
pub mod conformance;
mod heap;
pub mod listener;
mod logs;
mod node;
pub mod pattern;
pub mod ports;
pub mod process;
mod resources;
pub mod stats;

pub use buf::TestBuf;
pub use logs::Logs;
pub use node::{assert_still_serves, write_batch, Node, GRANT_VALIDITY};
pub use resources::{
    heap_bytes, isolated, largest_allocation, open_fds, peak_heap_growth, peak_rss_growth, reset_peak_heap,
    reset_peak_rss, Resources, HEAP_SLACK,
};

#[global_allocator]
static HEAP: heap::Counting = heap::Counting;
