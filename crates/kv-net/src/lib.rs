//! The tokio-level network code that more than one kvlink transport or
//! listener needs, written once: it sits between kv-proto (sans-IO, no
//! runtime) and the transports, which may depend on kv-proto and on this
//! crate only.
//!
//! What lives here: [`Admission`], the one accept loop step of every
//! listener (handshake places, throttled logging, backoff); [`RefusalLog`],
//! the one rate limit on the log lines a peer can provoke, which every
//! listener's logging of refusals and faults goes through;
//! [`EstablishedPlaces`], a listener's places for connections past their
//! handshake, with the one line about a peer refused one;
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
//! their one [`WireError`]; [`advertised_address`], what a listener
//! tells its peers to use; [`issue_grant`] / [`revoke_grant`], a
//! transport's grants when its registered memory alone holds them; and the
//! defaults every data plane's config starts from
//! ([`DEFAULT_CONNECT_TIMEOUT`] and the like).
//!
//! What this crate must never do: depend on a transport, on kv-sched, on
//! kv-worker or on kvlink; own a socket (callers own theirs and lend them to
//! the I/O helpers); wait without a bound the caller gives.

mod accept;
mod address;
mod budget;
mod defaults;
mod established;
mod grants;
pub mod http;
mod io;
mod limits;
mod listener;
mod receive;
mod throttle;

pub use accept::{Admission, ACCEPT_BACKOFF};
pub use address::advertised_address;
pub use budget::{
    OpListBudget, OpListLimits, Share, DEFAULT_MAX_OPS_PER_BATCH, DEFAULT_OP_LIST_BUDGET, DEFAULT_OP_LIST_TIMEOUT,
    DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
};
pub use defaults::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_IO_TIMEOUT, DEFAULT_LISTEN_ADDR};
pub use established::EstablishedPlaces;
pub use grants::{issue_grant, revoke_grant};
pub use io::{read_exact, write_all, WireError};
pub use limits::{ListenerLimits, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_CONNECTIONS};
pub use listener::{DataListener, PeerLog};
pub use receive::{carry_out, Carried};
pub use throttle::{RefusalLog, LOG_INTERVAL};
