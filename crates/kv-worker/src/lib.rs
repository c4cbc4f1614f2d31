//! The connector worker: what runs next to each model worker of a prefill (P)
//! or decode (D) instance.
//!
//! - registers the engine's KV cache ([`RegisteredCache`], or an
//!   [`OwnedKvCache`] the library allocates) with a data-plane transport,
//!   picked from `mooncake_protocol` among the transports compiled in
//!   (features `tcp`, default, and `quic`);
//! - on P, serves the side channel: D's transfer requests wait until the
//!   request is ready (bounded by the lease), are planned into coalesced
//!   writes, written with [`kv_proto::BatchWriter::batch_write`], and answered
//!   with one outcome per request;
//! - on D, [`Worker::start_load_kv`] groups pulls by P, sends one transfer
//!   request per P over a reused connection, and reports each request as
//!   received or failed (never left hanging) through [`Worker::get_finished`].
//!
//! The bookkeeping ([`SenderCore`], [`ReceiverCore`]) is sans-IO and driven
//! with explicit time; the tokio parts are a thin driver around it.
//!
//! What this crate must never do: report a request received whose bytes
//! were not all written; wait without a bound; let a peer's bad input panic
//! the process; leave a task running after the worker is gone. `unsafe` code
//! lives only in `cache.rs` (library-allocated memory).

pub mod bootstrap;
mod cache;
mod changes;
mod config;
mod error;
pub mod in_memory;
mod layout;
pub mod metrics;
mod names;
pub mod pattern;
pub mod plan;
mod receiver;
mod renewal;
mod resolve;
mod sender;
pub mod serving;
mod side_channel;
pub mod staging;
mod timer;
pub mod topology;
pub mod transport;
mod watch;
mod worker;

pub use cache::{AllocError, BlockError, OwnedKvCache};
pub use changes::Changes;
pub use config::{
    default_side_channel_limits, AuthSecret, DataEndpointPolicy, ListenerLimits, Placement, WorkerConfig,
    DEFAULT_LEASE_RENEWAL, DEFAULT_MAX_OPS_PER_BATCH, DEFAULT_SIDE_CHANNEL_MAX_CONNECTIONS,
};
pub use error::WorkerError;
pub use layout::{CacheDims, CacheShape, LayerCache, LayerTensor, LayoutError, RegisteredCache, ShapeError};
pub use plan::GrantPlanError;
pub use receiver::{
    CutShort, PeerInfo, PullBatch, PullProgress, PullReport, PullReports, ReceiverCore, RecvFinished, SideChannelAddr,
};
pub use renewal::{RenewalSchedule, Renewed};
pub use sender::{Claim, Puller, SenderCore, MAX_AWAITED};
pub use side_channel::{SideChannelCodec, SideChannelError};
pub use watch::WatchList;
pub use worker::{Finished, Settled, Worker};
