//! [`Link`]: one RC queue pair (one per control connection, on both sides)
//! with its own completion queue, and the one loop that posts a chain of
//! work requests under the send window and waits for it.

use std::ops::Range;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::fence::LinkId;
use crate::handshake::QpEndpoint;
use crate::verbs::{
    Completion, CompletionQueue, ConnectOptions, ProtectionDomain, QpCapacity, QpHold, QueuePair, VerbsError, WcStatus,
};
use crate::window::SendWindow;

/// Why a chain of work requests did not complete.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChainError {
    /// The queue pair is gone (in the error state after a failure, a
    /// revocation that could not invalidate, the end of its connection, or
    /// close).
    #[error("the queue pair is gone")]
    Gone,
    /// No completion within the bound; the queue pair was moved to the
    /// error state.
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    /// A verbs call failed; the queue pair was moved to the error state.
    #[error("{0}")]
    Verbs(#[from] VerbsError),
    /// A work request completed with an error; the queue pair is in the
    /// error state.
    #[error("work request {index:?} of the chain failed: {status} (vendor error {vendor_err:#x})")]
    Failed {
        /// Its position in the chain (`None`: a request of an earlier,
        /// abandoned chain).
        index: Option<usize>,
        /// How it ended.
        status: WcStatus,
        /// The provider's detail.
        vendor_err: u32,
    },
}

/// What one waiter holds while it drives the queue pair.
struct Driver {
    cq: CompletionQueue,
    window: SendWindow,
    completions: Vec<Completion>,
}

/// One RC queue pair and its completion queue.
///
/// Chains run one at a time ([`Link::run`] holds the driver lock); the queue
/// pair itself sits behind a plain mutex taken only to post, so
/// [`Link::kill`] (from a synchronous `close` too) can stop it at any time.
/// Once in the error state, the device neither reads nor writes memory for
/// it.
pub(crate) struct Link {
    pub(crate) id: LinkId,
    endpoint: QpEndpoint,
    // Field order is drop order: the queue pair before its completion queue.
    qp: Mutex<Option<QueuePair>>,
    driver: tokio::sync::Mutex<Driver>,
    dead: CancellationToken,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("id", &self.id).field("qpn", &self.endpoint.qpn).finish_non_exhaustive()
    }
}

impl Link {
    /// A queue pair of `capacity` in `pd`, with its own completion queue
    /// (sized for a flush of every outstanding request), not connected yet.
    pub(crate) fn new(
        id: LinkId,
        pd: &std::sync::Arc<ProtectionDomain>,
        capacity: QpCapacity,
        psn: u32,
    ) -> Result<Self, VerbsError> {
        let cq = CompletionQueue::new(pd.device(), capacity.max_send_wr + 16)?;
        let qp = QueuePair::new(pd, &cq, capacity, psn)?;
        let endpoint = qp.endpoint();
        let driver = Driver { cq, window: SendWindow::new(capacity.max_send_wr), completions: Vec::new() };
        Ok(Self {
            id,
            endpoint,
            qp: Mutex::new(Some(qp)),
            driver: tokio::sync::Mutex::new(driver),
            dead: CancellationToken::new(),
        })
    }

    /// What the peer needs to connect to this queue pair.
    pub(crate) fn endpoint(&self) -> QpEndpoint {
        self.endpoint
    }

    /// Connects to the peer's queue pair; `remote_write`: whether it takes
    /// the peer's writes (a receiver's link) or none (a sender's).
    pub(crate) fn connect(&self, remote: &QpEndpoint, remote_write: bool) -> Result<(), VerbsError> {
        let options = ConnectOptions { remote_write, ..ConnectOptions::default() };
        match self.lock_qp().as_mut() {
            Some(qp) => qp.connect(remote, &options),
            None => Err(VerbsError::OutOfRange("the queue pair is gone".to_owned())),
        }
    }

    /// Moves the queue pair to the error state: when this returns the
    /// device accepts no more of the peer's writes through it (windows
    /// bound on it included) and sends nothing more for it; what was
    /// outstanding is flushed. Waiters wake with [`ChainError::Gone`]. The
    /// queue pair itself is destroyed once the link and every window bound
    /// on it are gone (or at [`Link::release`]).
    pub(crate) fn kill(&self) {
        let mut qp = self.lock_qp();
        if let Some(qp) = qp.as_mut() {
            if !self.dead.is_cancelled() {
                if let Err(err) = qp.set_error() {
                    tracing::warn!(link = self.id, error = %err, "cannot move a queue pair to the error state");
                }
                tracing::debug!(link = self.id, qpn = qp.qpn(), "queue pair moved to the error state");
            }
        }
        self.dead.cancel();
    }

    /// Kills the link and lets go of its queue pair (destroyed now unless a
    /// window bound on it still holds it).
    pub(crate) fn release(&self) {
        self.kill();
        let qp = self.lock_qp().take();
        drop(qp);
    }

    /// A hold on the queue pair, for a window bound on it.
    pub(crate) fn hold(&self) -> Option<QpHold> {
        self.lock_qp().as_ref().map(QueuePair::hold)
    }

    /// Resolves once the queue pair is gone.
    pub(crate) async fn died(&self) {
        self.dead.cancelled().await;
    }

    /// Whether the queue pair is gone.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.is_cancelled()
    }

    fn lock_qp(&self) -> MutexGuard<'_, Option<QueuePair>> {
        self.qp.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Posts a chain of `count` work requests through `post` (given the
    /// queue pair, the indices to post and the first's sequence number),
    /// never more outstanding than the send queue holds, and waits until
    /// every one completed. Each wait for completions is bounded by
    /// `io_timeout`; chains take turns, and the wait for a turn is bounded
    /// by the chain ahead (whose every wait is bounded, and which moves the
    /// queue pair to the error state when one runs out).
    ///
    /// Any failure moves the queue pair to the error state (an RC queue
    /// pair in error is useless, and the error state is the fence for
    /// whatever windows it had open). A chain abandoned half-way (its future
    /// dropped) leaves requests outstanding: the next chain waits for them
    /// first.
    pub(crate) async fn run<F>(&self, count: usize, io_timeout: Duration, mut post: F) -> Result<(), ChainError>
    where
        F: FnMut(&mut QueuePair, Range<usize>, u64) -> Result<(), VerbsError>,
    {
        let mut driver = tokio::select! {
            biased;
            () = self.dead.cancelled() => return Err(ChainError::Gone),
            driver = self.driver.lock() => driver,
        };
        if self.is_dead() {
            return Err(ChainError::Gone);
        }
        let result = self.run_locked(&mut driver, count, io_timeout, &mut post).await;
        if result.is_err() {
            self.kill();
        }
        result
    }

    async fn run_locked<F>(
        &self,
        driver: &mut Driver,
        count: usize,
        io_timeout: Duration,
        post: &mut F,
    ) -> Result<(), ChainError>
    where
        F: FnMut(&mut QueuePair, Range<usize>, u64) -> Result<(), VerbsError>,
    {
        // Leftovers of an abandoned chain complete first.
        while !driver.window.is_idle() {
            self.wait(driver, io_timeout, None).await?;
        }
        let first = driver.window.next_seq();
        let mut posted = 0usize;
        loop {
            if posted < count {
                let wanted = u32::try_from(count - posted).unwrap_or(u32::MAX);
                let granted = driver.window.take(wanted);
                let taken = (granted.end - granted.start) as usize;
                if taken > 0 {
                    let mut qp = self.lock_qp();
                    let qp = qp.as_mut().ok_or(ChainError::Gone)?;
                    post(qp, posted..posted + taken, granted.start)?;
                    posted += taken;
                    continue;
                }
            } else if driver.window.is_idle() {
                return Ok(());
            }
            self.wait(driver, io_timeout, Some(first)).await?;
        }
    }

    /// Waits for completions (at least one) and retires them; an error
    /// completion fails the chain that began at `first`.
    async fn wait(&self, driver: &mut Driver, io_timeout: Duration, first: Option<u64>) -> Result<(), ChainError> {
        let Driver { cq, window, completions } = driver;
        completions.clear();
        tokio::select! {
            biased;
            () = self.dead.cancelled() => return Err(ChainError::Gone),
            waited = tokio::time::timeout(io_timeout, cq.wait(completions)) => {
                waited.map_err(|_| ChainError::Timeout(io_timeout))??;
            }
        }
        for completion in completions.iter() {
            window.complete(completion.wr_id).map_err(|err| VerbsError::OutOfRange(err.to_string()))?;
            if completion.status != WcStatus::Success {
                let index = first.and_then(|first| completion.wr_id.checked_sub(first)).map(|i| i as usize);
                return Err(ChainError::Failed { index, status: completion.status, vendor_err: completion.vendor_err });
            }
        }
        Ok(())
    }
}

/// Whether the `index`-th of `count` requests asks for a completion: every
/// `interval`-th and the last (see [`crate::window`] for why that bounds
/// the wait).
pub(crate) fn signaled(index: usize, count: usize, interval: u32) -> bool {
    (index + 1) % (interval.max(1) as usize) == 0 || index + 1 == count
}
