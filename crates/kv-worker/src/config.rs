//! The worker's settings: vLLM's transfer config plus the bounds kvlink adds.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

pub use kv_net::ListenerLimits;
pub use kv_proto::auth::AuthSecret;
use kv_proto::{EngineId, KvRole, KvTransferConfig, ListenerOverrides, ModelIdentity, Protocol, DEFAULT_MAX_FRAME_LEN};

/// Default [`WorkerConfig::lease_renewal`].
pub const DEFAULT_LEASE_RENEWAL: Duration = Duration::from_secs(10);

/// Default [`WorkerConfig::max_ops_per_batch`]: what every data listener
/// with default limits accepts in one batch, secret or not (2 Mi ops, a
/// 32 MiB op list).
pub const DEFAULT_MAX_OPS_PER_BATCH: usize =
    (kv_net::DEFAULT_UNAUTHENTICATED_OP_LIST_BUDGET / kv_proto::dataplane::OP_LEN as u64) as usize;

/// Default `max_connections` of [`WorkerConfig::side_channel_limits`]: the
/// decode connections one prefill worker serves at once.
pub const DEFAULT_SIDE_CHANNEL_MAX_CONNECTIONS: usize = 512;

/// The side channel's default [`WorkerConfig::side_channel_limits`]: the
/// handshake places of every listener, [`DEFAULT_SIDE_CHANNEL_MAX_CONNECTIONS`]
/// established connections.
pub fn default_side_channel_limits() -> ListenerLimits {
    ListenerLimits { max_connections: DEFAULT_SIDE_CHANNEL_MAX_CONNECTIONS, ..ListenerLimits::default() }
}

/// Everything a [`crate::Worker`] needs to know besides its cache.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Producer (P), consumer (D) or both.
    pub role: KvRole,
    /// This engine's id (sent in the side-channel hello).
    pub engine_id: EngineId,
    /// Data-plane transport (`mooncake_protocol`).
    pub protocol: Protocol,
    /// Transfers P runs at once (`num_workers`).
    pub num_workers: usize,
    /// Transfer requests P admits at once, waiting ones included, until
    /// their reply is written; further requests wait on their connection
    /// (back-pressure). One connection may hold at most half of them.
    pub queue_depth: usize,
    /// Address the side-channel listener binds (P).
    pub side_channel_bind: IpAddr,
    /// Side-channel base port of this data-parallel rank; the listener binds
    /// `base + pp_rank * tp_size + tp_rank`. Port 0 for the first worker
    /// picks a free port (tests).
    pub side_channel_base_port: u16,
    /// Tensor-parallel rank of this worker.
    pub tp_rank: u16,
    /// Tensor-parallel size of its instance (P and D may differ: D pulls
    /// each head from the prefill worker that holds it).
    pub tp_size: u16,
    /// Pipeline stage of this worker: it registers and transfers that
    /// stage's layers only, pulling from the same stage of P.
    pub pp_rank: u16,
    /// Pipeline-parallel size of its instance (P and D must agree).
    pub pp_size: u16,
    /// P's lease on a finished request's blocks, and its bound on waiting for
    /// a request D asks for before it is ready.
    pub abort_request_timeout: Duration,
    /// P: once a decode instance renews a finished request (it has seen it
    /// and will pull it), the request's blocks are held this long past the
    /// last renewal instead of the whole abort timeout (which still caps
    /// it), so a decode instance that dies or restarts before pulling
    /// strands them for seconds. D renews every third of it. Zero turns
    /// renewals off. Default 10 s.
    pub lease_renewal: Duration,
    /// D's bound on one pull: from sending the transfer request to P's reply.
    pub transfer_timeout: Duration,
    /// Bound on connecting and on the hello exchange, on the connecting
    /// side. (Listeners hold an incoming connection's handshake to their
    /// limits' `handshake_timeout`.)
    pub connect_timeout: Duration,
    /// Bound on a prefill worker's registration with its instance's
    /// bootstrap server, and on a decode worker's wait for a bootstrap
    /// server's answer. Default 30 s.
    pub bootstrap_timeout: Duration,
    /// Bound on one side-channel frame body.
    pub max_frame_len: usize,
    /// Address the data-plane listener binds.
    pub data_listen: SocketAddr,
    /// Host advertised in the data endpoint (default: the bound address).
    pub data_advertise_host: Option<String>,
    /// Data-plane bound on one stalled read, write or acknowledgement.
    pub data_io_timeout: Duration,
    /// Shared secret of the side channel and of every data plane (TCP, QUIC
    /// and RDMA's control connection). When set, each connection starts with
    /// a mutual challenge–response (see `kv_proto::auth`); a peer without
    /// the secret is refused before any transfer request or batch is read,
    /// or (RDMA) any queue pair is made or grant opened for it.
    pub auth_secret: Option<AuthSecret>,
    /// TCP data plane with a secret: tag every batch's payload too, and
    /// require tagged payloads from every sender (default off; see
    /// `transport_tcp::TcpConfig::authenticate_payloads`).
    pub tcp_authenticate_payloads: bool,
    /// Which data endpoints P writes to (default: only one on the host the
    /// side-channel peer connected from).
    pub data_endpoint_policy: DataEndpointPolicy,
    /// P: the side-channel listener's places (default
    /// [`default_side_channel_limits`]): connections still in their hello
    /// (and authentication), in total and per source host, closed at accept
    /// past either; and established connections, taken only once the hello
    /// succeeded (a hello past them is rejected with the reason). Kept apart,
    /// so peers that never finish a hello cannot take the places of those
    /// that did.
    pub side_channel_limits: ListenerLimits,
    /// The data-plane listener's places (TCP, QUIC, RDMA's control port;
    /// default [`ListenerLimits::default`]), as the transport's own config
    /// documents them. Every sender behind one source address (a NAT, a
    /// pod network) shares that address's `max_handshakes_per_host`: raise
    /// it where many do.
    pub data_limits: ListenerLimits,
    /// P: the most ops one batch it writes holds (default
    /// [`DEFAULT_MAX_OPS_PER_BATCH`]); a request with more (a long prompt
    /// whose heads are mapped one token row per op) goes out in several
    /// batches under its grant. Keep it within what decode's data listener
    /// accepts.
    pub max_ops_per_batch: usize,
    /// P: an established side-channel connection with no transfer request
    /// in progress for this long is closed (default 300 s); D learns it in
    /// the hello and retires its connection before.
    pub side_channel_idle_timeout: Duration,
    /// P: bound on writing one reply to D (a D that does not read its
    /// replies loses its connection, and with it the admission it held;
    /// default 30 s).
    pub reply_timeout: Duration,
    /// This instance's model, KV storage, topology and versions, sent in
    /// D's hello and compared by P: a field either side leaves undeclared
    /// is not compared (default: kvlink's version only).
    pub identity: ModelIdentity,
    /// Pieces of a request, in bytes of KV (0, the default: whole
    /// requests). D asks P to write each request it pulls in pieces of at
    /// most this much and to say as each one lands, and hears each
    /// request's outcome as soon as P knows it; a staged worker
    /// ([`crate::staging::StagedWorker`]) also copies requests between the
    /// engine's blocks and its slots in pieces of this size, so its copies
    /// and the wire run at once within one request.
    pub piece_bytes: u64,
}

/// Where a worker sits: its data-parallel rank, and its tensor- and
/// pipeline-parallel rank and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Data-parallel rank.
    pub dp_rank: u16,
    /// Tensor-parallel size.
    pub tp_size: u16,
    /// Tensor-parallel rank.
    pub tp_rank: u16,
    /// Pipeline-parallel size.
    pub pp_size: u16,
    /// Pipeline stage.
    pub pp_rank: u16,
}

impl Placement {
    /// The only worker of an instance.
    pub const fn single() -> Self {
        Self { dp_rank: 0, tp_size: 1, tp_rank: 0, pp_size: 1, pp_rank: 0 }
    }

    /// The worker's place among its instance's workers (its side-channel
    /// port is the instance's base plus this): as
    /// [`kv_proto::RankTopology::global_rank`].
    pub fn global_rank(&self) -> u32 {
        u32::from(self.pp_rank) * u32::from(self.tp_size) + u32::from(self.tp_rank)
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "data-parallel rank {}, tensor-parallel rank {} of {}, pipeline stage {} of {}",
            self.dp_rank, self.tp_rank, self.tp_size, self.pp_rank, self.pp_size
        )
    }
}

/// Which data-plane endpoints a prefill worker agrees to write to: a
/// transfer request names D's endpoint, and without a rule any peer of the
/// side channel could aim P's writes at a third host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DataEndpointPolicy {
    /// Only an endpoint on the host the side-channel connection came from
    /// (all loopback addresses count as one host).
    #[default]
    SamePeerHost,
    /// That host, or any of these addresses (hosts whose data plane uses
    /// another NIC than their side channel).
    SamePeerHostOr(Vec<IpAddr>),
    /// Any endpoint: for in-process transports whose endpoints are not
    /// `host:port`, and tests.
    Any,
}

impl WorkerConfig {
    /// A config for `role` with kvlink's defaults, everything on loopback and
    /// ports picked by the OS (tests, the demo).
    pub fn loopback(role: KvRole, engine_id: &str) -> Self {
        Self {
            role,
            engine_id: EngineId::new(engine_id),
            protocol: Protocol::Tcp,
            num_workers: kv_proto::DEFAULT_NUM_WORKERS,
            queue_depth: 4 * kv_proto::DEFAULT_NUM_WORKERS,
            side_channel_bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            side_channel_base_port: 0,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            abort_request_timeout: kv_proto::DEFAULT_ABORT_REQUEST_TIMEOUT,
            lease_renewal: DEFAULT_LEASE_RENEWAL,
            transfer_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            bootstrap_timeout: kv_proto::DEFAULT_BOOTSTRAP_TIMEOUT,
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            data_listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            data_advertise_host: None,
            data_io_timeout: Duration::from_secs(30),
            auth_secret: None,
            tcp_authenticate_payloads: false,
            data_endpoint_policy: DataEndpointPolicy::SamePeerHost,
            side_channel_limits: default_side_channel_limits(),
            data_limits: ListenerLimits::default(),
            max_ops_per_batch: DEFAULT_MAX_OPS_PER_BATCH,
            side_channel_idle_timeout: Duration::from_secs(300),
            reply_timeout: Duration::from_secs(30),
            identity: ModelIdentity::this_kvlink(),
            piece_bytes: 0,
        }
    }

    /// A config from vLLM's transfer config, for the worker at `place` (its
    /// data-parallel rank, and tensor- and pipeline-parallel rank and size):
    /// every worker setting it names, kvlink's defaults for the rest.
    /// Listeners bind `bind` (the side channel on the reference's port rule,
    /// one port per worker of every stage, the data plane on a free port);
    /// the shared secret, read from `auth_secret_file`, and the advertised
    /// host are the caller's to set.
    pub fn from_transfer_config(
        config: &KvTransferConfig,
        bind: IpAddr,
        place: Placement,
    ) -> Result<Self, crate::WorkerError> {
        let Placement { dp_rank, tp_size, tp_rank, pp_size, pp_rank } = place;
        let overflow = || crate::WorkerError::PortOverflow { bootstrap_port: config.bootstrap_port, place };
        let base = config.side_channel_base_port(dp_rank, tp_size, pp_size).ok_or_else(overflow)?;
        kv_proto::topology::side_channel_port(base, place.global_rank()).ok_or_else(overflow)?;
        let defaults = Self::loopback(config.kv_role, config.engine_id.as_str());
        Ok(Self {
            role: config.kv_role,
            engine_id: config.engine_id.clone(),
            protocol: crate::transport::resolve_protocol(config.protocol),
            num_workers: config.num_workers,
            queue_depth: config.queue_depth.unwrap_or(4 * config.num_workers),
            side_channel_bind: bind,
            side_channel_base_port: base,
            tp_rank,
            tp_size,
            pp_rank,
            pp_size,
            abort_request_timeout: config.abort_request_timeout,
            lease_renewal: config.lease_renewal.unwrap_or(defaults.lease_renewal),
            transfer_timeout: config.transfer_timeout.unwrap_or(defaults.transfer_timeout),
            connect_timeout: config.connect_timeout.unwrap_or(defaults.connect_timeout),
            bootstrap_timeout: config.bootstrap_timeout.unwrap_or(defaults.bootstrap_timeout),
            data_listen: SocketAddr::new(bind, 0),
            side_channel_limits: overridden(defaults.side_channel_limits, config.side_channel_limits),
            data_limits: overridden(defaults.data_limits, config.data_limits),
            tcp_authenticate_payloads: config.tcp_authenticate_payloads,
            ..defaults
        })
    }
}

/// `limits` with what `overrides` sets.
fn overridden(limits: ListenerLimits, overrides: ListenerOverrides) -> ListenerLimits {
    ListenerLimits {
        max_handshakes: overrides.max_handshakes.unwrap_or(limits.max_handshakes),
        max_handshakes_per_host: overrides.max_handshakes_per_host.unwrap_or(limits.max_handshakes_per_host),
        max_connections: overrides.max_connections.unwrap_or(limits.max_connections),
        handshake_timeout: overrides.handshake_timeout.unwrap_or(limits.handshake_timeout),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(extra: &str) -> KvTransferConfig {
        let text = format!(r#"{{"kv_role":"kv_producer","engine_id":"p","kv_connector_extra_config":{extra}}}"#);
        KvTransferConfig::from_json(&text, |_| None).unwrap()
    }

    #[test]
    fn a_transfer_config_sets_what_it_names_and_leaves_the_rest() {
        let bind = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let defaults = WorkerConfig::loopback(KvRole::Producer, "p");
        let plain = WorkerConfig::from_transfer_config(&parsed("{}"), bind, Placement::single()).unwrap();
        assert_eq!(plain.side_channel_limits, defaults.side_channel_limits);
        assert_eq!(plain.data_limits, defaults.data_limits);
        assert_eq!(plain.queue_depth, 4 * kv_proto::DEFAULT_NUM_WORKERS);
        assert_eq!(plain.transfer_timeout, defaults.transfer_timeout);
        assert!(!plain.tcp_authenticate_payloads);

        let set = parsed(
            r#"{"num_workers":2,"transfer_timeout":3,"connect_timeout":0.5,"lease_renewal":0,
                "side_channel_max_handshakes_per_host":4,"side_channel_max_connections":0,
                "data_max_handshakes":128,"data_max_handshakes_per_host":48,"data_handshake_timeout":2,
                "auth_secret_file":"/s","tcp_authenticate_payloads":true}"#,
        );
        let c = WorkerConfig::from_transfer_config(&set, bind, Placement::single()).unwrap();
        assert_eq!((c.num_workers, c.queue_depth), (2, 8));
        assert_eq!(c.transfer_timeout, Duration::from_secs(3));
        assert_eq!(c.connect_timeout, Duration::from_millis(500));
        assert_eq!(c.lease_renewal, Duration::ZERO);
        assert!(c.tcp_authenticate_payloads);
        assert_eq!(
            c.side_channel_limits,
            ListenerLimits { max_handshakes_per_host: 4, max_connections: 0, ..defaults.side_channel_limits }
        );
        assert_eq!(
            c.data_limits,
            ListenerLimits {
                max_handshakes: 128,
                max_handshakes_per_host: 48,
                handshake_timeout: Duration::from_secs(2),
                ..defaults.data_limits
            }
        );
    }
}
