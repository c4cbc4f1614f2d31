//! [`EstablishedPlaces`]: a listener's places for connections whose
//! handshake (and, with a shared secret, its proof) succeeded, and the one
//! rate-limited line about a peer refused one. Taken once, where each
//! listener's handshake decides (TCP's and QUIC's data planes, RDMA's
//! control port, the side channel); the wire's own refusal stays with the
//! listener.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{ListenerLimits, RefusalLog};

/// The established places [`ListenerLimits::max_connections`] allows on one
/// listener.
#[derive(Debug)]
pub struct EstablishedPlaces {
    places: Arc<Semaphore>,
    limit: usize,
    refusals: RefusalLog,
}

impl EstablishedPlaces {
    /// The places `limits` allow (0 refuses every peer).
    pub fn new(limits: &ListenerLimits) -> Self {
        Self { places: limits.established_places(), limit: limits.max_connections, refusals: RefusalLog::new() }
    }

    /// A place for `peer`, whose handshake on `listener` just succeeded, or
    /// `None` when every place is taken: then a line says so (rate-limited)
    /// and the caller refuses the peer as its wire allows.
    pub fn take(&self, listener: &'static str, peer: SocketAddr) -> Option<OwnedSemaphorePermit> {
        self.take_at(listener, peer, Instant::now())
    }

    /// [`Self::take`] at `now`.
    pub fn take_at(&self, listener: &'static str, peer: SocketAddr, now: Instant) -> Option<OwnedSemaphorePermit> {
        let place = Arc::clone(&self.places).try_acquire_owned().ok();
        if place.is_none() {
            if let Some(suppressed) = self.refusals.allow(now) {
                tracing::warn!(listener, %peer, limit = self.limit, suppressed,
                    "connection limit reached, refusing a peer that finished its handshake");
            }
        }
        place
    }

    /// The most connections established at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The places free now.
    pub fn available(&self) -> usize {
        self.places.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_is_given_back_when_dropped() {
        let t0 = Instant::now();
        let peer = SocketAddr::from(([192, 0, 2, 1], 4000));
        let places = EstablishedPlaces::new(&ListenerLimits { max_connections: 1, ..ListenerLimits::default() });
        let first = places.take_at("test", peer, t0);
        assert!(first.is_some());
        assert_eq!(places.available(), 0);
        assert!(places.take_at("test", peer, t0).is_none(), "past the limit");
        drop(first);
        assert!(places.take_at("test", peer, t0).is_some(), "given back");
    }

    #[test]
    fn no_places_refuses_every_peer() {
        let peer = SocketAddr::from(([192, 0, 2, 1], 4000));
        let places = EstablishedPlaces::new(&ListenerLimits { max_connections: 0, ..ListenerLimits::default() });
        assert_eq!(places.limit(), 0);
        assert!(places.take("test", peer).is_none());
    }
}
