#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Invariants over arbitrary interleavings of scheduler calls on a `kv_both`
//! instance: at most one pull per request, every announced send entry ends in
//! exactly one `Ready` or `Forget`, and nothing is tracked once every request
//! has finished.

mod common;

use common::*;
use kv_proto::{KvRole, KvTransferParams, ReqId, SendUpdate};
use kv_sched::{EngineRequest, RequestStatus};
use proptest::prelude::*;

/// What the proxy attached to a request.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Plain,
    Pull,
    PullWithoutEndpoint,
    RemoteDecode,
}

impl Kind {
    fn params(self) -> Option<KvTransferParams> {
        match self {
            Kind::Plain => None,
            Kind::Pull => Some(pull_from_p()),
            Kind::PullWithoutEndpoint => Some(params(true, false, None, Some(P_PORT))),
            Kind::RemoteDecode => Some(decode_elsewhere()),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// Schedule (or reschedule after preemption) request `i`.
    Alloc { i: usize, num_external_tokens: usize },
    /// Finish request `i`.
    Finish { i: usize, status: RequestStatus, num_blocks: usize },
    /// End of a scheduler step.
    Build,
}

const N: usize = 6;

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![Just(Kind::Plain), Just(Kind::Pull), Just(Kind::PullWithoutEndpoint), Just(Kind::RemoteDecode)]
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
        (0..N, 0usize..3).prop_map(|(i, n)| Op::Alloc { i, num_external_tokens: n * 16 }),
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
            .map(|(i, k)| req(&format!("r{i}"), 64, RequestStatus::Waiting, k.params()))
            .collect();
        let mut finished = [false; N];
        let mut emitted = Vec::new();

        let all_ops = ops.into_iter().chain((0..N).map(|i| Op::Finish {
            i,
            status: RequestStatus::FinishedAborted,
            num_blocks: 1,
        }));
        for op in all_ops.chain([Op::Build]) {
            match op {
                Op::Alloc { i, num_external_tokens } if !finished[i] => {
                    reqs[i].status = RequestStatus::Running;
                    s.update_state_after_alloc(&mut reqs[i], &[1, 2, 3], num_external_tokens).unwrap();
                }
                Op::Finish { i, status, num_blocks } if !finished[i] => {
                    finished[i] = true;
                    reqs[i].status = status;
                    let blocks: Vec<u32> = (0..num_blocks as u32).collect();
                    let (delay_free, returned) = s.request_finished(&mut reqs[i], &blocks).unwrap();
                    let remote_decode = matches!(kinds[i], Kind::RemoteDecode);
                    let capped = remote_decode && status == RequestStatus::FinishedLengthCapped;
                    prop_assert_eq!(delay_free, capped && num_blocks > 0);
                    prop_assert_eq!(returned, capped.then(points_here));
                }
                Op::Alloc { .. } | Op::Finish { .. } => {}
                Op::Build => emitted.push(s.build_connector_meta()),
            }
        }

        prop_assert_eq!(s.live_send_entries(), 0);
        prop_assert!(s.build_connector_meta().is_empty());

        for (i, k) in kinds.iter().enumerate() {
            let id = ReqId::new(format!("r{i}"));
            let recvs: Vec<_> = emitted.iter().filter_map(|m| m.reqs_to_recv.get(&id)).collect();
            let sends: Vec<_> = emitted.iter().filter_map(|m| m.reqs_to_send.get(&id)).collect();
            match k {
                // Exactly one pull: on scheduling, or on abort before scheduling.
                Kind::Pull => prop_assert_eq!(recvs.len(), 1),
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
