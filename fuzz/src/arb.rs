//! Building kv-proto values from fuzzer bytes (kv-proto implements no
//! `Arbitrary`): mostly small values, now and then values at or just past a
//! decoder's bound, so both sides of every bound are reached.

use std::time::Duration;

use arbitrary::{Result, Unstructured};
use kv_proto::{
    CacheLayout, Endpoint, EngineId, Grant, GrantId, HeadRange, Hello, HelloReply, KeepAlive, LayoutKind, Outcome,
    Protocol, RankTopology, RenewalKey, Renewing, ReqId, RequestBlocks, RequestOutcome, SideMessage, TokenLayout,
    XferProgress, XferReply, XferRequest, MAX_BLOCKS_PER_REQUEST, MAX_REGIONS, MAX_REQUESTS_PER_TRANSFER, MAX_TEXT_LEN,
};

/// Text: usually what the fuzzer gives, sometimes one character repeated to
/// just under, at or just over `MAX_TEXT_LEN` bytes.
pub(crate) fn text(u: &mut Unstructured<'_>) -> Result<String> {
    // `ratio` is true once the input is used up: the cheap case then.
    if u.ratio(15, 16)? {
        u.arbitrary()
    } else {
        let c: char = u.arbitrary()?;
        let target = MAX_TEXT_LEN - 4 + u.int_in_range(0..=8)?;
        Ok(std::iter::repeat_n(c, target.div_ceil(c.len_utf8())).collect())
    }
}

/// A vector: usually short; while the message's allowance `big` lasts (see
/// [`big_allowance`]), `len` within one of `max`, a repeated element, so the
/// decoder's element bound is met and exceeded.
fn vec<T: Clone>(
    u: &mut Unstructured<'_>,
    big: &mut bool,
    max: usize,
    mut element: impl FnMut(&mut Unstructured<'_>, &mut bool) -> Result<T>,
) -> Result<Vec<T>> {
    if *big && u.ratio(1, 2)? {
        *big = false;
        let len = max - 1 + u.int_in_range(0..=2)?;
        let one = element(u, big)?;
        return Ok(vec![one; len]);
    }
    let mut out = Vec::new();
    u.arbitrary_loop(None, Some(64), |u| {
        out.push(element(u, big)?);
        Ok(std::ops::ControlFlow::Continue(()))
    })?;
    Ok(out)
}

/// Whether one vector of a message may be huge: for one message in 128
/// (a huge message and its worst reply take tens of milliseconds to build,
/// encode and decode; the few such inputs the fuzzer keeps cover the bounds).
fn big_allowance(u: &mut Unstructured<'_>) -> Result<bool> {
    Ok(!u.ratio(127, 128)?)
}

fn protocol(u: &mut Unstructured<'_>) -> Result<Protocol> {
    Ok(*u.choose(&[Protocol::Tcp, Protocol::Quic, Protocol::Rdma])?)
}

fn layout(u: &mut Unstructured<'_>) -> Result<CacheLayout> {
    Ok(CacheLayout {
        kind: *u.choose(&[LayoutKind::SplitKv, LayoutKind::Fused, LayoutKind::Mla, LayoutKind::FusedRows])?,
        region_count: u.arbitrary()?,
        block_len: u.arbitrary()?,
        block_tokens: u.arbitrary()?,
        dtype_bytes: u.arbitrary()?,
        token_layout: *u.choose(&[TokenLayout::Undeclared, TokenLayout::Nhd, TokenLayout::Hnd])?,
        block_heads: u.arbitrary()?,
    })
}

fn head_range(u: &mut Unstructured<'_>) -> Result<HeadRange> {
    Ok(HeadRange::new(u.arbitrary()?, u.arbitrary()?))
}

fn topology(u: &mut Unstructured<'_>) -> Result<RankTopology> {
    Ok(RankTopology {
        tp_size: u.arbitrary()?,
        tp_rank: u.arbitrary()?,
        pp_size: u.arbitrary()?,
        pp_rank: u.arbitrary()?,
        num_kv_heads: u.arbitrary()?,
        heads: head_range(u)?,
    })
}

fn duration(u: &mut Unstructured<'_>) -> Result<Duration> {
    Ok(Duration::new(u.arbitrary()?, u.int_in_range(0..=999_999_999)?))
}

pub(crate) fn req_id(u: &mut Unstructured<'_>) -> Result<ReqId> {
    Ok(ReqId::new(text(u)?))
}

fn outcome(u: &mut Unstructured<'_>) -> Result<Outcome> {
    Ok(if u.arbitrary()? {
        Outcome::Done
    } else {
        Outcome::Failed { cause: kv_proto::FailureCause::from_code(u.arbitrary()?), reason: text(u)? }
    })
}

fn endpoint(u: &mut Unstructured<'_>) -> Result<Endpoint> {
    Ok(Endpoint { protocol: protocol(u)?, address: text(u)?, details: u.arbitrary()? })
}

fn grant(u: &mut Unstructured<'_>) -> Result<Grant> {
    Ok(Grant { id: GrantId::from_bytes(u.arbitrary()?), details: u.arbitrary()? })
}

/// A transfer request.
pub(crate) fn xfer_request(u: &mut Unstructured<'_>) -> Result<XferRequest> {
    let big = &mut big_allowance(u)?;
    Ok(XferRequest {
        xfer_id: u.arbitrary()?,
        endpoint: endpoint(u)?,
        grant: grant(u)?,
        wait_budget: duration(u)?,
        region_base_addrs: vec(u, big, MAX_REGIONS, |u, _| u.arbitrary())?,
        requests: vec(u, big, MAX_REQUESTS_PER_TRANSFER, |u, big| {
            Ok(RequestBlocks {
                req_id: req_id(u)?,
                decode_req_id: if u.arbitrary()? { Some(req_id(u)?) } else { None },
                prefill_engine_id: if u.arbitrary()? { Some(EngineId::new(text(u)?)) } else { None },
                block_ids: vec(u, big, MAX_BLOCKS_PER_REQUEST, |u, _| u.arbitrary())?,
                first_token: u.arbitrary()?,
                may_precede_prefill: u.arbitrary()?,
            })
        })?,
        heads: if u.arbitrary()? { Some(head_range(u)?) } else { None },
        piece_blocks: u.arbitrary()?,
    })
}

/// Any side-channel message.
pub(crate) fn side_message(u: &mut Unstructured<'_>) -> Result<SideMessage> {
    Ok(match u.int_in_range(0..=7)? {
        0 => SideMessage::Hello(Hello {
            client_nonce: u.arbitrary()?,
            engine_id: EngineId::new(text(u)?),
            protocol: protocol(u)?,
            layout: layout(u)?,
            identity: kv_proto::ModelIdentity {
                model: text(u)?,
                config_hash: text(u)?,
                kv_dtype: text(u)?,
                cache_dtype: text(u)?,
                num_layers: u.arbitrary()?,
                num_kv_heads: u.arbitrary()?,
                head_size: u.arbitrary()?,
                attention_layout: text(u)?,
                tp_size: u.arbitrary()?,
                pp_size: u.arbitrary()?,
                engine_version: text(u)?,
                kvlink_version: text(u)?,
            },
            topology: topology(u)?,
        }),
        1 => SideMessage::HelloReply(match u.int_in_range(0..=2)? {
            0 => HelloReply::Accepted {
                engine_id: EngineId::new(text(u)?),
                idle_timeout: duration(u)?,
                lease_renewal: duration(u)?,
                topology: topology(u)?,
                layout: layout(u)?,
            },
            1 => HelloReply::Challenge { server_nonce: u.arbitrary()?, server_proof: u.arbitrary()? },
            _ => HelloReply::Rejected { reason: text(u)? },
        }),
        2 => SideMessage::XferRequest(xfer_request(u)?),
        3 => {
            let big = &mut big_allowance(u)?;
            SideMessage::XferReply(XferReply {
                xfer_id: u.arbitrary()?,
                outcomes: vec(u, big, MAX_REQUESTS_PER_TRANSFER, |u, _| {
                    Ok(RequestOutcome { req_id: req_id(u)?, outcome: outcome(u)? })
                })?,
            })
        }
        4 => SideMessage::AuthProof(u.arbitrary()?),
        5 => {
            let big = &mut big_allowance(u)?;
            SideMessage::KeepAlive(KeepAlive {
                renewals: vec(u, big, MAX_REQUESTS_PER_TRANSFER, |u, _| {
                    Ok(Renewing { req_id: req_id(u)?, key: RenewalKey::from_bytes(u.arbitrary()?) })
                })?,
            })
        }
        6 => SideMessage::XferRefused { xfer_id: u.arbitrary()?, reason: text(u)? },
        _ => SideMessage::XferProgress(XferProgress {
            xfer_id: u.arbitrary()?,
            req_id: req_id(u)?,
            landed: u.arbitrary()?,
            outcome: if u.arbitrary()? { Some(outcome(u)?) } else { None },
        }),
    })
}

/// Whether every field of `msg` is within the bounds its decoder enforces.
pub(crate) fn within_bounds(msg: &SideMessage) -> bool {
    let text = |s: &str| s.len() <= MAX_TEXT_LEN;
    match msg {
        SideMessage::Hello(h) => {
            let id = &h.identity;
            [&id.model, &id.config_hash, &id.kv_dtype, &id.cache_dtype, &id.attention_layout, &id.engine_version]
                .iter()
                .chain([&&id.kvlink_version])
                .all(|t| text(t))
                && text(h.engine_id.as_str())
        }
        SideMessage::HelloReply(HelloReply::Accepted { engine_id, .. }) => text(engine_id.as_str()),
        SideMessage::HelloReply(HelloReply::Challenge { .. }) | SideMessage::AuthProof(_) => true,
        SideMessage::HelloReply(HelloReply::Rejected { reason }) | SideMessage::XferRefused { reason, .. } => {
            text(reason)
        }
        SideMessage::XferRequest(r) => {
            text(&r.endpoint.address)
                && r.region_base_addrs.len() <= MAX_REGIONS
                && r.requests.len() <= MAX_REQUESTS_PER_TRANSFER
                && r.requests.iter().all(|b| {
                    text(b.req_id.as_str())
                        && b.decode_req_id.as_ref().is_none_or(|id| text(id.as_str()))
                        && b.prefill_engine_id.as_ref().is_none_or(|e| text(e.as_str()))
                        && b.block_ids.len() <= MAX_BLOCKS_PER_REQUEST
                })
        }
        SideMessage::KeepAlive(k) => {
            k.renewals.len() <= MAX_REQUESTS_PER_TRANSFER && k.renewals.iter().all(|r| text(r.req_id.as_str()))
        }
        SideMessage::XferProgress(p) => {
            text(p.req_id.as_str())
                && match &p.outcome {
                    None | Some(Outcome::Done) => true,
                    Some(Outcome::Failed { reason, .. }) => text(reason),
                }
        }
        SideMessage::XferReply(r) => {
            r.outcomes.len() <= MAX_REQUESTS_PER_TRANSFER
                && r.outcomes.iter().all(|o| {
                    text(o.req_id.as_str())
                        && match &o.outcome {
                            Outcome::Done => true,
                            Outcome::Failed { reason, .. } => text(reason),
                        }
                })
        }
    }
}
