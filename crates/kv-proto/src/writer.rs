//! The `BatchWriter` trait every data-plane transport implements.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::memory::{MemoryRegion, RegionError, WriteOp};

/// Bound on an endpoint's transport-specific data (peer input).
pub const MAX_ENDPOINT_DETAILS_LEN: usize = 64 * 1024;

/// The data-plane transport, chosen by `mooncake_protocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Protocol {
    /// Plain TCP (`tcp`).
    Tcp,
    /// QUIC over UDP with TLS (`quic`).
    Quic,
    /// RDMA verbs (`rdma`).
    Rdma,
}

impl Protocol {
    /// The spelling `mooncake_protocol` uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Quic => "quic",
            Protocol::Rdma => "rdma",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A `mooncake_protocol` value that is not one of the accepted spellings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid mooncake_protocol {given:?}: expected one of \"tcp\", \"quic\", \"rdma\"")]
pub struct ParseProtocolError {
    /// What was given.
    pub given: String,
}

impl FromStr for Protocol {
    type Err = ParseProtocolError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tcp" => Ok(Protocol::Tcp),
            "quic" => Ok(Protocol::Quic),
            "rdma" => Ok(Protocol::Rdma),
            other => Err(ParseProtocolError { given: other.to_owned() }),
        }
    }
}

/// Where a transport receives writes: what D advertises in its transfer
/// request (the reference's `remote_hostname` / `rpc_port`).
///
/// `details` is transport-specific and carried untouched by the side channel:
/// empty for TCP, the certificate fingerprint for QUIC, queue-pair and
/// per-region keys for RDMA. Each transport encodes and validates its own.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Endpoint {
    /// The transport that serves this endpoint.
    pub protocol: Protocol,
    /// `host:port` of the data-plane listener.
    pub address: String,
    /// Transport-specific data, at most [`MAX_ENDPOINT_DETAILS_LEN`] bytes.
    pub details: Vec<u8>,
}

impl Endpoint {
    /// Checks that `address` has the `host:port` shape with a non-zero port
    /// (peer input: every transport checks it before connecting).
    pub fn check_address(&self) -> Result<(), String> {
        let (host, port) = self.address.rsplit_once(':').ok_or("expected host:port")?;
        if host.is_empty() {
            return Err("empty host".to_owned());
        }
        match port.parse::<u16>() {
            Ok(0) | Err(_) => Err(format!("bad port {port:?}")),
            Ok(_) => Ok(()),
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.protocol, self.address)
    }
}

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The endpoint names another transport.
    #[error("endpoint {peer} is for {got}, this writer speaks {expected}")]
    WrongProtocol {
        /// The endpoint.
        peer: String,
        /// This writer's protocol.
        expected: Protocol,
        /// The endpoint's protocol.
        got: Protocol,
    },
    /// The endpoint's address or details cannot be used.
    #[error("bad endpoint {peer}: {reason}")]
    BadEndpoint {
        /// The endpoint.
        peer: String,
        /// What is wrong.
        reason: String,
    },
    /// Regions could not be registered.
    #[error("memory registration failed: {0}")]
    Registration(#[from] RegionError),
    /// A local source range is outside every registered region.
    #[error("source range {addr:#x}+{len} is outside the registered regions")]
    SourceOutOfBounds {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// Could not connect to the peer.
    #[error("cannot connect to {peer}: {reason}")]
    Connect {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// A bounded wait ran out.
    #[error("{peer}: {what} timed out after {after:?}")]
    Timeout {
        /// The peer.
        peer: String,
        /// What was being waited for.
        what: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The peer refused the batch (e.g. a destination outside its regions);
    /// nothing of it was written.
    #[error("{peer} refused the batch: {reason}")]
    Refused {
        /// The peer.
        peer: String,
        /// The peer's reason.
        reason: String,
    },
    /// The peer closed the connection before acknowledging the batch.
    #[error("{peer} closed the connection before acknowledging the batch")]
    PeerClosed {
        /// The peer.
        peer: String,
    },
    /// The peer broke the wire protocol.
    #[error("{peer} broke the protocol: {reason}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        reason: String,
    },
    /// An I/O error on the connection to the peer.
    #[error("I/O error with {peer}: {source}")]
    Io {
        /// The peer.
        peer: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The writer is shut down.
    #[error("transport is shut down")]
    Shutdown,
}

/// A data-plane transport: registers local memory, advertises an endpoint,
/// serves peers' writes into the registered memory, and writes batches into
/// peers' memory.
///
/// Contract (every transport; the conformance suite in `kv-worker` proves it):
/// - a peer may write only inside regions registered here; a batch with any
///   op outside them is refused whole, with an error, and no byte of it lands;
/// - [`BatchWriter::batch_write`] returns `Ok` only once every byte is in the
///   peer's memory (remote completion, not "left my socket"); on error some
///   bytes may have landed, and the caller reports the affected blocks failed;
/// - per-op cost is small: no round trip and no allocation per op, and no
///   cap on ops per batch beyond the bounds a receiver puts on peer input;
/// - every wait is bounded by the transport's configured timeouts.
#[async_trait]
pub trait BatchWriter: Send + Sync + 'static {
    /// The transport this writer speaks.
    fn protocol(&self) -> Protocol;

    /// Registers local memory: sources of this writer's batches and
    /// destinations of peers' batches. Call before advertising the endpoint
    /// (an RDMA endpoint carries per-region keys).
    ///
    /// # Safety
    ///
    /// Each region must be valid for reads and writes for as long as this
    /// writer lives, and must not be freed or moved before it is dropped.
    /// Peers write into it concurrently with the caller: the caller must not
    /// read a destination range before the transfer that fills it has been
    /// reported complete, and must not hand out overlapping destinations to
    /// concurrent transfers.
    unsafe fn register_regions(&self, regions: &[MemoryRegion]) -> Result<(), TransportError>;

    /// Where peers reach this writer.
    fn endpoint(&self) -> Endpoint;

    /// Writes every op into `peer`'s memory; `Ok` once all bytes are there.
    async fn batch_write(&self, peer: &Endpoint, ops: &[WriteOp]) -> Result<(), TransportError>;

    /// Stops serving peers and closes connections. Later calls fail with
    /// [`TransportError::Shutdown`].
    async fn shutdown(&self);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_addresses_are_checked() {
        let endpoint = |address: &str| Endpoint { protocol: Protocol::Tcp, address: address.into(), details: vec![] };
        for good in ["127.0.0.1:9000", "[::1]:9000", "decode-0.example:9000"] {
            assert!(endpoint(good).check_address().is_ok(), "{good:?} refused");
        }
        for bad in ["", "host", ":9000", "host:", "host:0", "host:70000", "mem://x"] {
            assert!(endpoint(bad).check_address().is_err(), "{bad:?} accepted");
        }
    }
}
