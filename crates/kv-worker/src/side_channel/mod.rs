//! The side channel: TCP, framed by `kv_proto::FrameCodec`. P serves it
//! (`server`), D connects to it (`client`).

pub(crate) mod client;
mod codec;
pub(crate) mod server;

pub use codec::{SideChannelCodec, SideChannelError};
