//! One budget for the op lists all unauthenticated peers hold: peers that
//! keep announcing op lists as large as the whole budget (under a live
//! grant) and sending them keep the receiver's op-list memory (and the
//! process's live heap) within the budget, each gets a refusal naming the
//! reason, and an honest sender's 100,000-op batch completes meanwhile.
//!
//! The case measures the process's heap and descriptors, which concurrent
//! tests would disturb: it wants a test binary of its own.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kv_proto::dataplane::{encode_op, ReplyStatus, OP_LEN};
use kv_proto::{BatchWriter, GrantId, WriteOp};

use super::{budget_reaches, Listener, BOUND};
use crate::pattern::{check, fill};
use crate::{peak_heap_growth, peak_rss_growth, reset_peak_heap, reset_peak_rss, Node, Resources};

/// The receiver's op-list budget (no secret: every peer is unauthenticated).
pub const BUDGET: u64 = 16 << 20;
/// Hostile peers, each announcing (and sending) an op list as large as the
/// whole budget: without it they would hold eight times the budget.
pub const ATTACKERS: usize = 8;
/// The op count each hostile batch announces: the whole budget's worth.
pub const ANNOUNCED: u64 = BUDGET / OP_LEN as u64;
/// The honest batch: 100,000 ops of 64 bytes.
const HONEST_OPS: usize = 100_000;
const HONEST_LEN: usize = 64;
/// Live heap the test may add beyond the budget while the attack runs: the
/// honest batch's op list on both sides (100,000 ops, 2.4 MB decoded, as
/// much again while a list grows by doubling), the connections' buffers
/// (with QUIC, each stream's receive window). Measured at 8–14 MiB. Without
/// the budget the attack alone adds eight times the budget (128 MiB).
const HEAP_SLACK: u64 = 32 << 20;

/// What the op-budget case needs of a transport besides [`Listener`].
pub trait OpBudget: Listener {
    /// One hostile peer, able to send batch after batch.
    type Attacker: Send + 'static;

    /// Whether every share of the budget is given back before the refusal
    /// that ends its batch is sent (else only just after it).
    const GIVES_BACK_BEFORE_REPLYING: bool;

    /// A receiver whose unauthenticated peers share [`BUDGET`] bytes of op
    /// list, with a registered buffer of `len` bytes.
    fn victim(&self, len: usize) -> impl Future<Output = Node<Self::Transport>>;

    /// Op-list bytes `victim` holds now, and the most it ever held at once.
    fn budget_used_and_peak(victim: &Node<Self::Transport>) -> (u64, u64);

    /// [`ATTACKERS`] hostile peers of `victim`, sharing `chunk` (1 MiB of
    /// op entries) as what they send, so they themselves hold little.
    /// The bound on ops per batch in force must be [`ANNOUNCED`], what the
    /// budget holds: each attacker checks it.
    fn attackers(&self, victim: &Node<Self::Transport>, chunk: Vec<u8>) -> impl Future<Output = Vec<Self::Attacker>>;

    /// One hostile batch: announces [`ANNOUNCED`] ops (out of every region)
    /// under the live `grant` and sends all of them and the payload (the
    /// chunk over and over); returns the receiver's verdict, or `None` if
    /// the receiver closed the peer's connection (a defence too), after
    /// which the attacker stops.
    fn attack(
        attacker: &mut Self::Attacker,
        grant: GrantId,
    ) -> impl Future<Output = Option<(ReplyStatus, String)>> + Send;
}

/// The case: run it on a multi-threaded runtime of its own, alone in its
/// test binary.
#[allow(clippy::print_stderr)]
pub async fn huge_op_lists_stay_within_one_budget<L: OpBudget>(listener: L) {
    let before = Resources::now();
    let mut victim = listener.victim(HONEST_OPS * HONEST_LEN).await;
    // Resident from the start (the honest batch lands there), so it does
    // not count as growth. No grant is live yet.
    victim.buf.bytes_mut().fill(0);
    let mut sender = listener.node(None, HONEST_OPS * HONEST_LEN).await;
    let grant = victim.grant_all().await;
    let ops: Vec<WriteOp> = (0..HONEST_OPS as u64)
        .map(|k| WriteOp {
            src: sender.buf.addr() + k * HONEST_LEN as u64,
            dst: victim.buf.addr() + k * HONEST_LEN as u64,
            len: HONEST_LEN as u64,
        })
        .collect();
    fill(&mut sender.buf, &ops);
    let chunk: Vec<u8> = (0..64 * 1024).flat_map(|_| encode_op(0x1000, 1)).collect();
    let attackers = listener.attackers(&victim, chunk).await;
    assert_eq!(attackers.len(), ATTACKERS);
    let with_nodes = Resources::now();
    let rss_from = reset_peak_rss();
    let heap_from = reset_peak_heap();

    // Each attacker repeats its batch until the honest one is done.
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = attackers
        .into_iter()
        .map(|mut attacker| {
            let stop = Arc::clone(&stop);
            let grant = grant.id;
            tokio::spawn(async move {
                let mut verdicts = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let Some(verdict) = L::attack(&mut attacker, grant).await else { break };
                    verdicts.push(verdict);
                }
                verdicts
            })
        })
        .collect();
    // The attack holds the budget before the honest batch starts.
    budget_reaches(
        || L::budget_used_and_peak(&victim).0,
        |used| used >= BUDGET / 2,
        "the attack never filled the budget",
    )
    .await;
    let endpoint = victim.transport.endpoint();
    let honest = tokio::time::timeout(BOUND, sender.transport.batch_write(&endpoint, &grant, &ops))
        .await
        .expect("the honest batch hung");
    honest.expect("the honest batch failed");
    stop.store(true, Ordering::Relaxed);
    let mut attacks = 0;
    for attacker in attackers {
        let verdicts = tokio::time::timeout(BOUND, attacker).await.expect("an attacker hung").unwrap();
        for (status, reason) in &verdicts {
            assert_eq!(*status, ReplyStatus::Refused, "{reason}");
            assert!(reason.contains("no room") || reason.contains("outside"), "{reason}");
        }
        attacks += verdicts.len();
    }
    let peak = L::budget_used_and_peak(&victim).1;
    let grown = peak_heap_growth(heap_from);
    let resident = peak_rss_growth(rss_from);
    eprintln!(
        "{attacks} batches from {ATTACKERS} peers at once, each announcing {} MiB of op list: op lists peaked at \
         {} MiB (budget {} MiB), live heap grew by at most {} MiB, resident memory by {} MiB",
        (ANNOUNCED * OP_LEN as u64) >> 20,
        peak >> 20,
        BUDGET >> 20,
        grown >> 20,
        resident >> 20
    );
    assert!(peak <= BUDGET, "op lists held {peak} bytes, the budget is {BUDGET}");
    assert!(grown <= BUDGET + HEAP_SLACK, "live heap grew by {grown} bytes under a {BUDGET}-byte budget");
    if L::GIVES_BACK_BEFORE_REPLYING {
        assert_eq!(L::budget_used_and_peak(&victim).0, 0, "every share was given back");
    } else {
        // The last share comes back just after its reply.
        budget_reaches(|| L::budget_used_and_peak(&victim).0, |used| used == 0, "shares still charged").await;
    }
    victim.transport.revoke(&grant.id).await;
    check(&victim.buf, &ops);

    drop(sender);
    with_nodes.back("after the attack", BOUND).await;
    drop((victim, ops));
    before.back("after the nodes", BOUND).await;
}
