//! The transport-specific part of an RDMA endpoint
//! ([`kv_proto::Endpoint::details`]), carried untouched by the side channel.
//!
//! The queue-pair address (GID, QPN, PSN) is exchanged in the connection
//! handshake and the per-grant windows in the control channel, so the
//! endpoint itself carries only what identifies the receiver:
//!
//! ```text
//!  0      4         6       8          16
//!  | KVRD | version | flags | instance |
//!           u16       u16     u64          little-endian; flags must be 0
//! ```
//!
//! `instance` is random per transport: a sender keeps one connection per
//! peer address and instance, so a receiver restarted on the same port gets
//! a fresh connection instead of a stale one.

/// First bytes of the details.
pub const MAGIC: [u8; 4] = *b"KVRD";
/// The details version this build speaks.
pub const VERSION: u16 = 1;
/// Length of the details.
pub const LEN: usize = 16;

/// What an RDMA endpoint's details say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointDetails {
    /// The receiving transport's random instance number.
    pub instance: u64,
}

/// Why an endpoint's details were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DetailsError {
    /// Not [`LEN`] bytes.
    #[error("RDMA endpoint details are {0} bytes, expected {LEN}")]
    Length(usize),
    /// Not RDMA endpoint details.
    #[error("not RDMA endpoint details (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// A version this build does not speak.
    #[error("RDMA endpoint details version {got} is not supported (this side speaks {supported})")]
    UnsupportedVersion {
        /// Theirs.
        got: u16,
        /// Ours.
        supported: u16,
    },
    /// Flag bits this build does not know.
    #[error("unknown RDMA endpoint flags {0:#06x}")]
    UnknownFlags(u16),
}

impl EndpointDetails {
    /// The details' bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(LEN);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.instance.to_le_bytes());
        out
    }

    /// Decodes and checks `bytes` (peer input).
    pub fn decode(bytes: &[u8]) -> Result<Self, DetailsError> {
        let bytes: &[u8; LEN] = bytes.try_into().map_err(|_| DetailsError::Length(bytes.len()))?;
        let [m0, m1, m2, m3, v0, v1, f0, f1, rest @ ..] = *bytes;
        if [m0, m1, m2, m3] != MAGIC {
            return Err(DetailsError::BadMagic([m0, m1, m2, m3]));
        }
        let version = u16::from_le_bytes([v0, v1]);
        if version != VERSION {
            return Err(DetailsError::UnsupportedVersion { got: version, supported: VERSION });
        }
        let flags = u16::from_le_bytes([f0, f1]);
        if flags != 0 {
            return Err(DetailsError::UnknownFlags(flags));
        }
        Ok(Self { instance: u64::from_le_bytes(rest) })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn round_trips() {
        let details = EndpointDetails { instance: 0x0123_4567_89ab_cdef };
        let bytes = details.encode();
        assert_eq!(bytes.len(), LEN);
        assert_eq!(EndpointDetails::decode(&bytes), Ok(details));
    }

    #[test]
    fn refuses_what_it_does_not_know() {
        let good = EndpointDetails { instance: 5 }.encode();
        let patched = |at: usize, patch: &[u8]| {
            let mut bytes = good.clone();
            bytes[at..at + patch.len()].copy_from_slice(patch);
            EndpointDetails::decode(&bytes)
        };
        assert_eq!(patched(0, b"KVLT"), Err(DetailsError::BadMagic(*b"KVLT")));
        assert_eq!(patched(4, &2u16.to_le_bytes()), Err(DetailsError::UnsupportedVersion { got: 2, supported: 1 }));
        assert_eq!(patched(6, &1u16.to_le_bytes()), Err(DetailsError::UnknownFlags(1)));
        assert_eq!(EndpointDetails::decode(&good[..15]), Err(DetailsError::Length(15)));
        assert_eq!(EndpointDetails::decode(&[]), Err(DetailsError::Length(0)));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..40)) {
            let _ = EndpointDetails::decode(&bytes);
        }
    }
}
