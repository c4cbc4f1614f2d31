//! `auth`: proofs over arbitrary transcripts, secrets and proof bytes.

use arbitrary::{Arbitrary, Unstructured};
use kv_proto::auth::{
    client_proof, server_proof, verify_client_proof, verify_server_proof, AuthSecret, Channel, Nonce, Proof, Transcript,
};
use sha2::{Digest, Sha256};

#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
enum ArbChannel {
    SideChannel,
    DataTcp,
    DataQuic,
    DataRdma,
    Control,
}

impl From<ArbChannel> for Channel {
    fn from(c: ArbChannel) -> Self {
        match c {
            ArbChannel::SideChannel => Channel::SideChannel,
            ArbChannel::DataTcp => Channel::DataTcp,
            ArbChannel::DataQuic => Channel::DataQuic,
            ArbChannel::DataRdma => Channel::DataRdma,
            ArbChannel::Control => Channel::Control,
        }
    }
}

#[derive(Arbitrary, Clone, Debug, PartialEq, Eq)]
struct OwnedTranscript {
    channel: ArbChannel,
    client_nonce: Nonce,
    server_nonce: Nonce,
    context: Vec<u8>,
}

impl OwnedTranscript {
    fn view(&self) -> Transcript<'_> {
        Transcript {
            channel: self.channel.into(),
            client_nonce: &self.client_nonce,
            server_nonce: &self.server_nonce,
            context: &self.context,
        }
    }
}

#[derive(Arbitrary, Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Client,
    Server,
}

/// How the verifier's side differs from the prover's (`None`: not at all),
/// so that equal and nearly equal cases are common.
#[derive(Arbitrary, Debug)]
struct AuthInput {
    secret: Vec<u8>,
    prover: Role,
    transcript: OwnedTranscript,
    other_secret: Option<Vec<u8>>,
    other_role: Option<Role>,
    other_channel: Option<ArbChannel>,
    other_client_nonce: Option<Nonce>,
    other_server_nonce: Option<Nonce>,
    swap_nonces: bool,
    other_context: Option<Vec<u8>>,
    /// Bytes offered as a proof.
    forged: Vec<u8>,
    /// Where to damage the genuine proof (index, xor mask).
    flip: (u8, u8),
}

fn prove(role: Role, secret: &AuthSecret, t: &Transcript<'_>) -> Proof {
    match role {
        Role::Client => client_proof(secret, t),
        Role::Server => server_proof(secret, t),
    }
}

fn verify(role: Role, secret: &AuthSecret, t: &Transcript<'_>, proof: &[u8]) -> bool {
    match role {
        Role::Client => verify_client_proof(secret, t, proof),
        Role::Server => verify_server_proof(secret, t, proof),
    }
}

/// The key block HMAC-SHA-256 actually uses: a key longer than the 64-byte
/// block is hashed first, and every key is padded with zeros to the block.
/// Two secrets with the same block are the same HMAC key (a property of
/// HMAC, not of kvlink: `b"k"` and `b"k\0"` are one key).
fn hmac_key_block(secret: &[u8]) -> [u8; 64] {
    let mut block = [0u8; 64];
    if secret.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(secret));
    } else {
        block[..secret.len()].copy_from_slice(secret);
    }
    block
}

/// Proofs over built secrets and transcripts.
///
/// Checks: a genuine proof verifies for its own role, secret and transcript;
/// it verifies for the other side's role, secret and transcript exactly when
/// all three are the same (secrets compared as HMAC keys); any other bytes
/// (forged, damaged, truncated, extended) verify exactly when they equal the
/// genuine proof for the verifier's side; proofs are deterministic and a
/// server proof is never a client proof. Nothing panics.
pub fn auth(data: &[u8]) {
    let Ok(input) = AuthInput::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let secret = AuthSecret::new(&input.secret);
    let t = input.transcript.view();
    let proof = prove(input.prover, &secret, &t);
    assert_eq!(proof, prove(input.prover, &secret, &t), "proofs are not deterministic");
    assert!(verify(input.prover, &secret, &t, &proof), "a genuine proof does not verify");
    let other_role = match input.prover {
        Role::Client => Role::Server,
        Role::Server => Role::Client,
    };
    assert!(!verify(other_role, &secret, &t, &proof), "a {:?} proof verifies as the other role's", input.prover);

    // The verifier's side.
    let their_secret_bytes = input.other_secret.clone().unwrap_or_else(|| input.secret.clone());
    let their_secret = AuthSecret::new(&their_secret_bytes);
    let their_role = input.other_role.unwrap_or(input.prover);
    let mut theirs = input.transcript.clone();
    if let Some(c) = input.other_channel {
        theirs.channel = c;
    }
    if let Some(n) = input.other_client_nonce {
        theirs.client_nonce = n;
    }
    if let Some(n) = input.other_server_nonce {
        theirs.server_nonce = n;
    }
    if input.swap_nonces {
        std::mem::swap(&mut theirs.client_nonce, &mut theirs.server_nonce);
    }
    if let Some(c) = &input.other_context {
        theirs.context.clone_from(c);
    }
    let their_t = theirs.view();
    let same = their_role == input.prover
        && hmac_key_block(&their_secret_bytes) == hmac_key_block(&input.secret)
        && theirs == input.transcript;
    assert_eq!(
        verify(their_role, &their_secret, &their_t, &proof),
        same,
        "a {:?} proof for {:?} verified as {their_role:?} for {theirs:?} (same side: {same})",
        input.prover,
        input.transcript
    );

    // Other bytes offered as the verifier's proof.
    let genuine = prove(their_role, &their_secret, &their_t);
    let mut damaged = genuine;
    let index = usize::from(input.flip.0) % damaged.len();
    damaged[index] ^= input.flip.1;
    let mut extended = genuine.to_vec();
    extended.extend_from_slice(&input.forged);
    let cut = genuine.len().saturating_sub(1 + usize::from(input.flip.0) % genuine.len());
    for offered in [&input.forged[..], &damaged[..], &extended[..], &genuine[..cut]] {
        assert_eq!(
            verify(their_role, &their_secret, &their_t, offered),
            offered == genuine.as_slice(),
            "bytes {offered:02x?} verified wrongly as a {their_role:?} proof"
        );
    }
}
