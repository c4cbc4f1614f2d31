//! Back-pressure on the send queue, as a pure model: how many work requests
//! may be posted now, and which ones a completion retires.
//!
//! Work requests get consecutive sequence numbers (their `wr_id`s) in posting
//! order. With selective signalling only some of them produce a completion;
//! a send queue completes in order, so the completion of number `n` retires
//! every request up to and including `n`, signalled or not. (Requests flushed
//! by an error state complete individually, signalled or not; they retire the
//! same way.)
//!
//! Why the queue always drains: the planner signals every `interval`-th
//! request of a batch and its last, so any `interval` consecutive posted
//! requests hold a signalled one. [`crate::plan::SendQueueConfig`] keeps
//! `interval <= depth`, so a full window always holds a request whose
//! completion will come, and waiting for it is never a deadlock.

/// Outstanding work requests of one send queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWindow {
    depth: u32,
    /// Sequence number the next posted request gets.
    next: u64,
    /// Every request below this has completed.
    retired: u64,
}

/// A completion that names no outstanding request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("completion for work request {seq}, but only requests {retired}..{next} are outstanding")]
pub struct UnknownCompletion {
    /// The completion's `wr_id`.
    pub seq: u64,
    /// The oldest outstanding request.
    pub retired: u64,
    /// One past the newest posted request.
    pub next: u64,
}

impl SendWindow {
    /// An empty window for a send queue of `depth` requests.
    pub fn new(depth: u32) -> Self {
        Self { depth, next: 0, retired: 0 }
    }

    /// Requests posted and not yet retired.
    pub fn outstanding(&self) -> u32 {
        // At most `depth`: `take` never grants more.
        u32::try_from(self.next - self.retired).unwrap_or(u32::MAX)
    }

    /// Requests that may be posted now.
    pub fn room(&self) -> u32 {
        self.depth - self.outstanding()
    }

    /// The sequence number the next posted request gets.
    pub fn next_seq(&self) -> u64 {
        self.next
    }

    /// Whether nothing is outstanding.
    pub fn is_idle(&self) -> bool {
        self.next == self.retired
    }

    /// Grants up to `wanted` requests (as many as there is room for) and
    /// returns the sequence numbers they must be posted with.
    pub fn take(&mut self, wanted: u32) -> std::ops::Range<u64> {
        let granted = u64::from(wanted.min(self.room()));
        let first = self.next;
        self.next += granted;
        first..self.next
    }

    /// Records the completion of request `seq`: it and every earlier request
    /// are retired. Completions of already retired requests change nothing.
    pub fn complete(&mut self, seq: u64) -> Result<(), UnknownCompletion> {
        if seq >= self.next {
            return Err(UnknownCompletion { seq, retired: self.retired, next: self.next });
        }
        self.retired = self.retired.max(seq + 1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    /// One step of a window scenario.
    #[derive(Debug, Clone, Copy)]
    enum Step {
        /// Ask for this many; expect this many granted.
        Take(u32, u64),
        /// Complete this sequence number.
        Complete(u64),
    }
    use Step::{Complete, Take};

    #[rstest]
    #[case::fills_then_refuses(4, vec![Take(3, 3), Take(3, 1), Take(1, 0)], 0)]
    #[case::a_completion_retires_everything_before_it(4, vec![Take(4, 4), Complete(2), Take(4, 3)], 0)]
    #[case::stale_completions_change_nothing(4, vec![Take(4, 4), Complete(3), Complete(1), Take(9, 4)], 0)]
    #[case::flushed_requests_complete_one_by_one(
        3,
        vec![Take(3, 3), Complete(0), Complete(1), Complete(2), Take(3, 3)],
        0
    )]
    fn grants_only_what_the_queue_holds(#[case] depth: u32, #[case] steps: Vec<Step>, #[case] room_after: u32) {
        let mut window = SendWindow::new(depth);
        for step in steps {
            match step {
                Take(wanted, granted) => {
                    let range = window.take(wanted);
                    assert_eq!(range.end - range.start, granted, "{step:?}");
                    assert!(window.outstanding() <= depth);
                }
                Complete(seq) => window.complete(seq).unwrap(),
            }
        }
        assert_eq!(window.room(), room_after);
    }

    #[test]
    fn sequence_numbers_are_consecutive_across_grants() {
        let mut window = SendWindow::new(8);
        assert_eq!(window.take(3), 0..3);
        assert_eq!(window.take(2), 3..5);
        window.complete(4).unwrap();
        assert!(window.is_idle());
        assert_eq!(window.take(1), 5..6);
    }

    #[test]
    fn a_completion_for_an_unposted_request_is_an_error() {
        let mut window = SendWindow::new(8);
        let _ = window.take(2);
        assert_eq!(window.complete(2), Err(UnknownCompletion { seq: 2, retired: 0, next: 2 }));
        assert_eq!(window.outstanding(), 2);
    }

    /// Drives a whole plan through a queue that completes only signalled
    /// requests, in order, and only when the poster cannot go on: it must
    /// finish, never exceed the depth, and block exactly when the window is full.
    #[rstest]
    #[case::interval_equals_depth(100, 8, 8)]
    #[case::interval_below_depth(100, 3, 8)]
    #[case::interval_one(17, 1, 2)]
    #[case::short_batch(5, 4, 16)]
    fn a_full_window_always_holds_a_signalled_request(#[case] wrs: u64, #[case] interval: u64, #[case] depth: u32) {
        let signaled = |index: u64| (index + 1) % interval == 0 || index == wrs - 1;
        let mut window = SendWindow::new(depth);
        let mut posted = 0u64;
        let mut device_done = 0u64; // requests the "device" has executed
        let mut stalls = 0;
        while posted < wrs || !window.is_idle() {
            let wanted = u32::try_from(wrs - posted).unwrap_or(u32::MAX);
            let granted = window.take(wanted);
            posted += granted.end - granted.start;
            assert!(window.outstanding() <= depth);
            if window.room() > 0 && posted < wrs {
                continue;
            }
            // Blocked (or done posting): the device executes everything
            // posted; the poster sees the completions of signalled ones.
            stalls += 1;
            assert!(stalls < 10_000, "no progress: deadlock");
            let last_signaled = (device_done..posted).rev().find(|&index| signaled(index));
            device_done = posted;
            let seq = last_signaled.expect("a blocked window holds a signalled request");
            window.complete(seq).unwrap();
        }
        assert_eq!(posted, wrs);
    }
}
