//! The bootstrap flow (vLLM's Mooncake deployment since 0.16): the router
//! mints a transfer id and sends it to both instances; D learns P from
//! P's bootstrap server and names the request by the transfer id; P names
//! its send entry by it, reports it under its own id, and returns nothing.

mod common;

use std::collections::BTreeMap;

use common::*;
use kv_proto::{BootstrapTarget, EngineId, KvRole, KvTransferParams, RenewalKey, ReqId, SendUpdate};
use kv_sched::RequestStatus;
use kv_sched::RequestStatus::{FinishedAborted, FinishedLengthCapped, FinishedStopped, Waiting};
use rstest::rstest;

const BOOTSTRAP: &str = "http://10.0.0.1:8998";
const XFER: &str = "xfer-5a2ac7d6";

/// What the router sends P.
fn p_leg(transfer: &str) -> KvTransferParams {
    KvTransferParams { do_remote_decode: true, transfer_id: Some(transfer.into()), ..Default::default() }
}

/// What the router sends D.
fn d_leg() -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: true,
        transfer_id: Some(XFER.into()),
        remote_bootstrap_addr: Some(BOOTSTRAP.into()),
        remote_engine_id: Some(EngineId::new(P_ENGINE)),
        ..Default::default()
    }
}

#[test]
fn d_pulls_by_the_transfer_id_from_the_engine_its_bootstrap_server_names() {
    let mut s = sched(KvRole::Consumer);
    let mut r = req("d-1", 40, Waiting, Some(d_leg()));
    assert_eq!(s.get_num_new_matched_tokens(&r, 0), (40, true));
    s.update_state_after_alloc(&mut r, &[3, 4, 5], 40).unwrap();
    let meta = s.build_connector_meta();
    let pull = &meta.reqs_to_recv[&ReqId::from("d-1")];
    assert_eq!(pull.local_block_ids, vec![3, 4, 5]);
    assert_eq!(pull.remote.remote_request_id, ReqId::from(XFER));
    assert_eq!(pull.remote.remote_engine_id, Some(EngineId::new(P_ENGINE)));
    assert_eq!(
        pull.remote.bootstrap,
        Some(BootstrapTarget { url: BOOTSTRAP.into(), engine_id: EngineId::new(P_ENGINE) })
    );
    assert_eq!(pull.remote.remote_renewal_key, Some(RenewalKey::for_transfer(XFER)));
    assert_eq!((pull.remote.remote_host.as_str(), pull.remote.remote_port), ("", 0), "the worker learns them");
}

#[rstest]
#[case::no_transfer_id(KvTransferParams { transfer_id: None, ..d_leg() })]
#[case::no_bootstrap_server(KvTransferParams { remote_bootstrap_addr: None, ..d_leg() })]
#[case::no_engine(KvTransferParams { remote_engine_id: None, ..d_leg() })]
fn d_params_missing_one_of_the_three_are_served_locally(#[case] params: KvTransferParams) {
    let mut s = sched(KvRole::Consumer);
    let mut r = req("d-1", 40, Waiting, Some(params));
    assert_eq!(s.get_num_new_matched_tokens(&r, 0), (0, false));
    s.update_state_after_alloc(&mut r, &[], 0).unwrap();
    assert!(s.build_connector_meta().reqs_to_recv.is_empty());
}

#[test]
fn d_watches_the_request_under_the_transfer_id_until_it_pulls() {
    let mut s = sched(KvRole::Consumer);
    let r = req("d-1", 40, Waiting, Some(d_leg()));
    s.get_num_new_matched_tokens(&r, 0);
    let meta = s.build_connector_meta();
    let watch = &meta.reqs_to_watch[&ReqId::from("d-1")];
    assert_eq!(watch.remote_request_id, ReqId::from(XFER));
    assert!(watch.bootstrap.is_some());
}

/// P: the entry's name, its key and the engine's id of it, through a
/// request's life.
#[test]
fn p_names_the_entry_by_the_transfer_id_and_returns_nothing() {
    let mut s = sched(KvRole::Producer);
    let mut r = req("p-1", 32, Waiting, Some(p_leg(XFER)));
    s.update_state_after_alloc(&mut r, &[], 0).unwrap();
    let meta = s.build_connector_meta();
    assert_eq!(meta.reqs_to_send, BTreeMap::from([(ReqId::from(XFER), SendUpdate::Expect)]));
    assert_eq!(meta.send_names, BTreeMap::from([(ReqId::from(XFER), ReqId::from("p-1"))]));
    // D may renew before P's engine finishes it: its key goes with the Expect.
    assert_eq!(meta.renewal_keys, BTreeMap::from([(ReqId::from(XFER), RenewalKey::for_transfer(XFER))]));

    r.status = FinishedLengthCapped;
    let (delay, params) = s.request_finished(&mut r, &[7, 8]).unwrap();
    assert!(delay);
    assert_eq!(params, None, "the router already told D everything");
    let meta = s.build_connector_meta();
    assert_eq!(meta.reqs_to_send, BTreeMap::from([(ReqId::from(XFER), ready(&[7, 8]))]));
    assert_eq!(meta.renewal_keys, BTreeMap::from([(ReqId::from(XFER), RenewalKey::for_transfer(XFER))]));
    assert_eq!(s.live_transfer_names(), 1, "held until the engine reports it sent");
    s.sending_finished([&ReqId::from("p-1")]);
    assert_eq!(s.live_transfer_names(), 0);
}

#[rstest]
#[case::stopped(FinishedStopped)]
#[case::aborted(FinishedAborted)]
fn p_forgets_the_name_of_a_request_ended_without_a_send(#[case] status: RequestStatus) {
    let mut s = sched(KvRole::Producer);
    let mut r = req("p-1", 32, Waiting, Some(p_leg(XFER)));
    s.update_state_after_alloc(&mut r, &[], 0).unwrap();
    s.build_connector_meta();
    r.status = status;
    assert_eq!(s.request_finished(&mut r, &[7]).unwrap(), (false, None));
    let meta = s.build_connector_meta();
    assert_eq!(meta.reqs_to_send, BTreeMap::from([(ReqId::from(XFER), SendUpdate::Forget)]));
    assert_eq!(s.live_transfer_names(), 0);
}

#[test]
fn a_transfer_id_naming_a_live_request_cannot_name_another() {
    let mut s = sched(KvRole::Producer);
    let mut first = req("p-1", 32, Waiting, Some(p_leg(XFER)));
    let mut second = req("p-2", 32, Waiting, Some(p_leg(XFER)));
    s.update_state_after_alloc(&mut first, &[], 0).unwrap();
    s.update_state_after_alloc(&mut second, &[], 0).unwrap();
    let meta = s.build_connector_meta();
    assert_eq!(meta.send_names, BTreeMap::from([(ReqId::from(XFER), ReqId::from("p-1"))]));
    second.status = FinishedLengthCapped;
    assert_eq!(s.request_finished(&mut second, &[9]).unwrap(), (false, None), "freed at once, never held");
    assert!(s.build_connector_meta().reqs_to_send.is_empty());
    // Once the first is sent the id is free again.
    first.status = FinishedLengthCapped;
    s.request_finished(&mut first, &[7]).unwrap();
    s.sending_finished([&ReqId::from("p-1")]);
    let mut third = req("p-3", 32, Waiting, Some(p_leg(XFER)));
    s.update_state_after_alloc(&mut third, &[], 0).unwrap();
    assert_eq!(s.build_connector_meta().send_names[&ReqId::from(XFER)], ReqId::from("p-3"));
}

#[test]
fn requests_without_a_transfer_id_keep_the_older_flow() {
    let mut s = sched(KvRole::Producer);
    let mut r = req("p-1", 32, Waiting, Some(decode_elsewhere()));
    s.update_state_after_alloc(&mut r, &[], 0).unwrap();
    let meta = s.build_connector_meta();
    assert!(meta.send_names.is_empty());
    assert_eq!(meta.reqs_to_send, BTreeMap::from([(ReqId::from("p-1"), SendUpdate::Expect)]));
    r.status = FinishedLengthCapped;
    let (_, params) = s.request_finished(&mut r, &[7]).unwrap();
    assert_eq!(params.and_then(|p| p.remote_request_id), Some(ReqId::from("p-1")));
}
