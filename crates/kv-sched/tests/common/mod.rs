//! Builders shared by the integration tests.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeSet;

use kv_proto::{
    BlockId, ConnectorMetadata, EngineId, KvRole, KvTransferParams, RecvReqMeta, RemotePrefill, RenewalKey,
    RenewalSecret, ReqId, SendUpdate,
};
use kv_sched::{ConnectorScheduler, EngineRequest, RequestStatus};

/// The remote prefill instance's side channel, as the proxy forwards it to D.
pub const P_HOST: &str = "10.0.0.1";
/// The remote prefill instance's side-channel base port.
pub const P_PORT: u16 = 8998;
/// The remote prefill engine's id.
pub const P_ENGINE: &str = "prefill-engine";
/// What the remote prefill engine calls every request of these tests: never
/// the id the instance under test has for it (real engines never share ids).
pub const P_REQ: &str = "p-internal-id";
/// The engine id of the instance under test.
pub const HERE_ENGINE: &str = "engine-under-test";
/// The side channel of the instance under test.
pub const HERE_HOST: &str = "10.0.0.9";
/// The side-channel base port of the instance under test.
pub const HERE_PORT: u16 = 7100;

pub fn sched(role: KvRole) -> ConnectorScheduler {
    ConnectorScheduler::new(role, EngineId::new(HERE_ENGINE), HERE_HOST, HERE_PORT, renewal_secret())
}

/// What the instance under test mints its renewal keys from.
pub fn renewal_secret() -> RenewalSecret {
    RenewalSecret::from_bytes([9; 32])
}

/// The renewal key the instance under test gives its request `id`.
pub fn renewal_key(id: &str) -> RenewalKey {
    renewal_secret().key_for(&ReqId::from(id))
}

/// The remote prefill's renewal key of every request of these tests.
pub fn p_renewal_key() -> RenewalKey {
    RenewalKey::from_bytes([0x70; 16])
}

/// Params as a proxy forwards them; those naming a prefill side channel
/// also carry what P returns with it (its id of the request, its engine).
pub fn params(prefill: bool, decode: bool, host: Option<&str>, port: Option<u16>) -> KvTransferParams {
    let from_prefill = host.is_some() && port.is_some();
    KvTransferParams {
        do_remote_prefill: prefill,
        do_remote_decode: decode,
        remote_host: host.map(str::to_owned),
        remote_port: port,
        remote_request_id: from_prefill.then(|| ReqId::from(P_REQ)),
        remote_engine_id: from_prefill.then(|| EngineId::new(P_ENGINE)),
        remote_renewal_key: from_prefill.then(p_renewal_key),
        ..KvTransferParams::default()
    }
}

/// The remote prefill, as D's metadata names it.
pub fn remote_p() -> RemotePrefill {
    RemotePrefill {
        remote_host: P_HOST.to_owned(),
        remote_port: P_PORT,
        remote_request_id: ReqId::from(P_REQ),
        remote_engine_id: Some(EngineId::new(P_ENGINE)),
        remote_renewal_key: Some(p_renewal_key()),
        bootstrap: None,
    }
}

/// D side: pull this request's KV from P.
pub fn pull_from_p() -> KvTransferParams {
    params(true, false, Some(P_HOST), Some(P_PORT))
}

/// D side, after the pull was recorded (`do_remote_prefill` cleared).
pub fn pulled_from_p() -> KvTransferParams {
    params(false, false, Some(P_HOST), Some(P_PORT))
}

/// P side: prefill here, decode elsewhere.
pub fn decode_elsewhere() -> KvTransferParams {
    params(false, true, None, None)
}

/// What a finished prefill tells the proxy about request `id`: pull it
/// from the instance under test, which calls it `id`.
pub fn points_here(id: &str) -> KvTransferParams {
    KvTransferParams {
        remote_request_id: Some(ReqId::from(id)),
        remote_engine_id: Some(EngineId::new(HERE_ENGINE)),
        remote_renewal_key: Some(renewal_key(id)),
        ..params(true, false, Some(HERE_HOST), Some(HERE_PORT))
    }
}

pub fn req(id: &str, prompt_len: usize, status: RequestStatus, params: Option<KvTransferParams>) -> EngineRequest {
    EngineRequest { request_id: ReqId::from(id), prompt_len, status, kv_transfer_params: params }
}

/// A pull from P of no blocks (P is only told).
pub fn recv_from_p(blocks: &[BlockId]) -> RecvReqMeta {
    RecvReqMeta { local_block_ids: blocks.to_vec(), first_token: None, remote: remote_p() }
}

/// A pull from P into `blocks`, which start at prompt token `first`.
pub fn recv_from_p_at(blocks: &[BlockId], first: u64) -> RecvReqMeta {
    RecvReqMeta { first_token: Some(first), ..recv_from_p(blocks) }
}

/// A step's metadata: on P, each request made ready comes with its renewal key.
pub fn meta(recvs: Vec<(&str, RecvReqMeta)>, sends: Vec<(&str, SendUpdate)>) -> ConnectorMetadata {
    ConnectorMetadata {
        renewal_keys: sends
            .iter()
            .filter(|(_, u)| matches!(u, SendUpdate::Ready { .. }))
            .map(|(id, _)| (ReqId::from(*id), renewal_key(id)))
            .collect(),
        reqs_to_recv: recvs.into_iter().map(|(id, m)| (ReqId::from(id), m)).collect(),
        reqs_to_send: sends.into_iter().map(|(id, u)| (ReqId::from(id), u)).collect(),
        ..ConnectorMetadata::default()
    }
}

pub fn cancelled(ids: &[&str]) -> ConnectorMetadata {
    ConnectorMetadata {
        reqs_to_cancel: ids.iter().map(|id| ReqId::from(*id)).collect(),
        ..ConnectorMetadata::default()
    }
}

pub fn ids(ids: &[&str]) -> BTreeSet<ReqId> {
    ids.iter().map(|id| ReqId::from(*id)).collect()
}

/// The metadata of a step that starts watching `ids` (pulled from P).
pub fn watched(ids: &[&str]) -> ConnectorMetadata {
    let remote = remote_p();
    ConnectorMetadata {
        reqs_to_watch: ids.iter().map(|id| (ReqId::from(*id), remote.clone())).collect(),
        ..ConnectorMetadata::default()
    }
}

pub fn empty() -> ConnectorMetadata {
    ConnectorMetadata::default()
}

pub fn ready(blocks: &[BlockId]) -> SendUpdate {
    SendUpdate::Ready { block_ids: blocks.to_vec() }
}
