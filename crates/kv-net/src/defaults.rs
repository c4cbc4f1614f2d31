//! The defaults every data plane's config starts from, written once so the
//! transports agree on them.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

/// Where a data plane listens by default: the loopback address, a port the
/// kernel picks.
pub const DEFAULT_LISTEN_ADDR: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0));
/// Bound on opening a connection to a peer, its handshake included.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on any one read or write a peer keeps waiting.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a TCP or QUIC connection with nothing in progress is kept.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
