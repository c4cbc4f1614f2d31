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

use bytes::{Buf, BufMut, BytesMut};

use crate::codec::{self, CodecError};
use crate::wire::SideMessage;

/// The four bytes every side-channel frame starts with.
pub const FRAME_MAGIC: [u8; 4] = *b"KVLK";
/// The side-channel protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 4;
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
        let mut body = Vec::with_capacity(256);
        codec::encode_into(msg, &mut body)?;
        if body.len() > self.max_frame_len {
            return Err(FrameError::TooLarge { len: body.len(), max: self.max_frame_len });
        }
        dst.reserve(FRAME_HEADER_LEN + body.len());
        dst.put_slice(&FRAME_MAGIC);
        dst.put_u16(PROTOCOL_VERSION);
        dst.put_u16(0);
        // `max_frame_len` is capped at u32::MAX, so this cannot truncate.
        dst.put_u32(body.len() as u32);
        dst.put_slice(&body);
        Ok(())
    }

    /// Takes one complete frame off the front of `src`. `Ok(None)` means more
    /// bytes are needed; an error means the stream is unusable and the
    /// connection should be closed.
    pub fn decode(&self, src: &mut BytesMut) -> Result<Option<SideMessage>, FrameError> {
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
        if src.len() < FRAME_HEADER_LEN + len {
            src.reserve(FRAME_HEADER_LEN + len - src.len());
            return Ok(None);
        }
        src.advance(FRAME_HEADER_LEN);
        let body = src.split_to(len);
        Ok(Some(codec::decode(&body)?))
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
