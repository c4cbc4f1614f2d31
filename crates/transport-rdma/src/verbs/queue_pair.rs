//! An RC queue pair: connected from the peer's (GID, QPN, PSN), posting
//! chained RDMA WRITEs from a [`Plan`] without allocating, movable to the
//! error state (which flushes every outstanding work request).

use std::sync::Arc;

use rdma_mummy_sys::{
    bind_mw_t, ibv_access_flags, ibv_mw_bind_info, ibv_post_send, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode,
    imm_data_invalidated_rkey_union_t, rdma_t,
};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, GenericCompletionQueue};
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair as _, QueuePairAttribute, QueuePairAttributeMask, QueuePairState as SidewayState,
};
use sideway::ibverbs::AccessFlags;

use super::{CompletionQueue, MemoryRegion, MemoryWindow, ProtectionDomain, VerbsError};
use crate::handshake::QpEndpoint;
use crate::plan::Plan;

/// The states a queue pair goes through here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueuePairState {
    /// Created, not connected.
    Reset,
    /// Initialised.
    Init,
    /// Ready to receive.
    ReadyToReceive,
    /// Ready to send: connected.
    ReadyToSend,
    /// Error: every outstanding work request is flushed.
    Error,
    /// Any other verbs state.
    Other,
}

/// Sizes of the queue pair's send queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCapacity {
    /// Work requests outstanding at most (`max_send_wr`).
    pub max_send_wr: u32,
    /// Scatter-gather entries per work request (`max_send_sge`).
    pub max_send_sge: u32,
}

/// Transport timing of a connection (RTR/RTS attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Local ACK timeout exponent: 4.096 µs × 2^n per try.
    pub ack_timeout: u8,
    /// Retransmissions before a work request fails with "retry exceeded" (0..=7).
    pub retry_count: u8,
    /// Retries on receiver-not-ready (7: forever); unused by one-sided writes.
    pub rnr_retry: u8,
    /// Whether the queue pair accepts the peer's RDMA WRITEs (into memory
    /// its rkeys open). A pure sender's queue pair refuses them.
    pub remote_write: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        // 14: about 67 ms per try, 7 tries: a dead peer fails a request in ~0.5 s.
        Self { ack_timeout: 14, retry_count: 7, rnr_retry: 7, remote_write: true }
    }
}

/// One `BIND_MW` work request: bind `window` over `[addr, addr + len)` of
/// `region` for remote writes, under the key `rkey`.
#[derive(Debug, Clone, Copy)]
pub struct BindWindow<'a> {
    /// The window (unbound).
    pub window: &'a MemoryWindow,
    /// The region it goes over (registered [`super::Access::Windowed`]).
    pub region: &'a MemoryRegion,
    /// First byte.
    pub addr: u64,
    /// Length in bytes (not zero).
    pub len: u64,
    /// The key it gets (see [`MemoryWindow::next_rkey`]).
    pub rkey: u32,
}

/// The device's queue pair, shared by its [`QueuePair`] and the memory
/// windows bound on it ([`QpHold`]): it is destroyed when the last of them
/// lets go, so never while a window is still bound on it (destroying it
/// then would wait, in the kernel, for the windows to let go of it).
struct QpObject {
    // Field order is drop order: the queue pair before its completion queue.
    qp: std::sync::Mutex<BasicQueuePair>,
    raw: std::ptr::NonNull<rdma_mummy_sys::ibv_qp>,
    _cq: Arc<BasicCompletionQueue>,
}

// SAFETY: `raw` is the queue pair `qp` owns, valid while the object lives;
// libibverbs queue pairs may be used from any thread (sideway's is Send and
// Sync), and `qp` is only modified under its mutex.
unsafe impl Send for QpObject {}
// SAFETY: as above.
unsafe impl Sync for QpObject {}

impl QpObject {
    fn lock(&self) -> std::sync::MutexGuard<'_, BasicQueuePair> {
        self.qp.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Keeps a queue pair alive: what a memory window bound on it holds.
#[derive(Clone)]
pub struct QpHold(Arc<QpObject>);

impl std::fmt::Debug for QpHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("QpHold").field(&self.0.lock().qp_number()).finish()
    }
}

/// A reliable-connected queue pair.
pub struct QueuePair {
    object: Arc<QpObject>,
    psn: u32,
    capacity: QpCapacity,
    pd: Arc<ProtectionDomain>,
    /// Reused work-request and scatter-gather arrays: posting allocates nothing
    /// once they have grown to a batch's size.
    wrs: Vec<ibv_send_wr>,
    sges: Vec<ibv_sge>,
}

// SAFETY: `wrs` and `sges` hold raw pointers only into each other, rebuilt on
// every post under `&mut self`; sideway's queue pair is Send.
unsafe impl Send for QueuePair {}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.qpn())
            .field("psn", &self.psn)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl QueuePair {
    /// Creates an RC queue pair in `pd` whose work requests complete on `cq`,
    /// starting its send sequence at `psn` (24 bits).
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        cq: &CompletionQueue,
        capacity: QpCapacity,
        psn: u32,
    ) -> Result<Self, VerbsError> {
        if psn >= 1 << 24 {
            return Err(VerbsError::OutOfRange(format!("PSN {psn:#x} exceeds 24 bits")));
        }
        let send_cq = GenericCompletionQueue::from(Arc::clone(cq.raw()));
        let qp = pd
            .raw()
            .create_qp_builder()
            .setup_max_send_wr(capacity.max_send_wr)
            .setup_max_send_sge(capacity.max_send_sge)
            // One-sided writes consume no receives.
            .setup_max_recv_wr(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(send_cq.clone())
            .setup_recv_cq(send_cq)
            .build()
            .map_err(|err| VerbsError::sideway("ibv_create_qp", err))?;
        // SAFETY: only the pointer is kept, next to the queue pair that owns it.
        let raw = unsafe { qp.qp() };
        let object = Arc::new(QpObject { qp: std::sync::Mutex::new(qp), raw, _cq: Arc::clone(cq.raw()) });
        let qp = Self { object, psn, capacity, pd: Arc::clone(pd), wrs: Vec::new(), sges: Vec::new() };
        tracing::debug!(qpn = qp.qpn(), psn, ?capacity, "queue pair created");
        Ok(qp)
    }

    /// Queue pair number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: the queue pair is alive while `self` is; the field is plain data.
        unsafe { self.object.raw.as_ref().qp_num }
    }

    /// A hold on the device's queue pair, for a window bound on it.
    pub fn hold(&self) -> QpHold {
        QpHold(Arc::clone(&self.object))
    }

    /// What the peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> QpEndpoint {
        QpEndpoint { gid: self.pd.device().gid(), qpn: self.qpn(), psn: self.psn }
    }

    /// Its send queue's sizes.
    pub fn capacity(&self) -> QpCapacity {
        self.capacity
    }

    /// The current state, as the device has it (`ibv_query_qp`: an error
    /// completion moves the queue pair to error without telling this process).
    pub fn state(&self) -> Result<QueuePairState, VerbsError> {
        let (attr, _) = self
            .object
            .lock()
            .query(QueuePairAttributeMask::State)
            .map_err(|err| VerbsError::sideway("ibv_query_qp", err))?;
        Ok(match attr.state() {
            SidewayState::Reset => QueuePairState::Reset,
            SidewayState::Init => QueuePairState::Init,
            SidewayState::ReadyToReceive => QueuePairState::ReadyToReceive,
            SidewayState::ReadyToSend => QueuePairState::ReadyToSend,
            SidewayState::Error => QueuePairState::Error,
            _ => QueuePairState::Other,
        })
    }

    /// INIT → RTR → RTS towards `remote`. With `options.remote_write` the
    /// queue pair accepts remote writes into this side's memory (the rkeys
    /// of regions and windows decide where); without, it accepts none.
    pub fn connect(&mut self, remote: &QpEndpoint, options: &ConnectOptions) -> Result<(), VerbsError> {
        let device = Arc::clone(self.pd.device());
        let access =
            if options.remote_write { AccessFlags::LocalWrite | AccessFlags::RemoteWrite } else { AccessFlags::none() };
        let mut init = QueuePairAttribute::new();
        init.setup_state(SidewayState::Init).setup_pkey_index(0).setup_port(device.port()).setup_access_flags(access);
        let mut qp = self.object.lock();
        qp.modify(&init).map_err(|err| VerbsError::sideway("ibv_modify_qp(INIT)", err))?;

        let mut path = AddressHandleAttribute::new();
        path.setup_port(device.port()).setup_dest_lid(0).setup_service_level(0).setup_grh(
            &Gid { raw: remote.gid },
            0,
            device.gid_index(),
            64,
            0,
        );
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(SidewayState::ReadyToReceive)
            .setup_path_mtu(device.active_mtu())
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(1)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&path);
        qp.modify(&rtr).map_err(|err| VerbsError::sideway("ibv_modify_qp(RTR)", err))?;

        let mut rts = QueuePairAttribute::new();
        rts.setup_state(SidewayState::ReadyToSend)
            .setup_sq_psn(self.psn)
            .setup_timeout(options.ack_timeout)
            .setup_retry_cnt(options.retry_count)
            .setup_rnr_retry(options.rnr_retry)
            .setup_max_read_atomic(1);
        qp.modify(&rts).map_err(|err| VerbsError::sideway("ibv_modify_qp(RTS)", err))?;
        drop(qp);
        tracing::debug!(qpn = self.qpn(), remote_qpn = remote.qpn, "queue pair connected");
        Ok(())
    }

    /// Moves the queue pair to the error state: nothing more is sent, and
    /// every outstanding work request completes as [`super::WcStatus::Flushed`].
    pub fn set_error(&mut self) -> Result<(), VerbsError> {
        let mut error = QueuePairAttribute::new();
        error.setup_state(SidewayState::Error);
        self.object.lock().modify(&error).map_err(|err| VerbsError::sideway("ibv_modify_qp(ERR)", err))?;
        tracing::debug!(qpn = self.qpn(), "queue pair moved to the error state");
        Ok(())
    }

    /// Posts `plan`'s work requests `writes` as one chain, the `i`-th of them
    /// with `wr_id = first_seq + i`, signalled as the plan says.
    ///
    /// The caller keeps the count within the send queue's room (see
    /// [`crate::window::SendWindow`]); the device reads only local memory
    /// inside registered regions (by lkey) and writes only remote memory the
    /// peer registered (by rkey), so a wrong plan fails work requests, it
    /// cannot touch other memory.
    pub fn post_writes(
        &mut self,
        plan: &Plan,
        writes: std::ops::Range<usize>,
        first_seq: u64,
    ) -> Result<(), VerbsError> {
        let Some(chosen) = plan.writes().get(writes.clone()) else {
            return Err(VerbsError::OutOfRange(format!(
                "work requests {writes:?} are outside a plan of {}",
                plan.writes().len()
            )));
        };
        if chosen.is_empty() {
            return Ok(());
        }
        self.wrs.clear();
        self.sges.clear();
        for write in chosen {
            let entries = plan.sges(write);
            if entries.len() > self.capacity.max_send_sge as usize {
                return Err(VerbsError::OutOfRange(format!(
                    "a work request of {} entries exceeds the queue pair's {}",
                    entries.len(),
                    self.capacity.max_send_sge
                )));
            }
            self.sges.extend(entries.iter().map(|sge| ibv_sge { addr: sge.addr, length: sge.len, lkey: sge.lkey }));
        }
        // `sges` is complete: its buffer no longer moves.
        let sge_base = self.sges.as_mut_ptr();
        let mut first_sge = 0;
        for (index, write) in chosen.iter().enumerate() {
            let count = plan.sges(write).len();
            // SAFETY: an all-zero ibv_send_wr is valid (integers, null pointers, unions of those).
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = first_seq + index as u64;
            wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.send_flags = if write.signaled { ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            wr.num_sge = i32::try_from(count).unwrap_or(i32::MAX);
            // SAFETY: `first_sge` is this request's first entry, inside `sges`.
            wr.sg_list = unsafe { sge_base.add(first_sge) };
            wr.wr.rdma = rdma_t { remote_addr: write.remote_addr, rkey: write.rkey };
            self.wrs.push(wr);
            first_sge += count;
        }
        self.post_chain()?;
        tracing::trace!(qpn = self.qpn(), first_seq, count = chosen.len(), "work requests posted");
        Ok(())
    }

    /// Posts one `BIND_MW` work request per entry of `binds`, as one chain,
    /// the `i`-th with `wr_id = first_seq + i`, signalled where `signaled(i)`.
    /// Each window must be unbound and each range inside its region; when a
    /// bind completes successfully the caller records it
    /// ([`MemoryWindow::set_bound`]).
    pub fn post_binds(
        &mut self,
        binds: &[BindWindow<'_>],
        first_seq: u64,
        signaled: impl Fn(usize) -> bool,
    ) -> Result<(), VerbsError> {
        if binds.is_empty() {
            return Ok(());
        }
        self.wrs.clear();
        for (index, bind) in binds.iter().enumerate() {
            if bind.len == 0 || !bind.region.contains(bind.addr, bind.len) {
                return Err(VerbsError::OutOfRange(format!(
                    "window {:#x}+{} is empty or outside its region {:#x}+{}",
                    bind.addr,
                    bind.len,
                    bind.region.addr(),
                    bind.region.len()
                )));
            }
            // SAFETY: an all-zero ibv_send_wr is valid (integers, null pointers, unions of those).
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = first_seq + index as u64;
            wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
            wr.send_flags = if signaled(index) { ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            wr.bind_mw_tso_union.bind_mw = bind_mw_t {
                mw: bind.window.raw(),
                rkey: bind.rkey,
                bind_info: ibv_mw_bind_info {
                    mr: bind.region.raw(),
                    addr: bind.addr,
                    length: bind.len,
                    mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
                },
            };
            self.wrs.push(wr);
        }
        self.post_chain()?;
        tracing::trace!(qpn = self.qpn(), first_seq, count = binds.len(), "window binds posted");
        Ok(())
    }

    /// Posts one `LOCAL_INV` work request per key of `rkeys` (windows bound
    /// on this queue pair), as one chain, numbered and signalled as
    /// [`post_binds`](Self::post_binds) does. Once one completes successfully
    /// its window opens nothing any more.
    pub fn post_invalidates(
        &mut self,
        rkeys: &[u32],
        first_seq: u64,
        signaled: impl Fn(usize) -> bool,
    ) -> Result<(), VerbsError> {
        if rkeys.is_empty() {
            return Ok(());
        }
        self.wrs.clear();
        for (index, &rkey) in rkeys.iter().enumerate() {
            // SAFETY: an all-zero ibv_send_wr is valid (integers, null pointers, unions of those).
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = first_seq + index as u64;
            wr.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
            wr.send_flags = if signaled(index) { ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            wr.imm_data_invalidated_rkey_union = imm_data_invalidated_rkey_union_t { invalidated_rkey: rkey };
            self.wrs.push(wr);
        }
        self.post_chain()?;
        tracing::trace!(qpn = self.qpn(), first_seq, count = rkeys.len(), "window invalidations posted");
        Ok(())
    }

    /// Chains `wrs` (non-empty, complete) and posts it.
    fn post_chain(&mut self) -> Result<(), VerbsError> {
        let wr_base = self.wrs.as_mut_ptr();
        let Some(last) = self.wrs.len().checked_sub(1) else { return Ok(()) };
        for (index, wr) in self.wrs.iter_mut().enumerate() {
            // SAFETY: `index + 1 <= last` is inside `wrs`.
            wr.next = if index < last { unsafe { wr_base.add(index + 1) } } else { std::ptr::null_mut() };
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is alive; the chain, its entries (in `sges`) and the
        // windows and regions a bind names are not touched or freed until the
        // call returns (the provider copies what it needs into the send
        // queue). The memory they name is covered by the registration
        // contract of `ProtectionDomain::register`.
        let code = unsafe { ibv_post_send(self.object.raw.as_ptr(), wr_base, &mut bad) };
        if code != 0 {
            return Err(VerbsError::errno("ibv_post_send", code));
        }
        Ok(())
    }
}
