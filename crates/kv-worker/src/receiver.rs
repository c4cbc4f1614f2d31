//! The decode side's bookkeeping (sans-IO): pulls in flight grouped by
//! prefill side channel, their deadlines and grants, and each request's
//! outcome, reported only once the pull's grant is fenced.
//!
//! A request has two names here: D's own id, under which the engine handed
//! it over and hears its outcome, and P's id (`remote_request_id`), the only
//! one that goes to P and that P's reply names.
//!
//! Where P's instance is laid out otherwise (another tensor-parallel size,
//! block size or token layout), a request is pulled in parts, one per
//! prefill worker holding some of this worker's heads (see
//! [`kv_proto::topology::decode_parts`]). What P's instance looks like is
//! learned from the hello of its first worker, once per instance: requests
//! for an instance not known yet wait ([`ReceiverCore::take_discoveries`],
//! [`ReceiverCore::handle_discovered`]). A request is received only when
//! every part landed, and failed, once every part's grant is fenced, when
//! any part failed.
//!
//! When P is asked for pieces, it says after each batch how far each part
//! landed and each part's outcome as soon as it knows it
//! ([`ReceiverCore::handle_progress`]). A request's progress, as a staged
//! worker copies it on ([`ReceiverCore::take_progress`]), is that of its
//! slowest part: a block counts as landed only once every part has written
//! it, a request as done early only once every part said it is, and as
//! failed early as soon as one part did.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::{Duration, Instant};

use kv_proto::topology::{self, copies_whole_blocks};
use kv_proto::{
    BlockId, CacheLayout, EngineId, FailureCause, GrantId, HeadRange, Outcome, RankTopology, RecvReqMeta,
    RemotePrefill, ReqId, RequestBlocks, XferProgress, XferReply,
};

/// A prefill worker's side-channel address (its base port plus our tp rank).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SideChannelAddr {
    /// Host.
    pub host: String,
    /// Port.
    pub port: u16,
}

impl fmt::Display for SideChannelAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// One transfer request to send to one prefill worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullBatch {
    /// Id echoed by P's reply.
    pub xfer_id: u64,
    /// Where to send it.
    pub peer: SideChannelAddr,
    /// The requests and their local blocks.
    pub requests: Vec<RequestBlocks>,
    /// When D gives up on it.
    pub deadline: Instant,
    /// `None`: P copies whole blocks; else the heads P writes (see
    /// [`kv_proto::XferRequest::heads`]).
    pub heads: Option<HeadRange>,
}

/// What a decode worker knows of a prefill instance, from the hello of one
/// of its workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The prefill engine it belongs to (a restarted one has a new id).
    pub engine_id: EngineId,
    /// That worker's place in its instance.
    pub topology: RankTopology,
    /// That worker's cache layout.
    pub layout: CacheLayout,
}

/// How a receiver finds the prefill workers of a request.
#[derive(Clone, Debug)]
enum Pairing {
    /// Rank `r` pulls whole blocks from P's worker at base port plus `r`
    /// (both instances laid out alike, as kvlink assumed before it learned
    /// P's topology).
    Fixed(u16),
    /// Learns each prefill instance's topology from its first worker's
    /// hello, then pulls each part from the worker holding it.
    Discover { topology: RankTopology, layout: CacheLayout },
}

/// The prefill workers one request is pulled from, for one instance.
type Parts = Vec<(SideChannelAddr, Option<HeadRange>)>;

/// What is known of a prefill instance (by its base address).
#[derive(Debug)]
enum InstanceState {
    /// Its first worker is being asked; these requests wait for it.
    Discovering(Vec<Waiting>),
    /// Where each request's parts go, learned from `engine`.
    Known { parts: Parts, engine: EngineId },
}

/// A request waiting for its prefill instance to be known.
#[derive(Debug)]
struct Waiting {
    req: ReqId,
    meta: RecvReqMeta,
    started: Instant,
    /// Only to tell its prefill workers to let go of it
    /// ([`ReceiverCore::release`]): never reported.
    quiet: bool,
}

/// Where a pull stands.
#[derive(Debug)]
enum Stage {
    /// The transfer request is out (or about to be); no outcome yet.
    Pulling,
    /// Its outcome is known, but the grant may still let bytes land: not
    /// reported until [`ReceiverCore::handle_fenced`].
    Fencing(BatchOutcome),
}

#[derive(Debug)]
enum BatchOutcome {
    Replied(XferReply),
    Failed(FailureCause, String),
}

/// One request of a pull: D's id, P's id, D's blocks (of this part).
#[derive(Debug)]
struct Pulled {
    req: ReqId,
    remote: ReqId,
    blocks: Vec<BlockId>,
    /// Only tells P to let go of it ([`ReceiverCore::release`]): never
    /// reported, and its progress is not kept.
    quiet: bool,
}

/// A request being pulled: its parts still out, and how the first that
/// ended badly ended.
#[derive(Debug)]
struct InFlight {
    remote: ReqId,
    blocks: Vec<BlockId>,
    started: Instant,
    parts_left: usize,
    /// The part that decides the report: the first failed one, or else
    /// the last received.
    report: Option<PartEnd>,
    /// How far each part got, as P said (one per transfer request).
    parts: Vec<PartProgress>,
    /// The progress last handed out: blocks landed, and whether its end was.
    told: (u32, bool),
}

/// How far one part of a request got, as its prefill worker said.
#[derive(Debug)]
struct PartProgress {
    xfer_id: u64,
    /// D's blocks this part writes into (0: it writes none).
    blocks: u32,
    /// Its first `landed` blocks are written by this part.
    landed: u32,
    /// Its outcome, as P said before the reply (it wins over the reply),
    /// or as its fenced end decided.
    ended: Option<Outcome>,
    /// Whether `ended` came from P before the reply.
    early: bool,
}

/// How one part of a request ended.
#[derive(Debug)]
struct PartEnd {
    peer: SideChannelAddr,
    xfer_id: u64,
    grant: Option<GrantId>,
    failure: Option<(FailureCause, String)>,
}

#[derive(Debug)]
struct Batch {
    deadline: Instant,
    peer: SideChannelAddr,
    reqs: Vec<Pulled>,
    grant: Option<GrantId>,
    stage: Stage,
    /// A request of it was cancelled: its grant covers freed blocks.
    lost_requests: bool,
}

/// What finished on the decode side since the last poll.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecvFinished {
    /// Requests whose KV is entirely in local memory.
    pub received: BTreeSet<ReqId>,
    /// Requests whose pull failed, with the local blocks that hold no valid KV.
    pub failed: BTreeMap<ReqId, Vec<BlockId>>,
}

/// How one request's pull ended, for the driver's metrics and log (the
/// engine hears the outcome through [`ReceiverCore::poll_finished`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullReport {
    /// D's id.
    pub req: ReqId,
    /// P's id.
    pub remote: ReqId,
    /// The prefill worker pulled from (`None`: the pull never got one).
    pub peer: Option<SideChannelAddr>,
    /// The transfer request it was part of.
    pub xfer_id: Option<u64>,
    /// The grant it was pulled under.
    pub grant: Option<GrantId>,
    /// D's blocks of it.
    pub blocks: usize,
    /// When its pull started.
    pub started: Instant,
    /// `None`: received; else why it failed.
    pub failure: Option<(FailureCause, String)>,
}

/// What [`ReceiverCore::cut_short`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CutShort {
    /// The grants to revoke before the engine may reuse the blocks.
    pub grants: Vec<GrantId>,
    /// Requests that were not pulling any more (ended already, or never
    /// here): to be settled as they ended.
    pub ended: Vec<ReqId>,
}

/// What ended since the driver last asked ([`ReceiverCore::take_reports`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PullReports {
    /// One per request reported received or failed.
    pub ended: Vec<PullReport>,
    /// Requests cancelled by the engine while pulling.
    pub cancelled: u64,
    /// Requests whose pull started (each once, however many parts).
    pub started: u64,
}

/// How far one request of a pull got, as P said before its reply (kept
/// only by a core asked to, [`ReceiverCore::keep_progress`]): what a staged
/// worker copies on before the pull ends. For a request pulled in parts,
/// that of all its parts together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullProgress {
    /// D's id.
    pub req: ReqId,
    /// Its first `landed` blocks (in the order the engine gave them) are
    /// in local memory, every part of them, and are not written again.
    pub landed: u32,
    /// How it ends: `Ok`, every block of every part landed; `Err`, it fails
    /// with that cause (a part failed). Its report, once every part is
    /// fenced, says the same.
    pub ended: Option<Result<(), FailureCause>>,
}

/// Reports kept for a driver that never takes them, at most; older ones
/// are dropped (they feed metrics, not the engine).
const MAX_UNTAKEN_REPORTS: usize = 1 << 16;

/// D's pulls, driven with explicit time.
///
/// A pull ends by P's reply, a failure of its connection, or its deadline;
/// whichever comes first decides its outcome and later ones are ignored. An
/// ended pull is not reported until the driver confirms its grant is fenced
/// ([`ReceiverCore::handle_fenced`], after `BatchWriter::revoke` returned),
/// so the engine never reuses a block a late writer could still reach.
#[derive(Debug)]
pub struct ReceiverCore {
    pairing: Pairing,
    timeout: Duration,
    next_xfer_id: u64,
    batches: HashMap<u64, Batch>,
    in_flight: HashMap<ReqId, InFlight>,
    /// Prefill instances by base address.
    instances: HashMap<SideChannelAddr, InstanceState>,
    /// Instances to learn, not yet handed to the driver.
    to_discover: Vec<SideChannelAddr>,
    done: RecvFinished,
    reports: PullReports,
    /// P's progress since the driver last took it (`None`: not kept).
    progress: Option<Vec<PullProgress>>,
}

impl ReceiverCore {
    /// Pulls whole blocks from `remote_port + tp_rank` and fails them after
    /// `timeout` (for instances known to be laid out alike).
    pub fn new(tp_rank: u16, timeout: Duration) -> Self {
        Self::with_pairing(Pairing::Fixed(tp_rank), timeout)
    }

    /// A receiver for the worker at `topology` with a cache of `layout`:
    /// it learns each prefill instance's topology before pulling from it,
    /// and pulls each request from every prefill worker holding some of
    /// its heads. Pulls fail after `timeout`.
    pub fn discovering(topology: RankTopology, layout: CacheLayout, timeout: Duration) -> Self {
        Self::with_pairing(Pairing::Discover { topology, layout }, timeout)
    }

    fn with_pairing(pairing: Pairing, timeout: Duration) -> Self {
        Self {
            pairing,
            timeout,
            next_xfer_id: 1,
            batches: HashMap::new(),
            in_flight: HashMap::new(),
            instances: HashMap::new(),
            to_discover: Vec::new(),
            done: RecvFinished::default(),
            reports: PullReports::default(),
            progress: None,
        }
    }

    /// Keeps P's progress for [`ReceiverCore::take_progress`] (a worker
    /// that asks P for pieces).
    pub fn keep_progress(&mut self) {
        self.progress.get_or_insert_with(Vec::new);
    }

    /// Whether P's progress is kept.
    pub fn keeps_progress(&self) -> bool {
        self.progress.is_some()
    }

    /// The prefill workers whose hold on requests of `instance` this
    /// worker renews: those it pulls from, once the instance is known
    /// (see [`ReceiverCore::learn`]); until then the one it would pull from
    /// were the instance laid out like this one.
    pub fn renewal_peers(&self, instance: &SideChannelAddr) -> Vec<SideChannelAddr> {
        if let Some(InstanceState::Known { parts, .. }) = self.instances.get(instance) {
            let mut peers: Vec<SideChannelAddr> = parts.iter().map(|(peer, _)| peer.clone()).collect();
            peers.dedup();
            return peers;
        }
        let rank = match &self.pairing {
            Pairing::Fixed(rank) => u32::from(*rank),
            Pairing::Discover { topology, .. } => topology.global_rank(),
        };
        topology::side_channel_port(instance.port, rank)
            .map(|port| vec![SideChannelAddr { host: instance.host.clone(), port }])
            .unwrap_or_default()
    }

    /// A request of `instance` (naming `engine` as its prefill engine) is
    /// watched: the instance is learned now, if it is not known or being
    /// learned, so the request's renewals go to the prefill workers its
    /// pull will use ([`ReceiverCore::renewal_peers`] once
    /// [`ReceiverCore::handle_discovered`] has run), not to the one the
    /// guess before the hello names. Nothing to learn with fixed pairing.
    pub fn learn(&mut self, instance: &SideChannelAddr, engine: Option<&EngineId>) {
        if matches!(self.pairing, Pairing::Fixed(_)) || self.known_instance(instance, engine).is_some() {
            return;
        }
        self.instances.insert(instance.clone(), InstanceState::Discovering(Vec::new()));
        self.to_discover.push(instance.clone());
    }

    /// Prefill instances to learn (each the address of its first worker):
    /// the driver asks each one's hello and calls
    /// [`ReceiverCore::handle_discovered`].
    pub fn take_discoveries(&mut self) -> Vec<SideChannelAddr> {
        std::mem::take(&mut self.to_discover)
    }

    /// What the first worker of `instance` said in its hello (or why it
    /// could not be asked): the pulls waiting for it start, or fail.
    /// Returns the transfer requests to send.
    pub fn handle_discovered(
        &mut self,
        instance: &SideChannelAddr,
        info: Result<PeerInfo, (FailureCause, String)>,
        now: Instant,
    ) -> Vec<PullBatch> {
        let Some(InstanceState::Discovering(waiting)) = self.instances.remove(instance) else {
            return Vec::new();
        };
        let learned = info.and_then(|info| {
            let parts = self.parts_of(instance, &info).map_err(|reason| (FailureCause::IncompatiblePeer, reason))?;
            Ok((parts, info.engine_id))
        });
        match learned {
            Ok((parts, engine)) => {
                tracing::debug!(%instance, parts = parts.len(), "prefill instance learned");
                self.instances.insert(instance.clone(), InstanceState::Known { parts: parts.clone(), engine });
                let (mut groups, mut releases) = (Groups::new(), Groups::new());
                for w in waiting {
                    if w.quiet {
                        Self::group_release(&mut releases, w.req, &w.meta.remote, &parts, w.started);
                        continue;
                    }
                    self.in_flight.remove(&w.req);
                    self.group(&mut groups, w.req, &w.meta, &parts, w.started);
                }
                let mut batches = self.batches_of(groups, now);
                batches.extend(self.batches_of(releases, now));
                batches
            }
            Err((cause, reason)) => {
                for w in waiting {
                    if w.quiet {
                        tracing::debug!(req_id = %w.req, %instance, "prefill instance not learned; it is not told to let go of the request");
                        continue;
                    }
                    self.in_flight.remove(&w.req);
                    let reason = format!("cannot learn prefill instance {instance}: {reason}");
                    self.fail_at_start(&w.req, &w.meta, Some(instance.clone()), cause, reason, w.started);
                }
                Vec::new()
            }
        }
    }

    /// Where a request of `instance` is pulled from, given what its first
    /// worker said.
    fn parts_of(&self, instance: &SideChannelAddr, info: &PeerInfo) -> Result<Parts, String> {
        let Pairing::Discover { topology: ours, layout } = &self.pairing else {
            return Err("not a discovering receiver".to_owned());
        };
        let theirs = &info.topology;
        theirs.validate().map_err(|e| format!("prefill declares an impossible topology: {e}"))?;
        if theirs.pp_size != ours.pp_size {
            return Err(format!("pipeline-parallel size: decode has {}, prefill has {}", ours.pp_size, theirs.pp_size));
        }
        let at = |rank: u32| {
            let global = ours.pp_rank * theirs.tp_size + rank;
            topology::side_channel_port(instance.port, global)
                .map(|port| SideChannelAddr { host: instance.host.clone(), port })
                .ok_or_else(|| format!("side-channel port {} + worker {global} overflows", instance.port))
        };
        // Stages may hold different numbers of layers: the first worker's
        // region count says nothing of this stage's (its own hello checks).
        let stage_layout = CacheLayout { region_count: layout.region_count, ..info.layout };
        if copies_whole_blocks((layout, ours), (&stage_layout, theirs)) {
            return Ok(vec![(at(ours.tp_rank)?, None)]);
        }
        if ours.num_kv_heads == 0 || ours.num_kv_heads != theirs.num_kv_heads {
            return Err(format!(
                "model KV heads: decode has {}, prefill has {} (both must be declared to map heads)",
                ours.num_kv_heads, theirs.num_kv_heads
            ));
        }
        let parts = topology::decode_parts(ours.num_kv_heads, theirs.tp_size, ours.tp_size, ours.tp_rank)
            .map_err(|e| e.to_string())?;
        parts.into_iter().map(|part| Ok((at(part.prefill_rank)?, Some(part.heads)))).collect()
    }

    /// Starts this step's pulls: one batch per prefill side channel. Each
    /// must be granted ([`ReceiverCore::handle_granted`]) before its transfer
    /// request goes out. Requests of a prefill instance not known yet wait
    /// for it (see [`ReceiverCore::take_discoveries`]).
    ///
    /// Each request is named to P by its `remote_request_id`; two requests
    /// naming the same one of the same P in one step cannot both be served
    /// (P's reply could not tell them apart): the later one fails at once.
    pub fn start(&mut self, reqs: &BTreeMap<ReqId, RecvReqMeta>, now: Instant) -> Vec<PullBatch> {
        let mut groups = Groups::new();
        for (req, meta) in reqs {
            if self.in_flight.contains_key(req)
                || self.done.received.contains(req)
                || self.done.failed.contains_key(req)
            {
                tracing::warn!(req_id = %req, "pull requested again before its first was reported; the second is ignored");
                continue;
            }
            self.reports.started += 1;
            let remote = &meta.remote;
            let instance = SideChannelAddr { host: remote.remote_host.clone(), port: remote.remote_port };
            let parts = match &self.pairing {
                Pairing::Fixed(rank) => match remote.remote_port.checked_add(*rank) {
                    Some(port) => vec![(SideChannelAddr { host: remote.remote_host.clone(), port }, None)],
                    None => {
                        let reason = format!("side-channel port {} + tp rank {rank} overflows", remote.remote_port);
                        self.fail_at_start(req, meta, None, FailureCause::Other, reason, now);
                        continue;
                    }
                },
                Pairing::Discover { .. } => match self.known_instance(&instance, remote.remote_engine_id.as_ref()) {
                    Some(InstanceState::Known { parts, .. }) => parts.clone(),
                    Some(InstanceState::Discovering(waiting)) => {
                        waiting.push(Waiting { req: req.clone(), meta: meta.clone(), started: now, quiet: false });
                        self.in_flight.insert(req.clone(), InFlight::waiting(meta, now));
                        continue;
                    }
                    None => {
                        let waiting =
                            vec![Waiting { req: req.clone(), meta: meta.clone(), started: now, quiet: false }];
                        self.instances.insert(instance.clone(), InstanceState::Discovering(waiting));
                        self.to_discover.push(instance);
                        self.in_flight.insert(req.clone(), InFlight::waiting(meta, now));
                        continue;
                    }
                },
            };
            self.group(&mut groups, req.clone(), meta, &parts, now);
        }
        self.batches_of(groups, now)
    }

    /// A pull that could not start: where P is was not learned (the
    /// bootstrap flow's lookup failed). Reported failed with `cause` as a
    /// started one would be; its blocks hold no valid KV.
    pub fn fail_unstarted(
        &mut self,
        req: &ReqId,
        meta: &RecvReqMeta,
        cause: FailureCause,
        reason: String,
        now: Instant,
    ) {
        self.reports.started += 1;
        self.fail_at_start(req, meta, None, cause, reason, now);
    }

    /// Tells each prefill worker holding one of `reqs` to let go of it (D
    /// failed it before pulling: no staging room): a pull of no blocks to
    /// every prefill worker a pull of it would go to, which each answers
    /// by freeing the request once every decode rank pulling it from there
    /// did, as for a full prefix hit. Requests of a prefill instance not
    /// known yet wait for it as pulls do (see
    /// [`ReceiverCore::take_discoveries`]), and are dropped if it cannot be
    /// learned (P's lease frees them then). Never reported to the engine
    /// nor counted; the driver sends these batches like any other.
    pub fn release(&mut self, reqs: &BTreeMap<ReqId, RemotePrefill>, now: Instant) -> Vec<PullBatch> {
        let mut groups = Groups::new();
        for (req, remote) in reqs {
            let instance = SideChannelAddr { host: remote.remote_host.clone(), port: remote.remote_port };
            let parts = match &self.pairing {
                Pairing::Fixed(rank) => match remote.remote_port.checked_add(*rank) {
                    Some(port) => vec![(SideChannelAddr { host: remote.remote_host.clone(), port }, None)],
                    None => continue,
                },
                Pairing::Discover { .. } => {
                    let meta = RecvReqMeta { local_block_ids: Vec::new(), first_token: None, remote: remote.clone() };
                    let waiting = Waiting { req: req.clone(), meta, started: now, quiet: true };
                    match self.known_instance(&instance, remote.remote_engine_id.as_ref()) {
                        Some(InstanceState::Known { parts, .. }) => parts.clone(),
                        Some(InstanceState::Discovering(list)) => {
                            list.push(waiting);
                            continue;
                        }
                        None => {
                            self.instances.insert(instance.clone(), InstanceState::Discovering(vec![waiting]));
                            self.to_discover.push(instance);
                            continue;
                        }
                    }
                }
            };
            Self::group_release(&mut groups, req.clone(), remote, &parts, now);
        }
        self.batches_of(groups, now)
    }

    /// Adds a release of one request (a part of no blocks to each of its
    /// prefill workers) to `groups`.
    fn group_release(groups: &mut Groups, req: ReqId, remote: &RemotePrefill, parts: &Parts, started: Instant) {
        for (peer, heads) in parts {
            let pulled =
                Pulled { req: req.clone(), remote: remote.remote_request_id.clone(), blocks: Vec::new(), quiet: true };
            let part = Part {
                pulled,
                engine: remote.remote_engine_id.clone(),
                first_token: None,
                started,
                may_precede_prefill: remote.bootstrap.is_some(),
            };
            groups.entry((peer.clone(), *heads)).or_default().push(part);
        }
    }

    /// Adds one request's parts to this step's groups (or fails it at once
    /// if it names a prefill request another of this step already names).
    fn group(&mut self, groups: &mut Groups, req: ReqId, meta: &RecvReqMeta, parts: &Parts, started: Instant) {
        let remote = &meta.remote;
        for (peer, heads) in parts {
            let group = groups.entry((peer.clone(), *heads)).or_default();
            if let Some(other) = group.iter().find(|p| p.pulled.remote == remote.remote_request_id) {
                let reason = format!("request {} of this step names the same prefill request", other.pulled.req);
                self.fail_at_start(&req, meta, Some(peer.clone()), FailureCause::DuplicateRequest, reason, started);
                return;
            }
        }
        for (peer, heads) in parts {
            // A part that writes no heads only tells its prefill worker.
            let blocks = if heads.is_some_and(|h| h.is_empty()) { Vec::new() } else { meta.local_block_ids.clone() };
            let part = Part {
                pulled: Pulled { req: req.clone(), remote: remote.remote_request_id.clone(), blocks, quiet: false },
                engine: remote.remote_engine_id.clone(),
                first_token: meta.first_token,
                started,
                may_precede_prefill: remote.bootstrap.is_some(),
            };
            groups.entry((peer.clone(), *heads)).or_default().push(part);
        }
        let mut pull = InFlight::waiting(meta, started);
        pull.parts_left = parts.len();
        self.in_flight.insert(req, pull);
    }

    /// One batch per prefill worker (and heads) of this step's groups.
    fn batches_of(&mut self, groups: Groups, now: Instant) -> Vec<PullBatch> {
        groups
            .into_iter()
            .map(|((peer, heads), group)| {
                let xfer_id = self.next_xfer_id;
                self.next_xfer_id += 1;
                let requests = group
                    .iter()
                    .map(|p| RequestBlocks {
                        req_id: p.pulled.remote.clone(),
                        decode_req_id: Some(p.pulled.req.clone()),
                        prefill_engine_id: p.engine.clone(),
                        block_ids: p.pulled.blocks.clone(),
                        first_token: p.first_token,
                        may_precede_prefill: p.may_precede_prefill,
                    })
                    .collect();
                // A request that waited for its instance keeps its deadline.
                let started = group.iter().map(|p| p.started).min().unwrap_or(now);
                for p in group.iter().filter(|p| !p.pulled.quiet) {
                    if let Some(pull) = self.in_flight.get_mut(&p.pulled.req) {
                        let blocks = u32::try_from(p.pulled.blocks.len()).unwrap_or(u32::MAX);
                        pull.parts.push(PartProgress { xfer_id, blocks, landed: 0, ended: None, early: false });
                    }
                }
                let reqs = group.into_iter().map(|p| p.pulled).collect();
                let deadline = started + self.timeout;
                let batch = Batch {
                    deadline,
                    peer: peer.clone(),
                    reqs,
                    grant: None,
                    stage: Stage::Pulling,
                    lost_requests: false,
                };
                self.batches.insert(xfer_id, batch);
                PullBatch { xfer_id, peer, requests, deadline, heads }
            })
            .collect()
    }

    /// The pull's grant was issued: it must be fenced before the pull is
    /// reported. Returns whether the pull may go ahead: `false` if it ended
    /// meanwhile or one of its requests was cancelled after the grant was
    /// computed (the driver then revokes the grant and lets it fail).
    pub fn handle_granted(&mut self, xfer_id: u64, grant: GrantId) -> bool {
        match self.batches.get_mut(&xfer_id) {
            Some(batch) => {
                batch.grant = Some(grant);
                matches!(batch.stage, Stage::Pulling) && !batch.lost_requests
            }
            None => false,
        }
    }

    /// The engine gave up on these requests (aborted while pulling): they
    /// are never reported. Returns the grants the driver must revoke before
    /// the engine may reuse their blocks; the other requests of those pulls
    /// end as P reports them (bytes that landed before the revocation are
    /// whole), failed otherwise. Unknown requests are ignored.
    pub fn cancel<'a>(&mut self, reqs: impl IntoIterator<Item = &'a ReqId>) -> Vec<GrantId> {
        let mut grants = Vec::new();
        for req in reqs {
            let was_pulling = self.stop_pull(req, &mut grants).is_some();
            if self.forget_ended(req) || was_pulling {
                self.reports.cancelled += 1;
            }
            if was_pulling {
                tracing::debug!(req_id = %req, "pull cancelled by the engine");
            }
        }
        grants
    }

    /// The engine's side failed these requests while their pulls were still
    /// out (a staged decode's copy of what landed into the engine's blocks
    /// failed): each ends as a cancelled one does (never reported to the
    /// engine, which knows; its grants returned to revoke) but is reported
    /// failed with `cause` and `reason`. Those not pulling any more are in
    /// [`CutShort::ended`], to be settled as they ended.
    pub fn cut_short<'a>(
        &mut self,
        reqs: impl IntoIterator<Item = &'a ReqId>,
        cause: FailureCause,
        reason: &str,
    ) -> CutShort {
        let mut cut = CutShort::default();
        for req in reqs {
            match self.stop_pull(req, &mut cut.grants) {
                Some(pull) => {
                    tracing::debug!(req_id = %req, %cause, %reason, "pull cut short");
                    self.report(PullReport {
                        req: req.clone(),
                        remote: pull.remote,
                        peer: None,
                        xfer_id: None,
                        grant: None,
                        blocks: pull.blocks.len(),
                        started: pull.started,
                        failure: Some((cause, reason.to_owned())),
                    });
                }
                None => {
                    self.forget_ended(req);
                    cut.ended.push(req.clone());
                }
            }
        }
        cut
    }

    /// Stops the pull of `req` if it is in flight: it leaves every batch
    /// and discovery it waits in, and the grants of its batches join
    /// `grants` (a batch not granted yet has the driver revoke the grant it
    /// is about to issue). The other requests of those batches end as P
    /// reports them.
    fn stop_pull(&mut self, req: &ReqId, grants: &mut Vec<GrantId>) -> Option<InFlight> {
        let pull = self.in_flight.remove(req)?;
        for state in self.instances.values_mut() {
            if let InstanceState::Discovering(waiting) = state {
                waiting.retain(|w| &w.req != req);
            }
        }
        for batch in self.batches.values_mut() {
            let before = batch.reqs.len();
            batch.reqs.retain(|p| &p.req != req);
            if batch.reqs.len() == before {
                continue;
            }
            batch.lost_requests = true;
            if let Some(grant) = batch.grant {
                if !grants.contains(&grant) {
                    grants.push(grant);
                }
            }
        }
        Some(pull)
    }

    /// Forgets how `req` ended if it did and was not taken yet (ended and
    /// fenced, maybe not polled): it is never reported now. Whether it had.
    fn forget_ended(&mut self, req: &ReqId) -> bool {
        let received = self.done.received.remove(req);
        let failed = self.done.failed.remove(req).is_some();
        received || failed
    }

    /// P answered a pull: each request will be received or failed by its
    /// outcome (a request the reply leaves out has failed), once fenced.
    /// Replies for pulls that already ended are ignored.
    pub fn handle_reply(&mut self, reply: XferReply) {
        match self.batches.get_mut(&reply.xfer_id) {
            Some(batch) if matches!(batch.stage, Stage::Pulling) => {
                batch.stage = Stage::Fencing(BatchOutcome::Replied(reply));
            }
            _ => tracing::debug!(xfer_id = reply.xfer_id, "reply for a transfer already ended; ignored"),
        }
    }

    /// P said how far one request of a pull got (peer input: a count past
    /// the request's blocks, a count that goes back, a request or pull not
    /// in progress, or anything after its outcome is ignored). Returns
    /// whether it told something new. Its outcome, if given, is that
    /// part's: a reply or a failure of the pull later does not change it
    /// (P wrote with remote completion what it said landed). What the
    /// request's parts together reached is kept for
    /// [`ReceiverCore::take_progress`].
    pub fn handle_progress(&mut self, progress: XferProgress) -> bool {
        let Some(batch) = self.batches.get(&progress.xfer_id) else { return false };
        if !matches!(batch.stage, Stage::Pulling) {
            return false;
        }
        let Some(pulled) = batch.reqs.iter().find(|p| p.remote == progress.req_id && !p.quiet) else { return false };
        let req = pulled.req.clone();
        let Some(part) =
            self.in_flight.get_mut(&req).and_then(|pull| pull.parts.iter_mut().find(|p| p.xfer_id == progress.xfer_id))
        else {
            return false;
        };
        if part.ended.is_some() {
            return false;
        }
        let landed = if progress.outcome == Some(Outcome::Done) { part.blocks } else { progress.landed };
        if landed > part.blocks {
            tracing::debug!(req_id = %req, landed, blocks = part.blocks, "progress past the request's blocks; ignored");
            return false;
        }
        if landed <= part.landed && progress.outcome.is_none() {
            return false;
        }
        part.landed = part.landed.max(landed);
        part.early = progress.outcome.is_some();
        part.ended = progress.outcome;
        self.tell_progress(&req);
        true
    }

    /// Keeps what `req`'s parts together reached, if it grew: the blocks
    /// every part landed, and its end once every part said it is done or
    /// one said it failed. Told once it ended, nothing more.
    fn tell_progress(&mut self, req: &ReqId) {
        let (Some(events), Some(pull)) = (self.progress.as_mut(), self.in_flight.get_mut(req)) else { return };
        if pull.told.1 || pull.parts.is_empty() {
            return;
        }
        let total = u32::try_from(pull.blocks.len()).unwrap_or(u32::MAX);
        // A part of no blocks writes none: it holds no block back.
        let landed = pull.parts.iter().map(|p| if p.blocks == 0 { total } else { p.landed }).min().unwrap_or(0);
        let failed = pull.parts.iter().find_map(|p| match &p.ended {
            Some(Outcome::Failed { cause, .. }) => Some(*cause),
            _ => None,
        });
        let ended = match failed {
            Some(cause) => Some(Err(cause)),
            None if pull.parts.iter().all(|p| p.ended == Some(Outcome::Done)) => Some(Ok(())),
            None => None,
        };
        if landed <= pull.told.0 && ended.is_none() {
            return;
        }
        pull.told = (pull.told.0.max(landed), ended.is_some());
        events.push(PullProgress { req: req.clone(), landed: pull.told.0, ended });
    }

    /// P's progress since the last call (empty unless kept,
    /// [`ReceiverCore::keep_progress`]).
    pub fn take_progress(&mut self) -> Vec<PullProgress> {
        self.progress.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// What P said of part `xfer_id` of `req` before its reply, if anything.
    fn early_outcome(&self, req: &ReqId, xfer_id: u64) -> Option<Outcome> {
        let pull = self.in_flight.get(req)?;
        let part = pull.parts.iter().find(|p| p.xfer_id == xfer_id && p.early)?;
        part.ended.clone()
    }

    /// A pull could not be completed (no grant, connection failure, hello
    /// rejected, shutdown): every request of it will fail, once fenced.
    pub fn handle_batch_failed(&mut self, xfer_id: u64, cause: FailureCause, reason: &str) {
        if let Some(batch) = self.batches.get_mut(&xfer_id) {
            if matches!(batch.stage, Stage::Pulling) {
                batch.stage = Stage::Fencing(BatchOutcome::Failed(cause, reason.to_owned()));
            }
        }
    }

    /// Ends every pull whose deadline passed at `now` (failed, once fenced);
    /// returns the grants the driver must revoke (then call
    /// [`ReceiverCore::handle_fenced`]) for them.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<(u64, Option<GrantId>)> {
        let reason = format!("no reply within {:?}", self.timeout);
        let mut expired: Vec<(SideChannelAddr, Waiting)> = Vec::new();
        for (instance, state) in &mut self.instances {
            if let InstanceState::Discovering(waiting) = state {
                let (late, keep): (Vec<Waiting>, Vec<Waiting>) =
                    std::mem::take(waiting).into_iter().partition(|w| w.started + self.timeout <= now);
                *waiting = keep;
                expired.extend(late.into_iter().map(|w| (instance.clone(), w)));
            }
        }
        for (instance, w) in expired {
            if w.quiet {
                tracing::debug!(req_id = %w.req, %instance, "prefill instance not learned in time; it is not told to let go of the request");
                continue;
            }
            self.in_flight.remove(&w.req);
            let why = format!("prefill instance {instance} not learned within {:?}", self.timeout);
            self.fail_at_start(&w.req, &w.meta, Some(instance), FailureCause::Timeout, why, w.started);
        }
        let mut to_fence = Vec::new();
        for (id, batch) in &mut self.batches {
            if batch.deadline <= now && matches!(batch.stage, Stage::Pulling) {
                batch.stage = Stage::Fencing(BatchOutcome::Failed(FailureCause::Timeout, reason.clone()));
                to_fence.push((*id, batch.grant));
            }
        }
        to_fence
    }

    /// The pull's grant is revoked (or it never had one): no byte of it can
    /// land any more, so its outcome is reported (a request pulled in
    /// parts once every part is fenced). A pull that had not ended yet
    /// fails. Later calls are ignored.
    pub fn handle_fenced(&mut self, xfer_id: u64) {
        let Some(batch) = self.batches.remove(&xfer_id) else { return };
        let Batch { peer, reqs, grant, stage, .. } = batch;
        let said = |outcome: &Outcome| match outcome {
            Outcome::Done => None,
            Outcome::Failed { cause, reason } => Some((*cause, format!("prefill failed to send: {reason}"))),
        };
        let (outcomes, failed): (HashMap<ReqId, Outcome>, _) = match stage {
            Stage::Fencing(BatchOutcome::Replied(reply)) => {
                (reply.outcomes.into_iter().map(|o| (o.req_id, o.outcome)).collect(), None)
            }
            Stage::Pulling => (HashMap::new(), None),
            Stage::Fencing(BatchOutcome::Failed(cause, reason)) => {
                self.forget_instance_of(&peer);
                (HashMap::new(), Some((cause, reason)))
            }
        };
        for pulled in reqs {
            if pulled.quiet {
                let outcome = outcomes.get(&pulled.remote);
                tracing::debug!(req_id = %pulled.req, remote_req_id = %pulled.remote, ?outcome, failure = ?failed, "prefill told to let go of the request");
                continue;
            }
            // What P said first wins: bytes it said landed did.
            let early = self.early_outcome(&pulled.req, xfer_id);
            let failure = match (&early, outcomes.get(&pulled.remote), &failed) {
                (Some(outcome), _, _) | (None, Some(outcome), None) => said(outcome),
                (None, _, Some((cause, reason))) => Some((*cause, reason.clone())),
                (None, None, None) if outcomes.is_empty() => {
                    Some((FailureCause::Other, "the pull ended before an outcome".to_owned()))
                }
                (None, None, None) => {
                    Some((FailureCause::Other, "prefill's reply has no outcome for the request".to_owned()))
                }
            };
            if failure.as_ref().is_some_and(|(cause, _)| *cause == FailureCause::PlanFailed) {
                // P may have restarted laid out otherwise: learn it again.
                self.forget_instance_of(&peer);
            }
            self.part_ended(pulled.req, PartEnd { peer: peer.clone(), xfer_id, grant, failure });
        }
    }

    /// What is known of `instance`, for a request that names `engine` as
    /// its prefill engine: nothing if the instance was learned from another
    /// engine (it restarted there, maybe laid out otherwise, so it is
    /// learned again before this pull is planned).
    fn known_instance(&mut self, instance: &SideChannelAddr, engine: Option<&EngineId>) -> Option<&mut InstanceState> {
        let restarted = matches!(
            (self.instances.get(instance), engine),
            (Some(InstanceState::Known { engine: learned, .. }), Some(named)) if learned != named
        );
        if restarted {
            tracing::debug!(%instance, "the request names another prefill engine than the one learned there: learning it again");
            self.instances.remove(instance);
        }
        self.instances.get_mut(instance)
    }

    /// Forgets what was learned of the instance `peer` belongs to, so the
    /// next pull from it asks again (it may have restarted with another
    /// topology).
    fn forget_instance_of(&mut self, peer: &SideChannelAddr) {
        self.instances.retain(|_, state| match state {
            InstanceState::Known { parts, .. } => !parts.iter().any(|(p, _)| p == peer),
            InstanceState::Discovering(_) => true,
        });
    }

    /// One part of a request ended (fenced): the request is reported once
    /// its last part has.
    fn part_ended(&mut self, req: ReqId, end: PartEnd) {
        let Some(pull) = self.in_flight.get_mut(&req) else { return };
        pull.parts_left = pull.parts_left.saturating_sub(1);
        if let Some(part) = pull.parts.iter_mut().find(|p| p.xfer_id == end.xfer_id) {
            if end.failure.is_none() {
                part.landed = part.blocks;
            }
            if part.ended.is_none() {
                part.ended = Some(match &end.failure {
                    None => Outcome::Done,
                    Some((cause, reason)) => Outcome::Failed { cause: *cause, reason: reason.clone() },
                });
            }
        }
        let first_failure = end.failure.is_some() && pull.report.as_ref().is_none_or(|r| r.failure.is_none());
        if first_failure || pull.report.is_none() {
            pull.report = Some(end);
        }
        if pull.parts_left > 0 {
            // The others are still out: what this one's end settles (a
            // failure, or the last part done) is told now.
            self.tell_progress(&req);
            return;
        }
        let Some(pull) = self.in_flight.remove(&req) else { return };
        let InFlight { remote, blocks, started, report, .. } = pull;
        let report = match report {
            Some(PartEnd { peer, xfer_id, grant, failure }) => PullReport {
                req: req.clone(),
                remote: remote.clone(),
                peer: Some(peer),
                xfer_id: Some(xfer_id),
                grant,
                blocks: blocks.len(),
                started,
                failure,
            },
            None => return,
        };
        match &report.failure {
            None => {
                tracing::debug!(req_id = %req, remote_req_id = %remote, peer = ?report.peer, blocks = blocks.len(), "KV received");
                self.done.received.insert(req);
            }
            Some((cause, reason)) => {
                tracing::debug!(req_id = %req, remote_req_id = %remote, peer = ?report.peer, %cause, %reason, "KV pull failed");
                self.done.failed.insert(req, blocks);
            }
        }
        self.report(report);
    }

    fn fail_at_start(
        &mut self,
        req: &ReqId,
        meta: &RecvReqMeta,
        peer: Option<SideChannelAddr>,
        cause: FailureCause,
        reason: String,
        now: Instant,
    ) {
        tracing::debug!(req_id = %req, %cause, %reason, "pull not started");
        self.done.failed.insert(req.clone(), meta.local_block_ids.clone());
        self.report(PullReport {
            req: req.clone(),
            remote: meta.remote.remote_request_id.clone(),
            peer,
            xfer_id: None,
            grant: None,
            blocks: meta.local_block_ids.len(),
            started: now,
            failure: Some((cause, reason)),
        });
    }

    fn report(&mut self, report: PullReport) {
        if self.reports.ended.len() >= MAX_UNTAKEN_REPORTS {
            // Drop the older half at once: a driver that never takes them
            // pays a shift once per many reports, not once per report.
            self.reports.ended.drain(..MAX_UNTAKEN_REPORTS / 2);
        }
        self.reports.ended.push(report);
    }

    /// How each request ended since the last call, and how many the engine
    /// cancelled: what the driver counts and logs. Kept (a bounded number)
    /// until taken.
    pub fn take_reports(&mut self) -> PullReports {
        std::mem::take(&mut self.reports)
    }

    /// Outcomes since the last poll, each request reported once.
    pub fn poll_finished(&mut self) -> RecvFinished {
        std::mem::take(&mut self.done)
    }

    /// The earliest deadline of a pull still waiting, for a driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        let waiting = self.instances.values().flat_map(|state| match state {
            InstanceState::Discovering(waiting) => waiting.iter().map(|w| w.started + self.timeout).min(),
            InstanceState::Known { .. } => None,
        });
        self.batches.values().filter(|b| matches!(b.stage, Stage::Pulling)).map(|b| b.deadline).chain(waiting).min()
    }

    /// Requests being pulled (their outcome not yet reported).
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

impl InFlight {
    /// A request whose parts are not known yet.
    fn waiting(meta: &RecvReqMeta, started: Instant) -> Self {
        Self {
            remote: meta.remote.remote_request_id.clone(),
            blocks: meta.local_block_ids.clone(),
            started,
            parts_left: 0,
            report: None,
            parts: Vec::new(),
            told: (0, false),
        }
    }
}

/// One part of a request, on its way into a batch.
struct Part {
    pulled: Pulled,
    engine: Option<EngineId>,
    first_token: Option<u64>,
    started: Instant,
    /// Named by a transfer id: P may not know it yet (see
    /// [`RequestBlocks::may_precede_prefill`]).
    may_precede_prefill: bool,
}

/// This step's parts by prefill worker and heads.
type Groups = BTreeMap<(SideChannelAddr, Option<HeadRange>), Vec<Part>>;
