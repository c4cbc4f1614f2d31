//! P's side-channel server: accepts D's connections, checks the hello, admits
//! transfer requests on a bounded queue and answers each with one outcome per
//! request, and applies D's renewals of the requests it still means to pull.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use futures_util::{SinkExt, StreamExt};
use kv_proto::auth::{self, Channel, Transcript};
use kv_proto::session::{End, Session};
use kv_proto::topology::{self, copies_whole_blocks};
use kv_proto::{
    CacheLayout, Endpoint, FailureCause, FrameCodec, FrameError, Grant, HandshakePlace, HeadRange, Hello, HelloReply,
    Outcome, RankTopology, SideMessage, TransportError, WriteOp, XferReply, XferRequest, PROTOCOL_VERSION,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;

use crate::config::{AuthSecret, DataEndpointPolicy};
use crate::plan::{plan_request, PlanError, PlanGeometry};
use crate::sender::Puller;
use crate::serving::{failed, AdmissionWait, BlockMap, Misdirected, Piece, TransferCore, WaitEnd};
use crate::side_channel::{SideChannelCodec, SideChannelError};
use crate::topology::{plan_heads_range, CacheSide, HeadPlan};
use crate::worker::Shared;

/// Accepts connections until the worker shuts down. A connection first needs
/// a handshake place (hello and authentication, bounded in number and time),
/// then an established place; the two pools are separate, so connections
/// that never finish a hello cannot crowd out those that did.
pub(crate) async fn run_listener(shared: Arc<Shared>, listener: TcpListener) {
    let handshakes = shared.config.side_channel_limits.handshake_places();
    let mut admission = kv_net::Admission::new(&listener, &handshakes, "side channel");
    // Any host that reaches the port can end connections badly, as fast as
    // it can open them: one line a second for all of them.
    let dropped = Arc::new(kv_net::RefusalLog::new());
    loop {
        let (stream, peer, handshake) = tokio::select! {
            () = shared.cancel.cancelled() => break,
            admitted = admission.next() => admitted,
        };
        let _ = stream.set_nodelay(true);
        let conn_shared = shared.clone();
        let dropped = dropped.clone();
        shared.tracker.spawn(async move {
            match serve_connection(conn_shared, stream, peer, handshake).await {
                Ok(()) => tracing::debug!(%peer, "side-channel connection closed"),
                Err(reason) => match dropped.allow(Instant::now()) {
                    Some(suppressed) => {
                        tracing::warn!(%peer, %reason, suppressed, "side-channel connection dropped");
                    }
                    None => tracing::debug!(%peer, %reason, "side-channel connection dropped"),
                },
            }
        });
    }
}

/// What a decode worker's hello says it is, for planning its pulls.
#[derive(Clone, Copy, Debug)]
struct DecodeRank {
    layout: CacheLayout,
    topology: RankTopology,
    /// Whether its blocks are copied whole.
    whole_blocks: bool,
    /// Which of the decode ranks that pull each request from here it is.
    puller: Puller,
    /// Whether it is of this worker's pipeline stage: one of another stage
    /// only learns this instance's topology, and pulls nothing from here.
    same_stage: bool,
}

fn check_hello(shared: &Shared, hello: &Hello) -> Result<DecodeRank, String> {
    let ours = shared.cache.layout();
    let protocol = shared.writer.protocol();
    let decode = format!("decode {}", hello.engine_id);
    let prefill = format!("prefill {}", shared.config.engine_id);
    let mut mismatches = Vec::new();
    if hello.protocol != protocol {
        mismatches.push(format!("transport: {decode} uses {}, {prefill} uses {protocol}", hello.protocol));
    }
    let d = (&hello.layout, &hello.topology);
    let p = (&ours, &shared.topology);
    match hello.topology.validate() {
        Err(e) => mismatches.push(format!("topology: {decode} declares {e}")),
        Ok(()) => mismatches.extend(topology::mismatches(d, &decode, p, &prefill)),
    }
    mismatches.extend(hello.identity.mismatches(&decode, &shared.config.identity, &prefill));
    let whole_blocks = copies_whole_blocks(d, p);
    let same_stage = topology::same_stage(&hello.topology, &shared.topology);
    let puller = if whole_blocks || !same_stage || !mismatches.is_empty() {
        Puller::ONLY
    } else {
        let heads = shared.topology.num_kv_heads;
        match topology::pulls_expected(heads, shared.topology.tp_size, shared.topology.tp_rank, hello.topology.tp_size)
        {
            Ok(of) => Puller { rank: hello.topology.tp_rank, of },
            Err(e) => {
                mismatches.push(format!("topology: {e}"));
                Puller::ONLY
            }
        }
    };
    if mismatches.is_empty() {
        Ok(DecodeRank { layout: hello.layout, topology: hello.topology, whole_blocks, puller, same_stage })
    } else {
        Err(format!("{} ({})", crate::side_channel::INCOMPATIBLE, mismatches.join("; ")))
    }
}

type Conn = Framed<TcpStream, SideChannelCodec>;

/// Reads the hello, authenticates, checks what must agree and answers; all
/// of it within one deadline (`side_channel_limits.handshake_timeout`), not one per read.
async fn handshake(shared: &Shared, framed: &mut Conn) -> Result<Option<(Hello, DecodeRank)>, String> {
    let first = tokio::select! {
        () = shared.cancel.cancelled() => return Ok(None),
        first = framed.next() => first,
    };
    let hello = match first {
        None => return Ok(None),
        Some(Err(SideChannelError::Frame(FrameError::BadVersion { got }))) => {
            // Answer in our version: D's decoder then names both versions,
            // one clear error at connect time instead of a silent close.
            let reason = format!("decode speaks side-channel version {got}, prefill speaks {PROTOCOL_VERSION}");
            reject(framed, &reason).await;
            return Err(reason);
        }
        Some(Err(e)) => return Err(e.to_string()),
        Some(Ok(SideMessage::Hello(hello))) => hello,
        Some(Ok(other)) => return Err(format!("expected hello, got {}", message_name(&other))),
    };
    if let Some(secret) = &shared.config.auth_secret {
        authenticate(secret, &hello, framed)
            .await
            .inspect_err(|failure| {
                if failure.proof_failed {
                    shared.side_channel_counts.auth_failed();
                }
            })
            .map_err(|failure| failure.reason)?;
    }
    match check_hello(shared, &hello) {
        Ok(rank) => Ok(Some((hello, rank))),
        Err(reason) => {
            tracing::error!(peer_engine = %hello.engine_id, %reason, "refusing decode instance");
            reject(framed, &reason).await;
            Err(reason)
        }
    }
}

async fn reject(framed: &mut Conn, reason: &str) {
    let rejected = HelloReply::Rejected { reason: kv_proto::bounded_text(reason) };
    let _ = framed.send(SideMessage::HelloReply(rejected)).await;
}

async fn serve_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    handshake_place: HandshakePlace,
) -> Result<(), String> {
    let mut framed = Framed::new(stream, SideChannelCodec::new(FrameCodec::new(shared.config.max_frame_len)));
    let deadline = shared.config.side_channel_limits.handshake_timeout;
    let hello = match tokio::time::timeout(deadline, handshake(&shared, &mut framed)).await {
        Err(_) => return Err(format!("hello not completed within {deadline:?}")),
        Ok(Err(reason)) => return Err(reason),
        Ok(Ok(None)) => return Ok(()),
        Ok(Ok(Some(accepted))) => accepted,
    };
    let (hello, decode_rank) = hello;
    let Some(_established) = shared.established.take("side channel", peer) else {
        // Logged (rate-limited) where the place was refused.
        let reason = format!("prefill serves {} decode connections already", shared.established.limit());
        reject(&mut framed, &reason).await;
        return Ok(());
    };
    drop(handshake_place);
    let accepted = HelloReply::Accepted {
        engine_id: shared.config.engine_id.clone(),
        idle_timeout: shared.config.side_channel_idle_timeout,
        lease_renewal: shared.config.lease_renewal,
        topology: shared.topology,
        layout: shared.cache.layout(),
    };
    tokio::time::timeout(deadline, framed.send(SideMessage::HelloReply(accepted)))
        .await
        .map_err(|_| format!("hello reply not written within {deadline:?}"))?
        .map_err(|e| e.to_string())?;
    tracing::debug!(%peer, peer_engine = %hello.engine_id, "decode instance connected");
    let _open = shared.side_channel_counts.opened(&peer.ip().to_canonical().to_string());

    let (sink, mut stream) = framed.split();
    // Each transfer writes its own reply: no hand-off to a writer task. A
    // reply that cannot be written in time ends the connection.
    let sink = Arc::new(tokio::sync::Mutex::new(sink));
    let closed = shared.cancel.child_token();
    let _close_on_exit = closed.clone().drop_guard();
    let per_connection = Arc::new(Semaphore::new((shared.config.queue_depth / 2).max(1)));
    let idle = shared.config.side_channel_idle_timeout;
    loop {
        let next = tokio::select! {
            () = closed.cancelled() => return Ok(()),
            next = tokio::time::timeout(idle, stream.next()) => next,
        };
        let request = match next {
            Err(_) if per_connection.available_permits() == (shared.config.queue_depth / 2).max(1) => {
                tracing::debug!(%peer, ?idle, "side-channel connection idle, closing");
                return Ok(());
            }
            Err(_) => continue,
            Ok(None) => return Ok(()),
            Ok(Some(Err(SideChannelError::Frame(FrameError::BadTag(_))))) => {
                shared.side_channel_counts.tag_failed();
                return Err("a frame failed its authentication tag".to_owned());
            }
            Ok(Some(Err(e))) => return Err(e.to_string()),
            Ok(Some(Ok(SideMessage::XferRequest(request)))) => request,
            Ok(Some(Ok(SideMessage::KeepAlive(keep)))) => {
                let (renewed, refused) = {
                    let mut sender = shared.lock_sender();
                    let before = sender.renewals_refused();
                    let renewed = sender.renew(&keep.renewals, &hello.engine_id, Instant::now());
                    (renewed, sender.renewals_refused().saturating_sub(before))
                };
                tracing::trace!(%peer, asked = keep.renewals.len(), renewed, "renewed requests");
                if refused > 0 {
                    if let Some(suppressed) = refusal_line_allowed(&shared) {
                        tracing::warn!(%peer, decode_engine = %hello.engine_id, refused, suppressed, "renewals naming held requests without their renewal key ignored (a decode instance never given their params?)");
                    }
                }
                continue;
            }
            Ok(Some(Ok(other))) => return Err(format!("unexpected {} after hello", message_name(&other))),
        };
        // Admission is held until the reply is written: a D that does not
        // read its replies stops being read from, then loses the connection.
        // Its renewals then wait unread behind this request, so while P
        // makes it wait, P renews what it last renewed itself.
        let admitted = async {
            let mine = per_connection.clone().acquire_owned().await;
            let global = shared.admission.clone().acquire_owned().await;
            mine.ok().zip(global.ok())
        };
        tokio::pin!(admitted);
        // D's wait budget runs from here, however long admission takes.
        let received_at = Instant::now();
        let mut waiting = AdmissionWait::new(hello.engine_id.clone(), shared.config.lease_renewal, received_at);
        let permits = loop {
            tokio::select! {
                () = closed.cancelled() => return Ok(()),
                () = crate::timer::sleep_until(waiting.poll_timeout()) => {
                    waiting.handle_timeout(&mut shared.lock_sender(), Instant::now());
                }
                permits = &mut admitted => match permits {
                    Some(permits) => break permits,
                    None => return Ok(()),
                },
            }
        };
        tracing::debug!(%peer, xfer_id = request.xfer_id, requests = request.requests.len(), "transfer request admitted");
        let job_shared = shared.clone();
        let job_sink = sink.clone();
        let job_closed = closed.clone();
        // One span per transfer request, as on D: its id, the peer, the
        // grant; each request's two ids are logged inside it.
        let span = tracing::info_span!(
            "serve",
            xfer_id = request.xfer_id,
            peer = %peer,
            peer_engine = %hello.engine_id,
            grant = %request.grant.id,
            requests = request.requests.len(),
            heads = %heads_field(request.heads),
        );
        let job = async move {
            let xfer_id = request.xfer_id;
            let bound = request.reply_bound();
            let message = if bound > job_shared.config.max_frame_len {
                let reason = format!(
                    "the reply to {} requests could take {bound} bytes, more than the frame limit of {}; send fewer per transfer request",
                    request.requests.len(),
                    job_shared.config.max_frame_len
                );
                tracing::warn!(%peer, xfer_id, %reason, "refusing transfer request");
                SideMessage::XferRefused { xfer_id, reason }
            } else {
                let transfer =
                    serve_transfer(&job_shared, request, &decode_rank, peer.ip(), received_at, &job_closed, &job_sink);
                SideMessage::XferReply(transfer.await)
            };
            let after = job_shared.config.reply_timeout;
            let sent = tokio::time::timeout(after, async { job_sink.lock().await.send(message).await }).await;
            drop(permits);
            match sent {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(%peer, xfer_id, error = %e, "cannot send transfer reply; closing the connection");
                    job_closed.cancel();
                }
                Err(_) => {
                    tracing::warn!(%peer, xfer_id, ?after, "decode did not take its reply in time; closing the connection");
                    job_closed.cancel();
                }
            }
        };
        shared.tracker.spawn(tracing::Instrument::instrument(job, span));
    }
}

/// Why authentication did not complete.
struct AuthFailure {
    reason: String,
    /// D answered with a wrong proof (not: it went away, or sent garbage).
    proof_failed: bool,
}

impl From<String> for AuthFailure {
    fn from(reason: String) -> Self {
        Self { reason, proof_failed: false }
    }
}

/// Challenges D to prove the shared secret (and proves it to D); refuses
/// the connection unless D's proof matches.
async fn authenticate(secret: &AuthSecret, hello: &Hello, framed: &mut Conn) -> Result<(), AuthFailure> {
    let Some(server_nonce) = auth::fresh_nonce() else {
        let reason = "no OS randomness for the side-channel nonce".to_owned();
        reject(framed, &reason).await;
        return Err(reason.into());
    };
    let context = hello.auth_context();
    let transcript = Transcript {
        channel: Channel::SideChannel,
        client_nonce: &hello.client_nonce,
        server_nonce: &server_nonce,
        context: &context,
    };
    let server_proof = auth::server_proof(secret, &transcript);
    framed
        .send(SideMessage::HelloReply(HelloReply::Challenge { server_nonce, server_proof }))
        .await
        .map_err(|e| e.to_string())?;
    let proof = match framed.next().await {
        Some(Ok(SideMessage::AuthProof(proof))) => proof,
        Some(Ok(other)) => return Err(format!("expected an authentication proof, got {}", message_name(&other)).into()),
        Some(Err(e)) => return Err(e.to_string().into()),
        None => return Err("closed during authentication".to_owned().into()),
    };
    if !auth::verify_client_proof(secret, &transcript, &proof) {
        tracing::error!(peer_engine = %hello.engine_id, "decode instance failed side-channel authentication");
        let reason = "side-channel authentication failed".to_owned();
        reject(framed, &reason).await;
        return Err(AuthFailure { reason, proof_failed: true });
    }
    // Every frame after the proof, both ways, carries its tag.
    let Some(session) = Session::derive(secret, &transcript, End::Server) else {
        return Err("cannot derive the side-channel session keys".to_owned().into());
    };
    framed.codec_mut().seal(session);
    Ok(())
}

fn message_name(msg: &SideMessage) -> &'static str {
    match msg {
        SideMessage::Hello(_) => "hello",
        SideMessage::HelloReply(_) => "hello reply",
        SideMessage::XferRequest(_) => "transfer request",
        SideMessage::XferReply(_) => "transfer reply",
        SideMessage::AuthProof(_) => "authentication proof",
        SideMessage::XferRefused { .. } => "transfer refusal",
        SideMessage::KeepAlive(_) => "renewal",
        SideMessage::XferProgress(_) => "transfer progress",
    }
}

/// The cause a failed batch write is counted under.
fn write_cause(error: &TransportError) -> FailureCause {
    match error {
        TransportError::Refused { .. } | TransportError::Grant(_) => FailureCause::GrantRefused,
        TransportError::Timeout { .. } => FailureCause::Timeout,
        TransportError::Shutdown => FailureCause::Shutdown,
        TransportError::Connect { .. } | TransportError::PeerClosed { .. } | TransportError::Io { .. } => {
            FailureCause::ConnectionLost
        }
        TransportError::WrongProtocol { .. } | TransportError::BadEndpoint { .. } => FailureCause::IncompatiblePeer,
        _ => FailureCause::WriteFailed,
    }
}

/// Whether two addresses are one host: equal, or both loopback (a D that
/// reaches P at `localhost` may advertise `127.0.0.1`).
fn same_host(a: IpAddr, b: IpAddr) -> bool {
    let (a, b) = (a.to_canonical(), b.to_canonical());
    a == b || (a.is_loopback() && b.is_loopback())
}

/// The endpoint P may write to for a transfer request that came from
/// `peer_ip`, resolved to the address that passed the check (so the
/// transport connects exactly there), or why not.
async fn checked_endpoint(shared: &Shared, endpoint: &Endpoint, peer_ip: IpAddr) -> Result<Endpoint, String> {
    let ours = shared.writer.protocol();
    if endpoint.protocol != ours {
        return Err(format!("decode endpoint uses {}, prefill uses {ours}", endpoint.protocol));
    }
    let extra: &[IpAddr] = match &shared.config.data_endpoint_policy {
        DataEndpointPolicy::Any => return Ok(endpoint.clone()),
        DataEndpointPolicy::SamePeerHost => &[],
        DataEndpointPolicy::SamePeerHostOr(extra) => extra,
    };
    endpoint.check_address().map_err(|reason| format!("bad decode endpoint {endpoint}: {reason}"))?;
    let after = shared.config.connect_timeout;
    let resolved: Vec<SocketAddr> = tokio::time::timeout(after, tokio::net::lookup_host(endpoint.address.as_str()))
        .await
        .map_err(|_| format!("resolving decode endpoint {endpoint} timed out after {after:?}"))?
        .map_err(|e| format!("cannot resolve decode endpoint {endpoint}: {e}"))?
        .collect();
    let allowed = allowed_address(&resolved, peer_ip, extra).ok_or_else(|| {
        format!(
            "decode endpoint {endpoint} is not on the host the side channel came from ({peer_ip}) \
                 nor on the allowed list; refusing to write there"
        )
    })?;
    Ok(Endpoint { address: allowed.to_string(), ..endpoint.clone() })
}

/// The first of an endpoint's resolved addresses on the peer's host or on
/// the allowed list.
fn allowed_address(resolved: &[SocketAddr], peer_ip: IpAddr, extra: &[IpAddr]) -> Option<SocketAddr> {
    resolved
        .iter()
        .find(|addr| same_host(addr.ip(), peer_ip) || extra.iter().any(|&ip| same_host(addr.ip(), ip)))
        .copied()
}

/// Where a transfer request's progress goes: D's connection (only when D
/// asked for pieces, [`XferRequest::piece_blocks`]).
type ProgressOut = Arc<tokio::sync::Mutex<futures_util::stream::SplitSink<Conn, SideMessage>>>;

/// Serves one transfer request: every request of it is claimed as soon as it
/// is ready on P (all at once when they are), and written as its KV is
/// staged (whole when it was ready whole), in D's pieces when D asked for
/// them, so one slow request cannot starve the others' leases. Nothing is
/// written once D's wait budget has passed. The decisions are
/// [`TransferCore`]'s; this moves bytes and time.
async fn serve_transfer(
    shared: &Shared,
    request: XferRequest,
    decode: &DecodeRank,
    peer_ip: IpAddr,
    received_at: Instant,
    connection: &CancellationToken,
    progress: &ProgressOut,
) -> XferReply {
    let XferRequest { xfer_id, endpoint, grant, wait_budget, region_base_addrs, requests, heads, piece_blocks } =
        request;
    for r in &requests {
        let decode_req_id = r.decode_req_id.as_ref().map(ToString::to_string);
        tracing::debug!(req_id = %r.req_id, decode_req_id = %decode_req_id.as_deref().unwrap_or("-"), blocks = r.block_ids.len(), "serving");
    }
    if !decode.same_stage {
        let reason = format!(
            "pipeline stage: decode has {}, prefill has {}; a stage pulls only from the same stage",
            decode.topology.pp_rank, shared.topology.pp_rank
        );
        if let Some(suppressed) = refusal_line_allowed(shared) {
            tracing::warn!(xfer_id, peer = %peer_ip, %reason, suppressed, "refusing transfer request");
        }
        let reply = TransferCore::refuse_all(xfer_id, requests, FailureCause::PeerRefused, &reason);
        count_outcomes(shared, &reply);
        return reply;
    }
    let endpoint = match checked_endpoint(shared, &endpoint, peer_ip).await {
        Ok(endpoint) => endpoint,
        Err(reason) => {
            if let Some(suppressed) = refusal_line_allowed(shared) {
                tracing::error!(xfer_id, peer = %peer_ip, %reason, suppressed, "refusing transfer request");
            }
            let reply = TransferCore::refuse_all(xfer_id, requests, FailureCause::PeerRefused, &reason);
            count_outcomes(shared, &reply);
            return reply;
        }
    };
    let (core, misdirected) = TransferCore::new(
        xfer_id,
        requests,
        wait_budget,
        received_at,
        shared.config.abort_request_timeout,
        &shared.config.engine_id,
    );
    // Mapped by token, a piece of D's blocks is written once P's blocks
    // holding its tokens are staged.
    let map = match heads {
        Some(_) => BlockMap::Tokens { local: shared.cache.layout().block_tokens, remote: decode.layout.block_tokens },
        None => BlockMap::Whole,
    };
    let mut core = core.with_puller(decode.puller).with_pieces(piece_blocks).with_block_map(map);
    if let Some(Misdirected { req_id, refused, reason }) = misdirected {
        if let Some(suppressed) = refusal_line_allowed(shared) {
            tracing::warn!(xfer_id, %req_id, refused, suppressed, peer = %peer_ip, %reason, "refusing requests meant for another prefill engine");
        }
    }
    let local_bases = shared.cache.base_addrs();
    let local_layout = shared.cache.layout();
    let target = Target {
        endpoint: &endpoint,
        grant: &grant,
        geometry: PlanGeometry {
            local_bases: &local_bases,
            remote_bases: &region_base_addrs,
            block_len: shared.cache.block_len(),
            local_num_blocks: shared.cache.num_blocks(),
        },
        whole_blocks: decode.whole_blocks,
        heads: heads.map(|heads| HeadPlan {
            local: CacheSide { layout: &local_layout, heads: shared.topology.heads, bases: &local_bases },
            remote: CacheSide { layout: &decode.layout, heads: decode.topology.heads, bases: &region_base_addrs },
            local_num_blocks: shared.cache.num_blocks(),
            heads,
        }),
    };
    while core.is_open() {
        let changed = shared.sender_changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let (claimed, pulled_early) = {
            let mut sender = shared.lock_sender();
            let claimed = core.claim_ready(&mut sender, Instant::now());
            (claimed, sender.has_pulled())
        };
        if pulled_early {
            // A staged engine copies those into staging first: wake it.
            shared.finished_changed.signal();
        }
        for ready_for in claimed.iter().filter_map(|c| c.ready_for) {
            shared.metrics.send_waited(ready_for);
        }
        tell(shared, &mut core, progress, connection).await;
        let mut wrote = false;
        while !connection.is_cancelled() {
            let batches = core.next_batches(&mut shared.lock_sender());
            tell(shared, &mut core, progress, connection).await;
            if batches.is_empty() {
                break;
            }
            for batch in batches {
                write_batch(shared, xfer_id, &target, &mut core, batch).await;
                tell(shared, &mut core, progress, connection).await;
            }
            wrote = true;
        }
        if wrote {
            // Their blocks may be freed now, not when the whole transfer request ends.
            shared.sender_changed.notify_waiters();
            shared.finished_changed.signal();
            continue;
        }
        if !core.is_open() {
            break;
        }
        let ended = tokio::select! {
            () = shared.cancel.cancelled() => Some(WaitEnd::Shutdown),
            () = connection.cancelled() => Some(WaitEnd::ConnectionClosed),
            () = &mut changed => None,
            () = tokio::time::sleep_until(core.wait_end().into()) => Some(WaitEnd::Deadline),
        };
        if let Some(end) = ended {
            core.end_wait(end, &mut shared.lock_sender());
            tell(shared, &mut core, progress, connection).await;
        }
    }
    shared.finished_changed.signal();
    let reply = core.reply();
    count_outcomes(shared, &reply);
    reply
}

/// Tells D what the core has for it (nothing unless D asked for pieces),
/// bounded like a reply: a D that does not take it loses the connection,
/// as for a reply (the transfer then ends as for a connection closed).
async fn tell(shared: &Shared, core: &mut TransferCore, out: &ProgressOut, connection: &CancellationToken) {
    let progress = core.take_progress();
    if progress.is_empty() || connection.is_cancelled() {
        return;
    }
    let after = shared.config.reply_timeout;
    let sent = tokio::time::timeout(after, async {
        let mut sink = out.lock().await;
        for p in progress {
            sink.feed(SideMessage::XferProgress(p)).await?;
        }
        sink.flush().await
    })
    .await;
    if !matches!(sent, Ok(Ok(()))) {
        tracing::warn!(?after, "decode did not take the transfer's progress; closing the connection");
        connection.cancel();
    }
}

/// Counts each request of a reply as sent or failed, by cause.
fn count_outcomes(shared: &Shared, reply: &XferReply) {
    for outcome in &reply.outcomes {
        match &outcome.outcome {
            Outcome::Done => shared.metrics.send_done(),
            Outcome::Failed { cause, .. } => shared.metrics.send_failed(*cause),
        }
    }
}

/// Whether a line about what a peer sent that P refuses (a transfer request,
/// renewals without their key) may be written now (with how many were held
/// back since the last): at most one a second, whatever the peers send.
fn refusal_line_allowed(shared: &Shared) -> Option<u64> {
    shared.refusal_log.allow(Instant::now())
}

/// Where and under what a transfer request's writes go.
struct Target<'a> {
    endpoint: &'a Endpoint,
    grant: &'a Grant,
    geometry: PlanGeometry<'a>,
    /// Whether the two caches are laid out alike (blocks copy whole).
    whole_blocks: bool,
    /// The heads D asked for, mapped by token; `None`: whole blocks.
    heads: Option<HeadPlan<'a>>,
}

impl Target<'_> {
    /// Appends the writes of one piece of `request` (whole blocks: P's
    /// blocks and D's of the piece; mapped by heads: the tokens of D's
    /// blocks of the piece, from all of P's blocks of the request).
    fn plan(&self, piece: &Piece, request: &kv_proto::RequestBlocks, ops: &mut Vec<WriteOp>) -> Result<(), PlanError> {
        match &self.heads {
            Some(heads) => plan_heads_range(
                heads,
                &piece.local,
                &request.block_ids,
                request.first_token,
                piece.remote_range(),
                ops,
            ),
            None if self.whole_blocks || request.block_ids.is_empty() => {
                plan_request(&self.geometry, &piece.local, &piece.remote, ops)
            }
            None => Err(PlanError::Unmappable("decode asked for whole blocks, but the two caches differ".to_owned())),
        }
    }
}

/// The heads a transfer request asks for, for its log line.
fn heads_field(heads: Option<HeadRange>) -> String {
    heads.map_or_else(|| "whole blocks".to_owned(), |h| h.to_string())
}

/// Plans and writes one batch of pieces (their requests claimed, so P
/// holds their blocks) and hands the result to the core.
async fn write_batch(shared: &Shared, xfer_id: u64, target: &Target<'_>, core: &mut TransferCore, batch: Vec<Piece>) {
    let mut planned: Vec<(Piece, Vec<WriteOp>)> = Vec::with_capacity(batch.len());
    for piece in batch {
        if !core.is_being_written(piece.index) {
            continue;
        }
        let mut ops = Vec::new();
        match target.plan(&piece, &core.requests()[piece.index], &mut ops) {
            Ok(()) => planned.push((piece, ops)),
            Err(e) => {
                let req_id = core.requests()[piece.index].req_id.clone();
                tracing::warn!(xfer_id, %req_id, error = %e, "cannot plan transfer; blocks freed");
                core.end_writing(
                    piece.index,
                    failed(FailureCause::PlanFailed, e.to_string()),
                    &mut shared.lock_sender(),
                );
            }
        }
    }
    // A request that failed to plan sends none of its pieces.
    planned.retain(|(p, _)| core.is_being_written(p.index));
    let ops: Vec<WriteOp> = planned.iter().flat_map(|(_, ops)| ops.iter().copied()).collect();
    let pieces: Vec<Piece> = planned.into_iter().map(|(p, _)| p).collect();
    let written: Result<(), (FailureCause, String)> = if ops.is_empty() {
        Ok(())
    } else {
        let budget_end = tokio::time::Instant::from_std(core.budget_end());
        let shutting_down = || (FailureCause::Shutdown, "prefill worker shutting down".to_owned());
        async {
            // Bounded by D's budget: past it D has revoked the grant anyway.
            let slot = tokio::select! {
                () = shared.cancel.cancelled() => return Err(shutting_down()),
                () = tokio::time::sleep_until(budget_end) => return Err(TransferCore::budget_passed()),
                // The semaphore is never closed; a closed one would only lift the bound.
                slot = shared.transfer_slots.acquire() => slot.ok(),
            };
            let writing = Instant::now();
            if let Some(passed) = core.out_of_budget(writing) {
                return Err(passed);
            }
            // No more ops in one batch than decode's listener takes; the
            // batches go out one after another, the first failure ends them.
            let mut result = Ok(());
            for batch in ops.chunks(shared.config.max_ops_per_batch.max(1)) {
                let started = Instant::now();
                let bytes: u64 = batch.iter().map(|o| o.len).sum();
                result = tokio::select! {
                    () = shared.cancel.cancelled() => Err(shutting_down()),
                    r = tokio::time::timeout_at(budget_end, shared.writer.batch_write(target.endpoint, target.grant, batch)) => match r {
                        Ok(r) => r.map_err(|e| (write_cause(&e), e.to_string())),
                        Err(_) => Err(TransferCore::budget_passed()),
                    },
                };
                let took = started.elapsed();
                shared.metrics.batch_written(batch.len(), bytes, took, result.is_ok());
                tracing::debug!(xfer_id, peer = %target.endpoint, grant = %target.grant.id, ops = batch.len(), bytes, elapsed_us = took.as_micros() as u64, ok = result.is_ok(), "batch written");
                if result.is_err() {
                    break;
                }
            }
            drop(slot);
            result
        }
        .await
    };
    if let Err((cause, reason)) = &written {
        for p in &pieces {
            let req_id = &core.requests()[p.index].req_id;
            tracing::warn!(xfer_id, %req_id, peer = %target.endpoint, %cause, %reason, "sending KV failed; blocks freed, decode told");
        }
    }
    core.batch_written(&pieces, &written, &mut shared.lock_sender());
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
    }

    fn at(s: &str) -> SocketAddr {
        SocketAddr::new(ip(s), 9000)
    }

    #[rstest]
    #[case::same_address(&["10.0.0.5"], "10.0.0.5", &[], Some("10.0.0.5"))]
    #[case::v4_mapped_peer(&["10.0.0.5"], "::ffff:10.0.0.5", &[], Some("10.0.0.5"))]
    #[case::loopback_is_one_host(&["127.0.0.1"], "::1", &[], Some("127.0.0.1"))]
    #[case::third_host_refused(&["10.0.0.9"], "10.0.0.5", &[], None)]
    #[case::allowed_extra_nic(&["10.1.0.5"], "10.0.0.5", &["10.1.0.5"], Some("10.1.0.5"))]
    #[case::first_allowed_of_several(&["10.0.0.9", "10.0.0.5"], "10.0.0.5", &[], Some("10.0.0.5"))]
    #[case::loopback_endpoint_for_a_remote_peer_refused(&["127.0.0.1"], "10.0.0.5", &[], None)]
    fn endpoint_hosts(
        #[case] resolved: &[&str],
        #[case] peer: &str,
        #[case] extra: &[&str],
        #[case] expected: Option<&str>,
    ) {
        let resolved: Vec<SocketAddr> = resolved.iter().map(|s| at(s)).collect();
        let extra: Vec<IpAddr> = extra.iter().map(|s| ip(s)).collect();
        assert_eq!(allowed_address(&resolved, ip(peer), &extra), expected.map(at));
    }
}
