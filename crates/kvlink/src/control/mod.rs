//! The bench control protocol between `kvlink serve` and `kvlink bench
//! --connect`: how the side that drives a two-host bench asks the other host
//! to prefill requests (or to pull them), separate from kvlink's side
//! channel, which it never touches.
//!
//! One TCP connection per session. Each frame is a 4-byte big-endian length
//! and a JSON object, bounded by [`MAX_HANDSHAKE_FRAME_LEN`] until the
//! session is established and by [`MAX_FRAME_LEN`] after. The client sends
//! [`ClientMsg::Hello`] (protocol version, cache shape, block pattern,
//! transport, whether to verify, and its nonce if it holds the shared
//! secret). With a shared secret on both sides, the two prove it to each
//! other before the server does anything else:
//!
//! ```text
//! client → server  hello {.., client_nonce}
//! server → client  challenge {server_nonce, server_proof}
//! client → server  proof {proof}            (after checking server_proof)
//! ```
//!
//! The proofs are [`kv_proto::auth`]'s, for
//! [`kv_proto::auth::Channel::Control`], bound to both nonces and to the
//! hello frame exactly as sent: a proof made for the side channel or a data
//! plane, for another connection, or reflected from the server, is
//! worthless here. A server with a secret refuses a hello without a nonce; a
//! server without one refuses a hello with one; a client with a secret
//! refuses a server that does not prove it.
//!
//! Then the server starts an instance of its role with that shape and
//! answers [`ServerMsg::Welcome`] naming its role and its idle timeout, and
//! the client makes strictly alternating calls, one reply each:
//!
//! | client | server (producer) | server (consumer) |
//! |---|---|---|
//! | `prefill {prompts}` | `prefilled {items: id, params, blocks}` | error |
//! | `drain {timeout_ms}` | `drained {held}` | error |
//! | `schedule {pulls}` | error | `scheduled {blocks}` |
//! | `complete {timeout_ms}` | error | `completions {items}` |
//! | `stats` | `stats {cpu_seconds, peak_rss_bytes}` | same |
//! | `ping` | `pong` | same |
//! | `bye` | `bye`, after its worker shut down | same |
//!
//! A session with no call for the server's idle timeout is ended (a client
//! that waits on its own side meanwhile sends `ping`). Any refusal is
//! `error {message}`, after which the server closes the connection. Peer
//! input is untrusted on both sides: frames are bounded, decoding is
//! fallible, the shape and every request are checked before the server
//! allocates or schedules anything.

mod client;

use std::net::SocketAddr;
use std::time::Duration;

use kv_proto::auth::{Nonce, Proof};
use kv_proto::{BlockId, KvRole, LayoutKind, Protocol, ReqId};
use kv_worker::{CacheDims, CacheShape};
use serde::{Deserialize, Serialize};
use tokio_util::codec::LengthDelimitedCodec;

use crate::blocks::BlockPattern;
use crate::engine::{Completion, PromptSpec};
use crate::stats::ProcessFigures;

pub use client::{ControlClient, PeerStats, RemoteDecode, RemotePrefill};

/// Version of this protocol; both sides must speak the same.
pub const CONTROL_VERSION: u32 = 2;

/// Default port of `kvlink serve`'s control listener.
pub const DEFAULT_CONTROL_PORT: u16 = 18998;

/// Bound on one control frame, either direction.
pub const MAX_FRAME_LEN: usize = 16 * 1024 * 1024;

/// Bound on the requests of one `prefill` or `schedule` call.
pub const MAX_REQUESTS_PER_CALL: usize = 4096;

/// Bound on the blocks per region of a cache a client may ask for.
pub const MAX_BLOCKS: u64 = 1 << 20;

/// Bound on the regions of a cache a client may ask for.
pub const MAX_REGIONS: u32 = 4096;

/// Bound on one frame before the session is established (the hello and the
/// authentication proof are a few hundred bytes): a peer that has not been
/// admitted cannot make the server buffer more.
pub const MAX_HANDSHAKE_FRAME_LEN: usize = 64 * 1024;

/// The codec of an established control connection: length-delimited
/// frames, bounded by [`MAX_FRAME_LEN`].
pub fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder().max_frame_length(MAX_FRAME_LEN).new_codec()
}

/// The codec of a control connection the server has not admitted yet:
/// frames bounded by [`MAX_HANDSHAKE_FRAME_LEN`].
pub fn handshake_codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder().max_frame_length(MAX_HANDSHAKE_FRAME_LEN).new_codec()
}

/// Decodes a frame from a client (peer input: fallible, nothing but the
/// frame's JSON is read). The server reads every message through it.
pub fn decode_client_msg(frame: &[u8]) -> Result<ClientMsg, serde_json::Error> {
    serde_json::from_slice(frame)
}

/// Decodes a frame from a server (peer input: fallible). The client reads
/// every reply through it.
pub fn decode_server_msg(frame: &[u8]) -> Result<ServerMsg, serde_json::Error> {
    serde_json::from_slice(frame)
}

/// A cache shape as the control protocol carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireShape {
    /// How layers map to regions.
    pub kind: LayoutKind,
    /// Attention layers.
    pub num_layers: u32,
    /// Blocks per region.
    pub num_blocks: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per element.
    pub dtype_bytes: u32,
}

impl From<CacheShape> for WireShape {
    fn from(s: CacheShape) -> Self {
        s.dims().into()
    }
}

impl From<CacheDims> for WireShape {
    fn from(d: CacheDims) -> Self {
        Self {
            kind: d.kind,
            num_layers: d.num_layers,
            num_blocks: d.num_blocks,
            block_size: d.block_size,
            num_kv_heads: d.num_kv_heads,
            head_dim: d.head_dim,
            dtype_bytes: d.dtype_bytes,
        }
    }
}

/// Unchecked: [`check_shape`] makes a [`CacheShape`] of it.
impl From<WireShape> for CacheDims {
    fn from(s: WireShape) -> Self {
        Self {
            kind: s.kind,
            num_layers: s.num_layers,
            num_blocks: s.num_blocks,
            block_size: s.block_size,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            dtype_bytes: s.dtype_bytes,
        }
    }
}

/// A shape that cannot be allocated, or that is over a bound.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// A dimension is zero.
    #[error("the cache shape has no bytes ({0} is 0)")]
    Empty(&'static str),
    /// The sizes overflow.
    #[error(transparent)]
    Overflow(#[from] kv_worker::ShapeError),
    /// Over one of the bounds.
    #[error("the cache shape has {what} {got}, more than the {limit} allowed")]
    OverLimit {
        /// Which figure.
        what: &'static str,
        /// Asked for.
        got: u64,
        /// The bound.
        limit: u64,
    },
}

/// Checks `dims` from a peer or the command line: no zero dimension, within
/// [`MAX_BLOCKS`], [`MAX_REGIONS`] and `max_bytes`, and every size computable
/// ([`CacheShape::try_new`]). Returns the checked shape.
pub fn check_shape(dims: CacheDims, max_bytes: u64) -> Result<CacheShape, ShapeError> {
    for (name, v) in [
        ("layers", u64::from(dims.num_layers)),
        ("num_blocks", dims.num_blocks),
        ("block_size", u64::from(dims.block_size)),
        ("heads", u64::from(dims.num_kv_heads)),
        ("head_dim", u64::from(dims.head_dim)),
        ("dtype_bytes", u64::from(dims.dtype_bytes)),
    ] {
        if v == 0 {
            return Err(ShapeError::Empty(name));
        }
    }
    if dims.num_blocks > MAX_BLOCKS {
        return Err(ShapeError::OverLimit { what: "blocks per region", got: dims.num_blocks, limit: MAX_BLOCKS });
    }
    let shape = CacheShape::try_new(dims)?;
    if shape.region_count() > MAX_REGIONS {
        return Err(ShapeError::OverLimit {
            what: "regions",
            got: u64::from(shape.region_count()),
            limit: u64::from(MAX_REGIONS),
        });
    }
    if shape.total_bytes() > max_bytes {
        return Err(ShapeError::OverLimit { what: "bytes", got: shape.total_bytes(), limit: max_bytes });
    }
    Ok(shape)
}

/// A pull the client asks a consumer server to start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WirePull {
    /// Request id.
    pub id: ReqId,
    /// Prompt length in tokens.
    pub prompt_len: usize,
    /// Seed of its KV pattern (to verify).
    pub seed: u64,
    /// The params prefill returned, as vLLM's dict.
    pub params: serde_json::Value,
    /// Tokens decode already has (block-aligned).
    pub prefix_hit_tokens: usize,
}

/// One prefilled request, as a producer server returns it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefilledItem {
    /// Request id.
    pub id: ReqId,
    /// The params the proxy would hand D, as vLLM's dict.
    pub params: serde_json::Value,
    /// The blocks prefill holds the request in (for the ops count).
    pub blocks: Vec<BlockId>,
}

/// What the client sends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ClientMsg {
    /// Opens the session.
    Hello {
        /// [`CONTROL_VERSION`] of the client.
        version: u32,
        /// The cache both sides allocate.
        shape: WireShape,
        /// Block-id pattern of the server's allocator.
        pattern: BlockPattern,
        /// Data-plane transport.
        protocol: Protocol,
        /// Whether KV is written (P) and checked (D).
        verify: bool,
        /// The client's nonce, when it holds the shared secret (the server
        /// then answers with a challenge).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        client_nonce: Option<Nonce>,
    },
    /// The client's proof of the shared secret, answering a challenge.
    Proof {
        /// Its proof over the transcript.
        proof: Proof,
    },
    /// Producer: prefill these requests in one step.
    Prefill {
        /// The requests.
        prompts: Vec<PromptSpec>,
    },
    /// Producer: wait (bounded) until every held request is freed.
    Drain {
        /// Bound, milliseconds.
        timeout_ms: u64,
    },
    /// Consumer: start these pulls in one step.
    Schedule {
        /// The pulls.
        pulls: Vec<WirePull>,
    },
    /// Consumer: the engine has seen these requests and will pull them
    /// later (its worker renews P's hold on them until then).
    Watch {
        /// The pulls to come.
        pulls: Vec<WirePull>,
    },
    /// Consumer: wait (bounded) for pulls to finish.
    Complete {
        /// Bound, milliseconds.
        timeout_ms: u64,
    },
    /// The server's process figures.
    Stats,
    /// Keeps the session alive while the client waits on its own side.
    Ping,
    /// Ends the session.
    Bye,
}

/// What the server answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMsg {
    /// The server holds the shared secret: it proves it, and asks the
    /// client to.
    Challenge {
        /// The server's nonce.
        server_nonce: Nonce,
        /// The server's proof over the transcript.
        server_proof: Proof,
    },
    /// Hello accepted; the server's instance is up.
    Welcome {
        /// [`CONTROL_VERSION`] of the server.
        version: u32,
        /// The server's role: the client runs the other one.
        role: KvRole,
        /// The server ends a session with no call for this long, milliseconds.
        idle_timeout_ms: u64,
    },
    /// Reply to `prefill`, one item per prompt, in order.
    Prefilled {
        /// The requests.
        items: Vec<PrefilledItem>,
    },
    /// Reply to `drain`.
    Drained {
        /// Requests still held.
        held: usize,
    },
    /// Reply to `schedule`: decode's blocks per pull, in order.
    Scheduled {
        /// Blocks per pull.
        blocks: Vec<Vec<BlockId>>,
    },
    /// Reply to `watch`.
    Watching {
        /// Requests now watched.
        requests: usize,
    },
    /// Reply to `complete` (possibly empty).
    Completions {
        /// What finished.
        items: Vec<Completion>,
    },
    /// Reply to `stats`.
    Stats {
        /// Process CPU seconds (user + system) so far.
        cpu_seconds: f64,
        /// Peak resident set of the process, bytes.
        peak_rss_bytes: u64,
        /// What the process holds now (absent from older servers).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        figures: Option<ProcessFigures>,
    },
    /// Reply to `ping`.
    Pong,
    /// Reply to `bye`: the session's worker is shut down.
    Bye,
    /// A refusal; the server closes the connection after it.
    Error {
        /// Why, one line.
        message: String,
    },
}

impl ServerMsg {
    fn kind(&self) -> &'static str {
        match self {
            ServerMsg::Challenge { .. } => "challenge",
            ServerMsg::Welcome { .. } => "welcome",
            ServerMsg::Prefilled { .. } => "prefilled",
            ServerMsg::Drained { .. } => "drained",
            ServerMsg::Scheduled { .. } => "scheduled",
            ServerMsg::Watching { .. } => "watching",
            ServerMsg::Completions { .. } => "completions",
            ServerMsg::Stats { .. } => "stats",
            ServerMsg::Pong => "pong",
            ServerMsg::Bye => "bye",
            ServerMsg::Error { .. } => "error",
        }
    }
}

/// Why the client side of a session failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The address does not parse or resolve.
    #[error("cannot resolve {target}: {reason}")]
    Resolve {
        /// As given.
        target: String,
        /// Why.
        reason: String,
    },
    /// Nothing answers there.
    #[error("cannot reach kvlink serve at {target}: {error}")]
    Unreachable {
        /// As given.
        target: String,
        /// Why (in the message, so not a `source`: one line either way).
        error: std::io::Error,
    },
    /// Connecting took too long.
    #[error("cannot reach kvlink serve at {target}: no answer within {after:?}")]
    ConnectTimeout {
        /// As given.
        target: String,
        /// The bound.
        after: Duration,
    },
    /// A call got no reply in time.
    #[error("kvlink serve at {peer} did not answer {call} within {after:?}")]
    Timeout {
        /// The server.
        peer: SocketAddr,
        /// Which call.
        call: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The server closed the connection.
    #[error("kvlink serve at {peer} closed the control connection")]
    Closed {
        /// The server.
        peer: SocketAddr,
    },
    /// The server closed the connection before welcoming this client.
    #[error(
        "kvlink serve at {peer} closed the connection before a welcome \
         (too many clients connecting at once, or not a kvlink serve control port?)"
    )]
    ClosedEarly {
        /// The server.
        peer: SocketAddr,
    },
    /// A socket error.
    #[error("control connection to {peer}: {error}")]
    Io {
        /// The server.
        peer: SocketAddr,
        /// Why (in the message, so not a `source`: one line either way).
        error: std::io::Error,
    },
    /// The reply is not one this client can read.
    #[error("{peer} sent a reply this client cannot read ({reason}); is it a kvlink serve control port?")]
    BadReply {
        /// The server.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
    /// The shared-secret exchange failed on this side (the server did not
    /// prove the secret, or this side has no randomness for a nonce).
    #[error("kvlink serve at {peer}: {reason}")]
    Auth {
        /// The server.
        peer: SocketAddr,
        /// Why, one line.
        reason: String,
    },
    /// The server refused (its message says why).
    #[error("kvlink serve at {peer} refused: {message}")]
    Refused {
        /// The server.
        peer: SocketAddr,
        /// The server's reason.
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> CacheDims {
        CacheDims {
            kind: LayoutKind::SplitKv,
            num_layers: 2,
            num_blocks: 10,
            block_size: 16,
            num_kv_heads: 1,
            head_dim: 64,
            dtype_bytes: 2,
        }
    }

    #[test]
    fn shape_check_counts_bytes_and_refuses_what_it_cannot_hold() {
        assert_eq!(check_shape(shape(), u64::MAX).map(|s| s.total_bytes()), Ok(4 * 10 * 2048));
        assert_eq!(check_shape(CacheDims { head_dim: 0, ..shape() }, u64::MAX), Err(ShapeError::Empty("head_dim")));
        let huge = CacheDims { num_layers: u32::MAX, num_kv_heads: u32::MAX, head_dim: u32::MAX, ..shape() };
        assert!(check_shape(huge, u64::MAX).is_err());
        let wide = CacheDims { num_kv_heads: u32::MAX, head_dim: u32::MAX, dtype_bytes: u32::MAX, ..shape() };
        assert!(matches!(check_shape(wide, u64::MAX), Err(ShapeError::Overflow(_))));
        assert!(matches!(check_shape(shape(), 1000), Err(ShapeError::OverLimit { what: "bytes", .. })));
        let many = CacheDims { num_blocks: MAX_BLOCKS + 1, ..shape() };
        assert!(matches!(check_shape(many, u64::MAX), Err(ShapeError::OverLimit { .. })));
    }

    #[test]
    fn messages_round_trip_and_garbage_is_an_error() {
        let hello = ClientMsg::Hello {
            version: CONTROL_VERSION,
            shape: shape().into(),
            pattern: BlockPattern::Random,
            protocol: Protocol::Tcp,
            verify: true,
            client_nonce: Some([7; 32]),
        };
        let text = serde_json::to_vec(&hello).unwrap();
        assert_eq!(serde_json::from_slice::<ClientMsg>(&text).unwrap(), hello);
        let reply = ServerMsg::Completions {
            items: vec![Completion::Received {
                id: ReqId::new("r"),
                blocks: 3,
                verified: true,
                latency: Duration::from_micros(1500),
            }],
        };
        let text = serde_json::to_vec(&reply).unwrap();
        assert_eq!(serde_json::from_slice::<ServerMsg>(&text).unwrap(), reply);
        for garbage in [
            &b"{}"[..],
            b"[1,2]",
            b"{\"type\":\"prefill\"}",
            b"\xff\x00",
            b"{\"type\":\"hello\",\"version\":-1}",
            b"{\"type\":\"proof\",\"proof\":[1,2,3]}",
            b"{\"type\":\"proof\",\"proof\":\"not bytes\"}",
        ] {
            assert!(serde_json::from_slice::<ClientMsg>(garbage).is_err(), "{garbage:?}");
        }
    }
}
