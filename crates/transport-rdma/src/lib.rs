//! kvlink's RDMA data plane (`mooncake_protocol = "rdma"`): a
//! [`kv_proto::BatchWriter`] (`RdmaTransport`, feature `verbs`) that moves
//! KV blocks with one-sided RDMA WRITEs over RC queue pairs, into memory the
//! receiver opens per grant with memory windows.
//!
//! # How a transfer goes
//!
//! ```text
//!  D (receiver)                                   P (sender)
//!  register destinations LOCAL_WRITE | MW_BIND
//!  grant(ranges) -> Grant::plain(id)  ──side channel──►
//!                                                 batch_write(D, grant, ops):
//!          ◄── TCP connect + handshake (GID, QPN, PSN) ── (once per peer)
//!          ◄── "open grant id" (control channel) ──────── (once per grant)
//!  grant live? bind one type-2 window per grant
//!  range on this connection's queue pair
//!          ── windows (addr, len, rkey) ─────────────────►
//!                                                 every op inside one window?
//!                                                 (else refused, nothing posted)
//!          ◄══ chained RDMA WRITEs (rkey = window's) ════ wait for completions
//!  revoke(id): LOCAL_INV every window of the grant,
//!  wait for the completions (or error the QP)
//! ```
//!
//! # The grant fence, as built
//!
//! - **Least privilege.** Destination regions are registered
//!   `LOCAL_WRITE | MW_BIND` and without `REMOTE_WRITE`: their own rkeys open
//!   nothing, and a peer writes only through a window. Sources are registered
//!   with local access only. A sender's queue pair accepts no writes at all.
//! - **Admission.** A control connection first goes through its opening
//!   ([`handshake::opening`]): with [`RdmaConfig::auth_secret`] both sides
//!   prove the shared secret ([`kv_proto::auth`], `Channel::DataRdma`)
//!   before the receiver makes a queue pair or opens a grant for the
//!   sender. After the proofs, every frame on the connection (the
//!   queue-pair exchange, each open request, reply and progress frame)
//!   carries a tag under per-direction keys derived from the opening's
//!   transcript ([`tags`], [`kv_proto::session`]), checked before the frame
//!   is acted on: a frame altered or injected on the path ends the
//!   connection. 0 established places refuses every sender. The receiver
//!   holds a connection in its handshake in a handshake place (bounded in total and per source host, one deadline
//!   for the whole set-up) and gives it an established place
//!   ([`RdmaConfig::limits`]) only once the opening succeeded.
//! - **Grants.** [`BatchWriter::grant`](kv_proto::BatchWriter::grant) issues
//!   the grant in [`kv_proto::RegisteredMemory`] (the one copy of the grant
//!   bookkeeping: id, ranges, expiry) and returns `Grant::plain(id)`: the
//!   trait names no peer at grant time, and a type-2 window works only on
//!   the queue pair it is bound on. So binding is lazy: the first batch under
//!   a grant on a connection sends an "open" request on the per-peer TCP
//!   control connection (the handshake's, kept open); the receiver checks the
//!   grant is live and not expired (`RegisteredMemory::admit`), binds one
//!   window per grant range on that connection's queue pair (`BIND_MW` work
//!   requests, completions awaited), records them
//!   ([`fence::FenceBook`]) and answers with each window's address, length
//!   and rkey ([`control`]). The sender caches them per peer and grant
//!   ([`fence::GrantCache`]).
//! - **Refused whole.** The sender plans the whole batch against the
//!   grant's windows ([`plan::plan_batch`]) before posting anything: one op
//!   outside every window refuses the batch (`TransportError::Refused`,
//!   naming the op). An unknown, revoked or expired grant is refused by the
//!   receiver's answer. A sender that cached a grant's windows and writes
//!   after the grant was revoked or expired fails on its first write with a
//!   remote access error from the receiver's device; since the queue pair
//!   stops at the first error, nothing of the batch landed and that too is
//!   `Refused`.
//! - **Revocation is a fence.** `revoke` (and the grant's expiry timer)
//!   first stops new opens (`RegisteredMemory::revoke`), waits for an open
//!   of that grant in progress, then posts `LOCAL_INV` for every window bound
//!   for it, on the queue pair it is bound on, and waits for the
//!   completions. If a queue pair cannot invalidate (error state, no
//!   completion within the bound), it is moved to the error state instead,
//!   which makes every window bound on it unusable. When `revoke` returns no
//!   write with those keys can land. Invalidated windows go back to a pool
//!   and are bound again under their next 8-bit key; old keys stay dead.
//! - **Close.** `close` (and the drop of the last handle) moves every queue
//!   pair to the error state, deallocates every window, then lets go of the
//!   queue pairs and registrations, synchronously. A window holds the region
//!   and the queue pair it is bound on, so neither is destroyed under it
//!   (the device refuses to deregister such a region, and destroying such a
//!   queue pair waits in the kernel for its windows).
//!
//! Cost per transfer (one grant): one control round trip on the first batch
//! under the grant on a connection, plus one `BIND_MW` work request per grant
//! range when it opens and one `LOCAL_INV` work request per grant range when
//! it is revoked; both are local work requests on the receiver's queue pair
//! (no network traffic), posted in chains under the send window with
//! selective signalling. Later batches under the same grant cost nothing
//! extra. A grant has as many ranges as runs of contiguous blocks per region
//! (a contiguous pull over 64 regions: 64 windows). Windows come from a pool;
//! allocating one is a system call, paid once. Measured in the Soft-RoCE
//! guest (debug build, TCG): a 200,000-range grant opens in about 5 s
//! (allocation 2.3 s, binding 1.0 s) and is revoked in about 1.7 s, about
//! 9 µs per invalidation.
//!
//! **Soft-RoCE caveat.** rxe checks a window-addressed write against the
//! underlying memory region's bounds, not the window's: on Soft-RoCE a
//! window revokes but does not confine (measured in phase 1: writes past a
//! window's end but inside its region land). There, the sender's
//! whole-batch check is what keeps an honest sender inside the grant; a real
//! NIC enforces the window's bounds too. Also on rxe, invalidation and the
//! error state take effect per packet: a packet whose key check passed just
//! before a `LOCAL_INV` completed may still be copied (at most one MTU per
//! queue pair); a real NIC completes the invalidation only once no access
//! through the window is in progress.
//!
//! What Soft-RoCE cannot show and a real deployment needs: GPU memory
//! registration (`ibv_reg_dmabuf_mr` or peer memory, for KV caches in device
//! memory), several NICs (one transport per NIC and rail-aware peer
//! selection), several queue pairs per peer where one cannot fill a link,
//! and the device's own window bounds checks.
//!
//! # GPU memory (GPUDirect RDMA): what it will need, and the seam
//!
//! Today a CUDA KV cache reaches this transport only through host staging
//! (the `kvlink_vllm` package copies device blocks into pinned host memory
//! and back; the worker registers, grants and writes that memory): every
//! region this crate registers is host memory, pinned by `ibv_reg_mr`.
//! Writing device memory directly, without the staging copies, needs:
//!
//! - **Registration.** The seam is region registration:
//!   [`BatchWriter::register_regions`](kv_proto::BatchWriter::register_regions)
//!   (`&[MemoryRegion]` and a `RegionAccess`), which `transport/mod.rs`
//!   forwards to `verbs::register_checked` and `ProtectionDomain::register`
//!   (`verbs/memory.rs`, the `ibv_reg_mr` call). A device region is
//!   registered instead with `ibv_reg_dmabuf_mr(pd, offset, length, iova,
//!   fd, access)` on a dma-buf file descriptor the CUDA driver exports for
//!   the allocation (`cuMemGetHandleForAddressRange(...,
//!   CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, ...)`, one per vLLM cache tensor),
//!   with `iova` the device virtual address so that windows, op lists and
//!   grants keep addressing by the same numbers as now. `MemoryRegion` is an
//!   address and a length: it needs a memory kind (host, or device with the
//!   dma-buf and its offset), carried from the engine side through
//!   kv-worker's `RegisteredCache`, so that `tcp` and `quic` refuse device
//!   regions and `host_staging = "auto"` stages exactly where the transport
//!   cannot reach. sideway does not wrap `ibv_reg_dmabuf_mr`; the binding
//!   goes into `rdma-mummy-sys` and the RAII type into `verbs/memory.rs`,
//!   the crate's only `unsafe`. The older path, `ibv_reg_mr` on a CUDA
//!   pointer through the `nvidia-peermem` kernel module, needs no new call
//!   but a module this crate cannot check for; dma-buf is the one to build.
//! - **The fence, unchanged.** Destinations stay registered `LOCAL_WRITE |
//!   MW_BIND` without `REMOTE_WRITE`, and a peer writes only through the
//!   type-2 windows bound per grant; whether the NIC binds windows on a
//!   dma-buf memory region must be checked on the hardware (mlx5 supports
//!   both; Soft-RoCE registers no device memory at all, so none of this can
//!   be tested in the guest).
//! - **Visibility on D.** A completed RDMA WRITE into GPU memory is not
//!   ordered before the GPU's own later reads: before D reports a pull
//!   received, after the revocation fence, the engine side must flush
//!   (`cuFlushGPUDirectRDMAWrites`, or an event ordering the consumer
//!   after it). Like the staging copies, that is the engine's to run,
//!   ordered by kv-worker after its fence, so the Rust side stays
//!   device-agnostic.
//! - **Readiness on P.** The blocks are read by the NIC straight from the
//!   device: a request is ready only once the engine's stream has finished
//!   the forward passes that wrote them (the event the staging path already
//!   records in `start_load_kv`), not only once vLLM finished the request.
//! - **Placement.** One transport per NIC, the NIC on the GPU's PCIe switch
//!   (`KVLINK_RDMA_*` per tensor-parallel rank), and the NIC's translation
//!   limits for registering whole caches (tens of GiB per rank).
//!
//! # Connections
//!
//! One RC queue pair per peer (sender side: per address and receiver
//! instance, see `details`), set up over TCP (the [`handshake`]) and kept
//! with its TCP connection as the control channel. Batches to one peer take
//! turns on it; each is posted as chains of RDMA WRITE work requests (remote-
//! contiguous ops share one, with scatter-gather), never more outstanding
//! than the send queue holds (back-pressure, not failure), every
//! `signal_interval`-th and the last signalled; completions are awaited on
//! the completion channel in the tokio reactor (no polling while idle). Any
//! error moves the queue pair to the error state; the next batch connects
//! anew (a batch that failed on a reused connection before the peer could
//! answer is retried once on a new one). Every wait is bounded by
//! [`RdmaConfig`] (`connect_timeout`, `io_timeout`; a large grant being
//! bound sends progress frames that restart the sender's wait).
//!
//! # Bindings
//!
//! Not `rdma-core-sys`, the obvious raw binding: it does not build against
//! today's rdma-core (it bundles rdma-core 18 and needs a musl cross
//! toolchain). This
//! crate uses `sideway` (maintained safe wrappers; RAII objects that hold
//! `Arc`s of their parents) and, for the few calls sideway does not wrap
//! (memory windows, chained posting, completion-channel events), its own sys
//! crate `rdma-mummy-sys`, which loads libibverbs at run time. Both sit behind
//! the `verbs` feature, off by default: building them needs cmake and
//! libclang-dev, running them needs libibverbs and a provider, and a plain
//! `cargo build --workspace` needs none of that.
//!
//! # Why windows and not the error state (phase 1 findings)
//!
//! Measured on the test guest (Debian kernel 6.1, `rdma_rxe`; rdma-core 44):
//! rxe reports `MEM_WINDOW_TYPE_2B`, `max_mw` 524287; a type-2 window bound by
//! a `BIND_MW` work request on the receiver's QP takes remote writes through
//! its rkey, only on that QP; after a `LOCAL_INV` completes a write with that
//! rkey fails (remote access error) and no byte lands. Fencing by moving the
//! peer's queue pair to the error state instead costs a new queue pair and
//! handshake per revocation, and fences every grant on that connection at
//! once; it stays the fallback when invalidation fails.
//!
//! What this crate must never do:
//! - depend on anything but `kv-proto` and `kv-net` among kvlink's crates;
//! - let `unsafe` spread beyond the `verbs` module (one exception: the
//!   trait's `unsafe fn register_regions`, whose one block forwards the
//!   caller's contract to `verbs::register_checked`);
//! - post a work request for a batch that is not entirely inside the grant's
//!   windows (the whole batch is planned and checked before anything is
//!   posted);
//! - let a window outlive its grant: revocation, expiry, the end of its
//!   connection and close each invalidate or deallocate it;
//! - trust peer input: the handshake, control and details decoders are
//!   bounded and fallible.
//!
//! # Modules
//!
//! - [`config`]: [`RdmaConfig`], every bound, the device from the environment.
//! - [`control`]: the open-grant request and its answer, bounded decoding.
//! - `details`: what an RDMA endpoint carries (public to the fuzz targets
//!   only).
//! - [`fence`]: the fence's bookkeeping (window specs, bound windows per
//!   grant and connection, the window pool, the sender's grant cache).
//! - [`region`]: registered regions as numbers, and range lookups.
//! - [`plan`]: the work-request planner (chaining, scatter-gather, signalling).
//! - [`window`]: send-queue back-pressure (outstanding requests, retirement).
//! - [`handshake`]: the opening (versions, the secret, admission) and the
//!   QP exchange over TCP, bounded decoding.
//! - [`tags`]: the tags of a control connection's frames after its opening.
//! - `transport` (feature `verbs`): `RdmaTransport`: the receiver's side
//!   (listener, opens, the fence), the sender's (connections, batches), the
//!   queue-pair loop.
//! - `verbs` (feature `verbs`): the RAII verbs layer, the only `unsafe` code
//!   (the crate root denies `unsafe_code`; only that module allows it).

#![deny(unsafe_code)]

pub mod config;
pub mod control;
// Public only to the fuzz targets (cargo-fuzz builds with `--cfg fuzzing`,
// and so does `cargo xtask fuzz --replay`), as quinn-proto does; its items
// stay `pub` for them, which `unreachable_pub` would flag here. Without
// `verbs` nothing but its own tests uses it.
#[cfg(fuzzing)]
pub mod details;
#[cfg(not(fuzzing))]
#[allow(unreachable_pub)]
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
mod details;
pub mod fence;
pub mod handshake;
pub mod plan;
pub mod region;
pub mod tags;
pub mod window;

#[cfg(feature = "verbs")]
mod transport;

// The one module allowed `unsafe`.
#[cfg(feature = "verbs")]
#[allow(unsafe_code)]
pub mod verbs;

pub use config::RdmaConfig;
pub use kv_net::ListenerLimits;
#[cfg(feature = "verbs")]
pub use transport::RdmaTransport;
