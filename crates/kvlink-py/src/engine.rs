//! The one module that uses `kv-worker`'s API: config construction, start
//! over engine memory (or over host staging in front of it, with
//! kv-worker's `StagedWorker`), the per-step calls, and shutdown.
//! Everything else in this crate goes through [`Engine`].

use std::time::Duration;

use kv_proto::{ConnectorMetadata, LayoutKind, TokenLayout};
use kv_worker::staging::{CopyWork, StagedWorker};
pub(crate) use kv_worker::Placement;
use kv_worker::{Finished, LayerCache, LayerTensor, RegisteredCache, Worker, WorkerConfig};

use crate::config::Settings;
use crate::error::Result;
use crate::runtime::ProcessRuntime;

/// One tensor of engine memory, described by plain integers from Python.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorDesc {
    /// Base address.
    pub(crate) addr: u64,
    /// Bytes.
    pub(crate) len: u64,
    /// Blocks in it.
    pub(crate) num_blocks: u64,
    /// Tokens per block.
    pub(crate) block_size: u32,
}

/// The worker config for `settings` at `placement`; listeners bind per the
/// settings, `default_host` is this host's address when none is configured.
pub(crate) fn worker_config(settings: &Settings, placement: Placement, default_host: &str) -> Result<WorkerConfig> {
    let bind = settings.bind_addr(default_host);
    let mut config = WorkerConfig::from_transfer_config(&settings.transfer, bind, placement)?;
    config.auth_secret = settings.auth_secret.clone();
    config.data_advertise_host = Some(settings.host(default_host).to_owned());
    Ok(config)
}

/// How heads and tokens lie in a block, as the engine's layout reader
/// found them (undeclared: blocks are only copied whole).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockHeads {
    /// KV heads in a block (MLA: 1); 0 when undeclared.
    pub(crate) heads: u32,
    /// Token order inside a block.
    pub(crate) order: TokenLayout,
    /// Bytes per element (0 when undeclared).
    pub(crate) dtype_bytes: u32,
}

/// The registered cache of `layers` (validated: equal sizes, whole blocks,
/// block size as the engine's, heads dividing a block).
pub(crate) fn registered_cache(
    kind: LayoutKind,
    engine_block_size: u32,
    layers: &[(String, Vec<TensorDesc>)],
    heads: BlockHeads,
) -> Result<RegisteredCache> {
    let layers: Vec<LayerCache> = layers
        .iter()
        .map(|(name, tensors)| LayerCache {
            name: name.clone(),
            tensors: tensors
                .iter()
                .map(|t| LayerTensor {
                    addr: t.addr,
                    len: t.len,
                    num_blocks: t.num_blocks,
                    kernel_block_size: t.block_size,
                })
                .collect(),
        })
        .collect();
    let cache = RegisteredCache::new(kind, engine_block_size, &layers)
        .and_then(|cache| cache.with_dtype_bytes(heads.dtype_bytes).with_heads(heads.heads, heads.order))
        .map_err(kv_worker::WorkerError::from)?;
    Ok(cache)
}

/// How a worker reaches the engine's KV.
enum Inner {
    /// The registered cache is the engine's own (host) memory.
    Direct(Worker),
    /// The registered cache is host staging; the engine copies between its
    /// blocks and the slots as the [`StagedWorker`] orders.
    Staged(Box<StagedWorker>),
}

/// A running kv-worker over engine memory, or over host staging in front
/// of it.
pub(crate) struct Engine {
    inner: Inner,
    runtime: &'static ProcessRuntime,
}

impl Engine {
    /// Opens the configured transport and starts the worker. Blocks until
    /// the listeners are bound. With `staging_wait`, `cache` is host staging
    /// memory (its blocks are the slots) and a request waits at most that
    /// long for free slots.
    ///
    /// # Safety
    ///
    /// Every region of `cache` must stay valid for reads and writes until
    /// [`Engine::shutdown`] has returned `Ok` (dropping an `Engine` without
    /// it does not end the transport's access), and the engine must not read
    /// a block before it is reported received nor write one being sent.
    pub(crate) unsafe fn start(
        runtime: &'static ProcessRuntime,
        config: WorkerConfig,
        cache: RegisteredCache,
        staging_wait: Option<Duration>,
    ) -> Result<Self> {
        let worker = runtime.get().block_on(async move {
            let writer = kv_worker::transport::open(&config).await?;
            // SAFETY: forwarded from this function's contract: the regions
            // stay valid until `shutdown` returns, which waits for the writer
            // to be shut down.
            unsafe { Worker::start_with_writer(config, cache, writer).await }
        })?;
        let inner = match staging_wait {
            None => Inner::Direct(worker),
            Some(wait) => Inner::Staged(Box::new(StagedWorker::new(worker, wait))),
        };
        Ok(Self { inner, runtime })
    }

    fn worker(&self) -> &Worker {
        match &self.inner {
            Inner::Direct(worker) => worker,
            Inner::Staged(staged) => staged.worker(),
        }
    }

    /// Applies one step's metadata (returns at once, once this step's
    /// cancelled pulls are fenced on the wire); the copies it orders.
    pub(crate) fn start_load_kv(&self, meta: &ConnectorMetadata) -> CopyWork {
        match &self.inner {
            Inner::Direct(worker) => {
                worker.start_load_kv(meta);
                CopyWork::default()
            }
            Inner::Staged(staged) => staged.start_load_kv(meta),
        }
    }

    /// The engine finished these copies; the copies that became due.
    pub(crate) fn copies_done(&self, ids: Vec<u64>) -> CopyWork {
        match &self.inner {
            Inner::Direct(_) => CopyWork::default(),
            Inner::Staged(staged) => staged.copies_done(ids),
        }
    }

    /// These copies failed; the copies that became due.
    pub(crate) fn copies_failed(&self, ids: Vec<u64>) -> CopyWork {
        match &self.inner {
            Inner::Direct(_) => CopyWork::default(),
            Inner::Staged(staged) => staged.copies_failed(ids),
        }
    }

    /// What finished since the last call (the engine's block ids), and the
    /// copies that became due.
    pub(crate) fn get_finished(&self) -> (Finished, CopyWork) {
        match &self.inner {
            Inner::Direct(worker) => (worker.get_finished(), CopyWork::default()),
            Inner::Staged(staged) => staged.get_finished(),
        }
    }

    /// `(requests in staging, free slots, slots)`, or `None` without staging.
    pub(crate) fn staging_state(&self) -> Option<(usize, usize, u64)> {
        match &self.inner {
            Inner::Direct(_) => None,
            Inner::Staged(staged) => {
                let (requests, free) = staged.staging_state();
                Some((requests, free, staged.worker().cache().num_blocks()))
            }
        }
    }

    /// What the worker signals when something becomes available to
    /// `get_finished` (see [`kv_worker::Changes`]).
    pub(crate) fn changes(&self) -> std::sync::Arc<kv_worker::Changes> {
        self.worker().changes()
    }

    /// Port of this worker's side-channel listener (producers only).
    pub(crate) fn side_channel_port(&self) -> Option<u16> {
        self.worker().side_channel_addr().map(|a| a.port())
    }

    /// The data-plane endpoint, as text.
    pub(crate) fn data_endpoint(&self) -> String {
        self.worker().data_endpoint().to_string()
    }

    /// Everything the worker counts, now.
    pub(crate) fn metrics(&self) -> kv_worker::metrics::MetricsSnapshot {
        self.worker().metrics()
    }

    /// Transfer requests admitted on this (prefill) worker and not answered yet.
    pub(crate) fn transfers_in_progress(&self) -> usize {
        self.worker().transfers_in_progress()
    }

    /// Stops every task and the transport; `Ok` once no access to the
    /// registered memory can happen any more, `Err(())` if that did not
    /// finish within `timeout` (the memory must then be kept alive for good).
    pub(crate) fn shutdown(self, timeout: Duration) -> std::result::Result<(), ()> {
        let Self { inner, runtime } = self;
        runtime
            .get()
            .block_on(async move {
                tokio::time::timeout(timeout, async move {
                    match inner {
                        Inner::Direct(worker) => worker.shutdown().await,
                        Inner::Staged(staged) => (*staged).shutdown().await,
                    }
                })
                .await
            })
            .map_err(|_| ())
    }
}
