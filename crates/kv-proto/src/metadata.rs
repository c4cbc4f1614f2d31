//! `ConnectorMetadata`: what the scheduler tells its worker each step.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::ids::{BlockId, EngineId, ReqId};
use crate::renewal_key::RenewalKey;

/// A request whose KV this (decode) instance must pull from a prefill instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecvReqMeta {
    /// Local blocks the KV lands in. Empty on a full prefix-cache hit or an
    /// abort before scheduling: P is still told, so it frees its blocks.
    pub local_block_ids: Vec<BlockId>,
    /// The prompt token the first of those blocks starts at (the tokens
    /// D's prefix cache already held); `None` when the engine did not say
    /// (P then takes D's blocks to be its last ones).
    #[serde(default)]
    pub first_token: Option<u64>,
    /// Where the request is pulled from, and what P calls it.
    pub remote: RemotePrefill,
}

/// The prefill instance a decode instance pulls a request from, and P's
/// names for it. The map key beside it is D's own request id (what D
/// reports to its engine); everything D sends to P names
/// [`RemotePrefill::remote_request_id`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemotePrefill {
    /// P's side-channel host.
    pub remote_host: String,
    /// P's side-channel base port (each worker adds its tensor-parallel rank).
    pub remote_port: u16,
    /// P's id of the request.
    pub remote_request_id: ReqId,
    /// P's engine id, when P named it: P refuses a pull naming another.
    pub remote_engine_id: Option<EngineId>,
    /// The request's renewal key, when P gave one: D's renewals name it.
    /// Without it D cannot renew the request, and P holds it for its whole
    /// lease.
    #[serde(default)]
    pub remote_renewal_key: Option<RenewalKey>,
    /// In the bootstrap flow, where D learns P's side channel: until the
    /// worker has asked P's bootstrap server, `remote_host` and
    /// `remote_port` are not known (empty and 0), and the worker fills them
    /// in before the request reaches its pull or watch.
    #[serde(default)]
    pub bootstrap: Option<BootstrapTarget>,
}

/// A prefill engine as the bootstrap flow names it: its bootstrap server
/// and its engine id there (one server lists every data-parallel engine
/// of an instance).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BootstrapTarget {
    /// The bootstrap server's base URL (`http://host:port`), as the router
    /// sent it.
    pub url: String,
    /// The prefill engine's id, as the bootstrap server lists it.
    pub engine_id: EngineId,
}

/// What the worker must do with its send entry for a request (prefill side).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SendUpdate {
    /// The request was scheduled with `do_remote_decode`: expect it. D may ask
    /// for it before it is ready; the worker holds D's pull until it is.
    Expect,
    /// The request finished by length cap and its blocks are held for D until
    /// it pulls them or the lease expires.
    Ready {
        /// Blocks holding the request's KV, in prompt order.
        block_ids: Vec<BlockId>,
    },
    /// The request finished without delay-free (aborted, stopped early, or
    /// nothing to send): drop the entry; any pull for it gets an error.
    Forget,
}

/// The scheduler-to-worker message of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorMetadata {
    /// Pulls the worker starts this step (decode side).
    pub reqs_to_recv: BTreeMap<ReqId, RecvReqMeta>,
    /// Send-entry updates the worker applies this step (prefill side).
    pub reqs_to_send: BTreeMap<ReqId, SendUpdate>,
    /// Pulls the engine gave up on while they were in flight (decode side:
    /// the request was aborted and its blocks are freed). Before the worker
    /// returns from this step, no byte of them can land any more; they are
    /// never reported.
    #[serde(default)]
    pub reqs_to_cancel: BTreeSet<ReqId>,
    /// Requests the engine has seen and will pull (decode side): until they
    /// leave this set the worker renews P's hold on them, so P can free the
    /// blocks of a request no live decode instance still wants within a
    /// short lease.
    #[serde(default)]
    pub reqs_to_watch: BTreeMap<ReqId, RemotePrefill>,
    /// Requests no longer to renew: their pull went out (it holds them on P
    /// from now on), or they finished.
    #[serde(default)]
    pub reqs_to_unwatch: BTreeSet<ReqId>,
    /// The renewal keys of requests this step's send updates name (prefill
    /// side): the worker counts a renewal of one only when it names its key.
    #[serde(default)]
    pub renewal_keys: BTreeMap<ReqId, RenewalKey>,
    /// The engine's own id of each request whose send entry is named
    /// otherwise (prefill side, bootstrap flow: entries are named by the
    /// router's transfer id, which D names them by): the worker reports
    /// such a request finished under the engine's id.
    #[serde(default)]
    pub send_names: BTreeMap<ReqId, ReqId>,
}

impl ConnectorMetadata {
    /// Whether the step carries nothing for the worker.
    pub fn is_empty(&self) -> bool {
        self.reqs_to_recv.is_empty()
            && self.reqs_to_send.is_empty()
            && self.reqs_to_cancel.is_empty()
            && self.reqs_to_watch.is_empty()
            && self.reqs_to_unwatch.is_empty()
            && self.renewal_keys.is_empty()
            && self.send_names.is_empty()
    }
}
