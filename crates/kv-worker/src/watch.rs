//! D's watch list (sans-IO): the requests the engine has seen and will pull,
//! grouped by the prefill workers they will be pulled from, whose hold on
//! P the worker renews until their pull goes out or they finish. Watched by
//! D's id, renewed by P's.

use std::collections::{BTreeMap, HashMap};

use kv_proto::{RemotePrefill, RenewalKey, Renewing, ReqId};

use crate::receiver::SideChannelAddr;

/// Watched requests by prefill worker.
#[derive(Debug, Default)]
pub struct WatchList {
    /// P's ids of the watched requests, by prefill worker, each with its
    /// renewal key and the number of D's requests naming it (a proxy may
    /// send one twice).
    by_peer: BTreeMap<SideChannelAddr, BTreeMap<ReqId, (RenewalKey, usize)>>,
    /// D's id to what it is watched as.
    peer_of: HashMap<ReqId, Watched>,
}

/// One watched request of D.
#[derive(Debug)]
struct Watched {
    /// The prefill instance it names (the address of its first worker).
    instance: SideChannelAddr,
    /// The prefill workers it is renewed on.
    peers: Vec<SideChannelAddr>,
    /// P's id of it.
    remote: ReqId,
    /// Its renewal key.
    key: RenewalKey,
}

impl WatchList {
    /// An empty watch list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts renewing `req` of `remote` on `peers`, the prefill workers it
    /// will be pulled from (see [`crate::ReceiverCore::renewal_peers`]).
    /// With no peer (a port past 65535: the pull will fail the same way) it
    /// is not watched; nor without a renewal key (P's params carried none:
    /// P would ignore the renewals, and holds it for its whole lease).
    pub fn watch(&mut self, req: &ReqId, remote: &RemotePrefill, peers: Vec<SideChannelAddr>) {
        if peers.is_empty() {
            tracing::warn!(req_id = %req, remote_port = remote.remote_port, "prefill port out of range; not watched");
            return;
        }
        let Some(key) = remote.remote_renewal_key else {
            tracing::debug!(req_id = %req, "prefill gave no renewal key; not renewed");
            return;
        };
        self.unwatch(req);
        let instance = SideChannelAddr { host: remote.remote_host.clone(), port: remote.remote_port };
        self.insert(req.clone(), Watched { instance, peers, remote: remote.remote_request_id.clone(), key });
    }

    /// `instance` was learned: every request of it is renewed on `peers`
    /// from now on (the prefill workers its pulls use), wherever it was
    /// renewed before. Returns how many requests moved.
    pub fn repoint(&mut self, instance: &SideChannelAddr, peers: &[SideChannelAddr]) -> usize {
        if peers.is_empty() {
            return 0;
        }
        let moved: Vec<ReqId> = self
            .peer_of
            .iter()
            .filter(|(_, watched)| &watched.instance == instance && watched.peers != peers)
            .map(|(req, _)| req.clone())
            .collect();
        for req in &moved {
            if let Some(watched) = self.remove(req) {
                self.insert(req.clone(), Watched { peers: peers.to_vec(), ..watched });
            }
        }
        moved.len()
    }

    /// Stops renewing `req` (unknown ids are ignored).
    pub fn unwatch(&mut self, req: &ReqId) {
        self.remove(req);
    }

    fn insert(&mut self, req: ReqId, watched: Watched) {
        for peer in &watched.peers {
            let named = self.by_peer.entry(peer.clone()).or_default().entry(watched.remote.clone());
            let (key, count) = named.or_insert((watched.key, 0));
            // The latest params P gave for it name its key.
            *key = watched.key;
            *count += 1;
        }
        self.peer_of.insert(req, watched);
    }

    fn remove(&mut self, req: &ReqId) -> Option<Watched> {
        let watched = self.peer_of.remove(req)?;
        let Watched { peers, remote, .. } = &watched;
        for peer in peers {
            if let Some(reqs) = self.by_peer.get_mut(peer) {
                if let Some((_, count)) = reqs.get_mut(remote) {
                    *count -= 1;
                    if *count == 0 {
                        reqs.remove(remote);
                    }
                }
                if reqs.is_empty() {
                    self.by_peer.remove(peer);
                }
            }
        }
        Some(watched)
    }

    /// Whether any request is watched on `peer`.
    pub fn watches_on(&self, peer: &SideChannelAddr) -> bool {
        self.by_peer.contains_key(peer)
    }

    /// Every prefill worker with watched requests, and P's ids of them
    /// with their renewal keys.
    pub fn by_peer(&self) -> impl Iterator<Item = (&SideChannelAddr, Vec<Renewing>)> {
        self.by_peer.iter().map(|(peer, reqs)| {
            (peer, reqs.iter().map(|(req_id, (key, _))| Renewing { req_id: req_id.clone(), key: *key }).collect())
        })
    }

    /// Watched requests.
    pub fn len(&self) -> usize {
        self.peer_of.len()
    }

    /// Whether nothing is watched.
    pub fn is_empty(&self) -> bool {
        self.peer_of.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// P's id of request `a` is `p-a`, and so on.
    fn remote(host: &str, port: u16) -> RemotePrefill {
        RemotePrefill {
            remote_host: host.to_owned(),
            remote_port: port,
            remote_request_id: ReqId::new("p-?"),
            remote_engine_id: None,
            remote_renewal_key: Some(RenewalKey::from_bytes([1; 16])),
            bootstrap: None,
        }
    }

    /// Watches on the worker of rank 2 of that instance.
    fn watch(list: &mut WatchList, req: &str, host: &str, port: u16) {
        let remote = RemotePrefill { remote_request_id: ReqId::new(format!("p-{req}")), ..remote(host, port) };
        list.watch(&ReqId::new(req), &remote, vec![at(host, port + 2)]);
    }

    fn at(host: &str, port: u16) -> SideChannelAddr {
        SideChannelAddr { host: host.to_owned(), port }
    }

    fn peers(list: &WatchList) -> Vec<(String, Vec<String>)> {
        list.by_peer().map(|(p, reqs)| (p.to_string(), reqs.iter().map(|r| r.req_id.to_string()).collect())).collect()
    }

    fn named(peer: &str, reqs: &[&str]) -> (String, Vec<String>) {
        (peer.to_owned(), reqs.iter().map(|r| (*r).to_owned()).collect())
    }

    #[test]
    fn groups_by_the_prefill_worker_of_this_rank() {
        let mut list = WatchList::new();
        watch(&mut list, "a", "p1", 8000);
        watch(&mut list, "b", "p1", 8000);
        watch(&mut list, "c", "p2", 8000);
        assert_eq!(peers(&list), [named("p1:8002", &["p-a", "p-b"]), named("p2:8002", &["p-c"])]);
        list.unwatch(&ReqId::new("a"));
        list.unwatch(&ReqId::new("c"));
        list.unwatch(&ReqId::new("never"));
        list.unwatch(&ReqId::new("p-b"));
        assert_eq!(peers(&list), [named("p1:8002", &["p-b"])], "unwatched by D's id, not P's");
        assert_eq!(list.len(), 1);
    }

    #[test]
    fn a_request_watched_again_moves_to_its_new_prefill() {
        let mut list = WatchList::new();
        watch(&mut list, "a", "p1", 8000);
        watch(&mut list, "a", "p2", 9000);
        assert_eq!(peers(&list), [named("p2:9002", &["p-a"])]);
        list.unwatch(&ReqId::new("a"));
        assert!(list.is_empty());
        assert_eq!(list.by_peer().count(), 0);
    }

    #[test]
    fn a_prefill_request_two_of_ds_requests_name_is_renewed_until_both_end() {
        let mut list = WatchList::new();
        let remote = remote("p1", 8000);
        list.watch(&ReqId::new("a"), &remote, vec![at("p1", 8000)]);
        list.watch(&ReqId::new("b"), &remote, vec![at("p1", 8000)]);
        assert_eq!(peers(&list), [named("p1:8000", &["p-?"])]);
        list.unwatch(&ReqId::new("a"));
        assert_eq!(peers(&list), [named("p1:8000", &["p-?"])]);
        list.unwatch(&ReqId::new("b"));
        assert!(peers(&list).is_empty());
    }

    #[test]
    fn a_request_is_renewed_with_its_key_and_not_at_all_without_one() {
        let mut list = WatchList::new();
        let keyed = RemotePrefill { remote_renewal_key: Some(RenewalKey::from_bytes([5; 16])), ..remote("p1", 8000) };
        list.watch(&ReqId::new("a"), &keyed, vec![at("p1", 8000)]);
        let keyless = RemotePrefill { remote_renewal_key: None, ..remote("p1", 9000) };
        list.watch(&ReqId::new("b"), &keyless, vec![at("p1", 9000)]);
        let renewals: Vec<_> = list.by_peer().collect();
        assert_eq!(renewals.len(), 1, "P would ignore a renewal without a key: none is sent");
        assert_eq!(renewals[0].1, [Renewing { req_id: ReqId::new("p-?"), key: RenewalKey::from_bytes([5; 16]) }]);
        assert_eq!(list.len(), 1);
    }

    #[test]
    fn an_unreachable_port_is_not_watched() {
        let mut list = WatchList::new();
        list.watch(&ReqId::new("a"), &remote("p1", u16::MAX), Vec::new());
        assert!(list.is_empty());
    }

    #[test]
    fn a_learned_instance_moves_its_requests_to_the_workers_its_pulls_use() {
        let mut list = WatchList::new();
        watch(&mut list, "a", "p1", 8000);
        watch(&mut list, "b", "p1", 8000);
        watch(&mut list, "c", "p2", 8000);
        let learned = [at("p1", 8000), at("p1", 8001)];
        assert_eq!(list.repoint(&at("p1", 8000), &learned), 2);
        assert_eq!(
            peers(&list),
            [named("p1:8000", &["p-a", "p-b"]), named("p1:8001", &["p-a", "p-b"]), named("p2:8002", &["p-c"])],
            "the old guess (p1:8002) is gone, the other instance untouched"
        );
        assert_eq!(list.repoint(&at("p1", 8000), &learned), 0, "already there");
        assert_eq!(list.repoint(&at("p2", 8000), &[]), 0, "no peer: left where it is");
        list.unwatch(&ReqId::new("a"));
        list.unwatch(&ReqId::new("b"));
        assert_eq!(peers(&list), [named("p2:8002", &["p-c"])]);
    }

    #[test]
    fn a_request_pulled_from_several_prefill_workers_is_renewed_on_each() {
        let mut list = WatchList::new();
        list.watch(&ReqId::new("a"), &remote("p1", 8000), vec![at("p1", 8000), at("p1", 8001)]);
        assert_eq!(peers(&list), [named("p1:8000", &["p-?"]), named("p1:8001", &["p-?"])]);
        list.unwatch(&ReqId::new("a"));
        assert!(list.is_empty() && peers(&list).is_empty());
    }
}
