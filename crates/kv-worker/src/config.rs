//! The worker's settings: vLLM's transfer config plus the bounds kvlink adds.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

pub use kv_proto::auth::AuthSecret;
use kv_proto::{EngineId, KvRole, KvTransferConfig, ModelIdentity, Protocol, DEFAULT_MAX_FRAME_LEN};

/// Default [`WorkerConfig::lease_renewal`].
pub const DEFAULT_LEASE_RENEWAL: Duration = Duration::from_secs(10);

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
    /// `base + tp_rank`. Port 0 with `tp_rank` 0 picks a free port (tests).
    pub side_channel_base_port: u16,
    /// Tensor-parallel rank of this worker.
    pub tp_rank: u16,
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
    /// Bound on connecting and on the hello exchange, both sides.
    pub connect_timeout: Duration,
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
    /// Which data endpoints P writes to (default: only one on the host the
    /// side-channel peer connected from).
    pub data_endpoint_policy: DataEndpointPolicy,
    /// P: side-channel connections still in their hello (and authentication)
    /// at once; more are closed at accept (default 64). Kept apart from
    /// established connections, so peers that never finish a hello cannot
    /// take the places of those that did.
    pub side_channel_max_handshakes: usize,
    /// P: of those, at most this many from one host (default 16), so one
    /// misbehaving host cannot hold every handshake place.
    pub side_channel_max_handshakes_per_host: usize,
    /// P: established side-channel connections at once; a hello past it is
    /// rejected (default 512).
    pub side_channel_max_conns: usize,
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
            abort_request_timeout: kv_proto::DEFAULT_ABORT_REQUEST_TIMEOUT,
            lease_renewal: DEFAULT_LEASE_RENEWAL,
            transfer_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            data_listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            data_advertise_host: None,
            data_io_timeout: Duration::from_secs(30),
            auth_secret: None,
            data_endpoint_policy: DataEndpointPolicy::SamePeerHost,
            side_channel_max_handshakes: 64,
            side_channel_max_handshakes_per_host: 16,
            side_channel_max_conns: 512,
            side_channel_idle_timeout: Duration::from_secs(300),
            reply_timeout: Duration::from_secs(30),
            identity: ModelIdentity::this_kvlink(),
        }
    }

    /// A config from vLLM's transfer config, for worker `tp_rank` of
    /// data-parallel rank `dp_rank` in a `tp_size`-way tensor-parallel group.
    /// Listeners bind `bind` (the side channel on the reference's port rule,
    /// the data plane on a free port).
    pub fn from_transfer_config(
        config: &KvTransferConfig,
        bind: IpAddr,
        dp_rank: u16,
        tp_size: u16,
        tp_rank: u16,
    ) -> Result<Self, crate::WorkerError> {
        let base =
            config.side_channel_base_port(dp_rank, tp_size).filter(|base| base.checked_add(tp_rank).is_some()).ok_or(
                crate::WorkerError::PortOverflow { bootstrap_port: config.bootstrap_port, dp_rank, tp_size, tp_rank },
            )?;
        Ok(Self {
            role: config.kv_role,
            engine_id: config.engine_id.clone(),
            protocol: crate::transport::resolve_protocol(config.protocol),
            num_workers: config.num_workers,
            queue_depth: 4 * config.num_workers,
            side_channel_bind: bind,
            side_channel_base_port: base,
            tp_rank,
            abort_request_timeout: config.abort_request_timeout,
            data_listen: SocketAddr::new(bind, 0),
            ..Self::loopback(config.kv_role, config.engine_id.as_str())
        })
    }
}
