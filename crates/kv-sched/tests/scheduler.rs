#![allow(clippy::unwrap_used, clippy::expect_used)]
//! One case per branch of the reference `MooncakeConnectorScheduler`, per
//! role where the role matters; every case asserts the exact metadata the
//! worker would receive.

mod common;

use common::*;
use kv_proto::{
    BlockId, ConnectorMetadata, EngineId, KvRole, KvTransferParams, RecvReqMeta, RemotePrefill, ReqId, SendUpdate,
};
use kv_sched::{ConnectorScheduler, RequestStatus, SchedError};
use rstest::rstest;

use KvRole::{Both, Consumer, Producer};
use RequestStatus::{FinishedAborted, FinishedIgnored, FinishedLengthCapped, FinishedStopped, Running, Waiting};

const UNHASHED: &[u32] = &[5, 6, 7];
const HELD: &[u32] = &[1, 2, 3];

fn prefill_on_producer(id: &str) -> SchedError {
    SchedError::RemotePrefillOnProducer { role: Producer, request_id: ReqId::from(id) }
}

fn decode_on_consumer(id: &str) -> SchedError {
    SchedError::RemoteDecodeOnConsumer { role: Consumer, request_id: ReqId::from(id) }
}

// ---------------------------------------------------------------------------
// get_num_new_matched_tokens
// ---------------------------------------------------------------------------

#[rstest]
#[case::no_params_loads_nothing(None, 100, 0, (0, false))]
#[case::plain_params_load_nothing(Some(params(false, false, None, None)), 100, 0, (0, false))]
#[case::remote_decode_loads_nothing(Some(decode_elsewhere()), 100, 0, (0, false))]
#[case::remote_prefill_counts_uncomputed_tokens(Some(pull_from_p()), 100, 16, (84, true))]
#[case::remote_prefill_without_prefix_hit_loads_whole_prompt(Some(pull_from_p()), 100, 0, (100, true))]
#[case::remote_prefill_fully_computed_loads_nothing(Some(pull_from_p()), 100, 100, (0, false))]
#[case::remote_prefill_overcomputed_saturates_to_nothing(Some(pull_from_p()), 10, 20, (0, false))]
// The reference counts these and then, in update_state_after_alloc ("Got
// invalid KVTransferParams ... will not utilize KVTransfer"), records no pull:
// the request would wait for KV nobody sends. Here it loads nothing and the
// engine computes it locally.
#[case::invalid_params_missing_host_loads_nothing(Some(params(true, false, None, Some(P_PORT))), 64, 32, (0, false))]
#[case::invalid_params_missing_port_loads_nothing(Some(params(true, false, Some(P_HOST), None)), 64, 32, (0, false))]
#[case::invalid_params_missing_host_and_port_loads_nothing(Some(params(true, false, None, None)), 64, 32, (0, false))]
fn get_num_new_matched_tokens(
    #[values(Producer, Consumer, Both)] role: KvRole,
    #[case] given: Option<KvTransferParams>,
    #[case] prompt_len: usize,
    #[case] num_computed: usize,
    #[case] expected: (usize, bool),
) {
    // Unlike the reference, a prefill-only instance counts no external
    // tokens: update_state_after_alloc refuses a remote prefill there, so
    // nothing would ever load them.
    let remote_prefill = given.as_ref().is_some_and(|p| p.do_remote_prefill);
    let expected = if role == Producer && remote_prefill { (0, false) } else { expected };
    let mut s = sched(role);
    let r = req("r1", prompt_len, Waiting, given.clone());
    let before = r.clone();
    assert_eq!(s.get_num_new_matched_tokens(&r, num_computed), expected);
    assert_eq!(r, before, "get_num_new_matched_tokens must not change the request");
    // A decode instance watches every request it will pull from a named
    // side channel (even one whose prompt it computed: P is still told).
    let will_pull = role != Producer && given.as_ref().is_some_and(|p| p.do_remote_prefill && p.remote().is_some());
    let expected_meta = if will_pull { watched(&["r1"]) } else { empty() };
    assert_eq!(s.build_connector_meta(), expected_meta);
}

// ---------------------------------------------------------------------------
// Watches: the requests whose hold on P the worker renews
// ---------------------------------------------------------------------------

/// One step of a decode instance's life of request `r1`.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// The engine considers it for scheduling.
    Seen,
    /// Its blocks were allocated: the pull is recorded.
    Allocated,
    /// It finished (aborted) before it was scheduled.
    AbortedWaiting,
    /// The scheduler builds this step's metadata.
    Build,
}

/// The pull of `r1` (64 tokens, 16 of them cached) into `blocks`.
fn pull_meta(blocks: &[BlockId]) -> ConnectorMetadata {
    let pull = if blocks.is_empty() { recv_from_p(blocks) } else { recv_from_p_at(blocks, 16) };
    meta(vec![("r1", pull)], vec![])
}

#[rstest]
#[case::seen_is_watched_until_its_pull_goes_out(
    &[Step::Seen, Step::Build, Step::Seen, Step::Build, Step::Allocated, Step::Build],
    vec![watched(&["r1"]), empty(), ConnectorMetadata { reqs_to_unwatch: ids(&["r1"]), ..pull_meta(UNHASHED) }]
)]
#[case::seen_and_allocated_in_one_step_is_never_watched(
    &[Step::Seen, Step::Allocated, Step::Build],
    vec![pull_meta(UNHASHED)]
)]
#[case::seen_then_aborted_tells_p_and_ends_the_watch(
    &[Step::Seen, Step::Build, Step::AbortedWaiting, Step::Build],
    vec![watched(&["r1"]), ConnectorMetadata { reqs_to_unwatch: ids(&["r1"]), ..pull_meta(&[]) }]
)]
#[case::seen_and_aborted_in_one_step_is_never_watched(
    &[Step::Seen, Step::AbortedWaiting, Step::Build],
    vec![pull_meta(&[])]
)]
fn watches_last_from_first_sight_to_the_pull(
    #[values(Consumer, Both)] role: KvRole,
    #[case] steps: &[Step],
    #[case] expected: Vec<ConnectorMetadata>,
) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Waiting, Some(pull_from_p()));
    let mut built = Vec::new();
    for step in steps {
        match step {
            Step::Seen => {
                s.get_num_new_matched_tokens(&r, 16);
            }
            Step::Allocated => s.update_state_after_alloc(&mut r, UNHASHED, 48).unwrap(),
            Step::AbortedWaiting => {
                r.status = FinishedAborted;
                s.request_finished(&mut r, &[]).unwrap();
            }
            Step::Build => built.push(s.build_connector_meta()),
        }
    }
    assert_eq!(built, expected);
    assert_eq!(s.live_watches(), 0, "nothing watched without an owner");
}

// ---------------------------------------------------------------------------
// update_state_after_alloc, then build_connector_meta
// ---------------------------------------------------------------------------

#[rstest]
#[case::no_params_records_nothing(Both, None, UNHASHED, 48, Ok(empty()), None)]
#[case::plain_params_record_nothing(
    Both,
    Some(params(false, false, None, None)),
    UNHASHED,
    48,
    Ok(empty()),
    Some(params(false, false, None, None))
)]
#[case::remote_prefill_pulls_unhashed_blocks_on_consumer(
    Consumer,
    Some(pull_from_p()),
    UNHASHED,
    48,
    Ok(meta(vec![("r1", recv_from_p_at(UNHASHED, 16))], vec![])),
    Some(pulled_from_p())
)]
#[case::remote_prefill_pulls_unhashed_blocks_on_both(
    Both,
    Some(pull_from_p()),
    UNHASHED,
    48,
    Ok(meta(vec![("r1", recv_from_p_at(UNHASHED, 16))], vec![])),
    Some(pulled_from_p())
)]
#[case::partial_prefix_hit_pulls_only_unhashed_blocks(
    Consumer,
    Some(pull_from_p()),
    &[7],
    16,
    Ok(meta(vec![("r1", recv_from_p_at(&[7], 48))], vec![])),
    Some(pulled_from_p())
)]
#[case::full_prefix_hit_sends_empty_block_list_on_consumer(
    Consumer,
    Some(pull_from_p()),
    &[9],
    0,
    Ok(meta(vec![("r1", recv_from_p(&[]))], vec![])),
    Some(pulled_from_p())
)]
#[case::full_prefix_hit_sends_empty_block_list_on_both(
    Both,
    Some(pull_from_p()),
    &[],
    0,
    Ok(meta(vec![("r1", recv_from_p(&[]))], vec![])),
    Some(pulled_from_p())
)]
#[case::remote_prefill_on_producer_refused(
    Producer,
    Some(pull_from_p()),
    UNHASHED,
    48,
    Err(prefill_on_producer("r1")),
    Some(pull_from_p())
)]
#[case::invalid_params_missing_host_refused(
    Consumer,
    Some(params(true, false, None, Some(P_PORT))),
    UNHASHED,
    48,
    Ok(empty()),
    Some(params(false, false, None, Some(P_PORT)))
)]
#[case::invalid_params_missing_port_refused(
    Both,
    Some(params(true, false, Some(P_HOST), None)),
    UNHASHED,
    48,
    Ok(empty()),
    Some(params(false, false, Some(P_HOST), None))
)]
#[case::invalid_params_missing_host_and_port_refused(
    Consumer,
    Some(params(true, false, None, None)),
    UNHASHED,
    48,
    Ok(empty()),
    Some(params(false, false, None, None))
)]
#[case::remote_decode_expects_send_entry_on_producer(
    Producer,
    Some(decode_elsewhere()),
    UNHASHED,
    0,
    Ok(meta(vec![], vec![("r1", SendUpdate::Expect)])),
    Some(decode_elsewhere())
)]
#[case::remote_decode_expects_send_entry_on_both(
    Both,
    Some(decode_elsewhere()),
    UNHASHED,
    0,
    Ok(meta(vec![], vec![("r1", SendUpdate::Expect)])),
    Some(decode_elsewhere())
)]
#[case::remote_decode_on_consumer_refused(
    Consumer,
    Some(decode_elsewhere()),
    UNHASHED,
    0,
    Err(decode_on_consumer("r1")),
    Some(decode_elsewhere())
)]
#[case::remote_prefill_takes_precedence_over_remote_decode(
    Both,
    Some(params(true, true, Some(P_HOST), Some(P_PORT))),
    UNHASHED,
    48,
    Ok(meta(vec![("r1", recv_from_p_at(UNHASHED, 16))], vec![])),
    Some(params(false, true, Some(P_HOST), Some(P_PORT)))
)]
fn update_state_after_alloc(
    #[case] role: KvRole,
    #[case] given: Option<KvTransferParams>,
    #[case] unhashed: &[u32],
    #[case] num_external_tokens: usize,
    #[case] expected: Result<ConnectorMetadata, SchedError>,
    #[case] params_after: Option<KvTransferParams>,
) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Running, given);
    let got = s.update_state_after_alloc(&mut r, unhashed, num_external_tokens);
    let meta = s.build_connector_meta();
    match expected {
        Ok(expected_meta) => {
            assert_eq!(got, Ok(()));
            assert_eq!(meta, expected_meta);
        }
        Err(expected_err) => {
            assert_eq!(got, Err(expected_err));
            assert_eq!(meta, empty(), "a refused call records nothing");
        }
    }
    assert_eq!(r.kv_transfer_params, params_after);
}

// ---------------------------------------------------------------------------
// request_finished
// ---------------------------------------------------------------------------

type Finished = Result<(bool, Option<KvTransferParams>), SchedError>;

/// `announced`: the request went through `update_state_after_alloc` (and a
/// build) before finishing, so any send entry it asked for was announced.
#[rstest]
#[case::no_params_frees_now(Both, None, FinishedLengthCapped, false, Ok((false, None)), empty(), None)]
#[case::abort_before_schedule_notifies_p_with_empty_list_on_consumer(
    Consumer,
    Some(pull_from_p()),
    FinishedAborted,
    false,
    Ok((false, None)),
    meta(vec![("r1", recv_from_p(&[]))], vec![]),
    Some(pulled_from_p())
)]
#[case::abort_before_schedule_notifies_p_with_empty_list_on_both(
    Both,
    Some(pull_from_p()),
    FinishedAborted,
    false,
    Ok((false, None)),
    meta(vec![("r1", recv_from_p(&[]))], vec![]),
    Some(pulled_from_p())
)]
#[case::abort_before_schedule_on_producer_refused(
    Producer,
    Some(pull_from_p()),
    FinishedAborted,
    false,
    Err(prefill_on_producer("r1")),
    empty(),
    Some(pull_from_p())
)]
#[case::abort_before_schedule_invalid_params_notifies_nothing(
    Consumer,
    Some(params(true, false, Some(P_HOST), None)),
    FinishedAborted,
    false,
    Ok((false, None)),
    empty(),
    Some(params(false, false, Some(P_HOST), None))
)]
#[case::pulled_request_finishing_does_not_pull_again_but_cancels_its_pull(
    Consumer,
    Some(pull_from_p()),
    FinishedStopped,
    true,
    Ok((false, None)),
    cancelled(&["r1"]),
    Some(pulled_from_p())
)]
#[case::plain_params_free_now(
    Producer,
    Some(params(false, false, None, None)),
    FinishedLengthCapped,
    false,
    Ok((false, None)),
    empty(),
    Some(params(false, false, None, None))
)]
#[case::length_capped_delay_frees_and_points_d_here_on_producer(
    Producer,
    Some(decode_elsewhere()),
    FinishedLengthCapped,
    true,
    Ok((true, Some(points_here("r1")))),
    meta(vec![], vec![("r1", ready(HELD))]),
    Some(decode_elsewhere())
)]
#[case::length_capped_delay_frees_and_points_d_here_on_both(
    Both,
    Some(decode_elsewhere()),
    FinishedLengthCapped,
    true,
    Ok((true, Some(points_here("r1")))),
    meta(vec![], vec![("r1", ready(HELD))]),
    Some(decode_elsewhere())
)]
#[case::length_capped_unannounced_still_delay_frees(
    Producer,
    Some(decode_elsewhere()),
    FinishedLengthCapped,
    false,
    Ok((true, Some(points_here("r1")))),
    meta(vec![], vec![("r1", ready(HELD))]),
    Some(decode_elsewhere())
)]
#[case::length_capped_on_consumer_refused(
    Consumer,
    Some(decode_elsewhere()),
    FinishedLengthCapped,
    false,
    Err(decode_on_consumer("r1")),
    empty(),
    Some(decode_elsewhere())
)]
#[case::stopped_early_forgets_send_entry_on_producer(
    Producer,
    Some(decode_elsewhere()),
    FinishedStopped,
    true,
    Ok((false, None)),
    meta(vec![], vec![("r1", SendUpdate::Forget)]),
    Some(decode_elsewhere())
)]
#[case::stopped_early_forgets_send_entry_on_both(
    Both,
    Some(decode_elsewhere()),
    FinishedStopped,
    true,
    Ok((false, None)),
    meta(vec![], vec![("r1", SendUpdate::Forget)]),
    Some(decode_elsewhere())
)]
#[case::aborted_forgets_send_entry(
    Producer,
    Some(decode_elsewhere()),
    FinishedAborted,
    true,
    Ok((false, None)),
    meta(vec![], vec![("r1", SendUpdate::Forget)]),
    Some(decode_elsewhere())
)]
#[case::ignored_forgets_send_entry(
    Both,
    Some(decode_elsewhere()),
    FinishedIgnored,
    true,
    Ok((false, None)),
    meta(vec![], vec![("r1", SendUpdate::Forget)]),
    Some(decode_elsewhere())
)]
#[case::stopped_early_never_announced_records_nothing(
    Producer,
    Some(decode_elsewhere()),
    FinishedStopped,
    false,
    Ok((false, None)),
    empty(),
    Some(decode_elsewhere())
)]
#[case::remote_decode_stopped_on_consumer_frees_now(
    Consumer,
    Some(decode_elsewhere()),
    FinishedStopped,
    false,
    Ok((false, None)),
    empty(),
    Some(decode_elsewhere())
)]
fn request_finished(
    #[case] role: KvRole,
    #[case] given: Option<KvTransferParams>,
    #[case] status: RequestStatus,
    #[case] announced: bool,
    #[case] expected: Finished,
    #[case] expected_meta: ConnectorMetadata,
    #[case] params_after: Option<KvTransferParams>,
) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Running, given);
    if announced {
        s.update_state_after_alloc(&mut r, UNHASHED, 48).unwrap();
        s.build_connector_meta();
    }
    r.status = status;
    assert_eq!(s.request_finished(&mut r, HELD), expected);
    assert_eq!(s.build_connector_meta(), expected_meta);
    assert_eq!(r.kv_transfer_params, params_after);
    assert_eq!(s.live_send_entries(), 0, "nothing kept without an owner");
}

#[rstest]
#[case::length_capped_without_blocks_forgets_send_entry_on_producer(Producer)]
#[case::length_capped_without_blocks_forgets_send_entry_on_both(Both)]
fn length_capped_without_blocks_forgets_send_entry(#[case] role: KvRole) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Running, Some(decode_elsewhere()));
    s.update_state_after_alloc(&mut r, &[], 0).unwrap();
    assert_eq!(s.build_connector_meta(), meta(vec![], vec![("r1", SendUpdate::Expect)]));
    r.status = FinishedLengthCapped;
    let nothing_held = KvTransferParams { remote_renewal_key: None, ..points_here("r1") };
    assert_eq!(s.request_finished(&mut r, &[]), Ok((false, Some(nothing_held))), "nothing to renew: no key");
    assert_eq!(s.build_connector_meta(), meta(vec![], vec![("r1", SendUpdate::Forget)]));
    assert_eq!(s.live_send_entries(), 0);
}

// ---------------------------------------------------------------------------
// build_connector_meta: the reference's role gating and clearing
// ---------------------------------------------------------------------------

/// Drives one request of each kind through one step: `d` pulls from P, `p`
/// is prefilled for a remote decode, `q` finishes its prefill in the same step.
#[rstest]
#[case::producer_emits_sends_only(
    Producer,
    [Err(prefill_on_producer("d")), Ok(()), Ok(())],
    meta(vec![], vec![("p", SendUpdate::Expect), ("q", ready(HELD))])
)]
#[case::consumer_emits_recvs_only(
    Consumer,
    [Ok(()), Err(decode_on_consumer("p")), Err(decode_on_consumer("q"))],
    meta(vec![("d", recv_from_p_at(UNHASHED, 16))], vec![])
)]
#[case::both_emits_recvs_and_sends(
    Both,
    [Ok(()), Ok(()), Ok(())],
    meta(vec![("d", recv_from_p_at(UNHASHED, 16))], vec![("p", SendUpdate::Expect), ("q", ready(HELD))])
)]
fn build_connector_meta_gates_on_role(
    #[case] role: KvRole,
    #[case] outcomes: [Result<(), SchedError>; 3],
    #[case] expected: ConnectorMetadata,
) {
    let mut s = sched(role);
    let mut d = req("d", 64, Running, Some(pull_from_p()));
    let mut p = req("p", 64, Running, Some(decode_elsewhere()));
    let mut q = req("q", 64, Running, Some(decode_elsewhere()));
    let got = [
        s.update_state_after_alloc(&mut d, UNHASHED, 48),
        s.update_state_after_alloc(&mut p, UNHASHED, 0),
        s.update_state_after_alloc(&mut q, UNHASHED, 0).and_then(|()| {
            q.status = FinishedLengthCapped;
            s.request_finished(&mut q, HELD).map(|_| ())
        }),
    ];
    assert_eq!(got, outcomes);
    assert_eq!(s.build_connector_meta(), expected);
    assert_eq!(s.build_connector_meta(), empty(), "build clears both pending sets");
}

#[rstest]
fn metadata_cleared_after_build(#[values(Producer, Consumer, Both)] role: KvRole) {
    let mut s = sched(role);
    let mut d = req("d", 64, Running, Some(pull_from_p()));
    let mut p = req("p", 64, Running, Some(decode_elsewhere()));
    let _ = s.update_state_after_alloc(&mut d, UNHASHED, 48);
    let _ = s.update_state_after_alloc(&mut p, UNHASHED, 0);
    assert!(!s.build_connector_meta().is_empty());
    assert_eq!(s.build_connector_meta(), empty());
    assert_eq!(s.build_connector_meta(), empty());
}

#[rstest]
fn empty_scheduler_builds_empty_metadata(#[values(Producer, Consumer, Both)] role: KvRole) {
    let mut s = sched(role);
    assert_eq!(s.role(), role);
    assert_eq!(s.build_connector_meta(), empty());
    assert_eq!(s.live_send_entries(), 0);
}

// ---------------------------------------------------------------------------
// At most one transfer per request
// ---------------------------------------------------------------------------

#[rstest]
fn update_twice_in_one_step_yields_one_pull(#[values(Consumer, Both)] role: KvRole) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Running, Some(pull_from_p()));
    s.update_state_after_alloc(&mut r, UNHASHED, 48).unwrap();
    s.update_state_after_alloc(&mut r, &[8, 9], 32).unwrap();
    assert_eq!(s.build_connector_meta(), meta(vec![("r1", recv_from_p_at(UNHASHED, 16))], vec![]));
    assert_eq!(s.build_connector_meta(), empty());
}

#[rstest]
fn update_again_after_build_yields_no_second_pull(#[values(Consumer, Both)] role: KvRole) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Running, Some(pull_from_p()));
    s.update_state_after_alloc(&mut r, UNHASHED, 48).unwrap();
    assert_eq!(s.build_connector_meta(), meta(vec![("r1", recv_from_p_at(UNHASHED, 16))], vec![]));
    // Preempted and rescheduled: the engine calls the connector again.
    assert_eq!(s.get_num_new_matched_tokens(&r, 0), (0, false));
    s.update_state_after_alloc(&mut r, UNHASHED, 0).unwrap();
    assert_eq!(s.build_connector_meta(), empty());
    // Aborted after it was scheduled: P was already told by the pull, and
    // the pull (maybe still in flight) is cancelled before the engine frees
    // the blocks.
    r.status = FinishedAborted;
    assert_eq!(s.request_finished(&mut r, UNHASHED), Ok((false, None)));
    assert_eq!(s.build_connector_meta(), cancelled(&["r1"]));
    assert_eq!(s.live_pulls(), 0);
}

/// A request finished in the step its pull was recorded (before the pull
/// went out) pulls into no block: P only frees, nothing to cancel.
#[rstest]
fn finished_before_its_pull_went_out_pulls_nothing(#[values(Consumer, Both)] role: KvRole) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Running, Some(pull_from_p()));
    s.update_state_after_alloc(&mut r, UNHASHED, 48).unwrap();
    r.status = FinishedAborted;
    assert_eq!(s.request_finished(&mut r, UNHASHED), Ok((false, None)));
    assert_eq!(s.build_connector_meta(), meta(vec![("r1", recv_from_p(&[]))], vec![]));
    assert_eq!(s.live_pulls(), 0);
}

/// Once the engine saw the pull reported, finishing the request cancels nothing.
#[rstest]
fn a_pull_reported_finished_is_not_cancelled(#[values(Consumer, Both)] role: KvRole) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Running, Some(pull_from_p()));
    s.update_state_after_alloc(&mut r, UNHASHED, 48).unwrap();
    assert_eq!(s.build_connector_meta(), meta(vec![("r1", recv_from_p_at(UNHASHED, 16))], vec![]));
    assert_eq!(s.live_pulls(), 1);
    s.pull_finished(&ReqId::from("r1"));
    r.status = FinishedStopped;
    assert_eq!(s.request_finished(&mut r, UNHASHED), Ok((false, None)));
    assert_eq!(s.build_connector_meta(), empty());
}

#[rstest]
fn abort_before_schedule_twice_notifies_once(#[values(Consumer, Both)] role: KvRole) {
    let mut s = sched(role);
    let mut r = req("r1", 64, FinishedAborted, Some(pull_from_p()));
    assert_eq!(s.request_finished(&mut r, &[]), Ok((false, None)));
    assert_eq!(s.request_finished(&mut r, &[]), Ok((false, None)));
    assert_eq!(s.build_connector_meta(), meta(vec![("r1", recv_from_p(&[]))], vec![]));
}

/// The engine's whole loop for a request whose params ask for a remote
/// prefill but name no side channel: it is counted as no external tokens, so
/// the engine computes it locally; no pull is recorded and none is expected.
/// (The reference counts it, records no pull, and the request waits forever.)
#[rstest]
#[case::invalid_params_missing_host(params(true, false, None, Some(P_PORT)))]
#[case::invalid_params_missing_port(params(true, false, Some(P_HOST), None))]
#[case::invalid_params_missing_host_and_port(params(true, false, None, None))]
fn invalid_params_are_computed_locally_never_awaited(
    #[values(Consumer, Both)] role: KvRole,
    #[case] given: KvTransferParams,
    #[values(0, 16)] prefix_hit_tokens: usize,
) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Waiting, Some(given.clone()));
    let (external, load_async) = s.get_num_new_matched_tokens(&r, prefix_hit_tokens);
    assert_eq!((external, load_async), (0, false), "nothing to wait for");
    r.status = Running;
    s.update_state_after_alloc(&mut r, UNHASHED, external).unwrap();
    assert_eq!(s.build_connector_meta(), empty(), "no pull without a side channel");
    let cleared = KvTransferParams { do_remote_prefill: false, ..given };
    assert_eq!(r.kv_transfer_params.as_ref(), Some(&cleared), "one attempt per request");
    assert_eq!(s.get_num_new_matched_tokens(&r, prefix_hit_tokens), (0, false));
    r.status = FinishedStopped;
    assert_eq!(s.request_finished(&mut r, UNHASHED), Ok((false, None)));
    assert_eq!(s.build_connector_meta(), empty());
}

// ---------------------------------------------------------------------------
// Later updates replace earlier ones within one step
// ---------------------------------------------------------------------------

#[rstest]
#[case::expect_then_ready_in_one_step_emits_ready(FinishedLengthCapped, HELD, ready(HELD))]
#[case::expect_then_forget_when_stopped_in_one_step_emits_forget(FinishedStopped, HELD, SendUpdate::Forget)]
#[case::expect_then_forget_when_aborted_in_one_step_emits_forget(FinishedAborted, HELD, SendUpdate::Forget)]
#[case::expect_then_forget_without_blocks_in_one_step_emits_forget(FinishedLengthCapped, &[], SendUpdate::Forget)]
fn later_update_in_same_step_replaces_expect(
    #[values(Producer, Both)] role: KvRole,
    #[case] status: RequestStatus,
    #[case] blocks: &[u32],
    #[case] last: SendUpdate,
) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Running, Some(decode_elsewhere()));
    s.update_state_after_alloc(&mut r, UNHASHED, 0).unwrap();
    r.status = status;
    s.request_finished(&mut r, blocks).unwrap();
    assert_eq!(s.build_connector_meta(), meta(vec![], vec![("r1", last)]));
    assert_eq!(s.live_send_entries(), 0);
}

// ---------------------------------------------------------------------------
// Defect 3 of the reference: announced send entries are always withdrawn
// ---------------------------------------------------------------------------

#[rstest]
fn preempted_and_rescheduled_reannounces_then_forgets_once(#[values(Producer, Both)] role: KvRole) {
    let mut s = sched(role);
    let mut r = req("r1", 64, Running, Some(decode_elsewhere()));
    s.update_state_after_alloc(&mut r, UNHASHED, 0).unwrap();
    assert_eq!(s.build_connector_meta(), meta(vec![], vec![("r1", SendUpdate::Expect)]));
    r.status = RequestStatus::Preempted;
    // Rescheduled: the reference announces it again (the worker is idempotent).
    r.status = Running;
    s.update_state_after_alloc(&mut r, UNHASHED, 0).unwrap();
    assert_eq!(s.build_connector_meta(), meta(vec![], vec![("r1", SendUpdate::Expect)]));
    assert_eq!(s.live_send_entries(), 1);
    r.status = FinishedAborted;
    assert_eq!(s.request_finished(&mut r, HELD), Ok((false, None)));
    assert_eq!(s.build_connector_meta(), meta(vec![], vec![("r1", SendUpdate::Forget)]));
    assert_eq!(s.live_send_entries(), 0);
    // A late duplicate finish does not emit a second Forget.
    assert_eq!(s.request_finished(&mut r, HELD), Ok((false, None)));
    assert_eq!(s.build_connector_meta(), empty());
}

#[rstest]
fn every_announced_entry_gets_exactly_one_terminal_update(#[values(Producer, Both)] role: KvRole) {
    let mut s = sched(role);
    let ends = [
        ("a", FinishedLengthCapped, HELD),
        ("b", FinishedStopped, HELD),
        ("c", FinishedAborted, HELD),
        ("d", FinishedLengthCapped, &[][..]),
        ("e", FinishedIgnored, HELD),
    ];
    let mut reqs: Vec<_> = ends.iter().map(|(id, _, _)| req(id, 64, Running, Some(decode_elsewhere()))).collect();
    for r in &mut reqs {
        s.update_state_after_alloc(r, UNHASHED, 0).unwrap();
    }
    assert_eq!(s.live_send_entries(), 5);
    let announced = s.build_connector_meta();
    assert_eq!(announced.reqs_to_send.len(), 5);
    assert!(announced.reqs_to_send.values().all(|u| *u == SendUpdate::Expect));

    for (r, (_, status, blocks)) in reqs.iter_mut().zip(ends) {
        r.status = status;
        s.request_finished(r, blocks).unwrap();
    }
    assert_eq!(s.live_send_entries(), 0);
    assert_eq!(
        s.build_connector_meta(),
        meta(
            vec![],
            vec![
                ("a", ready(HELD)),
                ("b", SendUpdate::Forget),
                ("c", SendUpdate::Forget),
                ("d", SendUpdate::Forget),
                ("e", SendUpdate::Forget),
            ]
        )
    );
}

#[test]
fn finishing_an_unknown_plain_request_emits_nothing() {
    let mut s = sched(Producer);
    let mut r = req("x", 64, FinishedStopped, None);
    assert_eq!(s.request_finished(&mut r, HELD), Ok((false, None)));
    assert_eq!(s.build_connector_meta(), empty());
}

// ---------------------------------------------------------------------------
// Errors and the whole P → D hand-off
// ---------------------------------------------------------------------------

#[test]
fn errors_name_the_role_and_the_request() {
    let e = prefill_on_producer("req-42");
    assert_eq!(
        e.to_string(),
        "request req-42 has do_remote_prefill set, but this instance is kv_producer and never receives KV"
    );
    assert_eq!(e.request_id().as_str(), "req-42");
    let e = decode_on_consumer("req-7");
    assert_eq!(
        e.to_string(),
        "request req-7 has do_remote_decode set, but this instance is kv_consumer and never sends KV"
    );
    assert_eq!(e.request_id().as_str(), "req-7");
}

#[test]
fn refused_calls_leave_request_and_scheduler_unchanged() {
    let mut p = sched(Producer);
    let mut r = req("r1", 64, Running, Some(pull_from_p()));
    assert!(p.update_state_after_alloc(&mut r, UNHASHED, 48).is_err());
    r.status = FinishedAborted;
    assert!(p.request_finished(&mut r, HELD).is_err());
    assert_eq!(r.kv_transfer_params, Some(pull_from_p()));
    assert_eq!(p.build_connector_meta(), empty());

    let mut d = sched(Consumer);
    let mut r = req("r2", 64, FinishedLengthCapped, Some(decode_elsewhere()));
    assert!(d.request_finished(&mut r, HELD).is_err());
    assert_eq!(r.kv_transfer_params, Some(decode_elsewhere()));
    assert_eq!(d.build_connector_meta(), empty());
    assert_eq!(d.live_send_entries(), 0);
}

#[test]
fn prefill_on_p_hands_d_a_pull_of_its_blocks() {
    let mut p = ConnectorScheduler::new(Producer, EngineId::new(P_ENGINE), P_HOST, P_PORT, renewal_secret());
    let mut d = ConnectorScheduler::new(Consumer, EngineId::new(HERE_ENGINE), HERE_HOST, HERE_PORT, renewal_secret());
    // Each engine names its copy of the client's request its own way.
    let (p_id, d_id) = ("cmpl-7-0-b00fff6e", "cmpl-7-0-9760c8b8");

    // P: the proxy sends the request with do_remote_decode, max_tokens = 1.
    let mut on_p = req(p_id, 40, Waiting, Some(decode_elsewhere()));
    assert_eq!(p.get_num_new_matched_tokens(&on_p, 0), (0, false));
    on_p.status = Running;
    p.update_state_after_alloc(&mut on_p, &[10, 11, 12], 0).unwrap();
    assert_eq!(p.build_connector_meta(), meta(vec![], vec![(p_id, SendUpdate::Expect)]));
    on_p.status = FinishedLengthCapped;
    let (delay_free, returned) = p.request_finished(&mut on_p, &[10, 11, 12]).unwrap();
    assert!(delay_free);
    assert_eq!(p.build_connector_meta(), meta(vec![], vec![(p_id, ready(&[10, 11, 12]))]));
    let returned = returned.unwrap();
    assert_eq!(returned.remote_request_id, Some(ReqId::from(p_id)));
    assert_eq!(returned.remote_engine_id, Some(EngineId::new(P_ENGINE)));
    let key = renewal_key(p_id);
    assert_eq!(returned.remote_renewal_key, Some(key), "the key P's worker was given with the ready update");

    // D: the proxy forwards what P returned; D has 16 of 40 tokens cached.
    let mut on_d = req(d_id, 40, Waiting, Some(returned));
    assert_eq!(d.get_num_new_matched_tokens(&on_d, 16), (24, true));
    let pulled = RecvReqMeta {
        local_block_ids: vec![3, 4],
        first_token: Some(16),
        remote: RemotePrefill {
            remote_host: P_HOST.to_owned(),
            remote_port: P_PORT,
            remote_request_id: ReqId::from(p_id),
            remote_engine_id: Some(EngineId::new(P_ENGINE)),
            remote_renewal_key: Some(key),
            bootstrap: None,
        },
    };
    let watch = d.build_connector_meta();
    assert_eq!(watch.reqs_to_watch.get(&ReqId::from(d_id)), Some(&pulled.remote), "D renews P's id, with its key");
    on_d.status = Running;
    d.update_state_after_alloc(&mut on_d, &[3, 4], 24).unwrap();
    let built = d.build_connector_meta();
    assert_eq!(built.reqs_to_recv, [(ReqId::from(d_id), pulled)].into_iter().collect());
    assert_eq!(d.get_num_new_matched_tokens(&on_d, 16), (0, false), "one transfer per request");
    // The worker reports the pull received; the engine decodes, then stops.
    d.pull_finished(&ReqId::from(d_id));
    on_d.status = FinishedStopped;
    assert_eq!(d.request_finished(&mut on_d, &[1, 2, 3, 4]), Ok((false, None)));
    assert_eq!(d.build_connector_meta(), empty());
    assert_eq!(p.live_send_entries() + d.live_send_entries(), 0);
}

/// Every message D's scheduler builds that names a request to P names it by
/// P's id (`remote_request_id`) and engine; D's own id is only the key the
/// worker reports back to the engine under.
#[rstest]
#[case::watch_before_allocation(ReachedOnD::Matched)]
#[case::pull_into_blocks(ReachedOnD::Allocated { external_tokens: 48 })]
#[case::notify_only_pull_of_a_full_prefix_hit(ReachedOnD::Allocated { external_tokens: 0 })]
#[case::notify_only_pull_of_an_abort_before_scheduling(ReachedOnD::AbortedBeforeScheduling)]
fn messages_to_p_name_ps_request_id(#[case] step: ReachedOnD, #[values(true, false)] p_named_it: bool) {
    let mut d = sched(Consumer);
    let d_id = ReqId::from("d-own-id");
    let mut returned = pull_from_p();
    if !p_named_it {
        // An older proxy or a hand-written client: D falls back to its own id.
        returned.remote_request_id = None;
        returned.remote_engine_id = None;
        returned.remote_renewal_key = None;
    }
    let mut r = req(d_id.as_str(), 64, Waiting, Some(returned.clone()));
    let remote = d.get_num_new_matched_tokens(&r, 0);
    assert_eq!(remote, (64, true));
    let named: Vec<RemotePrefill> = match step {
        ReachedOnD::Matched => d.build_connector_meta().reqs_to_watch.into_values().collect(),
        ReachedOnD::Allocated { external_tokens } => {
            d.update_state_after_alloc(&mut r, UNHASHED, external_tokens).unwrap();
            d.build_connector_meta().reqs_to_recv.into_values().map(|m| m.remote).collect()
        }
        ReachedOnD::AbortedBeforeScheduling => {
            r.status = FinishedAborted;
            d.request_finished(&mut r, &[]).unwrap();
            d.build_connector_meta().reqs_to_recv.into_values().map(|m| m.remote).collect()
        }
    };
    let expected = RemotePrefill {
        remote_host: P_HOST.to_owned(),
        remote_port: P_PORT,
        remote_request_id: if p_named_it { ReqId::from(P_REQ) } else { d_id },
        remote_engine_id: p_named_it.then(|| EngineId::new(P_ENGINE)),
        remote_renewal_key: p_named_it.then(p_renewal_key),
        bootstrap: None,
    };
    assert_eq!(named, [expected]);
}

/// How far a request got on D before its message to P was built.
#[derive(Debug, Clone, Copy)]
enum ReachedOnD {
    Matched,
    Allocated { external_tokens: usize },
    AbortedBeforeScheduling,
}

#[test]
fn many_requests_in_one_step_are_all_emitted() {
    let mut s = sched(Both);
    let mut reqs = [
        req("z", 64, Running, Some(pull_from_p())),
        req("a", 64, Running, Some(decode_elsewhere())),
        req("m", 64, Running, Some(pull_from_p())),
    ];
    for r in &mut reqs {
        s.update_state_after_alloc(r, UNHASHED, 48).unwrap();
    }
    let mut aborted = req("b", 64, FinishedAborted, Some(pull_from_p()));
    s.request_finished(&mut aborted, &[]).unwrap();
    assert_eq!(
        s.build_connector_meta(),
        meta(
            vec![("b", recv_from_p(&[])), ("m", recv_from_p_at(UNHASHED, 16)), ("z", recv_from_p_at(UNHASHED, 16))],
            vec![("a", SendUpdate::Expect)]
        )
    );
}
