//! Shared-secret mutual authentication of a side-channel connection
//! (challenge–response, before any transfer request is read).
//!
//! ```text
//! D → P  Hello { .., client_nonce }
//! P → D  HelloReply::Challenge { server_nonce, server_proof = MAC("kvlink-p", client_nonce, server_nonce) }
//! D → P  AuthProof { client_proof = MAC("kvlink-d", server_nonce, client_nonce) }   (after checking server_proof)
//! P → D  HelloReply::Accepted | Rejected
//! ```
//!
//! MAC is HMAC-SHA-256 keyed with the shared secret. Both nonces are fresh
//! per connection, so a recorded exchange cannot be replayed, and each side
//! proves knowledge of the secret without revealing it. This authenticates
//! peers; it does not encrypt the side channel.

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

fn mac(secret: &[u8], role: &[u8], first: &Nonce, second: &Nonce) -> Proof {
    // HMAC takes keys of any length, so this cannot fail.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else { return [0; AUTH_TAG_LEN] };
    mac.update(role);
    mac.update(first);
    mac.update(second);
    mac.finalize().into_bytes().into()
}

/// P's proof, answering D's nonce.
pub fn server_proof(secret: &[u8], client_nonce: &Nonce, server_nonce: &Nonce) -> Proof {
    mac(secret, b"kvlink-p", client_nonce, server_nonce)
}

/// D's proof, answering P's nonce.
pub fn client_proof(secret: &[u8], server_nonce: &Nonce, client_nonce: &Nonce) -> Proof {
    mac(secret, b"kvlink-d", server_nonce, client_nonce)
}

/// Whether `got` equals `expected`, in time independent of where they differ.
pub fn proofs_match(expected: &Proof, got: &Proof) -> bool {
    expected.iter().zip(got).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_secret_role_and_both_nonces() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let p = server_proof(b"secret", &a, &b);
        assert!(proofs_match(&p, &server_proof(b"secret", &a, &b)));
        assert!(!proofs_match(&p, &server_proof(b"other", &a, &b)));
        assert!(!proofs_match(&p, &server_proof(b"secret", &b, &a)));
        assert!(!proofs_match(&p, &client_proof(b"secret", &a, &b)), "a P proof is no D proof");
        assert!(!proofs_match(&p, &[0; 32]));
    }
}
