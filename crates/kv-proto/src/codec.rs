//! The one place that knows the side channel's body encoding (bincode 2.0.1,
//! through serde). Swap this module to change the encoding; nothing else in
//! the workspace names bincode.

use serde::{Deserialize, Serialize};

/// Hard bound on what one decode may read, whatever the configured frame
/// limit: a claimed length beyond it is refused before allocating.
pub const MAX_DECODE_BYTES: usize = 256 * 1024 * 1024;

/// A body that could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// Encoding failed (a value serde cannot represent).
    #[error("cannot encode message: {0}")]
    Encode(String),
    /// The bytes are not a valid message.
    #[error("cannot decode message: {0}")]
    Decode(String),
    /// The message ended before the frame did.
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_DECODE_BYTES>()
}

/// Appends the encoding of `value` to `out`.
pub(crate) fn encode_into<T: Serialize>(value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
    bincode::serde::encode_into_std_write(value, out, config()).map(drop).map_err(|e| CodecError::Encode(e.to_string()))
}

/// Decodes exactly one value from `bytes`; trailing bytes are an error.
///
/// Decoding borrows from `bytes`: a claimed string length is checked against
/// the bytes present before anything is allocated for it (the owned decoder
/// allocates what the length prefix claims, up to [`MAX_DECODE_BYTES`],
/// before it finds the bytes missing).
pub(crate) fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, CodecError> {
    let (value, used) =
        bincode::serde::borrow_decode_from_slice(bytes, config()).map_err(|e| CodecError::Decode(e.to_string()))?;
    match bytes.len() - used.min(bytes.len()) {
        0 => Ok(value),
        extra => Err(CodecError::TrailingBytes(extra)),
    }
}
