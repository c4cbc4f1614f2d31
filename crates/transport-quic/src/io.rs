//! The sender's stall bound while its payload flows: QUIC-specific, as it
//! reads the connection's acknowledgement and credit counts. (Bounded reads
//! of a stream are kv-net's `read_exact`, over quinn's `AsyncRead`.)

use std::future::Future;
use std::time::Duration;

use quinn::Connection;

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
