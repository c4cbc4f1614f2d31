//! The op-list budget every incoming connection (or stream) of one transport
//! shares (`op_list_budget` of its config): a batch's share grows as its op
//! list arrives, waits (bounded) for room when there is none (or gives way
//! at once if it holds an equal share of the budget or more, so batches
//! that wait for each other cannot lock it up), and is given back, waking
//! the waiters, when the batch is done.

use std::sync::Arc;

use kv_proto::dataplane::OP_LEN;
use kv_proto::{Charge, MemoryBudget};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Default bound on the ops of one incoming batch (16 Mi ops: a 256 MiB op
/// list), of every transport that buffers op lists.
pub const DEFAULT_MAX_OPS_PER_BATCH: u64 = 16 * 1024 * 1024;

/// Default op-list budget when peers must prove a shared secret: 256 MiB.
pub const DEFAULT_OP_LIST_BUDGET: u64 = 256 << 20;

/// Default op-list budget when peers need not prove one: 32 MiB, room for
/// 20 batches of 100,000 ops at once.
pub const DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET: u64 = 32 << 20;

/// The op-list budget in force: `budget` when every peer must prove a
/// secret (`secret_required`), else the smaller `unauthenticated` one.
pub fn budget_in_force(secret_required: bool, budget: u64, unauthenticated: u64) -> u64 {
    if secret_required {
        budget
    } else {
        unauthenticated
    }
}

/// The op bound in force for one incoming batch: the smaller of
/// `max_ops_per_batch` and what `budget` holds (an op list no budget could
/// hold is refused before it is read, and senders learn this bound).
pub fn max_ops_in_force(max_ops_per_batch: u64, budget: u64) -> u64 {
    max_ops_per_batch.min(budget / OP_LEN as u64)
}

/// The budget and the waiters for room in it.
#[derive(Debug)]
pub struct OpListBudget {
    budget: Arc<MemoryBudget>,
    room: Notify,
}

impl OpListBudget {
    /// A budget of `limit` bytes, empty.
    pub fn new(limit: u64) -> Self {
        Self { budget: MemoryBudget::new(limit), room: Notify::new() }
    }

    /// The bound, bytes.
    pub fn limit(&self) -> u64 {
        self.budget.limit()
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.budget.used()
    }

    /// The most bytes ever held at once.
    pub fn peak(&self) -> u64 {
        self.budget.peak()
    }

    /// An empty share, for one batch.
    pub fn share(&self) -> Share<'_> {
        Share { charge: self.budget.charge(), room: &self.room }
    }
}

/// Why a share could not grow.
#[derive(Debug, Clone, Copy)]
pub enum NoRoom {
    /// The budget stayed full until the deadline.
    Timeout,
    /// The budget is full and this batch holds an equal share of it or
    /// more (`held` bytes, among `holders` batches): it gives way.
    GiveWay {
        /// Bytes this batch holds.
        held: u64,
        /// Batches holding a share.
        holders: u64,
    },
}

/// One batch's share of the budget; given back (and waiters woken) on drop.
pub struct Share<'a> {
    charge: Charge,
    room: &'a Notify,
}

impl Share<'_> {
    /// Takes `more` bytes, waiting for room until `deadline`; on `Err`
    /// nothing was taken.
    pub async fn grow(&mut self, more: u64, deadline: Instant) -> Result<(), NoRoom> {
        loop {
            // Registered before the attempt, so a release between the two
            // is not missed.
            let released = self.room.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if self.charge.try_grow(more) {
                return Ok(());
            }
            if self.charge.holds_fair_share() {
                return Err(NoRoom::GiveWay { held: self.charge.bytes(), holders: self.charge.budget().holders() });
            }
            if tokio::time::timeout_at(deadline, released).await.is_err() {
                return Err(NoRoom::Timeout);
            }
        }
    }

    /// Gives every byte back now and wakes the waiters.
    pub fn release(&mut self) {
        if self.charge.release() > 0 {
            self.room.notify_waiters();
        }
    }
}

impl NoRoom {
    /// Why the batch is refused, for its sender.
    pub fn reason(self, ops: u64, limit: u64, timeout: std::time::Duration) -> String {
        match self {
            NoRoom::Timeout => format!(
                "no room for the op list of {ops} ops within {timeout:?}: the receiver's op-list budget of {limit} \
                 bytes is held by other batches; try again"
            ),
            NoRoom::GiveWay { held, holders } => format!(
                "no room for the op list of {ops} ops: the receiver's op-list budget of {limit} bytes is full and \
                 this batch holds {held} bytes of it, an equal share or more among {holders} batches; try again"
            ),
        }
    }
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        self.release();
    }
}
