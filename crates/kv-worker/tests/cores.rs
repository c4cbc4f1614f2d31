//! The sender and receiver cores, driven without sockets and with explicit time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kv_proto::{
    EngineId, FailureCause, GrantId, Outcome, RecvReqMeta, RemotePrefill, ReqId, RequestBlocks, RequestOutcome,
    SendUpdate, XferReply,
};
use kv_worker::{Claim, ReceiverCore, SenderCore, SideChannelAddr};
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
    Update(SendUpdate),
    /// Decode instance `by` renews it.
    Renew(&'static str),
    /// P renews on behalf of `by` (it makes `by`'s messages wait).
    RenewAllBy(&'static str),
    /// A pull claims it, and finds this.
    Claim(Claim),
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
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
            SendEvent::Update(u) => core.handle_update(&r("a"), u, now),
            SendEvent::Renew(by) => {
                core.renew([&r("a")], &EngineId::new(*by), now);
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
    assert_eq!(core.renew([&r("a")], &EngineId::new("owner"), t0 + secs(5.0)), 1);
    assert_eq!(core.next_deadline(), Some(t0 + secs(5.0) + RENEWAL));
    assert_eq!(core.renew([&r("a")], &EngineId::new("other"), t0 + secs(6.0)), 0, "not counted as renewed");
    assert_eq!(core.next_deadline(), Some(t0 + LEASE), "contested: held for the whole lease");
    assert_eq!(core.renew([&r("a")], &EngineId::new("owner"), t0 + secs(7.0)), 0, "renewals no longer count");
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
    assert_eq!(core.renew([&r("a"), &r("b"), &r("unknown")], &d, t0), 2);
    assert_eq!(core.renewed(), 2);
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
    };
    RecvReqMeta { local_block_ids: blocks.to_vec(), remote }
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
            RequestBlocks { req_id: p("a"), decode_req_id: Some(r("a")), prefill_engine_id: None, block_ids: vec![1] },
            RequestBlocks {
                req_id: p("c"),
                decode_req_id: Some(r("c")),
                prefill_engine_id: None,
                block_ids: vec![3, 4]
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
