//! kvlink's data plane over QUIC (`mooncake_protocol = "quic"`): a
//! [`kv_proto::BatchWriter`] built on quinn and rustls.
//!
//! A prefill instance (P) calls [`BatchWriter::batch_write`] to copy scattered
//! KV-cache blocks from its registered memory into the registered memory of a
//! decode instance (D), whose [`QuicTransport`] serves the endpoint it
//! advertised. One batch is one bidirectional QUIC stream on a connection
//! kept per peer: a header, the op list, the payload, then the receiver's
//! reply. Concurrent batches to one peer are concurrent streams of one
//! connection, so none waits behind another's lost packets. No round trip and
//! no allocation per op: the sender gathers source ranges into 256 KiB chunks
//! that quinn sends as they are, the receiver copies each chunk quinn
//! received straight into the destinations, so the payload is never staged
//! beyond the buffers quinn itself keeps.
//!
//! What this crate must never do:
//! - write a byte outside the regions the receiver registered: every op of a
//!   batch is checked before its payload is read, and a batch with any op
//!   outside is refused whole (its stream stopped, its payload never read);
//! - acknowledge a batch before every byte of it is in memory;
//! - trust a certificate other than the one the endpoint pins;
//! - let a peer's input panic the process, grow memory beyond the configured
//!   bounds, or affect more than its own stream (or, for a QUIC protocol
//!   violation, its own connection);
//! - wait without a bound ([`QuicConfig`] holds every timeout);
//! - touch registered memory after [`BatchWriter::shutdown`] or the drop of
//!   the transport has returned.
//!
//! All `unsafe` code lives in the private `memory` module.
//!
//! # Trust model
//!
//! Each transport makes a self-signed certificate (rcgen, ECDSA P-256) when
//! it binds and advertises its SHA-256 fingerprint in its endpoint details
//! (see [`details`]). D's endpoint reaches P through the side channel; P
//! accepts the TLS 1.3 handshake only if the server's certificate has exactly
//! that fingerprint and the handshake signature verifies with its key (no
//! certificate authority, no host-name check; the SNI is the fixed
//! [`wire::SERVER_NAME`]; ALPN [`wire::ALPN`]). TLS then gives the data
//! confidentiality and integrity against anyone on the path, and P knows it
//! writes to the transport that the endpoint names. The pin is only as
//! trustworthy as the side channel that carried it. Authenticating D (the
//! client of the side channel, the server here) to P, and P to D, beyond
//! that is out of scope of this crate: the receiver accepts any client that
//! completes the handshake, and bounds-checks every write it asks for. The
//! optional shared-secret authentication of DESIGN §7 will be a
//! connection-level exchange (a first stream, or client certificates) under
//! a new ALPN.
//!
//! # Wire format
//!
//! All integers are little-endian. One batch per bidirectional stream; the
//! sender opens it:
//!
//! ```text
//! request (sender → receiver)
//!  0          8             16
//!  | op_count | total_bytes |                     header, 16 bytes
//!  | dst u64 | len u64 | × op_count                op list, 16 bytes per op
//!  | payload: total_bytes bytes = every op's bytes, concatenated in op order |
//!  FIN
//!
//! reply (receiver → sender)
//!  0        4            8
//!  | status | reason_len | reason (UTF-8, at most 1024 bytes) |  FIN
//!    u32      u32
//!  status: 0 ok        every byte is in memory (remote completion)
//!          1 refused   some op is outside the registered regions; nothing
//!                      was written; the receiver stops the stream
//!                      (STOP_SENDING 1) instead of reading the payload
//!          2 protocol  op_count above the limit, lengths that do not add up
//!                      to total_bytes (checked arithmetic), a stream that
//!                      ends early or carries more payload than announced, a
//!                      stall past io_timeout; the stream is stopped
//!                      (STOP_SENDING 2); the connection and its other
//!                      streams go on
//! ```
//!
//! The receiver allows [`QuicConfig::max_concurrent_streams`] streams per
//! connection, no unidirectional streams and no datagrams (a peer that opens
//! them breaks QUIC's limits and loses its connection). The op list is
//! buffered as it arrives (so an announced count costs memory only once its
//! bytes are sent), because every op must be checked before the first
//! payload byte is written.
//!
//! # Endpoint details
//!
//! ```text
//!  0      4         6       8             40                  48             52
//!  | KVLQ | version | flags | fingerprint | max_ops_per_batch | region_count | (addr u64, len u64) × region_count |
//!           u16 = 1   u16     SHA-256       u64                 u32
//! ```
//!
//! The regions let the sender refuse a bad batch whole before sending any of
//! it, and `max_ops_per_batch` lets it fail an oversized batch the same way;
//! the receiver checks everything again. Malformed details (wrong length,
//! magic, version, unknown flags, overlapping or wrapping regions) are a
//! [`kv_proto::TransportError::BadEndpoint`]. See [`details`].
//!
//! # Connections
//!
//! One UDP socket serves incoming and outgoing connections. A sender keeps
//! one connection per peer (address and pinned fingerprint) and opens a
//! stream on it per batch; a connection the peer closed is replaced on the
//! next batch, and a batch that finds its reused connection lost is sent
//! once more on a new one (writes are idempotent). A connection with no
//! packets for [`QuicConfig::idle_timeout`] closes (no keep-alives).

mod client;
mod config;
pub mod details;
mod hello;
mod io;
mod memory;
mod server;
pub mod tls;
mod transport;
pub mod wire;

pub use config::{QuicConfig, DEFAULT_MAX_OPS_PER_BATCH};
pub use details::{EndpointDetails, Fingerprint};
pub use transport::QuicTransport;

#[cfg(doc)]
use kv_proto::BatchWriter;
