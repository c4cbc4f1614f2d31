//! Write grants: the receiver's revocable permission for one transfer.
//!
//! A decode worker (D) issues a grant with its own data plane before it asks
//! a prefill worker (P) for KV: an unguessable [`GrantId`] and the exact
//! destination ranges of that pull. The transfer request carries the
//! [`Grant`]; every data-plane batch names it; the receiver writes a batch
//! only if every op lies inside the grant's ranges and the grant is live
//! (issued, not expired, not revoked). Revocation is a fence: once
//! `BatchWriter::revoke` returns, no byte of that grant can land any more,
//! so D may hand the blocks back to its engine.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Bytes of a [`GrantId`] (128 random bits).
pub const GRANT_ID_LEN: usize = 16;

/// Bound on a grant's transport-specific details (peer input).
pub const MAX_GRANT_DETAILS_LEN: usize = 64 * 1024;

/// A grant's identity: 128 bits from the operating system's random source,
/// so a peer cannot guess another transfer's grant.
///
/// It is a capability: `Debug` and `Display` show only its first four bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GrantId([u8; GRANT_ID_LEN]);

impl GrantId {
    /// A fresh random id, or `None` if the OS random source fails (a grant is
    /// then refused rather than made guessable).
    pub fn random() -> Option<Self> {
        crate::random::array().map(Self)
    }

    /// The id of these bytes (as read from a wire).
    pub fn from_bytes(bytes: [u8; GRANT_ID_LEN]) -> Self {
        Self(bytes)
    }

    /// The id's bytes (to write on a wire).
    pub fn to_bytes(self) -> [u8; GRANT_ID_LEN] {
        self.0
    }
}

impl fmt::Display for GrantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..4] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…")
    }
}

impl fmt::Debug for GrantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GrantId({self})")
    }
}

/// What a receiver hands out for one transfer, and what the sender names in
/// every batch of it: the id, and transport-specific data the side channel
/// carries untouched (empty for TCP and QUIC; e.g. memory-window keys for
/// RDMA). Decoders of `details` treat it as hostile input bounded by
/// [`MAX_GRANT_DETAILS_LEN`].
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// The grant's identity.
    pub id: GrantId,
    /// Transport-specific data for the sender.
    pub details: Vec<u8>,
}

impl Grant {
    /// A grant with no transport-specific details.
    pub fn plain(id: GrantId) -> Self {
        Self { id, details: Vec::new() }
    }
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant").field("id", &self.id).field("details_len", &self.details.len()).finish()
    }
}

/// Why a grant could not be issued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    /// A range is not inside memory registered as a destination.
    #[error("grant range {addr:#x}+{len} is not inside a region registered as a destination")]
    OutsideDestinations {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// Two ranges of the grant overlap.
    #[error("grant ranges at {first:#x} and {second:#x} overlap")]
    Overlap {
        /// Start of the lower range.
        first: u64,
        /// Start of the higher range.
        second: u64,
    },
    /// No random id could be drawn.
    #[error("no OS randomness for a grant id")]
    NoRandomness,
    /// An id that is already live was issued again.
    #[error("grant {0} is already live")]
    Duplicate(GrantId),
    /// The memory is closed (the transport is shut down).
    #[error("the transport's memory is closed")]
    Closed,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_random_and_print_only_a_prefix() {
        let a = GrantId::random().unwrap();
        let b = GrantId::random().unwrap();
        assert_ne!(a, b);
        assert_eq!(GrantId::from_bytes(a.to_bytes()), a);
        let shown = format!("{a} {a:?}");
        let full: String = a.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
        assert!(!shown.contains(&full), "{shown} shows the whole capability");
        assert!(shown.contains(&full[..8]));
    }
}
