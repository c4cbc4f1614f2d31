//! Encoding and bounded, fallible decoding of one handshake message (layout
//! in the [parent module](super)). Pure: bytes in, values out.

use super::{ConnectionInfo, HandshakeError, HandshakeLimits, QpEndpoint};
use crate::region::{RegionTable, RemoteRegion};

/// First bytes of every handshake message.
pub const MAGIC: [u8; 4] = *b"KVRH";
/// The wire version this build speaks.
pub const VERSION: u16 = 1;
/// Bytes before the region list.
pub const HEADER_LEN: usize = 36;
/// Bytes per region.
pub const REGION_LEN: usize = 20;

/// Largest valid QPN and PSN, plus one (both are 24-bit).
const LIMIT_24_BITS: u32 = 1 << 24;

/// The fixed-size part of a message, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The sender's queue pair.
    pub qp: QpEndpoint,
    /// How many regions follow (within the limit).
    pub region_count: u32,
}

impl Header {
    /// Length of the whole message this header starts.
    pub fn message_len(&self) -> usize {
        HEADER_LEN + self.region_count as usize * REGION_LEN
    }
}

/// Appends the message for `info` to `out`. Refuses what the peer would
/// refuse (the same checks as [`decode`], against `limits`).
pub fn encode(info: &ConnectionInfo, limits: &HandshakeLimits, out: &mut Vec<u8>) -> Result<(), HandshakeError> {
    check_qp(&info.qp)?;
    let count = region_count(info.regions.len() as u64, limits)?;
    RegionTable::new(info.regions.clone())?;
    out.reserve(HEADER_LEN + info.regions.len() * REGION_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&info.qp.gid);
    out.extend_from_slice(&info.qp.qpn.to_le_bytes());
    out.extend_from_slice(&info.qp.psn.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    for region in &info.regions {
        out.extend_from_slice(&region.addr.to_le_bytes());
        out.extend_from_slice(&region.len.to_le_bytes());
        out.extend_from_slice(&region.rkey.to_le_bytes());
    }
    Ok(())
}

/// Decodes and checks the first [`HEADER_LEN`] bytes of `bytes`.
pub fn decode_header(bytes: &[u8], limits: &HandshakeLimits) -> Result<Header, HandshakeError> {
    let mut reader = Reader { bytes, at: 0 };
    let magic: [u8; 4] = reader.array()?;
    if magic != MAGIC {
        return Err(HandshakeError::BadMagic(magic));
    }
    let version = u16::from_le_bytes(reader.array()?);
    if version != VERSION {
        return Err(HandshakeError::UnsupportedVersion { got: version, supported: VERSION });
    }
    let flags = u16::from_le_bytes(reader.array()?);
    if flags != 0 {
        return Err(HandshakeError::UnknownFlags(flags));
    }
    let gid = reader.array()?;
    let qpn = u32::from_le_bytes(reader.array()?);
    let psn = u32::from_le_bytes(reader.array()?);
    let qp = QpEndpoint { gid, qpn, psn };
    check_qp(&qp)?;
    let region_count = region_count(u64::from(u32::from_le_bytes(reader.array()?)), limits)?;
    Ok(Header { qp, region_count })
}

/// Decodes one whole message; `bytes` must hold exactly that message.
pub fn decode(bytes: &[u8], limits: &HandshakeLimits) -> Result<ConnectionInfo, HandshakeError> {
    let header = decode_header(bytes, limits)?;
    let needed = header.message_len();
    if bytes.len() < needed {
        return Err(HandshakeError::Truncated { needed, got: bytes.len() });
    }
    if bytes.len() > needed {
        return Err(HandshakeError::TrailingBytes(bytes.len() - needed));
    }
    let mut reader = Reader { bytes, at: HEADER_LEN };
    let mut regions = Vec::with_capacity(header.region_count as usize);
    for _ in 0..header.region_count {
        let addr = u64::from_le_bytes(reader.array()?);
        let len = u64::from_le_bytes(reader.array()?);
        let rkey = u32::from_le_bytes(reader.array()?);
        regions.push(RemoteRegion { addr, len, rkey });
    }
    RegionTable::new(regions.clone())?;
    Ok(ConnectionInfo { qp: header.qp, regions })
}

fn check_qp(qp: &QpEndpoint) -> Result<(), HandshakeError> {
    if qp.qpn < 2 || qp.qpn >= LIMIT_24_BITS {
        return Err(HandshakeError::BadQpn(qp.qpn));
    }
    if qp.psn >= LIMIT_24_BITS {
        return Err(HandshakeError::BadPsn(qp.psn));
    }
    Ok(())
}

fn region_count(count: u64, limits: &HandshakeLimits) -> Result<u32, HandshakeError> {
    match u32::try_from(count) {
        Ok(count) if count <= limits.max_regions => Ok(count),
        _ => Err(HandshakeError::TooManyRegions { count, max: limits.max_regions }),
    }
}

/// Reads fixed-size fields, failing (not panicking) past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn array<const N: usize>(&mut self) -> Result<[u8; N], HandshakeError> {
        let end = self.at + N;
        let field = self
            .bytes
            .get(self.at..end)
            .ok_or(HandshakeError::Truncated { needed: end.max(HEADER_LEN), got: self.bytes.len() })?;
        let mut out = [0u8; N];
        out.copy_from_slice(field);
        self.at = end;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rstest::rstest;

    use super::*;
    use crate::region::RegionTableError;

    fn limits() -> HandshakeLimits {
        HandshakeLimits { max_regions: 8, ..HandshakeLimits::default() }
    }

    fn qp() -> QpEndpoint {
        let mut gid = [0u8; 16];
        gid[10..].copy_from_slice(&[0xff, 0xff, 127, 0, 0, 1]);
        QpEndpoint { gid, qpn: 0x11, psn: 0x00ab_cdef }
    }

    fn info(regions: usize) -> ConnectionInfo {
        let regions = (0..regions as u64)
            .map(|i| RemoteRegion { addr: 0x7f00_0000_0000 + i * 0x10_0000, len: 0x8_0000, rkey: 0x100 + i as u32 })
            .collect();
        ConnectionInfo { qp: qp(), regions }
    }

    fn encoded(info: &ConnectionInfo) -> Vec<u8> {
        let mut out = Vec::new();
        encode(info, &limits(), &mut out).unwrap();
        out
    }

    #[rstest]
    #[case::sender_without_regions(0)]
    #[case::one_region(1)]
    #[case::at_the_limit(8)]
    fn round_trips(#[case] regions: usize) {
        let info = info(regions);
        let bytes = encoded(&info);
        assert_eq!(bytes.len(), HEADER_LEN + regions * REGION_LEN);
        assert_eq!(decode(&bytes, &limits()).unwrap(), info);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = encoded(&info(2));
        for len in 0..bytes.len() {
            assert!(
                matches!(decode(&bytes[..len], &limits()), Err(HandshakeError::Truncated { .. })),
                "prefix of {len} bytes"
            );
        }
    }

    /// Patches `bytes` at `at` with `patch`, then decodes.
    fn decode_patched(at: usize, patch: &[u8]) -> Result<ConnectionInfo, HandshakeError> {
        let mut bytes = encoded(&info(2));
        bytes[at..at + patch.len()].copy_from_slice(patch);
        decode(&bytes, &limits())
    }

    #[test]
    fn refuses_bad_headers() {
        assert!(matches!(decode_patched(0, b"KVRX"), Err(HandshakeError::BadMagic(m)) if &m == b"KVRX"));
        assert!(matches!(
            decode_patched(4, &2u16.to_le_bytes()),
            Err(HandshakeError::UnsupportedVersion { got: 2, supported: VERSION })
        ));
        assert!(matches!(decode_patched(6, &1u16.to_le_bytes()), Err(HandshakeError::UnknownFlags(1))));
        assert!(matches!(decode_patched(24, &1u32.to_le_bytes()), Err(HandshakeError::BadQpn(1))));
        assert!(matches!(decode_patched(24, &(1u32 << 24).to_le_bytes()), Err(HandshakeError::BadQpn(_))));
        assert!(matches!(decode_patched(28, &(1u32 << 24).to_le_bytes()), Err(HandshakeError::BadPsn(_))));
    }

    #[test]
    fn a_huge_region_count_is_refused_from_the_header_alone() {
        let mut header = encoded(&info(0));
        header[32..36].copy_from_slice(&u32::MAX.to_le_bytes());
        // No region bytes follow: the count alone is refused, nothing is allocated for it.
        assert!(matches!(
            decode_header(&header, &limits()),
            Err(HandshakeError::TooManyRegions { count, max: 8 }) if count == u64::from(u32::MAX)
        ));
    }

    /// `offset` is from the first region: addr at +0, len at +8, the second region at +20.
    #[rstest]
    #[case::empty_region(8, 0, RegionTableError::Invalid { index: 0, addr: 0x7f00_0000_0000, len: 0 })]
    #[case::wrapping_region(0, u64::MAX, RegionTableError::Invalid { index: 0, addr: u64::MAX, len: 0x8_0000 })]
    #[case::overlapping_regions(
        20,
        0x7f00_0004_0000,
        RegionTableError::Overlap { first: 0x7f00_0000_0000, second: 0x7f00_0004_0000 }
    )]
    fn refuses_bad_regions(#[case] offset: usize, #[case] value: u64, #[case] expected: RegionTableError) {
        let result = decode_patched(HEADER_LEN + offset, &value.to_le_bytes());
        assert!(matches!(&result, Err(HandshakeError::BadRegions(err)) if *err == expected), "{result:?}");
    }

    #[test]
    fn refuses_trailing_bytes() {
        let mut bytes = encoded(&info(1));
        bytes.push(0);
        assert!(matches!(decode(&bytes, &limits()), Err(HandshakeError::TrailingBytes(1))));
    }

    #[test]
    fn encode_refuses_what_the_peer_would_refuse() {
        let mut out = Vec::new();
        assert!(matches!(
            encode(&info(9), &limits(), &mut out),
            Err(HandshakeError::TooManyRegions { count: 9, max: 8 })
        ));
        let mut bad_qp = info(0);
        bad_qp.qp.qpn = 0;
        assert!(matches!(encode(&bad_qp, &limits(), &mut out), Err(HandshakeError::BadQpn(0))));
        assert!(out.is_empty());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
            let _ = decode(&bytes, &limits());
        }

        #[test]
        fn arbitrary_bytes_after_a_valid_header_never_panic(
            count in 0u32..10,
            tail in prop::collection::vec(any::<u8>(), 0..220),
        ) {
            let mut bytes = encoded(&info(0));
            bytes[32..36].copy_from_slice(&count.to_le_bytes());
            bytes.extend_from_slice(&tail);
            let _ = decode(&bytes, &limits());
        }
    }
}
