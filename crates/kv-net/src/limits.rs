//! [`ListenerLimits`]: the bounds every data-plane listener (TCP, QUIC,
//! RDMA's control port) keeps on its incoming connections, with their
//! defaults, once; each transport's config embeds them as `limits`.

use std::sync::Arc;
use std::time::Duration;

use kv_proto::{HandshakePlaces, DEFAULT_MAX_HANDSHAKES, DEFAULT_MAX_HANDSHAKES_PER_HOST};
use tokio::sync::Semaphore;

/// Default [`ListenerLimits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// Default [`ListenerLimits::handshake_timeout`].
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A listener's two pools of places: handshake places, taken at accept and
/// held for at most [`ListenerLimits::handshake_timeout`], and established
/// places, taken only once the handshake (and, with a shared secret, its
/// proof) succeeded, so peers that never finish a handshake cannot crowd
/// out those that did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Incoming connections still in their handshake (default
    /// [`DEFAULT_MAX_HANDSHAKES`]); more are refused at accept.
    pub max_handshakes: usize,
    /// Handshakes in progress from one source address (default
    /// [`DEFAULT_MAX_HANDSHAKES_PER_HOST`]), so one host cannot take every
    /// handshake place.
    pub max_handshakes_per_host: usize,
    /// Established incoming connections (default
    /// [`DEFAULT_MAX_CONNECTIONS`]). A connection past it is told so where
    /// the transport's wire allows, and closed; 0 refuses every connection,
    /// on every listener. (0 handshake places counts as 1: a listener with
    /// none would be refusing everything at accept, unable to say why.)
    pub max_connections: usize,
    /// One deadline on an incoming connection's whole handshake, from
    /// accept (default [`DEFAULT_HANDSHAKE_TIMEOUT`]): whatever the
    /// listener's protocol exchanges before the connection is established
    /// (TCP's preamble, reply and proof; QUIC's TLS handshake and hello;
    /// RDMA's opening and queue-pair exchange; the side channel's hello,
    /// challenge and reply). It does not restart on progress, so a peer
    /// dribbling its handshake holds a handshake place for at most this
    /// long; past it the connection is closed.
    pub handshake_timeout: Duration,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_handshakes_per_host: DEFAULT_MAX_HANDSHAKES_PER_HOST,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

impl ListenerLimits {
    /// The handshake places these limits allow.
    pub fn handshake_places(&self) -> HandshakePlaces {
        HandshakePlaces::new(self.max_handshakes, self.max_handshakes_per_host)
    }

    /// The established places these limits allow (capped at what a
    /// semaphore holds, which no real bound reaches).
    pub fn established_places(&self) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(self.max_connections.min(Semaphore::MAX_PERMITS)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pools_follow_the_limits() {
        let limits =
            ListenerLimits { max_handshakes: 3, max_handshakes_per_host: 2, max_connections: 1, ..Default::default() };
        let places = limits.handshake_places();
        assert_eq!((places.limit(), places.per_host()), (3, 2));
        let established = limits.established_places();
        assert_eq!(established.available_permits(), 1);
        let none = ListenerLimits { max_connections: 0, ..ListenerLimits::default() };
        assert_eq!(none.established_places().available_permits(), 0, "0 refuses every connection");
        let huge = ListenerLimits { max_connections: usize::MAX, ..ListenerLimits::default() };
        assert_eq!(huge.established_places().available_permits(), Semaphore::MAX_PERMITS);
    }
}
