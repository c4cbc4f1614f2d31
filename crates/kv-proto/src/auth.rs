//! Shared-secret mutual authentication (challenge–response) of a connection,
//! before anything else on it is read.
//!
//! ```text
//! client → server  client_nonce (with whatever opens the connection)
//! server → client  server_nonce, server_proof = MAC(transcript, "server")
//! client → server  client_proof = MAC(transcript, "client")   (after checking server_proof)
//! server → client  verdict
//! ```
//!
//! MAC is HMAC-SHA-256 keyed with the shared secret, over the whole
//! transcript: a version tag, the [`Channel`] (which protocol and what the
//! connection is for, so a proof made for one protocol is worthless on
//! another), the prover's role, both nonces (client's first), and the
//! channel's opening message (`context`, e.g. the side-channel hello, so it
//! cannot be swapped). Every field is length-prefixed, so no two transcripts
//! encode alike. Both nonces are fresh per connection, so a recorded exchange
//! cannot be replayed; the client checks the server's proof before it sends
//! its own, and a server only ever produces server proofs, so neither can be
//! used as an oracle for the other (no reflection). Proofs are compared in
//! constant time by the MAC crate. This authenticates peers; it does not
//! encrypt anything, and on its own it covers only the handshake: what
//! follows is covered by keys derived from the transcript ([`crate::session`]).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// A shared secret; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthSecret(std::sync::Arc<[u8]>);

impl AuthSecret {
    /// Wraps the secret bytes.
    pub fn new(secret: impl AsRef<[u8]>) -> Self {
        Self(secret.as_ref().into())
    }

    /// The secret bytes (to key a MAC; never to log).
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for AuthSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthSecret(..)")
    }
}

/// Bytes of a nonce and of a proof.
pub const AUTH_TAG_LEN: usize = 32;

/// A per-connection random value.
pub type Nonce = [u8; AUTH_TAG_LEN];

/// Proof of knowing the shared secret.
pub type Proof = [u8; AUTH_TAG_LEN];

/// A fresh nonce, or `None` if the OS random source fails (authentication is
/// then refused, never weakened).
pub fn fresh_nonce() -> Option<Nonce> {
    crate::random::array()
}

/// Which protocol a connection speaks and what it is for: part of every
/// proof, so proofs never cross protocols.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Channel {
    /// The side channel: decode worker (client) asks a prefill worker (server) for KV.
    SideChannel,
    /// The TCP data plane: a prefill worker (client) writes into a decode worker (server).
    DataTcp,
    /// The QUIC data plane: a prefill worker (client) writes into a decode worker (server).
    DataQuic,
    /// The RDMA data plane's control connection (TCP): a prefill worker
    /// (client) asks a decode worker (server) to open grants for its writes.
    DataRdma,
    /// The bench's control channel between two `kvlink` processes.
    Control,
}

impl Channel {
    fn label(self) -> &'static [u8] {
        match self {
            Channel::SideChannel => b"side-channel: decode asks prefill",
            Channel::DataTcp => b"data-plane/tcp: prefill writes into decode",
            Channel::DataQuic => b"data-plane/quic: prefill writes into decode",
            Channel::DataRdma => b"data-plane/rdma: prefill writes into decode",
            Channel::Control => b"bench control",
        }
    }
}

/// Everything a proof is bound to.
#[derive(Clone, Copy, Debug)]
pub struct Transcript<'a> {
    /// The protocol and purpose of the connection.
    pub channel: Channel,
    /// The connecting side's nonce.
    pub client_nonce: &'a Nonce,
    /// The accepting side's nonce.
    pub server_nonce: &'a Nonce,
    /// The connection's opening message as sent (may be empty).
    pub context: &'a [u8],
}

impl Transcript<'_> {
    /// What names the channel in every MAC over this transcript.
    pub(crate) fn channel_label(&self) -> &'static [u8] {
        self.channel.label()
    }
}

/// Which side proves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prover {
    Client,
    Server,
}

/// The MAC over `transcript`, or `None` if it cannot be keyed (HMAC takes
/// keys of any length, so it always can).
fn mac(secret: &[u8], transcript: &Transcript<'_>, prover: Prover) -> Option<Hmac<Sha256>> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).ok()?;
    let role: &[u8] = match prover {
        Prover::Client => b"client",
        Prover::Server => b"server",
    };
    for field in [
        b"kvlink-auth/1".as_slice(),
        transcript.channel.label(),
        role,
        transcript.client_nonce,
        transcript.server_nonce,
        transcript.context,
    ] {
        mac.update(&(field.len() as u64).to_le_bytes());
        mac.update(field);
    }
    Some(mac)
}

/// The accepting side's proof.
pub fn server_proof(secret: &AuthSecret, transcript: &Transcript<'_>) -> Proof {
    mac(secret.bytes(), transcript, Prover::Server).map_or([0; AUTH_TAG_LEN], |m| m.finalize().into_bytes().into())
}

/// The connecting side's proof.
pub fn client_proof(secret: &AuthSecret, transcript: &Transcript<'_>) -> Proof {
    mac(secret.bytes(), transcript, Prover::Client).map_or([0; AUTH_TAG_LEN], |m| m.finalize().into_bytes().into())
}

/// Whether `proof` is the accepting side's proof of `transcript` (constant time).
pub fn verify_server_proof(secret: &AuthSecret, transcript: &Transcript<'_>, proof: &[u8]) -> bool {
    mac(secret.bytes(), transcript, Prover::Server).is_some_and(|m| m.verify_slice(proof).is_ok())
}

/// Whether `proof` is the connecting side's proof of `transcript` (constant time).
pub fn verify_client_proof(secret: &AuthSecret, transcript: &Transcript<'_>, proof: &[u8]) -> bool {
    mac(secret.bytes(), transcript, Prover::Client).is_some_and(|m| m.verify_slice(proof).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t<'a>(channel: Channel, c: &'a Nonce, s: &'a Nonce, context: &'a [u8]) -> Transcript<'a> {
        Transcript { channel, client_nonce: c, server_nonce: s, context }
    }

    #[test]
    fn proofs_bind_secret_channel_role_nonces_and_context() {
        let secret = AuthSecret::new("secret");
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let base = t(Channel::SideChannel, &a, &b, b"hello");
        let p = server_proof(&secret, &base);
        assert!(verify_server_proof(&secret, &base, &p));
        assert!(!verify_server_proof(&AuthSecret::new("other"), &base, &p));
        assert!(!verify_client_proof(&secret, &base, &p), "a server proof is no client proof (reflection)");
        for other in [
            t(Channel::DataTcp, &a, &b, b"hello"),
            t(Channel::DataQuic, &a, &b, b"hello"),
            t(Channel::DataRdma, &a, &b, b"hello"),
            t(Channel::Control, &a, &b, b"hello"),
            t(Channel::SideChannel, &b, &a, b"hello"),
            t(Channel::SideChannel, &a, &b, b"hellO"),
            t(Channel::SideChannel, &a, &b, b""),
        ] {
            assert!(!verify_server_proof(&secret, &other, &p), "{other:?} accepted a proof made for {base:?}");
        }
        assert!(!verify_server_proof(&secret, &base, &p[..31]), "a truncated proof never verifies");
        assert!(!verify_server_proof(&secret, &base, &[0; 32]));
        assert!(verify_client_proof(&secret, &base, &client_proof(&secret, &base)));
    }

    #[test]
    fn every_channel_has_its_own_label() {
        let all = [Channel::SideChannel, Channel::DataTcp, Channel::DataQuic, Channel::DataRdma, Channel::Control];
        let labels: std::collections::HashSet<&[u8]> = all.iter().map(|c| c.label()).collect();
        assert_eq!(labels.len(), all.len());
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(fresh_nonce(), fresh_nonce());
    }
}
