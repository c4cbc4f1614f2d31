//! Fresh random bytes from the operating system, for nonces and grant ids.
//!
//! The one call of this crate outside plain computation: it reads no clock,
//! no file and no socket, and fails (never weakens) when the OS source does.

/// `N` random bytes, or `None` if the OS random source fails.
pub fn array<const N: usize>() -> Option<[u8; N]> {
    let mut bytes = [0u8; N];
    getrandom::getrandom(&mut bytes).ok()?;
    Some(bytes)
}
