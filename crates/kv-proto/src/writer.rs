//! The `BatchWriter` trait every data-plane transport implements.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::grant::{Grant, GrantError, GrantId};
use crate::memory::{MemoryRegion, RegionAccess, RegionError, WriteOp};

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
    /// `host:port` of the data-plane listener (at most
    /// [`crate::MAX_TEXT_LEN`] bytes).
    #[serde(deserialize_with = "crate::bounded::text")]
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

    /// Checks, before a batch is written to it, that the endpoint is one of
    /// `protocol`'s and its address has the `host:port` shape
    /// ([`Endpoint::check_address`]).
    pub fn check_for(&self, protocol: Protocol) -> Result<(), TransportError> {
        if self.protocol != protocol {
            return Err(TransportError::WrongProtocol {
                peer: self.to_string(),
                expected: protocol,
                got: self.protocol,
            });
        }
        self.check_address().map_err(|reason| TransportError::BadEndpoint { peer: self.to_string(), reason })
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
    /// A grant could not be issued (a closed memory is
    /// [`TransportError::Shutdown`]).
    #[error("cannot issue a grant: {0}")]
    Grant(GrantError),
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
    /// The peer refused the batch (an op outside the grant, or an unknown,
    /// expired or revoked grant); nothing of it was written.
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

impl From<GrantError> for TransportError {
    fn from(error: GrantError) -> Self {
        match error {
            GrantError::Closed => TransportError::Shutdown,
            other => TransportError::Grant(other),
        }
    }
}

/// A data-plane transport: registers local memory, advertises an endpoint,
/// issues and revokes write grants, serves peers' writes inside them, and
/// writes batches into peers' memory under the grants they issued.
///
/// # Contract (every transport; the conformance suite, `test_support::conformance`, proves it)
///
/// - **Least privilege.** Memory registered as [`RegionAccess::Source`] is
///   only ever read, never written by a peer. A peer may write only inside a
///   live grant this writer issued ([`BatchWriter::grant`]): a batch for an
///   unknown, expired or revoked grant, or with any op outside the grant's
///   ranges, is refused whole, with an error, and no byte of it lands.
/// - **Revocation is a fence.** When [`BatchWriter::revoke`] returns, no
///   byte of that grant can land any more: a batch in flight under it either
///   finished before, or lands nothing after. Where the sender writes
///   directly (RDMA one-sided writes, a same-host copy) the transport
///   honours the fence by its own means: memory windows bound per grant and
///   invalidated on revoke, or moving the peer's queue pair to the error
///   state and waiting for its flush, or a quarantine of the ranges.
/// - **Remote completion.** [`BatchWriter::batch_write`] returns `Ok` only
///   once every byte is in the peer's memory, not when it left the socket.
///   On error some bytes may have landed, all inside the grant: the receiver
///   reports those blocks failed after revoking it.
/// - **Cheap per op.** No round trip and no allocation per op, no cap on ops
///   per batch beyond the bounds a receiver puts on peer input; a grant
///   costs one lookup per batch and a range check per op.
/// - **Bounded.** Every wait is bounded by the transport's configured
///   timeouts; dropping a `batch_write` future stops that batch.
///
/// # Memory lifetime (the one rule, for every transport and the worker)
///
/// Registered memory must stay valid (allocated, not moved) until
/// [`BatchWriter::shutdown`]`.await` has returned. [`BatchWriter::close`],
/// and the drop of the transport's last handle, end all access the same way,
/// synchronously. Until then the owner must not read a destination range
/// while a grant covering it is live, nor change a source range while a
/// batch reading it is in flight.
#[async_trait]
pub trait BatchWriter: Send + Sync + 'static {
    /// The transport this writer speaks.
    fn protocol(&self) -> Protocol;

    /// Registers local memory with the given access. Call before advertising
    /// the endpoint (an RDMA endpoint carries per-region keys). A region may
    /// be registered both ways (a `kv_both` instance).
    ///
    /// # Safety
    ///
    /// Each region must satisfy the memory-lifetime rule in the trait docs:
    /// valid for reads (and writes, for destinations) until `shutdown().await`
    /// returned, or `close()` returned, or the last handle was dropped.
    unsafe fn register_regions(&self, regions: &[MemoryRegion], access: RegionAccess) -> Result<(), TransportError>;

    /// Where peers reach this writer.
    fn endpoint(&self) -> Endpoint;

    /// Issues a grant over `ranges` (each inside one destination region),
    /// valid for `valid_for` unless revoked earlier: peers that name it may
    /// write inside those ranges and nowhere else.
    async fn grant(&self, ranges: &[MemoryRegion], valid_for: Duration) -> Result<Grant, TransportError>;

    /// Revokes a grant this writer issued; returns once no byte of it can
    /// land any more (see the fence in the trait docs). Unknown or already
    /// revoked grants are ignored.
    async fn revoke(&self, grant: &GrantId);

    /// Writes every op into `peer`'s memory under `grant` (one the peer
    /// issued); `Ok` once all bytes are there.
    async fn batch_write(&self, peer: &Endpoint, grant: &Grant, ops: &[WriteOp]) -> Result<(), TransportError>;

    /// Ends all access to registered memory at once: when this returns no
    /// byte of it is read or written, no grant is live, and no batch is
    /// served or sent any more. Synchronous, so a `Drop` can call it.
    fn close(&self);

    /// What the transport counted about its peers (refused batches,
    /// failed authentications) and its live grants. Transports that keep
    /// no counts report zeros.
    fn stats(&self) -> crate::stats::TransportStats {
        crate::stats::TransportStats::default()
    }

    /// [`BatchWriter::close`], then stops serving peers, closes connections
    /// and waits for the transport's tasks. Later calls fail with
    /// [`TransportError::Shutdown`].
    async fn shutdown(&self);
}

/// A batch whose sources cannot be sent fails as the caller's mistake
/// (outside its source regions), or because the transport shut down.
impl From<crate::registered::SourceError> for TransportError {
    fn from(error: crate::registered::SourceError) -> Self {
        use crate::registered::SourceError;
        match error {
            SourceError::Outside { addr, len } | SourceError::TotalOverflows { addr, len } => {
                TransportError::SourceOutOfBounds { addr, len }
            }
            SourceError::Closed => TransportError::Shutdown,
        }
    }
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
