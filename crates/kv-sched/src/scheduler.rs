//! The port of `MooncakeConnectorScheduler`.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;

use kv_proto::{
    BlockId, BootstrapTarget, ConnectorMetadata, EngineId, KvRole, KvTransferParams, RecvReqMeta, RemotePrefill,
    RenewalKey, RenewalSecret, ReqId, SendUpdate,
};
use tracing::{debug, warn};

use crate::error::SchedError;
use crate::request::{EngineRequest, RequestStatus};

/// Scheduler-side state of the connector of one engine instance.
///
/// Between two calls of [`build_connector_meta`](Self::build_connector_meta)
/// it collects the pulls to start (decode side) and the send-entry updates
/// (prefill side); each build hands them to the worker and starts afresh. A
/// later update for the same request within one step replaces the earlier one
/// (e.g. [`SendUpdate::Expect`] then [`SendUpdate::Ready`] in one step is
/// emitted as `Ready`).
#[derive(Debug)]
pub struct ConnectorScheduler {
    role: KvRole,
    engine_id: EngineId,
    side_channel_host: String,
    side_channel_port: u16,
    /// Pulls recorded since the last build (reference: `_reqs_need_recv`).
    reqs_need_recv: BTreeMap<ReqId, RecvReqMeta>,
    /// Send-entry updates recorded since the last build (reference:
    /// `_reqs_need_send`).
    reqs_need_send: BTreeMap<ReqId, SendUpdate>,
    /// Requests for which an [`SendUpdate::Expect`] was recorded (pending or
    /// already emitted) and no `Ready`/`Forget` yet: the worker holds (or is
    /// about to hold) an entry only this scheduler can withdraw.
    live_sends: BTreeSet<ReqId>,
    /// Requests whose pull into blocks went to the worker and that have not
    /// finished: if one finishes (aborted) before its pull is reported, the
    /// worker must cancel the pull before the engine reuses the blocks.
    live_recvs: BTreeSet<ReqId>,
    /// Pulls to cancel at the next build.
    reqs_need_cancel: BTreeSet<ReqId>,
    /// Requests seen with a remote prefill to pull and not yet pulled or
    /// finished: the worker renews P's hold on them.
    watching: BTreeSet<ReqId>,
    /// Watches recorded since the last build.
    reqs_need_watch: BTreeMap<ReqId, RemotePrefill>,
    /// Watches (already built) to end at the next build.
    reqs_need_unwatch: BTreeSet<ReqId>,
    /// Whether params without P's request id were seen (warned once).
    warned_no_remote_request_id: bool,
    /// Whether params naming P's request id but no renewal key were seen
    /// (warned once).
    warned_no_renewal_key: bool,
    /// What this (prefill) instance's renewal keys are minted from.
    renewal_secret: RenewalSecret,
    /// Prefill side, bootstrap flow: the name each request's send entry has
    /// on the workers (its transfer id), by the engine's id; from the
    /// request's allocation until the engine reports it sent (or it ends
    /// without a send entry).
    send_names: BTreeMap<ReqId, ReqId>,
    /// The same names the other way round: a transfer id already naming a
    /// live request cannot name another (its pull could not tell them
    /// apart).
    names_in_use: BTreeMap<ReqId, ReqId>,
    /// Prefill side: requests whose transfer id already named another live
    /// request; they finish without a hold. Until they finish.
    unpaired: BTreeSet<ReqId>,
    /// Whether a request reusing a live transfer id was seen (warned once).
    warned_transfer_id_in_use: bool,
    /// Tokens per engine block, where known ([`with_block_tokens`](Self::with_block_tokens)):
    /// block lists are then cut to the blocks that hold prompt tokens.
    block_tokens: Option<NonZeroUsize>,
}

impl ConnectorScheduler {
    /// A scheduler for engine `engine_id` of `role` whose side channel
    /// listens on `side_channel_host:side_channel_port` (the base port; each
    /// worker adds its tensor-parallel rank). The engine id, host and port
    /// are what a finished prefill tells the proxy to forward to the decode
    /// instance, with the request's id on this engine and its renewal key,
    /// minted from `renewal_secret` (fresh per engine,
    /// [`RenewalSecret::fresh`]; a decode instance mints none).
    pub fn new(
        role: KvRole,
        engine_id: EngineId,
        side_channel_host: impl Into<String>,
        side_channel_port: u16,
        renewal_secret: RenewalSecret,
    ) -> Self {
        Self {
            role,
            engine_id,
            side_channel_host: side_channel_host.into(),
            side_channel_port,
            reqs_need_recv: BTreeMap::new(),
            reqs_need_send: BTreeMap::new(),
            live_sends: BTreeSet::new(),
            live_recvs: BTreeSet::new(),
            reqs_need_cancel: BTreeSet::new(),
            watching: BTreeSet::new(),
            reqs_need_watch: BTreeMap::new(),
            reqs_need_unwatch: BTreeSet::new(),
            warned_no_remote_request_id: false,
            warned_no_renewal_key: false,
            renewal_secret,
            send_names: BTreeMap::new(),
            names_in_use: BTreeMap::new(),
            unpaired: BTreeSet::new(),
            warned_transfer_id_in_use: false,
            block_tokens: None,
        }
    }

    /// Tells the scheduler the engine's block size, so that the block lists
    /// it is handed are cut to the blocks holding prompt tokens. An engine
    /// may hand over more: vLLM 0.20 to 0.24 give a request finished on P
    /// every block it holds, lookahead blocks of speculative decoding
    /// included, and D's async-load blocks may hold one too. P's KV is sent
    /// as its *last* blocks into D's, so an extra trailing block on P would
    /// shift every byte by a block; one on D would ask P for more than it has.
    #[must_use]
    pub fn with_block_tokens(mut self, block_tokens: NonZeroUsize) -> Self {
        self.block_tokens = Some(block_tokens);
        self
    }

    /// How many of `blocks` hold prompt tokens `first_token..prompt_len`
    /// (all of them where the block size is unknown).
    fn prompt_blocks(&self, blocks: usize, prompt_len: usize, first_token: usize) -> usize {
        self.block_tokens.map_or(blocks, |tokens| {
            let tokens = tokens.get();
            let held = prompt_len.div_ceil(tokens).saturating_sub(first_token / tokens);
            blocks.min(held)
        })
    }

    /// This instance's role.
    pub fn role(&self) -> KvRole {
        self.role
    }

    /// Number of requests whose send entry was announced to the worker
    /// ([`SendUpdate::Expect`]) and not yet resolved by `Ready` or `Forget`.
    /// It drops back to zero once every such request has finished: nothing is
    /// kept without an owner.
    pub fn live_send_entries(&self) -> usize {
        self.live_sends.len()
    }

    /// Requests the worker renews P's hold on (seen, not yet pulled or
    /// finished). Back to zero once every such request is pulled or
    /// finished.
    pub fn live_watches(&self) -> usize {
        self.watching.len()
    }

    /// How many prompt tokens of `req` will be loaded from the remote
    /// prefill instance beyond the `num_computed_tokens` already computed
    /// locally (prefix cache), and whether they load asynchronously (between
    /// scheduler steps).
    ///
    /// For a request with `do_remote_prefill` and a side channel to pull
    /// from (`remote_host` and `remote_port`), all uncomputed prompt tokens
    /// are pulled: `(prompt_len - num_computed_tokens, true)` when that is
    /// positive. Otherwise `(0, false)`.
    ///
    /// Unlike the reference, params with `do_remote_prefill` but no side
    /// channel count no external tokens: no pull can be recorded for them
    /// (see [`update_state_after_alloc`](Self::update_state_after_alloc)), so
    /// an engine that waited for their KV would wait forever. The engine
    /// computes such a request locally instead.
    ///
    /// On a decode instance, the first call for a request that will pull
    /// starts watching it (`reqs_to_watch`): from then until its pull goes
    /// out or it finishes, the worker renews P's hold on it. (The reference
    /// holds P's blocks for the whole abort timeout whether or not a decode
    /// instance still wants them.)
    pub fn get_num_new_matched_tokens(&mut self, req: &EngineRequest, num_computed_tokens: usize) -> (usize, bool) {
        debug!(
            request_id = %req.request_id,
            num_computed_tokens,
            params = ?req.kv_transfer_params,
            "get_num_new_matched_tokens"
        );
        if let Some(params) = req.kv_transfer_params.as_ref().filter(|p| p.do_remote_prefill) {
            if self.role == KvRole::Producer {
                // update_state_after_alloc refuses it; nothing will load.
                debug!(request_id = %req.request_id, "do_remote_prefill on a prefill-only instance: no external tokens");
                return (0, false);
            }
            let Some(source) = PrefillSource::of(params) else {
                // update_state_after_alloc warns once it sees the request.
                debug!(
                    request_id = %req.request_id,
                    "do_remote_prefill naming neither a side channel nor a bootstrap server: no external tokens"
                );
                return (0, false);
            };
            if !self.watching.contains(&req.request_id) {
                debug!(request_id = %req.request_id, ?source, "watching");
                let remote = self.remote_prefill(&req.request_id, params, source);
                self.watching.insert(req.request_id.clone());
                self.reqs_need_watch.insert(req.request_id.clone(), remote);
            }
            let count = req.prompt_len.saturating_sub(num_computed_tokens);
            if count > 0 {
                return (count, true);
            }
        }
        (0, false)
    }

    /// Records what the worker must do for `req` now that the engine has
    /// allocated its blocks.
    ///
    /// `unhashed_block_ids` are the blocks the engine just allocated that hold
    /// no prefix-cached KV (vLLM's `blocks.get_unhashed_block_ids()`);
    /// `num_external_tokens` is what [`get_num_new_matched_tokens`](Self::get_num_new_matched_tokens)
    /// returned.
    ///
    /// - No params: nothing.
    /// - `do_remote_prefill` (decode side): records a pull into
    ///   `unhashed_block_ids`, or into no block at all when
    ///   `num_external_tokens` is 0 (full prefix-cache hit: P must still be
    ///   told so it frees its blocks). Params without `remote_host` or
    ///   `remote_port` are logged and the request is computed locally. Either
    ///   way `do_remote_prefill` is cleared: a request triggers at most one
    ///   transfer.
    /// - otherwise `do_remote_decode` (prefill side): announces the request to
    ///   the worker ([`SendUpdate::Expect`]) so D may ask for it early.
    ///
    /// # Errors
    ///
    /// [`SchedError::RemotePrefillOnProducer`] for `do_remote_prefill` on a
    /// [`KvRole::Producer`], [`SchedError::RemoteDecodeOnConsumer`] for
    /// `do_remote_decode` on a [`KvRole::Consumer`] (the reference records the
    /// latter, but a consumer's metadata never carries sends, so the entry
    /// could never reach a worker). Nothing is changed on error.
    pub fn update_state_after_alloc(
        &mut self,
        req: &mut EngineRequest,
        unhashed_block_ids: &[BlockId],
        num_external_tokens: usize,
    ) -> Result<(), SchedError> {
        let request_id = &req.request_id;
        debug!(
            %request_id,
            num_external_tokens,
            params = ?req.kv_transfer_params,
            "update_state_after_alloc"
        );
        let Some(params) = req.kv_transfer_params.as_mut() else {
            return Ok(());
        };

        if params.do_remote_prefill {
            if self.role == KvRole::Producer {
                return Err(SchedError::RemotePrefillOnProducer { role: self.role, request_id: request_id.clone() });
            }
            // What the prefix cache held: the pulled blocks start there (P
            // maps tokens, not block ids, when its blocks hold another
            // number of tokens).
            let computed = req.prompt_len.saturating_sub(num_external_tokens);
            let local_block_ids = if num_external_tokens > 0 {
                let keep = self.prompt_blocks(unhashed_block_ids.len(), req.prompt_len, computed);
                if keep < unhashed_block_ids.len() {
                    debug!(%request_id, allocated = unhashed_block_ids.len(), keep, "pulling into the prompt's blocks only");
                }
                unhashed_block_ids[..keep].to_vec()
            } else {
                Vec::new()
            };
            let first_token = (num_external_tokens > 0).then_some(computed as u64);
            self.record_recv(request_id, params, local_block_ids, first_token);
            // Only one KV transfer per request.
            params.do_remote_prefill = false;
        } else if params.do_remote_decode {
            if self.role == KvRole::Consumer {
                return Err(SchedError::RemoteDecodeOnConsumer { role: self.role, request_id: request_id.clone() });
            }
            let name = params.send_name(request_id);
            if name != *request_id {
                if self.names_in_use.get(&name).is_some_and(|holder| holder != request_id) {
                    // Served as a plain request: no entry, no hold.
                    self.unpaired.insert(request_id.clone());
                    self.warn_transfer_id_in_use(request_id);
                    return Ok(());
                }
                self.names_in_use.insert(name.clone(), request_id.clone());
                self.send_names.insert(request_id.clone(), name);
            }
            debug!(%request_id, "announcing send entry");
            self.live_sends.insert(request_id.clone());
            self.reqs_need_send.insert(request_id.clone(), SendUpdate::Expect);
        }
        Ok(())
    }

    /// The metadata of this step: the pulls (unless this instance is a
    /// [`KvRole::Producer`]) and the send-entry updates (unless it is a
    /// [`KvRole::Consumer`]) recorded since the previous call. Both pending
    /// sets are cleared.
    pub fn build_connector_meta(&mut self) -> ConnectorMetadata {
        let recvs = std::mem::take(&mut self.reqs_need_recv);
        let sends = std::mem::take(&mut self.reqs_need_send);
        let cancels = std::mem::take(&mut self.reqs_need_cancel);
        let watches = std::mem::take(&mut self.reqs_need_watch);
        let unwatches = std::mem::take(&mut self.reqs_need_unwatch);
        if self.role.receives() {
            self.live_recvs.extend(recvs.iter().filter(|(_, m)| !m.local_block_ids.is_empty()).map(|(r, _)| r.clone()));
        }
        // Derived, not stored: the worker learns a request's key with the
        // update that makes it ready, the same key its params carry (or, in
        // the bootstrap flow, the one D derives from the transfer id).
        let mut renewal_keys = BTreeMap::new();
        let mut send_names = BTreeMap::new();
        let mut named_sends = BTreeMap::new();
        if self.role.sends() {
            for (req, update) in sends {
                let name = self.send_names.get(&req).cloned();
                // A transfer's key is known from the start (D derives it
                // too, and may renew before P's engine finishes it).
                let key = match (&name, &update) {
                    (Some(transfer), SendUpdate::Expect | SendUpdate::Ready { .. }) => {
                        Some(RenewalKey::for_transfer(transfer.as_str()))
                    }
                    (None, SendUpdate::Ready { .. }) => Some(self.renewal_secret.key_for(&req)),
                    _ => None,
                };
                if let Some(key) = key {
                    renewal_keys.insert(name.clone().unwrap_or_else(|| req.clone()), key);
                }
                match name {
                    Some(name) => {
                        if matches!(update, SendUpdate::Forget) {
                            // No entry is left to report sent.
                            self.release_name(&req);
                        }
                        send_names.insert(name.clone(), req);
                        named_sends.insert(name, update);
                    }
                    None => {
                        named_sends.insert(req, update);
                    }
                }
            }
        }
        let meta = ConnectorMetadata {
            renewal_keys,
            send_names,
            reqs_to_recv: if self.role.receives() { recvs } else { BTreeMap::new() },
            reqs_to_send: named_sends,
            reqs_to_cancel: if self.role.receives() { cancels } else { BTreeSet::new() },
            reqs_to_watch: if self.role.receives() { watches } else { BTreeMap::new() },
            reqs_to_unwatch: if self.role.receives() { unwatches } else { BTreeSet::new() },
        };
        if !meta.is_empty() {
            debug!(
                recv = ?meta.reqs_to_recv.keys().collect::<Vec<_>>(),
                send = ?meta.reqs_to_send.keys().collect::<Vec<_>>(),
                cancel = ?meta.reqs_to_cancel,
                watch = ?meta.reqs_to_watch.keys().collect::<Vec<_>>(),
                unwatch = ?meta.reqs_to_unwatch,
                "build_connector_meta"
            );
        }
        meta
    }

    /// Decides, once `req` has finished, whether its blocks (`block_ids`)
    /// are freed now or held until the decode instance has pulled them.
    ///
    /// Returns `(delay_free_blocks, params to return to the proxy)`:
    ///
    /// Decode side, first: a request whose pull is still recorded but not yet
    /// built goes out with no block (P only frees); one whose pull went to
    /// the worker and was not reported finished ([`Self::pull_finished`]) is
    /// cancelled (`reqs_to_cancel` of the next metadata): the engine frees
    /// its blocks at once, and the worker fences the pull before that step
    /// returns. (The reference lets a late write land in reused blocks.)
    ///
    /// - No params: `(false, None)`.
    /// - `do_remote_prefill` still set (decode side; the request was aborted
    ///   before it was ever scheduled): records a pull of no block so P is
    ///   told to free its blocks (logged and skipped if the params lack
    ///   `remote_host`/`remote_port`), clears `do_remote_prefill`,
    ///   `(false, None)`.
    /// - Not `do_remote_decode`, or not [`RequestStatus::FinishedLengthCapped`]
    ///   (stopped early, aborted, ignored): `(false, None)`; if a send entry
    ///   was announced for the request it is withdrawn with
    ///   [`SendUpdate::Forget`] (the reference leaks it).
    /// - `do_remote_decode` and length capped (the normal end of a prefill):
    ///   with blocks, records [`SendUpdate::Ready`] and delays their free;
    ///   without, records [`SendUpdate::Forget`]. Returns the params that
    ///   point D at this instance: `do_remote_prefill`, this side channel's
    ///   host and port.
    ///
    /// # Errors
    ///
    /// [`SchedError::RemotePrefillOnProducer`] when `do_remote_prefill` is
    /// still set on a [`KvRole::Producer`];
    /// [`SchedError::RemoteDecodeOnConsumer`] for a length-capped
    /// `do_remote_decode` request on a [`KvRole::Consumer`]. On error
    /// nothing is changed but the cancellation of the request's pull, if one
    /// is out (the engine frees the request's blocks either way).
    pub fn request_finished(
        &mut self,
        req: &mut EngineRequest,
        block_ids: &[BlockId],
    ) -> Result<(bool, Option<KvTransferParams>), SchedError> {
        let request_id = &req.request_id;
        debug!(
            %request_id,
            status = ?req.status,
            params = ?req.kv_transfer_params,
            num_blocks = block_ids.len(),
            "request_finished"
        );
        self.cancel_if_pulling(request_id);
        self.unwatch(request_id);
        if self.unpaired.remove(request_id) {
            return Ok((false, None));
        }
        let Some(params) = req.kv_transfer_params.as_mut() else {
            self.forget_if_live(request_id);
            return Ok((false, None));
        };

        if params.do_remote_prefill {
            // update_state_after_alloc never ran for this request: it was
            // aborted before it was scheduled. Tell P (with no block) so it
            // does not strand the prefill blocks.
            if self.role == KvRole::Producer {
                return Err(SchedError::RemotePrefillOnProducer { role: self.role, request_id: request_id.clone() });
            }
            self.record_recv(request_id, params, Vec::new(), None);
            params.do_remote_prefill = false;
            self.forget_if_live(request_id);
            return Ok((false, None));
        }

        if !params.do_remote_decode || req.status != RequestStatus::FinishedLengthCapped {
            self.forget_if_live(request_id);
            return Ok((false, None));
        }

        if self.role == KvRole::Consumer {
            return Err(SchedError::RemoteDecodeOnConsumer { role: self.role, request_id: request_id.clone() });
        }

        self.live_sends.remove(request_id);
        let prompt_blocks = &block_ids[..self.prompt_blocks(block_ids.len(), req.prompt_len, 0)];
        if prompt_blocks.len() < block_ids.len() {
            debug!(%request_id, held = block_ids.len(), prompt_blocks = prompt_blocks.len(), "sending the prompt's blocks only");
        }
        let delay_free_blocks = !prompt_blocks.is_empty();
        let update = if delay_free_blocks {
            SendUpdate::Ready { block_ids: prompt_blocks.to_vec() }
        } else {
            SendUpdate::Forget
        };
        debug!(%request_id, delay_free_blocks, ?update, "prefill finished for remote decode");
        self.reqs_need_send.insert(request_id.clone(), update);

        if self.send_names.contains_key(request_id) {
            // The bootstrap flow: D was sent everything it needs by the
            // router, and P returns nothing (as vLLM's connector).
            return Ok((delay_free_blocks, None));
        }
        Ok((
            delay_free_blocks,
            Some(KvTransferParams {
                do_remote_prefill: true,
                do_remote_decode: false,
                remote_host: Some(self.side_channel_host.clone()),
                remote_port: Some(self.side_channel_port),
                remote_request_id: Some(request_id.clone()),
                remote_engine_id: Some(self.engine_id.clone()),
                remote_renewal_key: delay_free_blocks.then(|| self.renewal_secret.key_for(request_id)),
                transfer_id: None,
                remote_bootstrap_addr: None,
            }),
        ))
    }

    /// The engine reports `request_ids` sent (vLLM's `finished_sending`,
    /// by the engine's ids): the transfer ids naming them are free again.
    pub fn sending_finished<'a>(&mut self, request_ids: impl IntoIterator<Item = &'a ReqId>) {
        for request_id in request_ids {
            self.release_name(request_id);
        }
    }

    /// Requests whose send entry is named by a transfer id and not yet
    /// reported sent (back to zero once each is).
    pub fn live_transfer_names(&self) -> usize {
        self.send_names.len()
    }

    fn release_name(&mut self, request_id: &ReqId) {
        if let Some(name) = self.send_names.remove(request_id) {
            self.names_in_use.remove(&name);
        }
    }

    fn warn_transfer_id_in_use(&mut self, request_id: &ReqId) {
        if self.warned_transfer_id_in_use {
            debug!(%request_id, "transfer_id already names a live request: served without KV transfer");
            return;
        }
        self.warned_transfer_id_in_use = true;
        warn!(
            %request_id,
            "kv_transfer_params carry a transfer_id that already names another live request on this instance: this \
             request is served without KV transfer (a decode instance pulling by that id gets the other request's \
             KV or none); a router must mint a fresh transfer_id per request. Warned once."
        );
    }

    /// Records a pull of `local_block_ids` from the side channel named in
    /// `params`, or logs and skips it if the params name none.
    fn record_recv(
        &mut self,
        request_id: &ReqId,
        params: &KvTransferParams,
        local_block_ids: Vec<BlockId>,
        first_token: Option<u64>,
    ) {
        // The pull holds the request on P from now on.
        self.unwatch(request_id);
        match PrefillSource::of(params) {
            Some(source) => {
                debug!(%request_id, ?source, num_blocks = local_block_ids.len(), "recording pull");
                let remote = self.remote_prefill(request_id, params, source);
                self.reqs_need_recv.insert(request_id.clone(), RecvReqMeta { local_block_ids, first_token, remote });
            }
            None => warn!(
                %request_id,
                ?params,
                "invalid kv_transfer_params: do_remote_prefill without remote_host and remote_port, or without \
                 transfer_id, remote_bootstrap_addr and remote_engine_id; this request will not use KV transfer"
            ),
        }
    }

    /// Where `request_id` (D's id) is pulled from and what P calls it:
    /// P's `remote_request_id`, or D's own id (with one warning per
    /// scheduler) when the params carry none, as an older proxy's do; and
    /// the request's renewal key (one warning per scheduler when P named
    /// its id but the params carry no key: this instance cannot renew P's
    /// hold on it).
    fn remote_prefill(
        &mut self,
        request_id: &ReqId,
        params: &KvTransferParams,
        source: PrefillSource,
    ) -> RemotePrefill {
        let (host, port) = match source {
            PrefillSource::SideChannel { host, port } => (host, port),
            PrefillSource::Bootstrap { target, transfer_id } => {
                // Named by the transfer id, renewed under the key both
                // sides derive from it; the worker learns P's side channel.
                return RemotePrefill {
                    remote_host: String::new(),
                    remote_port: 0,
                    remote_request_id: ReqId::new(transfer_id.clone()),
                    remote_engine_id: Some(target.engine_id.clone()),
                    remote_renewal_key: Some(RenewalKey::for_transfer(&transfer_id)),
                    bootstrap: Some(target),
                };
            }
        };
        if params.remote_request_id.is_none() && !self.warned_no_remote_request_id {
            self.warned_no_remote_request_id = true;
            warn!(
                %request_id,
                "kv_transfer_params carry no remote_request_id (the prefill's own id of the request): pulling by this \
                 instance's id, which a prefill engine that names requests differently (vLLM's does) does not know; \
                 pass the kv_transfer_params the prefill returned to the decode instance unchanged. Warned once."
            );
        }
        if params.remote_request_id.is_some() && params.remote_renewal_key.is_none() && !self.warned_no_renewal_key {
            self.warned_no_renewal_key = true;
            warn!(
                %request_id,
                "kv_transfer_params name the prefill's request but carry no remote_renewal_key: this instance cannot \
                 renew the prefill's hold on its requests, so a request it never pulls stays held there for the \
                 prefill's whole abort timeout; a proxy that keeps only the fields it knows drops the key: pass the \
                 kv_transfer_params the prefill returned to the decode instance unchanged. Warned once."
            );
        }
        RemotePrefill {
            remote_host: host.to_owned(),
            remote_port: port,
            remote_request_id: params.prefill_request_id(request_id),
            remote_engine_id: params.remote_engine_id.clone(),
            remote_renewal_key: params.remote_renewal_key,
            bootstrap: None,
        }
    }

    /// The worker reported `request_id`'s pull received or failed: a later
    /// finish of the request needs no cancellation. (Calling this is
    /// optional; without it a finished request costs one cancellation the
    /// worker ignores.)
    pub fn pull_finished(&mut self, request_id: &ReqId) {
        self.live_recvs.remove(request_id);
    }

    /// Requests whose pull is with the worker and not known to be finished.
    pub fn live_pulls(&self) -> usize {
        self.live_recvs.len()
    }

    /// A request finishing while its pull may still be in flight: if the
    /// pull is not built yet it goes out with no block (P still frees);
    /// if it is with the worker, the worker cancels it.
    fn cancel_if_pulling(&mut self, request_id: &ReqId) {
        if let Some(pending) = self.reqs_need_recv.get_mut(request_id) {
            debug!(%request_id, "request finished before its pull went out: P is only told to free");
            pending.local_block_ids.clear();
            pending.first_token = None;
        }
        if self.live_recvs.remove(request_id) {
            debug!(%request_id, "request finished while its pull may be in flight: cancelling it");
            self.reqs_need_cancel.insert(request_id.clone());
        }
    }

    /// Ends the watch on `request_id`, if any: withdrawn before the worker
    /// heard of it, or ended at the next build.
    fn unwatch(&mut self, request_id: &ReqId) {
        if self.watching.remove(request_id) && self.reqs_need_watch.remove(request_id).is_none() {
            self.reqs_need_unwatch.insert(request_id.clone());
        }
    }

    /// Withdraws the send entry announced for `request_id`, if any.
    fn forget_if_live(&mut self, request_id: &ReqId) {
        if self.live_sends.remove(request_id) {
            debug!(%request_id, "request finished without delay-free: forgetting its send entry");
            self.reqs_need_send.insert(request_id.clone(), SendUpdate::Forget);
        }
    }
}

/// Where a decode instance learns the prefill it pulls from, as its params
/// say: the bootstrap flow (all three of its fields) first, as vLLM's
/// Mooncake connector reads them, else the side channel P returned.
#[derive(Debug)]
enum PrefillSource {
    SideChannel { host: String, port: u16 },
    Bootstrap { target: BootstrapTarget, transfer_id: String },
}

impl PrefillSource {
    fn of(params: &KvTransferParams) -> Option<Self> {
        if let (Some(target), Some(transfer_id)) = (params.bootstrap(), params.transfer_id.clone()) {
            return Some(PrefillSource::Bootstrap { target, transfer_id });
        }
        let (host, port) = params.remote()?;
        Some(PrefillSource::SideChannel { host: host.to_owned(), port })
    }
}
