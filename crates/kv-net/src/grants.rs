//! `BatchWriter::grant` and `revoke` of a transport whose grants live in
//! its [`RegisteredMemory`] alone (the receiver checks every batch against
//! them, no device state to open or fence), written once.

use std::time::{Duration, Instant};

use kv_proto::{Grant, GrantId, MemoryRegion, RegisteredMemory, TransportError};
use tracing::debug;

/// Issues a grant over `ranges` in `memory`, valid for `valid_for` from now.
///
/// # Errors
///
/// What [`RegisteredMemory::grant`] refuses, as a [`TransportError`] (a
/// closed memory is [`TransportError::Shutdown`]).
pub fn issue_grant(
    memory: &RegisteredMemory,
    ranges: &[MemoryRegion],
    valid_for: Duration,
) -> Result<Grant, TransportError> {
    let id = memory.grant(ranges, Instant::now(), valid_for)?;
    debug!(grant = %id, ranges = ranges.len(), ?valid_for, "grant issued");
    Ok(Grant::plain(id))
}

/// Revokes `grant` in `memory`; returns once no access under it is in
/// progress and none can start (the fence). Unknown grants are ignored.
pub fn revoke_grant(memory: &RegisteredMemory, grant: &GrantId) {
    let was_live = memory.revoke(grant);
    debug!(grant = %grant, was_live, "grant revoked");
}
