//! A completion queue with a completion channel, polled without allocation
//! and awaited on the channel's file descriptor in the tokio reactor.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use rdma_mummy_sys::{ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq, ibv_wc};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue as _};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::{Device, VerbsError};

/// Completions read per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// The outcome of a work request (`ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// It completed.
    Success,
    /// A local scatter-gather entry was outside its memory region.
    LocalProtectionError,
    /// The queue pair entered the error state before it ran.
    Flushed,
    /// The peer refused the access (bad rkey, range or permission).
    RemoteAccessError,
    /// The peer could not carry it out.
    RemoteOperationError,
    /// No acknowledgement after all retries (peer unreachable or gone).
    RetryExceeded,
    /// A memory-window bind was refused (window not free, range outside its
    /// region, or missing access).
    WindowBindError,
    /// Another status, by its `ibv_wc_status` number.
    Other(u32),
}

impl WcStatus {
    fn from_raw(status: u32) -> Self {
        use rdma_mummy_sys::ibv_wc_status::*;
        match status {
            IBV_WC_SUCCESS => Self::Success,
            IBV_WC_LOC_PROT_ERR => Self::LocalProtectionError,
            IBV_WC_WR_FLUSH_ERR => Self::Flushed,
            IBV_WC_REM_ACCESS_ERR => Self::RemoteAccessError,
            IBV_WC_REM_OP_ERR => Self::RemoteOperationError,
            IBV_WC_RETRY_EXC_ERR => Self::RetryExceeded,
            IBV_WC_MW_BIND_ERR => Self::WindowBindError,
            other => Self::Other(other),
        }
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Success => f.write_str("success"),
            Self::LocalProtectionError => f.write_str("local protection error"),
            Self::Flushed => f.write_str("flushed (queue pair in error state)"),
            Self::RemoteAccessError => f.write_str("remote access error"),
            Self::RemoteOperationError => f.write_str("remote operation error"),
            Self::RetryExceeded => f.write_str("transport retry counter exceeded"),
            Self::WindowBindError => f.write_str("memory window bind error"),
            Self::Other(code) => write!(f, "ibv_wc_status {code}"),
        }
    }
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id (its sequence number, see [`crate::window`]).
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// The provider's own error detail.
    pub vendor_err: u32,
    /// The queue pair it belongs to.
    pub qp_num: u32,
}

/// The completion channel's file descriptor, as the reactor sees it. Holds
/// the channel so it is destroyed only after the reactor let go of the fd.
struct ChannelFd(Arc<CompletionChannel>);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// A completion queue whose notifications arrive on its own channel.
pub struct CompletionQueue {
    // Field order is drop order: the reactor registration goes before the
    // queue; sideway's queue holds the channel, so the channel goes last.
    events: AsyncFd<ChannelFd>,
    cq: Arc<BasicCompletionQueue>,
    batch: Vec<ibv_wc>,
    _device: Arc<Device>,
}

// SAFETY: `batch` holds plain completion records (its raw pointers are never
// dereferenced by us); the queue itself is only polled through `&mut self`, and
// sideway's CQ and channel types are Send.
unsafe impl Send for CompletionQueue {}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue").field("channel_fd", &self.events.as_raw_fd()).finish_non_exhaustive()
    }
}

impl CompletionQueue {
    /// A queue of at least `entries` completions on `device`, waited on
    /// through the current tokio runtime. Size it for every work request that
    /// can be outstanding on the queue pairs using it: a flush completes each
    /// of them, signalled or not.
    pub fn new(device: &Arc<Device>, entries: u32) -> Result<Self, VerbsError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(VerbsError::NoRuntime);
        }
        let channel = device
            .context()
            .create_comp_channel()
            .map_err(|err| VerbsError::sideway("ibv_create_comp_channel", err))?;
        channel.set_nonblocking(true).map_err(|source| VerbsError::Call { call: "fcntl(O_NONBLOCK)", source })?;
        let cq = device
            .context()
            .create_cq_builder()
            .setup_cqe(entries)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|err| VerbsError::sideway("ibv_create_cq", err))?;
        // SAFETY: the fd is the channel's, and `ChannelFd` holds the channel
        // (so the fd stays open and the same) for the AsyncFd's whole life.
        let events = unsafe { AsyncFd::register_with_interest(ChannelFd(channel), Interest::READABLE) }
            .map_err(|err| VerbsError::Call { call: "register the completion channel", source: err.into() })?;
        // SAFETY: an all-zero ibv_wc is a valid value (integers and a union of integers).
        let empty: ibv_wc = unsafe { std::mem::zeroed() };
        Ok(Self { events, cq, batch: vec![empty; POLL_BATCH], _device: Arc::clone(device) })
    }

    /// Moves the completions that are ready into `out` (appended); returns
    /// how many. Never blocks.
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        let mut total = 0;
        loop {
            let capacity = i32::try_from(self.batch.len()).unwrap_or(i32::MAX);
            // SAFETY: the CQ is alive (we hold its Arc) and `batch` has room
            // for `capacity` records, which is all the provider writes.
            let polled = unsafe { ibv_poll_cq(self.raw_cq(), capacity, self.batch.as_mut_ptr()) };
            let Ok(count) = usize::try_from(polled) else {
                return Err(VerbsError::errno("ibv_poll_cq", -polled));
            };
            out.extend(self.batch[..count].iter().map(|wc| Completion {
                wr_id: wc.wr_id,
                status: WcStatus::from_raw(wc.status),
                vendor_err: wc.vendor_err,
                qp_num: wc.qp_num,
            }));
            total += count;
            if count < self.batch.len() {
                return Ok(total);
            }
        }
    }

    /// Waits until at least one completion is ready, then moves the ready
    /// ones into `out` as [`poll`](Self::poll) does. Sleeps in the reactor
    /// while the queue is empty.
    pub async fn wait(&mut self, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        loop {
            let found = self.poll(out)?;
            if found > 0 {
                return Ok(found);
            }
            self.arm()?;
            // A completion that arrived before arming raises no event: look again.
            let found = self.poll(out)?;
            if found > 0 {
                return Ok(found);
            }
            let mut ready = self
                .events
                .readable()
                .await
                .map_err(|source| VerbsError::Call { call: "wait for the completion channel", source })?;
            if !self.take_event()? {
                ready.clear_ready();
            }
        }
    }

    /// Asks for an event on the channel at the next completion.
    fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the CQ is alive; 0 asks for any completion, not only solicited ones.
        let code = unsafe { ibv_req_notify_cq(self.raw_cq(), 0) };
        if code != 0 {
            return Err(VerbsError::errno("ibv_req_notify_cq", code));
        }
        Ok(())
    }

    /// Reads one event from the (non-blocking) channel and acknowledges it at
    /// once (a CQ with unacknowledged events cannot be destroyed). Returns
    /// false if there was none.
    fn take_event(&self) -> Result<bool, VerbsError> {
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut context: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the channel is alive (held by `events`); both out-pointers
        // point to locals.
        let code = unsafe { ibv_get_cq_event(self.events.get_ref().0.comp_channel().as_ptr(), &mut cq, &mut context) };
        if code != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(false);
            }
            return Err(VerbsError::Call { call: "ibv_get_cq_event", source: err });
        }
        // SAFETY: `cq` is the queue the event was for, alive: only our CQ uses
        // this channel, and we hold it.
        unsafe { ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }

    fn raw_cq(&self) -> *mut ibv_cq {
        // SAFETY: the pointer is used only while `self.cq` keeps the CQ alive.
        unsafe { self.cq.cq() }.as_ptr()
    }

    pub(super) fn raw(&self) -> &Arc<BasicCompletionQueue> {
        &self.cq
    }
}
