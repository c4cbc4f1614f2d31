//! The tokio-level network code that more than one kvlink transport or
//! listener needs, written once: it sits between kv-proto (sans-IO, no
//! runtime) and the transports, which may depend on kv-proto and on this
//! crate only.
//!
//! What lives here: [`Admission`], the one accept loop step of every
//! listener (handshake places, throttled logging, backoff), and
//! [`OpListBudget`], the one budget for the op lists all incoming
//! connections (TCP) or streams (QUIC) of a transport hold, with bounded
//! waits for room.
//!
//! What this crate must never do: depend on a transport, on kv-sched, on
//! kv-worker or on kvlink; read or write a socket itself (callers move the
//! bytes); wait without a bound the caller gives.

mod accept;
mod budget;

pub use accept::{Admission, ACCEPT_BACKOFF, LOG_INTERVAL};
pub use budget::{NoRoom, OpListBudget, Share};
