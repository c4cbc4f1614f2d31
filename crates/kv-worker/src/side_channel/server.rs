//! P's side-channel server: accepts D's connections, checks the hello, admits
//! transfer requests on a bounded queue and answers each with one outcome per
//! request.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use futures_util::{SinkExt, StreamExt};
use kv_proto::auth::{self, Channel, Transcript};
use kv_proto::{
    BlockId, Endpoint, FrameCodec, Grant, Hello, HelloReply, Outcome, RequestOutcome, SideMessage, WriteOp, XferReply,
    XferRequest,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::codec::Framed;

use crate::config::{AuthSecret, DataEndpointPolicy};
use crate::plan::{plan_request, PlanGeometry};
use crate::sender::Claim;
use crate::side_channel::SideChannelCodec;
use crate::worker::Shared;

/// Accepts connections until the worker shuts down.
pub(crate) async fn run_listener(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            () = shared.cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                let conn_shared = shared.clone();
                shared.tracker.spawn(async move {
                    match serve_connection(conn_shared, stream, peer).await {
                        Ok(()) => tracing::debug!(%peer, "side-channel connection closed"),
                        Err(reason) => tracing::warn!(%peer, %reason, "side-channel connection dropped"),
                    }
                });
            }
            Err(e) => tracing::warn!(error = %e, "side-channel accept failed"),
        }
    }
}

fn check_hello(shared: &Shared, hello: &Hello) -> Result<(), String> {
    let ours = shared.cache.layout();
    let protocol = shared.writer.protocol();
    if hello.protocol != protocol {
        return Err(format!(
            "transport mismatch: decode {} uses {}, prefill {} uses {}",
            hello.engine_id, hello.protocol, shared.config.engine_id, protocol
        ));
    }
    if hello.layout != ours {
        return Err(format!(
            "cache layout mismatch: decode {} has {:?}, {} regions, block_len {}; prefill {} has {:?}, {} regions, block_len {}",
            hello.engine_id, hello.layout.kind, hello.layout.region_count, hello.layout.block_len,
            shared.config.engine_id, ours.kind, ours.region_count, ours.block_len
        ));
    }
    Ok(())
}

async fn serve_connection(shared: Arc<Shared>, stream: TcpStream, peer: SocketAddr) -> Result<(), String> {
    let mut framed = Framed::new(stream, SideChannelCodec(FrameCodec::new(shared.config.max_frame_len)));
    let first = tokio::select! {
        () = shared.cancel.cancelled() => return Ok(()),
        r = tokio::time::timeout(shared.config.connect_timeout, framed.next()) => r,
    };
    let hello = match first {
        Err(_) => return Err(format!("no hello within {:?}", shared.config.connect_timeout)),
        Ok(None) => return Ok(()),
        Ok(Some(Err(e))) => return Err(e.to_string()),
        Ok(Some(Ok(SideMessage::Hello(hello)))) => hello,
        Ok(Some(Ok(other))) => return Err(format!("expected hello, got {}", message_name(&other))),
    };
    if let Some(secret) = &shared.config.auth_secret {
        authenticate(&shared, secret, &hello, &mut framed).await?;
    }
    if let Err(reason) = check_hello(&shared, &hello) {
        tracing::error!(peer_engine = %hello.engine_id, %reason, "refusing decode instance");
        let _ = framed.send(SideMessage::HelloReply(HelloReply::Rejected { reason: reason.clone() })).await;
        return Err(reason);
    }
    framed
        .send(SideMessage::HelloReply(HelloReply::Accepted { engine_id: shared.config.engine_id.clone() }))
        .await
        .map_err(|e| e.to_string())?;
    tracing::debug!(peer_engine = %hello.engine_id, "decode instance connected");

    let (sink, mut stream) = framed.split();
    // Each transfer writes its own reply: no hand-off to a writer task.
    let sink = Arc::new(tokio::sync::Mutex::new(sink));
    loop {
        let next = tokio::select! {
            () = shared.cancel.cancelled() => return Ok(()),
            next = stream.next() => next,
        };
        let request = match next {
            None => return Ok(()),
            Some(Err(e)) => return Err(e.to_string()),
            Some(Ok(SideMessage::XferRequest(request))) => request,
            Some(Ok(other)) => return Err(format!("unexpected {} after hello", message_name(&other))),
        };
        let permit = tokio::select! {
            () = shared.cancel.cancelled() => return Ok(()),
            permit = shared.admission.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => return Ok(()),
            },
        };
        let received_at = Instant::now();
        let job_shared = shared.clone();
        let job_sink = sink.clone();
        shared.tracker.spawn(async move {
            let reply = serve_transfer(&job_shared, request, peer.ip(), received_at, permit).await;
            let xfer_id = reply.xfer_id;
            if let Err(e) = job_sink.lock().await.send(SideMessage::XferReply(reply)).await {
                tracing::warn!(xfer_id, error = %e, "cannot send transfer reply");
            }
        });
    }
}

/// Challenges D to prove the shared secret (and proves it to D); refuses
/// the connection unless D's proof matches.
async fn authenticate(
    shared: &Shared,
    secret: &AuthSecret,
    hello: &Hello,
    framed: &mut Framed<TcpStream, SideChannelCodec>,
) -> Result<(), String> {
    let Some(server_nonce) = auth::fresh_nonce() else {
        let reason = "no OS randomness for the side-channel nonce".to_owned();
        let _ = framed.send(SideMessage::HelloReply(HelloReply::Rejected { reason: reason.clone() })).await;
        return Err(reason);
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
    let answer = tokio::time::timeout(shared.config.connect_timeout, framed.next())
        .await
        .map_err(|_| format!("no authentication proof within {:?}", shared.config.connect_timeout))?;
    let proof = match answer {
        Some(Ok(SideMessage::AuthProof(proof))) => proof,
        Some(Ok(other)) => return Err(format!("expected an authentication proof, got {}", message_name(&other))),
        Some(Err(e)) => return Err(e.to_string()),
        None => return Err("closed during authentication".to_owned()),
    };
    if !auth::verify_client_proof(secret, &transcript, &proof) {
        tracing::error!(peer_engine = %hello.engine_id, "decode instance failed side-channel authentication");
        let reason = "side-channel authentication failed".to_owned();
        let _ = framed.send(SideMessage::HelloReply(HelloReply::Rejected { reason: reason.clone() })).await;
        return Err(reason);
    }
    Ok(())
}

fn message_name(msg: &SideMessage) -> &'static str {
    match msg {
        SideMessage::Hello(_) => "hello",
        SideMessage::HelloReply(_) => "hello reply",
        SideMessage::XferRequest(_) => "transfer request",
        SideMessage::XferReply(_) => "transfer reply",
        SideMessage::AuthProof(_) => "authentication proof",
    }
}

/// Why a claim gives no blocks to send, for the request's outcome.
fn claim_failure(claim: &Claim) -> Option<&'static str> {
    match claim {
        Claim::Ready(_) | Claim::NotReady => None,
        Claim::Unknown => Some("request unknown to prefill (never scheduled there, aborted, or already sent)"),
        Claim::Expired => Some("request's lease on prefill had ended; its blocks were freed"),
        Claim::InFlight => Some("request is already being sent to another pull"),
    }
}

fn failed(reason: impl Into<String>) -> Outcome {
    Outcome::Failed { reason: reason.into() }
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
    let allowed = resolved
        .iter()
        .find(|addr| same_host(addr.ip(), peer_ip) || extra.iter().any(|&ip| same_host(addr.ip(), ip)))
        .ok_or_else(|| {
            format!(
                "decode endpoint {endpoint} is not on the host the side channel came from ({peer_ip}) \
                 nor on the allowed list; refusing to write there"
            )
        })?;
    Ok(Endpoint { address: allowed.to_string(), ..endpoint.clone() })
}

/// Serves one transfer request: every request of it is claimed as soon as it
/// is ready on P (all at once when they are), and each group that becomes
/// ready is written at once, so one slow request cannot starve the others'
/// leases. Nothing is written once D's wait budget has passed.
async fn serve_transfer(
    shared: &Shared,
    request: XferRequest,
    peer_ip: IpAddr,
    received_at: Instant,
    _admitted: OwnedSemaphorePermit,
) -> XferReply {
    let XferRequest { xfer_id, endpoint, grant, wait_budget, region_base_addrs, requests } = request;
    let budget_end = received_at + wait_budget;
    let ready_wait_end = budget_end.min(received_at + shared.config.abort_request_timeout);
    let mut outcomes: Vec<Option<Outcome>> = vec![None; requests.len()];
    let endpoint = match checked_endpoint(shared, &endpoint, peer_ip).await {
        Ok(endpoint) => endpoint,
        Err(reason) => {
            tracing::error!(xfer_id, peer = %peer_ip, %reason, "refusing transfer request");
            let outcomes =
                requests.into_iter().map(|r| RequestOutcome { req_id: r.req_id, outcome: failed(&reason) }).collect();
            return XferReply { xfer_id, outcomes };
        }
    };
    let local_bases = shared.cache.base_addrs();
    let target = Target {
        endpoint: &endpoint,
        grant: &grant,
        budget_end,
        geometry: PlanGeometry {
            local_bases: &local_bases,
            remote_bases: &region_base_addrs,
            block_len: shared.cache.block_len(),
            local_num_blocks: shared.cache.num_blocks(),
        },
    };
    let mut pending: Vec<usize> = (0..requests.len()).collect();
    loop {
        let changed = shared.sender_changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let mut ready: Vec<(usize, Vec<BlockId>)> = Vec::new();
        {
            let mut sender = shared.lock_sender();
            let now = Instant::now();
            pending.retain(|&index| {
                let claim = sender.claim(&requests[index].req_id, now);
                match claim {
                    Claim::NotReady => true,
                    Claim::Ready(blocks) => {
                        ready.push((index, blocks));
                        false
                    }
                    other => {
                        outcomes[index] = claim_failure(&other).map(failed);
                        false
                    }
                }
            });
        }
        if !ready.is_empty() {
            write_ready(shared, xfer_id, &target, &requests, ready, &mut outcomes).await;
        }
        if pending.is_empty() {
            break;
        }
        let reason = tokio::select! {
            () = shared.cancel.cancelled() => Some("prefill worker shutting down".to_owned()),
            () = &mut changed => None,
            () = tokio::time::sleep_until(ready_wait_end.into()) => Some(if ready_wait_end == budget_end {
                format!("request not finished on prefill within decode's wait budget of {wait_budget:?}")
            } else {
                format!("request not finished on prefill within {:?}", shared.config.abort_request_timeout)
            }),
        };
        if let Some(reason) = reason {
            for index in pending.drain(..) {
                outcomes[index] = Some(failed(&reason));
            }
            break;
        }
    }
    shared.finished_changed.notify_waiters();
    let outcomes = requests
        .into_iter()
        .zip(outcomes)
        .map(|(r, outcome)| RequestOutcome {
            req_id: r.req_id,
            outcome: outcome.unwrap_or_else(|| failed("no outcome recorded")),
        })
        .collect();
    XferReply { xfer_id, outcomes }
}

/// Where and under what a transfer request's writes go.
struct Target<'a> {
    endpoint: &'a Endpoint,
    grant: &'a Grant,
    budget_end: Instant,
    geometry: PlanGeometry<'a>,
}

/// Plans and writes the requests that just became ready (claimed, so P holds
/// their blocks), as one batch; records each one's outcome and releases it.
async fn write_ready(
    shared: &Shared,
    xfer_id: u64,
    target: &Target<'_>,
    requests: &[kv_proto::RequestBlocks],
    ready: Vec<(usize, Vec<BlockId>)>,
    outcomes: &mut [Option<Outcome>],
) {
    let started = Instant::now();
    let mut ops: Vec<WriteOp> = Vec::new();
    let mut planned: Vec<usize> = Vec::with_capacity(ready.len());
    for (index, local_blocks) in ready {
        let before = ops.len();
        match plan_request(&target.geometry, &local_blocks, &requests[index].block_ids, &mut ops) {
            Ok(()) => planned.push(index),
            Err(e) => {
                ops.truncate(before);
                tracing::warn!(xfer_id, req_id = %requests[index].req_id, error = %e, "cannot plan transfer; blocks freed");
                outcomes[index] = Some(failed(e.to_string()));
                shared.lock_sender().complete(&requests[index].req_id);
            }
        }
    }
    let written: Result<(), String> = if ops.is_empty() {
        Ok(())
    } else {
        let budget_end = tokio::time::Instant::from_std(target.budget_end);
        let out_of_budget = || "decode's wait budget passed before the KV was written".to_owned();
        async {
            // Bounded by D's budget: past it D has revoked the grant anyway.
            let slot = tokio::select! {
                () = shared.cancel.cancelled() => return Err("prefill worker shutting down".to_owned()),
                () = tokio::time::sleep_until(budget_end) => return Err(out_of_budget()),
                // The semaphore is never closed; a closed one would only lift the bound.
                slot = shared.transfer_slots.acquire() => slot.ok(),
            };
            if Instant::now() >= target.budget_end {
                return Err(out_of_budget());
            }
            let bytes: u64 = ops.iter().map(|o| o.len).sum();
            let result = tokio::select! {
                () = shared.cancel.cancelled() => Err("prefill worker shutting down".to_owned()),
                r = tokio::time::timeout_at(budget_end, shared.writer.batch_write(target.endpoint, target.grant, &ops)) => match r {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(out_of_budget()),
                },
            };
            drop(slot);
            tracing::debug!(xfer_id, peer = %target.endpoint, grant = %target.grant.id, ops = ops.len(), bytes, elapsed_us = started.elapsed().as_micros() as u64, ok = result.is_ok(), "batch written");
            result
        }
        .await
    };
    let mut sender = shared.lock_sender();
    for index in planned {
        let req_id = &requests[index].req_id;
        sender.complete(req_id);
        outcomes[index] = Some(match &written {
            Ok(()) => Outcome::Done,
            Err(reason) => {
                tracing::warn!(xfer_id, req_id = %req_id, peer = %target.endpoint, %reason, "sending KV failed; blocks freed, decode told");
                failed(reason)
            }
        });
    }
    drop(sender);
    shared.sender_changed.notify_waiters();
    // Their blocks may be freed now, not when the whole transfer request ends.
    shared.finished_changed.notify_waiters();
}
