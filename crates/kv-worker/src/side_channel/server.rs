//! P's side-channel server: accepts D's connections, checks the hello, admits
//! transfer requests on a bounded queue and answers each with one outcome per
//! request.

use std::sync::Arc;
use std::time::Instant;

use futures_util::{SinkExt, StreamExt};
use kv_proto::auth;
use kv_proto::{
    FrameCodec, Hello, HelloReply, Outcome, ReqId, RequestOutcome, SideMessage, WriteOp, XferReply, XferRequest,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::codec::Framed;

use crate::config::AuthSecret;
use crate::nonce;
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
                    match serve_connection(conn_shared, stream).await {
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

async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) -> Result<(), String> {
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
        let job_shared = shared.clone();
        let job_sink = sink.clone();
        shared.tracker.spawn(async move {
            let reply = serve_transfer(&job_shared, request, permit).await;
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
    let Some(server_nonce) = nonce::fresh() else {
        let reason = "no OS randomness for the side-channel nonce".to_owned();
        let _ = framed.send(SideMessage::HelloReply(HelloReply::Rejected { reason: reason.clone() })).await;
        return Err(reason);
    };
    let server_proof = auth::server_proof(secret.bytes(), &hello.client_nonce, &server_nonce);
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
    if !auth::proofs_match(&auth::client_proof(secret.bytes(), &server_nonce, &hello.client_nonce), &proof) {
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

/// Waits until `req` is ready on P (bounded by the lease), then claims it.
async fn claim_when_ready(shared: &Shared, req: &ReqId, deadline: tokio::time::Instant) -> Result<Vec<u32>, String> {
    loop {
        let changed = shared.sender_changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let claim = shared.lock_sender().claim(req, Instant::now());
        match claim {
            Claim::Ready(blocks) => return Ok(blocks),
            Claim::Unknown => {
                return Err("request unknown to prefill (never scheduled there, aborted, or already sent)".into())
            }
            Claim::Expired => return Err("request's lease on prefill had ended; its blocks were freed".into()),
            Claim::InFlight => return Err("request is already being sent to another pull".into()),
            Claim::NotReady => {}
        }
        tokio::select! {
            () = shared.cancel.cancelled() => return Err("prefill worker shutting down".into()),
            () = &mut changed => {}
            () = tokio::time::sleep_until(deadline) => {
                return Err(format!("request not finished on prefill within {:?}", shared.config.abort_request_timeout));
            }
        }
    }
}

async fn serve_transfer(shared: &Shared, request: XferRequest, _admitted: OwnedSemaphorePermit) -> XferReply {
    let XferRequest { xfer_id, endpoint, region_base_addrs, requests } = request;
    let started = Instant::now();
    let wait_deadline = tokio::time::Instant::now() + shared.config.abort_request_timeout;
    let mut outcomes: Vec<RequestOutcome> = Vec::with_capacity(requests.len());
    let mut claimed: Vec<usize> = Vec::with_capacity(requests.len());
    let mut ops: Vec<WriteOp> = Vec::new();
    let local_bases = shared.cache.base_addrs();
    let geometry = PlanGeometry {
        local_bases: &local_bases,
        remote_bases: &region_base_addrs,
        block_len: shared.cache.block_len(),
        local_num_blocks: shared.cache.num_blocks(),
    };
    let endpoint_error = (endpoint.protocol != shared.writer.protocol())
        .then(|| format!("decode endpoint uses {}, prefill uses {}", endpoint.protocol, shared.writer.protocol()));
    for (index, r) in requests.iter().enumerate() {
        if let Some(reason) = &endpoint_error {
            outcomes
                .push(RequestOutcome { req_id: r.req_id.clone(), outcome: Outcome::Failed { reason: reason.clone() } });
            continue;
        }
        let outcome = match claim_when_ready(shared, &r.req_id, wait_deadline).await {
            Err(reason) => Outcome::Failed { reason },
            Ok(local_blocks) => {
                let before = ops.len();
                match plan_request(&geometry, &local_blocks, &r.block_ids, &mut ops) {
                    Ok(()) => {
                        claimed.push(index);
                        Outcome::Done
                    }
                    Err(e) => {
                        ops.truncate(before);
                        shared.lock_sender().complete(&r.req_id);
                        tracing::warn!(xfer_id, req_id = %r.req_id, error = %e, "cannot plan transfer; blocks freed");
                        Outcome::Failed { reason: e.to_string() }
                    }
                }
            }
        };
        outcomes.push(RequestOutcome { req_id: r.req_id.clone(), outcome });
    }

    if !claimed.is_empty() {
        let write_result = if ops.is_empty() {
            Ok(())
        } else {
            // The semaphore is never closed; a closed one would only lift the bound.
            let _slot = shared.transfer_slots.acquire().await.ok();
            let bytes: u64 = ops.iter().map(|o| o.len).sum();
            let result = shared.writer.batch_write(&endpoint, &ops).await;
            tracing::debug!(xfer_id, peer = %endpoint, ops = ops.len(), bytes, elapsed_us = started.elapsed().as_micros() as u64, ok = result.is_ok(), "batch written");
            result
        };
        let mut sender = shared.lock_sender();
        for &index in &claimed {
            let req_id = &requests[index].req_id;
            sender.complete(req_id);
            if let Err(e) = &write_result {
                tracing::warn!(xfer_id, req_id = %req_id, peer = %endpoint, error = %e, "sending KV failed; blocks freed, decode told");
                outcomes[index].outcome = Outcome::Failed { reason: e.to_string() };
            }
        }
    }
    shared.sender_changed.notify_waiters();
    shared.finished_changed.notify_waiters();
    XferReply { xfer_id, outcomes }
}
