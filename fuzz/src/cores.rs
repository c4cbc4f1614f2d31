//! `cores`: the sans-IO state machines driven by arbitrary event sequences
//! with explicit, increasing time, each checked against a model of its
//! documented behaviour and against the invariants the system relies on.
//!
//! One input drives three machines at once, coupled as in a worker: the
//! scheduler's metadata feeds the sender's updates (prefill side) and the
//! receiver's pulls (decode side); other events reach the cores directly.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use arbitrary::{Arbitrary, Unstructured};
use kv_proto::{
    BlockId, ConnectorMetadata, EngineId, GrantId, KvRole, KvTransferParams, Outcome, RecvReqMeta, RemotePrefill,
    RenewalKey, RenewalSecret, Renewing, ReqId, RequestBlocks, RequestOutcome, SendUpdate, XferReply,
};
use kv_sched::{ConnectorScheduler, EngineRequest, RequestStatus, SchedError};
use kv_worker::{Claim, PullBatch, ReceiverCore, RecvFinished, SenderCore, SideChannelAddr};

/// Requests in each pool (scheduler `s*`, sender-only `p*`, receiver-only `d*`).
const POOL: usize = 8;
/// This instance's side channel, as the scheduler advertises it.
const HERE: (&str, u16) = ("here", 7000);
/// The engine id of the scheduler under test.
const HERE_ENGINE: &str = "here-engine";

/// What D's scheduler names to P for request `id` with `params`: P's id
/// when the params carry it, else D's own; `None` without a side channel.
fn remote_prefill(id: &ReqId, params: &KvTransferParams) -> Option<RemotePrefill> {
    let (host, port) = params.remote()?;
    Some(RemotePrefill {
        remote_host: host.to_owned(),
        remote_port: port,
        remote_request_id: params.remote_request_id.clone().unwrap_or_else(|| id.clone()),
        remote_engine_id: params.remote_engine_id.clone(),
        remote_renewal_key: params.remote_renewal_key,
        bootstrap: None,
    })
}

/// What the scheduler under test mints its renewal keys from.
fn renewal_secret() -> RenewalSecret {
    RenewalSecret::from_bytes([0x5e; 32])
}

/// The renewal key the sender under test is given with every update.
const KEY: RenewalKey = RenewalKey::from_bytes([0x6b; 16]);
/// A key the sender under test is never given.
const WRONG_KEY: RenewalKey = RenewalKey::from_bytes([0x6c; 16]);

fn pool_id(prefix: char, i: u8) -> ReqId {
    ReqId::new(format!("{prefix}{}", usize::from(i) % POOL))
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum ArbRole {
    Producer,
    Consumer,
    Both,
}

#[derive(Arbitrary, Clone, Debug)]
enum Host {
    P1,
    P2,
    V6,
    Other(String),
}

impl Host {
    fn name(&self) -> String {
        match self {
            Host::P1 => "p1".to_owned(),
            Host::P2 => "p2".to_owned(),
            Host::V6 => "::1".to_owned(),
            Host::Other(s) => s.clone(),
        }
    }
}

/// A port: usually ordinary, sometimes at the top so that adding the tp
/// rank overflows.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Port {
    Usual(u8),
    High(u8),
}

impl Port {
    fn get(self) -> u16 {
        match self {
            Port::Usual(p) => 8000 + u16::from(p % 4),
            Port::High(p) => u16::MAX - u16::from(p % 4),
        }
    }
}

#[derive(Arbitrary, Clone, Debug)]
struct ArbParams {
    do_remote_prefill: bool,
    do_remote_decode: bool,
    host: Option<Host>,
    port: Option<Port>,
}

#[derive(Arbitrary, Clone, Debug)]
struct ArbRequest {
    prompt_len: u8,
    params: Option<ArbParams>,
}

#[derive(Arbitrary, Clone, Copy, Debug)]
enum Finish {
    Stopped,
    LengthCapped,
    Aborted,
    Ignored,
}

impl From<Finish> for RequestStatus {
    fn from(f: Finish) -> Self {
        match f {
            Finish::Stopped => RequestStatus::FinishedStopped,
            Finish::LengthCapped => RequestStatus::FinishedLengthCapped,
            Finish::Aborted => RequestStatus::FinishedAborted,
            Finish::Ignored => RequestStatus::FinishedIgnored,
        }
    }
}

#[derive(Arbitrary, Clone, Debug)]
enum Update {
    Expect,
    Ready(Vec<BlockId>),
    Forget,
}

impl From<&Update> for SendUpdate {
    fn from(u: &Update) -> Self {
        match u {
            Update::Expect => SendUpdate::Expect,
            Update::Ready(b) => SendUpdate::Ready { block_ids: b.clone() },
            Update::Forget => SendUpdate::Forget,
        }
    }
}

/// Which transfer an event names: one started so far (by index), or an id
/// never handed out.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Xfer {
    Known(u8),
    Unknown(u64),
}

/// Where [`Event::ToDeadline`] lands relative to the deadline.
#[derive(Arbitrary, Clone, Copy, Debug)]
enum Offset {
    Before,
    At,
    After,
}

#[derive(Arbitrary, Clone, Debug)]
enum Event {
    /// Time passes.
    Advance {
        ms: u16,
    },
    /// Time moves to just before, exactly at or just after the sender's
    /// (`sender`) or the receiver's next deadline, if it is still ahead.
    ToDeadline {
        sender: bool,
        offset: Offset,
    },
    /// Scheduler: request `i` gets blocks (scheduled or rescheduled).
    Alloc {
        i: u8,
        num_computed: u8,
        blocks: Vec<BlockId>,
    },
    /// Scheduler: request `i` finishes.
    Finish {
        i: u8,
        how: Finish,
        blocks: Vec<BlockId>,
    },
    /// Scheduler: end of step; the metadata goes to the worker.
    Build,
    /// Sender: an update not from this scheduler (`s*` or `p*`).
    Update {
        req: u8,
        update: Update,
    },
    /// Sender: a pull for the request arrives.
    Claim {
        req: u8,
    },
    /// Sender: a transfer of the request ended.
    Complete {
        req: u8,
    },
    /// Sender: the pull that waited for the request gave up (its side
    /// channel closed, or its wait budget passed).
    Abandon {
        req: u8,
    },
    /// Sender: decode instance `by` (one of two) renews the request,
    /// naming its renewal key or (`wrong_key`) another.
    Renew {
        req: u8,
        by: bool,
        wrong_key: bool,
    },
    /// Sender: P renews what decode instance `by` last renewed (it makes
    /// that instance's messages wait).
    RenewAllBy {
        by: bool,
    },
    SenderTimeout,
    SenderPoll,
    /// Receiver: pulls not from this scheduler (`d*`).
    Start {
        reqs: Vec<(u8, Host, Port, Vec<BlockId>)>,
    },
    /// Receiver: the pull's grant was issued; if the core says the pull may
    /// not go ahead, the driver fails it (and fences it later).
    Granted {
        xfer: Xfer,
        grant: u8,
    },
    /// Receiver: the engine gave up on these pulls (`d*`; the scheduler's
    /// own cancellations come with its metadata).
    Cancel {
        reqs: Vec<u8>,
    },
    /// Receiver: P's reply; outcomes name the batch's `n`th request or
    /// another id, done or failed.
    Reply {
        xfer: Xfer,
        outcomes: Vec<(u8, bool, bool)>,
    },
    BatchFailed {
        xfer: Xfer,
    },
    ReceiverTimeout,
    Fenced {
        xfer: Xfer,
    },
    /// Receiver: the engine collects the outcomes; with `tell_scheduler` it
    /// reports the scheduler's requests among them (`pull_finished`, which
    /// is optional).
    ReceiverPoll {
        tell_scheduler: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct CoresInput {
    role: ArbRole,
    tp_rank: u16,
    transfer_timeout_ms: u16,
    lease_ms: u16,
    /// Zero: renewals off.
    renewal_ms: u16,
    requests: [ArbRequest; POOL],
    events: Vec<Event>,
}

// ---------------------------------------------------------------- scheduler

/// The scheduler under test with the engine's view of its requests.
struct Sched {
    role: KvRole,
    s: ConnectorScheduler,
    reqs: Vec<EngineRequest>,
    finished: Vec<bool>,
    /// Model: pending pulls, send updates and cancellations of this step,
    /// live send entries, and pulls into blocks that went to the worker and
    /// were neither reported (`pull_finished`) nor ended by a finish.
    recv: BTreeMap<ReqId, RecvReqMeta>,
    send: BTreeMap<ReqId, SendUpdate>,
    cancel: BTreeSet<ReqId>,
    live: BTreeSet<ReqId>,
    live_pulls: BTreeSet<ReqId>,
    /// Counted as external since the last build: their pull must go out.
    awaited: BTreeSet<ReqId>,
    /// Every request a pull ever went out for.
    pulled: BTreeSet<ReqId>,
    /// Watched requests (seen, to be pulled from a named side channel, not
    /// yet pulled or finished), and this step's watches and unwatches.
    watching: BTreeSet<ReqId>,
    watch: BTreeMap<ReqId, RemotePrefill>,
    unwatch: BTreeSet<ReqId>,
}

impl Sched {
    fn new(role: KvRole, requests: &[ArbRequest; POOL]) -> Self {
        let reqs = requests
            .iter()
            .enumerate()
            .map(|(i, r)| EngineRequest {
                request_id: ReqId::new(format!("s{i}")),
                prompt_len: usize::from(r.prompt_len),
                status: RequestStatus::Waiting,
                kv_transfer_params: r.params.as_ref().map(|p| KvTransferParams {
                    do_remote_prefill: p.do_remote_prefill,
                    do_remote_decode: p.do_remote_decode,
                    remote_host: p.host.as_ref().map(Host::name),
                    remote_port: p.port.map(Port::get),
                    // Half the requests carry P's id and engine (today's
                    // prefill), half not (an older proxy: D's id is used).
                    remote_request_id: (i % 2 == 0).then(|| ReqId::new(format!("P{i}"))),
                    remote_engine_id: (i % 2 == 0).then(|| EngineId::new("prefill")),
                    remote_renewal_key: (i % 2 == 0).then(|| RenewalKey::from_bytes([i as u8; 16])),
                    remote_bootstrap_addr: None,
                    transfer_id: None,
                }),
            })
            .collect();
        Self {
            role,
            s: ConnectorScheduler::new(role, EngineId::new(HERE_ENGINE), HERE.0, HERE.1, renewal_secret()),
            reqs,
            finished: vec![false; POOL],
            recv: BTreeMap::new(),
            send: BTreeMap::new(),
            cancel: BTreeSet::new(),
            live: BTreeSet::new(),
            live_pulls: BTreeSet::new(),
            awaited: BTreeSet::new(),
            pulled: BTreeSet::new(),
            watching: BTreeSet::new(),
            watch: BTreeMap::new(),
            unwatch: BTreeSet::new(),
        }
    }

    /// The watch on `id` ends: withdrawn if the worker never heard of it.
    fn end_watch(&mut self, id: &ReqId) {
        if self.watching.remove(id) && self.watch.remove(id).is_none() {
            self.unwatch.insert(id.clone());
        }
    }

    fn record_recv(&mut self, id: &ReqId, params: &KvTransferParams, blocks: Vec<BlockId>, first_token: Option<u64>) {
        // The pull holds the request on P from now on.
        self.end_watch(id);
        if let Some(remote) = remote_prefill(id, params) {
            self.recv.insert(id.clone(), RecvReqMeta { local_block_ids: blocks, first_token, remote });
        }
    }

    fn forget_if_live(&mut self, id: &ReqId) {
        if self.live.remove(id) {
            self.send.insert(id.clone(), SendUpdate::Forget);
        }
    }

    /// Checks a call's result against the refusal the model expects
    /// (`Some(true)`: a remote prefill on a producer, `Some(false)`: a remote
    /// decode on a consumer); a refused call changes nothing. Returns whether
    /// the call was refused.
    fn check_refusal<T: std::fmt::Debug>(
        &self,
        result: &Result<T, SchedError>,
        expected: Option<bool>,
        before: &EngineRequest,
        after: &EngineRequest,
    ) -> bool {
        let id = &before.request_id;
        match (result, expected) {
            (Ok(_), None) => false,
            (Err(e @ SchedError::RemotePrefillOnProducer { role, .. }), Some(true))
            | (Err(e @ SchedError::RemoteDecodeOnConsumer { role, .. }), Some(false)) => {
                assert_eq!(e.request_id(), id);
                assert_eq!(*role, self.role);
                assert_eq!(before, after, "a refused call changed the request");
                true
            }
            (got, expected) => panic!("{id} as {:?}: got {got:?}, expected refusal {expected:?}", self.role),
        }
    }

    fn alloc(&mut self, i: usize, num_computed: usize, blocks: &[BlockId]) {
        if self.finished[i] {
            return;
        }
        let before = self.reqs[i].clone();
        let id = before.request_id.clone();
        let (external, load_async) = self.s.get_num_new_matched_tokens(&self.reqs[i], num_computed);
        assert_eq!(load_async, external > 0, "load_async must say whether tokens are external");
        // A pull counts its uncomputed prompt tokens, except where none can
        // be made: no side channel named, or a prefill-only instance (which
        // refuses the pull below).
        let pull_params = before.kv_transfer_params.as_ref().filter(|p| p.do_remote_prefill);
        let expected = match pull_params {
            Some(p) if p.remote().is_some() && self.role != KvRole::Producer => {
                before.prompt_len.saturating_sub(num_computed)
            }
            _ => 0,
        };
        assert_eq!(external, expected, "{id}: external tokens with params {:?}", before.kv_transfer_params);
        // A decode instance watches a request it will pull from a named side channel.
        if let Some(remote) = pull_params.and_then(|p| remote_prefill(&id, p)) {
            if self.role != KvRole::Producer && self.watching.insert(id.clone()) {
                self.watch.insert(id.clone(), remote);
            }
        }

        self.reqs[i].status = RequestStatus::Running;
        let before = self.reqs[i].clone();
        let result = self.s.update_state_after_alloc(&mut self.reqs[i], blocks, external);
        let after = self.reqs[i].clone();
        let Some(params) = before.kv_transfer_params.clone() else {
            assert!(result.is_ok());
            assert_eq!(before, after);
            return;
        };
        let refusal = if params.do_remote_prefill {
            (self.role == KvRole::Producer).then_some(true)
        } else {
            (params.do_remote_decode && self.role == KvRole::Consumer).then_some(false)
        };
        if self.check_refusal(&result, refusal, &before, &after) {
            // The engine learns the request cannot run here: nothing may be
            // awaited for it.
            assert_eq!(external, 0, "{id}: external tokens counted for a refused request");
            return;
        }
        if params.do_remote_prefill {
            assert_ne!(self.role, KvRole::Producer);
            let blocks = if external > 0 { blocks.to_vec() } else { Vec::new() };
            // The pulled blocks start after what the prefix cache held.
            let first_token = (external > 0).then(|| before.prompt_len.saturating_sub(external) as u64);
            self.record_recv(&id, &params, blocks, first_token);
            let mut cleared = params.clone();
            cleared.do_remote_prefill = false;
            assert_eq!(after.kv_transfer_params, Some(cleared), "do_remote_prefill must be cleared, nothing else");
        } else if params.do_remote_decode {
            assert_ne!(self.role, KvRole::Consumer);
            self.live.insert(id.clone());
            self.send.insert(id.clone(), SendUpdate::Expect);
            assert_eq!(before, after);
        } else {
            assert_eq!(before, after);
        }
        if external > 0 {
            self.awaited.insert(id);
        }
    }

    fn finish(&mut self, i: usize, how: RequestStatus, blocks: &[BlockId]) {
        if self.finished[i] {
            return;
        }
        self.finished[i] = true;
        self.reqs[i].status = how;
        let before = self.reqs[i].clone();
        let id = before.request_id.clone();
        let result = self.s.request_finished(&mut self.reqs[i], blocks);
        let after = self.reqs[i].clone();
        // Decode side, first, whatever else the call decides (also when it
        // refuses the rest): the engine frees the request's blocks, so a
        // pull not built yet goes out with no block (P still frees), and a
        // pull with the worker and not reported is cancelled.
        if let Some(pending) = self.recv.get_mut(&id) {
            pending.local_block_ids.clear();
            pending.first_token = None;
        }
        if self.live_pulls.remove(&id) {
            self.cancel.insert(id.clone());
        }
        self.end_watch(&id);
        let Some(params) = before.kv_transfer_params.clone() else {
            self.forget_if_live(&id);
            assert_eq!(result, Ok((false, None)));
            return;
        };
        let refusal = if params.do_remote_prefill {
            (self.role == KvRole::Producer).then_some(true)
        } else {
            (params.do_remote_decode && how == RequestStatus::FinishedLengthCapped && self.role == KvRole::Consumer)
                .then_some(false)
        };
        if self.check_refusal(&result, refusal, &before, &after) {
            return;
        }
        if params.do_remote_prefill {
            self.record_recv(&id, &params, Vec::new(), None);
            self.forget_if_live(&id);
            assert_eq!(result, Ok((false, None)));
            let mut cleared = params.clone();
            cleared.do_remote_prefill = false;
            assert_eq!(after.kv_transfer_params, Some(cleared));
            return;
        }
        if !params.do_remote_decode || how != RequestStatus::FinishedLengthCapped {
            self.forget_if_live(&id);
            assert_eq!(result, Ok((false, None)));
            return;
        }
        self.live.remove(&id);
        let delay = !blocks.is_empty();
        let update = if delay { SendUpdate::Ready { block_ids: blocks.to_vec() } } else { SendUpdate::Forget };
        self.send.insert(id.clone(), update);
        let points_here = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_host: Some(HERE.0.to_owned()),
            remote_port: Some(HERE.1),
            remote_request_id: Some(id.clone()),
            remote_engine_id: Some(EngineId::new(HERE_ENGINE)),
            remote_renewal_key: delay.then(|| renewal_secret().key_for(&id)),
            remote_bootstrap_addr: None,
            transfer_id: None,
        };
        assert_eq!(result, Ok((delay, Some(points_here))));
    }

    fn build(&mut self) -> ConnectorMetadata {
        let meta = self.s.build_connector_meta();
        let recv = std::mem::take(&mut self.recv);
        let send = std::mem::take(&mut self.send);
        let cancel = std::mem::take(&mut self.cancel);
        let watch = std::mem::take(&mut self.watch);
        let unwatch = std::mem::take(&mut self.unwatch);
        if self.role.receives() {
            // Only a pull into blocks can write anything: only those are
            // cancelled if their request finishes first.
            self.live_pulls
                .extend(recv.iter().filter(|(_, m)| !m.local_block_ids.is_empty()).map(|(id, _)| id.clone()));
        }
        // Each request made ready comes with the key its params carry.
        let renewal_keys = send
            .iter()
            .filter(|(_, update)| self.role.sends() && matches!(update, SendUpdate::Ready { .. }))
            .map(|(id, _)| (id.clone(), renewal_secret().key_for(id)))
            .collect();
        let expected = ConnectorMetadata {
            renewal_keys,
            reqs_to_recv: if self.role.receives() { recv } else { BTreeMap::new() },
            reqs_to_send: if self.role.sends() { send } else { BTreeMap::new() },
            reqs_to_cancel: if self.role.receives() { cancel } else { BTreeSet::new() },
            reqs_to_watch: if self.role.receives() { watch } else { BTreeMap::new() },
            reqs_to_unwatch: if self.role.receives() { unwatch } else { BTreeSet::new() },
            send_names: Default::default(),
        };
        assert_eq!(meta, expected, "the step's metadata differs from the model's");
        for id in &meta.reqs_to_cancel {
            assert!(self.pulled.contains(id), "{id} cancelled but its pull never went out");
            assert!(!meta.reqs_to_recv.contains_key(id), "{id} pulled and cancelled in one step");
            let index = self.reqs.iter().position(|r| r.request_id == *id);
            assert!(index.is_some_and(|i| self.finished[i]), "{id} cancelled before it finished");
        }
        for id in std::mem::take(&mut self.awaited) {
            assert!(meta.reqs_to_recv.contains_key(&id), "{id} was counted as external but no pull went out");
        }
        for id in meta.reqs_to_recv.keys() {
            assert!(self.pulled.insert(id.clone()), "a second pull went out for {id}");
        }
        assert_eq!(self.s.live_send_entries(), self.live.len());
        assert_eq!(self.s.live_pulls(), self.live_pulls.len());
        assert_eq!(self.s.live_watches(), self.watching.len());
        meta
    }

    /// The engine saw `id`'s pull reported (received or failed).
    fn pull_finished(&mut self, id: &ReqId) {
        self.s.pull_finished(id);
        self.live_pulls.remove(id);
        assert_eq!(self.s.live_pulls(), self.live_pulls.len());
    }
}

// ------------------------------------------------------------------- sender

#[derive(Debug, Clone, PartialEq)]
enum Entry {
    Expected,
    Ready {
        blocks: Vec<BlockId>,
        lease_end: Instant,
    },
    InFlight,
    /// Not ready, and the pull that waited for it gave up: freed the moment
    /// it is ready, without a lease.
    Abandoned,
}

/// The sender under test and its model.
struct Sender {
    core: SenderCore,
    lease: Duration,
    renewal: Duration,
    /// Requests held for a decode instance that renews them: until when, and who.
    renewals: HashMap<ReqId, (Instant, EngineId)>,
    /// Requests two decode instances renewed: held for their whole lease.
    contested: HashSet<ReqId>,
    /// Requests expected or ready whose renewal key the core was given.
    keyed: HashSet<ReqId>,
    /// Renewals the core must have refused (a held request, the wrong key
    /// or none known).
    refused: u64,
    entries: HashMap<ReqId, Entry>,
    finished: BTreeSet<ReqId>,
    /// Per request: times its blocks were handed to P (Ready), and times it
    /// was reported finished sending (its blocks freed).
    held: HashMap<ReqId, usize>,
    freed: HashMap<ReqId, usize>,
    /// Requests that got a Ready or a Forget, and those that got any update
    /// after that: no scheduler does that (it announces a request, then ends
    /// it once), so the id-based accounting below is not asked of them; the
    /// model still is.
    ended: BTreeSet<ReqId>,
    irregular: BTreeSet<ReqId>,
}

impl Sender {
    fn new(lease: Duration, renewal: Duration) -> Self {
        Self {
            core: SenderCore::new(lease, renewal),
            lease,
            renewal,
            renewals: HashMap::new(),
            contested: HashSet::new(),
            keyed: HashSet::new(),
            refused: 0,
            entries: HashMap::new(),
            finished: BTreeSet::new(),
            held: HashMap::new(),
            freed: HashMap::new(),
            ended: BTreeSet::new(),
            irregular: BTreeSet::new(),
        }
    }

    fn update(&mut self, id: &ReqId, update: &SendUpdate, now: Instant) {
        self.core.handle_update(id, update, now);
        // The worker is given the request's renewal key with its update.
        self.core.set_renewal_key(id, KEY);
        if self.ended.contains(id) {
            self.irregular.insert(id.clone());
        }
        if !matches!(update, SendUpdate::Expect) {
            self.ended.insert(id.clone());
        }
        match update {
            SendUpdate::Expect => {
                self.entries.entry(id.clone()).or_insert(Entry::Expected);
            }
            SendUpdate::Ready { block_ids } => match self.entries.get(id) {
                Some(Entry::InFlight) => {}
                Some(Entry::Abandoned) => {
                    // Handed over and freed at once: no one will pull it.
                    *self.held.entry(id.clone()).or_default() += 1;
                    self.entries.remove(id);
                    self.renewals.remove(id);
                    self.contested.remove(id);
                    self.finished.insert(id.clone());
                }
                entry => {
                    // A second Ready replaces the first: one hold per request.
                    if !matches!(entry, Some(Entry::Ready { .. })) {
                        *self.held.entry(id.clone()).or_default() += 1;
                    }
                    self.entries
                        .insert(id.clone(), Entry::Ready { blocks: block_ids.clone(), lease_end: now + self.lease });
                }
            },
            SendUpdate::Forget => match self.entries.get(id) {
                None | Some(Entry::InFlight) => {}
                Some(Entry::Ready { .. }) => {
                    // The engine frees the blocks itself (it is told
                    // nothing): the hold ends without a report.
                    *self.held.entry(id.clone()).or_default() -= 1;
                    self.entries.remove(id);
                    self.renewals.remove(id);
                    self.contested.remove(id);
                }
                Some(Entry::Expected | Entry::Abandoned) => {
                    self.entries.remove(id);
                    self.renewals.remove(id);
                    self.contested.remove(id);
                }
            },
        }
        if matches!(self.entries.get(id), Some(Entry::Expected | Entry::Ready { .. })) {
            self.keyed.insert(id.clone());
        }
        self.check();
    }

    fn expire(&mut self, id: &ReqId) {
        self.entries.remove(id);
        self.renewals.remove(id);
        self.contested.remove(id);
        self.finished.insert(id.clone());
    }

    /// When a ready entry is freed unless claimed: its lease, or sooner its
    /// last renewal's end (unless two instances renewed it).
    fn ready_until(&self, id: &ReqId, lease_end: Instant) -> Instant {
        if self.contested.contains(id) {
            return lease_end;
        }
        self.renewals.get(id).map_or(lease_end, |(until, _)| (*until).min(lease_end))
    }

    fn renew(&mut self, id: &ReqId, by: &EngineId, wrong_key: bool, now: Instant) {
        let key = if wrong_key { WRONG_KEY } else { KEY };
        let got = self.core.renew(&[Renewing { req_id: id.clone(), key }], by, now);
        let held = matches!(self.entries.get(id), Some(Entry::Expected | Entry::Ready { .. }));
        // Only the request's key renews it: anything else moves nothing.
        let keyed = self.keyed.contains(id) && !wrong_key;
        if !self.renewal.is_zero() && held && !keyed {
            self.refused += 1;
        }
        let holds = held && keyed;
        // Only the first decode instance to renew a request renews it, and
        // a renewal never brings its end closer; a second one contests it.
        let someone_else = self.renewals.get(id).is_some_and(|(_, who)| who != by);
        if !self.renewal.is_zero() && holds && someone_else {
            self.contested.insert(id.clone());
        }
        let renewed = !self.renewal.is_zero() && holds && !someone_else && !self.contested.contains(id);
        if renewed {
            let until = self.renewals.get(id).map_or(now + self.renewal, |(u, _)| (*u).max(now + self.renewal));
            self.renewals.insert(id.clone(), (until, by.clone()));
        }
        assert_eq!(got, usize::from(renewed), "renewal of {id}");
        self.check();
    }

    fn renew_all_by(&mut self, by: &EngineId, now: Instant) {
        let got = self.core.renew_all_by(by, now);
        let mut expected = 0;
        if !self.renewal.is_zero() {
            let contested = &self.contested;
            for (_, (until, _)) in
                self.renewals.iter_mut().filter(|(id, (_, who))| who == by && !contested.contains(*id))
            {
                *until = (*until).max(now + self.renewal);
                expected += 1;
            }
        }
        assert_eq!(got, expected, "renewals on behalf of {by}");
        self.check();
    }

    fn claim(&mut self, id: &ReqId, now: Instant) {
        let got = self.core.claim(id, now);
        let expected = match self.entries.get(id).cloned() {
            None => Claim::Unknown,
            // The pull waiting for it holds it from now on, not renewals;
            // an abandoned one is waited for again.
            Some(entry @ (Entry::Expected | Entry::Abandoned)) => {
                // A waiting request keeps its key; an abandoned one had
                // none left (it is held for no renewal).
                if matches!(entry, Entry::Abandoned) {
                    self.keyed.remove(id);
                }
                self.entries.insert(id.clone(), Entry::Expected);
                self.renewals.remove(id);
                self.contested.remove(id);
                Claim::NotReady
            }
            Some(Entry::InFlight) => Claim::InFlight,
            Some(Entry::Ready { lease_end, .. }) if self.ready_until(id, lease_end) <= now => {
                self.expire(id);
                Claim::Expired
            }
            Some(Entry::Ready { blocks, .. }) => {
                self.entries.insert(id.clone(), Entry::InFlight);
                self.renewals.remove(id);
                self.contested.remove(id);
                Claim::Ready(blocks)
            }
        };
        assert_eq!(got, expected, "claim of {id}");
        self.check();
    }

    fn abandon(&mut self, id: &ReqId) {
        self.core.abandon(id);
        // Only a request not ready yet: a ready or in-flight one is left to
        // its lease or its transfer.
        if self.entries.get(id) == Some(&Entry::Expected) {
            self.entries.insert(id.clone(), Entry::Abandoned);
            self.renewals.remove(id);
            self.contested.remove(id);
        }
        self.check();
    }

    fn complete(&mut self, id: &ReqId) {
        self.core.complete(id);
        if self.entries.get(id) == Some(&Entry::InFlight) {
            self.entries.remove(id);
            self.finished.insert(id.clone());
        }
        self.check();
    }

    fn timeout(&mut self, now: Instant) {
        let got: BTreeSet<ReqId> = self.core.handle_timeout(now).into_iter().collect();
        let expired: BTreeSet<ReqId> = self
            .entries
            .iter()
            .filter(|(id, e)| matches!(e, Entry::Ready { lease_end, .. } if self.ready_until(id, *lease_end) <= now))
            .map(|(id, _)| id.clone())
            .collect();
        assert_eq!(got, expired, "expired leases at timeout");
        for id in &expired {
            self.expire(id);
        }
        self.check();
    }

    fn poll(&mut self) {
        let got = self.core.poll_finished();
        assert_eq!(got, std::mem::take(&mut self.finished), "finished sending");
        for id in got {
            if self.irregular.contains(&id) {
                continue;
            }
            assert!(!self.entries.contains_key(&id), "{id} reported finished while P still holds an entry for it");
            let freed = self.freed.entry(id.clone()).or_default();
            *freed += 1;
            let held = self.held.get(&id).copied().unwrap_or(0);
            assert!(*freed <= held, "{id}: blocks freed {freed} times, held {held} times");
        }
        assert!(self.core.poll_finished().is_empty(), "finished requests reported twice");
    }

    fn check(&self) {
        assert_eq!(self.core.len(), self.entries.len());
        assert_eq!(self.core.renewals_refused(), self.refused, "renewals refused");
        assert_eq!(self.core.is_empty(), self.entries.is_empty());
        let deadline = self
            .entries
            .iter()
            .filter_map(|(id, e)| match e {
                Entry::Ready { lease_end, .. } => Some(self.ready_until(id, *lease_end)),
                _ => None,
            })
            .min();
        assert_eq!(self.core.next_deadline(), deadline);
        assert_eq!(self.core.renewed(), self.renewals.len(), "requests held for a renewing decode instance");
    }
}

// ----------------------------------------------------------------- receiver

/// P's id of D's request `id` (engines never share ids).
fn on_prefill(id: &ReqId) -> ReqId {
    ReqId::new(format!("P{id}"))
}

#[derive(Debug, Clone)]
enum Decided {
    Replied(XferReply),
    Failed,
}

#[derive(Debug)]
struct Pull {
    /// The requests still pulled (cancelled ones leave).
    reqs: Vec<(ReqId, Vec<BlockId>)>,
    /// Every request the transfer request names, by P's id (P answers for these).
    named: Vec<ReqId>,
    /// P's id of each of D's requests in it.
    remote: HashMap<ReqId, ReqId>,
    deadline: Instant,
    grant: Option<GrantId>,
    decided: Option<Decided>,
    /// A request of it was cancelled: its grant covers freed blocks.
    lost: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum ReqState {
    InFlight,
    /// Reported at the next poll.
    Reportable,
}

/// The receiver under test and its model.
struct Receiver {
    core: ReceiverCore,
    tp_rank: u16,
    timeout: Duration,
    next_xfer_id: u64,
    /// Every transfer id handed out, in order (events pick from these).
    xfer_ids: Vec<u64>,
    pulls: HashMap<u64, Pull>,
    state: HashMap<ReqId, ReqState>,
    done: RecvFinished,
    /// Per request: pulls started for it, outcomes reported, and pulls
    /// cancelled (never reported).
    started: HashMap<ReqId, usize>,
    reported: HashMap<ReqId, usize>,
    cancelled: HashMap<ReqId, usize>,
}

impl Receiver {
    fn new(tp_rank: u16, timeout: Duration) -> Self {
        Self {
            core: ReceiverCore::new(tp_rank, timeout),
            tp_rank,
            timeout,
            next_xfer_id: 1,
            xfer_ids: Vec::new(),
            pulls: HashMap::new(),
            state: HashMap::new(),
            done: RecvFinished::default(),
            started: HashMap::new(),
            reported: HashMap::new(),
            cancelled: HashMap::new(),
        }
    }

    fn xfer(&self, x: Xfer) -> u64 {
        match x {
            Xfer::Known(i) if !self.xfer_ids.is_empty() => self.xfer_ids[usize::from(i) % self.xfer_ids.len()],
            Xfer::Known(_) => 0,
            Xfer::Unknown(id) => id.max(self.next_xfer_id),
        }
    }

    fn start(&mut self, reqs: &BTreeMap<ReqId, RecvReqMeta>, now: Instant) {
        let got = self.core.start(reqs, now);
        // (D's id, D's blocks), what is named to P (its id and engine), and
        // the token D's blocks start at.
        type Named = (ReqId, Vec<BlockId>, ReqId, Option<EngineId>, Option<u64>);
        let mut groups: BTreeMap<SideChannelAddr, Vec<Named>> = BTreeMap::new();
        for (id, meta) in reqs {
            if self.state.contains_key(id) {
                continue; // pulled again before its first was reported: ignored
            }
            *self.started.entry(id.clone()).or_default() += 1;
            match meta.remote.remote_port.checked_add(self.tp_rank) {
                None => {
                    // No pull can be made: failed at once (no grant exists).
                    self.done.failed.insert(id.clone(), meta.local_block_ids.clone());
                    self.state.insert(id.clone(), ReqState::Reportable);
                }
                Some(port) => {
                    let peer = SideChannelAddr { host: meta.remote.remote_host.clone(), port };
                    let group = groups.entry(peer).or_default();
                    let remote = &meta.remote.remote_request_id;
                    if group.iter().any(|(_, _, r, _, _)| r == remote) {
                        // Two of D's requests name one of P's: the later fails at once.
                        self.done.failed.insert(id.clone(), meta.local_block_ids.clone());
                        self.state.insert(id.clone(), ReqState::Reportable);
                        continue;
                    }
                    self.state.insert(id.clone(), ReqState::InFlight);
                    let engine = meta.remote.remote_engine_id.clone();
                    group.push((id.clone(), meta.local_block_ids.clone(), remote.clone(), engine, meta.first_token));
                }
            }
        }
        let deadline = now + self.timeout;
        let mut expected = Vec::new();
        for (peer, group) in groups {
            let xfer_id = self.next_xfer_id;
            self.next_xfer_id += 1;
            self.xfer_ids.push(xfer_id);
            // P is asked for its own id of each request.
            let requests = group
                .iter()
                .map(|(id, b, remote, engine, first_token)| RequestBlocks {
                    req_id: remote.clone(),
                    decode_req_id: Some(id.clone()),
                    prefill_engine_id: engine.clone(),
                    block_ids: b.clone(),
                    first_token: *first_token,
                    may_precede_prefill: false,
                })
                .collect();
            expected.push(PullBatch { xfer_id, peer, requests, deadline, heads: None });
            let named = group.iter().map(|(_, _, remote, _, _)| remote.clone()).collect();
            let remote = group.iter().map(|(id, _, remote, _, _)| (id.clone(), remote.clone())).collect();
            let reqs = group.into_iter().map(|(id, blocks, _, _, _)| (id, blocks)).collect();
            let pull = Pull { reqs, named, remote, deadline, grant: None, decided: None, lost: false };
            self.pulls.insert(xfer_id, pull);
        }
        assert_eq!(got, expected, "the pulls started");
        self.check();
    }

    fn granted(&mut self, xfer_id: u64, grant: GrantId) {
        let go = self.core.handle_granted(xfer_id, grant);
        let expected = match self.pulls.get_mut(&xfer_id) {
            Some(p) => {
                p.grant = Some(grant);
                p.decided.is_none() && !p.lost
            }
            None => false,
        };
        assert_eq!(go, expected, "whether pull {xfer_id} may go ahead");
        self.check();
        if !go {
            // The driver fails the pull (it is fenced later, like any other).
            self.batch_failed(xfer_id);
        }
    }

    /// The engine gave up on `reqs`: they are never reported, and every
    /// grant that covers their blocks is revoked before this returns (or
    /// is refused when it comes).
    fn cancel(&mut self, reqs: &[ReqId]) {
        let got = self.core.cancel(reqs);
        let mut expected = Vec::new();
        let mut hit = BTreeSet::new();
        for id in reqs {
            // A pull already ended and fenced needs no revocation; if its
            // outcome is not polled yet, it is never reported either.
            if self.state.get(id) == Some(&ReqState::Reportable) {
                self.state.remove(id);
                self.done.received.remove(id);
                self.done.failed.remove(id);
                *self.cancelled.entry(id.clone()).or_default() += 1;
                continue;
            }
            if self.state.get(id) != Some(&ReqState::InFlight) {
                continue;
            }
            self.state.remove(id);
            *self.cancelled.entry(id.clone()).or_default() += 1;
            for (xfer_id, p) in &mut self.pulls {
                let before = p.reqs.len();
                p.reqs.retain(|(r, _)| r != id);
                if p.reqs.len() < before {
                    hit.insert(*xfer_id);
                    p.lost = true;
                    if let Some(grant) = p.grant.filter(|g| !expected.contains(g)) {
                        expected.push(grant);
                    }
                }
            }
        }
        assert_eq!(got, expected, "the grants to revoke for cancelling {reqs:?}");
        // A grant over the blocks just cancelled is revoked now if it is
        // issued already; one issued later never goes out to P (the core
        // says no when it comes).
        for xfer_id in hit {
            if let Some(p) = self.pulls.get(&xfer_id).filter(|p| p.grant.is_some()) {
                assert!(p.grant.is_some_and(|g| got.contains(&g)), "pull {xfer_id}: its grant is not revoked");
            }
        }
        self.check();
    }

    fn reply(&mut self, reply: XferReply) {
        if let Some(p) = self.pulls.get_mut(&reply.xfer_id) {
            if p.decided.is_none() {
                p.decided = Some(Decided::Replied(reply.clone()));
            }
        }
        self.core.handle_reply(reply);
        self.check();
    }

    fn batch_failed(&mut self, xfer_id: u64) {
        self.core.handle_batch_failed(xfer_id, kv_proto::FailureCause::ConnectionLost, "connection lost");
        if let Some(p) = self.pulls.get_mut(&xfer_id) {
            if p.decided.is_none() {
                p.decided = Some(Decided::Failed);
            }
        }
        self.check();
    }

    fn timeout(&mut self, now: Instant) {
        let mut got = self.core.handle_timeout(now);
        got.sort_unstable_by_key(|(id, _)| *id);
        let mut expected = Vec::new();
        for (id, p) in &mut self.pulls {
            if p.decided.is_none() && p.deadline <= now {
                p.decided = Some(Decided::Failed);
                expected.push((*id, p.grant));
            }
        }
        expected.sort_unstable_by_key(|(id, _)| *id);
        assert_eq!(got, expected, "pulls to fence at timeout, with their grants");
        self.check();
    }

    fn fenced(&mut self, xfer_id: u64) {
        self.core.handle_fenced(xfer_id);
        if let Some(p) = self.pulls.remove(&xfer_id) {
            for (id, blocks) in p.reqs {
                assert_eq!(self.state.insert(id.clone(), ReqState::Reportable), Some(ReqState::InFlight));
                let done = match &p.decided {
                    // The last outcome the reply gives for the request decides.
                    Some(Decided::Replied(reply)) => {
                        let on_p = p.remote.get(&id);
                        reply
                            .outcomes
                            .iter()
                            .rev()
                            .find(|o| Some(&o.req_id) == on_p)
                            .is_some_and(|o| o.outcome == Outcome::Done)
                    }
                    Some(Decided::Failed) | None => false,
                };
                if done {
                    self.done.received.insert(id);
                } else {
                    self.done.failed.insert(id, blocks);
                }
            }
        }
        self.check();
    }

    fn poll(&mut self) -> RecvFinished {
        let got = self.core.poll_finished();
        let expected = std::mem::take(&mut self.done);
        assert_eq!(got, expected, "the outcomes reported");
        for id in got.received.iter().chain(got.failed.keys()) {
            assert!(
                !(got.received.contains(id) && got.failed.contains_key(id)),
                "{id} reported both received and failed"
            );
            assert_eq!(self.state.remove(id), Some(ReqState::Reportable), "{id} reported before its pull ended");
            let reported = self.reported.entry(id.clone()).or_default();
            *reported += 1;
            let ended = *reported + self.cancelled.get(id).copied().unwrap_or(0);
            assert!(
                ended <= self.started.get(id).copied().unwrap_or(0),
                "{id} reported or cancelled more often than pulled"
            );
        }
        let again = self.core.poll_finished();
        assert!(again.received.is_empty() && again.failed.is_empty(), "outcomes reported twice");
        got
    }

    fn check(&self) {
        let in_flight = self.state.values().filter(|s| **s == ReqState::InFlight).count();
        assert_eq!(self.core.in_flight(), in_flight);
        let deadline = self.pulls.values().filter(|p| p.decided.is_none()).map(|p| p.deadline).min();
        assert_eq!(self.core.next_deadline(), deadline);
        // Nothing decided is visible before its fence: the core holds it.
        assert!(self
            .pulls
            .values()
            .all(|p| p.reqs.iter().all(|(id, _)| self.state.get(id) == Some(&ReqState::InFlight))));
    }
}

// ------------------------------------------------------------------- target

/// One of the two decode instances that renew requests.
fn decode_engine(which: bool) -> EngineId {
    EngineId::new(if which { "d1" } else { "d0" })
}

/// Arbitrary event sequences through `ConnectorScheduler`, `SenderCore` and
/// `ReceiverCore`, with explicit time that only moves forward.
///
/// Each machine must agree with its model at every step (results, the
/// metadata of each step, claims, expiries, pulls started, grants to revoke,
/// outcomes reported, counters and deadlines). The invariants behind them,
/// checked on their own as well:
/// - scheduler: a request counted as external has its pull in the next
///   step's metadata (and a refused one counts none); at most one pull per
///   request; a cancellation names only a finished request whose pull went
///   out earlier; refused calls leave the request unchanged; no send entry
///   and no tracked pull is left once every request has finished;
/// - sender: for a request updated as a scheduler does (announced, then
///   ended once), it is reported finished sending (its blocks freed) only
///   when P no longer holds an entry for it, never while a transfer is
///   writing it, and exactly once per time its blocks were handed over
///   (at once, without a lease, when its puller gave up);
/// - receiver: nothing is reported before its pull was fenced (except a
///   pull that could not be made at all), a request is never both received
///   and failed, received only when P's reply said done, failed requests
///   carry exactly their blocks, a cancelled request is never reported and
///   the grant over its blocks is revoked before the cancellation returns
///   (or, issued later, never goes out), and, once every pull has ended
///   and been fenced, every request pulled was reported or cancelled
///   exactly once.
pub fn cores(data: &[u8]) {
    let Ok(input) = CoresInput::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let role = match input.role {
        ArbRole::Producer => KvRole::Producer,
        ArbRole::Consumer => KvRole::Consumer,
        ArbRole::Both => KvRole::Both,
    };
    let mut now = Instant::now();
    let timeout = Duration::from_millis(u64::from(input.transfer_timeout_ms) + 1);
    let lease = Duration::from_millis(u64::from(input.lease_ms) + 1);
    let mut sched = Sched::new(role, &input.requests);
    let renewal = Duration::from_millis(u64::from(input.renewal_ms));
    let mut sender = Sender::new(lease, renewal);
    let mut receiver = Receiver::new(input.tp_rank, timeout);

    // As the worker applies a step: send updates, then cancellations, then
    // new pulls.
    let feed = |meta: ConnectorMetadata, now: Instant, sender: &mut Sender, receiver: &mut Receiver| {
        for (id, update) in &meta.reqs_to_send {
            sender.update(id, update, now);
        }
        if !meta.reqs_to_cancel.is_empty() {
            let cancel: Vec<ReqId> = meta.reqs_to_cancel.iter().cloned().collect();
            receiver.cancel(&cancel);
            for id in &cancel {
                assert_ne!(
                    receiver.state.get(id),
                    Some(&ReqState::InFlight),
                    "{id} still pulled after its cancellation"
                );
            }
        }
        if !meta.reqs_to_recv.is_empty() {
            receiver.start(&meta.reqs_to_recv, now);
        }
    };

    for event in &input.events {
        match event {
            Event::Advance { ms } => now += Duration::from_millis(u64::from(*ms)),
            Event::ToDeadline { sender: which, offset } => {
                let deadline = if *which { sender.core.next_deadline() } else { receiver.core.next_deadline() };
                let tick = Duration::from_nanos(1);
                let target = deadline.and_then(|d| match offset {
                    Offset::Before => d.checked_sub(tick),
                    Offset::At => Some(d),
                    Offset::After => d.checked_add(tick),
                });
                if let Some(t) = target.filter(|t| *t > now) {
                    now = t;
                }
            }
            Event::Alloc { i, num_computed, blocks } => {
                sched.alloc(usize::from(*i) % POOL, usize::from(*num_computed), blocks);
            }
            Event::Finish { i, how, blocks } => sched.finish(usize::from(*i) % POOL, (*how).into(), blocks),
            Event::Build => {
                let meta = sched.build();
                feed(meta, now, &mut sender, &mut receiver);
            }
            Event::Update { req, update } => {
                let id = pool_id(if *req >= 128 { 's' } else { 'p' }, *req);
                sender.update(&id, &update.into(), now);
            }
            Event::Claim { req } => sender.claim(&pool_id(if *req >= 128 { 's' } else { 'p' }, *req), now),
            Event::Complete { req } => sender.complete(&pool_id(if *req >= 128 { 's' } else { 'p' }, *req)),
            Event::Abandon { req } => sender.abandon(&pool_id(if *req >= 128 { 's' } else { 'p' }, *req)),
            Event::Renew { req, by, wrong_key } => {
                let id = pool_id(if *req >= 128 { 's' } else { 'p' }, *req);
                sender.renew(&id, &decode_engine(*by), *wrong_key, now);
            }
            Event::RenewAllBy { by } => sender.renew_all_by(&decode_engine(*by), now),
            Event::SenderTimeout => sender.timeout(now),
            Event::SenderPoll => sender.poll(),
            Event::Start { reqs } => {
                let reqs: BTreeMap<ReqId, RecvReqMeta> = reqs
                    .iter()
                    .map(|(i, host, port, blocks)| {
                        let id = pool_id('d', *i);
                        let remote = RemotePrefill {
                            remote_host: host.name(),
                            remote_port: port.get(),
                            remote_request_id: on_prefill(&id),
                            remote_engine_id: None,
                            remote_renewal_key: None,
                            bootstrap: None,
                        };
                        (id, RecvReqMeta { local_block_ids: blocks.clone(), first_token: None, remote })
                    })
                    .collect();
                receiver.start(&reqs, now);
            }
            Event::Granted { xfer, grant } => {
                let id = receiver.xfer(*xfer);
                receiver.granted(id, GrantId::from_bytes([*grant; 16]));
            }
            Event::Cancel { reqs } => {
                let reqs: Vec<ReqId> = reqs.iter().map(|i| pool_id('d', *i)).collect();
                receiver.cancel(&reqs);
            }
            Event::Reply { xfer, outcomes } => {
                let xfer_id = receiver.xfer(*xfer);
                // P answers for every request it was asked for, cancelled
                // ones included (it knows nothing of the cancellation).
                let batch: Vec<ReqId> = receiver.pulls.get(&xfer_id).map(|p| p.named.clone()).unwrap_or_default();
                let outcomes = outcomes
                    .iter()
                    .map(|&(n, stray, done)| RequestOutcome {
                        req_id: if stray || batch.is_empty() {
                            pool_id('x', n)
                        } else {
                            batch[usize::from(n) % batch.len()].clone()
                        },
                        outcome: if done {
                            Outcome::Done
                        } else {
                            Outcome::Failed { cause: kv_proto::FailureCause::Other, reason: "no".to_owned() }
                        },
                    })
                    .collect();
                receiver.reply(XferReply { xfer_id, outcomes });
            }
            Event::BatchFailed { xfer } => {
                let id = receiver.xfer(*xfer);
                receiver.batch_failed(id);
            }
            Event::ReceiverTimeout => receiver.timeout(now),
            Event::Fenced { xfer } => {
                let id = receiver.xfer(*xfer);
                receiver.fenced(id);
            }
            Event::ReceiverPoll { tell_scheduler } => {
                let done = receiver.poll();
                if *tell_scheduler {
                    for id in done.received.iter().chain(done.failed.keys()) {
                        if id.as_str().starts_with('s') {
                            sched.pull_finished(id);
                        }
                    }
                }
            }
        }
    }

    // The end: every request finishes, the last step goes out, every pull
    // times out and is fenced, every transfer ends, every lease runs out.
    for i in 0..POOL {
        sched.finish(i, RequestStatus::FinishedAborted, &[1]);
    }
    let meta = sched.build();
    feed(meta, now, &mut sender, &mut receiver);
    assert_eq!(sched.s.live_send_entries(), 0, "send entries left after every request finished");
    assert_eq!(sched.s.live_pulls(), 0, "pulls tracked after every request finished");
    assert!(sched.s.build_connector_meta().is_empty());

    now += timeout + lease;
    receiver.timeout(now);
    let xfer_ids: Vec<u64> = receiver.pulls.keys().copied().collect();
    for id in xfer_ids {
        receiver.fenced(id);
    }
    receiver.poll();
    assert_eq!(receiver.core.in_flight(), 0);
    assert_eq!(receiver.core.next_deadline(), None);
    for (id, started) in &receiver.started {
        let reported = receiver.reported.get(id).copied().unwrap_or(0);
        let cancelled = receiver.cancelled.get(id).copied().unwrap_or(0);
        assert_eq!(
            reported + cancelled,
            *started,
            "{id}: pulled {started} times, reported {reported} times, cancelled {cancelled} times"
        );
    }

    let in_flight: Vec<ReqId> =
        sender.entries.iter().filter(|(_, e)| **e == Entry::InFlight).map(|(id, _)| id.clone()).collect();
    for id in in_flight {
        sender.complete(&id);
    }
    sender.timeout(now);
    sender.poll();
    assert!(
        sender.entries.values().all(|e| matches!(e, Entry::Expected | Entry::Abandoned)),
        "only entries the scheduler owns remain"
    );
    for (id, held) in sender.held.iter().filter(|(id, _)| !sender.irregular.contains(*id)) {
        let freed = sender.freed.get(id).copied().unwrap_or(0);
        assert_eq!(freed, *held, "{id}: blocks held {held} times, freed {freed} times");
    }
}
