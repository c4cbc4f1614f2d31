//! tokio-util adapter around the sans-IO frame codec.

use bytes::BytesMut;
use kv_proto::session::Session;
use kv_proto::{FrameCodec, FrameError, SideMessage};
use tokio_util::codec::{Decoder, Encoder};

/// A side-channel connection failed.
#[derive(Debug, thiserror::Error)]
pub enum SideChannelError {
    /// Socket error.
    #[error("side-channel I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent a bad frame.
    #[error("side-channel frame: {0}")]
    Frame(#[from] FrameError),
}

/// [`FrameCodec`] as a tokio-util codec; once [`SideChannelCodec::seal`]ed
/// (after an authenticated handshake), every frame it writes carries its
/// tag and every frame it reads must.
#[derive(Clone, Debug, Default)]
pub struct SideChannelCodec {
    frames: FrameCodec,
    session: Option<Box<Session>>,
}

impl SideChannelCodec {
    /// Frames bounded as `frames` says, not (yet) authenticated.
    pub fn new(frames: FrameCodec) -> Self {
        Self { frames, session: None }
    }

    /// Authenticates every frame from now on, in both directions, with the
    /// session keys of this end of the connection.
    pub fn seal(&mut self, session: Session) {
        self.session = Some(Box::new(session));
    }
}

impl Decoder for SideChannelCodec {
    type Item = SideMessage;
    type Error = SideChannelError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<SideMessage>, SideChannelError> {
        Ok(match &mut self.session {
            Some(session) => self.frames.decode_sealed(src, &mut session.recv)?,
            None => self.frames.decode(src)?,
        })
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<SideMessage>, SideChannelError> {
        match self.decode(src)? {
            Some(msg) => Ok(Some(msg)),
            None if src.is_empty() => Ok(None),
            None => Err(FrameError::Truncated { buffered: src.len() }.into()),
        }
    }
}

impl Encoder<SideMessage> for SideChannelCodec {
    type Error = SideChannelError;

    fn encode(&mut self, item: SideMessage, dst: &mut BytesMut) -> Result<(), SideChannelError> {
        match &mut self.session {
            Some(session) => self.frames.encode_sealed(&item, &mut session.send, dst)?,
            None => self.frames.encode(&item, dst)?,
        }
        Ok(())
    }
}
