//! D before P (the bootstrap flow, where the router dispatches both legs
//! at once): a pull naming a request P's engine has not seen yet waits for
//! it within its bounds, instead of being refused as unknown; what it
//! finds when the engine sees it (or never does), with explicit time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kv_proto::{EngineId, FailureCause, Outcome, ReqId, RequestBlocks, SendUpdate};
use kv_worker::serving::{TransferCore, WaitEnd, REPLY_MARGIN};
use kv_worker::{Claim, Puller, SenderCore, MAX_AWAITED};
use rstest::rstest;

const LEASE: Duration = Duration::from_secs(480);
const BUDGET: Duration = Duration::from_secs(30);

fn r(s: &str) -> ReqId {
    ReqId::new(s)
}

fn request(id: &str, may_precede_prefill: bool) -> RequestBlocks {
    RequestBlocks {
        req_id: r(id),
        decode_req_id: None,
        prefill_engine_id: None,
        block_ids: vec![7],
        first_token: None,
        may_precede_prefill,
    }
}

fn cause(outcome: &Outcome) -> Option<FailureCause> {
    match outcome {
        Outcome::Done => None,
        Outcome::Failed { cause, .. } => Some(*cause),
    }
}

fn core(reqs: Vec<RequestBlocks>, t0: Instant) -> TransferCore {
    TransferCore::new(1, reqs, BUDGET, t0, LEASE, &EngineId::new("p")).0
}

/// How the engine comes to see the request while the pull waits.
#[derive(Debug, Clone, Copy)]
enum EngineSees {
    ExpectThenReady,
    ReadyInOneStep,
    StagedInPieces,
}

#[rstest]
fn a_pull_before_the_prefill_is_served_once_the_engine_finishes_it(
    #[values(EngineSees::ExpectThenReady, EngineSees::ReadyInOneStep, EngineSees::StagedInPieces)] how: EngineSees,
) {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    let mut pull = core(vec![request("xfer-1", true)], t0);
    assert!(pull.claim_ready(&mut p, t0).is_empty());
    assert!(pull.is_waiting(), "held, not refused");
    assert!(p.never_seen(&r("xfer-1")));
    let t1 = t0 + Duration::from_secs(2);
    match how {
        EngineSees::ExpectThenReady => {
            p.handle_update(&r("xfer-1"), &SendUpdate::Expect, t1);
            assert!(!p.never_seen(&r("xfer-1")));
            assert!(pull.claim_ready(&mut p, t1).is_empty(), "seen, not finished");
            p.handle_update(&r("xfer-1"), &SendUpdate::Ready { block_ids: vec![4, 5] }, t1);
        }
        EngineSees::ReadyInOneStep => p.handle_update(&r("xfer-1"), &SendUpdate::Ready { block_ids: vec![4, 5] }, t1),
        EngineSees::StagedInPieces => p.handle_staged(&r("xfer-1"), &[4, 5], 1, t1),
    }
    let claimed = pull.claim_ready(&mut p, t1);
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].blocks, [4, 5]);
}

#[test]
fn a_pull_for_a_request_the_engine_never_sees_fails_naming_that() {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    let mut pull = core(vec![request("xfer-1", true)], t0);
    pull.claim_ready(&mut p, t0);
    assert_eq!(pull.wait_end(), t0 + BUDGET - REPLY_MARGIN, "answered before D gives up");
    pull.end_wait(WaitEnd::Deadline, &mut p);
    let reply = pull.reply();
    assert_eq!(cause(&reply.outcomes[0].outcome), Some(FailureCause::PrefillNeverSeen));
    // Its place is dropped at its bound; nothing is reported to the engine.
    p.handle_timeout(t0 + BUDGET);
    assert!(p.is_empty());
    assert!(p.poll_finished().is_empty());
}

#[test]
fn a_request_seen_after_its_pull_gave_up_is_freed_at_once() {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    let mut pull = core(vec![request("xfer-1", true)], t0);
    pull.claim_ready(&mut p, t0);
    pull.end_wait(WaitEnd::ConnectionClosed, &mut p);
    let t1 = t0 + Duration::from_secs(1);
    p.handle_update(&r("xfer-1"), &SendUpdate::Expect, t1);
    p.handle_update(&r("xfer-1"), &SendUpdate::Ready { block_ids: vec![4] }, t1);
    assert_eq!(p.poll_finished(), [r("xfer-1")].into(), "no lease for a pull that will not come");
}

#[test]
fn a_pull_that_may_not_precede_is_refused_as_unknown() {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    let mut pull = core(vec![request("cmpl-1", false)], t0);
    pull.claim_ready(&mut p, t0);
    assert!(!pull.is_waiting());
    assert_eq!(cause(&pull.reply().outcomes[0].outcome), Some(FailureCause::UnknownRequest));
    assert!(p.is_empty(), "nothing held for it");
}

#[test]
fn awaited_requests_are_bounded() {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    for i in 0..MAX_AWAITED {
        assert_eq!(p.claim_or_await(&r(&format!("x-{i}")), Puller::ONLY, t0 + BUDGET, t0), Claim::NotReady);
    }
    assert_eq!(p.claim_or_await(&r("one-too-many"), Puller::ONLY, t0 + BUDGET, t0), Claim::Unknown);
    // The engine seeing one frees a place.
    p.handle_update(&r("x-0"), &SendUpdate::Expect, t0);
    assert_eq!(p.claim_or_await(&r("one-more"), Puller::ONLY, t0 + BUDGET, t0), Claim::NotReady);
    // So does an awaited one passing its bound.
    p.handle_timeout(t0 + BUDGET);
    assert_eq!(p.len(), 1, "only the expected one is left");
    assert_eq!(p.claim_or_await(&r("later"), Puller::ONLY, t0 + 2 * BUDGET, t0 + BUDGET), Claim::NotReady);
}

#[test]
fn a_request_forgotten_by_the_engine_frees_its_awaited_place() {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    assert_eq!(p.claim_or_await(&r("xfer-1"), Puller::ONLY, t0 + BUDGET, t0), Claim::NotReady);
    p.handle_update(&r("xfer-1"), &SendUpdate::Forget, t0);
    assert!(p.is_empty());
    assert!(p.poll_finished().is_empty(), "the engine frees it itself");
}

#[test]
fn an_awaited_place_is_kept_no_longer_than_ps_own_bound() {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    let day = Duration::from_secs(24 * 60 * 60);
    let (mut pull, _) = TransferCore::new(1, vec![request("xfer-1", true)], day, t0, LEASE, &EngineId::new("p"));
    pull.claim_ready(&mut p, t0);
    assert_eq!(pull.wait_end(), t0 + LEASE, "P's abort timeout bounds the wait");
    p.handle_timeout(t0 + LEASE + REPLY_MARGIN);
    assert!(p.is_empty(), "a day-long budget does not hold the place");
}
