//! The side channel: TCP, framed by `kv_proto::FrameCodec`. P serves it
//! (`server`), D connects to it (`client`).

pub(crate) mod client;
mod codec;
mod counts;
mod reuse;
pub(crate) mod server;

pub use codec::{SideChannelCodec, SideChannelError};
pub(crate) use counts::{Counts, OpenConnection};

/// How P's refusal of an incompatible decode instance begins (D counts it
/// under `incompatible_peer`).
pub(crate) const INCOMPATIBLE: &str = "incompatible peers";
