//! Side-channel framing: `magic | version | reserved | length | body`.
//!
//! ```text
//! 0      4         6          8        12
//! | KVLK | version | reserved | length | body (length bytes, bincode) |
//!          u16 BE    u16 = 0    u32 BE
//! ```
//!
//! Decoding is incremental (for stream readers) and bounded: the length is
//! checked against the configured maximum before a byte of body is buffered.
//!
//! On an authenticated connection every frame after the handshake is
//! followed by its tag ([`crate::session`], over header and body), which is
//! checked before the body is decoded ([`FrameCodec::encode_sealed`],
//! [`FrameCodec::decode_sealed`]); the length field counts the body only.

use bytes::{BufMut, BytesMut};

use crate::codec::{self, CodecError};
use crate::session::{BadTag, FrameAuth, FRAME_TAG_LEN};
use crate::wire::SideMessage;

/// The four bytes every side-channel frame starts with.
pub const FRAME_MAGIC: [u8; 4] = *b"KVLK";
/// The side-channel protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 9;
/// Bytes of the frame header.
pub const FRAME_HEADER_LEN: usize = 12;
/// Default bound on a frame body (16 MiB: a transfer request for thousands
/// of requests of thousands of blocks fits).
pub const DEFAULT_MAX_FRAME_LEN: usize = 16 * 1024 * 1024;

/// A frame that cannot be read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The frame does not start with [`FRAME_MAGIC`].
    #[error("bad magic {got:02x?}, expected {FRAME_MAGIC:02x?} (not a kvlink side channel?)")]
    BadMagic {
        /// The bytes found.
        got: Vec<u8>,
    },
    /// The peer speaks another protocol version.
    #[error("protocol version {got}, this build speaks {PROTOCOL_VERSION}")]
    BadVersion {
        /// The peer's version.
        got: u16,
    },
    /// The reserved header field is not zero.
    #[error("reserved header field is {0:#06x}, expected 0")]
    BadReserved(u16),
    /// The frame is longer than allowed.
    #[error("frame body of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// The announced or produced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame ({buffered} bytes buffered)")]
    Truncated {
        /// Bytes of the partial frame.
        buffered: usize,
    },
    /// The body is not a valid message.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// The frame's tag does not match (altered or injected after the handshake).
    #[error(transparent)]
    BadTag(#[from] BadTag),
}

/// Encoder and incremental decoder of side-channel frames.
#[derive(Clone, Copy, Debug)]
pub struct FrameCodec {
    max_frame_len: usize,
}

impl Default for FrameCodec {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_FRAME_LEN)
    }
}

impl FrameCodec {
    /// A codec refusing bodies longer than `max_frame_len` (capped at
    /// [`crate::MAX_DECODE_BYTES`] and at `u32::MAX`).
    pub fn new(max_frame_len: usize) -> Self {
        let cap = codec::MAX_DECODE_BYTES.min(u32::MAX as usize);
        Self { max_frame_len: max_frame_len.min(cap) }
    }

    /// The body limit in force.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    /// Appends one frame carrying `msg` to `dst`.
    pub fn encode(&self, msg: &SideMessage, dst: &mut BytesMut) -> Result<(), FrameError> {
        self.encode_frame(msg, dst, None)
    }

    /// Appends one frame carrying `msg` to `dst`, followed by its tag under
    /// `auth` (the sending direction of the connection's session).
    pub fn encode_sealed(&self, msg: &SideMessage, auth: &mut FrameAuth, dst: &mut BytesMut) -> Result<(), FrameError> {
        self.encode_frame(msg, dst, Some(auth))
    }

    fn encode_frame(
        &self,
        msg: &SideMessage,
        dst: &mut BytesMut,
        auth: Option<&mut FrameAuth>,
    ) -> Result<(), FrameError> {
        let mut body = Vec::with_capacity(256);
        codec::encode_into(msg, &mut body)?;
        if body.len() > self.max_frame_len {
            return Err(FrameError::TooLarge { len: body.len(), max: self.max_frame_len });
        }
        let mut header = [0u8; FRAME_HEADER_LEN];
        header[..4].copy_from_slice(&FRAME_MAGIC);
        header[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
        // `max_frame_len` is capped at u32::MAX, so this cannot truncate.
        header[8..12].copy_from_slice(&(body.len() as u32).to_be_bytes());
        dst.reserve(FRAME_HEADER_LEN + body.len() + FRAME_TAG_LEN);
        dst.put_slice(&header);
        dst.put_slice(&body);
        if let Some(auth) = auth {
            dst.put_slice(&auth.seal(&[&header, &body]));
        }
        Ok(())
    }

    /// Takes one complete frame off the front of `src`. `Ok(None)` means more
    /// bytes are needed; an error means the stream is unusable and the
    /// connection should be closed.
    pub fn decode(&self, src: &mut BytesMut) -> Result<Option<SideMessage>, FrameError> {
        self.decode_frame(src, None)
    }

    /// Like [`FrameCodec::decode`], for a frame followed by its tag under
    /// `auth` (the receiving direction of the connection's session): the
    /// tag is checked before the body is decoded.
    pub fn decode_sealed(&self, src: &mut BytesMut, auth: &mut FrameAuth) -> Result<Option<SideMessage>, FrameError> {
        self.decode_frame(src, Some(auth))
    }

    fn decode_frame(
        &self,
        src: &mut BytesMut,
        auth: Option<&mut FrameAuth>,
    ) -> Result<Option<SideMessage>, FrameError> {
        let magic_seen = src.len().min(FRAME_MAGIC.len());
        if src[..magic_seen] != FRAME_MAGIC[..magic_seen] {
            return Err(FrameError::BadMagic { got: src[..magic_seen].to_vec() });
        }
        if src.len() < FRAME_HEADER_LEN {
            return Ok(None);
        }
        let version = u16::from_be_bytes([src[4], src[5]]);
        if version != PROTOCOL_VERSION {
            return Err(FrameError::BadVersion { got: version });
        }
        let reserved = u16::from_be_bytes([src[6], src[7]]);
        if reserved != 0 {
            return Err(FrameError::BadReserved(reserved));
        }
        let len = u32::from_be_bytes([src[8], src[9], src[10], src[11]]) as usize;
        if len > self.max_frame_len {
            return Err(FrameError::TooLarge { len, max: self.max_frame_len });
        }
        let tag_len = if auth.is_some() { FRAME_TAG_LEN } else { 0 };
        let whole = FRAME_HEADER_LEN + len + tag_len;
        if src.len() < whole {
            src.reserve(whole - src.len());
            return Ok(None);
        }
        let frame = src.split_to(whole);
        let (header_and_body, tag) = frame.split_at(FRAME_HEADER_LEN + len);
        if let Some(auth) = auth {
            auth.open(&[header_and_body], tag)?;
        }
        Ok(Some(codec::decode(&header_and_body[FRAME_HEADER_LEN..])?))
    }

    /// Like [`FrameCodec::decode`], at end of stream: leftover bytes of a
    /// partial frame are an error.
    pub fn decode_eof(&self, src: &mut BytesMut) -> Result<Option<SideMessage>, FrameError> {
        match self.decode(src)? {
            Some(msg) => Ok(Some(msg)),
            None if src.is_empty() => Ok(None),
            None => Err(FrameError::Truncated { buffered: src.len() }),
        }
    }

    /// Decodes a buffer that must hold exactly one complete frame.
    pub fn decode_exact(&self, bytes: &[u8]) -> Result<SideMessage, FrameError> {
        let mut src = BytesMut::from(bytes);
        match self.decode_eof(&mut src)? {
            Some(msg) if src.is_empty() => Ok(msg),
            Some(_) => Err(FrameError::Codec(CodecError::TrailingBytes(src.len()))),
            None => Err(FrameError::Truncated { buffered: 0 }),
        }
    }
}
