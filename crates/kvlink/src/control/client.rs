//! The client side of the control protocol: the prefill or decode half of a
//! bench that runs on another host.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use kv_proto::auth::{self, Channel, Transcript};
use kv_proto::{BlockId, KvRole, KvTransferParams, Protocol, ReqId};
use kv_worker::{AuthSecret, CacheShape};
use tokio::net::TcpStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use super::{
    codec, decode_server_msg, ClientMsg, ControlError, ServerMsg, WirePull, CONTROL_VERSION, DEFAULT_CONTROL_PORT,
};
use crate::blocks::BlockPattern;
use crate::engine::{Completion, PromptSpec, PullSpec};
use crate::stats::ProcessFigures;

/// Extra time a call's reply may take beyond the wait it asks the server for.
const REPLY_MARGIN: Duration = Duration::from_secs(10);

/// A server's answer to [`ControlClient::stats`].
#[derive(Clone, Copy, Debug)]
pub struct PeerStats {
    /// Process CPU time (user + system) so far.
    pub cpu: Duration,
    /// Peak resident set of the process, bytes.
    pub peak_rss_bytes: u64,
    /// What the process holds now (`None` from servers that do not say).
    pub figures: Option<ProcessFigures>,
}

/// An open control connection to a `kvlink serve`.
pub struct ControlClient {
    framed: Framed<TcpStream, LengthDelimitedCodec>,
    peer: SocketAddr,
    local: SocketAddr,
    call_timeout: Duration,
    /// The server's idle timeout, once welcomed.
    idle_timeout: Option<Duration>,
}

/// Splits `HOST[:PORT]` (IPv6 as `[ADDR]:PORT` or bare), the port
/// defaulting to [`DEFAULT_CONTROL_PORT`].
fn split_target(target: &str) -> Result<(String, u16), ControlError> {
    let bad = |reason: &str| ControlError::Resolve { target: target.to_owned(), reason: reason.to_owned() };
    if let Ok(addr) = target.parse::<SocketAddr>() {
        return Ok((addr.ip().to_string(), addr.port()));
    }
    if let Ok(ip) = target.parse::<IpAddr>() {
        return Ok((ip.to_string(), DEFAULT_CONTROL_PORT));
    }
    if let Some(inner) = target.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
        return Ok((inner.to_owned(), DEFAULT_CONTROL_PORT));
    }
    let (host, port) = match target.rsplit_once(':') {
        Some((host, port)) => (host, port.parse::<u16>().map_err(|_| bad("the port is not a number in 0..=65535"))?),
        None => (target, DEFAULT_CONTROL_PORT),
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    Ok((host.to_owned(), port))
}

impl ControlClient {
    /// Connects to `target` (`HOST[:PORT]`), bounded by `connect_timeout`;
    /// every later call is bounded by `call_timeout` (plus what it asks the
    /// server to wait).
    pub async fn connect(
        target: &str,
        connect_timeout: Duration,
        call_timeout: Duration,
    ) -> Result<Self, ControlError> {
        let (host, port) = split_target(target)?;
        let attempt = async {
            let addrs = tokio::net::lookup_host((host.as_str(), port))
                .await
                .map_err(|e| ControlError::Resolve { target: target.to_owned(), reason: e.to_string() })?;
            let mut last = None;
            for addr in addrs {
                match TcpStream::connect(addr).await {
                    Ok(stream) => return Ok(stream),
                    Err(e) => last = Some(e),
                }
            }
            Err(match last {
                Some(error) => ControlError::Unreachable { target: target.to_owned(), error },
                None => ControlError::Resolve { target: target.to_owned(), reason: "no address".to_owned() },
            })
        };
        let stream = tokio::time::timeout(connect_timeout, attempt)
            .await
            .map_err(|_| ControlError::ConnectTimeout { target: target.to_owned(), after: connect_timeout })??;
        let peer =
            stream.peer_addr().map_err(|error| ControlError::Unreachable { target: target.to_owned(), error })?;
        let local = stream.local_addr().map_err(|error| ControlError::Io { peer, error })?;
        let _ = stream.set_nodelay(true);
        Ok(Self { framed: Framed::new(stream, codec()), peer, local, call_timeout, idle_timeout: None })
    }

    /// The server's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// This end's address: where the server reaches this host.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn bad(&self, reason: impl Into<String>) -> ControlError {
        ControlError::BadReply { peer: self.peer, reason: reason.into() }
    }

    fn unexpected(&self, expected: &str, got: &ServerMsg) -> ControlError {
        self.bad(format!("expected a {expected} reply, got {}", got.kind()))
    }

    fn auth_error(&self, reason: impl Into<String>) -> ControlError {
        ControlError::Auth { peer: self.peer, reason: reason.into() }
    }

    /// Sends `msg` and waits (bounded by `wait`) for the reply; an `error`
    /// reply is [`ControlError::Refused`].
    async fn call(&mut self, msg: &ClientMsg, call: &'static str, wait: Duration) -> Result<ServerMsg, ControlError> {
        let peer = self.peer;
        let frame = serde_json::to_vec(msg).map_err(|e| ControlError::Io { peer, error: e.into() })?;
        self.exchange(frame, call, wait).await
    }

    /// Sends one encoded message and waits (bounded by `wait`) for the reply.
    async fn exchange(
        &mut self,
        frame: Vec<u8>,
        call: &'static str,
        wait: Duration,
    ) -> Result<ServerMsg, ControlError> {
        let peer = self.peer;
        let exchange = async {
            self.framed.send(Bytes::from(frame)).await.map_err(|error| ControlError::Io { peer, error })?;
            match self.framed.next().await {
                None => Err(ControlError::Closed { peer }),
                Some(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                    Err(ControlError::BadReply { peer, reason: e.to_string() })
                }
                Some(Err(error)) => Err(ControlError::Io { peer, error }),
                Some(Ok(frame)) => {
                    decode_server_msg(&frame).map_err(|e| ControlError::BadReply { peer, reason: e.to_string() })
                }
            }
        };
        let reply = tokio::time::timeout(wait, exchange).await.map_err(|_| ControlError::Timeout {
            peer,
            call,
            after: wait,
        })??;
        match reply {
            ServerMsg::Error { message } => Err(ControlError::Refused { peer, message }),
            reply => Ok(reply),
        }
    }

    /// Opens the session: the server starts an instance with `shape`;
    /// returns its role (the client runs the other one). With `secret`, the
    /// server must prove it (and this client proves it to the server)
    /// before anything else happens.
    pub async fn hello(
        &mut self,
        shape: CacheShape,
        pattern: BlockPattern,
        protocol: Protocol,
        verify: bool,
        secret: Option<&AuthSecret>,
    ) -> Result<KvRole, ControlError> {
        let client_nonce = match secret {
            Some(_) => Some(auth::fresh_nonce().ok_or_else(|| self.auth_error("no OS randomness for a nonce"))?),
            None => None,
        };
        let hello =
            ClientMsg::Hello { version: CONTROL_VERSION, shape: shape.into(), pattern, protocol, verify, client_nonce };
        // The proofs are bound to the hello exactly as sent.
        let frame = serde_json::to_vec(&hello).map_err(|e| ControlError::Io { peer: self.peer, error: e.into() })?;
        let closed = |c: &Self| ControlError::ClosedEarly { peer: c.peer };
        let mut reply = match self.exchange(frame.clone(), "hello", self.call_timeout).await {
            Err(ControlError::Closed { .. }) => return Err(closed(self)),
            other => other?,
        };
        match (secret.zip(client_nonce), &reply) {
            (Some((secret, client_nonce)), ServerMsg::Challenge { server_nonce, server_proof }) => {
                let transcript = Transcript {
                    channel: Channel::Control,
                    client_nonce: &client_nonce,
                    server_nonce,
                    context: &frame,
                };
                if !auth::verify_server_proof(secret, &transcript, server_proof) {
                    return Err(self.auth_error(
                        "it failed to prove the shared secret (its --auth-secret-file differs from this one)",
                    ));
                }
                let proof = ClientMsg::Proof { proof: auth::client_proof(secret, &transcript) };
                reply = match self.call(&proof, "proof", self.call_timeout).await {
                    Err(ControlError::Closed { .. }) => return Err(closed(self)),
                    other => other?,
                };
            }
            (Some(_), ServerMsg::Welcome { .. }) => {
                return Err(self.auth_error(
                    "it did not prove the shared secret (it runs without --auth-secret-file; refusing it)",
                ));
            }
            (None, ServerMsg::Challenge { .. }) => {
                return Err(self.auth_error("it requires the shared secret: pass --auth-secret-file"));
            }
            _ => {}
        }
        match reply {
            ServerMsg::Welcome { version, .. } if version != CONTROL_VERSION => {
                Err(self.bad(format!("it speaks control protocol version {version}, this client {CONTROL_VERSION}")))
            }
            ServerMsg::Welcome { role: role @ (KvRole::Producer | KvRole::Consumer), idle_timeout_ms, .. } => {
                self.idle_timeout = Some(Duration::from_millis(idle_timeout_ms));
                Ok(role)
            }
            ServerMsg::Welcome { role, .. } => {
                Err(self.bad(format!("it serves role {role}, not a producer or consumer")))
            }
            other => Err(self.unexpected("welcome", &other)),
        }
    }

    /// How often to [`ControlClient::ping`] while this side waits on its
    /// own: a third of the server's idle timeout.
    pub fn keepalive_interval(&self) -> Duration {
        self.idle_timeout.map_or(self.call_timeout, |idle| idle / 3).max(Duration::from_millis(10))
    }

    /// Keeps the session alive (the server ends one with no call for its
    /// idle timeout).
    pub async fn ping(&mut self) -> Result<(), ControlError> {
        match self.call(&ClientMsg::Ping, "ping", self.call_timeout).await? {
            ServerMsg::Pong => Ok(()),
            other => Err(self.unexpected("pong", &other)),
        }
    }

    /// The server's process CPU time, peak resident set and current figures.
    pub async fn stats(&mut self) -> Result<PeerStats, ControlError> {
        match self.call(&ClientMsg::Stats, "stats", self.call_timeout).await? {
            ServerMsg::Stats { cpu_seconds, peak_rss_bytes, figures } => {
                let cpu = Duration::try_from_secs_f64(cpu_seconds)
                    .map_err(|_| self.bad(format!("cpu_seconds {cpu_seconds} is not a duration")))?;
                Ok(PeerStats { cpu, peak_rss_bytes, figures })
            }
            other => Err(self.unexpected("stats", &other)),
        }
    }

    /// Ends the session; returns once the server's worker is shut down.
    pub async fn bye(mut self) -> Result<(), ControlError> {
        match self.call(&ClientMsg::Bye, "bye", self.call_timeout).await? {
            ServerMsg::Bye => Ok(()),
            other => Err(self.unexpected("bye", &other)),
        }
    }
}

/// The prefill half of a bench, served by `kvlink serve --role producer`.
pub struct RemotePrefill {
    client: ControlClient,
}

impl RemotePrefill {
    /// Over a session whose server is a producer.
    pub fn new(client: ControlClient) -> Self {
        Self { client }
    }

    /// Gives the control connection back (to end the session).
    pub fn into_client(self) -> ControlClient {
        self.client
    }

    /// The control connection.
    pub fn client(&mut self) -> &mut ControlClient {
        &mut self.client
    }

    /// Prefills `prompts` in one step on the server; returns each with its
    /// params and the server's blocks.
    pub async fn prefill(
        &mut self,
        prompts: &[PromptSpec],
    ) -> Result<Vec<(PromptSpec, KvTransferParams, Vec<BlockId>)>, ControlError> {
        let c = &mut self.client;
        let msg = ClientMsg::Prefill { prompts: prompts.to_vec() };
        let items = match c.call(&msg, "prefill", c.call_timeout).await? {
            ServerMsg::Prefilled { items } => items,
            other => return Err(c.unexpected("prefilled", &other)),
        };
        if items.len() != prompts.len() {
            return Err(c.bad(format!("{} prefilled items for {} prompts", items.len(), prompts.len())));
        }
        let mut out = Vec::with_capacity(items.len());
        for (spec, item) in prompts.iter().zip(items) {
            if item.id != spec.id {
                return Err(c.bad(format!("prefilled {} where {} was asked", item.id, spec.id)));
            }
            let params = KvTransferParams::from_value(&item.params).map_err(|e| c.bad(e.to_string()))?;
            out.push((spec.clone(), params, item.blocks));
        }
        Ok(out)
    }

    /// Waits (bounded by `timeout`) until the server freed every request;
    /// returns how many it still holds.
    pub async fn drain(&mut self, timeout: Duration) -> Result<usize, ControlError> {
        let c = &mut self.client;
        let msg = ClientMsg::Drain { timeout_ms: timeout.as_millis().try_into().unwrap_or(u64::MAX) };
        match c.call(&msg, "drain", timeout + REPLY_MARGIN).await? {
            ServerMsg::Drained { held } => Ok(held),
            other => Err(c.unexpected("drained", &other)),
        }
    }
}

/// The decode half of a bench, served by `kvlink serve --role consumer`.
pub struct RemoteDecode {
    client: ControlClient,
    pulling: HashSet<ReqId>,
}

impl RemoteDecode {
    /// Over a session whose server is a consumer.
    pub fn new(client: ControlClient) -> Self {
        Self { client, pulling: HashSet::new() }
    }

    /// Gives the control connection back (to end the session).
    pub fn into_client(self) -> ControlClient {
        self.client
    }

    /// The control connection.
    pub fn client(&mut self) -> &mut ControlClient {
        &mut self.client
    }

    /// Pulls in flight on the server.
    pub fn pulling(&self) -> usize {
        self.pulling.len()
    }

    /// Tells the server its engine has seen `pulls` and will pull them later.
    pub async fn watch(&mut self, pulls: &[PullSpec]) -> Result<(), ControlError> {
        let c = &mut self.client;
        let wire = pulls.iter().map(wire_pull).collect();
        match c.call(&ClientMsg::Watch { pulls: wire }, "watch", c.call_timeout).await? {
            ServerMsg::Watching { requests } if requests == pulls.len() => Ok(()),
            other => Err(c.unexpected("watching", &other)),
        }
    }

    /// Starts `pulls` in one step on the server; returns the server's blocks
    /// per pull.
    pub async fn schedule(&mut self, pulls: &[PullSpec]) -> Result<Vec<Vec<BlockId>>, ControlError> {
        let c = &mut self.client;
        let wire = pulls.iter().map(wire_pull).collect();
        let blocks = match c.call(&ClientMsg::Schedule { pulls: wire }, "schedule", c.call_timeout).await? {
            ServerMsg::Scheduled { blocks } => blocks,
            other => return Err(c.unexpected("scheduled", &other)),
        };
        if blocks.len() != pulls.len() {
            return Err(c.bad(format!("{} block lists for {} pulls", blocks.len(), pulls.len())));
        }
        self.pulling.extend(pulls.iter().map(|p| p.id.clone()));
        Ok(blocks)
    }

    /// Waits up to `timeout` for pulls to finish on the server.
    pub async fn complete(&mut self, timeout: Duration) -> Result<Vec<Completion>, ControlError> {
        let c = &mut self.client;
        let msg = ClientMsg::Complete { timeout_ms: timeout.as_millis().try_into().unwrap_or(u64::MAX) };
        let items = match c.call(&msg, "complete", timeout + REPLY_MARGIN).await? {
            ServerMsg::Completions { items } => items,
            other => return Err(c.unexpected("completions", &other)),
        };
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let id = match &item {
                Completion::Received { id, .. } | Completion::Corrupt { id, .. } | Completion::Failed { id, .. } => id,
            };
            if self.pulling.remove(id) {
                out.push(item);
            } else {
                tracing::warn!(req_id = %id, "the decode server reported a request this client did not start; ignored");
            }
        }
        Ok(out)
    }
}

/// A pull as the control channel carries it.
fn wire_pull(p: &PullSpec) -> WirePull {
    WirePull {
        id: p.id.clone(),
        prompt_len: p.prompt_len,
        seed: p.seed,
        // Serializing plain bools, strings and integers cannot fail.
        params: serde_json::to_value(&p.params).unwrap_or_default(),
        prefix_hit_tokens: p.prefix_hit_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_default_the_control_port() {
        let ok = |t: &str| split_target(t).unwrap();
        assert_eq!(ok("10.0.0.1"), ("10.0.0.1".to_owned(), DEFAULT_CONTROL_PORT));
        assert_eq!(ok("10.0.0.1:7"), ("10.0.0.1".to_owned(), 7));
        assert_eq!(ok("host.example"), ("host.example".to_owned(), DEFAULT_CONTROL_PORT));
        assert_eq!(ok("host.example:9"), ("host.example".to_owned(), 9));
        assert_eq!(ok("::1"), ("::1".to_owned(), DEFAULT_CONTROL_PORT));
        assert_eq!(ok("[::1]:5"), ("::1".to_owned(), 5));
        assert_eq!(ok("[::1]"), ("::1".to_owned(), DEFAULT_CONTROL_PORT));
        assert!(split_target("h:99999").is_err());
        assert!(split_target(":1").is_err());
        assert!(split_target("").is_err());
    }
}
