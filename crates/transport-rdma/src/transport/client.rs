//! The sender's side: one connection (control TCP stream and RC queue pair)
//! per peer, the grants opened on it, and the batch itself: checked whole
//! against the grant's windows, then posted as chained RDMA WRITEs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_net::WireError;
use kv_proto::{Endpoint, Grant, Protocol, TransportError, WriteOp};
use tokio::net::TcpStream;

use super::link::{ChainError, Link};
use super::{lock, server, Shared};
use crate::control::{self, ControlError, Reply, Request};
use crate::details::EndpointDetails;
use crate::fence::GrantCache;
use crate::handshake::opening;
use crate::plan::{plan_batch, Plan, PlanError, WriteSpan};
use crate::region::{LocalRegion, RegionTable, RemoteRegion};
use crate::tags::FrameTags;
use crate::verbs::WcStatus;

/// A grant's windows on one connection, as the planner reads them.
type Windows = Arc<RegionTable<RemoteRegion>>;

/// The connection to each peer address.
#[derive(Debug, Default)]
pub(crate) struct Peers {
    slots: Mutex<HashMap<String, Arc<PeerSlot>>>,
}

impl Peers {
    fn slot(&self, address: &str, idle_timeout: Duration) -> Arc<PeerSlot> {
        let mut slots = lock(&self.slots);
        if let Some(slot) = slots.get(address) {
            return Arc::clone(slot);
        }
        // Forget peers whose connection is gone or idle (restarted receivers
        // on other ports leave such entries behind).
        slots.retain(|_, slot| {
            slot.conn.try_lock().map_or(true, |conn| conn.as_ref().is_some_and(|c| c.usable(idle_timeout)))
        });
        Arc::clone(slots.entry(address.to_owned()).or_default())
    }

    /// Drops every connection (close).
    pub(crate) fn clear(&self) {
        let slots = std::mem::take(&mut *lock(&self.slots));
        for slot in slots.values() {
            if let Ok(mut conn) = slot.conn.try_lock() {
                conn.take();
            }
        }
    }
}

#[derive(Debug, Default)]
struct PeerSlot {
    /// Held while connecting, so concurrent batches to a new peer share one
    /// connection.
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
}

/// One connection to a peer.
#[derive(Debug)]
struct Conn {
    link: Arc<Link>,
    /// The peer transport's instance (from its endpoint details).
    instance: u64,
    control: tokio::sync::Mutex<Control>,
    grants: Mutex<GrantCache<Windows>>,
    last_used: Mutex<Instant>,
}

/// The control stream of a connection and the tags of its frames.
#[derive(Debug)]
struct Control {
    stream: TcpStream,
    tags: FrameTags,
}

impl Conn {
    /// Whether it may carry another batch: its queue pair is alive, it was
    /// used recently, and the peer has not closed the control stream.
    fn usable(&self, idle_timeout: Duration) -> bool {
        if self.link.is_dead() || lock(&self.last_used).elapsed() > idle_timeout {
            return false;
        }
        // In use by another batch: alive as far as anyone knows.
        let Ok(control) = self.control.try_lock() else { return true };
        let mut byte = [0u8; 1];
        // The receiver never speaks unasked: readable means closed (or broken).
        matches!(control.stream.try_read(&mut byte), Err(err) if err.kind() == std::io::ErrorKind::WouldBlock)
    }

    fn touch(&self) {
        *lock(&self.last_used) = Instant::now();
    }
}

/// How an attempt on one connection failed.
enum Failure {
    /// The connection failed before the peer could answer: worth once more
    /// on a new connection if this one was reused (writes are idempotent).
    Retry(TransportError),
    /// The answer stands.
    Final(TransportError),
}

/// Writes `ops` into `peer`'s memory under `grant`.
pub(super) async fn batch_write(
    shared: &Shared,
    peer: &Endpoint,
    grant: &Grant,
    ops: &[WriteOp],
) -> Result<(), TransportError> {
    peer.check_for(Protocol::Rdma)?;
    let label = peer.to_string();
    let details = EndpointDetails::decode(&peer.details)
        .map_err(|err| TransportError::BadEndpoint { peer: label.clone(), reason: err.to_string() })?;
    shared.memory.check_sources(ops)?;
    if ops.is_empty() {
        return Ok(());
    }
    let local = Arc::clone(&shared.registrations().local);
    let slot = shared.peers.slot(&peer.address, shared.config.idle_timeout);
    for attempt in 0..2 {
        let (conn, fresh) = connection(shared, &slot, &peer.address, details.instance, &label).await?;
        let started = Instant::now();
        match write_on(shared, &conn, &label, grant, ops, &local).await {
            Ok(bytes) => {
                conn.touch();
                tracing::trace!(peer = %label, grant = %grant.id, ops = ops.len(), bytes, micros = started.elapsed().as_micros() as u64, "rdma batch written");
                return Ok(());
            }
            Err(Failure::Retry(err)) if !fresh && attempt == 0 => {
                tracing::debug!(peer = %label, grant = %grant.id, error = %err, "rdma: a reused connection failed; once more on a new one");
                discard(&slot, &conn);
            }
            Err(Failure::Retry(err) | Failure::Final(err)) => {
                if conn.link.is_dead() {
                    discard(&slot, &conn);
                }
                tracing::debug!(peer = %label, grant = %grant.id, error = %err, "rdma batch failed");
                return Err(err);
            }
        }
    }
    Err(TransportError::Connect { peer: label, reason: "no connection could be used".to_owned() })
}

/// The connection to `address` (instance `instance`): the cached one if it
/// is still usable, else a new one. The bool says whether it is new.
async fn connection(
    shared: &Shared,
    slot: &PeerSlot,
    address: &str,
    instance: u64,
    label: &str,
) -> Result<(Arc<Conn>, bool), TransportError> {
    let bound = shared.config.connect_timeout * 2;
    let mut guard = tokio::time::timeout(bound, slot.conn.lock()).await.map_err(|_| TransportError::Timeout {
        peer: label.to_owned(),
        what: "another batch's connection attempt",
        after: bound,
    })?;
    if let Some(conn) = guard.as_ref() {
        if conn.instance == instance && conn.usable(shared.config.idle_timeout) {
            return Ok((Arc::clone(conn), false));
        }
        guard.take();
    }
    let conn = Arc::new(connect(shared, address, instance, label).await?);
    *guard = Some(Arc::clone(&conn));
    Ok((conn, true))
}

/// Connects: TCP, handshake, queue pair, all within the connect timeout.
async fn connect(shared: &Shared, address: &str, instance: u64, label: &str) -> Result<Conn, TransportError> {
    let bound = shared.config.connect_timeout;
    let failed = |reason: String| TransportError::Connect { peer: label.to_owned(), reason };
    let mut stream = match tokio::time::timeout(bound, TcpStream::connect(address)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(err)) => return Err(failed(err.to_string())),
        Err(_) => return Err(failed(format!("no connection within {bound:?}"))),
    };
    let opened = async {
        server::tune(&stream);
        let proved = opening::client(&mut stream, shared.config.auth_secret.as_ref()).await;
        if let Err(opening::OpeningError::BadProof) = &proved {
            // The receiver's own proof is wrong: counted here, on this side.
            shared.memory.counters().auth_failed();
        }
        let mut tags = proved.map_err(|e| e.to_string())?;
        let link = server::set_up(shared, &mut stream, false, &mut tags).await?;
        Ok::<_, String>((link, tags))
    };
    let (link, tags) = match tokio::time::timeout(bound, opened).await {
        Ok(Ok(set_up)) => set_up,
        Ok(Err(reason)) => return Err(failed(reason)),
        Err(_) => return Err(failed(format!("no handshake within {bound:?}"))),
    };
    tracing::debug!(peer = %label, link = link.id, "rdma connection up");
    Ok(Conn {
        link,
        instance,
        control: tokio::sync::Mutex::new(Control { stream, tags }),
        grants: Mutex::new(GrantCache::new(shared.config.max_cached_grants)),
        last_used: Mutex::new(Instant::now()),
    })
}

/// Takes `conn` out of its slot (if it is still there) and destroys its
/// queue pair; its control stream closes when the last batch lets go.
fn discard(slot: &PeerSlot, conn: &Arc<Conn>) {
    conn.link.kill();
    if let Ok(mut guard) = slot.conn.try_lock() {
        if guard.as_ref().is_some_and(|current| Arc::ptr_eq(current, conn)) {
            guard.take();
        }
    }
}

/// One attempt on `conn`: the grant's windows (cached, or opened now), the
/// whole batch checked against them and planned, then posted and waited
/// for. Returns the bytes written.
async fn write_on(
    shared: &Shared,
    conn: &Conn,
    label: &str,
    grant: &Grant,
    ops: &[WriteOp],
    local: &RegionTable<LocalRegion>,
) -> Result<u64, Failure> {
    let windows = windows(shared, conn, label, grant).await?;
    let spans = ops.iter().map(|op| WriteSpan { src: op.src, dst: op.dst, len: op.len });
    let mut plan = Plan::default();
    if let Err(err) = plan_batch(local, &windows, &shared.queue, spans, &mut plan) {
        return Err(Failure::Final(match err {
            PlanError::OutsideRemoteRegions { index, dst, len } => TransportError::Refused {
                peer: label.to_owned(),
                reason: format!("op {index}: destination {dst:#x}+{len} is outside grant {}", grant.id),
            },
            PlanError::OutsideLocalRegions { src, len, .. } => TransportError::SourceOutOfBounds { addr: src, len },
        }));
    }
    // The receiver's CPU never sees one-sided writes: the sender refuses a
    // batch that writes the same bytes twice (after the grant check, as a
    // receiver would).
    if let Some(dst) = kv_proto::dataplane::first_overlap(ops.iter().map(|op| (op.dst, op.len))) {
        return Err(Failure::Final(TransportError::Refused {
            peer: label.to_owned(),
            reason: format!("two ops of the batch write the bytes at {dst:#x}"),
        }));
    }
    if plan.writes().is_empty() {
        return Ok(0);
    }
    let io_timeout = shared.config.io_timeout;
    let count = plan.writes().len();
    let result = conn.link.run(count, io_timeout, |qp, range, seq| qp.post_writes(&plan, range, seq)).await;
    let peer = label.to_owned();
    match result {
        Ok(()) => Ok(plan.total_bytes()),
        Err(ChainError::Failed { index: Some(0), status: WcStatus::RemoteAccessError, .. }) => {
            // The first write failed, so none landed (the queue pair stops
            // at the first error): the receiver refused the whole batch.
            lock(&conn.grants).remove(&grant.id);
            Err(Failure::Final(TransportError::Refused {
                peer,
                reason: format!(
                    "the receiver's device refused the first write under grant {} (remote access error): \
                     the grant was revoked or expired",
                    grant.id
                ),
            }))
        }
        Err(ChainError::Failed { status: WcStatus::RetryExceeded, .. } | ChainError::Gone) => {
            Err(Failure::Retry(TransportError::Io { peer, source: std::io::Error::other(result_text(&result)) }))
        }
        Err(ChainError::Timeout(after)) => {
            Err(Failure::Final(TransportError::Timeout { peer, what: "an RDMA WRITE completion", after }))
        }
        Err(ChainError::Failed { .. } | ChainError::Verbs(_)) => {
            Err(Failure::Final(TransportError::Io { peer, source: std::io::Error::other(result_text(&result)) }))
        }
    }
}

fn result_text(result: &Result<(), ChainError>) -> String {
    match result {
        Ok(()) => "ok".to_owned(),
        Err(err) => format!("RDMA WRITE: {err}"),
    }
}

/// The grant's windows on `conn`: cached, or opened now with one control
/// round trip.
async fn windows(shared: &Shared, conn: &Conn, label: &str, grant: &Grant) -> Result<Windows, Failure> {
    if let Some(windows) = lock(&conn.grants).get(&grant.id) {
        return Ok(windows);
    }
    let io_timeout = shared.config.io_timeout;
    let peer = label.to_owned();
    // Opens take turns on the control connection; the one ahead is bounded
    // (each of its waits is, and it breaks the connection when one runs out).
    let mut control = tokio::select! {
        biased;
        () = conn.link.died() => return Err(Failure::Retry(TransportError::PeerClosed { peer })),
        control = conn.control.lock() => control,
    };
    if conn.link.is_dead() {
        return Err(Failure::Retry(TransportError::PeerClosed { peer }));
    }
    // Another batch may have opened it meanwhile.
    if let Some(windows) = lock(&conn.grants).get(&grant.id) {
        return Ok(windows);
    }
    let Control { stream, tags } = &mut *control;
    let mut request = Vec::with_capacity(control::REQUEST_LEN + kv_proto::session::FRAME_TAG_LEN);
    control::encode_request(&Request::Open(grant.id), &mut request);
    tags.seal(&mut request, 0);
    let started = Instant::now();
    // Each wait is bounded; a progress frame (a large grant being bound)
    // restarts the clock. `Err(None)`: a wait ran out.
    let reply: Result<Reply, Option<ControlError>> =
        match kv_net::write_all(stream, &request, io_timeout, "open-grant request").await {
            Err(WireError::Timeout { .. }) => Err(None),
            Err(WireError::Io { source, .. }) => Err(Some(ControlError::Io(source))),
            // A write sees no end of stream; the arm keeps the match whole.
            Err(WireError::Eof { .. }) => Err(Some(ControlError::PeerClosed)),
            Ok(()) => loop {
                match tokio::time::timeout(io_timeout, control::read_reply(stream, &shared.control, tags)).await {
                    Err(_) => break Err(None),
                    Ok(Ok(Reply::Progress(_))) => continue,
                    Ok(Ok(reply)) => break Ok(reply),
                    Ok(Err(err)) => break Err(Some(err)),
                }
            },
        };
    let reply = match reply {
        Ok(reply) => reply,
        Err(Some(ControlError::PeerClosed)) => {
            conn.link.kill();
            return Err(Failure::Retry(TransportError::PeerClosed { peer }));
        }
        Err(Some(ControlError::Io(source))) => {
            conn.link.kill();
            return Err(Failure::Retry(TransportError::Io { peer, source }));
        }
        Err(Some(err)) => {
            if matches!(err, ControlError::BadTag(_)) {
                shared.memory.counters().tag_failed();
            }
            conn.link.kill();
            return Err(Failure::Final(TransportError::Protocol { peer, reason: err.to_string() }));
        }
        Err(None) => {
            conn.link.kill();
            return Err(Failure::Final(TransportError::Timeout {
                peer,
                what: "the answer to an open-grant request",
                after: io_timeout,
            }));
        }
    };
    match reply {
        Reply::Windows(table) => {
            let count = table.regions().len();
            let windows = Arc::new(table);
            lock(&conn.grants).insert(grant.id, Arc::clone(&windows));
            tracing::debug!(peer = %label, grant = %grant.id, windows = count, micros = started.elapsed().as_micros() as u64, "rdma grant opened at the peer");
            Ok(windows)
        }
        Reply::Refused(reason) => Err(Failure::Final(TransportError::Refused { peer, reason })),
        Reply::Closed(reason) => {
            conn.link.kill();
            Err(Failure::Final(TransportError::Connect { peer, reason: format!("the peer is shut down: {reason}") }))
        }
        Reply::Failed(reason) => {
            conn.link.kill();
            Err(Failure::Retry(TransportError::Io {
                peer,
                source: std::io::Error::other(format!("the peer could not open the grant: {reason}")),
            }))
        }
        Reply::Progress(_) => Err(Failure::Final(TransportError::Protocol {
            peer,
            reason: "a progress frame where an answer was expected".to_owned(),
        })),
    }
}
