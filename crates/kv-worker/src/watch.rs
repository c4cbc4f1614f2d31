//! D's watch list (sans-IO): the requests the engine has seen and will pull,
//! grouped by the prefill side channel they come from, whose hold on P the
//! worker renews until their pull goes out or they finish.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kv_proto::{RemotePrefill, ReqId};

use crate::receiver::SideChannelAddr;

/// Watched requests by prefill worker.
#[derive(Debug)]
pub struct WatchList {
    tp_rank: u16,
    by_peer: BTreeMap<SideChannelAddr, BTreeSet<ReqId>>,
    peer_of: HashMap<ReqId, SideChannelAddr>,
}

impl WatchList {
    /// The watch list of tensor-parallel rank `tp_rank` (it renews on the
    /// prefill worker of the same rank: base port plus rank).
    pub fn new(tp_rank: u16) -> Self {
        Self { tp_rank, by_peer: BTreeMap::new(), peer_of: HashMap::new() }
    }

    /// Starts renewing `req` on `remote`. A port past 65535 cannot be
    /// reached (the pull will fail the same way); it is not watched.
    pub fn watch(&mut self, req: &ReqId, remote: &RemotePrefill) {
        let Some(port) = remote.remote_port.checked_add(self.tp_rank) else {
            tracing::warn!(req_id = %req, remote_port = remote.remote_port, "prefill port out of range; not watched");
            return;
        };
        self.unwatch(req);
        let peer = SideChannelAddr { host: remote.remote_host.clone(), port };
        self.by_peer.entry(peer.clone()).or_default().insert(req.clone());
        self.peer_of.insert(req.clone(), peer);
    }

    /// Stops renewing `req` (unknown ids are ignored).
    pub fn unwatch(&mut self, req: &ReqId) {
        let Some(peer) = self.peer_of.remove(req) else {
            return;
        };
        if let Some(reqs) = self.by_peer.get_mut(&peer) {
            reqs.remove(req);
            if reqs.is_empty() {
                self.by_peer.remove(&peer);
            }
        }
    }

    /// Every prefill worker with watched requests, and those requests.
    pub fn by_peer(&self) -> impl Iterator<Item = (&SideChannelAddr, &BTreeSet<ReqId>)> {
        self.by_peer.iter()
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

    fn remote(host: &str, port: u16) -> RemotePrefill {
        RemotePrefill { remote_host: host.to_owned(), remote_port: port }
    }

    fn peers(list: &WatchList) -> Vec<(String, Vec<&str>)> {
        list.by_peer().map(|(p, reqs)| (p.to_string(), reqs.iter().map(ReqId::as_str).collect())).collect()
    }

    #[test]
    fn groups_by_the_prefill_worker_of_this_rank() {
        let mut list = WatchList::new(2);
        list.watch(&ReqId::new("a"), &remote("p1", 8000));
        list.watch(&ReqId::new("b"), &remote("p1", 8000));
        list.watch(&ReqId::new("c"), &remote("p2", 8000));
        assert_eq!(peers(&list), [("p1:8002".to_owned(), vec!["a", "b"]), ("p2:8002".to_owned(), vec!["c"])]);
        list.unwatch(&ReqId::new("a"));
        list.unwatch(&ReqId::new("c"));
        list.unwatch(&ReqId::new("never"));
        assert_eq!(peers(&list), [("p1:8002".to_owned(), vec!["b"])]);
        assert_eq!(list.len(), 1);
    }

    #[test]
    fn a_request_watched_again_moves_to_its_new_prefill() {
        let mut list = WatchList::new(0);
        list.watch(&ReqId::new("a"), &remote("p1", 8000));
        list.watch(&ReqId::new("a"), &remote("p2", 9000));
        assert_eq!(peers(&list), [("p2:9000".to_owned(), vec!["a"])]);
        list.unwatch(&ReqId::new("a"));
        assert!(list.is_empty());
        assert_eq!(list.by_peer().count(), 0);
    }

    #[test]
    fn an_unreachable_port_is_not_watched() {
        let mut list = WatchList::new(1);
        list.watch(&ReqId::new("a"), &remote("p1", u16::MAX));
        assert!(list.is_empty());
    }
}
