//! Every batch a receiver refuses is counted once, under its reason, in
//! `BatchWriter::stats`: an unknown grant, a revoked grant (through a real
//! sender, which counts nothing of its own), an op outside a live grant,
//! and an op list that finds no room in the listener's op-list budget. The
//! batches that land count nothing.

use std::future::Future;
use std::time::Duration;

use kv_net::OpListLimits;
use kv_proto::dataplane::{ReplyStatus, OP_LEN};
use kv_proto::{BatchRefusal, BatchWriter, GrantId, TransportError, WriteOp};

use super::{budget_reaches, Listener, BOUND};
use crate::stats::{expected, reaches};
use crate::Node;

/// Ops the receiver's op-list budget holds: one held list fills it.
pub const BUDGET_OPS: u64 = 16;
/// How long a second op list waits for room before it is refused.
const OP_LIST_WAIT: Duration = Duration::from_millis(300);

/// What the refusal case needs of a transport besides [`Listener`]: raw
/// peers that send batches by hand.
pub trait Refusals: Listener {
    /// A raw peer that completed the transport's handshake (no secret).
    type Client;
    /// A batch whose header and op list are sent, its payload not yet.
    type Held;

    /// A receiver whose op lists are bounded by `op_lists`, with a
    /// registered buffer of `len` bytes.
    fn budgeted(&self, op_lists: OpListLimits, len: usize) -> impl Future<Output = Node<Self::Transport>>;

    /// Op-list bytes `receiver` holds now.
    fn budget_used(receiver: &Node<Self::Transport>) -> u64;

    /// A raw peer of `receiver`, and the bound on ops per batch the
    /// receiver tells its senders.
    fn client(&self, receiver: &Node<Self::Transport>) -> impl Future<Output = (Self::Client, u64)>;

    /// Sends one whole batch under `grant`: the op list `ops` (destination,
    /// length) and `payload`, as many bytes as the ops add up to; returns
    /// the receiver's reply (status and reason).
    fn batch(
        client: &mut Self::Client,
        grant: GrantId,
        ops: &[(u64, u64)],
        payload: &[u8],
    ) -> impl Future<Output = (ReplyStatus, String)>;

    /// Begins a batch under `grant` beside the batches of `beside` (however
    /// the transport runs batches side by side), up to the end of its op
    /// list `ops`.
    fn hold(
        &self,
        receiver: &Node<Self::Transport>,
        beside: &Self::Client,
        grant: GrantId,
        ops: &[(u64, u64)],
    ) -> impl Future<Output = Self::Held>;

    /// Sends the held batch's `payload`; returns the receiver's reply.
    fn release(held: Self::Held, payload: &[u8]) -> impl Future<Output = (ReplyStatus, String)>;
}

/// The case: each refusal counted once, under its reason; the batches that
/// land count nothing.
pub async fn each_refusal_is_counted_once_by_reason<L: Refusals>(listener: L) {
    // Unauthenticated peers share a budget of `BUDGET_OPS` op entries.
    let op_lists = OpListLimits {
        unauthenticated_budget: BUDGET_OPS * OP_LEN as u64,
        timeout: OP_LIST_WAIT,
        ..OpListLimits::default()
    };
    let rx = listener.budgeted(op_lists, 1 << 16).await;
    let base = rx.buf.addr();
    let live = rx.grant_range(0, 4096).await;
    let (mut client, max_ops) = listener.client(&rx).await;
    assert_eq!(max_ops, BUDGET_OPS, "the bound in force is what the budget holds");

    // Never issued.
    let (status, reason) = L::batch(&mut client, GrantId::from_bytes([0x42; 16]), &[(base, 4)], &[1; 4]).await;
    assert_eq!(status, ReplyStatus::Refused, "{reason}");
    reaches(&rx.transport, &expected(1, &[(BatchRefusal::UnknownGrant, 1)], 0), BOUND).await;

    // Revoked, written by a real sender: the receiver counts it, the
    // sender (whose batch it is) does not.
    let mut tx = listener.node(None, 1 << 16).await;
    tx.buf.bytes_mut()[..8].fill(7);
    let revoked = rx.grant_range(8192, 4096).await;
    rx.transport.revoke(&revoked.id).await;
    let ops = [WriteOp { src: tx.buf.addr(), dst: base + 8192, len: 8 }];
    let err = tx.transport.batch_write(&rx.transport.endpoint(), &revoked, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{err:?}");
    reaches(&rx.transport, &expected(1, &[(BatchRefusal::UnknownGrant, 2)], 0), BOUND).await;
    assert_eq!(tx.transport.stats(), expected(0, &[], 0), "a sender counts no refusal of its own batch");

    // Live, one op outside it (inside the registered destination).
    let (status, reason) = L::batch(&mut client, live.id, &[(base, 4), (base + 16384, 4)], &[2; 8]).await;
    assert_eq!(status, ReplyStatus::Refused, "{reason}");
    assert!(reason.contains("op 1"), "{reason}");
    let after_outside = [(BatchRefusal::UnknownGrant, 2), (BatchRefusal::OutsideGrant, 1)];
    reaches(&rx.transport, &expected(1, &after_outside, 0), BOUND).await;

    // The budget: one batch holds all of it (its op list is in, its payload
    // not yet), so another's list finds no room within the wait.
    let held: Vec<(u64, u64)> = (0..BUDGET_OPS).map(|k| (base + k, 1)).collect();
    let holder = listener.hold(&rx, &client, live.id, &held).await;
    let full = BUDGET_OPS * OP_LEN as u64;
    budget_reaches(|| L::budget_used(&rx), |used| used >= full, "the holder's op list was never charged").await;
    let (status, reason) = L::batch(&mut client, live.id, &[(base + 100, 1)], &[4]).await;
    assert_eq!(status, ReplyStatus::Refused, "{reason}");
    assert!(reason.contains("no room"), "{reason}");
    let (status, reason) = L::release(holder, &[3; BUDGET_OPS as usize]).await;
    assert_eq!(status, ReplyStatus::Ok, "{reason}");

    // And a batch that lands counts nothing.
    let (status, reason) = L::batch(&mut client, live.id, &[(base + 200, 2)], &[5; 2]).await;
    assert_eq!(status, ReplyStatus::Ok, "{reason}");
    let all = [(BatchRefusal::UnknownGrant, 2), (BatchRefusal::OutsideGrant, 1), (BatchRefusal::OpBudget, 1)];
    reaches(&rx.transport, &expected(1, &all, 0), BOUND).await;
    rx.transport.revoke(&live.id).await;
    reaches(&rx.transport, &expected(0, &all, 0), BOUND).await;
    assert_eq!(&rx.buf.bytes()[..BUDGET_OPS as usize], &[3; BUDGET_OPS as usize]);
    assert_eq!(&rx.buf.bytes()[200..202], &[5; 2]);
}
