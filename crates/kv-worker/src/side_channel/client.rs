//! D's side-channel client: one connection per prefill worker, reused across
//! steps, carrying many transfer requests at once (replies matched by id).

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::{SinkExt, StreamExt};
use kv_proto::auth;
use kv_proto::{FrameCodec, Hello, HelloReply, SideMessage, XferReply, XferRequest};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::AuthSecret;
use crate::nonce;
use crate::receiver::SideChannelAddr;
use crate::side_channel::SideChannelCodec;

type Pending = oneshot::Sender<Result<XferReply, String>>;

/// What a client needs to open connections.
#[derive(Clone, Debug)]
pub(crate) struct ClientSettings {
    pub(crate) hello: Hello,
    pub(crate) connect_timeout: std::time::Duration,
    pub(crate) max_frame_len: usize,
    pub(crate) auth_secret: Option<AuthSecret>,
}

/// A handle on one prefill worker's side channel.
pub(crate) struct SideChannelClient {
    peer: SideChannelAddr,
    settings: ClientSettings,
    cancel: CancellationToken,
    tracker: TaskTracker,
    conn: Mutex<Option<mpsc::Sender<(XferRequest, Pending)>>>,
}

impl SideChannelClient {
    pub(crate) fn new(
        peer: SideChannelAddr,
        settings: ClientSettings,
        cancel: CancellationToken,
        tracker: TaskTracker,
    ) -> Arc<Self> {
        Arc::new(Self { peer, settings, cancel, tracker, conn: Mutex::new(None) })
    }

    /// Sends one transfer request and waits for its reply (unbounded here:
    /// the caller bounds it with the transfer timeout).
    pub(crate) async fn request(&self, request: XferRequest) -> Result<XferReply, String> {
        let (tx, rx) = oneshot::channel();
        let mut item = (request, tx);
        // A pooled connection may have died since its last use: retry once on a fresh one.
        for attempt in 0..2 {
            let conn = self.connection(attempt > 0).await?;
            match conn.send(item).await {
                Ok(()) => return rx.await.unwrap_or_else(|_| Err(format!("connection to {} closed", self.peer))),
                Err(mpsc::error::SendError(back)) => item = back,
            }
        }
        Err(format!("connection to {} keeps closing", self.peer))
    }

    async fn connection(&self, fresh: bool) -> Result<mpsc::Sender<(XferRequest, Pending)>, String> {
        let mut slot = self.conn.lock().await;
        if let Some(tx) = slot.as_ref() {
            if !fresh && !tx.is_closed() {
                return Ok(tx.clone());
            }
        }
        *slot = None;
        let framed = tokio::time::timeout(self.settings.connect_timeout, self.handshake()).await.map_err(|_| {
            format!("connecting to {} timed out after {:?}", self.peer, self.settings.connect_timeout)
        })??;
        let (tx, rx) = mpsc::channel(64);
        self.tracker.spawn(run_connection(self.peer.clone(), framed, rx, self.cancel.clone()));
        *slot = Some(tx.clone());
        Ok(tx)
    }

    async fn handshake(&self) -> Result<Framed<TcpStream, SideChannelCodec>, String> {
        let stream = TcpStream::connect((self.peer.host.as_str(), self.peer.port))
            .await
            .map_err(|e| format!("cannot connect to prefill side channel {}: {e}", self.peer))?;
        let _ = stream.set_nodelay(true);
        let mut framed = Framed::new(stream, SideChannelCodec(FrameCodec::new(self.settings.max_frame_len)));
        let client_nonce = nonce::fresh().ok_or("no OS randomness for the side-channel nonce")?;
        let hello = Hello { client_nonce, ..self.settings.hello.clone() };
        framed.send(SideMessage::Hello(hello)).await.map_err(|e| e.to_string())?;
        let mut reply = self.next_reply(&mut framed).await?;
        if let HelloReply::Challenge { server_nonce, server_proof } = reply {
            let Some(secret) = &self.settings.auth_secret else {
                return Err(format!(
                    "prefill {} requires the side-channel shared secret; none is configured here",
                    self.peer
                ));
            };
            let expected = auth::server_proof(secret.bytes(), &client_nonce, &server_nonce);
            if !auth::proofs_match(&expected, &server_proof) {
                tracing::error!(peer = %self.peer, "prefill failed to prove the side-channel shared secret");
                return Err(format!("prefill {} failed to prove the shared secret", self.peer));
            }
            let proof = auth::client_proof(secret.bytes(), &server_nonce, &client_nonce);
            framed.send(SideMessage::AuthProof(proof)).await.map_err(|e| e.to_string())?;
            reply = self.next_reply(&mut framed).await?;
        } else if self.settings.auth_secret.is_some() && matches!(reply, HelloReply::Accepted { .. }) {
            tracing::error!(peer = %self.peer, "prefill did not authenticate");
            return Err(format!("prefill {} did not authenticate (no shared secret configured there?)", self.peer));
        }
        match reply {
            HelloReply::Accepted { engine_id } => {
                tracing::debug!(peer = %self.peer, peer_engine = %engine_id, "side channel connected");
                Ok(framed)
            }
            HelloReply::Rejected { reason } => {
                tracing::error!(peer = %self.peer, %reason, "prefill refused this decode instance");
                Err(format!("prefill {} refused: {reason}", self.peer))
            }
            HelloReply::Challenge { .. } => Err(format!("{} challenged twice", self.peer)),
        }
    }

    async fn next_reply(&self, framed: &mut Framed<TcpStream, SideChannelCodec>) -> Result<HelloReply, String> {
        match framed.next().await {
            Some(Ok(SideMessage::HelloReply(reply))) => Ok(reply),
            Some(Ok(_)) => Err(format!("{} sent something other than a hello reply", self.peer)),
            Some(Err(e)) => Err(format!("{}: {e}", self.peer)),
            None => Err(format!("{} closed the connection during hello", self.peer)),
        }
    }
}

async fn run_connection(
    peer: SideChannelAddr,
    framed: Framed<TcpStream, SideChannelCodec>,
    mut requests: mpsc::Receiver<(XferRequest, Pending)>,
    cancel: CancellationToken,
) {
    let (mut sink, mut stream) = framed.split();
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    let reason = loop {
        tokio::select! {
            () = cancel.cancelled() => break "decode worker shutting down".to_owned(),
            next = requests.recv() => match next {
                None => break "client dropped".to_owned(),
                Some((request, reply)) => {
                    let xfer_id = request.xfer_id;
                    if let Err(e) = sink.send(SideMessage::XferRequest(request)).await {
                        let _ = reply.send(Err(format!("sending to {peer}: {e}")));
                        break format!("send failed: {e}");
                    }
                    pending.insert(xfer_id, reply);
                }
            },
            frame = stream.next() => match frame {
                Some(Ok(SideMessage::XferReply(reply))) => match pending.remove(&reply.xfer_id) {
                    Some(waiter) => { let _ = waiter.send(Ok(reply)); }
                    None => tracing::warn!(%peer, xfer_id = reply.xfer_id, "reply to no pending transfer"),
                },
                Some(Ok(_)) => break "unexpected message from prefill".to_owned(),
                Some(Err(e)) => break format!("bad frame from prefill: {e}"),
                None => break "prefill closed the connection".to_owned(),
            },
        }
    };
    tracing::debug!(%peer, %reason, pending = pending.len(), "side-channel connection ended");
    for (_, waiter) in pending.drain() {
        let _ = waiter.send(Err(format!("{peer}: {reason}")));
    }
}
