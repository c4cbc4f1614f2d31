//! Places for incoming connections still in their handshake, in total and
//! per source host, which every listener takes at accept and gives back
//! when the handshake ends. A listener keeps its established connections in
//! a separate pool, taken only once a peer finished its handshake (and
//! proved the shared secret, where one is configured): connections that
//! never finish cannot crowd out those that did, and one host cannot take
//! every handshake place. Counting only: nothing here does I/O or reads a
//! clock.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// A listener's default bound on connections in their handshake.
pub const DEFAULT_MAX_HANDSHAKES: usize = 64;

/// A listener's default bound on connections in their handshake from one
/// source address.
pub const DEFAULT_MAX_HANDSHAKES_PER_HOST: usize = 16;

/// Handshake places: at most `limit` at once, at most `per_host` of them
/// for one source address.
#[derive(Clone, Debug)]
pub struct HandshakePlaces {
    limit: usize,
    per_host: usize,
    held: Arc<Mutex<Held>>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    hosts: HashMap<IpAddr, usize>,
}

/// Why no handshake place was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoPlace {
    /// Every handshake place is taken.
    #[error("{limit} handshakes in progress already")]
    Full {
        /// The bound in total.
        limit: usize,
    },
    /// The source host holds its share.
    #[error("{per_host} handshakes from this host in progress already")]
    HostFull {
        /// The bound per host.
        per_host: usize,
    },
}

/// One connection's handshake place; given back on drop.
#[derive(Debug)]
pub struct HandshakePlace {
    host: IpAddr,
    held: Arc<Mutex<Held>>,
}

impl HandshakePlaces {
    /// At most `limit` handshakes at once, `per_host` of them from one
    /// address (each at least 1).
    pub fn new(limit: usize, per_host: usize) -> Self {
        Self { limit: limit.max(1), per_host: per_host.max(1), held: Arc::default() }
    }

    /// A place for a connection from `host` (IPv4-mapped IPv6 addresses
    /// count as their IPv4 address), unless the bounds are reached.
    pub fn enter(&self, host: IpAddr) -> Result<HandshakePlace, NoPlace> {
        let host = host.to_canonical();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if held.total >= self.limit {
            return Err(NoPlace::Full { limit: self.limit });
        }
        let count = held.hosts.entry(host).or_insert(0);
        if *count >= self.per_host {
            return Err(NoPlace::HostFull { per_host: self.per_host });
        }
        *count += 1;
        held.total += 1;
        Ok(HandshakePlace { host, held: Arc::clone(&self.held) })
    }

    /// Handshake places taken now.
    pub fn taken(&self) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).total
    }

    /// The bound in total.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The bound per host.
    pub fn per_host(&self) -> usize {
        self.per_host
    }
}

impl Drop for HandshakePlace {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.total = held.total.saturating_sub(1);
        if let Some(count) = held.hosts.get_mut(&self.host) {
            *count -= 1;
            if *count == 0 {
                held.hosts.remove(&self.host);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
    }

    #[test]
    fn a_host_gets_its_share_and_others_the_rest() {
        let places = HandshakePlaces::new(3, 2);
        let a1 = places.enter(ip("10.0.0.1"));
        let a2 = places.enter(ip("::ffff:10.0.0.1"));
        assert!(a1.is_ok() && a2.is_ok());
        assert_eq!(places.enter(ip("10.0.0.1")).err(), Some(NoPlace::HostFull { per_host: 2 }));
        let b1 = places.enter(ip("10.0.0.2"));
        assert!(b1.is_ok());
        assert_eq!(places.enter(ip("10.0.0.3")).err(), Some(NoPlace::Full { limit: 3 }));
        assert_eq!(places.taken(), 3);
        drop(a1);
        assert!(places.enter(ip("10.0.0.3")).is_ok(), "a place given back is free again");
        drop((a2, b1));
        assert_eq!(places.taken(), 0);
        let held = places.held.lock().unwrap_or_else(PoisonError::into_inner);
        assert!(held.hosts.is_empty(), "no host is remembered once it holds nothing");
    }

    #[test]
    fn zero_bounds_mean_one() {
        let places = HandshakePlaces::new(0, 0);
        let one = places.enter(ip("10.0.0.1"));
        assert!(one.is_ok());
        assert!(places.enter(ip("10.0.0.2")).is_err());
    }
}
