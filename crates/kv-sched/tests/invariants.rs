#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Invariants over arbitrary interleavings of scheduler calls on a `kv_both`
//! instance, driven the way an engine drives them (what
//! `get_num_new_matched_tokens` returns is what `update_state_after_alloc`
//! gets): at most one pull per request, every request counted as external
//! (the engine waits for its KV) has its pull in the next step's metadata,
//! every announced send entry ends in exactly one `Ready` or `Forget`, and
//! nothing is tracked once every request has finished.

mod common;

use std::collections::BTreeSet;

use common::*;
use kv_proto::{KvRole, KvTransferParams, ReqId, SendUpdate};
use kv_sched::{EngineRequest, RequestStatus};
use proptest::prelude::*;

/// What the proxy attached to a request.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Plain,
    Pull,
    PullWithoutHost,
    PullWithoutPort,
    PullWithoutEndpoint,
    RemoteDecode,
}

impl Kind {
    fn params(self) -> Option<KvTransferParams> {
        match self {
            Kind::Plain => None,
            Kind::Pull => Some(pull_from_p()),
            Kind::PullWithoutHost => Some(params(true, false, None, Some(P_PORT))),
            Kind::PullWithoutPort => Some(params(true, false, Some(P_HOST), None)),
            Kind::PullWithoutEndpoint => Some(params(true, false, None, None)),
            Kind::RemoteDecode => Some(decode_elsewhere()),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Schedule (or reschedule after preemption) request `i`, of which the
    /// prefix cache already holds `num_computed_tokens`.
    Alloc { i: usize, num_computed_tokens: usize },
    /// Finish request `i`.
    Finish { i: usize, status: RequestStatus, num_blocks: usize },
    /// End of a scheduler step.
    Build,
}

const N: usize = 6;
const PROMPT_LEN: usize = 64;

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Plain),
        Just(Kind::Pull),
        Just(Kind::PullWithoutHost),
        Just(Kind::PullWithoutPort),
        Just(Kind::PullWithoutEndpoint),
        Just(Kind::RemoteDecode),
    ]
}

fn status() -> impl Strategy<Value = RequestStatus> {
    prop_oneof![
        Just(RequestStatus::FinishedStopped),
        Just(RequestStatus::FinishedLengthCapped),
        Just(RequestStatus::FinishedAborted),
        Just(RequestStatus::FinishedIgnored),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // 0 to 4 blocks of 16 tokens cached: none, partial and full prefix hits.
        (0..N, 0usize..=4).prop_map(|(i, n)| Op::Alloc { i, num_computed_tokens: n * 16 }),
        (0..N, status(), 0usize..3).prop_map(|(i, status, num_blocks)| Op::Finish { i, status, num_blocks }),
        Just(Op::Build),
    ]
}

proptest! {
    #[test]
    fn scheduler_invariants(kinds in proptest::collection::vec(kind(), N), ops in proptest::collection::vec(op(), 0..60)) {
        let mut s = sched(KvRole::Both);
        let mut reqs: Vec<EngineRequest> = kinds
            .iter()
            .enumerate()
            .map(|(i, k)| req(&format!("r{i}"), PROMPT_LEN, RequestStatus::Waiting, k.params()))
            .collect();
        let mut finished = [false; N];
        let mut emitted = Vec::new();
        // Counted as external since the last build: the engine parks these
        // until the worker reports their pull, so the pull must go out.
        let mut awaited: BTreeSet<ReqId> = BTreeSet::new();
        let mut ever_awaited = [false; N];
        // Finished while counted as external and before any build: the pull
        // goes out with no block (P only frees).
        let mut finished_before_build = [false; N];
        // Pulled into blocks, then finished: the worker must cancel it.
        let mut pulled_into_blocks = [false; N];
        let mut expect_cancel: BTreeSet<ReqId> = BTreeSet::new();
        let mut watched: BTreeSet<ReqId> = BTreeSet::new();

        let all_ops = ops.into_iter().chain((0..N).map(|i| Op::Finish {
            i,
            status: RequestStatus::FinishedAborted,
            num_blocks: 1,
        }));
        for op in all_ops.chain([Op::Build]) {
            match op {
                Op::Alloc { i, num_computed_tokens } if !finished[i] => {
                    let (num_external_tokens, load_async) = s.get_num_new_matched_tokens(&reqs[i], num_computed_tokens);
                    prop_assert_eq!(load_async, num_external_tokens > 0);
                    if load_async {
                        prop_assert!(matches!(kinds[i], Kind::Pull), "{:?} counted as external", kinds[i]);
                        prop_assert_eq!(num_external_tokens, PROMPT_LEN - num_computed_tokens);
                        prop_assert!(!ever_awaited[i], "counted as external twice");
                        ever_awaited[i] = true;
                        awaited.insert(reqs[i].request_id.clone());
                    }
                    reqs[i].status = RequestStatus::Running;
                    s.update_state_after_alloc(&mut reqs[i], &[1, 2, 3], num_external_tokens).unwrap();
                }
                Op::Finish { i, status, num_blocks } if !finished[i] => {
                    finished[i] = true;
                    if awaited.contains(&reqs[i].request_id) {
                        finished_before_build[i] = true;
                    }
                    if pulled_into_blocks[i] {
                        expect_cancel.insert(reqs[i].request_id.clone());
                    }
                    reqs[i].status = status;
                    let blocks: Vec<u32> = (0..num_blocks as u32).collect();
                    let (delay_free, returned) = s.request_finished(&mut reqs[i], &blocks).unwrap();
                    let remote_decode = matches!(kinds[i], Kind::RemoteDecode);
                    let capped = remote_decode && status == RequestStatus::FinishedLengthCapped;
                    prop_assert_eq!(delay_free, capped && num_blocks > 0);
                    // Nothing held, nothing to renew: no key.
                    let expected = capped.then(|| KvTransferParams {
                        remote_renewal_key: (num_blocks > 0).then(|| renewal_key(reqs[i].request_id.as_str())),
                        ..points_here(reqs[i].request_id.as_str())
                    });
                    prop_assert_eq!(returned, expected);
                }
                Op::Alloc { .. } | Op::Finish { .. } => {}
                Op::Build => {
                    let meta = s.build_connector_meta();
                    for id in std::mem::take(&mut awaited) {
                        prop_assert!(
                            meta.reqs_to_recv.contains_key(&id),
                            "{} is awaited by the engine but no pull went out: {:?}",
                            id,
                            meta
                        );
                    }
                    for (id, pull) in &meta.reqs_to_recv {
                        if let Some(i) = (0..N).find(|&i| &reqs[i].request_id == id) {
                            pulled_into_blocks[i] |= !pull.local_block_ids.is_empty();
                        }
                    }
                    prop_assert_eq!(
                        &meta.reqs_to_cancel,
                        &std::mem::take(&mut expect_cancel),
                        "exactly the finished requests whose pull went out into blocks are cancelled"
                    );
                    for id in meta.reqs_to_watch.keys() {
                        prop_assert!(watched.insert(id.clone()), "{} watched twice", id);
                    }
                    for id in &meta.reqs_to_unwatch {
                        prop_assert!(watched.remove(id), "{} unwatched without a watch", id);
                    }
                    emitted.push(meta);
                }
            }
        }
        prop_assert!(awaited.is_empty());
        prop_assert!(watched.is_empty(), "watches left after every request finished: {:?}", watched);
        prop_assert_eq!(s.live_watches(), 0);

        prop_assert_eq!(s.live_send_entries(), 0);
        prop_assert_eq!(s.live_pulls(), 0, "every finished request's pull is cancelled or known finished");
        prop_assert!(s.build_connector_meta().is_empty());

        for (i, k) in kinds.iter().enumerate() {
            let id = ReqId::new(format!("r{i}"));
            let recvs: Vec<_> = emitted.iter().filter_map(|m| m.reqs_to_recv.get(&id)).collect();
            let sends: Vec<_> = emitted.iter().filter_map(|m| m.reqs_to_send.get(&id)).collect();
            match k {
                // Exactly one pull: on scheduling, or on abort before scheduling.
                Kind::Pull => {
                    prop_assert_eq!(recvs.len(), 1);
                    if finished_before_build[i] {
                        prop_assert!(recvs[0].local_block_ids.is_empty(), "finished before its pull went out");
                    } else if ever_awaited[i] {
                        prop_assert_eq!(&recvs[0].local_block_ids, &vec![1, 2, 3], "pulled into its blocks");
                    }
                }
                _ => prop_assert!(recvs.is_empty()),
            }
            if matches!(k, Kind::RemoteDecode) {
                let terminal = sends.iter().filter(|u| !matches!(u, SendUpdate::Expect)).count();
                let announced = sends.iter().any(|u| matches!(u, SendUpdate::Expect));
                prop_assert!(terminal <= 1, "at most one Ready/Forget: {:?}", sends);
                if announced {
                    prop_assert!(
                        matches!(sends.last(), Some(SendUpdate::Ready { .. } | SendUpdate::Forget)),
                        "announced entry not withdrawn: {:?}",
                        sends
                    );
                }
            } else {
                prop_assert!(sends.is_empty());
            }
        }
    }
}
