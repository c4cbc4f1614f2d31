//! Fresh nonces for the side-channel challenge–response.

use kv_proto::auth::Nonce;

/// A nonce from the operating system's random source, or `None` if that
/// source fails (it does not on supported systems): authentication is then
/// refused rather than weakened.
pub(crate) fn fresh() -> Option<Nonce> {
    let mut nonce = [0u8; kv_proto::auth::AUTH_TAG_LEN];
    getrandom::getrandom(&mut nonce).ok()?;
    Some(nonce)
}
