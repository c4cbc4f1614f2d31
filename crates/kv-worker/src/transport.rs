//! Transport selection: `mooncake_protocol` picks the `BatchWriter`, among
//! those compiled in by cargo features.

use std::sync::Arc;

use kv_proto::{BatchWriter, Protocol};

use crate::{WorkerConfig, WorkerError};

/// Opens the transport `config.protocol` names, bound per `config`.
pub async fn open(config: &WorkerConfig) -> Result<Arc<dyn BatchWriter>, WorkerError> {
    match config.protocol {
        #[cfg(feature = "tcp")]
        Protocol::Tcp => {
            let tcp = transport_tcp::TcpConfig {
                listen_addr: config.data_listen,
                advertise_host: config.data_advertise_host.clone(),
                connect_timeout: config.connect_timeout,
                io_timeout: config.data_io_timeout,
                auth_secret: config.auth_secret.clone(),
                ..transport_tcp::TcpConfig::default()
            };
            let writer: Arc<dyn BatchWriter> =
                transport_tcp::TcpTransport::bind(tcp).await.map_err(WorkerError::Transport)?;
            Ok(writer)
        }
        #[cfg(feature = "quic")]
        Protocol::Quic => {
            let quic = transport_quic::QuicConfig {
                listen_addr: config.data_listen,
                advertise_host: config.data_advertise_host.clone(),
                connect_timeout: config.connect_timeout,
                io_timeout: config.data_io_timeout,
                auth_secret: config.auth_secret.clone(),
                ..transport_quic::QuicConfig::default()
            };
            let writer: Arc<dyn BatchWriter> =
                transport_quic::QuicTransport::bind(quic).await.map_err(WorkerError::Transport)?;
            Ok(writer)
        }
        other => Err(WorkerError::TransportNotCompiled { protocol: other, feature: feature_of(other) }),
    }
}

/// The cargo feature of `kv-worker` that compiles a transport in.
pub fn feature_of(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Tcp => "tcp",
        Protocol::Quic => "quic",
        Protocol::Rdma => "rdma",
    }
}

/// The transports this build can open.
pub fn compiled_in() -> Vec<Protocol> {
    let mut protocols = Vec::new();
    if cfg!(feature = "tcp") {
        protocols.push(Protocol::Tcp);
    }
    if cfg!(feature = "quic") {
        protocols.push(Protocol::Quic);
    }
    protocols
}
