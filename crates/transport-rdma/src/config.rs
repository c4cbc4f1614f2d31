//! [`RdmaConfig`]: the device, where the control listener binds, and every
//! bound the transport keeps.

use std::net::SocketAddr;
use std::time::Duration;

use kv_net::ListenerLimits;
use kv_proto::auth::AuthSecret;

/// Environment variable naming the RDMA device (e.g. `rxe0`, `mlx5_0`).
pub const ENV_DEVICE: &str = "KVLINK_RDMA_DEVICE";
/// Environment variable naming the device port (default 1).
pub const ENV_PORT: &str = "KVLINK_RDMA_PORT";
/// Environment variable naming the source GID index.
pub const ENV_GID_INDEX: &str = "KVLINK_RDMA_GID_INDEX";

/// Configuration of an RDMA transport. Every wait the transport makes is
/// bounded by one of these durations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Where the control listener binds (default `127.0.0.1:0`): peers
    /// connect there for the queue-pair handshake and keep the connection
    /// as their control channel.
    pub listen_addr: SocketAddr,
    /// Host put in the advertised endpoint (default: the bound IP). Set it
    /// when binding a wildcard address.
    pub advertise_host: Option<String>,
    /// RDMA device name (default: the first device present).
    pub device: Option<String>,
    /// Device port (default 1).
    pub port: u8,
    /// Source GID index (default: the port's IPv4-mapped GID of the listen
    /// address, else its first IPv4-mapped GID: RoCE v2 over that interface).
    pub gid_index: Option<u8>,
    /// Bound on connecting to a peer: TCP connect, handshake and queue-pair
    /// set-up (default 5 s). (The receiving side's one deadline is
    /// [`ListenerLimits::handshake_timeout`].)
    pub connect_timeout: Duration,
    /// Bound on any single wait once connected (default 30 s): a control
    /// reply, a completion (progress restarts the clock, so a large batch on
    /// a slow link is not cut off), a queue pair another batch holds.
    pub io_timeout: Duration,
    /// Work requests outstanding per queue pair (default 256): more wait for
    /// completions (back-pressure), they never fail.
    pub send_queue_depth: u32,
    /// Scatter-gather entries per work request (default 16; capped by the device).
    pub max_sge: u32,
    /// Bytes per RDMA WRITE work request (default 1 MiB; capped by the
    /// port's message size); longer ops are split.
    pub max_wr_bytes: u32,
    /// One work request in this many asks for a completion (default 16, at
    /// most `send_queue_depth`), and the last of a batch.
    pub signal_interval: u32,
    /// Most windows (grant ranges) one grant may have (default 1 Mi; also
    /// bounded by the device's window count). A sender refuses a reply with
    /// more (peer input), a receiver refuses to open a grant with more.
    pub max_windows_per_grant: u32,
    /// Free memory windows a receiver keeps for reuse (default 65536):
    /// allocating one is a system call, binding a free one only a work
    /// request.
    pub window_pool: usize,
    /// The control listener's places (default [`ListenerLimits::default`]):
    /// a handshake place, taken at accept (or the connection is closed at
    /// once), is held for at most [`ListenerLimits::handshake_timeout`]
    /// (the opening and the queue-pair exchange together); an
    /// established place is taken only once the opening (and, with a
    /// secret, its proof) succeeded, before any queue pair is made for it,
    /// and a connection past [`ListenerLimits::max_connections`] is told so
    /// (status 5, or verdict 2 after the proof) and closed.
    pub limits: ListenerLimits,
    /// The data plane's shared secret (default none). When set, the
    /// receiver serves only senders that prove it on the control connection
    /// (before any queue pair is made or grant opened for them), and the
    /// sender connects only to receivers that prove it; a side with a
    /// secret refuses a peer without one.
    pub auth_secret: Option<AuthSecret>,
    /// Opened grants a sender caches per peer (default 256).
    pub max_cached_grants: usize,
    /// A sender drops its connection to a peer unused this long (default
    /// 300 s). A receiver closes a control connection on which no grant
    /// was opened for twice this long and no window of a grant is bound.
    pub idle_timeout: Duration,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            listen_addr: kv_net::DEFAULT_LISTEN_ADDR,
            advertise_host: None,
            device: None,
            port: 1,
            gid_index: None,
            connect_timeout: kv_net::DEFAULT_CONNECT_TIMEOUT,
            io_timeout: kv_net::DEFAULT_IO_TIMEOUT,
            send_queue_depth: 256,
            max_sge: 16,
            max_wr_bytes: 1 << 20,
            signal_interval: 16,
            max_windows_per_grant: 1 << 20,
            window_pool: 65536,
            limits: ListenerLimits::default(),
            auth_secret: None,
            max_cached_grants: 256,
            idle_timeout: Duration::from_secs(300),
        }
    }
}

/// An environment variable with a value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?} is invalid: expected {expected}")]
pub struct EnvError {
    /// The variable.
    pub name: &'static str,
    /// Its value.
    pub value: String,
    /// What it takes.
    pub expected: &'static str,
}

impl RdmaConfig {
    /// This config with the device, port and GID index the environment names
    /// ([`ENV_DEVICE`], [`ENV_PORT`], [`ENV_GID_INDEX`]), where set. `env`
    /// looks a variable up (pass `|name| std::env::var(name).ok()`).
    pub fn with_env(mut self, env: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let set = |name: &'static str| env(name).map(|value| value.trim().to_owned()).filter(|v| !v.is_empty());
        if let Some(device) = set(ENV_DEVICE) {
            self.device = Some(device);
        }
        if let Some(port) = set(ENV_PORT) {
            self.port = port.parse().ok().filter(|&port| port > 0).ok_or(EnvError {
                name: ENV_PORT,
                value: port,
                expected: "a port number in 1..=255",
            })?;
        }
        if let Some(index) = set(ENV_GID_INDEX) {
            self.gid_index = Some(index.parse().map_err(|_| EnvError {
                name: ENV_GID_INDEX,
                value: index,
                expected: "a GID index in 0..=255",
            })?);
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_names_the_device() {
        let env = |name: &str| match name {
            ENV_DEVICE => Some("rxe0".to_owned()),
            ENV_GID_INDEX => Some(" 3 ".to_owned()),
            _ => None,
        };
        let config = RdmaConfig::default().with_env(env).unwrap();
        assert_eq!((config.device.as_deref(), config.port, config.gid_index), (Some("rxe0"), 1, Some(3)));
        let untouched = RdmaConfig::default().with_env(|_| None).unwrap();
        assert_eq!(untouched, RdmaConfig::default());
    }

    #[test]
    fn bad_values_are_errors() {
        let bad_port = RdmaConfig::default().with_env(|name| (name == ENV_PORT).then(|| "0".to_owned()));
        assert_eq!(bad_port.unwrap_err().name, ENV_PORT);
        let bad_gid = RdmaConfig::default().with_env(|name| (name == ENV_GID_INDEX).then(|| "x".to_owned()));
        assert_eq!(bad_gid.unwrap_err().name, ENV_GID_INDEX);
    }
}
