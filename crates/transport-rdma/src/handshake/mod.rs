//! The connection handshake. First the [`opening`]: versions, the shared
//! secret proved both ways, the receiver's admission. Then each side tells the other how to reach its
//! queue pair (GID, QPN, PSN) and which of its regions the other may write
//! (address, length, rkey), over a TCP connection set up by the caller.
//!
//! `codec` is the pure encoding (bounded, fallible decoding: the peer is
//! untrusted); [`exchange()`] sends ours and reads theirs, within a time bound.
//!
//! # Wire format
//!
//! All integers little-endian; one message each way, same layout:
//!
//! ```text
//!  0      4         6       8      24    28    32             36
//!  | KVRH | version | flags | gid  | qpn | psn | region count | regions...
//!           u16       u16     16 B   u32   u32   u32
//!
//!  region (20 bytes): addr u64 | len u64 | rkey u32
//! ```
//!
//! `version` is 1; `flags` must be 0 (unknown bits are
//! refused); QPN and PSN are 24-bit; the region count is at most the
//! receiver's [`HandshakeLimits::max_regions`], checked before the regions
//! are read; regions must be non-empty, not wrap, and not overlap.

// `codec` and `exchange` (for `read_message`) are public only to the fuzz
// targets (`--cfg fuzzing`), as quinn-proto does; what the transport and
// the tests use is re-exported below.
#[cfg(fuzzing)]
pub mod codec;
#[cfg(not(fuzzing))]
#[allow(unreachable_pub)]
mod codec;
#[cfg(fuzzing)]
pub mod exchange;
#[cfg(not(fuzzing))]
#[allow(unreachable_pub)]
mod exchange;
pub mod opening;

use std::time::Duration;

use crate::region::{RegionTableError, RemoteRegion};

pub use codec::{decode, encode};
pub use exchange::exchange;

/// How to reach a queue pair: what the peer's QP needs to move to RTR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    /// The port GID (RoCE: the IPv4-mapped or IPv6 address).
    pub gid: [u8; 16],
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number the QP sends (24 bits).
    pub psn: u32,
}

/// One side's half of the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// Its queue pair.
    pub qp: QpEndpoint,
    /// The regions it lets the other side write (none for a pure sender).
    pub regions: Vec<RemoteRegion>,
}

/// Bounds on what a peer's handshake may make us do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeLimits {
    /// Most regions accepted from a peer (bounds the memory a peer can make
    /// us allocate: 20 bytes each).
    pub max_regions: u32,
    /// The whole exchange, both directions.
    pub timeout: Duration,
}

impl Default for HandshakeLimits {
    fn default() -> Self {
        // 80 layers x K/V x a few tensors each, with room to spare.
        Self { max_regions: 4096, timeout: Duration::from_secs(10) }
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The message ended early.
    #[error("handshake message truncated: {needed} bytes needed, {got} present")]
    Truncated {
        /// Bytes the message needs.
        needed: usize,
        /// Bytes there were.
        got: usize,
    },
    /// Not a kvlink RDMA handshake.
    #[error("not a kvlink RDMA handshake (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// A version this build does not speak.
    #[error("handshake version {got} is not supported (this side speaks {supported})")]
    UnsupportedVersion {
        /// The peer's version.
        got: u16,
        /// Ours.
        supported: u16,
    },
    /// Flag bits this build does not know.
    #[error("unknown handshake flags {0:#06x}")]
    UnknownFlags(u16),
    /// More regions than [`HandshakeLimits::max_regions`].
    #[error("{count} regions exceed the limit of {max}")]
    TooManyRegions {
        /// Regions announced (or given to encode).
        count: u64,
        /// The limit.
        max: u32,
    },
    /// A QPN outside 2..2^24 (0 and 1 are the special QPs, not RC).
    #[error("queue pair number {0:#x} is not a valid RC QPN")]
    BadQpn(u32),
    /// A PSN wider than 24 bits.
    #[error("packet sequence number {0:#x} exceeds 24 bits")]
    BadPsn(u32),
    /// Empty, wrapping or overlapping regions.
    #[error("bad region list: {0}")]
    BadRegions(#[from] RegionTableError),
    /// Bytes after the last region.
    #[error("{0} unexpected bytes after the handshake message")]
    TrailingBytes(usize),
    /// The peer closed the connection before its message was complete.
    #[error("the peer closed the connection during the handshake")]
    PeerClosed,
    /// The peer's message fails its tag: altered or injected after the
    /// opening.
    #[error("rdma handshake {0}")]
    BadTag(#[from] kv_proto::session::BadTag),
    /// The exchange did not finish within [`HandshakeLimits::timeout`].
    #[error("the handshake did not finish within {0:?}")]
    TimedOut(Duration),
    /// The connection failed.
    #[error("handshake I/O failed: {0}")]
    Io(#[from] std::io::Error),
}
