//! P's decisions for one transfer request, with explicit time: what is
//! refused at once, what waits and until when, what a wait that ends means
//! for each request, and the reply's one outcome per request, in order.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kv_proto::{EngineId, FailureCause, Outcome, ReqId, RequestBlocks, SendUpdate};
use kv_worker::serving::{TransferCore, WaitEnd, MAX_WAIT_BUDGET};
use kv_worker::SenderCore;
use rstest::rstest;

const LEASE: Duration = Duration::from_secs(480);

fn r(s: &str) -> ReqId {
    ReqId::new(s)
}

fn request(id: &str, engine: Option<&str>) -> RequestBlocks {
    RequestBlocks {
        req_id: r(id),
        decode_req_id: None,
        prefill_engine_id: engine.map(EngineId::new),
        block_ids: vec![7],
    }
}

fn cause(outcome: &Outcome) -> Option<FailureCause> {
    match outcome {
        Outcome::Done => None,
        Outcome::Failed { cause, .. } => Some(*cause),
    }
}

/// P's sender with `ready` finished and `expected` scheduled but not finished.
fn sender(ready: &[&str], expected: &[&str], t0: Instant) -> SenderCore {
    let mut core = SenderCore::new(LEASE, Duration::from_secs(10));
    for id in ready {
        core.handle_update(&r(id), &SendUpdate::Ready { block_ids: vec![1, 2] }, t0);
    }
    for id in expected {
        core.handle_update(&r(id), &SendUpdate::Expect, t0);
    }
    core
}

#[test]
fn ready_requests_are_claimed_at_once_and_answered_in_order() {
    let t0 = Instant::now();
    let mut p = sender(&["a", "b"], &[], t0);
    let reqs = vec![request("b", None), request("ghost", None), request("a", Some("p"))];
    let (mut core, misdirected) = TransferCore::new(1, reqs, Duration::from_secs(60), t0, LEASE, &EngineId::new("p"));
    assert!(misdirected.is_none());
    let claimed = core.claim_ready(&mut p, t0 + Duration::from_secs(2));
    assert_eq!(claimed.iter().map(|c| c.index).collect::<Vec<_>>(), [0, 2]);
    assert_eq!(claimed[0].blocks, [1, 2]);
    assert_eq!(claimed[0].ready_for, Some(Duration::from_secs(2)), "how long it waited for its pull");
    assert!(!core.is_waiting());
    for c in &claimed {
        core.record(c.index, Outcome::Done);
    }
    let reply = core.reply();
    let got: Vec<(&str, Option<FailureCause>)> =
        reply.outcomes.iter().map(|o| (o.req_id.as_str(), cause(&o.outcome))).collect();
    assert_eq!(got, [("b", None), ("ghost", Some(FailureCause::UnknownRequest)), ("a", None)]);
}

#[test]
fn requests_meant_for_another_prefill_engine_are_refused_and_not_claimed() {
    let t0 = Instant::now();
    let mut p = sender(&["a", "b"], &[], t0);
    let reqs = vec![request("a", Some("other")), request("b", Some("other")), request("c", None)];
    let (mut core, misdirected) = TransferCore::new(1, reqs, Duration::from_secs(60), t0, LEASE, &EngineId::new("p"));
    let m = misdirected.unwrap();
    assert_eq!((m.req_id, m.refused), (r("a"), 2));
    assert!(m.reason.contains("other") && m.reason.contains("prefill engine p"), "{}", m.reason);
    let claimed = core.claim_ready(&mut p, t0);
    assert!(claimed.is_empty(), "a and b were not taken");
    assert_eq!(p.claim(&r("a"), t0), kv_worker::Claim::Ready(vec![1, 2]), "still P's to send to the right D");
    let reply = core.reply();
    assert_eq!(cause(&reply.outcomes[0].outcome), Some(FailureCause::PeerRefused));
    assert_eq!(cause(&reply.outcomes[2].outcome), Some(FailureCause::UnknownRequest));
}

/// A request not finished when the wait ends: its outcome, and whether P
/// abandons it (frees it as soon as the engine finishes it).
#[rstest]
#[case::budget_passes(
    Duration::from_secs(30),
    LEASE,
    WaitEnd::Deadline,
    FailureCause::NotReady,
    "wait budget of 30s",
    true
)]
#[case::abort_timeout_first(
    Duration::from_secs(600),
    Duration::from_secs(20),
    WaitEnd::Deadline,
    FailureCause::NotReady,
    "within 20s",
    true
)]
#[case::decode_went_away(
    Duration::from_secs(30),
    LEASE,
    WaitEnd::ConnectionClosed,
    FailureCause::ConnectionLost,
    "connection closed",
    true
)]
#[case::prefill_shutting_down(
    Duration::from_secs(30),
    LEASE,
    WaitEnd::Shutdown,
    FailureCause::Shutdown,
    "shutting down",
    false
)]
fn a_wait_that_ends_fails_what_still_waits(
    #[case] budget: Duration,
    #[case] abort_timeout: Duration,
    #[case] end: WaitEnd,
    #[case] expected: FailureCause,
    #[case] reason_has: &str,
    #[case] abandoned: bool,
) {
    let t0 = Instant::now();
    let mut p = sender(&[], &["a"], t0);
    let (mut core, _) = TransferCore::new(1, vec![request("a", None)], budget, t0, abort_timeout, &EngineId::new("p"));
    assert!(core.claim_ready(&mut p, t0).is_empty());
    assert!(core.is_waiting());
    assert_eq!(core.wait_end(), t0 + budget.min(abort_timeout));
    assert_eq!(core.budget_end(), t0 + budget);
    core.end_wait(end, &mut p);
    assert!(!core.is_waiting());
    let reply = core.reply();
    match &reply.outcomes[0].outcome {
        Outcome::Failed { cause, reason } => {
            assert_eq!(*cause, expected);
            assert!(reason.contains(reason_has), "{reason}");
        }
        Outcome::Done => panic!("not finished, not sent"),
    }
    // The engine finishes it now: abandoned, it is freed at once; else it
    // is held for a pull as usual.
    p.handle_update(&r("a"), &SendUpdate::Ready { block_ids: vec![1] }, t0);
    assert_eq!(p.poll_finished().contains(&r("a")), abandoned);
}

#[test]
fn a_wait_budget_past_a_day_is_a_day() {
    let t0 = Instant::now();
    let (core, _) =
        TransferCore::new(1, vec![request("a", None)], Duration::MAX, t0, Duration::MAX / 4, &EngineId::new("p"));
    assert_eq!(core.budget_end(), t0 + MAX_WAIT_BUDGET);
}
