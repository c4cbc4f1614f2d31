//! kvlink's data plane over QUIC (`mooncake_protocol = "quic"`): a
//! [`kv_proto::BatchWriter`] built on quinn and rustls.
//!
//! A decode instance (D) registers its KV blocks as destinations and, for
//! each pull, issues a write grant over exactly the blocks it allocated
//! ([`BatchWriter::grant`]). A prefill instance (P) calls
//! [`BatchWriter::batch_write`] under that grant to copy scattered KV-cache
//! blocks from its source regions into D's memory, whose [`QuicTransport`]
//! serves the endpoint it advertised. One batch is one bidirectional QUIC
//! stream on a connection kept per peer: a header naming the grant, the op
//! list, the payload, then the receiver's verdict. Concurrent batches to one
//! peer are concurrent streams of one connection, so none waits behind
//! another's lost packets. No round trip and no allocation per op: the
//! sender gathers source ranges into 256 KiB chunks that quinn sends as they
//! are, the receiver copies each chunk quinn received straight into the
//! destinations, so the payload is never staged beyond the buffers quinn
//! itself keeps.
//!
//! What this crate must never do:
//! - write a byte outside a live grant this transport issued: a batch is
//!   admitted against its grant before any of its payload is read, and a
//!   batch for an unknown, expired or revoked grant, or with any op outside
//!   the grant (an ungranted destination, a source region), is refused
//!   whole (its stream stopped, its payload never read);
//! - write a byte of a grant after [`BatchWriter::revoke`] of it returned,
//!   or a byte at all after [`BatchWriter::close`] returned;
//! - read a source range outside the regions registered as sources;
//! - acknowledge a batch before every byte of it is in memory;
//! - trust a certificate other than the one the endpoint pins, or, with a
//!   shared secret configured, carry or serve a batch on a connection whose
//!   peer has not proven it;
//! - let a peer's input panic the process, grow memory beyond the configured
//!   bounds (op lists: one budget for all streams), or affect more than its
//!   own stream (or, for a QUIC protocol
//!   violation or a failed hello, its own connection);
//! - wait without a bound ([`QuicConfig`] holds every timeout).
//!
//! All `unsafe` code lives in the private `memory` module, each block with
//! its `SAFETY` argument.
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
//! trustworthy as the side channel that carried it.
//!
//! D does not authenticate P by TLS (no client certificates): what keeps an
//! arbitrary client out of D's memory is the grant. A grant id is 128 random
//! bits that only D and the P it asked know; a batch writes only inside the
//! ranges of the live grant it names, never into a source region, never
//! after the grant was revoked or expired.
//!
//! With [`QuicConfig::auth_secret`] set, both sides also prove knowledge of
//! the shared secret before any batch (the hello below): HMAC-SHA-256 proofs
//! from [`kv_proto::auth`] for [`kv_proto::auth::Channel::DataQuic`], over a
//! transcript of both fresh nonces and a context made of keying material
//! exported from this TLS session ([`wire::EXPORTER_LABEL`]) and the client
//! hello as sent. A proof is therefore worthless on another connection (a
//! relay sees a different exporter value), for another protocol (the side
//! channel's or the TCP data plane's proofs carry other labels), or in the
//! other direction. The receiver proves first and the sender checks that
//! proof before producing its own, so neither side is an oracle for the
//! other. Proofs are compared in constant time by the MAC crate. A side with
//! a secret refuses a peer without one, and a side without one refuses a
//! peer that demands one, each with an error that says so; the whole hello
//! is bounded by one deadline ([`QuicConfig::connect_timeout`] connecting,
//! [`ListenerLimits::handshake_timeout`] accepting).
//!
//! # The grant check and the fence
//!
//! The bookkeeping is [`kv_proto::RegisteredMemory`]'s, the one copy every
//! transport shares. For each incoming batch the receiver:
//! 1. reads the header and refuses at once a grant that is not live (before
//!    buffering an op list a stranger announced);
//! 2. reads the op list and admits it ([`kv_proto::RegisteredMemory::admit`]):
//!    lengths add up to the header's total, the grant is still live, every
//!    op lies inside its ranges; anything else refuses the batch whole;
//! 3. copies each chunk of payload quinn hands over inside
//!    [`kv_proto::GrantAccess::with`], a short synchronous copy under the
//!    grant's read lock.
//!
//! [`BatchWriter::revoke`] takes that lock for writing: it waits for the copy
//! in progress (microseconds: one read's chunks) and no copy starts after
//! it, so when it returns no byte of the grant can land any more. A batch
//! cut by a revocation has its stream stopped and gets a `Refused` verdict.
//! [`BatchWriter::close`] (called by `shutdown` and by `Drop`) ends every
//! grant and every source read the same way. Each refusal is logged with the
//! peer's address and the grant's short form (its first four bytes).
//!
//! # Wire format
//!
//! All integers are little-endian. A connection starts with the hello on the
//! first bidirectional stream, which the sender opens; every later stream
//! carries one batch.
//!
//! ```text
//! hello (first stream, before any batch; bounded by the handshake deadline)
//!  client → server  | KVLH | version u16 = 2 | flags u16 | client_nonce [32] |
//!  server → client  | KVLH | version u16 = 2 | flags u16 | server_nonce [32] | server_proof [32] |
//!                   flags bit 0 AUTH: this side holds a shared secret
//!                   (nonce and proof are zeros without it)
//!  only if both set AUTH:
//!  client → server  client_proof [32]  FIN       (after checking server_proof)
//!  server → client  verdict (below)    FIN
//!  proofs: kv_proto::auth over Transcript { DataQuic, client_nonce,
//!          server_nonce, context = TLS exporter(EXPORTER_LABEL, 32 bytes)
//!          ‖ client hello as sent }
//!  refusals close the connection with CLOSE_AUTH and a reason the peer logs
//!  (no secret here, none there, a proof that does not verify, the deadline);
//!  a receiver serving its most connections closes with CLOSE_BUSY and the
//!  reason in place of its last answer (the no-secret server hello, or the
//!  verdict)
//!
//! batch request (sender → receiver, one stream per batch)
//!  0         16         24            32
//!  | grant   | op_count | total_bytes |              header, 32 bytes
//!  | dst u64 | len u64 | × op_count                  op list (kv_proto::dataplane)
//!  | payload: total_bytes bytes = every op's bytes, concatenated in op order |
//!  FIN
//!
//! verdict (receiver → sender; kv_proto::dataplane)
//!  0        4            8
//!  | status | reason_len | reason (UTF-8, at most 1024 bytes) |  FIN
//!    u32      u32
//!  status: 0 ok        every byte is in memory (remote completion)
//!          1 refused   unknown, expired or revoked grant, or an op outside
//!                      it; nothing was written (or, revoked mid-batch,
//!                      nothing after the revocation); the receiver stops
//!                      the stream (STOP_SENDING 1) instead of reading on
//!          2 protocol  op_count above the limit, lengths that do not add up
//!                      to total_bytes (checked arithmetic), a stream that
//!                      ends early or carries more payload than announced, a
//!                      stall past io_timeout; the stream is stopped
//!                      (STOP_SENDING 2); the connection and its other
//!                      streams go on
//!  a sender that abandons a batch resets its stream (RESET_STREAM 7)
//! ```
//!
//! The receiver allows [`QuicConfig::max_concurrent_streams`] streams per
//! connection once its hello succeeded (before: the hello's stream only,
//! and 64 KiB of unread data instead of [`QuicConfig::receive_window`], so
//! peers that never prove the secret cannot make it buffer much), no
//! unidirectional streams and no datagrams; a sender's
//! connections allow the peer no streams at all (a peer that opens them
//! breaks QUIC's limits and loses its connection). The op list is buffered
//! as it arrives (so an announced count costs memory only once its bytes
//! are sent, and only under a live grant), because every op must be checked
//! before the first payload byte is written. All streams share one budget
//! for those buffers ([`QuicConfig::op_lists`]: [`OpListLimits::budget`], smaller when
//! peers need not prove a secret: [`OpListLimits::unauthenticated_budget`]):
//! a list is charged as it grows; when the budget is full a batch waits for
//! room, or gives way at once if it already holds an equal share of the
//! budget or more (so batches waiting for each other cannot lock it up). A
//! batch refused for want of room has its stream stopped and a `Refused`
//! verdict naming the reason. The whole op list, waits included, must
//! arrive within [`OpListLimits::timeout`] of its header. The
//! advertised `max_ops_per_batch` is the smaller of the configured bound and
//! what the budget holds.
//!
//! # Endpoint details
//!
//! ```text
//!  0      4         6       8             40                  48
//!  | KVLQ | version | flags | fingerprint | max_ops_per_batch |
//!           u16 = 2   u16 = 0 SHA-256       u64
//! ```
//!
//! `max_ops_per_batch` lets a sender fail an oversized batch before sending
//! it; the receiver checks it again. Version 1 also listed the receiver's
//! regions; a sender cannot see grants, so version 2 lists none and the
//! receiver refuses a bad batch whole before reading its payload. Malformed
//! details (wrong length, magic, version, unknown flags) are a
//! [`kv_proto::TransportError::BadEndpoint`]. See [`details`].
//!
//! # Connections and bounds
//!
//! One UDP socket serves incoming and outgoing connections. A sender keeps
//! one connection per peer (address and pinned fingerprint) and opens a
//! stream on it per batch; a connection the peer closed is replaced on the
//! next batch, and a batch that finds its reused connection lost is sent
//! once more on a new one (writes are idempotent, and checked against the
//! grant again). A connection with no packets for
//! [`QuicConfig::idle_timeout`] closes (no keep-alives).
//!
//! Establishing a connection (resolution, handshake, hello) has one
//! deadline on each side: [`QuicConfig::connect_timeout`] for the sender,
//! [`ListenerLimits::handshake_timeout`] for the receiver, from accept. A sender's wait
//! while its payload flows (a stream slot, each write, the peer's
//! acknowledgement of the whole stream) ends when the connection shows no
//! progress (acknowledgements, flow-control credit) for
//! [`QuicConfig::io_timeout`]; once the payload is acknowledged, the verdict
//! must arrive within `io_timeout`, absolutely, so a receiver that keeps
//! acknowledging but never answers cannot hold a batch, and the sender's
//! blocks, any longer. Dropping a `batch_write` future resets its stream.

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

pub use config::QuicConfig;
// Shared with the other data planes (kv-net), under the names this crate
// has always exported.
pub use details::{EndpointDetails, Fingerprint};
pub use kv_net::{
    ListenerLimits, OpListLimits, DEFAULT_MAX_OPS_PER_BATCH, DEFAULT_OP_LIST_BUDGET, DEFAULT_OP_LIST_TIMEOUT,
    DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
};
pub use transport::QuicTransport;

#[cfg(doc)]
use kv_proto::BatchWriter;
