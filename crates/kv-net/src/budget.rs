//! The op-list bounds of a data plane ([`OpListLimits`], every config's
//! `op_lists`) and the budget every incoming connection (or stream) of one
//! transport shares ([`OpListBudget`]): a batch's share grows as its op
//! list arrives, waits (bounded) for room when there is none (or gives way
//! at once if it holds an equal share of the budget or more, so batches
//! that wait for each other cannot lock it up), and is given back, waking
//! the waiters, when the batch is done.

use std::sync::Arc;
use std::time::Duration;

use kv_proto::dataplane::OP_LEN;
use kv_proto::receive::ReceiveLimits;
use kv_proto::{Charge, MemoryBudget, NoRoom};
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

/// Default [`OpListLimits::timeout`].
pub const DEFAULT_OP_LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// The bounds a data plane keeps on the op lists it buffers for its peers'
/// batches (a receiver admits every op before the first payload byte lands,
/// so it holds the whole list), with their defaults, once; TCP's and QUIC's
/// configs embed them as `op_lists`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpListLimits {
    /// Bound on the ops of one incoming batch (peer input; default
    /// [`DEFAULT_MAX_OPS_PER_BATCH`]). A larger batch is a protocol error;
    /// a sender learns the bound in force at connection set-up (TCP: the
    /// accept reply; QUIC: the endpoint details) and fails such a batch
    /// before sending it. Outgoing batches have no cap of their own. The
    /// bound in force is the smaller of this and what the budget in force
    /// holds (16 bytes an op; [`OpListLimits::max_ops_in_force`]).
    pub max_ops_per_batch: u64,
    /// Bytes of op lists (16 per op) that all incoming batches together may
    /// hold at once, when peers must prove the shared secret (default
    /// [`DEFAULT_OP_LIST_BUDGET`]). A batch's list is charged as it arrives
    /// (never more than the count announced), and only once the grant its
    /// header names is live, and given back when the batch is done. A batch
    /// whose list does not fit waits for room (within
    /// [`OpListLimits::timeout`]) or, if it holds an equal share of the
    /// budget or more already, gives way at once; either way it is refused
    /// with the reason.
    pub budget: u64,
    /// The same budget when peers need not prove a secret (the transport
    /// has none): every connection then counts as unauthenticated, and gets
    /// this smaller budget (default
    /// [`DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET`]). With a secret, no op
    /// list is read before its peer proved it.
    pub unauthenticated_budget: u64,
    /// One bound on receiving a batch's op list, from its header, waits for
    /// room in the budget included (default [`DEFAULT_OP_LIST_TIMEOUT`];
    /// keep it below the senders' I/O bound, which bounds their stall
    /// meanwhile). A list still waiting for room then is refused; one its
    /// peer has not sent by then is a protocol error. So a peer dribbling
    /// its list holds its share of the budget no longer than this.
    pub timeout: Duration,
}

impl Default for OpListLimits {
    fn default() -> Self {
        Self {
            max_ops_per_batch: DEFAULT_MAX_OPS_PER_BATCH,
            budget: DEFAULT_OP_LIST_BUDGET,
            unauthenticated_budget: DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET,
            timeout: DEFAULT_OP_LIST_TIMEOUT,
        }
    }
}

impl OpListLimits {
    /// The budget in force: [`OpListLimits::budget`] when every peer must
    /// prove a secret (`secret_required`), else the smaller
    /// [`OpListLimits::unauthenticated_budget`].
    pub fn budget_in_force(&self, secret_required: bool) -> u64 {
        if secret_required {
            self.budget
        } else {
            self.unauthenticated_budget
        }
    }

    /// The op bound in force for one incoming batch: the smaller of
    /// [`OpListLimits::max_ops_per_batch`] and what the budget in force
    /// holds (an op list no budget could hold is refused before it is
    /// read, and senders learn this bound).
    pub fn max_ops_in_force(&self, secret_required: bool) -> u64 {
        self.max_ops_per_batch.min(self.budget_in_force(secret_required) / OP_LEN as u64)
    }

    /// What the batch-receive machine keeps to, as in force.
    pub fn receive_limits(&self, secret_required: bool) -> ReceiveLimits {
        ReceiveLimits {
            max_ops: self.max_ops_in_force(secret_required),
            op_list_budget: self.budget_in_force(secret_required),
            op_list_timeout: self.timeout,
        }
    }
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

impl Drop for Share<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bounds_in_force_follow_the_secret_and_the_budget() {
        let limits = OpListLimits {
            max_ops_per_batch: 100,
            budget: 16 * 50,
            unauthenticated_budget: 16 * 10,
            ..OpListLimits::default()
        };
        assert_eq!((limits.budget_in_force(true), limits.budget_in_force(false)), (800, 160));
        assert_eq!((limits.max_ops_in_force(true), limits.max_ops_in_force(false)), (50, 10), "what the budget holds");
        let roomy = OpListLimits { budget: 1 << 30, ..limits };
        assert_eq!(roomy.max_ops_in_force(true), 100, "the configured bound");
        let receive = limits.receive_limits(false);
        assert_eq!(
            (receive.max_ops, receive.op_list_budget, receive.op_list_timeout),
            (10, 160, DEFAULT_OP_LIST_TIMEOUT)
        );
        assert_eq!(OpListLimits::default().max_ops_in_force(false), DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET / 16);
    }
}
