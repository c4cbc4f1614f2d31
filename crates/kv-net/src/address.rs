//! The address a listener tells its peers to use.

use std::net::SocketAddr;

/// The `host:port` peers are told to use for a listener bound at
/// `local_addr`: `advertise_host` (an IPv6 literal in brackets) with the
/// bound port, or else the bound address itself, with a warning when that
/// is a wildcard address no peer can reach.
pub fn advertised_address(advertise_host: Option<&str>, local_addr: SocketAddr) -> String {
    match advertise_host {
        Some(host) if host.contains(':') && !host.starts_with('[') => format!("[{host}]:{}", local_addr.port()),
        Some(host) => format!("{host}:{}", local_addr.port()),
        None => {
            if local_addr.ip().is_unspecified() {
                tracing::warn!(
                    %local_addr,
                    "listening on a wildcard address without advertise_host: peers get an unusable endpoint"
                );
            }
            local_addr.to_string()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advertised_host_takes_the_bound_port() {
        let bound: SocketAddr = "0.0.0.0:4321".parse().unwrap_or_else(|_| unreachable!());
        assert_eq!(advertised_address(Some("p.example"), bound), "p.example:4321");
        assert_eq!(advertised_address(Some("fd00::1"), bound), "[fd00::1]:4321");
        assert_eq!(advertised_address(Some("[fd00::1]"), bound), "[fd00::1]:4321");
        assert_eq!(advertised_address(None, bound), "0.0.0.0:4321");
        let loopback: SocketAddr = "127.0.0.1:9".parse().unwrap_or_else(|_| unreachable!());
        assert_eq!(advertised_address(None, loopback), "127.0.0.1:9");
    }
}
