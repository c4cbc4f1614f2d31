//! Transport selection: `mooncake_protocol` picks the `BatchWriter`, among
//! those compiled in by cargo features.
//!
//! RDMA (feature `rdma`) takes its device from the environment, as
//! `transport_rdma::RdmaConfig::with_env` reads it: `KVLINK_RDMA_DEVICE`
//! (default: the first device), `KVLINK_RDMA_PORT` (default 1) and
//! `KVLINK_RDMA_GID_INDEX` (default: the port's IPv4-mapped GID of the data
//! listen address). Its control listener binds `data_listen`, and
//! `connect_timeout` and `data_io_timeout` bound its waits.
//!
//! Every transport takes from [`WorkerConfig`] the same fields: the listen
//! address and the host it advertises, `connect_timeout`, `data_io_timeout`
//! (its `io_timeout`), the shared secret and the listener's places
//! (`data_limits`, its `limits`); the rest keep the transport's defaults.

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
                authenticate_payloads: config.tcp_authenticate_payloads,
                limits: config.data_limits,
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
                limits: config.data_limits,
                ..transport_quic::QuicConfig::default()
            };
            let writer: Arc<dyn BatchWriter> =
                transport_quic::QuicTransport::bind(quic).await.map_err(WorkerError::Transport)?;
            Ok(writer)
        }
        #[cfg(feature = "rdma")]
        Protocol::Rdma => {
            if config.tcp_authenticate_payloads {
                tracing::warn!(
                    "tcp_authenticate_payloads is set and the data plane is RDMA: RDMA payloads are not tagged \
                     (they land through the windows bound for each grant)"
                );
            }
            let rdma = transport_rdma::RdmaConfig {
                listen_addr: config.data_listen,
                advertise_host: config.data_advertise_host.clone(),
                connect_timeout: config.connect_timeout,
                io_timeout: config.data_io_timeout,
                auth_secret: config.auth_secret.clone(),
                limits: config.data_limits,
                ..transport_rdma::RdmaConfig::default()
            }
            .with_env(|name| std::env::var(name).ok())
            .map_err(|err| {
                WorkerError::Transport(kv_proto::TransportError::Io {
                    peer: "rdma device".to_owned(),
                    source: std::io::Error::new(std::io::ErrorKind::InvalidInput, err),
                })
            })?;
            let writer: Arc<dyn BatchWriter> =
                transport_rdma::RdmaTransport::bind(rdma).await.map_err(WorkerError::Transport)?;
            Ok(writer)
        }
        #[allow(unreachable_patterns)]
        other => Err(WorkerError::TransportNotCompiled { protocol: other, feature: feature_of(other) }),
    }
}

/// The transport an unset `mooncake_protocol` means in this build: `rdma`
/// when it is compiled in (the reference's default), else `tcp`.
pub fn default_protocol() -> Protocol {
    if cfg!(feature = "rdma") {
        Protocol::Rdma
    } else {
        Protocol::Tcp
    }
}

/// `mooncake_protocol` as configured, or, when it is unset, this build's
/// [`default_protocol`], with one log line saying which and why.
pub fn resolve_protocol(configured: Option<Protocol>) -> Protocol {
    if let Some(protocol) = configured {
        return protocol;
    }
    let protocol = default_protocol();
    if protocol == Protocol::Rdma {
        tracing::info!("mooncake_protocol is unset: using rdma (compiled in; the reference's default)");
    } else {
        tracing::info!(
            "mooncake_protocol is unset: using tcp (the reference defaults to rdma, which this build does not \
             compile in: enable kv-worker's \"rdma\" feature)"
        );
    }
    protocol
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
    if cfg!(feature = "rdma") {
        protocols.push(Protocol::Rdma);
    }
    protocols
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unset_protocol_is_rdma_only_where_it_is_compiled_in() {
        let expected = if cfg!(feature = "rdma") { Protocol::Rdma } else { Protocol::Tcp };
        assert_eq!(resolve_protocol(None), expected);
        assert_eq!(default_protocol(), expected);
        assert!(compiled_in().contains(&expected) || expected == Protocol::Tcp);
        for protocol in [Protocol::Tcp, Protocol::Quic, Protocol::Rdma] {
            assert_eq!(resolve_protocol(Some(protocol)), protocol, "a configured protocol stands");
        }
    }
}
