//! The contracts every kvlink crate speaks.
//!
//! This crate holds the vocabulary shared by the scheduler side (`kv-sched`),
//! the worker (`kv-worker`) and the data-plane transports: request and engine
//! ids, the connector roles, the per-request [`KvTransferParams`] the proxy
//! carries between a prefill (P) and a decode (D) instance, the
//! [`ConnectorMetadata`] the scheduler hands its worker every step, the
//! [`KvTransferConfig`] parsed from vLLM's `--kv-transfer-config`, the side
//! channel's messages and their framing, and the [`BatchWriter`] trait that
//! every transport implements.
//!
//! What this crate must never do: perform I/O, spawn tasks, read a clock or
//! the process environment, or depend on tokio or on any transport. Everything
//! here is plain data and pure functions (the one exception: [`random`] reads
//! the OS random source for nonces and grant ids), so any caller (sans-IO
//! state machines, async drivers, fuzzers) can use it.
//!
//! It is also where the checks that keep peers out of memory live, once:
//! [`RegisteredMemory`] (sources, destinations, write grants and their fence)
//! and [`dataplane`] (the op list and verdict every data-plane wire shares),
//! the order in which a receiver applies them to a peer's batch,
//! [`receive::BatchReceiver`] (a sans-IO machine every byte-stream data
//! plane drives), the bound on memory peers make a transport hold,
//! [`MemoryBudget`], and the bound on connections still in their handshake,
//! [`HandshakePlaces`].
//!
//! Decoding of anything a peer sends is bounded and fallible: a malformed
//! input is an error value, never a panic and never an unbounded allocation.

mod accept;
mod admission;
pub mod auth;
pub mod bootstrap;
mod bounded;
mod budget;
mod cause;
mod codec;
mod config;
pub mod dataplane;
mod frame;
mod grant;
mod identity;
mod ids;
mod memory;
mod metadata;
mod op_list;
mod params;
pub mod random;
pub mod receive;
mod registered;
mod renewal_key;
pub mod session;
mod stats;
mod throttle;
pub mod topology;
mod wire;
mod writer;

pub use accept::AcceptStatus;
pub use admission::{
    HandshakePlace, HandshakePlaces, NoPlace, DEFAULT_MAX_HANDSHAKES, DEFAULT_MAX_HANDSHAKES_PER_HOST,
};
pub use bounded::{bounded_text, MAX_BLOCKS_PER_REQUEST, MAX_REGIONS, MAX_REQUESTS_PER_TRANSFER, MAX_TEXT_LEN};
pub use budget::{Charge, MemoryBudget, NoRoom};
pub use cause::FailureCause;
pub use codec::{CodecError, MAX_DECODE_BYTES};
pub use config::{
    ConfigError, HostStaging, KvTransferConfig, ListenerOverrides, DEFAULT_ABORT_REQUEST_TIMEOUT,
    DEFAULT_BOOTSTRAP_PORT, DEFAULT_BOOTSTRAP_TIMEOUT, DEFAULT_NUM_WORKERS, DEFAULT_STAGING_BYTES,
    DEFAULT_STAGING_PIECE_BYTES, ENV_ABORT_REQUEST_TIMEOUT, ENV_BOOTSTRAP_PORT, EXTRA_KEYS, FOREIGN_KEYS,
    MAX_STAGING_BYTES,
};
pub use frame::{FrameCodec, FrameError, DEFAULT_MAX_FRAME_LEN, FRAME_HEADER_LEN, FRAME_MAGIC, PROTOCOL_VERSION};
pub use grant::{Grant, GrantError, GrantId, GRANT_ID_LEN, MAX_GRANT_DETAILS_LEN};
pub use identity::ModelIdentity;
pub use ids::{BlockId, EngineId, KvRole, ParseRoleError, ReqId};
pub use memory::{MemoryRegion, RegionAccess, RegionError, RegionSet, WriteOp};
pub use metadata::{BootstrapTarget, ConnectorMetadata, RecvReqMeta, RemotePrefill, SendUpdate};
pub use params::{KvTransferParams, ParamsError};
pub use registered::{
    CheckedSources, DestinationError, GrantAccess, MemoryClosed, RegisteredMemory, Revoked, SourceError,
};
pub use renewal_key::{RenewalKey, RenewalSecret, RENEWAL_KEY_LEN};
pub use stats::{BatchRefusal, TransportCounters, TransportStats};
pub use throttle::LogThrottle;
pub use topology::{HeadRange, Part, RankTopology, TokenLayout, TopologyError};
pub use wire::{
    CacheLayout, Hello, HelloReply, KeepAlive, LayoutKind, Outcome, Renewing, RequestBlocks, RequestOutcome,
    SideMessage, XferProgress, XferReply, XferRequest,
};
pub use writer::{BatchWriter, Endpoint, ParseProtocolError, Protocol, TransportError, MAX_ENDPOINT_DETAILS_LEN};
