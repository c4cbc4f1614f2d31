//! The staging flow's decisions, step by step, with explicit time: what the
//! worker is told (slots), which copies the engine runs, what the engine
//! hears (its own blocks), and that every slot comes back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kv_proto::{ConnectorMetadata, RecvReqMeta, RemotePrefill, ReqId, SendUpdate};
use kv_worker::staging::{CopyDirection, StagedStep, StagingCore};
use kv_worker::Finished;

const WAIT: Duration = Duration::from_secs(5);

fn r(s: &str) -> ReqId {
    ReqId::new(s)
}

fn remote(req: &str) -> RemotePrefill {
    RemotePrefill {
        remote_host: "p".into(),
        remote_port: 9000,
        remote_request_id: ReqId::new(format!("p-{req}")),
        remote_engine_id: None,
    }
}

fn recv(pulls: &[(&str, &[u32])]) -> ConnectorMetadata {
    let reqs_to_recv = pulls
        .iter()
        .map(|(req, blocks)| (r(req), RecvReqMeta { local_block_ids: blocks.to_vec(), remote: remote(req) }))
        .collect();
    ConnectorMetadata { reqs_to_recv, ..ConnectorMetadata::default() }
}

fn ready(reqs: &[(&str, &[u32])]) -> ConnectorMetadata {
    let reqs_to_send =
        reqs.iter().map(|(req, blocks)| (r(req), SendUpdate::Ready { block_ids: blocks.to_vec() })).collect();
    ConnectorMetadata { reqs_to_send, ..ConnectorMetadata::default() }
}

fn cancel(req: &str) -> ConnectorMetadata {
    ConnectorMetadata { reqs_to_cancel: BTreeSet::from([r(req)]), ..ConnectorMetadata::default() }
}

fn received(req: &str) -> Finished {
    Finished { receiving: BTreeSet::from([r(req)]), ..Finished::default() }
}

fn sent(req: &str) -> Finished {
    Finished { sending: BTreeSet::from([r(req)]), ..Finished::default() }
}

fn slots_of(step: &StagedStep, req: &str) -> Vec<u32> {
    step.to_worker.reqs_to_recv[&r(req)].local_block_ids.clone()
}

#[test]
fn a_pull_lands_in_slots_and_is_reported_once_copied_to_the_device() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(4, WAIT);
    let step = core.start_load_kv(&recv(&[("a", &[10, 11])]), t0);
    assert_eq!(slots_of(&step, "a"), [0, 1], "the worker pulls into slots");
    assert!(step.copies.is_empty() && step.finished.receiving.is_empty());

    let step = core.worker_finished(received("a"), t0);
    assert_eq!(step.copies.len(), 1);
    let copy = &step.copies[0];
    assert_eq!((copy.direction, copy.pairs.clone()), (CopyDirection::ToDevice, vec![(10, 0), (11, 1)]));
    assert!(step.finished.receiving.is_empty(), "not before the copy is done");
    assert_eq!(core.pool().free(), 2);

    let step = core.copies_done([copy.id], t0);
    assert_eq!(step.finished.receiving, BTreeSet::from([r("a")]));
    assert_eq!(core.pool().free(), 4);
    assert!(core.is_empty());
}

#[test]
fn a_failed_pull_is_reported_with_the_device_blocks_at_once() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(4, WAIT);
    let step = core.start_load_kv(&recv(&[("a", &[10, 11])]), t0);
    let failed = Finished { failed_receiving: BTreeMap::from([(r("a"), slots_of(&step, "a"))]), ..Finished::default() };
    let step = core.worker_finished(failed, t0);
    assert_eq!(step.finished.failed_receiving, BTreeMap::from([(r("a"), vec![10, 11])]));
    assert!(step.copies.is_empty());
    assert_eq!(core.pool().free(), 4);
}

#[test]
fn a_pull_waits_for_slots_watched_then_starts_when_they_come_back() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(2, WAIT);
    let step = core.start_load_kv(&recv(&[("a", &[1, 2]), ("b", &[3, 4])]), t0);
    assert_eq!(step.to_worker.reqs_to_recv.keys().collect::<Vec<_>>(), [&r("a")]);
    assert_eq!(step.to_worker.reqs_to_watch.get(&r("b")), Some(&remote("b")), "P keeps holding b meanwhile");

    let copy = core.worker_finished(received("a"), t0).copies[0].id;
    let step = core.copies_done([copy], t0 + Duration::from_secs(1));
    assert_eq!(step.finished.receiving, BTreeSet::from([r("a")]));
    assert_eq!(slots_of(&step, "b"), [0, 1], "b starts with a's slots");
    assert!(!step.to_worker.reqs_to_watch.contains_key(&r("b")));
}

#[test]
fn a_pull_that_finds_no_slots_within_the_bound_fails_and_is_unwatched() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(2, WAIT);
    core.start_load_kv(&recv(&[("a", &[1, 2]), ("b", &[3])]), t0);
    let step = core.worker_finished(Finished::default(), t0 + WAIT - Duration::from_millis(1));
    assert!(step.finished.is_empty(), "still within its bound");
    let step = core.worker_finished(Finished::default(), t0 + WAIT);
    assert_eq!(step.finished.failed_receiving, BTreeMap::from([(r("b"), vec![3])]));
    assert_eq!(step.failed_before_pull, [r("b")]);
    assert!(step.to_worker.reqs_to_unwatch.contains(&r("b")));
    assert_eq!(core.pool().waiting(), 0);
}

#[test]
fn a_pull_larger_than_all_staging_fails_at_once() {
    let mut core = StagingCore::new(2, WAIT);
    let step = core.start_load_kv(&recv(&[("a", &[1, 2, 3])]), Instant::now());
    assert_eq!(step.finished.failed_receiving, BTreeMap::from([(r("a"), vec![1, 2, 3])]));
    assert!(step.to_worker.reqs_to_recv.is_empty());
}

#[test]
fn a_notify_only_pull_takes_no_slots() {
    let mut core = StagingCore::new(2, WAIT);
    let step = core.start_load_kv(&recv(&[("a", &[])]), Instant::now());
    assert_eq!(slots_of(&step, "a"), Vec::<u32>::new());
    assert_eq!(core.pool().free(), 2);
    assert!(core.is_empty());
}

/// Cancelled at each stage: nothing is reported, every slot comes back, and
/// a copy to the device in progress is one the engine must wait for.
#[rstest::rstest]
#[case::while_waiting("waiting")]
#[case::while_pulling("pulling")]
#[case::while_copying("copying")]
fn a_cancelled_pull_gives_its_slots_back_and_is_not_reported(#[case] stage: &str) {
    let t0 = Instant::now();
    let mut core = StagingCore::new(2, WAIT);
    core.start_load_kv(&recv(&[("x", &[7, 8])]), t0);
    core.start_load_kv(&recv(&[("a", &[1, 2])]), t0); // waits behind x
    let mut copy = None;
    if stage != "waiting" {
        let x_copy = core.worker_finished(received("x"), t0).copies[0].id;
        let step = core.copies_done([x_copy], t0);
        assert_eq!(slots_of(&step, "a"), [0, 1]);
    }
    if stage == "copying" {
        copy = Some(core.worker_finished(received("a"), t0).copies[0].id);
    }
    let step = core.start_load_kv(&cancel("a"), t0);
    assert!(step.to_worker.reqs_to_cancel.contains(&r("a")), "the worker fences it");
    assert_eq!(step.wait_for, copy.into_iter().collect::<Vec<_>>());
    let mut reported = step.finished.clone();
    if let Some(copy) = copy {
        reported = core.copies_done([copy], t0).finished;
    }
    assert!(!reported.receiving.contains(&r("a")) && !reported.failed_receiving.contains_key(&r("a")));
    // x still holds its slots only while it waits (case waiting), else all free.
    if stage == "waiting" {
        assert_eq!(core.pool().free(), 0);
        assert_eq!(core.pool().waiting(), 0);
    } else {
        assert_eq!(core.pool().free(), 2);
    }
}

#[test]
fn p_copies_a_finished_request_to_slots_then_frees_its_device_blocks() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(4, WAIT);
    let step = core.start_load_kv(&ready(&[("a", &[5, 6])]), t0);
    assert_eq!(step.to_worker.reqs_to_send.get(&r("a")), Some(&SendUpdate::Expect), "a pull waits for the copy");
    let copy = &step.copies[0];
    assert_eq!((copy.direction, copy.pairs.clone()), (CopyDirection::ToStaging, vec![(5, 0), (6, 1)]));
    assert!(step.finished.sending.is_empty());

    let step = core.copies_done([copy.id], t0);
    assert_eq!(step.to_worker.reqs_to_send.get(&r("a")), Some(&SendUpdate::Ready { block_ids: vec![0, 1] }));
    assert_eq!(step.finished.sending, BTreeSet::from([r("a")]), "the device blocks are free once copied");
    assert_eq!(core.pool().free(), 2, "the slots hold it for the pull");

    let step = core.worker_finished(sent("a"), t0);
    assert!(step.finished.is_empty(), "reported to the engine once");
    assert_eq!(core.pool().free(), 4);
}

#[test]
fn p_fails_a_request_that_finds_no_slots_within_the_bound() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(2, WAIT);
    let step = core.start_load_kv(&ready(&[("a", &[1, 2]), ("b", &[3])]), t0);
    assert_eq!(step.copies.len(), 1);
    let step = core.worker_finished(Finished::default(), t0 + WAIT);
    assert_eq!(step.fail_sends, [r("b")], "its pull is answered staging_exhausted");
    assert_eq!(step.finished.sending, BTreeSet::from([r("b")]), "the engine frees its blocks");
    let step = core.start_load_kv(&ready(&[("huge", &[1, 2, 3])]), t0);
    assert_eq!(step.fail_sends, [r("huge")]);
}

#[test]
fn p_forgetting_a_request_mid_copy_frees_its_slots_when_the_copy_ends() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(2, WAIT);
    let copy = core.start_load_kv(&ready(&[("a", &[1, 2])]), t0).copies[0].id;
    let forget = ConnectorMetadata {
        reqs_to_send: BTreeMap::from([(r("a"), SendUpdate::Forget)]),
        ..ConnectorMetadata::default()
    };
    let step = core.start_load_kv(&forget, t0);
    assert_eq!(step.to_worker.reqs_to_send.get(&r("a")), Some(&SendUpdate::Forget));
    let step = core.copies_done([copy], t0);
    assert!(step.to_worker.reqs_to_send.is_empty() && step.finished.is_empty());
    assert_eq!(core.pool().free(), 2);
    assert!(core.is_empty());
}
