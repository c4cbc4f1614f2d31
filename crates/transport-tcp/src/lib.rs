//! kvlink's data plane over TCP: a [`kv_proto::BatchWriter`] built on tokio.
//!
//! A decode instance (D) registers its KV memory as destinations, issues a
//! write grant for each pull ([`BatchWriter::grant`]: a random 128-bit id and
//! the exact destination ranges of that pull) and hands it to the prefill
//! instance (P) over the side channel. P registers its KV memory as sources
//! and calls [`BatchWriter::batch_write`] with D's endpoint and that grant to
//! copy scattered KV-cache blocks into D's memory. One batch costs one
//! header, one op list and one payload on one connection: no round trip and
//! no allocation per op. The payload goes out with vectored `sendmsg` calls
//! straight from the source memory and comes in with vectored `readv` calls
//! straight into the destination memory (up to 1024 segments per call), so
//! it is never staged.
//!
//! # The grant check and the fence
//!
//! The receiver admits every batch against the grant its header names
//! before it reads a payload byte ([`kv_proto::RegisteredMemory::admit`]):
//! the grant must be live (issued here, not expired, not revoked) and every
//! op must lie inside its ranges. Otherwise the batch is refused whole,
//! logged with the peer's address and the grant's short form, its payload
//! discarded, and the connection stays usable. Each `readv` of an admitted
//! payload runs inside [`kv_proto::GrantAccess::with`], so
//! [`BatchWriter::revoke`] is a fence: it waits for a `readv` in progress,
//! and once it returns no byte of that grant lands any more (the rest of a
//! batch in flight is read and discarded, and the sender told `Refused`).
//!
//! What this crate must never do:
//! - write a byte into memory registered as a source, outside the ranges of
//!   the live grant a batch names, or after that grant was revoked;
//! - write part of a batch that is refused: a batch spread over several
//!   connections is pre-checked part by part before any payload is sent;
//! - acknowledge a batch before every byte of it is in memory;
//! - let a peer's input panic the process, grow memory beyond the configured
//!   bounds (op lists: one budget for all connections), or affect more than
//!   its own connection;
//! - let peers that do not finish their handshake crowd out those that did:
//!   a connection in its handshake holds a handshake place (bounded in
//!   total, [`ListenerLimits::max_handshakes`], and per source host,
//!   [`ListenerLimits::max_handshakes_per_host`], of
//!   [`TcpConfig::limits`]) for at most one deadline
//!   ([`kv_net::ListenerLimits::handshake_timeout`]), and takes an established place
//!   ([`ListenerLimits::max_connections`]) only once the handshake succeeded;
//! - wait without a bound ([`TcpConfig`] holds every timeout);
//! - touch registered memory after [`BatchWriter::close`],
//!   [`BatchWriter::shutdown`] or the drop of the transport has returned.
//!
//! All `unsafe` code lives in the private `memory` module.
//!
//! # Wire format (version 3)
//!
//! All integers are little-endian. A sender opens a connection and writes the
//! preamble; the receiver answers with an accept reply:
//!
//! ```text
//! preamble (sender → receiver, 8 bytes; 40 with FLAG_AUTH)
//!  0      4         6       8
//!  | KVLT | version | flags | [client_nonce, 32 bytes, if flags has FLAG_AUTH]
//!           u16 = 3   u16      flags: bit 0 FLAG_AUTH (the sender holds the
//!                              shared secret); unknown bits are refused.
//!
//! accept (receiver → sender, 24 bytes)
//!  0      4         6        8                   16                24
//!  | KVLT | version | status | max_ops_per_batch | idle_timeout_ms |
//!           u16       u16      u64                 u64
//!  status: 0 accepted, 1 unsupported version, 2 unsupported flags,
//!  3 the receiver requires the secret, 4 the receiver has no secret,
//!  5 the receiver serves its most connections already (the receiver
//!  closes after a non-zero status; a bad magic is closed unanswered)
//!
//! authentication (only when both hold a secret, before any batch)
//!  receiver → sender: server_nonce (32) | server_proof (32)
//!  sender → receiver: client_proof (32)     (after checking server_proof)
//!  receiver → sender: verdict u8 (0 ok; 1 refused, 2 proved but the
//!                     receiver serves its most connections; then close)
//! ```
//!
//! The proofs are [`kv_proto::auth`]'s HMAC-SHA-256 over the whole
//! transcript: the channel [`kv_proto::auth::Channel::DataTcp`] (so a proof
//! made for the side channel or QUIC is worthless here), the prover's role
//! (so a reflected server proof is no client proof), both nonces (fresh on
//! both sides, so nothing replays), and as context the preamble and the
//! accept reply exactly as sent (so neither can be altered unnoticed). Both
//! sides verify in constant time. A sender with a secret writes only to
//! receivers that prove it; a receiver with one reads no batch from a sender
//! that has not. The receiver bounds the whole handshake (preamble, accept,
//! authentication) by one deadline from accept, then keeps the connection
//! while batches arrive within [`TcpConfig::idle_timeout`].
//!
//! Then any number of batches, one at a time per connection:
//!
//! ```text
//! batch (sender → receiver)
//!  0          8       12         16         24            40         48
//!  | batch_id | flags | reserved | op_count | total_bytes | grant_id |   header, 48 bytes
//!    u64        u32     u32 = 0    u64        u64           16 bytes
//!  | dst u64 | len u64 | × op_count                     op list, 16 bytes per op
//!  | payload: total_bytes bytes = every op's bytes, concatenated in op order |
//!  flags: bit 0 PRECHECK (see below); unknown bits or a non-zero reserved
//!  field are a protocol error.
//!
//! reply (receiver → sender)
//!  0          8        12           16
//!  | batch_id | status | reason_len | reason (UTF-8, at most 1024 bytes) |
//!    u64        u32      u32
//!  status: 0 ok        every byte is in memory
//!          1 refused   unknown, expired or revoked grant, an op outside
//!                      it, or no room for the op list in the receiver's
//!                      budget; nothing was written (a revocation mid-batch:
//!                      nothing after it); the rest was read and
//!                      discarded; the connection stays usable
//!          2 protocol  bad flags, op_count above the limit, or lengths that
//!                      do not add up to total_bytes; the receiver closes
//! ```
//!
//! On an authenticated connection every batch header, every op list and
//! every reply is followed by a 16-byte tag ([`kv_proto::session`]: HMAC
//! under a key of its direction derived from the secret and the handshake's
//! transcript, over a count of the frames before it and the frame's bytes).
//! The receiver checks the header's tag before it acts on the header, and
//! the op list's before it admits one op; the sender checks each reply's
//! before it believes it. A tag that does not match closes the connection
//! at once (nothing of that batch is written): bytes altered, injected,
//! replayed or reordered after the handshake cost only that connection.
//! The payload itself carries no tag: it lands only where an authenticated
//! op list under a live grant says, and QUIC (TLS) is the transport for
//! payloads that must not be altered on the path.
//!
//! A batch with PRECHECK is answered twice: after its op list, with a reply
//! that is the admission verdict (0: admitted, the payload follows; 1:
//! refused, no payload follows and the connection stays usable), then, if
//! admitted, after its payload as above. A sender that abandons an admitted
//! batch closes the connection; the receiver then sees end-of-stream before
//! any payload byte and has written nothing.
//!
//! A receiver closes a connection, logging why, on a bad preamble, a
//! handshake not done by [`kv_net::ListenerLimits::handshake_timeout`], a failed proof,
//! a protocol error above, a truncated frame, any stalled read past
//! [`TcpConfig::io_timeout`], or no batch within [`TcpConfig::idle_timeout`].
//! The op list is buffered as it arrives (so an announced count costs memory
//! only once its bytes are sent, and only under a live grant: a batch whose
//! grant is not live is refused from its header, its list discarded unread),
//! because every op must be admitted before the first payload byte is
//! written. All connections share one budget for those buffers
//! ([`TcpConfig::op_lists`]: [`OpListLimits::budget`], smaller when peers need
//! not prove a secret: [`OpListLimits::unauthenticated_budget`]): a list is charged
//! as it grows; when the budget is full a batch waits for room, or gives way
//! at once if it already holds an equal share of the budget or more (so
//! batches waiting for each other cannot lock it up). A batch refused for
//! want of room gets status 1 (the rest of it discarded, the connection
//! usable). The whole op list, waits included, must arrive within
//! [`OpListLimits::timeout`] of its header, so a peer dribbling its
//! list holds its share no longer. The accept reply's `max_ops_per_batch`
//! is the smaller of the configured bound and what the budget holds, so a
//! sender fails a batch that could never fit before sending it.
//!
//! # Connections
//!
//! Outgoing connections are pooled per peer address (at most
//! [`TcpConfig::max_idle_conns_per_peer`] idle); concurrent batches to one
//! peer use separate connections. A pooled connection is probed (non-blocking
//! peek) before reuse and retired after half the receiver's idle timeout; if
//! it still turns out closed by the peer, the batch is sent once more on a
//! new connection (writes are idempotent). A connection that failed in any
//! other way is dropped, and the next batch reconnects. Whenever a
//! connection is pooled, the idle ones of every peer are probed the same
//! way: those of a peer that went away for good are closed then, not kept.
//!
//! A receiver admits only so many handshakes from one source host at once
//! ([`ListenerLimits::max_handshakes_per_host`], 16 by default), and a
//! sender that starts many batches at once, each on its own connections,
//! could exceed that on its own. So at most
//! [`TcpConfig::max_connecting_per_peer`] (8) of a sender's connections to
//! one peer are in their handshake at once; the others wait for a place,
//! and one that gets it takes a connection another batch put back
//! meanwhile if there is one. A connection the receiver closes before its
//! accept reply (what it does when it has no place for this host: other
//! senders on the same address hold them) is tried again after a backoff
//! (5 ms, doubling to 200 ms). All of it is bounded by
//! [`TcpConfig::connect_timeout`].
//!
//! A batch of at least [`TcpConfig::parallel_min_bytes`] is cut into
//! [`TcpConfig::parallel_streams`] parts of about equal bytes, each on its
//! own task and pooled connection, so the copies run on several cores. Each
//! part is admitted by the receiver on its own, so to keep a batch refused
//! whole the parts are sent with PRECHECK: every part sends its header and
//! op list at once and waits for its verdict at a gate that opens when the
//! last part is admitted and closes as soon as one is not (refused, or its
//! connection failed); then either every part sends its payload, or the
//! admitted parts drop their connections and the batch fails with the
//! refusal. The batch succeeds when every part is acknowledged. This costs
//! one round trip and the admission of every part before any payload moves
//! (on loopback about 0.1 ms for a 128 MiB batch of 64 KiB ops, 0.2 ms for a
//! 32 MiB batch of scattered 8 KiB ops, against 5 to 40 ms for the batch);
//! smaller batches keep the one-way flow.
//!
//! Endpoint details are empty for TCP: the grant, not the endpoint, says
//! where a peer may write.

mod client;
mod config;
mod memory;
mod server;
mod split;
mod transport;
pub mod wire;

pub use config::{TcpConfig, DEFAULT_MAX_CONNECTING_PER_PEER};
// Shared with the other data planes (kv-net), under the names this crate
// has always exported.
pub use kv_net::{
    ListenerLimits, OpListLimits, DEFAULT_MAX_OPS_PER_BATCH, DEFAULT_OP_LIST_BUDGET, DEFAULT_OP_LIST_TIMEOUT,
    DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
};
pub use transport::TcpTransport;

#[cfg(doc)]
use kv_proto::BatchWriter;
