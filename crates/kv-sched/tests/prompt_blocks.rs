#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Block lists cut to the blocks holding prompt tokens, once the scheduler
//! knows the engine's block size: vLLM 0.20 to 0.24 hand a request finished
//! on P every block it holds (a speculative-decoding lookahead block
//! included), and D's async-load blocks may hold one too. P's KV goes into
//! D's blocks as P's *last* blocks, so one extra trailing block on P would
//! shift every byte by a block.

mod common;

use std::num::NonZeroUsize;

use common::*;
use kv_proto::{BlockId, ConnectorMetadata, KvRole, SendUpdate};
use kv_sched::{ConnectorScheduler, RequestStatus};
use rstest::rstest;

const BLOCK_TOKENS: usize = 16;

fn knowing_block_size(role: KvRole) -> ConnectorScheduler {
    sched(role).with_block_tokens(NonZeroUsize::new(BLOCK_TOKENS).unwrap())
}

/// What P's worker is told to send for a request of `prompt_len` tokens
/// that holds `held` when it finishes.
fn sent_by_p(s: &mut ConnectorScheduler, prompt_len: usize, held: &[BlockId]) -> ConnectorMetadata {
    let mut r = req("r1", prompt_len, RequestStatus::Running, Some(decode_elsewhere()));
    s.update_state_after_alloc(&mut r, &[], 0).unwrap();
    s.build_connector_meta();
    r.status = RequestStatus::FinishedLengthCapped;
    let (delay, _) = s.request_finished(&mut r, held).unwrap();
    assert!(delay, "P holds the blocks it sends");
    s.build_connector_meta()
}

#[rstest]
#[case::a_lookahead_block_past_a_full_last_block(32, &[1, 2, 3], &[1, 2])]
#[case::a_lookahead_block_past_a_partial_last_block(40, &[1, 2, 3, 4], &[1, 2, 3])]
#[case::exactly_the_prompts_blocks(33, &[1, 2, 3], &[1, 2, 3])]
#[case::never_more_than_held(64, &[1, 2], &[1, 2])]
fn p_sends_only_the_prompts_blocks(
    #[values(KvRole::Producer, KvRole::Both)] role: KvRole,
    #[case] prompt_len: usize,
    #[case] held: &[BlockId],
    #[case] sent: &[BlockId],
) {
    let mut s = knowing_block_size(role);
    assert_eq!(sent_by_p(&mut s, prompt_len, held), meta(vec![], vec![("r1", ready(sent))]));
    assert_eq!(s.live_send_entries(), 0);
}

#[test]
fn without_the_block_size_p_sends_every_block_it_holds() {
    let mut s = sched(KvRole::Producer);
    assert_eq!(sent_by_p(&mut s, 32, &[1, 2, 3]), meta(vec![], vec![("r1", ready(&[1, 2, 3]))]));
}

#[rstest]
// 48 prompt tokens, 16 cached locally, 32 to pull: two blocks, a third allocated for lookahead.
#[case::a_lookahead_block_after_the_pulled_ones(48, 32, &[5, 6, 7], &[5, 6], 16)]
#[case::a_lookahead_block_after_a_partial_last_block(40, 40, &[5, 6, 7, 8], &[5, 6, 7], 0)]
#[case::exactly_the_prompts_blocks(40, 24, &[5, 6], &[5, 6], 16)]
fn d_pulls_into_the_prompts_blocks_only(
    #[values(KvRole::Consumer, KvRole::Both)] role: KvRole,
    #[case] prompt_len: usize,
    #[case] external: usize,
    #[case] unhashed: &[BlockId],
    #[case] pulled: &[BlockId],
    #[case] first_token: u64,
) {
    let mut s = knowing_block_size(role);
    let mut r = req("r1", prompt_len, RequestStatus::Running, Some(pull_from_p()));
    s.update_state_after_alloc(&mut r, unhashed, external).unwrap();
    assert_eq!(s.build_connector_meta(), meta(vec![("r1", recv_from_p_at(pulled, first_token))], vec![]));
}

#[test]
fn a_request_with_nothing_held_is_forgotten_not_sent() {
    let mut s = knowing_block_size(KvRole::Producer);
    let mut r = req("r1", 32, RequestStatus::Running, Some(decode_elsewhere()));
    s.update_state_after_alloc(&mut r, &[], 0).unwrap();
    s.build_connector_meta();
    r.status = RequestStatus::FinishedLengthCapped;
    assert!(!s.request_finished(&mut r, &[]).unwrap().0);
    assert_eq!(s.build_connector_meta(), meta(vec![], vec![("r1", SendUpdate::Forget)]));
}
