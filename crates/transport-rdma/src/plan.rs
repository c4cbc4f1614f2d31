//! The work-request planner: a batch of writes becomes a list of chained
//! RDMA WRITE work requests, with no device involved.
//!
//! Ops that are contiguous on the remote side (and in one remote region)
//! share one work request, one scatter-gather entry per local piece; a piece
//! that continues the previous one locally too extends its entry instead.
//! A work request holds at most [`SendQueueConfig::max_sge`] entries and
//! [`SendQueueConfig::max_wr_bytes`] bytes (longer ops are split). Every
//! [`SendQueueConfig::signal_interval`]-th work request and the last one are
//! signalled; see [`crate::window`] for why that bounds the wait.
//!
//! The whole batch is planned, and checked against the local and remote
//! regions, before anything is posted: a batch with one op outside is refused
//! whole, since the device can only fail single work requests.

use std::ops::Range;

use crate::region::{LocalRegion, RegionTable, RemoteRegion};

/// One write of a batch: `len` bytes from local `src` to remote `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteSpan {
    /// Local source address (inside a registered source region).
    pub src: u64,
    /// Remote destination address (inside a region the peer advertised).
    pub dst: u64,
    /// Length in bytes; zero-length spans are skipped.
    pub len: u64,
}

/// The send queue's shape, which the plan and the window must respect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendQueueConfig {
    max_sge: u32,
    max_wr_bytes: u32,
    signal_interval: u32,
    depth: u32,
}

/// Why a [`SendQueueConfig`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendQueueConfigError {
    /// A limit that must be at least 1 is 0.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// With more than `depth` work requests between two signalled ones, a
    /// full queue could hold no signalled request and never drain.
    #[error("signal interval {interval} exceeds the send queue depth {depth}")]
    IntervalExceedsDepth {
        /// The signal interval asked for.
        interval: u32,
        /// The send queue depth.
        depth: u32,
    },
}

impl SendQueueConfig {
    /// `max_sge`: scatter-gather entries per work request (the QP's
    /// `max_send_sge`); `max_wr_bytes`: bytes per work request (the port's
    /// `max_msg_sz`); `signal_interval`: one work request in this many is
    /// signalled; `depth`: the most work requests outstanding (the QP's
    /// `max_send_wr`).
    pub fn new(
        max_sge: u32,
        max_wr_bytes: u32,
        signal_interval: u32,
        depth: u32,
    ) -> Result<Self, SendQueueConfigError> {
        for (value, name) in [
            (max_sge, "max_sge"),
            (max_wr_bytes, "max_wr_bytes"),
            (signal_interval, "signal_interval"),
            (depth, "depth"),
        ] {
            if value == 0 {
                return Err(SendQueueConfigError::Zero(name));
            }
        }
        if signal_interval > depth {
            return Err(SendQueueConfigError::IntervalExceedsDepth { interval: signal_interval, depth });
        }
        Ok(Self { max_sge, max_wr_bytes, signal_interval, depth })
    }

    /// Scatter-gather entries per work request.
    pub fn max_sge(&self) -> u32 {
        self.max_sge
    }

    /// Bytes per work request.
    pub fn max_wr_bytes(&self) -> u32 {
        self.max_wr_bytes
    }

    /// One work request in this many is signalled (and the last of a batch).
    pub fn signal_interval(&self) -> u32 {
        self.signal_interval
    }

    /// The most work requests outstanding on the send queue.
    pub fn depth(&self) -> u32 {
        self.depth
    }
}

/// One local piece of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Local address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Local key of the region holding it.
    pub lkey: u32,
}

/// One RDMA WRITE work request of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedWrite {
    /// Where the bytes land on the peer.
    pub remote_addr: u64,
    /// Remote key of the peer's region holding them.
    pub rkey: u32,
    /// Total length (the sum of its entries).
    pub bytes: u32,
    /// Whether it asks for a completion.
    pub signaled: bool,
    /// Its entries, as indices into [`Plan::sges`].
    sges: Range<usize>,
}

/// A planned batch: work requests in posting order and their entries.
/// Reusable: [`Planner::plan`] clears it first, keeping the allocations.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    writes: Vec<PlannedWrite>,
    sges: Vec<Sge>,
    total_bytes: u64,
}

impl Plan {
    /// The work requests, in posting order.
    pub fn writes(&self) -> &[PlannedWrite] {
        &self.writes
    }

    /// The entries of `write` (one of this plan's).
    pub fn sges(&self, write: &PlannedWrite) -> &[Sge] {
        self.sges.get(write.sges.clone()).unwrap_or(&[])
    }

    /// Bytes the plan writes.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    fn clear(&mut self) {
        self.writes.clear();
        self.sges.clear();
        self.total_bytes = 0;
    }
}

/// Why a batch was refused; nothing of it may be posted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// An op's destination is not inside one region the peer advertised.
    #[error("op {index}: destination {dst:#x}+{len} is outside the peer's registered regions")]
    OutsideRemoteRegions {
        /// Position of the op in the batch.
        index: usize,
        /// Its destination.
        dst: u64,
        /// Its length.
        len: u64,
    },
    /// An op's source is not inside one local registered region.
    #[error("op {index}: source {src:#x}+{len} is outside the local registered regions")]
    OutsideLocalRegions {
        /// Position of the op in the batch.
        index: usize,
        /// Its source.
        src: u64,
        /// Its length.
        len: u64,
    },
}

/// Plans batches against fixed local and remote regions.
#[derive(Debug, Clone)]
pub struct Planner {
    local: RegionTable<LocalRegion>,
    remote: RegionTable<RemoteRegion>,
    config: SendQueueConfig,
}

/// The work request being filled.
struct OpenWrite {
    remote_region: usize,
    remote_addr: u64,
    rkey: u32,
    bytes: u32,
    first_sge: usize,
}

impl Planner {
    /// A planner writing from `local` into `remote` within `config`.
    pub fn new(local: RegionTable<LocalRegion>, remote: RegionTable<RemoteRegion>, config: SendQueueConfig) -> Self {
        Self { local, remote, config }
    }

    /// The send queue shape it plans for.
    pub fn config(&self) -> &SendQueueConfig {
        &self.config
    }

    /// Plans `ops` into `plan` (cleared first). On error `plan` is left
    /// cleared: nothing of a refused batch may be posted.
    pub fn plan(&self, ops: &[WriteSpan], plan: &mut Plan) -> Result<(), PlanError> {
        plan_batch(&self.local, &self.remote, &self.config, ops.iter().copied(), plan)
    }
}

/// Plans `ops` from `local` into `remote` within `config`, into `plan`
/// (cleared first), as [`Planner::plan`] does, with borrowed tables (the
/// transport keeps one per grant). On error `plan` is left cleared: nothing
/// of a refused batch may be posted.
pub fn plan_batch(
    local: &RegionTable<LocalRegion>,
    remote: &RegionTable<RemoteRegion>,
    config: &SendQueueConfig,
    ops: impl IntoIterator<Item = WriteSpan>,
    plan: &mut Plan,
) -> Result<(), PlanError> {
    plan.clear();
    let tables = Tables { local, remote, config };
    let result = tables.fill(ops, plan);
    if result.is_err() {
        plan.clear();
    }
    result
}

/// The regions and limits one batch is planned against.
struct Tables<'a> {
    local: &'a RegionTable<LocalRegion>,
    remote: &'a RegionTable<RemoteRegion>,
    config: &'a SendQueueConfig,
}

impl Tables<'_> {
    fn fill(&self, ops: impl IntoIterator<Item = WriteSpan>, plan: &mut Plan) -> Result<(), PlanError> {
        let mut open: Option<OpenWrite> = None;
        for (index, op) in ops.into_iter().enumerate() {
            if op.len == 0 {
                continue;
            }
            let (remote_region, remote) = self.remote.find(op.dst, op.len).ok_or(PlanError::OutsideRemoteRegions {
                index,
                dst: op.dst,
                len: op.len,
            })?;
            let (_, local) = self.local.find(op.src, op.len).ok_or(PlanError::OutsideLocalRegions {
                index,
                src: op.src,
                len: op.len,
            })?;
            let (mut src, mut dst, mut left) = (op.src, op.dst, op.len);
            while left > 0 {
                let room = open.as_ref().map_or(0, |write| self.room(write, plan, remote_region, dst, src, local.lkey));
                let take = if room > 0 {
                    left.min(u64::from(room))
                } else {
                    if let Some(write) = open.take() {
                        close(write, plan);
                    }
                    let take = left.min(u64::from(self.config.max_wr_bytes));
                    open = Some(OpenWrite {
                        remote_region,
                        remote_addr: dst,
                        rkey: remote.rkey,
                        bytes: 0,
                        first_sge: plan.sges.len(),
                    });
                    take
                };
                // Both fit in u32: `take` is at most `max_wr_bytes`.
                let take32 = u32::try_from(take).unwrap_or(u32::MAX);
                if let Some(write) = open.as_mut() {
                    append(plan, write, src, take32, local.lkey);
                }
                src += take;
                dst += take;
                left -= take;
            }
            plan.total_bytes += op.len;
        }
        if let Some(write) = open {
            close(write, plan);
        }
        self.mark_signaled(plan);
        Ok(())
    }

    /// How many bytes starting at remote `dst` (local `src`, key `lkey`) the
    /// open work request can still take: 0 unless it continues it remotely
    /// in the same region, has byte room, and has an entry free or can
    /// extend its last one.
    fn room(&self, write: &OpenWrite, plan: &Plan, remote_region: usize, dst: u64, src: u64, lkey: u32) -> u32 {
        let continues = write.remote_region == remote_region && write.remote_addr + u64::from(write.bytes) == dst;
        let byte_room = self.config.max_wr_bytes - write.bytes;
        if !continues || byte_room == 0 {
            return 0;
        }
        let entries = plan.sges.len() - write.first_sge;
        let extends_last =
            plan.sges.last().is_some_and(|last| last.lkey == lkey && last.addr + u64::from(last.len) == src);
        if extends_last || entries < self.config.max_sge as usize {
            byte_room
        } else {
            0
        }
    }

    /// Every `signal_interval`-th work request and the last.
    fn mark_signaled(&self, plan: &mut Plan) {
        let interval = self.config.signal_interval as usize;
        let last = plan.writes.len().saturating_sub(1);
        for (index, write) in plan.writes.iter_mut().enumerate() {
            write.signaled = (index + 1) % interval == 0 || index == last;
        }
    }
}

/// Adds `len` bytes at local `src` to the open work request.
fn append(plan: &mut Plan, write: &mut OpenWrite, src: u64, len: u32, lkey: u32) {
    let owns_last = plan.sges.len() > write.first_sge;
    match plan.sges.last_mut() {
        Some(last) if owns_last && last.lkey == lkey && last.addr + u64::from(last.len) == src => last.len += len,
        _ => plan.sges.push(Sge { addr: src, len, lkey }),
    }
    write.bytes += len;
}

fn close(write: OpenWrite, plan: &mut Plan) {
    plan.writes.push(PlannedWrite {
        remote_addr: write.remote_addr,
        rkey: write.rkey,
        bytes: write.bytes,
        signaled: false,
        sges: write.first_sge..plan.sges.len(),
    });
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rstest::rstest;

    use super::*;

    const KIB: u64 = 1024;
    const LOCAL_A: u64 = 0x1000_0000;
    const LOCAL_B: u64 = 0x2000_0000;
    const REMOTE_A: u64 = 0x9000_0000;
    /// Right after REMOTE_A's end: contiguous addresses, another region.
    const REMOTE_B: u64 = REMOTE_A + 1024 * KIB;

    fn planner(max_sge: u32, max_wr_bytes: u32, signal_interval: u32) -> Planner {
        let local = RegionTable::new(vec![
            LocalRegion { addr: LOCAL_A, len: 1024 * KIB, lkey: 10 },
            LocalRegion { addr: LOCAL_B, len: 1024 * KIB, lkey: 11 },
        ])
        .unwrap();
        let remote = RegionTable::new(vec![
            RemoteRegion { addr: REMOTE_A, len: 1024 * KIB, rkey: 70 },
            RemoteRegion { addr: REMOTE_B, len: 1024 * KIB, rkey: 71 },
        ])
        .unwrap();
        Planner::new(local, remote, SendQueueConfig::new(max_sge, max_wr_bytes, signal_interval, 64).unwrap())
    }

    fn op(src: u64, dst: u64, len: u64) -> WriteSpan {
        WriteSpan { src, dst, len }
    }

    /// `(remote_addr, rkey, [(sge addr, sge len, lkey)])` per work request.
    type Shape = Vec<(u64, u32, Vec<(u64, u32, u32)>)>;

    fn shape(plan: &Plan) -> Shape {
        plan.writes()
            .iter()
            .map(|write| {
                let sges = plan.sges(write).iter().map(|sge| (sge.addr, sge.len, sge.lkey)).collect();
                (write.remote_addr, write.rkey, sges)
            })
            .collect()
    }

    fn plan_with(planner: &Planner, ops: &[WriteSpan]) -> Plan {
        let mut plan = Plan::default();
        planner.plan(ops, &mut plan).unwrap();
        plan
    }

    #[rstest]
    #[case::single_op(
        vec![op(LOCAL_A, REMOTE_A, 4 * KIB)],
        vec![(REMOTE_A, 70, vec![(LOCAL_A, 4096, 10)])]
    )]
    #[case::remote_contiguous_local_scattered_share_one_wr(
        vec![op(LOCAL_A + 8 * KIB, REMOTE_A, 4 * KIB), op(LOCAL_A, REMOTE_A + 4 * KIB, 4 * KIB)],
        vec![(REMOTE_A, 70, vec![(LOCAL_A + 8192, 4096, 10), (LOCAL_A, 4096, 10)])]
    )]
    #[case::contiguous_on_both_sides_share_one_sge(
        vec![op(LOCAL_A, REMOTE_A, 4 * KIB), op(LOCAL_A + 4 * KIB, REMOTE_A + 4 * KIB, 4 * KIB)],
        vec![(REMOTE_A, 70, vec![(LOCAL_A, 8192, 10)])]
    )]
    #[case::remote_gap_starts_a_new_wr(
        vec![op(LOCAL_A, REMOTE_A, 4 * KIB), op(LOCAL_A + 4 * KIB, REMOTE_A + 8 * KIB, 4 * KIB)],
        vec![(REMOTE_A, 70, vec![(LOCAL_A, 4096, 10)]), (REMOTE_A + 8192, 70, vec![(LOCAL_A + 4096, 4096, 10)])]
    )]
    #[case::remote_order_is_kept_not_sorted(
        vec![op(LOCAL_A, REMOTE_A + 4 * KIB, 4 * KIB), op(LOCAL_A + 4 * KIB, REMOTE_A, 4 * KIB)],
        vec![(REMOTE_A + 4096, 70, vec![(LOCAL_A, 4096, 10)]), (REMOTE_A, 70, vec![(LOCAL_A + 4096, 4096, 10)])]
    )]
    #[case::contiguous_across_two_remote_regions_splits(
        vec![op(LOCAL_A, REMOTE_B - 4 * KIB, 4 * KIB), op(LOCAL_A + 4 * KIB, REMOTE_B, 4 * KIB)],
        vec![(REMOTE_B - 4096, 70, vec![(LOCAL_A, 4096, 10)]), (REMOTE_B, 71, vec![(LOCAL_A + 4096, 4096, 10)])]
    )]
    #[case::local_pieces_from_two_regions_share_one_wr(
        vec![op(LOCAL_A, REMOTE_A, 4 * KIB), op(LOCAL_B, REMOTE_A + 4 * KIB, 4 * KIB)],
        vec![(REMOTE_A, 70, vec![(LOCAL_A, 4096, 10), (LOCAL_B, 4096, 11)])]
    )]
    #[case::zero_length_ops_are_skipped(
        vec![op(LOCAL_A, REMOTE_A, 0), op(LOCAL_A, REMOTE_A, 4 * KIB), op(0, 0, 0)],
        vec![(REMOTE_A, 70, vec![(LOCAL_A, 4096, 10)])]
    )]
    fn chains_remote_contiguous_ops(#[case] ops: Vec<WriteSpan>, #[case] expected: Shape) {
        assert_eq!(shape(&plan_with(&planner(16, 1 << 20, 4), &ops)), expected);
    }

    #[rstest]
    #[case::limit_one(1, vec![1, 1, 1, 1, 1])]
    #[case::limit_two(2, vec![2, 2, 1])]
    #[case::limit_five(5, vec![5])]
    #[case::limit_above_count(32, vec![5])]
    fn respects_the_sge_limit(#[case] max_sge: u32, #[case] sges_per_wr: Vec<usize>) {
        // Five remote-contiguous blocks whose sources are not contiguous.
        let ops: Vec<WriteSpan> =
            (0..5).map(|i| op(LOCAL_A + (8 - 2 * i) * 4 * KIB, REMOTE_A + i * 4 * KIB, 4 * KIB)).collect();
        let plan = plan_with(&planner(max_sge, 1 << 20, 4), &ops);
        let counts: Vec<usize> = plan.writes().iter().map(|write| plan.sges(write).len()).collect();
        assert_eq!(counts, sges_per_wr);
        // Still one remote run: each work request starts where the last ended.
        let mut next = REMOTE_A;
        for write in plan.writes() {
            assert_eq!(write.remote_addr, next);
            next += u64::from(write.bytes);
        }
        assert_eq!(next, REMOTE_A + 20 * KIB);
    }

    #[test]
    fn splits_an_op_longer_than_a_work_request() {
        let plan = plan_with(&planner(4, 4096, 4), &[op(LOCAL_A, REMOTE_A, 10 * KIB)]);
        assert_eq!(
            shape(&plan),
            vec![
                (REMOTE_A, 70, vec![(LOCAL_A, 4096, 10)]),
                (REMOTE_A + 4096, 70, vec![(LOCAL_A + 4096, 4096, 10)]),
                (REMOTE_A + 8192, 70, vec![(LOCAL_A + 8192, 2048, 10)]),
            ]
        );
        assert_eq!(plan.total_bytes(), 10 * KIB);
    }

    #[test]
    fn a_split_op_tops_up_the_open_work_request_first() {
        let ops = [op(LOCAL_B, REMOTE_A, 1024), op(LOCAL_A, REMOTE_A + 1024, 5 * KIB)];
        let plan = plan_with(&planner(4, 4096, 4), &ops);
        assert_eq!(
            shape(&plan),
            vec![
                (REMOTE_A, 70, vec![(LOCAL_B, 1024, 11), (LOCAL_A, 3072, 10)]),
                (REMOTE_A + 4096, 70, vec![(LOCAL_A + 3072, 2048, 10)]),
            ]
        );
    }

    #[rstest]
    #[case::one_wr(1, 4, vec![0])]
    #[case::exact_multiple(8, 4, vec![3, 7])]
    #[case::remainder_signals_the_last(9, 4, vec![3, 7, 8])]
    #[case::every_wr(5, 1, vec![0, 1, 2, 3, 4])]
    #[case::interval_above_count(3, 16, vec![2])]
    fn signals_every_nth_and_the_last(#[case] wrs: u64, #[case] interval: u32, #[case] signaled: Vec<usize>) {
        // Remote gaps keep every op in its own work request.
        let ops: Vec<WriteSpan> = (0..wrs).map(|i| op(LOCAL_A + i * KIB, REMOTE_A + 2 * i * KIB, KIB)).collect();
        let plan = plan_with(&planner(16, 1 << 20, interval), &ops);
        assert_eq!(plan.writes().len() as u64, wrs);
        let got: Vec<usize> =
            plan.writes().iter().enumerate().filter(|(_, write)| write.signaled).map(|(index, _)| index).collect();
        assert_eq!(got, signaled);
    }

    #[rstest]
    #[case::outside_every_remote_region(
        op(LOCAL_A, 0x5000, 16),
        PlanError::OutsideRemoteRegions { index: 1, dst: 0x5000, len: 16 }
    )]
    #[case::runs_past_the_last_remote_region(
        op(LOCAL_A, REMOTE_B + 1024 * KIB - 8, 16),
        PlanError::OutsideRemoteRegions { index: 1, dst: REMOTE_B + 1024 * KIB - 8, len: 16 }
    )]
    #[case::straddles_two_remote_regions(
        op(LOCAL_A, REMOTE_B - 8, 16),
        PlanError::OutsideRemoteRegions { index: 1, dst: REMOTE_B - 8, len: 16 }
    )]
    #[case::wraps_the_address_space(
        op(LOCAL_A, u64::MAX - 4, 16),
        PlanError::OutsideRemoteRegions { index: 1, dst: u64::MAX - 4, len: 16 }
    )]
    #[case::outside_the_local_regions(
        op(0x10, REMOTE_A, 16),
        PlanError::OutsideLocalRegions { index: 1, src: 0x10, len: 16 }
    )]
    fn refuses_the_whole_batch_for_one_bad_op(#[case] bad: WriteSpan, #[case] expected: PlanError) {
        let planner = planner(16, 1 << 20, 4);
        let mut plan = Plan::default();
        let ops = [op(LOCAL_A, REMOTE_A, 4 * KIB), bad, op(LOCAL_A, REMOTE_A + 8 * KIB, 4 * KIB)];
        assert_eq!(planner.plan(&ops, &mut plan), Err(expected));
        assert!(plan.writes().is_empty(), "nothing of a refused batch may be posted");
    }

    #[rstest]
    #[case::zero_sge(SendQueueConfig::new(0, 1, 1, 1), SendQueueConfigError::Zero("max_sge"))]
    #[case::zero_bytes(SendQueueConfig::new(1, 0, 1, 1), SendQueueConfigError::Zero("max_wr_bytes"))]
    #[case::zero_interval(SendQueueConfig::new(1, 1, 0, 1), SendQueueConfigError::Zero("signal_interval"))]
    #[case::zero_depth(SendQueueConfig::new(1, 1, 1, 0), SendQueueConfigError::Zero("depth"))]
    #[case::interval_above_depth(
        SendQueueConfig::new(1, 1, 9, 8),
        SendQueueConfigError::IntervalExceedsDepth { interval: 9, depth: 8 }
    )]
    fn refuses_configs_that_cannot_work(
        #[case] config: Result<SendQueueConfig, SendQueueConfigError>,
        #[case] expected: SendQueueConfigError,
    ) {
        assert_eq!(config, Err(expected));
    }

    proptest! {
        /// Any batch inside the regions plans into work requests that, laid
        /// end to end, write exactly the ops' bytes where the ops say, within
        /// every limit.
        #[test]
        fn plans_preserve_every_byte(
            blocks in prop::collection::vec((0u64..64, 0u64..64, 1u64..700), 0..40),
            max_sge in 1u32..5,
            max_wr_bytes in 1u32..3000,
            interval in 1u32..6,
        ) {
            let planner = planner(max_sge, max_wr_bytes, interval);
            let ops: Vec<WriteSpan> =
                blocks.iter().map(|&(s, d, len)| op(LOCAL_A + s * 4 * KIB, REMOTE_A + d * 4 * KIB, len)).collect();
            let plan = plan_with(&planner, &ops);
            // Expand the ops and the plan into (src, dst) byte pairs, in order.
            let expected: Vec<(u64, u64)> = ops.iter().flat_map(|o| (0..o.len).map(move |i| (o.src + i, o.dst + i))).collect();
            let mut got = Vec::with_capacity(expected.len());
            for write in plan.writes() {
                let sges = plan.sges(write);
                prop_assert!(!sges.is_empty() && sges.len() <= max_sge as usize);
                prop_assert!(write.bytes <= max_wr_bytes);
                prop_assert_eq!(u64::from(write.bytes), sges.iter().map(|sge| u64::from(sge.len)).sum::<u64>());
                let mut dst = write.remote_addr;
                for sge in sges {
                    for i in 0..u64::from(sge.len) {
                        got.push((sge.addr + i, dst));
                        dst += 1;
                    }
                }
            }
            prop_assert_eq!(got, expected);
            prop_assert_eq!(plan.total_bytes(), ops.iter().map(|o| o.len).sum::<u64>());
            if let Some(last) = plan.writes().last() {
                prop_assert!(last.signaled);
            }
        }
    }
}
