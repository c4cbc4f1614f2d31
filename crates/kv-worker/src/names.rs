//! P's names for requests (sans-IO): in the bootstrap flow a send entry is
//! named by the router's transfer id, the name D pulls it by, while the
//! engine knows the request by its own id. The worker keeps which engine
//! id each such entry stands for, from the metadata that announces it
//! until the request is reported finished, and reports it under the
//! engine's id. Requests named by the engine's own id pass unchanged.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kv_proto::{ReqId, SendUpdate};

/// The engine's id of each send entry named otherwise.
#[derive(Debug, Default)]
pub(crate) struct SendNames {
    engine_ids: HashMap<ReqId, ReqId>,
}

impl SendNames {
    /// Records one step's names (`send_names`, by entry name) beside its
    /// updates: an entry dropped without a send (`Forget`) is never
    /// reported, so its name is not kept.
    pub(crate) fn record(&mut self, names: &BTreeMap<ReqId, ReqId>, updates: &BTreeMap<ReqId, SendUpdate>) {
        for (name, engine_id) in names {
            if matches!(updates.get(name), Some(SendUpdate::Forget)) {
                self.engine_ids.remove(name);
            } else {
                self.engine_ids.insert(name.clone(), engine_id.clone());
            }
        }
    }

    /// `finished` (entry names) as the engine names them; each name is
    /// forgotten once reported.
    pub(crate) fn for_engine(&mut self, finished: BTreeSet<ReqId>) -> BTreeSet<ReqId> {
        if self.engine_ids.is_empty() {
            return finished;
        }
        finished.into_iter().map(|name| self.engine_ids.remove(&name).unwrap_or(name)).collect()
    }

    /// Entries named otherwise and not yet reported.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.engine_ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ReqId {
        ReqId::new(s)
    }

    #[test]
    fn a_transfer_named_entry_is_reported_under_the_engines_id_once() {
        let mut names = SendNames::default();
        let updates = BTreeMap::from([(id("xfer-1"), SendUpdate::Expect)]);
        names.record(&BTreeMap::from([(id("xfer-1"), id("cmpl-a"))]), &updates);
        let reported = names.for_engine(BTreeSet::from([id("xfer-1"), id("cmpl-b")]));
        assert_eq!(reported, BTreeSet::from([id("cmpl-a"), id("cmpl-b")]));
        assert_eq!(names.len(), 0);
        assert_eq!(names.for_engine(BTreeSet::from([id("xfer-1")])), BTreeSet::from([id("xfer-1")]));
    }

    #[test]
    fn a_forgotten_entry_keeps_no_name() {
        let mut names = SendNames::default();
        let expect = BTreeMap::from([(id("xfer-1"), SendUpdate::Expect)]);
        let map = BTreeMap::from([(id("xfer-1"), id("cmpl-a"))]);
        names.record(&map, &expect);
        names.record(&map, &BTreeMap::from([(id("xfer-1"), SendUpdate::Forget)]));
        assert_eq!(names.len(), 0);
    }
}
