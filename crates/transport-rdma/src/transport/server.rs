//! The receiver's side: the control listener, one task per connection
//! (handshake, queue pair, then "open grant" requests), window binding, and
//! the fence (revocation and expiry invalidate every window of the grant).
//!
//! Admission: a connection holds a handshake place (bounded in total and
//! per source address) from accept until its queue pair is connected, all
//! of it within one deadline (`limits.handshake_timeout`); it takes an established
//! place once its opening (and proof of the secret) succeeded, before a
//! queue pair is made for it. A connection idle past twice `idle_timeout`
//! with no window bound on it is closed. Accept errors are backed off, their
//! log lines rate-limited.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_proto::{BatchRefusal, DestinationError, GrantId, HandshakePlace};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;

use super::link::{signaled, ChainError, Link};
use super::Shared;
use crate::control::{self, ControlLimits, Reply, Request};
use crate::handshake::{self, opening, ConnectionInfo, HandshakeLimits};
use crate::region::{RegionTable, RemoteRegion};
use crate::tags::FrameTags;
use crate::verbs::{BindWindow, MemoryWindow};

/// Names this listener in kv-net's log lines.
const LISTENER: &str = "rdma control";

/// Accepts control connections until the transport is shut down.
pub(super) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut admission = kv_net::Admission::new(&listener, &shared.handshakes, LISTENER);
    loop {
        let (stream, peer, place) = tokio::select! {
            biased;
            () = shared.token.cancelled() => return,
            admitted = admission.next() => admitted,
        };
        shared.tracker.spawn(serve(Arc::clone(&shared), stream, peer, place));
    }
}

/// Sets a control connection up: no delay, keepalive (a peer host that
/// vanishes is noticed and its queue pair destroyed).
pub(super) fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let keepalive =
        socket2::TcpKeepalive::new().with_time(Duration::from_secs(60)).with_interval(Duration::from_secs(10));
    let _ = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive);
}

/// Makes a link for `stream`, exchanges queue-pair addresses over it (each
/// message under `tags`) and connects the queue pair, within the connect
/// timeout.
pub(super) async fn set_up(
    shared: &Shared,
    stream: &mut TcpStream,
    remote_write: bool,
    tags: &mut FrameTags,
) -> Result<Arc<Link>, String> {
    let link = shared.new_link().map_err(|e| format!("cannot create a queue pair: {e}"))?;
    let limits = HandshakeLimits { max_regions: 0, timeout: shared.config.connect_timeout };
    let ours = ConnectionInfo { qp: link.endpoint(), regions: Vec::new() };
    let theirs = handshake::exchange(stream, &ours, &limits, tags).await.map_err(|e| {
        if matches!(e, handshake::HandshakeError::BadTag(_)) {
            shared.memory.counters().tag_failed();
        }
        e.to_string()
    })?;
    link.connect(&theirs.qp, remote_write).map_err(|e| format!("cannot connect the queue pair: {e}"))?;
    Ok(link)
}

/// The opening (with the proof of the secret, if one is configured), then
/// the established place, then the queue pair: all of an incoming control
/// connection's set-up, within one deadline from accept. Returns the tags
/// of the connection's later frames too.
async fn accept_connection(
    shared: &Shared,
    stream: &mut TcpStream,
    peer: SocketAddr,
) -> Result<(Arc<Link>, OwnedSemaphorePermit, FrameTags), String> {
    let deadline = shared.config.limits.handshake_timeout;
    let set_up = async {
        tune(stream);
        let establish = || shared.established.take(LISTENER, peer);
        let opened = opening::server(stream, shared.config.auth_secret.as_ref(), establish).await;
        if let Err(opening::OpeningError::BadProof) = &opened {
            // A wrong proof, not a peer gone mid-opening.
            shared.memory.counters().auth_failed();
        }
        let (place, mut tags) = opened.map_err(|e| e.to_string())?;
        let link = set_up(shared, stream, true, &mut tags).await?;
        Ok((link, place, tags))
    };
    tokio::time::timeout(deadline, set_up).await.map_err(|_| format!("set-up not completed within {deadline:?}"))?
}

/// Serves one control connection: handshake, then "open grant" requests
/// until the peer closes it, it idles, or the transport shuts down; then the
/// link is destroyed and its windows freed.
async fn serve(shared: Arc<Shared>, mut stream: TcpStream, peer: SocketAddr, place: HandshakePlace) {
    let (link, _established, mut tags) = tokio::select! {
        biased;
        () = shared.token.cancelled() => return,
        set_up = accept_connection(&shared, &mut stream, peer) => match set_up {
            Ok(set_up) => set_up,
            Err(reason) => {
                tracing::debug!(%peer, %reason, "rdma control connection: set-up failed");
                return;
            }
        },
    };
    drop(place);
    tracing::debug!(%peer, link = link.id, "rdma control connection up");
    let idle = shared.config.idle_timeout.saturating_mul(2);
    loop {
        let request = tokio::select! {
            biased;
            () = shared.token.cancelled() => break,
            () = link.died() => break,
            request = tokio::time::timeout(idle, control::read_request(&mut stream, &mut tags)) => request,
        };
        let request = match request {
            Ok(request) => request,
            // Idle: closed unless a window is bound on it (a sender may be
            // writing through it without a word on the control connection).
            Err(_) if shared.fence().book.has_windows_on(link.id) => continue,
            Err(_) => {
                tracing::debug!(%peer, link = link.id, ?idle, "rdma control connection idle, closing");
                break;
            }
        };
        let grant = match request {
            Ok(Some(Request::Open(grant))) => grant,
            Ok(None) => break,
            Err(err) => {
                // A bad request (a failed tag among them) ends the connection.
                if matches!(err, control::ControlError::BadTag(_)) {
                    shared.memory.counters().tag_failed();
                }
                tracing::debug!(%peer, error = %err, "rdma control connection: bad request");
                break;
            }
        };
        let mut progress = Progress::new(&mut stream, &mut tags, shared.config.io_timeout);
        let (reply, fatal) = open(&shared, &link, grant, peer, &mut progress).await;
        if progress.failed {
            break;
        }
        let mut bytes = Vec::new();
        if let Err(err) = control::encode_reply(&reply, &shared.control, &mut bytes) {
            tracing::warn!(%peer, %grant, error = %err, "rdma control reply cannot be encoded");
            break;
        }
        tags.seal(&mut bytes, 0);
        let written = kv_net::write_all(&mut stream, &bytes, shared.config.io_timeout, "open-grant reply").await;
        if let Err(error) = written {
            tracing::debug!(%peer, %grant, %error, "rdma control connection: reply not written");
            break;
        }
        if fatal {
            break;
        }
    }
    // The queue pair stops first (its windows then open nothing), then the
    // windows go, then the queue pair.
    link.kill();
    let windows = shared.fence().book.unlink(link.id);
    let count = windows.len();
    drop(windows);
    link.release();
    tracing::debug!(%peer, link = link.id, windows = count, "rdma control connection closed");
}

fn refusal(err: DestinationError) -> Reply {
    match err {
        DestinationError::Closed => Reply::Closed("the receiver is shut down".to_owned()),
        other => Reply::Refused(other.to_string()),
    }
}

fn window_remote(window: &MemoryWindow) -> Option<RemoteRegion> {
    window.bound_range().map(|(addr, len)| RemoteRegion { addr, len, rkey: window.rkey() })
}

/// Windows bound per chain (and allocated between two looks at the clock)
/// while opening a grant.
const OPEN_CHUNK: usize = 4096;

/// Sends progress frames while a large grant is opened, so the sender's
/// bounded wait for the answer restarts as long as work goes on.
struct Progress<'a> {
    stream: &'a mut TcpStream,
    tags: &'a mut FrameTags,
    every: Duration,
    io_timeout: Duration,
    last: Instant,
    failed: bool,
}

impl<'a> Progress<'a> {
    fn new(stream: &'a mut TcpStream, tags: &'a mut FrameTags, io_timeout: Duration) -> Self {
        Self { stream, tags, every: io_timeout / 4, io_timeout, last: Instant::now(), failed: false }
    }

    /// Tells the sender `ready` windows are ready, if it has not heard from
    /// us for a while. A frame that cannot be written ends the connection.
    async fn tick(&mut self, ready: usize) {
        if self.failed || self.last.elapsed() < self.every {
            return;
        }
        let mut bytes = Vec::with_capacity(control::REPLY_HEADER_LEN);
        let frame = Reply::Progress(u32::try_from(ready).unwrap_or(u32::MAX));
        // A progress frame has no body: it always encodes.
        let _ = control::encode_reply(&frame, &ControlLimits { max_windows: 0 }, &mut bytes);
        self.tags.seal(&mut bytes, 0);
        let written = kv_net::write_all(&mut *self.stream, &bytes, self.io_timeout, "progress frame").await;
        self.failed = written.is_err();
        self.last = Instant::now();
    }
}

/// Opens `grant` on `link`: binds one window per grant range there (or
/// names the ones already bound). Returns the reply and whether the
/// connection must close (its queue pair failed).
async fn open(
    shared: &Shared,
    link: &Link,
    grant: GrantId,
    peer: SocketAddr,
    progress: &mut Progress<'_>,
) -> (Reply, bool) {
    if shared.memory.is_closed() {
        shared.memory.counters().refused(BatchRefusal::Closed);
        return (Reply::Closed("the receiver is shut down".to_owned()), false);
    }
    // Not in the fence's book: refused before `admit`, so counted here.
    let unknown = || {
        shared.memory.counters().refused(BatchRefusal::UnknownGrant);
        Reply::Refused("no live grant has this id (never issued, revoked or expired)".to_owned())
    };
    let Some((_, slot)) = shared.fence().book.get(&grant) else { return (unknown(), false) };
    let Ok(_serial) = tokio::time::timeout(shared.config.io_timeout, slot.lock.lock()).await else {
        return (Reply::Failed("the grant stayed busy".to_owned()), false);
    };
    let specs = {
        let fence = shared.fence();
        let Some((specs, _)) = fence.book.get(&grant) else { return (unknown(), false) };
        if let Some(bound) = fence.book.bound(&grant, link.id) {
            return (windows_reply(bound.iter()), false);
        }
        specs
    };
    // Live and not expired (the one copy of that bookkeeping).
    let total: u64 = specs.iter().map(|spec| spec.len).sum();
    if let Err(err) = shared.memory.admit(&grant, specs.iter().map(|s| (s.addr, s.len)), total, Instant::now()) {
        return (refusal(err), false);
    }
    if specs.len() > shared.control.max_windows as usize {
        let reason =
            format!("the grant has {} ranges; at most {} windows per grant", specs.len(), shared.control.max_windows);
        return (Reply::Refused(reason), false);
    }
    // The windows and the regions they go over.
    let started_alloc = Instant::now();
    let mut windows = shared.fence().pool.take(specs.len());
    while windows.len() < specs.len() {
        match MemoryWindow::alloc(&shared.pd) {
            Ok(window) => windows.push(window),
            Err(err) => {
                let extra = shared.fence().pool.give(windows);
                drop(extra);
                return (Reply::Failed(format!("cannot allocate memory windows: {err}")), false);
            }
        }
        if windows.len() % OPEN_CHUNK == 0 {
            progress.tick(0).await;
        }
    }
    let allocated = started_alloc.elapsed();
    let regions = {
        let registrations = shared.registrations();
        specs.iter().map(|spec| registrations.destinations.get(spec.region).cloned()).collect::<Option<Vec<_>>>()
    };
    let Some(regions) = regions else {
        return (Reply::Closed("the receiver is shut down".to_owned()), false);
    };
    let keys: Vec<u32> = windows.iter().map(MemoryWindow::next_rkey).collect();
    let binds: Vec<BindWindow<'_>> = windows
        .iter()
        .zip(specs.iter())
        .zip(&regions)
        .zip(&keys)
        .map(|(((window, spec), region), &rkey)| BindWindow { window, region, addr: spec.addr, len: spec.len, rkey })
        .collect();
    let interval = shared.queue.signal_interval();
    let started = Instant::now();
    let mut bound = Ok(());
    for (index, chunk) in binds.chunks(OPEN_CHUNK).enumerate() {
        let count = chunk.len();
        bound = link
            .run(count, shared.config.io_timeout, |qp, range, seq| {
                let start = range.start;
                qp.post_binds(&chunk[range], seq, |i| signaled(start + i, count, interval))
            })
            .await;
        if bound.is_err() {
            break;
        }
        progress.tick(index * OPEN_CHUNK + count).await;
    }
    let count = binds.len();
    drop(binds);
    if let Err(err) = bound {
        // Some may be bound: deallocating unbinds them (the queue pair is
        // in the error state already).
        drop(windows);
        tracing::warn!(%peer, %grant, link = link.id, error = %err, "rdma: binding the grant's windows failed");
        return (Reply::Failed(format!("cannot bind the grant's windows: {err}")), true);
    }
    let Some(hold) = link.hold() else {
        drop(windows);
        return (Reply::Closed("the receiver is shut down".to_owned()), true);
    };
    for (((window, spec), region), &rkey) in windows.iter_mut().zip(specs.iter()).zip(regions).zip(&keys) {
        window.set_bound(region, hold.clone(), spec.addr, spec.len, rkey);
    }
    let remote = windows_reply(windows.iter());
    if let Err(windows) = shared.fence().book.record(grant, link.id, windows) {
        // Closed meanwhile (a revocation waits for this lock).
        drop(windows);
        return (Reply::Closed("the receiver is shut down".to_owned()), false);
    }
    tracing::debug!(
        %peer, %grant, link = link.id, windows = count, alloc_micros = allocated.as_micros() as u64,
        bind_micros = started.elapsed().as_micros() as u64, "rdma grant opened"
    );
    (remote, false)
}

/// The reply naming `windows` (bound over a grant's disjoint ranges).
fn windows_reply<'a>(windows: impl Iterator<Item = &'a MemoryWindow>) -> Reply {
    match RegionTable::new(windows.filter_map(window_remote).collect()) {
        Ok(table) => Reply::Windows(table),
        Err(err) => Reply::Failed(format!("the grant's windows overlap: {err}")),
    }
}

/// Revokes `grant` (`why`: revoked or expired): no new open from now on;
/// when this returns, every window bound for it was invalidated (a
/// `LOCAL_INV` completed on its queue pair) or its queue pair destroyed, so
/// no write under the grant can land any more.
pub(super) async fn revoke(shared: &Shared, grant: &GrantId, why: &'static str) {
    shared.memory.revoke(grant);
    let Some((_, slot)) = shared.fence().book.get(grant) else { return };
    slot.expiry.cancel();
    // Waits for an open in progress (bounded: its own waits are).
    let _serial = slot.lock.lock().await;
    let bound = shared.fence().book.remove(grant);
    let started = Instant::now();
    let mut invalidated = 0usize;
    for (link_id, mut windows) in bound {
        let link = shared.link(link_id);
        let fenced = match &link {
            Some(link) if !link.is_dead() => {
                let keys: Vec<u32> = windows.iter().map(MemoryWindow::rkey).collect();
                let count = keys.len();
                let interval = shared.queue.signal_interval();
                link.run(count, shared.config.io_timeout, |qp, range, seq| {
                    let start = range.start;
                    qp.post_invalidates(&keys[range], seq, |i| signaled(start + i, count, interval))
                })
                .await
            }
            _ => Err(ChainError::Gone),
        };
        match fenced {
            Ok(()) => {
                invalidated += windows.len();
                windows.iter_mut().for_each(MemoryWindow::set_invalidated);
                let extra = shared.fence().pool.give(windows);
                drop(extra);
            }
            Err(err) => {
                // The queue pair is in the error state (`run` does that on
                // any failure; a gone link already is): nothing reaches these
                // windows any more. Deallocate them.
                if let Some(link) = &link {
                    link.kill();
                }
                tracing::debug!(%grant, link = link_id, error = %err, "rdma: windows fenced by the queue pair's error state");
                drop(windows);
            }
        }
    }
    tracing::debug!(%grant, why, invalidated, micros = started.elapsed().as_micros() as u64, "rdma grant fenced");
}
