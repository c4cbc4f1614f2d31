//! Byte layout of the TCP data plane (wire v2): fixed-size frames,
//! little-endian, encoded and decoded with `bytes::Buf`/`BufMut`, no I/O.
//!
//! The layout is drawn in the crate documentation. The op list and the
//! verdict every data-plane wire shares come from [`kv_proto::dataplane`];
//! this module adds the TCP framing around them. Everything here is public
//! so that tests (and a future second wire beside this one) can speak it
//! byte for byte; the transport itself is the only intended user.

use bytes::{Buf, BufMut};
use kv_proto::dataplane::{self, ReplyStatus, VERDICT_HEADER_LEN};
use kv_proto::receive::HeaderFields;
use kv_proto::{GrantId, GRANT_ID_LEN};

pub use kv_proto::dataplane::{decode_op, encode_op, OpEntry, MAX_REASON_LEN, OP_LEN};
/// The receiver's answer to a [`Preamble`], as every data plane codes it.
pub use kv_proto::AcceptStatus;

/// The four bytes a data-plane connection starts with.
pub const MAGIC: [u8; 4] = *b"KVLT";
/// The data-plane wire version this build speaks (2: batches name a grant;
/// 3: once authenticated, every batch header, op list and reply is followed
/// by its tag, [`kv_proto::session`]).
pub const VERSION: u16 = 3;
/// Preamble flag: the sender holds the shared secret and sends its nonce
/// ([`AUTH_TAG_LEN`] bytes) right after the preamble.
pub const FLAG_AUTH: u16 = 1;
/// Preamble flag (only with [`FLAG_AUTH`]): the sender follows every
/// batch's payload with its tag ([`kv_proto::session`], a frame of its own
/// over the batch id and the payload), and the receiver checks it over the
/// bytes as they landed ([`crate::TcpConfig::authenticate_payloads`]).
pub const FLAG_PAYLOAD_AUTH: u16 = 2;
/// Preamble flags this build understands.
pub const SUPPORTED_FLAGS: u16 = FLAG_AUTH | FLAG_PAYLOAD_AUTH;
/// Bytes of a nonce and of a proof.
pub const AUTH_TAG_LEN: usize = kv_proto::auth::AUTH_TAG_LEN;
/// Verdict byte after the sender's proof: accepted.
pub const AUTH_OK: u8 = 0;
/// Verdict byte after the sender's proof: refused (the receiver then closes).
pub const AUTH_FAILED: u8 = 1;
/// Verdict byte after the sender's proof: proved, but the receiver serves
/// its most connections already (it then closes).
pub const AUTH_BUSY: u8 = 2;

/// Batch flag: the sender asks for an admission verdict before it sends
/// the payload (used for each part of a batch spread over several
/// connections, so a batch is refused whole before any part is written).
pub const BATCH_FLAG_PRECHECK: u32 = 1;
/// Batch flags this build understands.
pub const SUPPORTED_BATCH_FLAGS: u32 = BATCH_FLAG_PRECHECK;

/// Bytes of the [`Preamble`] (the nonce of `FLAG_AUTH` not included).
pub const PREAMBLE_LEN: usize = 8;
/// Bytes of the [`Accept`] reply.
pub const ACCEPT_LEN: usize = 24;
/// Bytes of the receiver's challenge: its nonce, then its proof.
pub const CHALLENGE_LEN: usize = 2 * AUTH_TAG_LEN;
/// Bytes of the authentication transcript's context: the preamble and the
/// accept reply, as sent.
pub const AUTH_CONTEXT_LEN: usize = PREAMBLE_LEN + ACCEPT_LEN;
/// Bytes of a [`BatchHeader`].
pub const BATCH_HEADER_LEN: usize = 48;
/// Bytes of a [`ReplyHeader`] (the reason follows it).
pub const REPLY_HEADER_LEN: usize = 8 + VERDICT_HEADER_LEN;

/// What a connecting sender writes first: `KVLT | version u16 | flags u16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preamble {
    /// The sender's wire version.
    pub version: u16,
    /// Requested features; the receiver refuses bits it does not know.
    pub flags: u16,
}

impl Preamble {
    /// This build's preamble, without authentication.
    pub fn current() -> Self {
        Self { version: VERSION, flags: 0 }
    }

    /// The preamble's bytes.
    pub fn encode(&self) -> [u8; PREAMBLE_LEN] {
        let mut b = [0u8; PREAMBLE_LEN];
        let mut out = &mut b[..];
        out.put_slice(&MAGIC);
        out.put_u16_le(self.version);
        out.put_u16_le(self.flags);
        b
    }

    /// Parses a preamble; `Err` carries the four bytes found in place of
    /// [`MAGIC`].
    pub fn decode(b: &[u8; PREAMBLE_LEN]) -> Result<Self, [u8; 4]> {
        let mut buf = &b[..];
        take_magic(&mut buf)?;
        Ok(Self { version: buf.get_u16_le(), flags: buf.get_u16_le() })
    }

    /// Whether the sender holds the shared secret ([`FLAG_AUTH`]; its nonce
    /// follows the preamble).
    pub fn announces_auth(&self) -> bool {
        self.flags & FLAG_AUTH != 0
    }

    /// Whether the sender tags its payloads ([`FLAG_PAYLOAD_AUTH`]).
    pub fn announces_payload_auth(&self) -> bool {
        self.flags & FLAG_PAYLOAD_AUTH != 0
    }

    /// The receiver's answer to this preamble, for a receiver that holds the
    /// shared secret or not: [`AcceptStatus::Accepted`] only for this
    /// build's version, known flags ([`FLAG_PAYLOAD_AUTH`] only with
    /// [`FLAG_AUTH`]), and a secret on both sides or neither.
    pub fn answer(&self, receiver_has_secret: bool) -> AcceptStatus {
        if self.version != VERSION {
            AcceptStatus::UnsupportedVersion
        } else if self.flags & !SUPPORTED_FLAGS != 0 || (self.announces_payload_auth() && !self.announces_auth()) {
            AcceptStatus::UnsupportedFlags
        } else if receiver_has_secret && !self.announces_auth() {
            AcceptStatus::AuthRequired
        } else if !receiver_has_secret && self.announces_auth() {
            AcceptStatus::AuthUnavailable
        } else {
            AcceptStatus::Accepted
        }
    }
}

impl Preamble {
    /// [`Preamble::answer`] from a receiver that also requires tagged
    /// payloads or not: a sender that does not announce them is then
    /// refused with [`AcceptStatus::PayloadAuthRequired`].
    pub fn answer_requiring(&self, receiver_has_secret: bool, payload_auth_required: bool) -> AcceptStatus {
        match self.answer(receiver_has_secret) {
            AcceptStatus::Accepted if payload_auth_required && !self.announces_payload_auth() => {
                AcceptStatus::PayloadAuthRequired
            }
            answer => answer,
        }
    }
}

/// Reads the four magic bytes; `Err` carries them if they are not [`MAGIC`].
fn take_magic(buf: &mut &[u8]) -> Result<(), [u8; 4]> {
    let mut magic = [0u8; 4];
    buf.copy_to_slice(&mut magic);
    if magic == MAGIC {
        Ok(())
    } else {
        Err(magic)
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
        let mut out = &mut b[..];
        out.put_slice(&MAGIC);
        out.put_u16_le(self.version);
        out.put_u16_le(self.status.code());
        out.put_u64_le(self.max_ops_per_batch);
        out.put_u64_le(self.idle_timeout_ms);
        b
    }

    /// Parses a reply; `Err` carries the four bytes found in place of [`MAGIC`].
    pub fn decode(b: &[u8; ACCEPT_LEN]) -> Result<Self, [u8; 4]> {
        let mut buf = &b[..];
        take_magic(&mut buf)?;
        Ok(Self {
            version: buf.get_u16_le(),
            status: AcceptStatus::from_code(buf.get_u16_le()),
            max_ops_per_batch: buf.get_u64_le(),
            idle_timeout_ms: buf.get_u64_le(),
        })
    }
}

/// The context of the authentication transcript
/// ([`kv_proto::auth::Transcript::context`]): everything both sides have
/// seen before the proofs, as sent — the preamble, then the accept reply.
/// (The nonces are transcript fields of their own.)
pub fn auth_context(preamble: &[u8; PREAMBLE_LEN], accept: &[u8; ACCEPT_LEN]) -> [u8; AUTH_CONTEXT_LEN] {
    let mut b = [0u8; AUTH_CONTEXT_LEN];
    let mut out = &mut b[..];
    out.put_slice(preamble);
    out.put_slice(accept);
    b
}

/// What starts every batch:
/// `batch_id u64 | flags u32 | reserved u32 | op_count u64 | total_bytes u64 | grant_id [u8; 16]`.
///
/// `op_count` entries of [`OP_LEN`] bytes follow, then (unless the receiver
/// refused a [`BATCH_FLAG_PRECHECK`] batch) `total_bytes` of payload: every
/// op's bytes, concatenated in op order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHeader {
    /// Sender-chosen id, echoed in the replies.
    pub batch_id: u64,
    /// [`BATCH_FLAG_PRECHECK`] or 0; the receiver refuses unknown bits.
    pub flags: u32,
    /// Must be zero (room for a later version).
    pub reserved: u32,
    /// Number of ops in the op list.
    pub op_count: u64,
    /// Sum of the ops' lengths: the payload's size.
    pub total_bytes: u64,
    /// The grant the batch writes under (issued by the receiver).
    pub grant: GrantId,
}

impl BatchHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; BATCH_HEADER_LEN] {
        let mut b = [0u8; BATCH_HEADER_LEN];
        let mut out = &mut b[..];
        out.put_u64_le(self.batch_id);
        out.put_u32_le(self.flags);
        out.put_u32_le(self.reserved);
        out.put_u64_le(self.op_count);
        out.put_u64_le(self.total_bytes);
        out.put_slice(&self.grant.to_bytes());
        b
    }

    /// Parses a header (any bytes are a header; the receiver validates the
    /// flags, the counts and the grant).
    pub fn decode(b: &[u8; BATCH_HEADER_LEN]) -> Self {
        let mut buf = &b[..];
        let batch_id = buf.get_u64_le();
        let flags = buf.get_u32_le();
        let reserved = buf.get_u32_le();
        let op_count = buf.get_u64_le();
        let total_bytes = buf.get_u64_le();
        let mut grant = [0u8; GRANT_ID_LEN];
        buf.copy_to_slice(&mut grant);
        Self { batch_id, flags, reserved, op_count, total_bytes, grant: GrantId::from_bytes(grant) }
    }

    /// Whether the receiver can read this batch: known flags, zero reserved
    /// field (the op count is checked against the receiver's limit apart).
    pub fn is_well_formed(&self) -> bool {
        self.flags & !SUPPORTED_BATCH_FLAGS == 0 && self.reserved == 0
    }

    /// Whether the sender asks for an admission verdict before the payload.
    pub fn wants_precheck(&self) -> bool {
        self.flags & BATCH_FLAG_PRECHECK != 0
    }
}

/// What the batch-receive machine ([`kv_proto::receive`]) reads of a header.
impl From<BatchHeader> for HeaderFields {
    fn from(header: BatchHeader) -> Self {
        HeaderFields {
            grant: header.grant,
            op_count: header.op_count,
            total_bytes: header.total_bytes,
            batch_id: header.batch_id,
            precheck: header.wants_precheck(),
            well_formed: header.is_well_formed(),
        }
    }
}

/// The receiver's reply to a batch, or its admission verdict on a
/// [`BATCH_FLAG_PRECHECK`] batch: `batch_id u64`, then the shared verdict
/// (`status u32 | reason_len u32`, [`kv_proto::dataplane::put_verdict`]),
/// then `reason_len` bytes of UTF-8 reason (empty for [`ReplyStatus::Ok`]).
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
    /// Parses a reply header.
    pub fn decode(b: &[u8; REPLY_HEADER_LEN]) -> Self {
        let mut buf = &b[..];
        let batch_id = buf.get_u64_le();
        let mut verdict = [0u8; VERDICT_HEADER_LEN];
        buf.copy_to_slice(&mut verdict);
        let (status, reason_len) = dataplane::decode_verdict_header(&verdict);
        Self { batch_id, status, reason_len }
    }
}

/// Appends a whole reply (header and reason, the reason cut to
/// [`MAX_REASON_LEN`] bytes at a character boundary) to `out`.
pub fn put_reply(out: &mut impl BufMut, batch_id: u64, status: ReplyStatus, reason: &str) {
    out.put_u64_le(batch_id);
    dataplane::put_verdict(out, status, reason);
}

/// A whole reply's bytes (see [`put_reply`]).
pub fn encode_reply(batch_id: u64, status: ReplyStatus, reason: &str) -> Vec<u8> {
    let reason_len = dataplane::bounded_reason(reason).len();
    let mut out = Vec::with_capacity(REPLY_HEADER_LEN + reason_len);
    put_reply(&mut out, batch_id, status, reason);
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
        let h = BatchHeader {
            batch_id: u64::MAX,
            flags: BATCH_FLAG_PRECHECK,
            reserved: 0,
            op_count: 3,
            total_bytes: 1 << 40,
            grant: GrantId::from_bytes([0xA5; GRANT_ID_LEN]),
        };
        assert_eq!(BatchHeader::decode(&h.encode()), h);
        assert!(h.wants_precheck());
        let bytes = encode_reply(9, ReplyStatus::Unknown(77), "hello");
        let r = ReplyHeader::decode(bytes[..REPLY_HEADER_LEN].try_into().unwrap());
        assert_eq!(r, ReplyHeader { batch_id: 9, status: ReplyStatus::Unknown(77), reason_len: 5 });
        assert_eq!(&bytes[REPLY_HEADER_LEN..], b"hello");
    }

    #[test]
    fn the_layout_is_little_endian_at_fixed_offsets() {
        let grant = GrantId::from_bytes(core::array::from_fn(|i| i as u8));
        let h = BatchHeader { batch_id: 1, flags: 2, reserved: 3, op_count: 4, total_bytes: 5, grant };
        let b = h.encode();
        assert_eq!((b[0], b[8], b[12], b[16], b[24]), (1, 2, 3, 4, 5));
        assert_eq!(&b[32..], &grant.to_bytes());
        assert_eq!(&Preamble::current().encode(), b"KVLT\x03\x00\x00\x00");
        let p = [1u8; PREAMBLE_LEN];
        let a = [2u8; ACCEPT_LEN];
        let c = auth_context(&p, &a);
        assert_eq!((&c[..PREAMBLE_LEN], &c[PREAMBLE_LEN..]), (&p[..], &a[..]));
    }

    #[test]
    fn a_preamble_is_accepted_only_for_this_version_known_flags_and_matching_secrets() {
        let answer = |version, flags, secret| Preamble { version, flags }.answer(secret);
        assert_eq!(answer(VERSION, 0, false), AcceptStatus::Accepted);
        assert_eq!(answer(VERSION, FLAG_AUTH, true), AcceptStatus::Accepted);
        assert_eq!(answer(VERSION, 0, true), AcceptStatus::AuthRequired);
        assert_eq!(answer(VERSION, FLAG_AUTH, false), AcceptStatus::AuthUnavailable);
        assert_eq!(answer(VERSION, 4, false), AcceptStatus::UnsupportedFlags);
        assert_eq!(answer(VERSION, FLAG_PAYLOAD_AUTH, false), AcceptStatus::UnsupportedFlags, "tags need a session");
        assert_eq!(answer(VERSION, FLAG_PAYLOAD_AUTH, true), AcceptStatus::UnsupportedFlags);
        assert_eq!(answer(VERSION, FLAG_AUTH | FLAG_PAYLOAD_AUTH, true), AcceptStatus::Accepted);
        let requiring = |flags| Preamble { version: VERSION, flags }.answer_requiring(true, true);
        assert_eq!(requiring(FLAG_AUTH), AcceptStatus::PayloadAuthRequired);
        assert_eq!(requiring(FLAG_AUTH | FLAG_PAYLOAD_AUTH), AcceptStatus::Accepted);
        assert_eq!(requiring(0), AcceptStatus::AuthRequired, "the secret is checked first");
        assert_eq!(answer(1, 0, false), AcceptStatus::UnsupportedVersion, "the version is checked first");
    }

    #[test]
    fn a_batch_header_is_well_formed_with_known_flags_and_no_reserved_bits() {
        let grant = GrantId::from_bytes([1; GRANT_ID_LEN]);
        let h = |flags, reserved| BatchHeader { batch_id: 1, flags, reserved, op_count: 1, total_bytes: 1, grant };
        assert!(h(0, 0).is_well_formed() && h(BATCH_FLAG_PRECHECK, 0).is_well_formed());
        assert!(!h(2, 0).is_well_formed() && !h(0, 1).is_well_formed());
    }

    #[test]
    fn bad_magic_is_reported() {
        let mut b = Preamble::current().encode();
        b[0] = b'X';
        assert_eq!(Preamble::decode(&b), Err(*b"XVLT"));
        let mut a =
            Accept { version: 2, status: AcceptStatus::Accepted, max_ops_per_batch: 1, idle_timeout_ms: 1 }.encode();
        a[3] = b'!';
        assert_eq!(Accept::decode(&a), Err(*b"KVL!"));
    }

    #[test]
    fn reply_reason_is_cut_at_a_char_boundary() {
        let long = "é".repeat(MAX_REASON_LEN);
        let bytes = encode_reply(1, ReplyStatus::Refused, &long);
        let h = ReplyHeader::decode(bytes[..REPLY_HEADER_LEN].try_into().unwrap());
        assert!(h.reason_len as usize <= MAX_REASON_LEN);
        assert_eq!(bytes.len(), REPLY_HEADER_LEN + h.reason_len as usize);
        assert!(std::str::from_utf8(&bytes[REPLY_HEADER_LEN..]).is_ok());
    }
}
