//! Fresh nonces for the connection challenge–response.

use crate::wire::AUTH_TAG_LEN;

/// A nonce from the operating system's random source, or `None` if that
/// source fails: authentication is then refused rather than weakened.
pub(crate) fn fresh() -> Option<[u8; AUTH_TAG_LEN]> {
    let mut nonce = [0u8; AUTH_TAG_LEN];
    getrandom::getrandom(&mut nonce).ok()?;
    Some(nonce)
}
