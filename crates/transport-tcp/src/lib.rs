//! kvlink's data plane over TCP: a [`kv_proto::BatchWriter`] built on tokio.
//!
//! A prefill instance (P) calls [`BatchWriter::batch_write`] to copy scattered
//! KV-cache blocks from its registered memory into the registered memory of a
//! decode instance (D), whose [`TcpTransport`] listens on the endpoint it
//! advertised. One batch costs one header, one op list and one payload on one
//! connection: no round trip and no allocation per op. The payload goes out
//! with vectored `sendmsg` calls straight from the source memory and comes in
//! with vectored `readv` calls straight into the destination memory (up to
//! 1024 segments per call), so it is never staged.
//!
//! What this crate must never do:
//! - write a byte outside the regions the receiver registered: every op of a
//!   batch is checked before its payload is read, and a batch with any op
//!   outside is refused whole, its payload discarded;
//! - acknowledge a batch before every byte of it is in memory;
//! - let a peer's input panic the process, grow memory beyond the configured
//!   bounds, or affect more than its own connection;
//! - wait without a bound ([`TcpConfig`] holds every timeout);
//! - touch registered memory after [`BatchWriter::shutdown`] or the drop of
//!   the transport has returned.
//!
//! All `unsafe` code lives in the private `memory` module.
//!
//! # Wire format
//!
//! All integers are little-endian. A sender opens a connection and writes the
//! preamble; the receiver answers with an accept reply:
//!
//! ```text
//! preamble (sender → receiver, 8 bytes; 40 with FLAG_AUTH)
//!  0      4         6       8
//!  | KVLT | version | flags | [client_nonce, 32 bytes, if flags has FLAG_AUTH]
//!           u16       u16      flags: bit 0 FLAG_AUTH (the sender holds the
//!                              shared secret); unknown bits are refused.
//!
//! accept (receiver → sender, 24 bytes)
//!  0      4         6        8                   16                24
//!  | KVLT | version | status | max_ops_per_batch | idle_timeout_ms |
//!           u16       u16      u64                 u64
//!  status: 0 accepted, 1 unsupported version, 2 unsupported flags,
//!  3 the receiver requires the secret, 4 the receiver has no secret (the
//!  receiver closes after a non-zero status; a bad magic is closed unanswered)
//!
//! authentication (only when both hold a secret, before any batch)
//!  receiver → sender: server_nonce (32) | HMAC(secret, "kvlink-p", client_nonce, server_nonce) (32)
//!  sender → receiver: HMAC(secret, "kvlink-d", server_nonce, client_nonce) (32)
//!  receiver → sender: verdict u8 (0 ok; 1 refused, then close)
//! ```
//!
//! The sender checks the receiver's proof before sending its own, so each
//! side proves the secret to the other and a recorded exchange cannot be
//! replayed (fresh nonces on both sides). A sender with a secret writes only
//! to receivers that prove it; a receiver with one reads no batch from a
//! sender that has not.
//!
//! Then any number of batches, one at a time per connection:
//!
//! ```text
//! batch (sender → receiver)
//!  0          8          16            24
//!  | batch_id | op_count | total_bytes |            header, 24 bytes
//!  | dst u64 | len u64 | × op_count                 op list, 16 bytes per op
//!  | payload: total_bytes bytes = every op's bytes, concatenated in op order |
//!
//! reply (receiver → sender)
//!  0          8        12           16
//!  | batch_id | status | reason_len | reason (UTF-8, at most 1024 bytes) |
//!    u64        u32      u32
//!  status: 0 ok        every byte is in memory
//!          1 refused   some op is outside the registered regions; the
//!                      payload was read and discarded, nothing written; the
//!                      connection stays usable
//!          2 protocol  op_count above the limit or lengths that do not add
//!                      up to total_bytes; the receiver closes the connection
//! ```
//!
//! A receiver closes a connection, logging why, on a bad preamble, an
//! `op_count` above [`TcpConfig::max_ops_per_batch`], lengths that do not sum
//! to `total_bytes` (checked arithmetic), a truncated frame, any stalled read
//! past [`TcpConfig::io_timeout`], or no batch within
//! [`TcpConfig::idle_timeout`]. The op list is buffered as it arrives (so an
//! announced count costs memory only once its bytes are sent), because every
//! op must be checked before the first payload byte is written.
//!
//! # Connections
//!
//! Outgoing connections are pooled per peer address (at most
//! [`TcpConfig::max_idle_conns_per_peer`] idle); concurrent batches to one
//! peer use separate connections. A pooled connection is probed (non-blocking
//! peek) before reuse and retired after half the receiver's idle timeout; if
//! it still turns out closed by the peer, the batch is sent once more on a
//! new connection (writes are idempotent). A connection that failed in any
//! other way is dropped, and the next batch reconnects.
//!
//! A batch of at least `parallel_min_bytes` is cut into
//! `parallel_streams` parts of about equal bytes, each written by its own
//! task on its own pooled connection, so the copies run on several cores;
//! the batch succeeds when every part is acknowledged. To keep a bad batch
//! refused whole, the sender first checks every destination against the
//! regions the receiver advertises in its endpoint details (16 bytes per
//! region: address and length, little-endian); a peer that advertises none
//! is written on one connection. The receiver still checks every part.

mod client;
mod config;
mod io;
mod memory;
mod nonce;
mod server;
mod split;
mod transport;
pub mod wire;

pub use config::{TcpConfig, DEFAULT_MAX_OPS_PER_BATCH};
pub use transport::TcpTransport;

#[cfg(doc)]
use kv_proto::BatchWriter;
