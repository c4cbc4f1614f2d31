//! Ports a test can give up and bind again.
//!
//! A test that restarts a listener "on the same port" frees the port in
//! between, and a port from the kernel's ephemeral range can be taken in
//! that gap by any socket the machine opens meanwhile: another test's
//! `bind(0)`, or an outgoing connection's source port. Neither ever takes a
//! port below the ephemeral range, so a port from there stays ours to bind
//! again unless someone names it explicitly.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};

/// Where the search starts: above the well-known and commonly configured
/// service ports, below the bases kvlink's own tests name (20 000 and up).
const FIRST: u16 = 12_000;
/// Where it ends (exclusive).
const LAST: u16 = 20_000;

/// A loopback address, free right now, whose port is below the ephemeral
/// range (so neither `bind(0)` nor `connect` takes it while a test has let
/// go of it). Each process starts its search at its own place, so tests in
/// several processes rarely probe the same ports.
///
/// # Panics
///
/// When no port in the range is free.
pub fn restartable_loopback() -> SocketAddr {
    let span = u32::from(LAST - FIRST);
    let start = std::process::id() % span;
    for step in 0..span {
        // A stride coprime to the span visits every port once.
        let offset = (start + step * 7_919) % span;
        let port = FIRST + u16::try_from(offset).expect("below the span");
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        if TcpListener::bind(addr).is_ok() {
            return addr;
        }
    }
    panic!("no free loopback port in {FIRST}..{LAST}");
}

/// The lower end of the kernel's ephemeral port range (32 768 when it
/// cannot be read).
pub fn first_ephemeral_port() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_is_free_and_below_the_ephemeral_range() {
        let addr = restartable_loopback();
        assert!(addr.port() < first_ephemeral_port(), "{addr}");
        let _held = TcpListener::bind(addr).unwrap();
        // Taken now: the next call finds another.
        assert_ne!(restartable_loopback(), addr);
    }
}
