//! P's decisions for one transfer request, with explicit time: what is
//! refused at once, what waits and until when, what a wait that ends means
//! for each request, and the reply's one outcome per request, in order.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kv_proto::{EngineId, FailureCause, Outcome, ReqId, RequestBlocks, SendUpdate};
use kv_worker::serving::{remote_blocks_staged, BlockMap, Piece, TransferCore, WaitEnd, MAX_WAIT_BUDGET, REPLY_MARGIN};
use kv_worker::{Puller, SenderCore};
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
        first_token: None,
        may_precede_prefill: false,
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
    let answer_by = budget - REPLY_MARGIN.min(budget / 8);
    assert_eq!(core.wait_end(), t0 + answer_by.min(abort_timeout));
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

/// Nothing is written once D's wait budget (60 s from receipt here) has
/// passed: a batch P could not start writing before then fails with
/// `timeout`, whatever P's own abort timeout.
#[rstest]
#[case::while_the_budget_runs(59.999, None)]
#[case::when_it_ends(60.0, Some(FailureCause::Timeout))]
#[case::after_it(600.0, Some(FailureCause::Timeout))]
fn nothing_is_written_past_ds_budget(#[case] at: f64, #[case] refused: Option<FailureCause>) {
    let t0 = Instant::now();
    let budget = Duration::from_secs(60);
    let (core, _) = TransferCore::new(1, vec![request("a", None)], budget, t0, LEASE, &EngineId::new("p"));
    let got = core.out_of_budget(t0 + Duration::from_secs_f64(at));
    assert_eq!(got.as_ref().map(|(cause, _)| *cause), refused);
    if let Some((_, reason)) = got {
        assert!(reason.contains("wait budget"), "{reason}");
    }
}

fn blocks_request(id: &str, blocks: &[u32]) -> RequestBlocks {
    RequestBlocks {
        req_id: r(id),
        decode_req_id: None,
        prefill_engine_id: None,
        block_ids: blocks.to_vec(),
        first_token: None,
        may_precede_prefill: false,
    }
}

/// What D is told: (request, landed, outcome's cause or done).
fn told(core: &mut TransferCore) -> Vec<(String, u32, Option<Option<FailureCause>>)> {
    core.take_progress()
        .into_iter()
        .map(|p| (p.req_id.as_str().to_owned(), p.landed, p.outcome.as_ref().map(cause)))
        .collect()
}

/// D's blocks of each batch, per piece.
fn remote_of(batches: &[Vec<Piece>]) -> Vec<Vec<Vec<u32>>> {
    batches.iter().map(|b| b.iter().map(|p| p.remote.clone()).collect()).collect()
}

/// A request of five blocks P stages in parts (`staged`, one after the
/// other) written with D's pieces (`piece`, 0: none): the batches each
/// part yields (D's blocks: batches split by `/`, pieces by `|`), and what
/// D hears as they land.
#[rstest]
#[case::ready_whole_in_pieces_of_two(2, &[5], &["10,11/12,13/14"])]
#[case::staged_in_parts_whole_pieces_only(2, &[3, 5], &["10,11", "12,13/14"])]
#[case::no_pieces_writes_what_is_staged(0, &[3, 5], &["10,11,12", "13,14"])]
#[case::pieces_larger_than_the_request(8, &[2, 5], &["", "10,11,12,13,14"])]
#[case::pieces_of_one_share_no_batch(1, &[2, 5], &["10/11", "12/13/14"])]
fn a_claimed_request_is_written_as_it_is_staged(
    #[case] piece: u32,
    #[case] staged: &[usize],
    #[case] batches: &[&str],
) {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    let local = [1, 2, 3, 4, 5];
    p.handle_update(&r("a"), &SendUpdate::Expect, t0);
    let (core, _) = TransferCore::new(
        1,
        vec![blocks_request("a", &[10, 11, 12, 13, 14])],
        Duration::from_secs(60),
        t0,
        LEASE,
        &EngineId::new("p"),
    );
    let mut core = core.with_pieces(piece);
    let mut landed_told = Vec::new();
    for (&n, want) in staged.iter().zip(batches) {
        p.handle_staged(&r("a"), &local, n, t0);
        core.claim_ready(&mut p, t0);
        let got = core.next_batches(&mut p);
        let want: Vec<Vec<Vec<u32>>> = want
            .split('/')
            .filter(|b| !b.is_empty())
            .map(|b| b.split('|').map(|p| p.split(',').map(|n| n.parse().unwrap()).collect()).collect())
            .collect();
        assert_eq!(remote_of(&got), want, "after {n} staged");
        for batch in &got {
            for piece in batch {
                let skip = piece.landed_after - piece.remote.len();
                assert_eq!(piece.local, local[skip..piece.landed_after], "P's blocks of the piece");
            }
            core.batch_written(batch, &Ok(()), &mut p);
        }
        landed_told.extend(told(&mut core));
    }
    assert!(!core.is_open());
    assert_eq!(p.poll_finished(), [r("a")].into(), "released on the sender once written whole");
    let done = ("a".to_owned(), 5, Some(None));
    if piece == 0 {
        assert!(landed_told.is_empty(), "D asked for no progress");
    } else {
        assert_eq!(landed_told.last(), Some(&done), "the last piece tells the outcome");
        let counts: Vec<u32> = landed_told.iter().map(|(_, n, _)| *n).collect();
        assert!(counts.windows(2).all(|w| w[0] < w[1]), "{counts:?}");
    }
    assert_eq!(cause(&core.reply().outcomes[0].outcome), None);
}

/// How a request being written in pieces fails: D hears at once what
/// landed and why, and P releases it.
#[rstest]
#[case::write_fails(FailureCause::WriteFailed, 2)]
#[case::p_cannot_stage_the_rest(FailureCause::CopyFailed, 2)]
#[case::wait_ends(FailureCause::NotReady, 2)]
fn a_request_failing_mid_write_is_told_at_once(#[case] why: FailureCause, #[case] landed: u32) {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    p.handle_update(&r("a"), &SendUpdate::Expect, t0);
    p.handle_staged(&r("a"), &[1, 2, 3, 4], 2, t0);
    let reqs = vec![blocks_request("a", &[10, 11, 12, 13]), blocks_request("b", &[20])];
    p.handle_update(&r("b"), &SendUpdate::Expect, t0);
    let (core, _) = TransferCore::new(1, reqs, Duration::from_secs(60), t0, LEASE, &EngineId::new("p"));
    let mut core = core.with_pieces(2);
    core.claim_ready(&mut p, t0);
    let batches = core.next_batches(&mut p);
    assert_eq!(remote_of(&batches), [vec![vec![10, 11]]]);
    core.batch_written(&batches[0], &Ok(()), &mut p);
    assert_eq!(told(&mut core), [("a".to_owned(), 2, None)]);
    match why {
        FailureCause::WriteFailed => {
            p.handle_staged(&r("a"), &[1, 2, 3, 4], 4, t0);
            let batches = core.next_batches(&mut p);
            core.batch_written(&batches[0], &Err((why, "peer reset".to_owned())), &mut p);
        }
        FailureCause::CopyFailed => {
            p.fail(&r("a"), why, t0);
            assert!(core.next_batches(&mut p).is_empty());
        }
        _ => core.end_wait(WaitEnd::Deadline, &mut p),
    }
    let about_a: Vec<_> = told(&mut core).into_iter().filter(|(id, _, _)| id == "a").collect();
    assert_eq!(about_a, [("a".to_owned(), landed, Some(Some(why)))], "told before the reply");
    assert!(p.poll_finished().contains(&r("a")), "P let go of it");
    assert_eq!(core.is_open(), why != FailureCause::NotReady, "b still waits, unless the wait ended");
}

#[test]
fn small_requests_share_a_batch_and_refusals_are_told_at_once() {
    let t0 = Instant::now();
    let mut p = sender(&["a", "b", "c"], &[], t0);
    let reqs = vec![
        blocks_request("a", &[10]),
        RequestBlocks { prefill_engine_id: Some(EngineId::new("other")), ..blocks_request("x", &[11]) },
        blocks_request("b", &[12]),
        blocks_request("c", &[13, 14]),
    ];
    let (core, _) = TransferCore::new(1, reqs, Duration::from_secs(60), t0, LEASE, &EngineId::new("p"));
    let mut core = core.with_pieces(4);
    assert_eq!(told(&mut core), [("x".to_owned(), 0, Some(Some(FailureCause::PeerRefused)))]);
    core.claim_ready(&mut p, t0);
    let batches = core.next_batches(&mut p);
    assert_eq!(remote_of(&batches), [vec![vec![10], vec![12], vec![13, 14]]], "one batch of four blocks");
    core.batch_written(&batches[0], &Ok(()), &mut p);
    let done: Vec<String> = told(&mut core).into_iter().map(|(id, _, o)| format!("{id}:{o:?}")).collect();
    assert_eq!(done, ["a:Some(None)", "b:Some(None)", "c:Some(None)"]);
    assert!(!core.is_open());
}

/// Parses batches of D's blocks: batches split by `/`, pieces by `|`.
fn parse_batches(want: &str) -> Vec<Vec<Vec<u32>>> {
    want.split('/')
        .filter(|b| !b.is_empty())
        .map(|b| b.split('|').map(|p| p.split(',').map(|n| n.parse().unwrap()).collect()).collect())
        .collect()
}

/// How a request maps by token: P's blocks hold `lt` tokens, D's `rt`;
/// P holds `local` blocks, D asks for `remote`, starting at `first`.
struct TokenCase {
    lt: u32,
    rt: u32,
    local: u32,
    remote: &'static [u32],
    first: Option<u64>,
}

const fn tokens(lt: u32, rt: u32, local: u32, remote: &'static [u32], first: Option<u64>) -> TokenCase {
    TokenCase { lt, rt, local, remote, first }
}

/// A request mapped by token that P stages block by block (`staged`, in
/// turn): a block of D's is written once every token of it P holds is
/// staged, in D's pieces of `piece`, and every piece is planned from all
/// of P's blocks.
#[rstest]
#[case::to_larger_blocks(tokens(16, 32, 4, &[10, 11], Some(0)), 1, &[1, 2, 3, 4], &["", "10", "", "11"])]
#[case::to_smaller_blocks(tokens(32, 16, 2, &[10, 11, 12, 13], Some(0)), 2, &[1, 2], &["10,11", "12,13"])]
#[case::a_prefix_hit_mid_prefill_block(tokens(16, 32, 4, &[11], Some(32)), 1, &[2, 3, 4], &["", "", "11"])]
#[case::the_last_block_holds_fewer_tokens(tokens(16, 32, 3, &[10, 11], Some(0)), 1, &[2, 3], &["10", "11"])]
#[case::no_pieces(tokens(16, 16, 4, &[10, 11, 12], None), 0, &[2, 4], &["10", "11,12"])]
fn a_token_mapped_request_is_written_as_its_tokens_are_staged(
    #[case] case: TokenCase,
    #[case] piece: u32,
    #[case] staged: &[usize],
    #[case] batches: &[&str],
) {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    let local: Vec<u32> = (1..=case.local).collect();
    let remote = case.remote;
    p.handle_update(&r("a"), &SendUpdate::Expect, t0);
    let request = RequestBlocks { first_token: case.first, ..blocks_request("a", remote) };
    let (core, _) = TransferCore::new(1, vec![request], Duration::from_secs(60), t0, LEASE, &EngineId::new("p"));
    let mut core = core.with_pieces(piece).with_block_map(BlockMap::Tokens { local: case.lt, remote: case.rt });
    for (&n, want) in staged.iter().zip(batches) {
        p.handle_staged(&r("a"), &local, n, t0);
        core.claim_ready(&mut p, t0);
        let got = core.next_batches(&mut p);
        assert_eq!(remote_of(&got), parse_batches(want), "after {n} of P's blocks staged");
        for batch in &got {
            for piece in batch {
                assert_eq!(piece.local, local, "the planner maps the piece's tokens onto all of P's blocks");
                assert_eq!(&remote[piece.remote_range()], piece.remote.as_slice());
            }
            core.batch_written(batch, &Ok(()), &mut p);
        }
    }
    assert!(!core.is_open(), "written whole");
    assert_eq!(p.poll_finished(), [r("a")].into());
}

/// Of D's blocks, those every token of which P holds staged.
#[rstest]
#[case::none_staged(0, 4, 2, Some(0), 16, 32, 0)]
#[case::half_a_decode_block(1, 4, 2, Some(0), 16, 32, 0)]
#[case::one_decode_block(2, 4, 2, Some(0), 16, 32, 1)]
#[case::all_staged_whatever_the_mapping(4, 4, 2, None, 16, 32, 2)]
#[case::unknown_mapping_waits_for_all(3, 4, 2, None, 16, 32, 0)]
#[case::smaller_decode_blocks(1, 2, 4, Some(0), 32, 16, 2)]
#[case::past_a_prefix_hit(3, 4, 1, Some(32), 16, 32, 0)]
#[case::last_blocks_of_equal_size(3, 4, 2, None, 16, 16, 1)]
fn decode_blocks_staged(
    #[case] staged: usize,
    #[case] local: usize,
    #[case] remote: usize,
    #[case] first: Option<u64>,
    #[case] lt: u32,
    #[case] rt: u32,
    #[case] want: usize,
) {
    assert_eq!(remote_blocks_staged(staged, local, remote, first, lt, rt), want);
}

/// Two decode ranks pull one request P stages in pieces, each its own
/// heads, each with its own transfer request: each is written what is
/// staged and hears its own progress; when P's copy of the rest fails,
/// each transfer tells its decode rank at once, and P frees the request
/// once, after the last of them.
#[rstest]
#[case::both_written_whole(None)]
#[case::staging_fails_mid_way(Some(FailureCause::CopyFailed))]
fn decode_ranks_sharing_a_request_each_hear_its_pieces(#[case] fails: Option<FailureCause>) {
    let t0 = Instant::now();
    let mut p = SenderCore::new(LEASE, Duration::from_secs(10));
    let local = [1, 2, 3, 4];
    p.handle_update(&r("a"), &SendUpdate::Expect, t0);
    let mut cores: Vec<TransferCore> = (0..2u32)
        .map(|rank| {
            let request = blocks_request("a", &[10 + rank * 10, 11 + rank * 10, 12 + rank * 10, 13 + rank * 10]);
            let (core, _) = TransferCore::new(
                u64::from(rank),
                vec![request],
                Duration::from_secs(60),
                t0,
                LEASE,
                &EngineId::new("p"),
            );
            core.with_pieces(2).with_puller(Puller { rank, of: 2 })
        })
        .collect();
    p.handle_staged(&r("a"), &local, 2, t0);
    for core in &mut cores {
        assert_eq!(core.claim_ready(&mut p, t0).len(), 1, "each rank claims it once");
        let batches = core.next_batches(&mut p);
        assert_eq!(batches.len(), 1);
        core.batch_written(&batches[0], &Ok(()), &mut p);
        assert_eq!(told(core), [("a".to_owned(), 2, None)]);
    }
    match fails {
        None => p.handle_staged(&r("a"), &local, 4, t0),
        Some(cause) => p.fail(&r("a"), cause, t0),
    }
    assert!(p.poll_finished().is_empty(), "two transfers still hold it");
    for (i, core) in cores.iter_mut().enumerate() {
        for batch in core.next_batches(&mut p) {
            core.batch_written(&batch, &Ok(()), &mut p);
        }
        let landed = if fails.is_some() { 2 } else { 4 };
        assert_eq!(told(core), [("a".to_owned(), landed, Some(fails))], "rank {i} hears its own end");
        assert!(!core.is_open());
        assert_eq!(p.poll_finished().len(), i, "freed after the last rank only");
    }
    let later = p.claim_by(&r("a"), Puller { rank: 0, of: 2 }, t0);
    let expect = match fails {
        Some(cause) => kv_worker::Claim::Failed(cause),
        None => kv_worker::Claim::Unknown,
    };
    assert_eq!(later, expect);
}
