//! tokio-util adapter around the sans-IO frame codec.

use bytes::BytesMut;
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

/// [`FrameCodec`] as a tokio-util codec.
#[derive(Clone, Copy, Debug, Default)]
pub struct SideChannelCodec(pub FrameCodec);

impl Decoder for SideChannelCodec {
    type Item = SideMessage;
    type Error = SideChannelError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<SideMessage>, SideChannelError> {
        Ok(self.0.decode(src)?)
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<SideMessage>, SideChannelError> {
        Ok(self.0.decode_eof(src)?)
    }
}

impl Encoder<SideMessage> for SideChannelCodec {
    type Error = SideChannelError;

    fn encode(&mut self, item: SideMessage, dst: &mut BytesMut) -> Result<(), SideChannelError> {
        Ok(self.0.encode(&item, dst)?)
    }
}
