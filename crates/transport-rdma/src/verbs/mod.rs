//! The RAII verbs layer over `sideway`: device, protection domain, memory
//! regions, completion queue with a completion channel, RC queue pair. The
//! only module of this crate allowed `unsafe` (the crate root denies it
//! everywhere else); every `unsafe` block has a `SAFETY:` comment and every
//! `unsafe fn` a `# Safety` section.
//!
//! Ownership follows the verbs object tree: each object holds an `Arc` of its
//! parent (sideway's objects do the same underneath), so a protection domain
//! outlives its memory regions and queue pairs, a completion queue outlives
//! the queue pairs that post to it, and the device context outlives them
//! all, whatever order the caller drops them in.
//!
//! Waiting for completions does not burn a core: [`CompletionQueue::wait`]
//! arms the queue's notification and sleeps on the completion channel's file
//! descriptor in the tokio reactor until the device signals it.
//!
//! Memory windows (the per-grant fence, see the crate docs) are wrapped here
//! from the raw calls: sideway 0.4 has no API for them ([`MemoryWindow`],
//! [`QueuePair::post_binds`], [`QueuePair::post_invalidates`]).

mod buffer;
mod completion;
mod device;
mod memory;
mod queue_pair;
mod window;

pub use buffer::RegisteredBuffer;
pub use completion::{Completion, CompletionQueue, WcStatus};
pub use device::{Device, DeviceLimits, GidChoice};
pub use memory::{register_checked, Access, MemoryRegion, ProtectionDomain, RegisterError};
pub use queue_pair::{BindWindow, ConnectOptions, QpCapacity, QpHold, QueuePair, QueuePairState};
pub use window::MemoryWindow;

/// A verbs call failed.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// No device of that name.
    #[error("RDMA device {name:?} not found (present: {present:?})")]
    NoSuchDevice {
        /// The name asked for.
        name: String,
        /// The devices there are.
        present: Vec<String>,
    },
    /// A verbs call returned an error.
    #[error("{call} failed: {source}")]
    Call {
        /// The verbs call.
        call: &'static str,
        /// What it returned (errno).
        #[source]
        source: std::io::Error,
    },
    /// A sideway call returned an error.
    #[error("{call} failed: {source}")]
    Sideway {
        /// The operation.
        call: &'static str,
        /// sideway's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A value does not fit what verbs take.
    #[error("{0}")]
    OutOfRange(String),
    /// Completion queues wait on the tokio reactor.
    #[error("a completion queue must be created inside a tokio runtime")]
    NoRuntime,
}

impl VerbsError {
    fn sideway(call: &'static str, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Sideway { call, source: Box::new(source) }
    }

    fn errno(call: &'static str, code: i32) -> Self {
        Self::Call { call, source: std::io::Error::from_raw_os_error(code) }
    }
}
