//! The control channel: the handshake's TCP connection stays open after the
//! queue pairs are connected and carries the sender's "open grant" requests
//! and the receiver's answers. Pure encoding and bounded, fallible decoding,
//! plus the two async reads (one request, one reply) the transport uses.
//!
//! # Wire format
//!
//! All integers little-endian.
//!
//! ```text
//! request (sender → receiver, 24 bytes)
//!  0      4         6    8          24
//!  | KVRG | version | op | grant id |
//!           u16       u16  16 bytes    op 1: open the grant on this connection
//!
//! reply (receiver → sender)
//!  0      4         6        8       12
//!  | KVRG | version | status | count | body
//!           u16       u16      u32
//!  status 0 (windows): count windows follow, 20 bytes each:
//!                      addr u64 | len u64 | rkey u32
//!  status 1 (refused): count bytes of UTF-8 reason follow (no live grant:
//!                      unknown, revoked or expired; or too many ranges)
//!  status 2 (closed):  the receiver is shut down; count bytes of reason
//!  status 3 (failed):  the receiver could not bind the windows; count bytes
//!                      of reason; it closes the connection after the reply
//!  status 4 (progress): no body; count windows are ready so far. Not an
//!                      answer: the answer follows (binding a large grant
//!                      takes a while, and each progress frame restarts the
//!                      sender's wait, as progress does for every wait)
//! ```
//!
//! A reply's count is checked against [`ControlLimits`] before anything past
//! the header is read: at most `max_windows` windows, at most
//! [`MAX_REASON_LEN`] bytes of reason. Windows must be non-empty, must not
//! wrap and must not overlap.
//!
//! When both sides proved the shared secret in the opening, every request,
//! reply and progress frame is followed by its 16-byte tag
//! ([`crate::tags`]); a reader checks it before it decodes the frame (only
//! a reply's count is checked first, against the limits, to bound what is
//! read), and a frame that fails it ends the connection.

use kv_proto::session::BadTag;
use kv_proto::GrantId;
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::region::{RegionTable, RegionTableError, RemoteRegion};
use crate::tags::{FrameTags, TagFailure};

/// First bytes of every control message.
pub const MAGIC: [u8; 4] = *b"KVRG";
/// The control wire version this build speaks.
pub const VERSION: u16 = 1;
/// Bytes of a request.
pub const REQUEST_LEN: usize = 24;
/// Bytes of a reply before its body.
pub const REPLY_HEADER_LEN: usize = 12;
/// Bytes per window in a reply.
pub const WINDOW_LEN: usize = 20;
/// Most bytes of a reason in a reply.
pub const MAX_REASON_LEN: usize = 1024;
/// Bytes of a reply's body read (and buffered) per step.
pub const BODY_CHUNK: usize = 64 * 1024;

const OP_OPEN: u16 = 1;
const STATUS_WINDOWS: u16 = 0;
const STATUS_REFUSED: u16 = 1;
const STATUS_CLOSED: u16 = 2;
const STATUS_FAILED: u16 = 3;
const STATUS_PROGRESS: u16 = 4;

/// A sender's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Bind the grant's windows on this connection's queue pair (or name
    /// the ones already bound there) and send them.
    Open(GrantId),
}

/// A receiver's answer to [`Request::Open`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The grant's windows on this connection: the sender may write inside
    /// them, each with its own key, and nowhere else.
    Windows(RegionTable<RemoteRegion>),
    /// No live grant of that id (never issued, revoked or expired), or one
    /// the receiver will not open; nothing was bound.
    Refused(String),
    /// The receiver is shut down.
    Closed(String),
    /// The receiver could not bind the windows; it closes the connection.
    Failed(String),
    /// Not an answer yet: this many windows are ready; the answer follows.
    Progress(u32),
}

/// Bounds on what a peer's reply may make us read and allocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlLimits {
    /// Most windows accepted in one reply (20 bytes each).
    pub max_windows: u32,
}

/// Why a control message was refused or could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Not a kvlink control message.
    #[error("not a kvlink RDMA control message (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// A version this build does not speak.
    #[error("control version {got} is not supported (this side speaks {supported})")]
    UnsupportedVersion {
        /// The peer's version.
        got: u16,
        /// Ours.
        supported: u16,
    },
    /// A request op this build does not know.
    #[error("unknown control request op {0}")]
    UnknownOp(u16),
    /// A reply status this build does not know.
    #[error("unknown control reply status {0}")]
    UnknownStatus(u16),
    /// More windows than [`ControlLimits::max_windows`].
    #[error("{count} windows exceed the limit of {max}")]
    TooManyWindows {
        /// Windows announced (or given to encode).
        count: u64,
        /// The limit.
        max: u32,
    },
    /// A reason longer than [`MAX_REASON_LEN`].
    #[error("a reason of {0} bytes exceeds {MAX_REASON_LEN}")]
    ReasonTooLong(u64),
    /// A reason that is not UTF-8.
    #[error("the reason is not UTF-8")]
    BadReason,
    /// Empty, wrapping or overlapping windows.
    #[error("bad window list: {0}")]
    BadWindows(#[from] RegionTableError),
    /// The message ended early.
    #[error("control message truncated: {needed} bytes needed, {got} present")]
    Truncated {
        /// Bytes the message needs.
        needed: usize,
        /// Bytes there were.
        got: usize,
    },
    /// The peer closed the connection in the middle of a message.
    #[error("the peer closed the control connection")]
    PeerClosed,
    /// The message's tag does not match: it was altered or injected after
    /// the opening.
    #[error("rdma control {0}")]
    BadTag(#[from] BadTag),
    /// The connection failed.
    #[error("control connection I/O failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Appends the bytes of `request` to `out`.
pub fn encode_request(request: &Request, out: &mut Vec<u8>) {
    let Request::Open(grant) = request;
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&OP_OPEN.to_le_bytes());
    out.extend_from_slice(&grant.to_bytes());
}

/// Decodes one request of exactly [`REQUEST_LEN`] bytes.
pub fn decode_request(bytes: &[u8]) -> Result<Request, ControlError> {
    if bytes.len() != REQUEST_LEN {
        return Err(ControlError::Truncated { needed: REQUEST_LEN, got: bytes.len() });
    }
    let mut reader = Reader { bytes, at: 0 };
    check_magic_and_version(&mut reader)?;
    let op = u16::from_le_bytes(reader.array()?);
    if op != OP_OPEN {
        return Err(ControlError::UnknownOp(op));
    }
    Ok(Request::Open(GrantId::from_bytes(reader.array()?)))
}

/// Appends the bytes of `reply` to `out`. Refuses what the peer would
/// refuse; a reason is cut to [`MAX_REASON_LEN`] bytes (at a character
/// boundary) rather than refused.
pub fn encode_reply(reply: &Reply, limits: &ControlLimits, out: &mut Vec<u8>) -> Result<(), ControlError> {
    let (status, reason) = match reply {
        Reply::Windows(windows) => {
            let windows = windows.regions();
            let count = window_count(windows.len() as u64, limits)?;
            out.reserve(REPLY_HEADER_LEN + windows.len() * WINDOW_LEN);
            header(out, STATUS_WINDOWS, count);
            for window in windows {
                out.extend_from_slice(&window.addr.to_le_bytes());
                out.extend_from_slice(&window.len.to_le_bytes());
                out.extend_from_slice(&window.rkey.to_le_bytes());
            }
            return Ok(());
        }
        Reply::Refused(reason) => (STATUS_REFUSED, reason),
        Reply::Closed(reason) => (STATUS_CLOSED, reason),
        Reply::Failed(reason) => (STATUS_FAILED, reason),
        Reply::Progress(ready) => {
            header(out, STATUS_PROGRESS, *ready);
            return Ok(());
        }
    };
    let reason = truncate(reason, MAX_REASON_LEN);
    // At most MAX_REASON_LEN: fits.
    header(out, status, reason.len() as u32);
    out.extend_from_slice(reason.as_bytes());
    Ok(())
}

/// The checked header of a reply: what the body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyHeader {
    status: u16,
    count: u32,
}

impl ReplyHeader {
    /// Bytes of the body that follows the header.
    pub fn body_len(&self) -> usize {
        match self.status {
            STATUS_WINDOWS => self.count as usize * WINDOW_LEN,
            STATUS_PROGRESS => 0,
            _ => self.count as usize,
        }
    }
}

/// Decodes and checks the first [`REPLY_HEADER_LEN`] bytes of a reply
/// (the count against `limits`).
pub fn decode_reply_header(bytes: &[u8], limits: &ControlLimits) -> Result<ReplyHeader, ControlError> {
    let mut reader = Reader { bytes, at: 0 };
    check_magic_and_version(&mut reader)?;
    let status = u16::from_le_bytes(reader.array()?);
    let count = u32::from_le_bytes(reader.array()?);
    match status {
        STATUS_WINDOWS => {
            window_count(u64::from(count), limits)?;
        }
        STATUS_REFUSED | STATUS_CLOSED | STATUS_FAILED => {
            if count as usize > MAX_REASON_LEN {
                return Err(ControlError::ReasonTooLong(u64::from(count)));
            }
        }
        STATUS_PROGRESS => {}
        other => return Err(ControlError::UnknownStatus(other)),
    }
    Ok(ReplyHeader { status, count })
}

/// Decodes one whole reply; `bytes` must hold exactly that reply.
pub fn decode_reply(bytes: &[u8], limits: &ControlLimits) -> Result<Reply, ControlError> {
    let header = decode_reply_header(bytes, limits)?;
    let needed = REPLY_HEADER_LEN + header.body_len();
    if bytes.len() != needed {
        return Err(ControlError::Truncated { needed, got: bytes.len() });
    }
    let body = &bytes[REPLY_HEADER_LEN..];
    if header.status == STATUS_PROGRESS {
        return Ok(Reply::Progress(header.count));
    }
    if header.status != STATUS_WINDOWS {
        let reason = std::str::from_utf8(body).map_err(|_| ControlError::BadReason)?.to_owned();
        return Ok(match header.status {
            STATUS_REFUSED => Reply::Refused(reason),
            STATUS_CLOSED => Reply::Closed(reason),
            _ => Reply::Failed(reason),
        });
    }
    let mut reader = Reader { bytes: body, at: 0 };
    let mut windows = Vec::with_capacity(header.count as usize);
    for _ in 0..header.count {
        let addr = u64::from_le_bytes(reader.array()?);
        let len = u64::from_le_bytes(reader.array()?);
        let rkey = u32::from_le_bytes(reader.array()?);
        windows.push(RemoteRegion { addr, len, rkey });
    }
    Ok(Reply::Windows(RegionTable::new(windows)?))
}

/// Reads one request and its tag (see [`crate::tags`]); `Ok(None)` if the
/// peer closed the connection cleanly before its first byte.
pub async fn read_request<R: AsyncRead + Unpin>(
    reader: &mut R,
    tags: &mut FrameTags,
) -> Result<Option<Request>, ControlError> {
    let mut bytes = [0u8; REQUEST_LEN];
    let first = reader.read(&mut bytes).await?;
    if first == 0 {
        return Ok(None);
    }
    read_exact(reader, &mut bytes[first..]).await?;
    check_tag(reader, tags, &bytes).await?;
    decode_request(&bytes).map(Some)
}

/// Reads the tag that follows `frame` and checks it.
async fn check_tag<R: AsyncRead + Unpin>(
    reader: &mut R,
    tags: &mut FrameTags,
    frame: &[u8],
) -> Result<(), ControlError> {
    tags.read_and_check(reader, &[frame]).await.map_err(|failure| match failure {
        TagFailure::Read(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => ControlError::PeerClosed,
        TagFailure::Read(err) => ControlError::Io(err),
        TagFailure::Bad(bad) => ControlError::BadTag(bad),
    })
}

/// Reads one reply and its tag: the header first, so the count is checked
/// against `limits` before the body is read; the body is then buffered as
/// it arrives (at most [`BODY_CHUNK`] bytes ahead of it), so a count the
/// peer does not follow with its bytes costs no memory; the tag is checked
/// before the reply is decoded.
pub async fn read_reply<R: AsyncRead + Unpin>(
    reader: &mut R,
    limits: &ControlLimits,
    tags: &mut FrameTags,
) -> Result<Reply, ControlError> {
    let mut message = vec![0u8; REPLY_HEADER_LEN];
    read_exact(reader, &mut message).await?;
    let header = decode_reply_header(&message, limits)?;
    let len = REPLY_HEADER_LEN + header.body_len();
    while message.len() < len {
        let start = message.len();
        message.resize(start + (len - start).min(BODY_CHUNK), 0);
        read_exact(reader, &mut message[start..]).await?;
    }
    check_tag(reader, tags, &message).await?;
    decode_reply(&message, limits)
}

async fn read_exact<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut [u8]) -> Result<(), ControlError> {
    match reader.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => Err(ControlError::PeerClosed),
        Err(err) => Err(err.into()),
    }
}

fn header(out: &mut Vec<u8>, status: u16, count: u32) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&status.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
}

fn check_magic_and_version(reader: &mut Reader<'_>) -> Result<(), ControlError> {
    let magic: [u8; 4] = reader.array()?;
    if magic != MAGIC {
        return Err(ControlError::BadMagic(magic));
    }
    let version = u16::from_le_bytes(reader.array()?);
    if version != VERSION {
        return Err(ControlError::UnsupportedVersion { got: version, supported: VERSION });
    }
    Ok(())
}

fn window_count(count: u64, limits: &ControlLimits) -> Result<u32, ControlError> {
    match u32::try_from(count) {
        Ok(count) if count <= limits.max_windows => Ok(count),
        _ => Err(ControlError::TooManyWindows { count, max: limits.max_windows }),
    }
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Reads fixed-size fields, failing (not panicking) past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn array<const N: usize>(&mut self) -> Result<[u8; N], ControlError> {
        let end = self.at + N;
        let field =
            self.bytes.get(self.at..end).ok_or(ControlError::Truncated { needed: end, got: self.bytes.len() })?;
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
    use tokio::io::AsyncWriteExt;

    use super::*;

    fn limits() -> ControlLimits {
        ControlLimits { max_windows: 8 }
    }

    fn windows(count: usize) -> RegionTable<RemoteRegion> {
        RegionTable::new(
            (0..count as u64)
                .map(|i| RemoteRegion {
                    addr: 0x7f00_0000_0000 + i * 0x1_0000,
                    len: 0x8000 + i,
                    rkey: 0x1200 + i as u32,
                })
                .collect(),
        )
        .unwrap()
    }

    fn encoded(reply: &Reply) -> Vec<u8> {
        let mut out = Vec::new();
        encode_reply(reply, &limits(), &mut out).unwrap();
        out
    }

    #[test]
    fn requests_round_trip() {
        let grant = GrantId::from_bytes([7; 16]);
        let mut bytes = Vec::new();
        encode_request(&Request::Open(grant), &mut bytes);
        assert_eq!(bytes.len(), REQUEST_LEN);
        assert_eq!(decode_request(&bytes).unwrap(), Request::Open(grant));
    }

    #[test]
    fn bad_requests_are_refused() {
        let mut bytes = Vec::new();
        encode_request(&Request::Open(GrantId::from_bytes([1; 16])), &mut bytes);
        let patched = |at: usize, patch: &[u8]| {
            let mut bytes = bytes.clone();
            bytes[at..at + patch.len()].copy_from_slice(patch);
            decode_request(&bytes)
        };
        assert!(matches!(patched(0, b"KVRX"), Err(ControlError::BadMagic(_))));
        assert!(matches!(patched(4, &9u16.to_le_bytes()), Err(ControlError::UnsupportedVersion { got: 9, .. })));
        assert!(matches!(patched(6, &2u16.to_le_bytes()), Err(ControlError::UnknownOp(2))));
        assert!(matches!(decode_request(&bytes[..23]), Err(ControlError::Truncated { needed: 24, got: 23 })));
    }

    #[rstest]
    #[case::no_windows(Reply::Windows(windows(0)))]
    #[case::one_window(Reply::Windows(windows(1)))]
    #[case::at_the_limit(Reply::Windows(windows(8)))]
    #[case::refused(Reply::Refused("no live grant has this id".into()))]
    #[case::closed(Reply::Closed(String::new()))]
    #[case::failed(Reply::Failed("bind failed: é".into()))]
    #[case::progress(Reply::Progress(123_456))]
    fn replies_round_trip(#[case] reply: Reply) {
        assert_eq!(decode_reply(&encoded(&reply), &limits()).unwrap(), reply);
    }

    #[test]
    fn a_long_reason_is_cut_at_a_character_boundary() {
        let reason = "é".repeat(MAX_REASON_LEN);
        let Reply::Refused(got) = decode_reply(&encoded(&Reply::Refused(reason)), &limits()).unwrap() else {
            panic!("not a refusal")
        };
        assert!(got.len() <= MAX_REASON_LEN && got.len() >= MAX_REASON_LEN - 1);
        assert!(got.chars().all(|c| c == 'é'));
    }

    #[test]
    fn encode_refuses_what_the_peer_would_refuse() {
        let mut out = Vec::new();
        assert!(matches!(
            encode_reply(&Reply::Windows(windows(9)), &limits(), &mut out),
            Err(ControlError::TooManyWindows { count: 9, max: 8 })
        ));
        assert!(out.is_empty());
    }

    #[test]
    fn a_huge_count_is_refused_from_the_header_alone() {
        let mut header = encoded(&Reply::Windows(windows(0)));
        header[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_reply_header(&header, &limits()),
            Err(ControlError::TooManyWindows { count, max: 8 }) if count == u64::from(u32::MAX)
        ));
        let mut header = encoded(&Reply::Refused(String::new()));
        header[8..12].copy_from_slice(&(MAX_REASON_LEN as u32 + 1).to_le_bytes());
        assert!(matches!(decode_reply_header(&header, &limits()), Err(ControlError::ReasonTooLong(_))));
        header[6..8].copy_from_slice(&5u16.to_le_bytes());
        assert!(matches!(decode_reply_header(&header, &limits()), Err(ControlError::UnknownStatus(5))));
        header[6..8].copy_from_slice(&7u16.to_le_bytes());
        assert!(matches!(decode_reply_header(&header, &limits()), Err(ControlError::UnknownStatus(7))));
    }

    #[rstest]
    #[case::empty_window(REPLY_HEADER_LEN + 8, 0)]
    #[case::wrapping_window(REPLY_HEADER_LEN, u64::MAX)]
    #[case::overlapping_windows(REPLY_HEADER_LEN + WINDOW_LEN, 0x7f00_0000_0001)]
    fn bad_windows_are_refused(#[case] at: usize, #[case] value: u64) {
        let mut bytes = encoded(&Reply::Windows(windows(2)));
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        assert!(matches!(decode_reply(&bytes, &limits()), Err(ControlError::BadWindows(_))));
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        for reply in [Reply::Windows(windows(3)), Reply::Failed("why".into())] {
            let bytes = encoded(&reply);
            for len in 0..bytes.len() {
                assert!(decode_reply(&bytes[..len], &limits()).is_err(), "prefix of {len} bytes");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert!(matches!(decode_reply(&longer, &limits()), Err(ControlError::Truncated { .. })));
        }
    }

    #[test]
    fn a_reason_that_is_not_utf8_is_refused() {
        let mut bytes = encoded(&Reply::Refused("ab".into()));
        bytes[REPLY_HEADER_LEN] = 0xff;
        assert!(matches!(decode_reply(&bytes, &limits()), Err(ControlError::BadReason)));
    }

    #[tokio::test]
    async fn reads_one_message_at_a_time() {
        let (mut a, mut b) = tokio::io::duplex(64);
        let grant = GrantId::from_bytes([3; 16]);
        let reply = Reply::Windows(windows(4));
        let writer = async {
            let mut bytes = Vec::new();
            encode_request(&Request::Open(grant), &mut bytes);
            encode_reply(&reply, &limits(), &mut bytes).unwrap();
            a.write_all(&bytes).await.unwrap();
            drop(a);
        };
        let reader = async {
            let tags = &mut FrameTags::none();
            assert_eq!(read_request(&mut b, tags).await.unwrap(), Some(Request::Open(grant)));
            assert_eq!(read_reply(&mut b, &limits(), tags).await.unwrap(), reply);
            assert!(read_request(&mut b, tags).await.unwrap().is_none(), "a clean end");
        };
        tokio::join!(writer, reader);
    }

    #[tokio::test]
    async fn a_hostile_count_is_refused_before_reading_on() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let mut header = encoded(&Reply::Windows(windows(0)));
        header[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        a.write_all(&header).await.unwrap();
        // The peer sends nothing more and keeps the connection open.
        let result = read_reply(&mut b, &limits(), &mut FrameTags::none()).await;
        assert!(matches!(result, Err(ControlError::TooManyWindows { .. })));
    }

    #[tokio::test]
    async fn a_peer_closing_mid_message_is_an_error() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        a.write_all(&MAGIC).await.unwrap();
        drop(a);
        assert!(matches!(read_request(&mut b, &mut FrameTags::none()).await, Err(ControlError::PeerClosed)));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode_reply(&bytes, &limits());
            let _ = decode_request(&bytes);
        }

        #[test]
        fn arbitrary_bodies_after_a_valid_header_never_panic(
            status in 0u16..5,
            count in 0u32..12,
            tail in prop::collection::vec(any::<u8>(), 0..260),
        ) {
            let mut bytes = encoded(&Reply::Windows(windows(0)));
            bytes[6..8].copy_from_slice(&status.to_le_bytes());
            bytes[8..12].copy_from_slice(&count.to_le_bytes());
            bytes.extend_from_slice(&tail);
            let _ = decode_reply(&bytes, &limits());
        }
    }
}
