//! The tokio-level network code that more than one kvlink transport or
//! listener needs, written once: it sits between kv-proto (sans-IO, no
//! runtime) and the transports, which may depend on kv-proto and on this
//! crate only.
//!
//! What lives here: [`Admission`], the one accept loop step of every
//! listener (handshake places, throttled logging, backoff);
//! [`ListenerLimits`], the bounds on a listener's connections every data
//! plane's config embeds, and [`DataListener`], the places, op-list budget
//! and throttled logs a data plane's listener shares among its connections; [`OpListLimits`], the bounds on the op lists a
//! data plane buffers (ops per batch, budgets, deadline), which TCP's and
//! QUIC's configs embed as `op_lists`, with their defaults and the bounds
//! in force; [`OpListBudget`], the one budget for the op lists all incoming
//! connections (TCP) or streams (QUIC) of a transport hold, with bounded
//! waits for room; [`carry_out`], the steps of kv-proto's batch-receive
//! machine every byte stream takes the same way (reads within the op
//! list's deadline, charges to the budget); and [`read_exact`] /
//! [`write_all`], the bounded reads and writes over any tokio stream, with
//! their one [`WireError`]; and [`advertised_address`], what a listener
//! tells its peers to use.
//!
//! What this crate must never do: depend on a transport, on kv-sched, on
//! kv-worker or on kvlink; own a socket (callers own theirs and lend them to
//! the I/O helpers); wait without a bound the caller gives.

mod accept;
mod address;
mod budget;
mod io;
mod limits;
mod listener;
mod receive;

pub use accept::{Admission, ACCEPT_BACKOFF, LOG_INTERVAL};
pub use address::advertised_address;
pub use budget::{
    OpListBudget, OpListLimits, Share, DEFAULT_MAX_OPS_PER_BATCH, DEFAULT_OP_LIST_BUDGET, DEFAULT_OP_LIST_TIMEOUT,
    DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
};
pub use io::{read_exact, write_all, WireError};
pub use limits::{ListenerLimits, DEFAULT_MAX_CONNECTIONS};
pub use listener::{DataListener, PeerLog};
pub use receive::{carry_out, Carried};
