//! Byte layout of the QUIC data plane: one bidirectional stream per batch,
//! little-endian, pure encode/decode with no I/O.
//!
//! The layout is drawn in the crate documentation. Everything here is public
//! so that tests (and a second implementation beside this one) can speak it
//! byte for byte; the transport itself is the only intended user.

/// The ALPN protocol a data-plane connection negotiates; a peer offering
/// anything else fails the TLS handshake. The wire version lives here: a new
/// wire gets a new ALPN.
pub const ALPN: &[u8] = b"kvlink-data/1";
/// The TLS server name a sender presents (SNI). Identity is checked by the
/// pinned certificate fingerprint, never by this name.
pub const SERVER_NAME: &str = "kvlink";

/// Bytes of a [`BatchHeader`].
pub const BATCH_HEADER_LEN: usize = 16;
/// Bytes of one op-list entry (`dst u64`, `len u64`).
pub const OP_LEN: usize = 16;
/// Bytes of a [`ReplyHeader`] (the reason follows it).
pub const REPLY_HEADER_LEN: usize = 8;
/// Bound on the reason text of a reply (peer input on the sender side).
pub const MAX_REASON_LEN: usize = 1024;

/// `STOP_SENDING` code: the batch is refused (a destination is outside the
/// registered regions); its reply says why.
pub const STOP_REFUSED: u32 = 1;
/// `STOP_SENDING` code: the sender broke the protocol; the reply says how.
pub const STOP_PROTOCOL: u32 = 2;
/// `STOP_SENDING` / `CONNECTION_CLOSE` code: the receiver is shutting down.
pub const CLOSE_SHUTDOWN: u32 = 3;

fn u32_at(buf: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    if let Some(s) = buf.get(at..at + 4) {
        b.copy_from_slice(s);
    }
    u32::from_le_bytes(b)
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    if let Some(s) = buf.get(at..at + 8) {
        b.copy_from_slice(s);
    }
    u64::from_le_bytes(b)
}

/// What a batch's stream starts with: `op_count u64 | total_bytes u64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHeader {
    /// Entries in the op list that follows.
    pub op_count: u64,
    /// Payload bytes after the op list: the sum of the ops' lengths.
    pub total_bytes: u64,
}

impl BatchHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; BATCH_HEADER_LEN] {
        let mut b = [0u8; BATCH_HEADER_LEN];
        b[..8].copy_from_slice(&self.op_count.to_le_bytes());
        b[8..].copy_from_slice(&self.total_bytes.to_le_bytes());
        b
    }

    /// Parses a header (every bit pattern is a header; the receiver checks
    /// the values).
    pub fn decode(b: &[u8; BATCH_HEADER_LEN]) -> Self {
        Self { op_count: u64_at(b, 0), total_bytes: u64_at(b, 8) }
    }
}

/// One op-list entry: `dst u64 | len u64`.
pub fn encode_op(dst: u64, len: u64) -> [u8; OP_LEN] {
    let mut b = [0u8; OP_LEN];
    b[..8].copy_from_slice(&dst.to_le_bytes());
    b[8..].copy_from_slice(&len.to_le_bytes());
    b
}

/// `(dst, len)` of an op-list entry.
pub fn decode_op(b: &[u8; OP_LEN]) -> (u64, u64) {
    (u64_at(b, 0), u64_at(b, 8))
}

/// The receiver's verdict on a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyStatus {
    /// Every byte is in the receiver's memory.
    Ok,
    /// Some op is outside the registered regions; nothing was written.
    Refused,
    /// The sender broke the protocol (op count over the limit, lengths that
    /// do not add up, a truncated or overlong stream).
    ProtocolError,
    /// A status this build does not know.
    Unknown(u32),
}

impl ReplyStatus {
    /// The status code on the wire.
    pub fn code(self) -> u32 {
        match self {
            ReplyStatus::Ok => 0,
            ReplyStatus::Refused => 1,
            ReplyStatus::ProtocolError => 2,
            ReplyStatus::Unknown(c) => c,
        }
    }

    /// The status of a wire code.
    pub fn from_code(code: u32) -> Self {
        match code {
            0 => ReplyStatus::Ok,
            1 => ReplyStatus::Refused,
            2 => ReplyStatus::ProtocolError,
            c => ReplyStatus::Unknown(c),
        }
    }
}

/// The fixed part of a reply: `status u32 | reason_len u32`; `reason_len`
/// bytes of UTF-8 follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyHeader {
    /// The verdict.
    pub status: ReplyStatus,
    /// Bytes of reason text that follow (at most [`MAX_REASON_LEN`] from a
    /// well-behaved receiver).
    pub reason_len: u32,
}

impl ReplyHeader {
    /// Parses a reply header.
    pub fn decode(b: &[u8; REPLY_HEADER_LEN]) -> Self {
        Self { status: ReplyStatus::from_code(u32_at(b, 0)), reason_len: u32_at(b, 4) }
    }
}

/// A whole reply: header then `reason`, cut to [`MAX_REASON_LEN`] bytes on a
/// character boundary.
pub fn encode_reply(status: ReplyStatus, reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let reason = reason.get(..end).unwrap_or_default();
    let mut out = Vec::with_capacity(REPLY_HEADER_LEN + reason.len());
    out.extend_from_slice(&status.code().to_le_bytes());
    out.extend_from_slice(&(reason.len() as u32).to_le_bytes());
    out.extend_from_slice(reason.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_ops_round_trip() {
        let h = BatchHeader { op_count: 3, total_bytes: u64::MAX };
        assert_eq!(BatchHeader::decode(&h.encode()), h);
        assert_eq!(decode_op(&encode_op(0xdead_beef, 42)), (0xdead_beef, 42));
    }

    #[test]
    fn replies_round_trip_and_long_reasons_are_cut() {
        let reply = encode_reply(ReplyStatus::Refused, "op 1: outside");
        let mut h = [0u8; REPLY_HEADER_LEN];
        h.copy_from_slice(&reply[..REPLY_HEADER_LEN]);
        let header = ReplyHeader::decode(&h);
        assert_eq!(header.status, ReplyStatus::Refused);
        assert_eq!(&reply[REPLY_HEADER_LEN..], b"op 1: outside");
        let long = "é".repeat(MAX_REASON_LEN);
        let reply = encode_reply(ReplyStatus::ProtocolError, &long);
        assert!(reply.len() - REPLY_HEADER_LEN <= MAX_REASON_LEN);
        assert!(std::str::from_utf8(&reply[REPLY_HEADER_LEN..]).is_ok());
        for code in 0..5 {
            assert_eq!(ReplyStatus::from_code(code).code(), code);
        }
    }
}
