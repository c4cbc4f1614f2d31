//! The worker's errors.

use std::net::SocketAddr;

use kv_proto::{Protocol, TransportError};

use crate::layout::LayoutError;

/// Why a worker could not start. Each message includes its cause, so
/// printing the error alone says everything (no separate source chain).
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The configured transport is not compiled into this build.
    #[error(
        "mooncake_protocol = \"{protocol}\" is not compiled into this build; enable kv-worker's \"{feature}\" feature"
    )]
    TransportNotCompiled {
        /// The protocol asked for.
        protocol: Protocol,
        /// The feature that compiles it in.
        feature: &'static str,
    },
    /// The writer handed in speaks another protocol than configured.
    #[error("configured mooncake_protocol is {configured}, the writer speaks {writer}")]
    ProtocolMismatch {
        /// From the config.
        configured: Protocol,
        /// The writer's.
        writer: Protocol,
    },
    /// The side-channel port does not fit in 16 bits.
    #[error("the side-channel port of the worker at {place} from port {bootstrap_port} exceeds 65535 (bootstrap port + (dp_rank * pp_size + pp_rank) * tp_size + tp_rank)")]
    PortOverflow {
        /// Bootstrap (or base) port.
        bootstrap_port: u16,
        /// Where the worker sits.
        place: crate::config::Placement,
    },
    /// The worker's place in its instance, or the heads its cache declares,
    /// cannot be.
    #[error("worker topology: {0}")]
    Topology(String),
    /// The side-channel listener could not bind.
    #[error("cannot listen on {addr}: {cause}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        cause: std::io::Error,
    },
    /// The cache layout is inconsistent.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The transport failed to start or register memory.
    #[error("transport: {0}")]
    Transport(TransportError),
    /// Other socket error.
    #[error("I/O: {0}")]
    Io(std::io::Error),
}
