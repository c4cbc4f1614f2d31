//! The sender and receiver cores, driven without sockets and with explicit time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kv_proto::{
    EngineId, FailureCause, GrantId, Outcome, RecvReqMeta, RemotePrefill, RenewalKey, Renewing, ReqId, RequestBlocks,
    RequestOutcome, SendUpdate, XferProgress, XferReply,
};
use kv_worker::{Claim, Puller, ReceiverCore, SenderCore, SideChannelAddr};
use rstest::rstest;

const LEASE: Duration = Duration::from_secs(480);
const RENEWAL: Duration = Duration::from_secs(10);

fn r(id: &str) -> ReqId {
    ReqId::new(id)
}

fn ready(blocks: &[u32]) -> SendUpdate {
    SendUpdate::Ready { block_ids: blocks.to_vec() }
}

/// Applies updates at `t0`, then claims at `t0 + after`.
#[rstest]
#[case::unknown_request_is_refused_not_done(&[], Duration::ZERO, Claim::Unknown)]
#[case::expected_but_not_finished_waits(&[SendUpdate::Expect], Duration::ZERO, Claim::NotReady)]
#[case::ready_is_claimed_with_its_blocks(&[SendUpdate::Expect, ready(&[4, 5])], Duration::ZERO, Claim::Ready(vec![4, 5]))]
#[case::ready_without_expect_is_claimed(&[ready(&[1])], Duration::ZERO, Claim::Ready(vec![1]))]
#[case::ready_just_before_lease_end(&[ready(&[1])], LEASE - Duration::from_millis(1), Claim::Ready(vec![1]))]
#[case::lease_ended_frees_blocks(&[ready(&[1])], LEASE, Claim::Expired)]
#[case::forgotten_before_ready_is_unknown(&[SendUpdate::Expect, SendUpdate::Forget], Duration::ZERO, Claim::Unknown)]
#[case::expect_after_ready_keeps_ready(&[ready(&[3]), SendUpdate::Expect], Duration::ZERO, Claim::Ready(vec![3]))]
fn sender_claims(#[case] updates: &[SendUpdate], #[case] after: Duration, #[case] expected: Claim) {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    for u in updates {
        core.handle_update(&r("a"), u, t0);
    }
    assert_eq!(core.claim(&r("a"), t0 + after), expected);
}

/// P fails a request it could not stage (at `t0`), then a pull claims it at
/// `t0 + after` (after a sweep at that time).
#[rstest]
#[case::a_pull_gets_the_cause(&[SendUpdate::Expect], Duration::ZERO, Claim::Failed(FailureCause::StagingExhausted))]
#[case::then_it_is_gone(&[SendUpdate::Expect], LEASE, Claim::Unknown)]
#[case::one_being_written_is_left_to_its_transfer(&[ready(&[1])], Duration::ZERO, Claim::InFlight)]
fn sender_failures(#[case] updates: &[SendUpdate], #[case] after: Duration, #[case] expected: Claim) {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    for u in updates {
        core.handle_update(&r("a"), u, t0);
    }
    if matches!(updates.last(), Some(SendUpdate::Ready { .. })) {
        assert!(matches!(core.claim(&r("a"), t0), Claim::Ready(_)));
    }
    core.fail(&r("a"), FailureCause::StagingExhausted, t0);
    assert!(core.handle_timeout(t0 + after).is_empty(), "a failed request is never reported finished");
    assert_eq!(core.claim(&r("a"), t0 + after), expected);
    assert!(core.poll_finished().is_empty(), "the engine freed it itself");
    if expected != Claim::InFlight {
        assert_eq!(core.claim(&r("a"), t0 + after), Claim::Unknown, "the cause is told once");
    }
}

/// A request made ready in pieces (`handle_staged`): a pull claims it once
/// its first piece is staged and may write what is staged; later pieces
/// let it write more; a failure mid-way stops it; a request P no longer
/// holds is never made ready again.
#[rstest]
#[case::claimed_then_staged_whole(&[2, 4], None, &[Some(Ok(2)), Some(Ok(4))])]
#[case::a_count_going_back_is_ignored(&[3, 1], None, &[Some(Ok(3)), Some(Ok(3))])]
#[case::failed_mid_way(&[2], Some(FailureCause::CopyFailed), &[Some(Ok(2)), Some(Err(FailureCause::CopyFailed))])]
fn a_request_staged_in_pieces_is_written_as_it_is_staged(
    #[case] staged: &[usize],
    #[case] fails: Option<FailureCause>,
    #[case] writable: &[Option<Result<usize, FailureCause>>],
) {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &SendUpdate::Expect, t0);
    core.handle_staged(&r("a"), &[5, 6, 7, 8], staged[0], t0);
    assert_eq!(core.claim(&r("a"), t0), Claim::Ready(vec![5, 6, 7, 8]), "claimed with its first piece staged");
    let mut got = vec![core.writable(&r("a"))];
    for &n in &staged[1..] {
        core.handle_staged(&r("a"), &[5, 6, 7, 8], n, t0);
        got.push(core.writable(&r("a")));
    }
    if let Some(cause) = fails {
        core.fail(&r("a"), cause, t0);
        got.push(core.writable(&r("a")));
    }
    assert_eq!(got, writable);
    assert!(core.poll_finished().is_empty(), "reported when its transfer ends");
    core.complete(&r("a"));
    assert_eq!(core.poll_finished().len(), 1);
    core.handle_staged(&r("a"), &[5, 6, 7, 8], 4, t0);
    assert_eq!(core.claim(&r("a"), t0), Claim::Unknown, "not made ready again once gone");
}

/// A ready request P then fails (a copy of its later pieces failed): its
/// owner hears it finished at once (it takes the blocks back), and a pull
/// gets the cause.
#[test]
fn a_ready_request_that_fails_is_reported_at_once_and_its_pull_gets_the_cause() {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &SendUpdate::Expect, t0);
    core.handle_staged(&r("a"), &[5, 6], 1, t0);
    core.fail(&r("a"), FailureCause::CopyFailed, t0);
    assert_eq!(core.poll_finished().into_iter().collect::<Vec<_>>(), [r("a")]);
    assert_eq!(core.claim(&r("a"), t0), Claim::Failed(FailureCause::CopyFailed));
}

#[test]
fn a_claimed_request_is_in_flight_until_completed_then_freed_once() {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &ready(&[1, 2]), t0);
    assert_eq!(core.claim(&r("a"), t0), Claim::Ready(vec![1, 2]));
    assert_eq!(core.claim(&r("a"), t0), Claim::InFlight, "a second pull does not send it twice");
    assert!(core.handle_timeout(t0 + 2 * LEASE).is_empty(), "an in-flight request has no lease");
    assert!(core.poll_finished().is_empty());
    core.complete(&r("a"));
    assert_eq!(core.poll_finished().into_iter().collect::<Vec<_>>(), vec![r("a")]);
    assert!(core.poll_finished().is_empty(), "reported once");
    assert_eq!(core.claim(&r("a"), t0), Claim::Unknown, "sent requests are gone");
    assert!(core.is_empty());
}

/// Several decode ranks pull one request from this prefill worker (each
/// its own heads): each claims it once, at once or one after another, and
/// it is freed once, when the last of them completed.
#[rstest]
#[case::one_after_another(false)]
#[case::at_once(true)]
fn a_request_several_decode_ranks_pull_is_freed_after_the_last(#[case] at_once: bool) {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &ready(&[1, 2]), t0);
    let (first, second) = (Puller { rank: 0, of: 2 }, Puller { rank: 1, of: 2 });
    assert_eq!(core.claim_by(&r("a"), first, t0), Claim::Ready(vec![1, 2]));
    assert_eq!(core.claim_by(&r("a"), first, t0), Claim::InFlight, "one rank pulls it once");
    if !at_once {
        core.complete(&r("a"));
        assert!(core.poll_finished().is_empty(), "the second rank has not pulled it");
    }
    assert_eq!(core.claim_by(&r("a"), second, t0), Claim::Ready(vec![1, 2]));
    assert_eq!(core.held(), (1, 2));
    if at_once {
        core.complete(&r("a"));
        assert!(core.poll_finished().is_empty(), "one pull still writes from its blocks");
    }
    core.complete(&r("a"));
    assert_eq!(core.poll_finished().into_iter().collect::<Vec<_>>(), vec![r("a")]);
    assert_eq!(core.claim_by(&r("a"), Puller { rank: 2, of: 2 }, t0), Claim::Unknown);
}

/// A request some decode ranks never pull is freed at its lease, but
/// never while one of them is writing from it.
#[test]
fn a_shared_request_keeps_its_lease_but_not_under_a_writer() {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &ready(&[1]), t0);
    assert_eq!(core.claim_by(&r("a"), Puller { rank: 0, of: 3 }, t0), Claim::Ready(vec![1]));
    assert!(core.handle_timeout(t0 + 2 * LEASE).is_empty(), "a pull is writing from it");
    core.complete(&r("a"));
    assert_eq!(core.claim_by(&r("a"), Puller { rank: 1, of: 3 }, t0 + LEASE), Claim::Expired);
    assert_eq!(core.poll_finished().into_iter().collect::<Vec<_>>(), vec![r("a")], "freed once, at its lease");
    assert_eq!(core.lease_expiries(), 1);
}

#[test]
fn lease_expiry_is_reported_as_finished_sending() {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &ready(&[1]), t0);
    core.handle_update(&r("b"), &ready(&[2]), t0 + Duration::from_secs(10));
    core.handle_update(&r("c"), &SendUpdate::Expect, t0);
    assert_eq!(core.next_deadline(), Some(t0 + LEASE));
    assert_eq!(core.handle_timeout(t0 + LEASE), vec![r("a")]);
    assert_eq!(core.poll_finished().into_iter().collect::<Vec<_>>(), vec![r("a")]);
    assert_eq!(core.len(), 2, "b is still leased, c still owned by the scheduler");
    assert_eq!(core.next_deadline(), Some(t0 + LEASE + Duration::from_secs(10)));
}

#[test]
fn forget_drops_the_entry_without_reporting_it() {
    // Defect 3 of the reference: an entry for a request that finished
    // without delay-free was kept forever.
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &SendUpdate::Expect, t0);
    core.handle_update(&r("a"), &SendUpdate::Forget, t0);
    assert!(core.is_empty());
    assert!(core.poll_finished().is_empty(), "the engine freed those blocks itself");
}

/// What happens to request `a` on P, at a time in seconds from the start.
#[derive(Clone, Debug)]
enum SendEvent {
    /// P's scheduler sends this update, with the request's renewal key.
    Update(SendUpdate),
    /// P's scheduler sends this update, and no renewal key.
    UpdateWithoutKey(SendUpdate),
    /// Decode instance `by` renews it, naming its renewal key.
    Renew(&'static str),
    /// Decode instance `by` renews it, naming a key that is not its own.
    RenewWithAnotherKey(&'static str),
    /// P renews on behalf of `by` (it makes `by`'s messages wait).
    RenewAllBy(&'static str),
    /// A pull claims it, and finds this.
    Claim(Claim),
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// The renewal key P's scheduler gave every request of these tests.
const KEY: RenewalKey = RenewalKey::from_bytes([0x4b; 16]);
/// A key no request here was given.
const OTHER_KEY: RenewalKey = RenewalKey::from_bytes([0x4c; 16]);

/// A renewal of `id` naming its key.
fn renewing(id: &str) -> Renewing {
    Renewing { req_id: r(id), key: KEY }
}

/// Renewals: once a decode instance renews a request, P holds it a renewal
/// past the last one, never past the lease; `freed` is whether it is freed
/// at `check_at`.
#[rstest]
#[case::renewed_is_held_until_a_renewal_after_the_last(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (5.0, SendEvent::Renew("d"))], 14.999, false)]
#[case::renewed_is_freed_a_renewal_after_the_last(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (5.0, SendEvent::Renew("d"))], 15.0, true)]
#[case::each_renewal_extends_the_hold(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (5.0, SendEvent::Renew("d")), (12.0, SendEvent::Renew("d"))], 21.0, false)]
#[case::a_renewal_never_extends_past_the_lease(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (475.0, SendEvent::Renew("d"))], 480.0, true)]
#[case::unrenewed_is_held_for_the_lease(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1])))], 479.0, false)]
#[case::a_renewal_before_ready_carries_over(RENEWAL, &[(0.0, SendEvent::Update(SendUpdate::Expect)), (1.0, SendEvent::Renew("d")), (5.0, SendEvent::Update(ready(&[1])))], 11.0, true)]
#[case::a_waiting_pull_takes_over_from_renewals(RENEWAL, &[(0.0, SendEvent::Update(SendUpdate::Expect)), (1.0, SendEvent::Renew("d")), (2.0, SendEvent::Claim(Claim::NotReady)), (60.0, SendEvent::Update(ready(&[1])))], 100.0, false)]
#[case::renewals_off(Duration::ZERO, &[(0.0, SendEvent::Update(ready(&[1]))), (1.0, SendEvent::Renew("d"))], 20.0, false)]
#[case::p_renews_for_the_instance_it_keeps_waiting(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (1.0, SendEvent::Renew("d1")), (9.0, SendEvent::RenewAllBy("d1"))], 18.0, false)]
#[case::p_renews_only_for_that_instance(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (1.0, SendEvent::Renew("d1")), (9.0, SendEvent::RenewAllBy("d2"))], 11.0, true)]
#[case::p_renewing_never_starts_a_hold(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (9.0, SendEvent::RenewAllBy("d"))], 100.0, false)]
// The attack run's hole: another decode instance's renewal cut the owner's
// hold short. Whichever renews first, a second one makes the request
// contested: held for its whole lease, renewals no longer counting.
#[case::another_instance_cannot_cut_the_owners_hold_short(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (5.0, SendEvent::Renew("owner")), (6.0, SendEvent::Renew("other")), (14.0, SendEvent::RenewAllBy("owner"))], 20.0, false)]
#[case::another_instance_renewing_first_cannot_cut_it_short(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (1.0, SendEvent::Renew("other")), (5.0, SendEvent::Renew("owner"))], 30.0, false)]
#[case::a_contested_request_is_held_for_its_lease(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (5.0, SendEvent::Renew("owner")), (6.0, SendEvent::Renew("other"))], 479.0, false)]
#[case::a_contested_request_is_freed_at_its_lease(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (5.0, SendEvent::Renew("owner")), (6.0, SendEvent::Renew("other")), (400.0, SendEvent::Renew("owner"))], 480.0, true)]
#[case::contested_before_ready_still_holds_for_the_lease(RENEWAL, &[(0.0, SendEvent::Update(SendUpdate::Expect)), (1.0, SendEvent::Renew("other")), (2.0, SendEvent::Renew("owner")), (5.0, SendEvent::Update(ready(&[1])))], 400.0, false)]
// Only the decode instance given the request's params (its renewal key)
// renews it: anyone else's renewal moves nothing, whenever it comes.
#[case::a_renewal_without_the_key_does_not_shorten_the_hold(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (1.0, SendEvent::RenewWithAnotherKey("stranger"))], 479.0, false)]
#[case::a_renewal_without_the_key_does_not_take_the_request(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (1.0, SendEvent::RenewWithAnotherKey("stranger")), (5.0, SendEvent::Renew("owner")), (12.0, SendEvent::Renew("owner"))], 21.0, false)]
#[case::the_keyed_owner_still_frees_it_early(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (1.0, SendEvent::RenewWithAnotherKey("stranger")), (5.0, SendEvent::Renew("owner"))], 15.0, true)]
#[case::a_request_given_no_key_is_never_renewed(RENEWAL, &[(0.0, SendEvent::UpdateWithoutKey(ready(&[1]))), (1.0, SendEvent::Renew("d"))], 479.0, false)]
#[case::a_key_given_before_ready_carries_over(RENEWAL, &[(0.0, SendEvent::Update(SendUpdate::Expect)), (5.0, SendEvent::UpdateWithoutKey(ready(&[1]))), (6.0, SendEvent::Renew("d"))], 16.0, true)]
#[case::a_claimed_request_ignores_renewals(RENEWAL, &[(0.0, SendEvent::Update(ready(&[1]))), (1.0, SendEvent::Claim(Claim::Ready(vec![1]))), (2.0, SendEvent::Renew("d"))], 100.0, false)]
fn sender_renewals(
    #[case] renewal: Duration,
    #[case] events: &[(f64, SendEvent)],
    #[case] check_at: f64,
    #[case] freed: bool,
) {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, renewal);
    for (at, event) in events {
        let now = t0 + secs(*at);
        match event {
            SendEvent::Update(u) => {
                core.handle_update(&r("a"), u, now);
                core.set_renewal_key(&r("a"), KEY);
            }
            SendEvent::UpdateWithoutKey(u) => core.handle_update(&r("a"), u, now),
            SendEvent::Renew(by) => {
                core.renew(&[renewing("a")], &EngineId::new(*by), now);
            }
            SendEvent::RenewWithAnotherKey(by) => {
                core.renew(&[Renewing { key: OTHER_KEY, ..renewing("a") }], &EngineId::new(*by), now);
            }
            SendEvent::RenewAllBy(by) => {
                core.renew_all_by(&EngineId::new(*by), now);
            }
            SendEvent::Claim(expected) => assert_eq!(&core.claim(&r("a"), now), expected),
        }
    }
    assert_eq!(core.handle_timeout(t0 + secs(check_at)).contains(&r("a")), freed);
    if !freed {
        let deadline = core.next_deadline();
        assert!(deadline.is_none_or(|d| d > t0 + secs(check_at)), "the driver's timer points past the check");
    }
}

#[test]
fn a_renewal_from_another_instance_contests_the_request() {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &ready(&[1]), t0);
    core.set_renewal_key(&r("a"), KEY);
    let a = [renewing("a")];
    assert_eq!(core.renew(&a, &EngineId::new("owner"), t0 + secs(5.0)), 1);
    assert_eq!(core.next_deadline(), Some(t0 + secs(5.0) + RENEWAL));
    assert_eq!(core.renew(&a, &EngineId::new("other"), t0 + secs(6.0)), 0, "not counted as renewed");
    assert_eq!(core.next_deadline(), Some(t0 + LEASE), "contested: held for the whole lease");
    assert_eq!(core.renew(&a, &EngineId::new("owner"), t0 + secs(7.0)), 0, "renewals no longer count");
    assert_eq!(core.renew_all_by(&EngineId::new("owner"), t0 + secs(8.0)), 0);
    assert_eq!(core.next_deadline(), Some(t0 + LEASE));
}

#[test]
fn renewals_count_only_requests_p_holds() {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    let d = EngineId::new("d");
    core.handle_update(&r("a"), &ready(&[1]), t0);
    core.handle_update(&r("b"), &SendUpdate::Expect, t0);
    core.handle_update(&r("c"), &ready(&[2]), t0);
    for id in ["a", "b", "c", "unknown"] {
        core.set_renewal_key(&r(id), KEY);
    }
    let wrong = Renewing { key: OTHER_KEY, ..renewing("c") };
    assert_eq!(core.renew(&[renewing("a"), renewing("b"), renewing("unknown"), wrong], &d, t0), 2);
    assert_eq!(core.renewed(), 2);
    assert_eq!(core.renewals_refused(), 1, "a request P holds, named with another key");
    assert_eq!(core.next_deadline(), Some(t0 + RENEWAL), "the renewed ready request ends first");
    assert_eq!(core.renew_all_by(&d, t0 + secs(5.0)), 2);
    assert_eq!(core.next_deadline(), Some(t0 + secs(5.0) + RENEWAL));
}

/// P's id of D's request `id` (engines never share ids).
fn p(id: &str) -> ReqId {
    ReqId::new(format!("p-{id}"))
}

/// A pull from `host:port`; [`reqs`] names P's id.
fn recv(host: &str, port: u16, blocks: &[u32]) -> RecvReqMeta {
    let remote = RemotePrefill {
        remote_host: host.into(),
        remote_port: port,
        remote_request_id: p("?"),
        remote_engine_id: None,
        remote_renewal_key: None,
        bootstrap: None,
    };
    RecvReqMeta { local_block_ids: blocks.to_vec(), first_token: None, remote }
}

/// D's requests `id`, each named to P as [`p`]`(id)`.
fn reqs(items: &[(&str, RecvReqMeta)]) -> BTreeMap<ReqId, RecvReqMeta> {
    items
        .iter()
        .map(|(id, m)| {
            let remote = RemotePrefill { remote_request_id: p(id), ..m.remote.clone() };
            (r(id), RecvReqMeta { remote, ..m.clone() })
        })
        .collect()
}

#[test]
fn pulls_are_grouped_by_prefill_side_channel_with_tp_rank_added() {
    let mut core = ReceiverCore::new(2, Duration::from_secs(5));
    let batches = core.start(
        &reqs(&[("a", recv("p1", 8998, &[1])), ("b", recv("p2", 8998, &[2])), ("c", recv("p1", 8998, &[3, 4]))]),
        Instant::now(),
    );
    assert_eq!(batches.len(), 2);
    assert_eq!(batches[0].peer, SideChannelAddr { host: "p1".into(), port: 9000 });
    assert_eq!(
        batches[0].requests,
        vec![
            RequestBlocks {
                req_id: p("a"),
                decode_req_id: Some(r("a")),
                prefill_engine_id: None,
                block_ids: vec![1],
                first_token: None,
                may_precede_prefill: false,
            },
            RequestBlocks {
                req_id: p("c"),
                decode_req_id: Some(r("c")),
                prefill_engine_id: None,
                block_ids: vec![3, 4],
                first_token: None,
                may_precede_prefill: false,
            }
        ]
    );
    assert_eq!(batches[1].peer, SideChannelAddr { host: "p2".into(), port: 9000 });
    assert_ne!(batches[0].xfer_id, batches[1].xfer_id);
    assert_eq!(core.in_flight(), 3);
}

/// P's reply, naming each of D's requests `id` by P's id.
fn reply(xfer_id: u64, outcomes: &[(&str, Outcome)]) -> XferReply {
    XferReply {
        xfer_id,
        outcomes: outcomes.iter().map(|(id, o)| RequestOutcome { req_id: p(id), outcome: o.clone() }).collect(),
    }
}

fn failed(reason: &str) -> Outcome {
    Outcome::Failed { cause: kv_proto::FailureCause::Other, reason: reason.into() }
}

/// One batch of requests a (blocks 1,2) and b (blocks 3), then `event`.
#[rstest]
#[case::all_done(Some(vec![("a", Outcome::Done), ("b", Outcome::Done)]), &["a", "b"], &[])]
#[case::one_failed_by_prefill(Some(vec![("a", Outcome::Done), ("b", failed("unknown"))]), &["a"], &["b"])]
#[case::outcome_missing_counts_as_failed(Some(vec![("a", Outcome::Done)]), &["a"], &["b"])]
#[case::stray_outcome_ignored(Some(vec![("a", Outcome::Done), ("b", Outcome::Done), ("zzz", Outcome::Done)]), &["a", "b"], &[])]
#[case::connection_failed(None, &[], &["a", "b"])]
fn receiver_outcomes(
    #[case] event: Option<Vec<(&str, Outcome)>>,
    #[case] received: &[&str],
    #[case] failed_reqs: &[&str],
) {
    let t0 = Instant::now();
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let batches = core.start(&reqs(&[("a", recv("p", 1, &[1, 2])), ("b", recv("p", 1, &[3]))]), t0);
    let xfer_id = batches[0].xfer_id;
    core.handle_granted(xfer_id, GrantId::from_bytes([1; 16]));
    match event {
        Some(outcomes) => core.handle_reply(reply(xfer_id, &outcomes)),
        None => core.handle_batch_failed(xfer_id, FailureCause::ConnectionLost, "connection refused"),
    }
    let fenced = core.poll_finished();
    assert!(fenced.received.is_empty() && fenced.failed.is_empty(), "nothing is reported before the grant is fenced");
    core.handle_fenced(xfer_id);
    let done = core.poll_finished();
    assert_eq!(done.received.iter().map(ReqId::as_str).collect::<Vec<_>>(), received);
    assert_eq!(done.failed.keys().map(ReqId::as_str).collect::<Vec<_>>(), failed_reqs);
    if failed_reqs.contains(&"a") {
        assert_eq!(done.failed[&r("a")], vec![1, 2], "failed requests carry their block ids");
    }
    assert_eq!(core.in_flight(), 0);
    assert!(core.poll_finished().received.is_empty(), "reported once");
}

fn progress(xfer_id: u64, id: &str, landed: u32, outcome: Option<Outcome>) -> XferProgress {
    XferProgress { xfer_id, req_id: p(id), landed, outcome }
}

/// P's progress on a pull of a (blocks 1, 2, 3): what is kept for the
/// driver (landed counts that grow, outcomes once; anything past the
/// request's blocks, about another request or pull, or after its outcome,
/// ignored), and how the pull ends: the first outcome P said wins over the
/// reply and over a failure of the pull.
#[rstest]
#[case::pieces_then_done(&[(1, None), (3, Some(Outcome::Done))], None, &[(1, None), (3, Some(true))], true)]
#[case::hostile_counts_ignored(&[(2, None), (1, None), (9, None), (2, None)], Some(Outcome::Done), &[(2, None)], true)]
#[case::early_done_wins_over_a_lost_connection(&[(0, Some(Outcome::Done))], None, &[(3, Some(true))], true)]
#[case::early_failure_wins_over_the_reply(&[(1, Some(failed("x"))), (3, Some(Outcome::Done))], Some(Outcome::Done), &[(1, Some(false))], false)]
#[case::no_progress_the_reply_decides(&[], Some(Outcome::Done), &[], true)]
fn receiver_progress(
    #[case] said: &[(u32, Option<Outcome>)],
    #[case] reply_outcome: Option<Outcome>,
    #[case] kept: &[(u32, Option<bool>)],
    #[case] received: bool,
) {
    let t0 = Instant::now();
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    core.keep_progress();
    let batches = core.start(&reqs(&[("a", recv("p", 1, &[1, 2, 3]))]), t0);
    let xfer_id = batches[0].xfer_id;
    core.handle_granted(xfer_id, GrantId::from_bytes([1; 16]));
    assert!(!core.handle_progress(progress(xfer_id + 1, "a", 1, None)), "another pull");
    assert!(!core.handle_progress(progress(xfer_id, "zzz", 1, None)), "another request");
    for (landed, outcome) in said {
        core.handle_progress(progress(xfer_id, "a", *landed, outcome.clone()));
    }
    let got: Vec<(u32, Option<bool>)> =
        core.take_progress().into_iter().map(|p| (p.landed, p.ended.map(|e| e.is_ok()))).collect();
    assert_eq!(got, kept);
    assert!(core.poll_finished().received.is_empty(), "nothing reported before the fence");
    match reply_outcome {
        Some(outcome) => core.handle_reply(reply(xfer_id, &[("a", outcome)])),
        None => core.handle_batch_failed(xfer_id, FailureCause::ConnectionLost, "gone"),
    }
    core.handle_fenced(xfer_id);
    let done = core.poll_finished();
    assert_eq!(done.received.contains(&r("a")), received);
    assert_eq!(done.failed.contains_key(&r("a")), !received);
}

#[test]
fn progress_is_not_kept_unless_asked_and_releases_are_never_reported() {
    let t0 = Instant::now();
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let batches = core.start(&reqs(&[("a", recv("p", 1, &[1, 2]))]), t0);
    assert!(core.handle_progress(progress(batches[0].xfer_id, "a", 1, None)), "applied");
    assert!(core.take_progress().is_empty(), "but not kept for a driver that did not ask");
    let remote = RemotePrefill { remote_request_id: p("b"), ..recv("p", 1, &[]).remote };
    let released = core.release(&BTreeMap::from([(r("b"), remote)]), t0);
    assert_eq!(released[0].requests[0].block_ids, Vec::<u32>::new(), "a pull of no blocks");
    assert_eq!(released[0].requests[0].req_id, p("b"), "named by P's id");
    core.handle_reply(reply(released[0].xfer_id, &[("b", Outcome::Done)]));
    core.handle_fenced(released[0].xfer_id);
    let done = core.poll_finished();
    assert!(done.received.is_empty() && done.failed.is_empty(), "never reported");
    assert!(core.take_reports().ended.is_empty(), "nor counted");
    assert_eq!(core.in_flight(), 1, "only a is in flight");
}

#[test]
fn a_pull_names_ps_request_and_engine_and_its_outcome_is_reported_under_ds_id() {
    let t0 = Instant::now();
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let mut meta = recv("p", 1, &[4, 5]);
    meta.remote.remote_request_id = ReqId::new("cmpl-1-0-b00fff6e");
    meta.remote.remote_engine_id = Some(EngineId::new("prefill-0"));
    let batches = core.start(&BTreeMap::from([(r("cmpl-1-0-9760c8b8"), meta)]), t0);
    assert_eq!(
        batches[0].requests,
        [RequestBlocks {
            req_id: ReqId::new("cmpl-1-0-b00fff6e"),
            decode_req_id: Some(r("cmpl-1-0-9760c8b8")),
            prefill_engine_id: Some(EngineId::new("prefill-0")),
            block_ids: vec![4, 5],
            first_token: None,
            may_precede_prefill: false,
        }]
    );
    let xfer_id = batches[0].xfer_id;
    core.handle_granted(xfer_id, GrantId::from_bytes([1; 16]));
    core.handle_reply(XferReply {
        xfer_id,
        outcomes: vec![RequestOutcome { req_id: ReqId::new("cmpl-1-0-b00fff6e"), outcome: Outcome::Done }],
    });
    core.handle_fenced(xfer_id);
    assert_eq!(core.poll_finished().received, BTreeSet::from([r("cmpl-1-0-9760c8b8")]));
}

#[test]
fn an_outcome_naming_ds_id_instead_of_ps_does_not_count() {
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let batches = core.start(&reqs(&[("a", recv("p", 1, &[1]))]), Instant::now());
    let xfer_id = batches[0].xfer_id;
    core.handle_granted(xfer_id, GrantId::from_bytes([1; 16]));
    core.handle_reply(XferReply { xfer_id, outcomes: vec![RequestOutcome { req_id: r("a"), outcome: Outcome::Done }] });
    core.handle_fenced(xfer_id);
    assert_eq!(core.poll_finished().failed, BTreeMap::from([(r("a"), vec![1])]));
}

#[test]
fn two_requests_naming_one_prefill_request_pull_it_once() {
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let same = |blocks: &[u32]| {
        let mut m = recv("p", 1, blocks);
        m.remote.remote_request_id = ReqId::new("p-shared");
        m
    };
    let batches = core.start(
        &BTreeMap::from([(r("a"), same(&[1])), (r("b"), same(&[2])), (r("c"), recv("p", 1, &[3]))]),
        Instant::now(),
    );
    assert_eq!(batches.len(), 1);
    let named: Vec<&str> = batches[0].requests.iter().map(|b| b.req_id.as_str()).collect();
    assert_eq!(named, ["p-shared", "p-?"]);
    assert_eq!(core.poll_finished().failed, BTreeMap::from([(r("b"), vec![2])]), "the second fails at once");
    assert_eq!(core.in_flight(), 2);
}

#[test]
fn a_pull_without_reply_fails_at_its_deadline_once_fenced_and_a_late_reply_is_ignored() {
    // Defect 2 of the reference: a failed or silent pull was only logged.
    let t0 = Instant::now();
    let timeout = Duration::from_secs(5);
    let mut core = ReceiverCore::new(0, timeout);
    let batches = core.start(&reqs(&[("a", recv("p", 1, &[7]))]), t0);
    let (xfer_id, grant) = (batches[0].xfer_id, GrantId::from_bytes([7; 16]));
    core.handle_granted(xfer_id, grant);
    assert_eq!(core.next_deadline(), Some(t0 + timeout));
    assert!(core.handle_timeout(t0 + timeout - Duration::from_millis(1)).is_empty());
    assert!(core.poll_finished().failed.is_empty());
    assert_eq!(core.handle_timeout(t0 + timeout), vec![(xfer_id, Some(grant))], "the driver must revoke this grant");
    assert!(core.handle_timeout(t0 + timeout).is_empty(), "asked to fence once");
    assert_eq!(core.next_deadline(), None);
    assert!(core.poll_finished().failed.is_empty(), "a late writer could still land: not reported yet");
    core.handle_reply(reply(xfer_id, &[("a", Outcome::Done)]));
    core.handle_fenced(xfer_id);
    assert_eq!(
        core.poll_finished().failed,
        BTreeMap::from([(r("a"), vec![7])]),
        "the timeout decided, not the late reply"
    );
    core.handle_fenced(xfer_id);
    let late = core.poll_finished();
    assert!(late.received.is_empty() && late.failed.is_empty(), "each request is reported exactly once");
    assert_eq!(core.in_flight(), 0);
}

#[test]
fn a_pull_fenced_before_any_outcome_fails() {
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let batches = core.start(&reqs(&[("a", recv("p", 1, &[1, 2]))]), Instant::now());
    core.handle_fenced(batches[0].xfer_id);
    assert_eq!(core.poll_finished().failed, BTreeMap::from([(r("a"), vec![1, 2])]));
    assert_eq!(core.in_flight(), 0);
}

#[test]
fn a_request_pulled_twice_while_in_flight_is_pulled_once() {
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let t0 = Instant::now();
    assert_eq!(core.start(&reqs(&[("a", recv("p", 1, &[1]))]), t0).len(), 1);
    assert!(core.start(&reqs(&[("a", recv("p", 1, &[1]))]), t0).is_empty());
    assert_eq!(core.in_flight(), 1);
}

#[test]
fn port_overflow_fails_the_request_at_once() {
    let mut core = ReceiverCore::new(3, Duration::from_secs(5));
    assert!(core.start(&reqs(&[("a", recv("p", u16::MAX, &[1]))]), Instant::now()).is_empty());
    assert_eq!(core.poll_finished().failed, BTreeMap::from([(r("a"), vec![1])]));
}

/// When the engine cancels a request of a pull (aborted while pulling).
#[derive(Clone, Copy, Debug)]
enum CancelAt {
    /// After the pull's grant was issued: the grant must be revoked now.
    Granted,
    /// Before the grant was issued: the pull must not go out with it.
    BeforeGrant,
    /// After P's reply, while the grant is being fenced.
    Fencing,
}

#[rstest]
#[case::granted_pull_is_fenced_now(CancelAt::Granted)]
#[case::ungranted_pull_never_goes_out(CancelAt::BeforeGrant)]
#[case::a_pull_being_fenced_is_fenced_now(CancelAt::Fencing)]
fn a_cancelled_request_is_never_reported_and_its_grant_is_fenced(#[case] at: CancelAt) {
    let t0 = Instant::now();
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let batches = core.start(&reqs(&[("a", recv("p", 1, &[1, 2])), ("b", recv("p", 1, &[3]))]), t0);
    let (xfer_id, grant) = (batches[0].xfer_id, GrantId::from_bytes([3; 16]));
    let cancel = BTreeSet::from([r("a")]);
    match at {
        CancelAt::Granted => {
            assert!(core.handle_granted(xfer_id, grant));
            assert_eq!(core.cancel(&cancel), vec![grant], "revoke before the engine reuses a's blocks");
            core.handle_reply(reply(xfer_id, &[("a", Outcome::Done), ("b", Outcome::Done)]));
        }
        CancelAt::BeforeGrant => {
            assert!(core.cancel(&cancel).is_empty(), "no grant out yet: nothing to fence");
            assert!(!core.handle_granted(xfer_id, grant), "the pull must not go out under a grant over a's blocks");
            core.handle_batch_failed(xfer_id, FailureCause::Other, "cancelled");
        }
        CancelAt::Fencing => {
            assert!(core.handle_granted(xfer_id, grant));
            core.handle_reply(reply(xfer_id, &[("a", Outcome::Done), ("b", Outcome::Done)]));
            assert_eq!(core.cancel(&cancel), vec![grant]);
        }
    }
    assert!(core.cancel(&cancel).is_empty(), "cancelling twice is harmless");
    core.handle_fenced(xfer_id);
    let done = core.poll_finished();
    assert!(!done.received.contains(&r("a")) && !done.failed.contains_key(&r("a")), "a is never reported: {done:?}");
    match at {
        CancelAt::BeforeGrant => assert_eq!(done.failed, BTreeMap::from([(r("b"), vec![3])])),
        _ => assert_eq!(done.received, BTreeSet::from([r("b")]), "b's bytes landed before the fence"),
    }
    assert_eq!(core.in_flight(), 0);
}

/// `abandon`: the pull that asked for a request gave up before it was ready.
#[rstest]
#[case::expected_is_freed_the_moment_it_is_ready(&[SendUpdate::Expect], &[ready(&[1])], true)]
#[case::forget_after_abandon_reports_nothing(&[SendUpdate::Expect], &[SendUpdate::Forget], false)]
#[case::a_ready_request_keeps_its_lease(&[ready(&[1])], &[], false)]
#[case::unknown_stays_unknown(&[], &[ready(&[1])], false)]
fn abandoned_requests(#[case] before: &[SendUpdate], #[case] after: &[SendUpdate], #[case] freed_at_once: bool) {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    for u in before {
        core.handle_update(&r("a"), u, t0);
    }
    core.abandon(&r("a"));
    for u in after {
        core.handle_update(&r("a"), u, t0);
    }
    let finished = core.poll_finished();
    assert_eq!(finished.contains(&r("a")), freed_at_once, "{finished:?}");
}

#[test]
fn a_new_pull_takes_an_abandoned_request_back() {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &SendUpdate::Expect, t0);
    core.abandon(&r("a"));
    assert_eq!(core.claim(&r("a"), t0), Claim::NotReady, "a new pull waits for it again");
    core.handle_update(&r("a"), &ready(&[4]), t0);
    assert!(core.poll_finished().is_empty(), "held for the new pull, not freed");
    assert_eq!(core.claim(&r("a"), t0), Claim::Ready(vec![4]));
}

#[test]
fn a_request_pulled_again_before_its_first_pull_was_polled_is_pulled_once() {
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let t0 = Instant::now();
    let first = core.start(&reqs(&[("a", recv("p", 1, &[1]))]), t0);
    core.handle_batch_failed(first[0].xfer_id, FailureCause::PeerRefused, "refused");
    core.handle_fenced(first[0].xfer_id);
    assert!(core.start(&reqs(&[("a", recv("p", 1, &[1]))]), t0).is_empty(), "reported, not yet polled");
    let done = core.poll_finished();
    assert_eq!(done.failed, BTreeMap::from([(r("a"), vec![1])]));
    assert!(done.received.is_empty(), "never both ways");
}

#[test]
fn a_pull_cancelled_after_it_ended_but_before_it_was_polled_is_never_reported() {
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let pulls = core.start(&reqs(&[("a", recv("p", 1, &[1])), ("b", recv("p", 1, &[2]))]), Instant::now());
    core.handle_reply(reply(pulls[0].xfer_id, &[("a", Outcome::Done), ("b", Outcome::Done)]));
    core.handle_fenced(pulls[0].xfer_id);
    assert!(core.cancel(&BTreeSet::from([r("a")])).is_empty(), "fenced already: nothing to revoke");
    let done = core.poll_finished();
    assert_eq!(done.received, BTreeSet::from([r("b")]), "a is never reported once cancelled");
}

/// A staged decode's copy of a pull still out failed: the pull is cut
/// short like a cancel (its grant revoked, never reported to the engine)
/// but counted failed with the cause; one that had ended already comes
/// back to be settled as it ended, never reported either.
#[test]
fn a_pull_cut_short_is_fenced_counted_failed_and_never_reported() {
    let t0 = Instant::now();
    let mut core = ReceiverCore::new(0, Duration::from_secs(5));
    let pulls = core.start(&reqs(&[("a", recv("p", 1, &[1, 2])), ("b", recv("p", 1, &[3]))]), t0);
    let (xfer_id, grant) = (pulls[0].xfer_id, GrantId::from_bytes([4; 16]));
    assert!(core.handle_granted(xfer_id, grant));
    let started = core.take_reports();
    assert_eq!(started.started, 2);

    let cut = core.cut_short(&BTreeSet::from([r("a")]), FailureCause::CopyFailed, "copy failed");
    assert_eq!((cut.grants, cut.ended), (vec![grant], vec![]), "revoke before the engine reuses a's blocks");
    let reports = core.take_reports();
    assert_eq!(reports.cancelled, 0, "failed, not cancelled");
    assert_eq!(reports.ended.len(), 1);
    let report = &reports.ended[0];
    assert_eq!((&report.req, report.blocks), (&r("a"), 2));
    assert_eq!(report.failure, Some((FailureCause::CopyFailed, "copy failed".to_owned())));

    core.handle_reply(reply(xfer_id, &[("a", Outcome::Done), ("b", Outcome::Done)]));
    core.handle_fenced(xfer_id);
    let cut = core.cut_short(&BTreeSet::from([r("b")]), FailureCause::CopyFailed, "copy failed");
    assert_eq!((cut.grants, cut.ended), (vec![], vec![r("b")]), "ended and fenced: settled as it ended");
    let done = core.poll_finished();
    assert!(done.received.is_empty() && done.failed.is_empty(), "neither is reported to the engine: {done:?}");
    assert_eq!(core.in_flight(), 0);
}

// ---------------------------------------------------------------------------
// A receiver that learns each prefill instance's topology first
// ---------------------------------------------------------------------------

/// A split-K/V NHD layout of 2 layers holding `heads` heads of 32 bytes
/// per token, 16 tokens per block.
fn layout(heads: u32) -> kv_proto::CacheLayout {
    kv_proto::CacheLayout {
        kind: kv_proto::LayoutKind::SplitKv,
        region_count: 4,
        block_len: u64::from(heads) * 16 * 32,
        block_tokens: 16,
        dtype_bytes: 2,
        token_layout: kv_proto::TokenLayout::Nhd,
        block_heads: heads,
    }
}

/// A decode receiver at rank `rank` of `tp` of a model of 2 KV heads.
fn discovering(tp: u32, rank: u32) -> ReceiverCore {
    let topology = kv_proto::RankTopology::new(tp, rank, 1, 0, 2).unwrap();
    ReceiverCore::discovering(topology, layout(topology.heads.count), Duration::from_secs(5))
}

/// What prefill rank 0 of `tp` of engine `prefill` says in its hello.
fn prefill_info(tp: u32) -> kv_worker::PeerInfo {
    let topology = kv_proto::RankTopology::new(tp, 0, 1, 0, 2).unwrap();
    kv_worker::PeerInfo { engine_id: EngineId::new("prefill"), topology, layout: layout(topology.heads.count) }
}

/// [`recv`] from engine `engine` at `p:9000`.
fn recv_from(engine: &str, blocks: &[u32]) -> RecvReqMeta {
    let mut meta = recv("p", 9000, blocks);
    meta.remote.remote_engine_id = Some(EngineId::new(engine));
    meta
}

/// A request naming another prefill engine than the one learned at its
/// instance (P restarted on the same ports, here at another TP size) has
/// the instance learned again before it is planned; one naming the learned
/// engine, or none, goes out at once.
#[test]
fn a_prefill_instance_restarted_as_another_engine_is_learned_again() {
    let t0 = Instant::now();
    let mut core = discovering(1, 0);
    core.start(&reqs(&[("a", recv_from("prefill", &[1]))]), t0);
    assert_eq!(core.take_discoveries(), [instance(9000)]);
    assert_eq!(core.handle_discovered(&instance(9000), Ok(prefill_info(1)), t0).len(), 1);
    assert_eq!(core.start(&reqs(&[("b", recv_from("prefill", &[2]))]), t0).len(), 1, "the learned engine");
    assert_eq!(core.start(&reqs(&[("c", recv("p", 9000, &[3]))]), t0).len(), 1, "no engine named");
    assert!(core.start(&reqs(&[("d", recv_from("restarted", &[4]))]), t0).is_empty(), "learned again first");
    assert_eq!(core.take_discoveries(), [instance(9000)]);
    let restarted = kv_worker::PeerInfo { engine_id: EngineId::new("restarted"), ..prefill_info(2) };
    let batches = core.handle_discovered(&instance(9000), Ok(restarted), t0);
    let parts: Vec<u16> = batches.iter().map(|b| b.peer.port).collect();
    assert_eq!(parts, [9000, 9001], "the new P's two workers, a head each");
    assert_eq!(core.start(&reqs(&[("e", recv_from("restarted", &[5]))]), t0).len(), 2, "known again");
}

fn instance(port: u16) -> SideChannelAddr {
    SideChannelAddr { host: "p".into(), port }
}

#[test]
fn requests_wait_for_their_instance_to_be_learned_once() {
    let t0 = Instant::now();
    let mut core = discovering(1, 0);
    assert!(core.start(&reqs(&[("a", recv("p", 9000, &[1, 2]))]), t0).is_empty());
    assert!(core.start(&reqs(&[("b", recv("p", 9000, &[3]))]), t0).is_empty());
    assert_eq!(core.take_discoveries(), [instance(9000)], "asked once");
    assert!(core.take_discoveries().is_empty());
    assert_eq!(core.in_flight(), 2);
    // Same layout and size: whole blocks from the worker of the same rank.
    let batches = core.handle_discovered(&instance(9000), Ok(prefill_info(1)), t0);
    assert_eq!(batches.len(), 1);
    assert_eq!((batches[0].peer.port, batches[0].heads, batches[0].requests.len()), (9000, None, 2));
    // Known now: the next request goes out at once.
    let next = core.start(&reqs(&[("c", recv("p", 9000, &[4]))]), t0);
    assert_eq!(next.len(), 1);
    assert!(core.take_discoveries().is_empty());
}

/// A watched request's instance is learned before its pull: asked once
/// (a pull meanwhile waits for the same hello), and its renewals move from
/// the guess (D's own rank) to the workers its pull uses.
#[test]
fn a_watched_instance_is_learned_before_its_pull() {
    let t0 = Instant::now();
    let mut core = discovering(2, 1);
    assert_eq!(core.renewal_peers(&instance(9000)), [instance(9001)], "the guess: D's own rank");
    core.learn(&instance(9000), None);
    core.learn(&instance(9000), None);
    assert!(core.start(&reqs(&[("a", recv("p", 9000, &[1]))]), t0).is_empty(), "waits for the hello asked");
    assert_eq!(core.take_discoveries(), [instance(9000)], "asked once");
    let batches = core.handle_discovered(&instance(9000), Ok(prefill_info(1)), t0);
    assert_eq!(batches.iter().map(|b| b.peer.port).collect::<Vec<_>>(), [9000]);
    assert_eq!(core.renewal_peers(&instance(9000)), [instance(9000)], "P has one worker");
    core.learn(&instance(9000), None);
    assert!(core.take_discoveries().is_empty(), "known");
    // Learned from another engine than the request names: asked again.
    core.learn(&instance(9000), Some(&EngineId::new("restarted")));
    assert_eq!(core.take_discoveries(), [instance(9000)]);
}

/// With fixed pairing there is nothing to learn.
#[test]
fn a_fixed_receiver_learns_nothing() {
    let mut core = ReceiverCore::new(3, Duration::from_secs(5));
    core.learn(&instance(9000), None);
    assert!(core.take_discoveries().is_empty());
    assert_eq!(core.renewal_peers(&instance(9000)), [instance(9003)]);
}

/// D at one rank, P at two: one part per prefill worker, each its head;
/// the request is reported once both parts are fenced, failed if either
/// failed.
#[rstest]
#[case::both_done(Outcome::Done, Outcome::Done, true)]
#[case::second_failed(Outcome::Done, failed("gone"), false)]
#[case::first_failed(failed("gone"), Outcome::Done, false)]
fn a_request_of_parts_ends_with_its_last_part(#[case] first: Outcome, #[case] second: Outcome, #[case] ok: bool) {
    let t0 = Instant::now();
    let mut core = discovering(1, 0);
    core.start(&reqs(&[("a", recv("p", 9000, &[1, 2]))]), t0);
    core.take_discoveries();
    let batches = core.handle_discovered(&instance(9000), Ok(prefill_info(2)), t0);
    let parts: Vec<(u16, Option<kv_proto::HeadRange>)> = batches.iter().map(|b| (b.peer.port, b.heads)).collect();
    assert_eq!(parts, [(9000, Some(kv_proto::HeadRange::new(0, 1))), (9001, Some(kv_proto::HeadRange::new(1, 1)))]);
    assert!(batches.iter().all(|b| b.requests[0].block_ids == [1, 2]));
    core.handle_reply(reply(batches[0].xfer_id, &[("a", first)]));
    core.handle_fenced(batches[0].xfer_id);
    assert_eq!(core.poll_finished(), kv_worker::RecvFinished::default(), "one part is still out");
    core.handle_reply(reply(batches[1].xfer_id, &[("a", second)]));
    core.handle_fenced(batches[1].xfer_id);
    let done = core.poll_finished();
    assert_eq!(done.received.contains(&r("a")), ok);
    assert_eq!(done.failed.contains_key(&r("a")), !ok);
    let reports = core.take_reports();
    assert_eq!((reports.ended.len(), reports.started), (1, 1), "one request, reported once");
    assert_eq!(core.in_flight(), 0);
}

/// P replicates each of its 2 heads on 2 of its 4 workers: D's one worker
/// pulls each head from one of them and tells the two others, with parts of
/// no heads and no blocks, so they free the request at once.
#[test]
fn prefill_workers_no_part_comes_from_are_told() {
    let t0 = Instant::now();
    let mut core = discovering(1, 0);
    core.start(&reqs(&[("a", recv("p", 9000, &[1]))]), t0);
    core.take_discoveries();
    let batches = core.handle_discovered(&instance(9000), Ok(prefill_info(4)), t0);
    let parts: Vec<(u16, Option<kv_proto::HeadRange>, usize)> =
        batches.iter().map(|b| (b.peer.port, b.heads, b.requests[0].block_ids.len())).collect();
    let (one, none) = (Some(kv_proto::HeadRange::new(0, 1)), Some(kv_proto::HeadRange::default()));
    assert_eq!(
        parts,
        [(9000, one, 1), (9001, none, 0), (9002, Some(kv_proto::HeadRange::new(1, 1)), 1), (9003, none, 0)]
    );
}

#[rstest]
#[case::unreachable(Err((FailureCause::ConnectionLost, "refused".to_owned())), FailureCause::ConnectionLost)]
#[case::pipeline_on_one_side(Ok(kv_worker::PeerInfo { topology: kv_proto::RankTopology::new(1, 0, 2, 0, 2).unwrap(), ..prefill_info(1) }), FailureCause::IncompatiblePeer)]
fn an_instance_that_cannot_be_learned_fails_its_requests_at_once(
    #[case] info: Result<kv_worker::PeerInfo, (FailureCause, String)>,
    #[case] cause: FailureCause,
) {
    let t0 = Instant::now();
    let mut core = discovering(1, 0);
    core.start(&reqs(&[("a", recv("p", 9000, &[1]))]), t0);
    assert_eq!(core.take_discoveries(), [instance(9000)]);
    assert!(core.handle_discovered(&instance(9000), info, t0).is_empty());
    assert_eq!(core.poll_finished().failed, BTreeMap::from([(r("a"), vec![1])]));
    let reports = core.take_reports();
    assert_eq!(reports.ended[0].failure.as_ref().map(|f| f.0), Some(cause));
    // Not remembered: the next request asks again.
    core.start(&reqs(&[("b", recv("p", 9000, &[2]))]), t0);
    assert_eq!(core.take_discoveries(), [instance(9000)]);
}

#[test]
fn a_request_waiting_for_its_instance_times_out_or_is_cancelled() {
    let t0 = Instant::now();
    let mut core = discovering(1, 0);
    core.start(&reqs(&[("a", recv("p", 9000, &[1])), ("b", recv("p", 9000, &[2]))]), t0);
    assert_eq!(core.next_deadline(), Some(t0 + Duration::from_secs(5)));
    assert!(core.cancel([&r("b")]).is_empty(), "no grant to fence");
    assert!(core.handle_timeout(t0 + Duration::from_secs(5)).is_empty());
    let done = core.poll_finished();
    assert_eq!(done.failed.keys().collect::<Vec<_>>(), [&r("a")], "the cancelled one is never reported");
    // Learned late: nothing is left to start.
    assert!(core.handle_discovered(&instance(9000), Ok(prefill_info(1)), t0).is_empty());
    assert_eq!(core.in_flight(), 0);
}

// ---------------------------------------------------------------------------
// Pieces of a request pulled in parts (several prefill workers)
// ---------------------------------------------------------------------------

/// What happens to one part of a request pulled in parts.
#[derive(Clone, Debug)]
enum PartEvent {
    /// Its prefill worker says how far it got (and maybe how it ends).
    Said(usize, u32, Option<Outcome>),
    /// Its reply comes, and its grant is fenced.
    Replied(usize, Outcome),
    /// Its connection is lost, and its grant is fenced.
    Lost(usize),
}

/// D at one rank pulls request a (blocks 1..=4) from P at `tp_p` ranks:
/// each part's progress is its own, and what a staged worker is told is
/// that of all parts together (a block lands once every part wrote it; a
/// part of no blocks holds none back; the request ends early once every
/// part said done, or one said it failed). The request is reported once,
/// after its last part is fenced, failed if any part failed.
#[rstest]
#[case::the_slowest_part_decides(2, &[
    PartEvent::Said(0, 2, None), PartEvent::Said(1, 1, None), PartEvent::Said(1, 3, None),
    PartEvent::Said(0, 4, Some(Outcome::Done)), PartEvent::Said(1, 0, Some(Outcome::Done)),
    PartEvent::Replied(0, Outcome::Done), PartEvent::Replied(1, Outcome::Done),
], &[(1, None), (2, None), (3, None), (4, Some(true))], true)]
#[case::one_part_fails_early(2, &[
    PartEvent::Said(0, 4, Some(Outcome::Done)), PartEvent::Said(1, 2, None), PartEvent::Said(1, 2, Some(failed("copy"))),
    PartEvent::Said(0, 4, None), PartEvent::Replied(0, Outcome::Done), PartEvent::Replied(1, Outcome::Done),
], &[(2, None), (2, Some(false))], false)]
#[case::a_part_lost_after_the_other_said_done(2, &[
    PartEvent::Said(0, 4, Some(Outcome::Done)), PartEvent::Lost(1), PartEvent::Replied(0, Outcome::Done),
], &[(0, Some(false))], false)]
#[case::a_part_done_early_survives_its_lost_connection(2, &[
    PartEvent::Said(0, 0, Some(Outcome::Done)), PartEvent::Lost(0), PartEvent::Said(1, 4, Some(Outcome::Done)),
    PartEvent::Replied(1, Outcome::Done),
], &[(4, Some(true))], true)]
#[case::parts_of_no_blocks_hold_no_block_back_but_the_end(4, &[
    PartEvent::Said(0, 4, Some(Outcome::Done)), PartEvent::Said(2, 3, None), PartEvent::Said(1, 0, Some(Outcome::Done)),
    PartEvent::Said(2, 4, Some(Outcome::Done)), PartEvent::Said(3, 0, Some(Outcome::Done)),
    PartEvent::Replied(0, Outcome::Done), PartEvent::Replied(1, Outcome::Done),
    PartEvent::Replied(2, Outcome::Done), PartEvent::Replied(3, Outcome::Done),
], &[(3, None), (4, None), (4, Some(true))], true)]
#[case::a_part_fenced_whole_holds_no_block_back(2, &[
    PartEvent::Replied(1, Outcome::Done), PartEvent::Said(0, 2, None), PartEvent::Replied(0, Outcome::Done),
], &[(2, None)], true)]
fn progress_of_a_request_pulled_in_parts(
    #[case] tp_p: u32,
    #[case] events: &[PartEvent],
    #[case] kept: &[(u32, Option<bool>)],
    #[case] received: bool,
) {
    let t0 = Instant::now();
    let mut core = discovering(1, 0);
    core.keep_progress();
    core.start(&reqs(&[("a", recv("p", 9000, &[1, 2, 3, 4]))]), t0);
    core.take_discoveries();
    let batches = core.handle_discovered(&instance(9000), Ok(prefill_info(tp_p)), t0);
    assert_eq!(batches.len(), tp_p as usize, "one part per prefill worker");
    for (i, b) in batches.iter().enumerate() {
        core.handle_granted(b.xfer_id, GrantId::from_bytes([i as u8 + 1; 16]));
    }
    for event in events {
        assert!(core.poll_finished().received.is_empty(), "nothing reported before the last fence");
        match event.clone() {
            PartEvent::Said(part, landed, outcome) => {
                core.handle_progress(progress(batches[part].xfer_id, "a", landed, outcome));
            }
            PartEvent::Replied(part, outcome) => {
                core.handle_reply(reply(batches[part].xfer_id, &[("a", outcome)]));
                core.handle_fenced(batches[part].xfer_id);
            }
            PartEvent::Lost(part) => {
                core.handle_batch_failed(batches[part].xfer_id, FailureCause::ConnectionLost, "gone");
                core.handle_fenced(batches[part].xfer_id);
            }
        }
    }
    let got: Vec<(u32, Option<bool>)> =
        core.take_progress().into_iter().map(|p| (p.landed, p.ended.map(|e| e.is_ok()))).collect();
    assert_eq!(got, kept);
    let done = core.poll_finished();
    assert_eq!(done.received.contains(&r("a")), received);
    assert_eq!(done.failed.contains_key(&r("a")), !received);
    assert_eq!(core.take_reports().ended.len(), 1, "reported once");
    assert_eq!(core.in_flight(), 0);
}

/// D releases a request it could not stage: every prefill worker a pull
/// of it would go to is told (a part of no blocks each), once the instance
/// is learned; none of it is ever reported.
#[test]
fn a_release_goes_to_every_prefill_worker_of_the_request() {
    let t0 = Instant::now();
    let mut core = discovering(1, 0);
    let remote = |id: &str| RemotePrefill { remote_request_id: p(id), ..recv("p", 9000, &[]).remote };
    // Not learned yet: the release waits for the instance.
    assert!(core.release(&BTreeMap::from([(r("a"), remote("a"))]), t0).is_empty());
    assert_eq!(core.take_discoveries(), [instance(9000)]);
    let batches = core.handle_discovered(&instance(9000), Ok(prefill_info(2)), t0);
    let told: Vec<(u16, usize)> = batches.iter().map(|b| (b.peer.port, b.requests[0].block_ids.len())).collect();
    assert_eq!(told, [(9000, 0), (9001, 0)]);
    // Learned: the next release goes out at once, to both.
    let next = core.release(&BTreeMap::from([(r("b"), remote("b"))]), t0);
    assert_eq!(next.iter().map(|b| b.peer.port).collect::<Vec<_>>(), [9000, 9001]);
    for b in batches.iter().chain(&next) {
        core.handle_reply(reply(b.xfer_id, &[(b.requests[0].req_id.as_str(), Outcome::Done)]));
        core.handle_fenced(b.xfer_id);
    }
    assert_eq!(core.poll_finished(), kv_worker::RecvFinished::default(), "never reported");
    let reports = core.take_reports();
    assert!(reports.ended.is_empty() && reports.started == 0, "nor counted");
    assert_eq!(core.in_flight(), 0);
    // An instance that cannot be learned drops the release (P's lease frees it).
    let remote_c = RemotePrefill { remote_port: 9100, ..remote("c") };
    assert!(core.release(&BTreeMap::from([(r("c"), remote_c)]), t0).is_empty());
    assert_eq!(core.take_discoveries(), [instance(9100)]);
    let lost = Err((FailureCause::ConnectionLost, "refused".to_owned()));
    assert!(core.handle_discovered(&instance(9100), lost, t0).is_empty());
    assert_eq!(core.poll_finished(), kv_worker::RecvFinished::default());
    assert!(core.take_reports().ended.is_empty());
}

/// A request several decode ranks pull, staged in pieces: every rank's
/// transfer may write what is staged; once P gives up on it, the ranks
/// writing it fail it, no rank claims it after, and it is freed once,
/// when the last writer is done (at once when none writes).
#[rstest]
#[case::while_both_write(2)]
#[case::while_one_writes(1)]
#[case::while_none_writes(0)]
fn a_shared_request_p_gives_up_on_is_freed_after_its_writers(#[case] writing: usize) {
    let t0 = Instant::now();
    let mut core = SenderCore::new(LEASE, RENEWAL);
    core.handle_update(&r("a"), &SendUpdate::Expect, t0);
    core.handle_staged(&r("a"), &[5, 6, 7, 8], 1, t0);
    let rank = |rank| Puller { rank, of: 3 };
    assert_eq!(core.claim_by(&r("a"), rank(0), t0), Claim::Ready(vec![5, 6, 7, 8]));
    assert_eq!(core.claim_by(&r("a"), rank(1), t0), Claim::Ready(vec![5, 6, 7, 8]));
    core.handle_staged(&r("a"), &[5, 6, 7, 8], 3, t0);
    assert_eq!(core.writable(&r("a")), Some(Ok(3)), "every rank writes what is staged");
    for _ in writing..2 {
        core.complete(&r("a"));
    }
    core.fail(&r("a"), FailureCause::CopyFailed, t0);
    if writing > 0 {
        assert_eq!(core.writable(&r("a")), Some(Err(FailureCause::CopyFailed)));
        assert!(core.poll_finished().is_empty(), "a transfer still writes from its blocks");
        for _ in 0..writing {
            core.complete(&r("a"));
        }
    }
    assert_eq!(core.poll_finished().into_iter().collect::<Vec<_>>(), [r("a")], "freed once");
    assert_eq!(core.claim_by(&r("a"), rank(2), t0), Claim::Failed(FailureCause::CopyFailed));
    assert_eq!(core.held(), (0, 0));
}

/// One step of a decode worker's pulls in parts, for the property below.
#[derive(Clone, Debug)]
enum PartsOp {
    /// A prefill worker says how far one request of its part got.
    Said { batch: usize, req: usize, landed: u32, outcome: Option<bool> },
    /// A part's reply, each request done or failed.
    Replied { batch: usize, done: Vec<bool> },
    /// A part's connection is lost.
    Lost { batch: usize },
    /// A part's grant is revoked.
    Fenced { batch: usize },
    /// The engine cancels a request.
    Cancel { req: usize },
}

fn parts_op() -> impl proptest::strategy::Strategy<Value = PartsOp> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0usize..4, 0usize..3, 0u32..8, proptest::option::of(proptest::bool::weighted(0.8)))
            .prop_map(|(batch, req, landed, outcome)| PartsOp::Said { batch, req, landed, outcome }),
        2 => (0usize..4, proptest::collection::vec(proptest::bool::weighted(0.8), 3))
            .prop_map(|(batch, done)| PartsOp::Replied { batch, done }),
        1 => (0usize..4).prop_map(|batch| PartsOp::Lost { batch }),
        2 => (0usize..4).prop_map(|batch| PartsOp::Fenced { batch }),
        1 => (0usize..3).prop_map(|req| PartsOp::Cancel { req }),
    ]
}

proptest::proptest! {
    /// Whatever P says and in whatever order parts end, a request pulled in
    /// parts is told as landed only as far as every part of it said (or
    /// ended whole), ends early at most once, is reported exactly once
    /// (never if cancelled) after its last part is fenced, received only if
    /// it ended early as received or not at all, and failed if it ended
    /// early as failed.
    #[test]
    fn progress_in_parts_never_runs_ahead_of_a_part(
        tp_p in proptest::sample::select(vec![1u32, 2, 4]),
        sizes in proptest::collection::vec(1usize..6, 3),
        ops in proptest::collection::vec(parts_op(), 0..60),
    ) {
        let t0 = Instant::now();
        let mut core = discovering(1, 0);
        core.keep_progress();
        let names = ["a", "b", "c"];
        let metas: Vec<(&str, RecvReqMeta)> = names
            .iter()
            .zip(&sizes)
            .enumerate()
            .map(|(i, (name, &n))| {
                let blocks: Vec<u32> = (0..n as u32).map(|b| 10 * i as u32 + b).collect();
                (*name, recv("p", 9000, &blocks))
            })
            .collect();
        core.start(&reqs(&metas), t0);
        core.take_discoveries();
        let batches = core.handle_discovered(&instance(9000), Ok(prefill_info(tp_p)), t0);
        for (i, b) in batches.iter().enumerate() {
            core.handle_granted(b.xfer_id, GrantId::from_bytes([i as u8 + 1; 16]));
        }
        // The most each part of each request can have landed, as P said.
        let mut credit: BTreeMap<(usize, usize), u32> = BTreeMap::new();
        for (b, batch) in batches.iter().enumerate() {
            for (q, n) in sizes.iter().enumerate() {
                let none = batch.requests.iter().find(|r| r.req_id == p(names[q])).is_some_and(|r| r.block_ids.is_empty());
                credit.insert((b, q), if none { *n as u32 } else { 0 });
            }
        }
        let mut cancelled = BTreeSet::new();
        let mut told = BTreeMap::new();
        let mut reported: BTreeMap<ReqId, bool> = BTreeMap::new();
        type Told = BTreeMap<ReqId, (u32, Option<bool>)>;
        let check = |core: &mut ReceiverCore, credit: &BTreeMap<(usize, usize), u32>, told: &mut Told, reported: &mut BTreeMap<ReqId, bool>| {
            for progress in core.take_progress() {
                let q = names.iter().position(|n| r(n) == progress.req).unwrap();
                let bound = (0..batches.len()).map(|b| credit[&(b, q)]).min().unwrap();
                assert!(progress.landed <= bound, "{} told {} landed, parts said {bound}", progress.req, progress.landed);
                let before = told.entry(progress.req.clone()).or_insert((0, None));
                assert!(before.1.is_none(), "{} told after its end", progress.req);
                assert!(progress.landed >= before.0, "{} went back", progress.req);
                *before = (progress.landed, progress.ended.map(|e| e.is_ok()));
            }
            let done = core.poll_finished();
            for req in done.received {
                assert!(reported.insert(req, true).is_none(), "reported twice");
            }
            for (req, _) in done.failed {
                assert!(reported.insert(req, false).is_none(), "reported twice");
            }
        };
        let whole = |credit: &mut BTreeMap<(usize, usize), u32>, b: usize| {
            for (q, &size) in sizes.iter().enumerate().take(names.len()) {
                credit.insert((b, q), size as u32);
            }
        };
        for op in ops {
            match op {
                PartsOp::Said { batch, req, landed, outcome } => {
                    let Some(x) = batches.get(batch) else { continue };
                    let outcome = outcome.map(|ok| if ok { Outcome::Done } else { failed("p") });
                    let n = sizes[req] as u32;
                    let c = credit.get_mut(&(batch, req)).unwrap();
                    *c = (*c).max(if outcome == Some(Outcome::Done) { n } else { landed.min(n) });
                    core.handle_progress(progress(x.xfer_id, names[req], landed, outcome));
                }
                PartsOp::Replied { batch, done } => {
                    let Some(x) = batches.get(batch) else { continue };
                    let outcomes: Vec<(&str, Outcome)> = names
                        .iter()
                        .zip(&done)
                        .map(|(n, ok)| (*n, if *ok { Outcome::Done } else { failed("p") }))
                        .collect();
                    whole(&mut credit, batch);
                    core.handle_reply(reply(x.xfer_id, &outcomes));
                }
                PartsOp::Lost { batch } => {
                    let Some(x) = batches.get(batch) else { continue };
                    core.handle_batch_failed(x.xfer_id, FailureCause::ConnectionLost, "gone");
                }
                PartsOp::Fenced { batch } => {
                    let Some(x) = batches.get(batch) else { continue };
                    core.handle_fenced(x.xfer_id);
                }
                PartsOp::Cancel { req } => {
                    if !reported.contains_key(&r(names[req])) {
                        cancelled.insert(r(names[req]));
                    }
                    core.cancel([&r(names[req])]);
                }
            }
            check(&mut core, &credit, &mut told, &mut reported);
        }
        for x in &batches {
            core.handle_batch_failed(x.xfer_id, FailureCause::Shutdown, "end");
            core.handle_fenced(x.xfer_id);
        }
        check(&mut core, &credit, &mut told, &mut reported);
        for name in names {
            let req = r(name);
            let got = reported.get(&req);
            if cancelled.contains(&req) {
                assert!(got.is_none(), "{name} reported after it was cancelled");
                continue;
            }
            let ok = got.copied();
            assert!(ok.is_some(), "{name} never reported");
            if let Some((_, Some(ended))) = told.get(&req) {
                assert_eq!(ok, Some(*ended), "{name}: its report says what its early end said");
            }
        }
        assert_eq!(core.in_flight(), 0);
    }
}
