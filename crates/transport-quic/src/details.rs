//! What a QUIC endpoint advertises in [`kv_proto::Endpoint::details`]: the
//! certificate fingerprint a sender pins and the receiver's bound on ops per
//! batch. Pure encode/decode with `bytes`, no I/O.
//!
//! ```text
//!  0      4         6       8             40                  48
//!  | KVLQ | version | flags | fingerprint | max_ops_per_batch |
//!           u16 = 2   u16 = 0 SHA-256       u64
//! ```
//!
//! All integers are little-endian; the details are exactly [`DETAILS_LEN`]
//! bytes (magic and version are checked first, so an endpoint of another
//! layout is reported by its version). Version 1 also listed the receiver's registered regions; with
//! grants a sender cannot check destinations itself (only the receiver knows
//! its grants, and it refuses a bad batch whole before reading its payload),
//! so version 2 lists none. No flag is defined: any set bit makes the
//! details malformed, as does a wrong length, magic or version; malformed
//! details are refused as a bad endpoint before a packet is sent.

use std::fmt;

use bytes::{Buf, BufMut};

/// The SHA-256 of a transport's DER certificate: what a sender pins.
pub type Fingerprint = [u8; 32];

/// The four bytes the details start with.
pub const MAGIC: [u8; 4] = *b"KVLQ";
/// The details layout this build writes and reads.
pub const VERSION: u16 = 2;
/// Bytes of the details.
pub const DETAILS_LEN: usize = 48;

/// The decoded details of a QUIC endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointDetails {
    /// SHA-256 of the receiver's certificate.
    pub fingerprint: Fingerprint,
    /// The receiver's bound on ops per incoming batch.
    pub max_ops_per_batch: u64,
}

/// Why details cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DetailsError {
    /// Not [`DETAILS_LEN`] bytes.
    #[error("QUIC endpoint details are {0} bytes, expected {DETAILS_LEN}")]
    BadLength(usize),
    /// Not QUIC endpoint details.
    #[error("QUIC endpoint details start with {0:02x?}, not \"KVLQ\"")]
    BadMagic([u8; 4]),
    /// A layout version this build does not read.
    #[error("QUIC endpoint details version {0}, this build reads {VERSION}")]
    UnsupportedVersion(u16),
    /// Flag bits this build does not know.
    #[error("QUIC endpoint details carry unknown flags {0:#06x}")]
    UnknownFlags(u16),
}

impl EndpointDetails {
    /// The details' bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(DETAILS_LEN);
        out.put_slice(&MAGIC);
        out.put_u16_le(VERSION);
        out.put_u16_le(0);
        out.put_slice(&self.fingerprint);
        out.put_u64_le(self.max_ops_per_batch);
        out
    }

    /// Parses details (peer input: every malformation is an error).
    pub fn decode(b: &[u8]) -> Result<Self, DetailsError> {
        // Magic and version first, so details of another layout say so.
        if b.len() < 6 {
            return Err(DetailsError::BadLength(b.len()));
        }
        let mut buf = b;
        let mut magic = [0u8; 4];
        buf.copy_to_slice(&mut magic);
        if magic != MAGIC {
            return Err(DetailsError::BadMagic(magic));
        }
        let version = buf.get_u16_le();
        if version != VERSION {
            return Err(DetailsError::UnsupportedVersion(version));
        }
        if b.len() != DETAILS_LEN {
            return Err(DetailsError::BadLength(b.len()));
        }
        let flags = buf.get_u16_le();
        if flags != 0 {
            return Err(DetailsError::UnknownFlags(flags));
        }
        let mut fingerprint = [0u8; 32];
        buf.copy_to_slice(&mut fingerprint);
        Ok(Self { fingerprint, max_ops_per_batch: buf.get_u64_le() })
    }
}

/// A fingerprint as lowercase hex, for messages.
pub(crate) struct Hex<'a>(pub(crate) &'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> EndpointDetails {
        EndpointDetails { fingerprint: [7; 32], max_ops_per_batch: 1024 }
    }

    #[test]
    fn round_trip() {
        let d = sample();
        let bytes = d.encode();
        assert_eq!(bytes.len(), DETAILS_LEN);
        assert_eq!(&bytes[..4], b"KVLQ");
        assert_eq!(&bytes[40..], &1024u64.to_le_bytes());
        assert_eq!(EndpointDetails::decode(&bytes).unwrap(), d);
    }

    #[test]
    fn malformed_details_are_errors() {
        let good = sample().encode();
        let with = |at: usize, bytes: &[u8]| {
            let mut b = good.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            b
        };
        type Case = (Vec<u8>, fn(&DetailsError) -> bool);
        let cases: Vec<Case> = vec![
            (Vec::new(), |e| matches!(e, DetailsError::BadLength(0))),
            (good[..47].to_vec(), |e| matches!(e, DetailsError::BadLength(47))),
            ([&good[..], &[0u8]].concat(), |e| matches!(e, DetailsError::BadLength(49))),
            (vec![0; kv_proto::MAX_ENDPOINT_DETAILS_LEN + 1], |e| matches!(e, DetailsError::BadMagic(_))),
            (good[..5].to_vec(), |e| matches!(e, DetailsError::BadLength(5))),
            (with(0, b"X"), |e| matches!(e, DetailsError::BadMagic(_))),
            (with(4, &1u16.to_le_bytes()), |e| matches!(e, DetailsError::UnsupportedVersion(1))),
            // Version 1's layout (with a region list) names its version.
            ([&with(4, &1u16.to_le_bytes())[..], &[0u8; 20]].concat(), |e| {
                matches!(e, DetailsError::UnsupportedVersion(1))
            }),
            (with(4, &3u16.to_le_bytes()), |e| matches!(e, DetailsError::UnsupportedVersion(3))),
            (with(6, &1u16.to_le_bytes()), |e| matches!(e, DetailsError::UnknownFlags(1))),
            (with(7, &[0x80]), |e| matches!(e, DetailsError::UnknownFlags(_))),
        ];
        for (i, (bytes, expected)) in cases.iter().enumerate() {
            let err = EndpointDetails::decode(bytes).unwrap_err();
            assert!(expected(&err), "case {i}: unexpected {err:?}");
            assert!(!err.to_string().is_empty());
        }
    }

    #[test]
    fn hex() {
        assert_eq!(Hex(&[0, 0xab, 0x10]).to_string(), "00ab10");
    }
}
