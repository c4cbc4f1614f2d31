//! kvlink's RDMA data plane (`mooncake_protocol = "rdma"`): one-sided RDMA
//! WRITEs over RC queue pairs into the regions the receiver registered (their
//! address, length and rkey travel in its endpoint, with its GID, QPN and PSN).
//!
//! Status: phase 1 (infrastructure). The verbs layer, the connection
//! handshake and the work-request planner are here; the `kv_proto::BatchWriter`
//! on top of them is not yet, so `kv-worker` has no `rdma` feature and asking
//! for `rdma` is still a start-up error naming the missing feature.
//!
//! # Bindings
//!
//! The design names `rdma-core-sys`; it does not build against today's
//! rdma-core (it bundles rdma-core 18 and needs a musl cross toolchain). This
//! crate uses `sideway` (maintained safe wrappers; RAII objects that hold
//! `Arc`s of their parents) and, for the few calls sideway does not wrap, its
//! own sys crate `rdma-mummy-sys`, which loads libibverbs at run time. Both
//! sit behind the `verbs` feature, off by default: building them needs cmake
//! and libclang-dev, running them needs libibverbs and a provider, and a plain
//! `cargo build --workspace` needs none of that.
//!
//! # Revocation ("revoke is a fence"): what the devices offer
//!
//! Measured for the choice the `BatchWriter` phase must make, on the test
//! guest (Debian kernel 6.1, `rdma_rxe`; rdma-core 44):
//! - sideway 0.4 wraps no memory-window calls; its sys crate has
//!   `ibv_alloc_mw`, `ibv_dealloc_mw`, `ibv_bind_mw` and the `IBV_WR_BIND_MW`
//!   and `IBV_WR_LOCAL_INV` work requests, so windows need raw calls here.
//! - rxe reports `MEM_WINDOW` and `MEM_WINDOW_TYPE_2B`, `max_mw` 524287. A
//!   type-2 window bound by a `BIND_MW` work request on the receiver's QP
//!   takes remote writes through its rkey, only on that QP; after a
//!   `LOCAL_INV` completes, a write with that rkey fails (remote access
//!   error) and no byte lands: invalidation is a fence.
//! - But rxe checks a window-addressed write against the underlying memory
//!   region's bounds, not the window's: writes straddling the window's end,
//!   or wholly outside it but inside the region, succeed and land. On
//!   Soft-RoCE a window therefore revokes but does not confine; the per-grant
//!   range check must stay on the sender (the planner refuses a batch outside
//!   the advertised regions), and a conformance test for "outside the grant"
//!   cannot rely on the device there.
//! - Moving a queue pair to the error state flushes every outstanding work
//!   request (tested here); as a fence on the receiver it also needs a
//!   drain marker (a receive posted before, whose flush completion says the
//!   responder has stopped), and it costs a new queue pair and handshake per
//!   revocation.
//!
//! What this crate must never do:
//! - depend on anything but `kv-proto` among kvlink's crates;
//! - let `unsafe` spread beyond the `verbs` module;
//! - post a work request for a batch that is not entirely inside the
//!   receiver's advertised regions (the whole batch is planned and checked
//!   before anything is posted);
//! - trust peer input: the handshake decoder is bounded and fallible.
//!
//! # Modules
//!
//! - [`region`]: registered regions as numbers, and range lookups.
//! - [`plan`]: the work-request planner (chaining, scatter-gather, signalling).
//! - [`window`]: send-queue back-pressure (outstanding requests, retirement).
//! - [`handshake`]: the QP and region exchange over TCP, bounded decoding.
//! - `verbs` (feature `verbs`): the RAII verbs layer, the only `unsafe` code
//!   (the crate root denies `unsafe_code`; only that module allows it).

#![deny(unsafe_code)]

pub mod config;
pub mod control;
pub mod details;
pub mod fence;
pub mod handshake;
pub mod plan;
pub mod region;
pub mod window;

#[cfg(feature = "verbs")]
mod transport;

// The one module allowed `unsafe`.
#[cfg(feature = "verbs")]
#[allow(unsafe_code)]
pub mod verbs;

pub use config::RdmaConfig;
#[cfg(feature = "verbs")]
pub use transport::RdmaTransport;
