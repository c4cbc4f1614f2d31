//! Where D learns a prefill engine's side channel in the bootstrap flow
//! (sans-IO, explicit time): the router names P by its bootstrap server
//! and engine id, not by a side channel, so each such engine is looked up
//! once on that server. Until the answer comes, the requests naming it
//! (pulls, watches, releases) wait here; then each goes on with P's side
//! channel filled in, or a pull fails with the reason. A failed lookup is
//! the answer for [`FAILURE_MEMORY`] (pulls fail at once, without asking
//! again); a found address is kept, as engine ids are fresh per start.
//! The driver asks the server ([`Directory::take_lookups`]) and reports
//! back ([`Directory::handle_found`]); it never decides.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kv_proto::{BootstrapTarget, RecvReqMeta, RemotePrefill, ReqId};

use crate::receiver::SideChannelAddr;

/// How long a failed lookup is taken as the answer.
pub(crate) const FAILURE_MEMORY: Duration = Duration::from_secs(5);
/// Engines whose address is kept; past it the whole table is dropped
/// (looked up again as needed): a decode instance that meets more prefill
/// engines than this has restarted prefills many times over.
pub(crate) const MAX_KNOWN_ENGINES: usize = 4096;

/// Something that names a prefill engine by its bootstrap server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Parked {
    /// A pull, which arrived at `at` (its deadline counts from then).
    Pull { req: ReqId, meta: RecvReqMeta, at: Instant },
    /// A request D renews P's hold on until it pulls it.
    Watch { req: ReqId, remote: RemotePrefill },
    /// A request D tells P to let go of.
    Release { req: ReqId, remote: RemotePrefill },
}

impl Parked {
    fn req(&self) -> &ReqId {
        match self {
            Parked::Pull { req, .. } | Parked::Watch { req, .. } | Parked::Release { req, .. } => req,
        }
    }

    fn remote_mut(&mut self) -> &mut RemotePrefill {
        match self {
            Parked::Pull { meta, .. } => &mut meta.remote,
            Parked::Watch { remote, .. } | Parked::Release { remote, .. } => remote,
        }
    }

    /// With P's side channel filled in.
    fn at(mut self, addr: &SideChannelAddr) -> Parked {
        let remote = self.remote_mut();
        remote.remote_host.clone_from(&addr.host);
        remote.remote_port = addr.port;
        self
    }
}

#[derive(Debug)]
enum Entry {
    Looking { waiting: Vec<Parked> },
    Found(SideChannelAddr),
    Failed { until: Instant, reason: String },
}

/// What became of something placed in the directory.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Placed {
    /// P's side channel is known: filled in, it goes on now.
    Ready(Parked),
    /// It waits for the lookup.
    Waiting,
    /// The lookup failed lately: a pull fails with this reason.
    Failed(Parked, String),
}

/// The bootstrap lookups of one decode worker.
#[derive(Debug, Default)]
pub(crate) struct Directory {
    entries: HashMap<BootstrapTarget, Entry>,
    to_look_up: Vec<BootstrapTarget>,
}

impl Directory {
    /// Places `parked`, which names P by `target`: ready when P's side
    /// channel is known, else waiting (a lookup starts if none is out).
    pub(crate) fn place(&mut self, target: &BootstrapTarget, parked: Parked, now: Instant) -> Placed {
        let stale = matches!(self.entries.get(target), Some(Entry::Failed { until, .. }) if *until <= now);
        if stale {
            self.entries.remove(target);
        }
        match self.entries.get_mut(target) {
            Some(Entry::Found(addr)) => Placed::Ready(parked.at(addr)),
            Some(Entry::Failed { reason, .. }) => Placed::Failed(parked, reason.clone()),
            Some(Entry::Looking { waiting }) => {
                waiting.push(parked);
                Placed::Waiting
            }
            None => {
                self.entries.insert(target.clone(), Entry::Looking { waiting: vec![parked] });
                self.to_look_up.push(target.clone());
                Placed::Waiting
            }
        }
    }

    /// The lookups to start (each once).
    pub(crate) fn take_lookups(&mut self) -> Vec<BootstrapTarget> {
        std::mem::take(&mut self.to_look_up)
    }

    /// The lookup of `target` ended: P's side channel, or why not. Returns
    /// what waited for it: ready (filled in) or failed with the reason.
    pub(crate) fn handle_found(
        &mut self,
        target: &BootstrapTarget,
        found: Result<SideChannelAddr, String>,
        now: Instant,
    ) -> Vec<Placed> {
        let waiting = match self.entries.remove(target) {
            Some(Entry::Looking { waiting }) => waiting,
            Some(other) => {
                self.entries.insert(target.clone(), other);
                return Vec::new();
            }
            None => Vec::new(),
        };
        match found {
            Ok(addr) => {
                if self.entries.len() >= MAX_KNOWN_ENGINES {
                    self.entries.retain(|_, e| matches!(e, Entry::Looking { .. }));
                }
                let placed = waiting.into_iter().map(|p| Placed::Ready(p.at(&addr))).collect();
                self.entries.insert(target.clone(), Entry::Found(addr));
                placed
            }
            Err(reason) => {
                let placed = waiting.into_iter().map(|p| Placed::Failed(p, reason.clone())).collect();
                self.entries.insert(target.clone(), Entry::Failed { until: now + FAILURE_MEMORY, reason });
                placed
            }
        }
    }

    /// Drops what waits for `req` (its pull was cancelled, or its watch
    /// ended): it never goes on, and a pull of it is never reported.
    pub(crate) fn withdraw(&mut self, req: &ReqId, pulls: bool) {
        for entry in self.entries.values_mut() {
            if let Entry::Looking { waiting } = entry {
                waiting.retain(|p| p.req() != req || matches!(p, Parked::Pull { .. }) != pulls);
            }
        }
    }

    /// Whether something waits for a lookup (and may have to be withdrawn).
    pub(crate) fn has_waiting(&self) -> bool {
        self.entries.values().any(|e| matches!(e, Entry::Looking { .. }))
    }

    /// Pulls waiting for a lookup.
    #[cfg(test)]
    pub(crate) fn waiting_pulls(&self) -> usize {
        self.entries
            .values()
            .map(|e| match e {
                Entry::Looking { waiting } => waiting.iter().filter(|p| matches!(p, Parked::Pull { .. })).count(),
                _ => 0,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use kv_proto::EngineId;
    use rstest::rstest;

    use super::*;

    fn target(engine: &str) -> BootstrapTarget {
        BootstrapTarget { url: "http://10.0.0.1:8998".into(), engine_id: EngineId::new(engine) }
    }

    fn remote(engine: &str) -> RemotePrefill {
        RemotePrefill {
            remote_host: String::new(),
            remote_port: 0,
            remote_request_id: ReqId::new("xfer-1"),
            remote_engine_id: Some(EngineId::new(engine)),
            remote_renewal_key: None,
            bootstrap: Some(target(engine)),
        }
    }

    fn pull(req: &str, at: Instant) -> Parked {
        let meta = RecvReqMeta { local_block_ids: vec![1, 2], first_token: None, remote: remote("p") };
        Parked::Pull { req: ReqId::new(req), meta, at }
    }

    fn addr() -> SideChannelAddr {
        SideChannelAddr { host: "10.0.0.1".into(), port: 7000 }
    }

    #[test]
    fn waiters_go_on_with_the_found_address_and_later_ones_at_once() {
        let (mut dir, t0) = (Directory::default(), Instant::now());
        assert_eq!(dir.place(&target("p"), pull("a", t0), t0), Placed::Waiting);
        let watch = Parked::Watch { req: ReqId::new("b"), remote: remote("p") };
        assert_eq!(dir.place(&target("p"), watch, t0), Placed::Waiting);
        assert_eq!(dir.take_lookups(), vec![target("p")], "one lookup for both");
        assert!(dir.take_lookups().is_empty());
        let placed = dir.handle_found(&target("p"), Ok(addr()), t0);
        assert_eq!(placed.len(), 2);
        for p in placed {
            let Placed::Ready(mut p) = p else { panic!("{p:?}") };
            let remote = p.remote_mut();
            assert_eq!((remote.remote_host.as_str(), remote.remote_port), ("10.0.0.1", 7000));
        }
        assert!(matches!(dir.place(&target("p"), pull("c", t0), t0), Placed::Ready(Parked::Pull { .. })));
        assert!(dir.take_lookups().is_empty(), "a found address is kept");
    }

    #[rstest]
    #[case::within_the_memory(Duration::from_secs(1), false)]
    #[case::past_it(FAILURE_MEMORY, true)]
    fn a_failed_lookup_is_the_answer_for_a_while(#[case] later: Duration, #[case] asks_again: bool) {
        let (mut dir, t0) = (Directory::default(), Instant::now());
        dir.place(&target("p"), pull("a", t0), t0);
        dir.take_lookups();
        let placed = dir.handle_found(&target("p"), Err("refused".into()), t0);
        assert!(matches!(&placed[..], [Placed::Failed(Parked::Pull { .. }, reason)] if reason == "refused"));
        let again = dir.place(&target("p"), pull("b", t0 + later), t0 + later);
        assert_eq!(matches!(again, Placed::Waiting), asks_again);
        assert_eq!(dir.take_lookups().len(), usize::from(asks_again));
    }

    #[test]
    fn a_withdrawn_pull_never_goes_on() {
        let (mut dir, t0) = (Directory::default(), Instant::now());
        dir.place(&target("p"), pull("a", t0), t0);
        dir.place(&target("p"), Parked::Watch { req: ReqId::new("a"), remote: remote("p") }, t0);
        dir.withdraw(&ReqId::new("a"), true);
        assert_eq!(dir.waiting_pulls(), 0);
        let placed = dir.handle_found(&target("p"), Ok(addr()), t0);
        assert!(matches!(&placed[..], [Placed::Ready(Parked::Watch { .. })]), "the watch stays: {placed:?}");
    }

    #[test]
    fn engines_are_looked_up_apart() {
        let (mut dir, t0) = (Directory::default(), Instant::now());
        dir.place(&target("p"), pull("a", t0), t0);
        dir.place(&target("q"), pull("b", t0), t0);
        assert_eq!(dir.take_lookups().len(), 2);
        assert!(dir.handle_found(&target("q"), Err("no such engine".into()), t0).len() == 1);
        assert_eq!(dir.waiting_pulls(), 1);
    }
}
