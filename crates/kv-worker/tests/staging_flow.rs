//! The staging flow's decisions, step by step, with explicit time: what the
//! worker is told (slots), which copies the engine runs, what the engine
//! hears (its own blocks), and that every slot comes back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kv_proto::{ConnectorMetadata, FailureCause, RecvReqMeta, RemotePrefill, ReqId, SendUpdate};
use kv_worker::staging::{stages, CopyDirection, StagedStep, StagingCore};
use kv_worker::{Finished, PullProgress, Settled};

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
        remote_renewal_key: None,
        bootstrap: None,
    }
}

fn recv(pulls: &[(&str, &[u32])]) -> ConnectorMetadata {
    let reqs_to_recv = pulls
        .iter()
        .map(|(req, blocks)| {
            (r(req), RecvReqMeta { local_block_ids: blocks.to_vec(), first_token: None, remote: remote(req) })
        })
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
    assert_eq!(step.staged_sends, [(r("a"), vec![0, 1], 2)], "the worker sends it from its slots");
    assert_eq!(step.finished.sending, BTreeSet::from([r("a")]), "the device blocks are free once copied");
    assert_eq!(core.pool().free(), 2, "the slots hold it for the pull");

    let step = core.worker_finished(sent("a"), t0);
    assert!(step.finished.is_empty(), "reported to the engine once");
    assert_eq!(core.pool().free(), 4);
}

#[test]
fn p_fails_a_request_that_finds_no_slots_within_the_bound() {
    let t0 = Instant::now();
    // "a" is staged ahead of its pull while room for the largest stays
    // free; "b" waits for that room.
    let mut core = StagingCore::new(4, WAIT);
    let step = core.start_load_kv(&ready(&[("a", &[1, 2]), ("b", &[3])]), t0);
    assert_eq!(step.copies.len(), 1);
    let step = core.worker_finished(Finished::default(), t0 + WAIT);
    assert_eq!(step.fail_sends, [(r("b"), FailureCause::StagingExhausted)], "its pull is answered staging_exhausted");
    assert_eq!(step.finished.sending, BTreeSet::from([r("b")]), "the engine frees its blocks");
    let step = core.start_load_kv(&ready(&[("huge", &[1, 2, 3, 4, 5])]), t0);
    assert_eq!(step.fail_sends, [(r("huge"), FailureCause::StagingExhausted)]);
}

#[test]
fn p_forgetting_a_request_mid_copy_frees_its_slots_when_the_copy_ends() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(4, WAIT);
    let copy = core.start_load_kv(&ready(&[("a", &[1, 2])]), t0).copies[0].id;
    let forget = ConnectorMetadata {
        reqs_to_send: BTreeMap::from([(r("a"), SendUpdate::Forget)]),
        ..ConnectorMetadata::default()
    };
    let step = core.start_load_kv(&forget, t0);
    assert_eq!(step.to_worker.reqs_to_send.get(&r("a")), Some(&SendUpdate::Forget));
    let step = core.copies_done([copy], t0);
    assert!(step.to_worker.reqs_to_send.is_empty() && step.finished.is_empty());
    assert_eq!(core.pool().free(), 4);
    assert!(core.is_empty());
}

/// P copies a ready request into its slots ahead of its pull only while
/// room for the largest request stays free; a request whose pull is here
/// (before it was ready, or while it waited ahead) takes that room.
#[rstest::rstest]
#[case::ahead_it_waits(&[], &[])]
#[case::pulled_before_it_was_ready(&["b"], &["b"])]
#[case::pulled_while_it_waited_ahead(&[], &["b"])]
fn p_stages_a_pulled_request_in_the_room_kept_back(#[case] pulled_first: &[&str], #[case] pulled_then: &[&str]) {
    let t0 = Instant::now();
    let mut core = StagingCore::new(4, WAIT);
    core.pulls_arrived(pulled_first.iter().map(|q| r(q)), t0);
    let step = core.start_load_kv(&ready(&[("a", &[1, 2])]), t0);
    assert_eq!(step.copies.len(), 1, "a staged ahead: room for another of its size stays free");
    let mut step = core.start_load_kv(&ready(&[("b", &[3, 4])]), t0);
    let then = core.pulls_arrived(pulled_then.iter().map(|q| r(q)), t0);
    step.copies.extend(then.copies);
    let pulled = !pulled_first.is_empty() || !pulled_then.is_empty();
    let staged: Vec<Vec<(u32, u32)>> = step.copies.iter().map(|c| c.pairs.clone()).collect();
    let want: Vec<Vec<(u32, u32)>> = if pulled { vec![vec![(3, 2), (4, 3)]] } else { vec![] };
    assert_eq!(staged, want);
    assert_eq!(core.pool().free(), if pulled { 0 } else { 2 });
    assert_eq!(core.counts().waits, u64::from(pulled_first.is_empty()));
}

fn progress(req: &str, landed: u32, ended: Option<Result<(), FailureCause>>) -> Vec<PullProgress> {
    vec![PullProgress { req: r(req), landed, ended }]
}

/// P, pieces of two blocks: a request of five is copied in three pieces
/// (`done`: the order they complete in); the worker hears how much of it
/// is in the slots as each piece completes in order (`staged`: after each,
/// `None` when nothing new), the engine hears it finished sending only
/// once every piece is done, and the slots come back once the worker is
/// done with them.
#[rstest::rstest]
#[case::in_order(&[0, 1, 2], &[Some(2), Some(4), Some(5)])]
#[case::second_first(&[1, 0, 2], &[None, Some(4), Some(5)])]
#[case::last_first(&[2, 1, 0], &[None, None, Some(5)])]
fn p_copies_in_pieces_and_the_worker_sends_each_staged_prefix(
    #[case] done: &[usize],
    #[case] staged: &[Option<usize>],
) {
    let t0 = Instant::now();
    let mut core = StagingCore::new(10, WAIT).with_pieces(Some(2));
    let step = core.start_load_kv(&ready(&[("a", &[5, 6, 7, 8, 9])]), t0);
    let pairs: Vec<Vec<(u32, u32)>> = step.copies.iter().map(|c| c.pairs.clone()).collect();
    assert_eq!(pairs, [vec![(5, 0), (6, 1)], vec![(7, 2), (8, 3)], vec![(9, 4)]]);
    let ids: Vec<u64> = step.copies.iter().map(|c| c.id).collect();
    for (k, (&piece, &want)) in done.iter().zip(staged).enumerate() {
        let step = core.copies_done([ids[piece]], t0);
        let got = step.staged_sends.iter().map(|(_, slots, n)| {
            assert_eq!(slots, &[0, 1, 2, 3, 4]);
            *n
        });
        assert_eq!(got.collect::<Vec<_>>(), want.into_iter().collect::<Vec<_>>(), "after piece {piece}");
        let last = k + 1 == done.len();
        assert_eq!(step.finished.sending.contains(&r("a")), last, "device blocks free only once all are copied");
    }
    assert_eq!(core.pool().free(), 5, "the slots hold it for the pull");
    core.worker_finished(sent("a"), t0);
    assert_eq!(core.pool().free(), 10);
    assert!(core.is_empty());
}

/// P: a copy into the slots fails (the first or the second of two pieces):
/// the request fails `copy_failed` (its pull is answered failed), the
/// engine hears its blocks free once no copy reads them, and the slots come
/// back once no copy writes them and the worker (if it had the request)
/// let go of it.
#[rstest::rstest]
#[case::first_piece(0, false)]
#[case::second_piece_after_the_first_was_sent(1, true)]
fn p_a_failed_copy_fails_the_send_and_every_slot_comes_back(#[case] failing: usize, #[case] given: bool) {
    let t0 = Instant::now();
    let mut core = StagingCore::new(8, WAIT).with_pieces(Some(2));
    let ids: Vec<u64> = core.start_load_kv(&ready(&[("a", &[5, 6, 7, 8])]), t0).copies.iter().map(|c| c.id).collect();
    let other = ids[1 - failing];
    if given {
        let step = core.copies_done([other], t0);
        assert_eq!(step.staged_sends, [(r("a"), vec![0, 1, 2, 3], 2)]);
    }
    let step = core.copies_failed([ids[failing]], t0);
    assert_eq!(step.fail_sends, [(r("a"), FailureCause::CopyFailed)]);
    assert_eq!(core.counts().copies_failed_to_staging, 1);
    if !given {
        assert!(step.finished.sending.is_empty(), "the other copy still reads the device blocks");
        let step = core.copies_done([other], t0);
        assert!(step.staged_sends.is_empty(), "nothing more is sent of a failed request");
        assert_eq!(step.finished.sending, BTreeSet::from([r("a")]));
    } else {
        assert_eq!(step.finished.sending, BTreeSet::from([r("a")]));
        assert_eq!(core.pool().free(), 4, "the worker may still be sending from the slots");
        core.worker_finished(sent("a"), t0);
    }
    assert_eq!(core.pool().free(), 8);
    assert!(core.is_empty());
}

/// What happens to a pull of five blocks (pieces of two) in a D scenario.
#[derive(Clone, Copy, Debug)]
enum Ev {
    /// P says this many blocks landed (and maybe how it ends).
    Landed(u32, Option<Result<(), FailureCause>>),
    /// The k-th copy ordered in the scenario is done / failed.
    Done(usize),
    Fail(usize),
    /// The worker reports the pull (fenced): received / failed.
    Received,
    PullFailed,
    /// The engine cancels it.
    Cancel,
}

/// D: each piece P says landed is copied into the engine's blocks at once,
/// the rest once the pull is received (or P said it is done); the engine
/// hears the pull only once no copy into its blocks runs (received only if
/// every copy was done), never when cancelled; a copy failing while the
/// pull is still out cuts it short (`cut`: the worker fences it and never
/// reports it); the slots come back only once the pull is fenced and no
/// copy reads them; a pull the worker reported received is settled once
/// (`settled`: how it counts).
#[rstest::rstest]
#[case::pieces_then_received(&[Ev::Landed(2, None), Ev::Landed(4, None), Ev::Done(0), Ev::Done(1), Ev::Received, Ev::Done(2)], Some(true), Some(Settled::Copied), 3, false)]
#[case::received_while_a_piece_copies(&[Ev::Landed(2, None), Ev::Received, Ev::Done(1), Ev::Done(0)], Some(true), Some(Settled::Copied), 2, false)]
#[case::a_count_going_back_orders_nothing(&[Ev::Landed(4, None), Ev::Landed(2, None), Ev::Done(0), Ev::Received, Ev::Done(1)], Some(true), Some(Settled::Copied), 2, false)]
#[case::p_said_done_before_the_reply(&[Ev::Landed(2, None), Ev::Landed(0, Some(Ok(()))), Ev::Done(0), Ev::Done(1), Ev::Received], Some(true), Some(Settled::Copied), 2, false)]
#[case::p_said_failed_before_the_reply(&[Ev::Landed(2, None), Ev::Landed(2, Some(Err(FailureCause::CopyFailed))), Ev::Done(0), Ev::PullFailed], Some(false), None, 1, false)]
#[case::pull_failed_while_a_piece_copies(&[Ev::Landed(2, None), Ev::PullFailed, Ev::Done(0)], Some(false), None, 1, false)]
#[case::copy_failed_while_pulling(&[Ev::Landed(2, None), Ev::Landed(4, None), Ev::Fail(0), Ev::Done(1)], Some(false), None, 2, true)]
#[case::copy_failed_while_pulling_then_p_says_more(&[Ev::Landed(2, None), Ev::Fail(0), Ev::Landed(4, Some(Ok(())))], Some(false), None, 1, true)]
#[case::copy_failed_once_p_said_done(&[Ev::Landed(2, None), Ev::Landed(4, Some(Ok(()))), Ev::Fail(0), Ev::Done(1), Ev::Done(2), Ev::Received], Some(false), Some(Settled::CopyFailed), 3, false)]
#[case::copy_failed_after_p_said_failed(&[Ev::Landed(2, None), Ev::Landed(2, Some(Err(FailureCause::Other))), Ev::Fail(0), Ev::PullFailed], Some(false), None, 1, false)]
#[case::copy_failed_after_received(&[Ev::Received, Ev::Fail(0)], Some(false), Some(Settled::CopyFailed), 1, false)]
#[case::cancelled_while_a_piece_copies(&[Ev::Landed(2, None), Ev::Cancel, Ev::Done(0)], None, None, 1, false)]
#[case::cancelled_after_received_mid_copy(&[Ev::Received, Ev::Cancel, Ev::Done(0)], None, Some(Settled::Cancelled), 1, false)]
#[case::cancelled_after_a_copy_failed_mid_pull(&[Ev::Landed(2, None), Ev::Landed(4, None), Ev::Fail(1), Ev::Cancel, Ev::Done(0)], None, None, 2, true)]
fn d_copies_pieces_as_they_land_and_reports_only_when_safe(
    #[case] events: &[Ev],
    #[case] heard: Option<bool>,
    #[case] settled: Option<Settled>,
    #[case] copies_ordered: usize,
    #[case] cut: bool,
) {
    let t0 = Instant::now();
    let device = [10, 11, 12, 13, 14];
    let mut core = StagingCore::new(8, WAIT).with_pieces(Some(2));
    core.start_load_kv(&recv(&[("a", &device)]), t0);
    let mut ordered: Vec<u64> = Vec::new();
    let mut copied: Vec<u32> = Vec::new();
    let mut running: BTreeSet<u64> = BTreeSet::new();
    let mut fenced = false;
    let mut told: Option<bool> = None;
    let mut how: Vec<Settled> = Vec::new();
    let mut cut_short = 0;
    for &ev in events {
        let step = match ev {
            Ev::Landed(n, ended) => core.worker_progress(progress("a", n, ended)),
            Ev::Done(k) => {
                running.remove(&ordered[k]);
                core.copies_done([ordered[k]], t0)
            }
            Ev::Fail(k) => {
                running.remove(&ordered[k]);
                core.copies_failed([ordered[k]], t0)
            }
            Ev::Received => {
                assert_eq!(cut_short, 0, "the worker never reports a pull it cut short");
                fenced = true;
                core.worker_finished(received("a"), t0)
            }
            Ev::PullFailed => {
                assert_eq!(cut_short, 0, "the worker never reports a pull it cut short");
                fenced = true;
                let slots = vec![0, 1, 2, 3, 4];
                core.worker_finished(
                    Finished { failed_receiving: BTreeMap::from([(r("a"), slots)]), ..Finished::default() },
                    t0,
                )
            }
            Ev::Cancel => {
                fenced = true;
                let step = core.start_load_kv(&cancel("a"), t0);
                assert_eq!(
                    step.wait_for,
                    running.iter().copied().collect::<Vec<_>>(),
                    "the engine waits for what runs"
                );
                step
            }
        };
        if step.fail_pulls.contains(&r("a")) {
            assert!(!fenced, "{ev:?}: cut short once, only while out");
            // The driver fences it before the step's other orders apply.
            cut_short += 1;
            fenced = true;
        }
        for copy in &step.copies {
            assert_eq!(copy.direction, CopyDirection::ToDevice);
            ordered.push(copy.id);
            running.insert(copy.id);
            copied.extend(copy.pairs.iter().map(|&(d, _)| d));
        }
        if step.finished.receiving.contains(&r("a")) || step.finished.failed_receiving.contains_key(&r("a")) {
            assert!(running.is_empty(), "{ev:?}: heard while a copy into its blocks runs");
            assert!(told.is_none(), "heard twice");
            told = Some(step.finished.receiving.contains(&r("a")));
        }
        how.extend(step.settled.iter().map(|(_, h)| *h));
        if core.pool().free() == 8 {
            assert!(fenced && running.is_empty(), "{ev:?}: slots free while a peer or a copy may use them");
        }
    }
    assert_eq!(told, heard);
    assert_eq!(cut_short, usize::from(cut));
    assert_eq!(how, settled.into_iter().collect::<Vec<_>>());
    assert_eq!(ordered.len(), copies_ordered);
    if heard == Some(true) {
        assert_eq!(copied, device, "every block copied once, in order");
    }
    assert_eq!(core.pool().free(), 8, "every slot comes back");
    assert!(core.is_empty());
}

/// D, pieces of two, a pull of six blocks through six slots with "b"
/// waiting for two of them: the copy of the second piece fails while P is
/// still writing the pull (the first piece's copy done, or still running).
/// The worker is told at once to cut the pull short (fenced before anything
/// else of the step applies: P's further writes are refused and P lets go
/// of it); the engine hears it failed once, once no copy into its blocks
/// runs; its slots come back (and go to "b") only in a step that fences it
/// or after one; nothing P says later orders a copy or a report.
#[rstest::rstest]
#[case::first_piece_copied(true)]
#[case::first_piece_still_copying(false)]
fn d_a_copy_failing_mid_pull_cuts_the_pull_short_and_fails_it_once(#[case] first_done: bool) {
    let t0 = Instant::now();
    let mut core = StagingCore::new(6, WAIT).with_pieces(Some(2));
    let step = core.start_load_kv(&recv(&[("a", &[10, 11, 12, 13, 14, 15])]), t0);
    assert_eq!(slots_of(&step, "a"), [0, 1, 2, 3, 4, 5]);
    let step = core.start_load_kv(&recv(&[("b", &[20, 21])]), t0);
    assert!(step.to_worker.reqs_to_recv.is_empty(), "b waits for slots");

    let first = core.worker_progress(progress("a", 2, None)).copies[0].id;
    let second = core.worker_progress(progress("a", 4, None)).copies[0].id;
    let t1 = t0 + Duration::from_millis(100);
    if first_done {
        let step = core.copies_done([first], t1);
        assert!(step.fail_pulls.is_empty() && step.finished.is_empty());
    }

    let step = core.copies_failed([second], t1);
    assert_eq!(step.fail_pulls, [r("a")], "the worker cuts the pull short at once");
    assert!(step.to_worker.reqs_to_cancel.is_empty(), "not an engine cancel: it counts failed");
    assert!(step.settled.is_empty(), "never reported by the worker, so never settled");
    assert_eq!(core.counts().copies_failed_to_device, 1);
    let mut heard = step.finished.failed_receiving.clone();
    let step = if first_done {
        step
    } else {
        assert!(heard.is_empty(), "not while the first piece's copy runs");
        assert!(step.to_worker.reqs_to_recv.is_empty(), "a's slots are read by the first piece's copy");
        assert_eq!(core.pool().free(), 0);
        let step = core.copies_done([first], t1);
        assert!(step.fail_pulls.is_empty(), "cut short once");
        heard = step.finished.failed_receiving.clone();
        step
    };
    assert_eq!(heard, BTreeMap::from([(r("a"), vec![10, 11, 12, 13, 14, 15])]), "failed once, every block");
    assert!(step.finished.receiving.is_empty());
    assert_eq!(slots_of(&step, "b"), [0, 1], "b gets a's slots once a is fenced");
    assert_eq!(core.pool().free(), 4);

    // What P said before it heard: no copy, no report.
    let step = core.worker_progress(progress("a", 6, Some(Ok(()))));
    assert!(step.copies.is_empty() && step.finished.is_empty() && step.fail_pulls.is_empty());
    // The engine's later cancel (it heard a failed) changes nothing.
    let step = core.start_load_kv(&cancel("a"), t1);
    assert!(step.wait_for.is_empty() && step.finished.is_empty());
    assert_eq!(stages(&core).get("pulling"), Some(&BTreeSet::from([r("b")])));
}

/// D fails a pull for lack of room (now or at its bound): the prefill
/// instance holding it is told to let go of it at once.
#[test]
fn d_tells_prefill_to_let_go_of_a_pull_it_cannot_stage() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(2, WAIT);
    let step = core.start_load_kv(&recv(&[("big", &[1, 2, 3])]), t0);
    assert_eq!(step.release_on_prefill, BTreeMap::from([(r("big"), remote("big"))]));
    core.start_load_kv(&recv(&[("a", &[1, 2]), ("b", &[3])]), t0);
    let step = core.worker_finished(Finished::default(), t0 + WAIT);
    assert_eq!(step.release_on_prefill, BTreeMap::from([(r("b"), remote("b"))]));
    let counts = core.counts();
    assert_eq!((counts.waits, counts.exhausted), (1, 2));
}

/// A notify-only pull goes through untouched and is heard (and counted)
/// as the worker reports it.
#[test]
fn a_notify_only_pull_is_reported_as_the_worker_reports_it() {
    let mut core = StagingCore::new(2, WAIT);
    core.start_load_kv(&recv(&[("a", &[])]), Instant::now());
    let step = core.worker_finished(received("a"), Instant::now());
    assert_eq!(step.finished.receiving, BTreeSet::from([r("a")]));
    assert_eq!(step.settled, [(r("a"), Settled::Copied)]);
}

/// An operation of the model below.
#[derive(Clone, Debug)]
enum Op {
    Pull(usize),
    Send(usize),
    Landed(usize, u32, u8),
    CopyEnds(usize, bool),
    WorkerEnds(usize, bool),
    Sent(usize),
    Cancel(usize),
    Tick(u64),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (0usize..3).prop_map(Op::Pull),
        (0usize..3).prop_map(Op::Send),
        (0usize..3, 0u32..4, 0u8..3).prop_map(|(i, n, e)| Op::Landed(i, n, e)),
        (0usize..8, proptest::bool::weighted(0.8)).prop_map(|(k, ok)| Op::CopyEnds(k, ok)),
        (0usize..3, proptest::bool::weighted(0.7)).prop_map(|(i, ok)| Op::WorkerEnds(i, ok)),
        (0usize..3).prop_map(Op::Sent),
        (0usize..3).prop_map(Op::Cancel),
        (1u64..4).prop_map(Op::Tick),
    ]
}

proptest::proptest! {
    /// Whatever happens in whatever order (pulls and sends through four
    /// slots in pieces, progress, copies done or failed, pulls ending either
    /// way, cancellations, waits running out): the engine hears a pull at
    /// most once, never while a copy into its blocks runs and never after
    /// cancelling it; and once every copy ended and the worker reported
    /// every request it holds, every slot is free and nothing is left.
    #[test]
    fn no_slot_leaks_and_no_report_while_a_copy_runs(ops in proptest::collection::vec(op(), 0..60)) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut core = StagingCore::new(4, WAIT).with_pieces(Some(1));
        let pulls = ["d0", "d1", "d2"];
        let sends = ["s0", "s1", "s2"];
        let mut copies: Vec<(u64, String)> = Vec::new();
        let mut heard: BTreeSet<String> = BTreeSet::new();
        let mut cancelled: BTreeSet<String> = BTreeSet::new();
        let mut started: BTreeSet<String> = BTreeSet::new();
        // What the worker holds: pulls it was given, sends it was handed.
        let mut pulling: BTreeSet<String> = BTreeSet::new();
        let mut sending: BTreeSet<String> = BTreeSet::new();
        let apply = |step: StagedStep,
                         copies: &mut Vec<(u64, String)>,
                         pulling: &mut BTreeSet<String>,
                         sending: &mut BTreeSet<String>,
                         heard: &mut BTreeSet<String>,
                         cancelled: &BTreeSet<String>| {
            for req in step.to_worker.reqs_to_recv.keys() {
                pulling.insert(req.as_str().to_owned());
            }
            for req in step.to_worker.reqs_to_cancel.iter() {
                pulling.remove(req.as_str());
            }
            for req in &step.fail_pulls {
                // Fenced by the worker, never reported by it.
                assert!(pulling.remove(req.as_str()), "{req} cut short while the worker does not hold it");
            }
            for (req, _, _) in &step.staged_sends {
                sending.insert(req.as_str().to_owned());
            }
            for c in &step.copies {
                assert!(!heard.contains(c.req.as_str()) || c.direction == CopyDirection::ToStaging, "a copy into blocks already handed back: {c:?}");
                copies.push((c.id, c.req.as_str().to_owned()));
            }
            let told = step.finished.receiving.iter().chain(step.finished.failed_receiving.keys());
            for req in told {
                let name = req.as_str().to_owned();
                assert!(!copies.iter().any(|(_, r)| *r == name), "{name} heard while a copy into its blocks runs");
                assert!(!cancelled.contains(&name), "{name} heard after it was cancelled");
                assert!(heard.insert(name.clone()), "{name} heard twice");
            }
        };
        for op in ops {
            let step = match op {
                Op::Pull(i) if started.insert(pulls[i].to_owned()) => {
                    core.start_load_kv(&recv(&[(pulls[i], &[10 + i as u32 * 3, 11 + i as u32 * 3])]), now)
                }
                Op::Send(i) if started.insert(sends[i].to_owned()) => {
                    core.start_load_kv(&ready(&[(sends[i], &[20 + i as u32 * 3, 21 + i as u32 * 3, 22 + i as u32 * 3])]), now)
                }
                Op::Landed(i, n, e) if pulling.contains(pulls[i]) => {
                    let ended = match e { 0 => None, 1 => Some(Ok(())), _ => Some(Err(FailureCause::Other)) };
                    core.worker_progress(progress(pulls[i], n, ended))
                }
                Op::CopyEnds(k, ok) if !copies.is_empty() => {
                    let (id, _) = copies.remove(k % copies.len());
                    if ok { core.copies_done([id], now) } else { core.copies_failed([id], now) }
                }
                Op::WorkerEnds(i, ok) if pulling.remove(pulls[i]) => {
                    let finished = if ok {
                        received(pulls[i])
                    } else {
                        Finished { failed_receiving: BTreeMap::from([(r(pulls[i]), vec![])]), ..Finished::default() }
                    };
                    core.worker_finished(finished, now)
                }
                Op::Sent(i) if sending.remove(sends[i]) => core.worker_finished(sent(sends[i]), now),
                Op::Cancel(i) if started.contains(pulls[i]) && !heard.contains(pulls[i]) => {
                    cancelled.insert(pulls[i].to_owned());
                    pulling.remove(pulls[i]);
                    let step = core.start_load_kv(&cancel(pulls[i]), now);
                    // The engine finishes what it must wait for at once.
                    let wait: Vec<u64> = step.wait_for.clone();
                    apply(step, &mut copies, &mut pulling, &mut sending, &mut heard, &cancelled);
                    copies.retain(|(id, _)| !wait.contains(id));
                    core.copies_done(wait, now)
                }
                Op::Tick(s) => {
                    now += Duration::from_secs(s);
                    core.worker_finished(Finished::default(), now)
                }
                _ => continue,
            };
            apply(step, &mut copies, &mut pulling, &mut sending, &mut heard, &cancelled);
        }
        // Wind down: copies end, the worker reports what it holds, waits run out.
        for _ in 0..20 {
            now += WAIT;
            let mut step = core.worker_finished(Finished::default(), now);
            while let Some((id, _)) = copies.first().cloned() {
                copies.remove(0);
                apply(step, &mut copies, &mut pulling, &mut sending, &mut heard, &cancelled);
                step = core.copies_done([id], now);
            }
            apply(step, &mut copies, &mut pulling, &mut sending, &mut heard, &cancelled);
            for req in std::mem::take(&mut pulling) {
                let step = core.worker_finished(received(&req), now);
                apply(step, &mut copies, &mut pulling, &mut sending, &mut heard, &cancelled);
            }
            for req in std::mem::take(&mut sending) {
                let step = core.worker_finished(sent(&req), now);
                apply(step, &mut copies, &mut pulling, &mut sending, &mut heard, &cancelled);
            }
            if copies.is_empty() && pulling.is_empty() && sending.is_empty() && core.is_empty() {
                break;
            }
        }
        proptest::prop_assert_eq!(core.pool().free(), 4, "every slot comes back: {:?}", stages(&core));
        proptest::prop_assert!(core.is_empty());
    }
}

/// P's scheduler hands each ready request's renewal key with its update:
/// while it is staged the worker holds it as expected, and must already
/// know its key, for the decode instance given its params renews it then.
#[test]
fn a_staged_request_keeps_its_renewal_key() {
    let t0 = Instant::now();
    let mut core = StagingCore::new(4, WAIT);
    let key = kv_proto::RenewalKey::from_bytes([0x2a; 16]);
    let mut meta = ready(&[("a", &[10, 11])]);
    meta.renewal_keys.insert(r("a"), key);
    let step = core.start_load_kv(&meta, t0);
    assert_eq!(step.to_worker.reqs_to_send.get(&r("a")), Some(&SendUpdate::Expect), "staged first");
    assert_eq!(step.to_worker.renewal_keys.get(&r("a")), Some(&key));
}
