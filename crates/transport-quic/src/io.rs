//! Bounded stream I/O shared by the sender and the receiver.

use std::future::Future;
use std::time::Duration;

use quinn::{Connection, ReadError, RecvStream};

/// Why a bounded read failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    /// No progress within the bound.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was being waited for.
        what: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The peer finished the stream early.
    #[error("stream finished {}while reading {what}", if *.partial { "part-way " } else { "" })]
    Eof {
        /// What was being read.
        what: &'static str,
        /// Whether some of it had arrived.
        partial: bool,
    },
    /// The stream or connection failed.
    #[error("reading {what}: {source}")]
    Read {
        /// What was being read.
        what: &'static str,
        /// The error.
        #[source]
        source: ReadError,
    },
}

/// Fills `buf` from `recv`; each wait for more bytes is bounded by `after`.
pub(crate) async fn read_full(
    recv: &mut RecvStream,
    buf: &mut [u8],
    after: Duration,
    what: &'static str,
) -> Result<(), WireError> {
    let mut off = 0;
    while let Some(rest) = buf.get_mut(off..).filter(|r| !r.is_empty()) {
        match tokio::time::timeout(after, recv.read(rest)).await {
            Err(_) => return Err(WireError::Timeout { what, after }),
            Ok(Err(source)) => return Err(WireError::Read { what, source }),
            Ok(Ok(None)) => return Err(WireError::Eof { what, partial: off > 0 }),
            Ok(Ok(Some(n))) => off += n,
        }
    }
    Ok(())
}

/// A count that grows whenever the peer shows that data this side sent is
/// moving: acknowledgements, flow-control credit, stream slots freed.
///
/// Stream data the peer sends is not counted: it says nothing about this
/// side's payload, and a receiver's replies on other streams must not keep a
/// stalled batch alive.
fn peer_progress(conn: &Connection) -> u64 {
    let rx = conn.stats().frame_rx;
    rx.acks.wrapping_add(rx.max_data).wrapping_add(rx.max_stream_data).wrapping_add(rx.max_streams_bidi)
}

/// Runs `fut` until it completes or `conn` sees no progress from the peer for
/// `after` (then `None`). Progress restarts the clock, so a wait behind a
/// large transfer that is still moving is not cut off. For waits while this
/// side's payload flows; a wait for the peer's answer is bounded absolutely.
pub(crate) async fn until_stalled<F: Future>(conn: &Connection, after: Duration, fut: F) -> Option<F::Output> {
    tokio::pin!(fut);
    let mut seen = peer_progress(conn);
    loop {
        match tokio::time::timeout(after, &mut fut).await {
            Ok(out) => return Some(out),
            Err(_) => {
                let now = peer_progress(conn);
                if now == seen {
                    return None;
                }
                seen = now;
            }
        }
    }
}
