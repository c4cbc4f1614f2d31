//! The tokio-level network code that more than one kvlink transport or
//! listener needs, written once: it sits between kv-proto (sans-IO, no
//! runtime) and the transports, which may depend on kv-proto and on this
//! crate only.
//!
//! What lives here: [`Admission`], the one accept loop step of every
//! listener (handshake places, throttled logging, backoff);
//! [`ListenerLimits`], the bounds on a listener's connections every data
//! plane's config embeds; [`OpListBudget`], the one budget for the op lists
//! all incoming connections (TCP) or streams (QUIC) of a transport hold,
//! with bounded waits for room, and its defaults; and [`read_exact`] /
//! [`write_all`], the bounded reads and writes over any tokio stream, with
//! their one [`WireError`].
//!
//! What this crate must never do: depend on a transport, on kv-sched, on
//! kv-worker or on kvlink; own a socket (callers own theirs and lend them to
//! the I/O helpers); wait without a bound the caller gives.

mod accept;
mod budget;
mod io;
mod limits;

pub use accept::{Admission, ACCEPT_BACKOFF, LOG_INTERVAL};
pub use budget::{
    budget_in_force, max_ops_in_force, NoRoom, OpListBudget, Share, DEFAULT_MAX_OPS_PER_BATCH, DEFAULT_OP_LIST_BUDGET,
    DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
};
pub use io::{read_exact, write_all, WireError};
pub use limits::{ListenerLimits, DEFAULT_MAX_CONNECTIONS};
