//! What a QUIC endpoint advertises in [`kv_proto::Endpoint::details`]: the
//! certificate fingerprint a sender pins, the receiver's bound on ops per
//! batch, and its registered regions. Pure encode/decode, no I/O.
//!
//! ```text
//!  0      4         6       8             40                  48             52
//!  | KVLQ | version | flags | fingerprint | max_ops_per_batch | region_count | region × region_count |
//!           u16       u16     32 bytes      u64                 u32            addr u64, len u64
//! ```
//!
//! All integers are little-endian. The details must be exactly
//! `52 + 16 × region_count` bytes, at most
//! [`kv_proto::MAX_ENDPOINT_DETAILS_LEN`]; the regions must be non-empty,
//! must not wrap the address space and must not overlap. Flag bit 0
//! ([`FLAG_REGIONS_OMITTED`]) says the receiver has more regions than fit, so
//! none are listed (the sender then leaves every bounds check to the
//! receiver); any other bit is unknown and makes the details malformed.
//! Anything else malformed is refused as a bad endpoint before a packet is
//! sent.

use std::fmt;

use kv_proto::{MemoryRegion, RegionSet, MAX_ENDPOINT_DETAILS_LEN};

/// The SHA-256 of a transport's DER certificate: what a sender pins.
pub type Fingerprint = [u8; 32];

/// The four bytes the details start with.
pub const MAGIC: [u8; 4] = *b"KVLQ";
/// The details layout this build writes and reads.
pub const VERSION: u16 = 1;
/// Flag: the regions did not fit and are not listed.
pub const FLAG_REGIONS_OMITTED: u16 = 1;
/// Bytes before the first region entry.
pub const HEADER_LEN: usize = 52;
/// Bytes of one region entry.
pub const REGION_LEN: usize = 16;
/// Most regions the details can list.
pub const MAX_REGIONS: usize = (MAX_ENDPOINT_DETAILS_LEN - HEADER_LEN) / REGION_LEN;

/// The decoded details of a QUIC endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointDetails {
    /// SHA-256 of the receiver's certificate.
    pub fingerprint: Fingerprint,
    /// The receiver's bound on ops per incoming batch.
    pub max_ops_per_batch: u64,
    /// The receiver's registered regions, or `None` if it has more than
    /// [`MAX_REGIONS`] (then not listed).
    pub regions: Option<Vec<MemoryRegion>>,
}

/// Why details cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DetailsError {
    /// Shorter than the fixed header.
    #[error("QUIC endpoint details are {0} bytes, shorter than the {HEADER_LEN}-byte header")]
    TooShort(usize),
    /// Longer than [`MAX_ENDPOINT_DETAILS_LEN`].
    #[error("QUIC endpoint details are {0} bytes, more than {MAX_ENDPOINT_DETAILS_LEN}")]
    TooLong(usize),
    /// Not QUIC endpoint details.
    #[error("QUIC endpoint details start with {0:02x?}, not \"KVLQ\"")]
    BadMagic([u8; 4]),
    /// A layout version this build does not read.
    #[error("QUIC endpoint details version {0}, this build reads {VERSION}")]
    UnsupportedVersion(u16),
    /// Flag bits this build does not know.
    #[error("QUIC endpoint details carry unknown flags {0:#06x}")]
    UnknownFlags(u16),
    /// The length does not match the region count.
    #[error("QUIC endpoint details announce {count} regions in {len} bytes")]
    LengthMismatch {
        /// The announced region count.
        count: u32,
        /// The details' length.
        len: usize,
    },
    /// Regions listed although the flag says they are omitted.
    #[error("QUIC endpoint details list regions and flag them omitted")]
    OmittedButListed,
    /// The listed regions are empty, wrap or overlap.
    #[error("QUIC endpoint details list bad regions: {0}")]
    BadRegions(kv_proto::RegionError),
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    let mut x = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        x.copy_from_slice(s);
    }
    u16::from_le_bytes(x)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        x.copy_from_slice(s);
    }
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        x.copy_from_slice(s);
    }
    u64::from_le_bytes(x)
}

impl EndpointDetails {
    /// The details' bytes. More than [`MAX_REGIONS`] regions are not listed
    /// ([`FLAG_REGIONS_OMITTED`]).
    pub fn encode(&self) -> Vec<u8> {
        let listed = self.regions.as_deref().filter(|r| r.len() <= MAX_REGIONS);
        let flags = if listed.is_some() { 0 } else { FLAG_REGIONS_OMITTED };
        let regions = listed.unwrap_or_default();
        let mut out = Vec::with_capacity(HEADER_LEN + regions.len() * REGION_LEN);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&self.fingerprint);
        out.extend_from_slice(&self.max_ops_per_batch.to_le_bytes());
        // At most MAX_REGIONS (about 4 Ki), which fits u32.
        out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
        for r in regions {
            out.extend_from_slice(&r.addr.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
        }
        out
    }

    /// Parses details (peer input: every malformation is an error).
    pub fn decode(b: &[u8]) -> Result<Self, DetailsError> {
        if b.len() > MAX_ENDPOINT_DETAILS_LEN {
            return Err(DetailsError::TooLong(b.len()));
        }
        let (Some(magic), Some(fingerprint)) = (b.get(..4), b.get(8..40)) else {
            return Err(DetailsError::TooShort(b.len()));
        };
        if b.len() < HEADER_LEN {
            return Err(DetailsError::TooShort(b.len()));
        }
        if magic != MAGIC {
            let mut m = [0u8; 4];
            m.copy_from_slice(magic);
            return Err(DetailsError::BadMagic(m));
        }
        let version = u16_at(b, 4);
        if version != VERSION {
            return Err(DetailsError::UnsupportedVersion(version));
        }
        let flags = u16_at(b, 6);
        if flags & !FLAG_REGIONS_OMITTED != 0 {
            return Err(DetailsError::UnknownFlags(flags));
        }
        let mut fp = [0u8; 32];
        fp.copy_from_slice(fingerprint);
        let max_ops_per_batch = u64_at(b, 40);
        let count = u32_at(b, 48);
        let body = b.get(HEADER_LEN..).unwrap_or_default();
        if usize::try_from(count).ok().and_then(|c| c.checked_mul(REGION_LEN)) != Some(body.len()) {
            return Err(DetailsError::LengthMismatch { count, len: b.len() });
        }
        let regions = if flags & FLAG_REGIONS_OMITTED != 0 {
            if count != 0 {
                return Err(DetailsError::OmittedButListed);
            }
            None
        } else {
            let regions: Vec<MemoryRegion> =
                body.chunks_exact(REGION_LEN).map(|c| MemoryRegion::new(u64_at(c, 0), u64_at(c, 8))).collect();
            // Checks: non-empty, no wrap, no overlap (identical duplicates
            // are merged, which is harmless for bounds checks).
            RegionSet::new().insert(&regions).map_err(DetailsError::BadRegions)?;
            Some(regions)
        };
        Ok(Self { fingerprint: fp, max_ops_per_batch, regions })
    }

    /// The listed regions as a set for bounds checks, or `None` if omitted.
    pub fn region_set(&self) -> Option<RegionSet> {
        let mut set = RegionSet::new();
        set.insert(self.regions.as_deref()?).ok()?;
        Some(set)
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
        EndpointDetails {
            fingerprint: [7; 32],
            max_ops_per_batch: 1024,
            regions: Some(vec![MemoryRegion::new(4096, 100), MemoryRegion::new(0, 10)]),
        }
    }

    #[test]
    fn round_trip() {
        let d = sample();
        let bytes = d.encode();
        assert_eq!(bytes.len(), HEADER_LEN + 2 * REGION_LEN);
        assert_eq!(EndpointDetails::decode(&bytes).unwrap(), d);
        let set = d.region_set().unwrap();
        assert!(set.contains(4096, 100) && !set.contains(10, 1));
    }

    #[test]
    fn too_many_regions_are_omitted() {
        let regions: Vec<MemoryRegion> = (0..MAX_REGIONS as u64 + 1).map(|i| MemoryRegion::new(i * 100, 10)).collect();
        let d = EndpointDetails { regions: Some(regions), ..sample() };
        let back = EndpointDetails::decode(&d.encode()).unwrap();
        assert_eq!(back.regions, None);
        assert!(back.region_set().is_none());
        let fits: Vec<MemoryRegion> = (0..MAX_REGIONS as u64).map(|i| MemoryRegion::new(i * 100, 10)).collect();
        let d = EndpointDetails { regions: Some(fits), ..sample() };
        assert!(d.encode().len() <= MAX_ENDPOINT_DETAILS_LEN);
        assert_eq!(EndpointDetails::decode(&d.encode()).unwrap(), d);
    }

    #[test]
    fn malformed_details_are_errors() {
        let good = sample().encode();
        type Case = (Vec<u8>, fn(&DetailsError) -> bool);
        let cases: Vec<Case> = vec![
            (Vec::new(), |e| matches!(e, DetailsError::TooShort(0))),
            (good[..51].to_vec(), |e| matches!(e, DetailsError::TooShort(51))),
            (good[..60].to_vec(), |e| matches!(e, DetailsError::LengthMismatch { .. })),
            ([&good[..], &[0u8]].concat(), |e| matches!(e, DetailsError::LengthMismatch { .. })),
            (vec![0; MAX_ENDPOINT_DETAILS_LEN + 1], |e| matches!(e, DetailsError::TooLong(_))),
            (
                {
                    let mut b = good.clone();
                    b[0] = b'X';
                    b
                },
                |e| matches!(e, DetailsError::BadMagic(_)),
            ),
            (
                {
                    let mut b = good.clone();
                    b[4] = 2;
                    b
                },
                |e| matches!(e, DetailsError::UnsupportedVersion(2)),
            ),
            (
                {
                    let mut b = good.clone();
                    b[7] = 0x80;
                    b
                },
                |e| matches!(e, DetailsError::UnknownFlags(_)),
            ),
            (
                {
                    let mut b = good.clone();
                    b[6] = 1;
                    b
                },
                |e| matches!(e, DetailsError::OmittedButListed),
            ),
            (
                {
                    let mut b = good.clone();
                    b[48..52].copy_from_slice(&u32::MAX.to_le_bytes());
                    b
                },
                |e| matches!(e, DetailsError::LengthMismatch { .. }),
            ),
            (
                EndpointDetails { regions: Some(vec![MemoryRegion::new(0, 10), MemoryRegion::new(5, 10)]), ..sample() }
                    .encode(),
                |e| matches!(e, DetailsError::BadRegions(_)),
            ),
            (EndpointDetails { regions: Some(vec![MemoryRegion::new(u64::MAX, 2)]), ..sample() }.encode(), |e| {
                matches!(e, DetailsError::BadRegions(_))
            }),
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
