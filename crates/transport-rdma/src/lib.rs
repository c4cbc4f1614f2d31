//! kvlink's RDMA data plane (`mooncake_protocol = "rdma"`): a
//! `kv_proto::BatchWriter` over verbs, one-sided RDMA WRITE into the regions
//! the receiver registered (their address, length and rkey travel in its
//! endpoint, with its GID, QPN and PSN).
//!
//! Bindings: the user's choice, `rdma-core-sys` (2018), does not build
//! against today's rdma-core; this crate is to use `sideway` (maintained
//! rdma-core bindings; needs cmake and libclang-dev at build time).
//!
//! Status: not implemented yet, and off by default (excluded from the
//! default workspace members and from `cargo xtask ci`). `kv-worker` has no
//! `rdma` feature until it passes the shared conformance suite (in a
//! Soft-RoCE guest, as these machines have no RDMA hardware), so asking for
//! `rdma` today is a start-up error naming the missing feature.
//!
//! What it must never do: depend on anything but `kv-proto` among kvlink's
//! crates; let `unsafe` verbs code spread beyond one module.
