//! kvlink's QUIC data plane (`mooncake_protocol = "quic"`): a
//! `kv_proto::BatchWriter` over quinn with rustls, whose endpoint carries the
//! certificate fingerprint a peer pins.
//!
//! Status: not implemented yet. This crate holds the place the layout in
//! DESIGN.md gives it; `kv-worker` has no `quic` feature until it passes the
//! shared conformance suite, so asking for `quic` today is a start-up error
//! naming the missing feature rather than a silent fallback.
//!
//! What it must never do: depend on anything but `kv-proto` among kvlink's
//! crates; accept a write outside the receiver's registered regions; report a
//! batch written before the peer acknowledged every byte.
