//! Cases about a transport's listener, written once for every network
//! transport that has one: admission of incoming connections
//! ([`admission`]), one op-list budget for all unauthenticated peers
//! ([`op_budget`]), failed proofs of the shared secret counted on the
//! side that saw them ([`proofs`]), and refused batches counted by reason
//! ([`refusals`]).
//!
//! A transport's tests implement [`Listener`] (and the trait of each module
//! they run) over their own raw clients, which speak that transport's wire
//! by hand; the cases hold the logic and every assertion, so a case added
//! or tightened here does so for every transport.

pub mod admission;
pub mod op_budget;
pub mod proofs;
pub mod refusals;

use std::future::Future;
use std::net::Ipv4Addr;
use std::time::Duration;

use kv_proto::{BatchWriter, TransportError};

use crate::Node;

/// Upper bound on any single wait of these cases (never reached when
/// things work).
pub const BOUND: Duration = Duration::from_secs(20);

/// The secret a case's receiver holds when it holds one.
pub const SECRET: &str = "the data-plane secret";

/// Where hostile connections come from (any of 127.0.0.0/8 is a host of its
/// own to the receiver); honest senders come from 127.0.0.1.
pub const HOSTILE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

/// Waits (at most [`BOUND`]) until the op-list bytes a receiver holds,
/// read by `used`, are `wanted`; panics naming `what` (and the bytes
/// charged) if they never are.
async fn budget_reaches(used: impl Fn() -> u64, wanted: impl Fn(u64) -> bool, what: &str) {
    let deadline = tokio::time::Instant::now() + BOUND;
    while !wanted(used()) {
        assert!(tokio::time::Instant::now() < deadline, "{what}: {} bytes charged", used());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A network transport whose listener the cases attack.
pub trait Listener {
    /// The transport under test.
    type Transport: BatchWriter + 'static;

    /// A transport with its default configuration but `secret`, with a
    /// registered buffer of `len` bytes: an honest peer.
    fn node(&self, secret: Option<&str>, len: usize) -> impl Future<Output = Node<Self::Transport>>;
}

/// An honest sender (from 127.0.0.1, holding `secret`) writes a patterned
/// batch into the start of `victim`'s buffer; see [`crate::write_batch`].
pub async fn honest_batch<L: Listener>(
    listener: &L,
    victim: &Node<L::Transport>,
    secret: Option<&str>,
) -> Result<(), TransportError> {
    let mut sender = listener.node(secret, 1 << 16).await;
    crate::write_batch(&mut sender, victim, 0, BOUND).await
}
