//! Byte layout of the TCP data plane: fixed-size frames, little-endian, pure
//! encode/decode with no I/O.
//!
//! The layout is drawn in the crate documentation. Everything here is public
//! so that tests (and a future second wire beside this one) can speak it
//! byte for byte; the transport itself is the only intended user.

/// The four bytes a data-plane connection starts with.
pub const MAGIC: [u8; 4] = *b"KVLT";
/// The data-plane wire version this build speaks.
pub const VERSION: u16 = 1;
/// Preamble flag: the sender holds the shared secret and sends its nonce
/// ([`AUTH_TAG_LEN`] bytes) right after the preamble.
pub const FLAG_AUTH: u16 = 1;
/// Preamble flags this build understands.
pub const SUPPORTED_FLAGS: u16 = FLAG_AUTH;
/// Bytes of a nonce, a proof, and so of the challenge (nonce then proof) is twice this.
pub const AUTH_TAG_LEN: usize = kv_proto::auth::AUTH_TAG_LEN;
/// Verdict byte after the sender's proof: accepted.
pub const AUTH_OK: u8 = 0;
/// Verdict byte after the sender's proof: refused (the receiver then closes).
pub const AUTH_FAILED: u8 = 1;

/// Bytes of the [`Preamble`].
pub const PREAMBLE_LEN: usize = 8;
/// Bytes of the [`Accept`] reply.
pub const ACCEPT_LEN: usize = 24;
/// Bytes of a [`BatchHeader`].
pub const BATCH_HEADER_LEN: usize = 24;
/// Bytes of one op-list entry (`dst u64`, `len u64`).
pub const OP_LEN: usize = 16;
/// Bytes of a [`ReplyHeader`] (the reason follows it).
pub const REPLY_HEADER_LEN: usize = 16;
/// Bound on the reason text of a reply (peer input on the sender side).
pub const MAX_REASON_LEN: usize = 1024;

fn u16_at(buf: &[u8], at: usize) -> u16 {
    let mut b = [0u8; 2];
    if let Some(s) = buf.get(at..at + 2) {
        b.copy_from_slice(s);
    }
    u16::from_le_bytes(b)
}

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

/// What a connecting sender writes first: `KVLT | version u16 | flags u16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preamble {
    /// The sender's wire version.
    pub version: u16,
    /// Requested features; the receiver refuses bits it does not know.
    pub flags: u16,
}

impl Preamble {
    /// This build's preamble.
    pub fn current() -> Self {
        Self { version: VERSION, flags: 0 }
    }

    /// The preamble's bytes.
    pub fn encode(&self) -> [u8; PREAMBLE_LEN] {
        let mut b = [0u8; PREAMBLE_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b
    }

    /// Parses a preamble; `Err` carries the four bytes found in place of
    /// [`MAGIC`].
    pub fn decode(b: &[u8; PREAMBLE_LEN]) -> Result<Self, [u8; 4]> {
        let mut magic = [0u8; 4];
        magic.copy_from_slice(&b[..4]);
        if magic != MAGIC {
            return Err(magic);
        }
        Ok(Self { version: u16_at(b, 4), flags: u16_at(b, 6) })
    }
}

/// The receiver's answer to a [`Preamble`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcceptStatus {
    /// The connection is accepted; batches may follow.
    Accepted,
    /// The receiver does not speak the sender's version; it closes.
    UnsupportedVersion,
    /// The sender asked for flags the receiver does not know; it closes.
    UnsupportedFlags,
    /// The receiver requires the shared secret and the sender did not
    /// announce it; it closes.
    AuthRequired,
    /// The sender announced the shared secret but the receiver has none; it
    /// closes (a sender with a secret writes only to authenticated peers).
    AuthUnavailable,
    /// A status this build does not know.
    Unknown(u16),
}

impl AcceptStatus {
    /// The status code on the wire.
    pub fn code(self) -> u16 {
        match self {
            AcceptStatus::Accepted => 0,
            AcceptStatus::UnsupportedVersion => 1,
            AcceptStatus::UnsupportedFlags => 2,
            AcceptStatus::AuthRequired => 3,
            AcceptStatus::AuthUnavailable => 4,
            AcceptStatus::Unknown(c) => c,
        }
    }

    /// The status of a wire code.
    pub fn from_code(code: u16) -> Self {
        match code {
            0 => AcceptStatus::Accepted,
            1 => AcceptStatus::UnsupportedVersion,
            2 => AcceptStatus::UnsupportedFlags,
            3 => AcceptStatus::AuthRequired,
            4 => AcceptStatus::AuthUnavailable,
            c => AcceptStatus::Unknown(c),
        }
    }
}

/// The receiver's reply to a preamble:
/// `KVLT | version u16 | status u16 | max_ops_per_batch u64 | idle_timeout_ms u64`.
///
/// The limits let a sender fail fast (a batch the receiver would refuse is
/// never sent) and retire pooled connections before the receiver's idle
/// timeout closes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accept {
    /// The receiver's wire version.
    pub version: u16,
    /// Whether the connection is accepted.
    pub status: AcceptStatus,
    /// The most ops the receiver accepts in one batch.
    pub max_ops_per_batch: u64,
    /// How long the receiver keeps a connection with no batch in progress.
    pub idle_timeout_ms: u64,
}

impl Accept {
    /// The reply's bytes.
    pub fn encode(&self) -> [u8; ACCEPT_LEN] {
        let mut b = [0u8; ACCEPT_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.status.code().to_le_bytes());
        b[8..16].copy_from_slice(&self.max_ops_per_batch.to_le_bytes());
        b[16..24].copy_from_slice(&self.idle_timeout_ms.to_le_bytes());
        b
    }

    /// Parses a reply; `Err` carries the four bytes found in place of [`MAGIC`].
    pub fn decode(b: &[u8; ACCEPT_LEN]) -> Result<Self, [u8; 4]> {
        let mut magic = [0u8; 4];
        magic.copy_from_slice(&b[..4]);
        if magic != MAGIC {
            return Err(magic);
        }
        Ok(Self {
            version: u16_at(b, 4),
            status: AcceptStatus::from_code(u16_at(b, 6)),
            max_ops_per_batch: u64_at(b, 8),
            idle_timeout_ms: u64_at(b, 16),
        })
    }
}

/// What starts every batch: `batch_id u64 | op_count u64 | total_bytes u64`.
///
/// `op_count` entries of [`OP_LEN`] bytes follow, then `total_bytes` of
/// payload (every op's bytes, concatenated in op order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHeader {
    /// Sender-chosen id, echoed in the reply.
    pub batch_id: u64,
    /// Number of ops in the op list.
    pub op_count: u64,
    /// Sum of the ops' lengths: the payload's size.
    pub total_bytes: u64,
}

impl BatchHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; BATCH_HEADER_LEN] {
        let mut b = [0u8; BATCH_HEADER_LEN];
        b[..8].copy_from_slice(&self.batch_id.to_le_bytes());
        b[8..16].copy_from_slice(&self.op_count.to_le_bytes());
        b[16..24].copy_from_slice(&self.total_bytes.to_le_bytes());
        b
    }

    /// Parses a header (any bytes are a header; the receiver validates the
    /// counts).
    pub fn decode(b: &[u8; BATCH_HEADER_LEN]) -> Self {
        Self { batch_id: u64_at(b, 0), op_count: u64_at(b, 8), total_bytes: u64_at(b, 16) }
    }
}

/// One op-list entry's bytes: `dst u64 | len u64`.
pub fn encode_op(dst: u64, len: u64) -> [u8; OP_LEN] {
    let mut b = [0u8; OP_LEN];
    b[..8].copy_from_slice(&dst.to_le_bytes());
    b[8..].copy_from_slice(&len.to_le_bytes());
    b
}

/// Parses one op-list entry into `(dst, len)`.
pub fn decode_op(b: &[u8; OP_LEN]) -> (u64, u64) {
    (u64_at(b, 0), u64_at(b, 8))
}

/// The outcome of a batch, as the receiver reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyStatus {
    /// Every byte of the batch is in the receiver's memory.
    Ok,
    /// The batch was refused whole (nothing written); the connection stays
    /// usable.
    Refused,
    /// The sender broke the protocol; the receiver closes the connection.
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

/// The receiver's reply to a batch:
/// `batch_id u64 | status u32 | reason_len u32`, then `reason_len` bytes of
/// UTF-8 reason (empty for [`ReplyStatus::Ok`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyHeader {
    /// The batch this replies to.
    pub batch_id: u64,
    /// The outcome.
    pub status: ReplyStatus,
    /// Bytes of reason text that follow, at most [`MAX_REASON_LEN`].
    pub reason_len: u32,
}

impl ReplyHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; REPLY_HEADER_LEN] {
        let mut b = [0u8; REPLY_HEADER_LEN];
        b[..8].copy_from_slice(&self.batch_id.to_le_bytes());
        b[8..12].copy_from_slice(&self.status.code().to_le_bytes());
        b[12..16].copy_from_slice(&self.reason_len.to_le_bytes());
        b
    }

    /// Parses a reply header.
    pub fn decode(b: &[u8; REPLY_HEADER_LEN]) -> Self {
        Self { batch_id: u64_at(b, 0), status: ReplyStatus::from_code(u32_at(b, 8)), reason_len: u32_at(b, 12) }
    }
}

/// A whole reply (header and reason), the reason cut to [`MAX_REASON_LEN`]
/// bytes at a character boundary.
pub fn encode_reply(batch_id: u64, status: ReplyStatus, reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let reason = &reason.as_bytes()[..end];
    // `end` <= MAX_REASON_LEN, which fits in u32.
    let reason_len = u32::try_from(reason.len()).unwrap_or(0);
    let mut out = Vec::with_capacity(REPLY_HEADER_LEN + reason.len());
    out.extend_from_slice(&ReplyHeader { batch_id, status, reason_len }.encode());
    out.extend_from_slice(&reason[..reason_len as usize]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let p = Preamble { version: 7, flags: 0x8001 };
        assert_eq!(Preamble::decode(&p.encode()), Ok(p));
        let a = Accept {
            version: VERSION,
            status: AcceptStatus::UnsupportedFlags,
            max_ops_per_batch: 1 << 24,
            idle_timeout_ms: 120_000,
        };
        assert_eq!(Accept::decode(&a.encode()), Ok(a));
        let h = BatchHeader { batch_id: u64::MAX, op_count: 3, total_bytes: 1 << 40 };
        assert_eq!(BatchHeader::decode(&h.encode()), h);
        assert_eq!(decode_op(&encode_op(0xdead_beef, 8192)), (0xdead_beef, 8192));
        let r = ReplyHeader { batch_id: 9, status: ReplyStatus::Unknown(77), reason_len: 5 };
        assert_eq!(ReplyHeader::decode(&r.encode()), r);
    }

    #[test]
    fn bad_magic_is_reported() {
        let mut b = Preamble::current().encode();
        b[0] = b'X';
        assert_eq!(Preamble::decode(&b), Err(*b"XVLT"));
    }

    #[test]
    fn reply_reason_is_cut_at_a_char_boundary() {
        let long = "é".repeat(MAX_REASON_LEN);
        let bytes = encode_reply(1, ReplyStatus::Refused, &long);
        let mut h = [0u8; REPLY_HEADER_LEN];
        h.copy_from_slice(&bytes[..REPLY_HEADER_LEN]);
        let h = ReplyHeader::decode(&h);
        assert_eq!(h.reason_len as usize, MAX_REASON_LEN);
        assert!(std::str::from_utf8(&bytes[REPLY_HEADER_LEN..]).is_ok());
    }
}
