//! The opening of a control connection, before the queue-pair exchange:
//! versions and flags agreed, the shared secret proved both ways when both
//! sides hold one, and the receiver's admission (an established place, taken
//! only once all of that succeeded). The receiver creates no queue pair and
//! opens no grant for a sender that did not finish this. The caller bounds
//! the whole exchange by one deadline.
//!
//! ```text
//! preamble (sender → receiver, 8 bytes; 40 with FLAG_AUTH)
//!  | KVRC | version u16 = 2 | flags u16 | [client_nonce, 32 bytes, if FLAG_AUTH]
//!    flags: bit 0 FLAG_AUTH (the sender holds the shared secret); unknown
//!    bits are refused
//! accept (receiver → sender, 8 bytes)
//!  | KVRC | version u16 | status u16 |
//!    status: 0 accepted, 1 unsupported version, 2 unsupported flags,
//!    3 the receiver requires the secret, 4 the receiver has no secret,
//!    5 the receiver serves its most connections (it closes after a
//!    non-zero status)
//! authentication (only when both hold a secret)
//!  receiver → sender: server_nonce (32) | server_proof (32)
//!  sender → receiver: client_proof (32)     (after checking server_proof)
//!  receiver → sender: verdict u8 (0 ok; 1 refused; 2 proved, but the
//!                     receiver serves its most connections; then close)
//! ```
//!
//! The proofs are [`kv_proto::auth`]'s over the transcript of
//! [`Channel::DataRdma`] (so no proof made for another protocol verifies
//! here), both nonces, and as context the preamble and the accept reply as
//! sent. Once both proofs verified, each side derives the connection's
//! [`Session`] from that transcript: every later frame (the queue-pair
//! exchange, requests, replies) carries its tag ([`crate::tags`]). Version
//! 2 is the first whose later frames carry tags.

use kv_proto::auth::{self, AuthSecret, Channel, Nonce, Transcript, AUTH_TAG_LEN};
use kv_proto::session::{End, Session};
use kv_proto::AcceptStatus;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::tags::FrameTags;

/// First bytes of the preamble and the accept reply.
pub const MAGIC: [u8; 4] = *b"KVRC";
/// The opening's version this build speaks.
pub const VERSION: u16 = 2;
/// Preamble flag: the sender holds the shared secret; its nonce follows.
pub const FLAG_AUTH: u16 = 1;
/// Bytes of the preamble (the nonce not included) and of the accept reply.
pub const OPENING_LEN: usize = 8;
/// Verdict byte after the sender's proof: accepted.
pub const VERDICT_OK: u8 = 0;
/// Verdict byte after the sender's proof: refused.
pub const VERDICT_REFUSED: u8 = 1;
/// Verdict byte after the sender's proof: proved, but no place.
pub const VERDICT_BUSY: u8 = 2;

/// Why an opening failed (on either side; the connection is then closed).
#[derive(Debug, thiserror::Error)]
pub enum OpeningError {
    /// Not a kvlink RDMA control connection.
    #[error("not a kvlink RDMA control connection (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// The peer speaks another version.
    #[error("the peer speaks control version {0}, this build speaks {VERSION}")]
    UnsupportedVersion(u16),
    /// Flags one side does not know.
    #[error("unsupported control flags {0:#06x}")]
    UnsupportedFlags(u16),
    /// The receiver requires the shared secret; the sender has none.
    #[error("the receiver requires the data-plane shared secret (RdmaConfig::auth_secret); the sender has none")]
    SecretRequired,
    /// The sender has a shared secret; the receiver has none.
    #[error("the receiver has no data-plane shared secret; a sender with one writes only to receivers that prove it")]
    SecretUnavailable,
    /// The peer's proof does not verify.
    #[error(
        "the peer's proof does not verify (another shared secret, or a proof made for another connection or protocol)"
    )]
    BadProof,
    /// The receiver refused the sender's proof.
    #[error("the receiver refused this sender's proof of the data-plane shared secret")]
    ProofRefused,
    /// The receiver serves its most connections already.
    #[error(
        "the receiver serves its maximum of RDMA control connections (RdmaConfig::limits.max_connections) already"
    )]
    Busy,
    /// A status or verdict this build does not know.
    #[error("unknown control opening answer {0}")]
    Unknown(u16),
    /// No OS randomness for a nonce (authentication is refused, never weakened).
    #[error("no OS randomness for a nonce")]
    NoRandomness,
    /// The session keys could not be made (HMAC takes keys of any length,
    /// so this does not happen; refused rather than left untagged).
    #[error("cannot derive the control connection's session keys")]
    NoSessionKeys,
    /// The peer closed the connection during the opening.
    #[error("the peer closed the connection during the opening")]
    PeerClosed,
    /// The connection failed.
    #[error("control opening I/O failed: {0}")]
    Io(#[from] std::io::Error),
}

fn encode(code: u16, flags_or_status: u16) -> [u8; OPENING_LEN] {
    let mut b = [0u8; OPENING_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&code.to_le_bytes());
    b[6..].copy_from_slice(&flags_or_status.to_le_bytes());
    b
}

/// `(version, flags or status)` of a preamble or accept reply.
fn decode(b: &[u8; OPENING_LEN]) -> Result<(u16, u16), OpeningError> {
    let mut magic = [0u8; 4];
    magic.copy_from_slice(&b[..4]);
    if magic != MAGIC {
        return Err(OpeningError::BadMagic(magic));
    }
    Ok((u16::from_le_bytes([b[4], b[5]]), u16::from_le_bytes([b[6], b[7]])))
}

/// The transcript's context: the preamble and the accept reply, as sent.
fn context(preamble: &[u8; OPENING_LEN], accept: &[u8; OPENING_LEN]) -> [u8; 2 * OPENING_LEN] {
    let mut b = [0u8; 2 * OPENING_LEN];
    b[..OPENING_LEN].copy_from_slice(preamble);
    b[OPENING_LEN..].copy_from_slice(accept);
    b
}

async fn read<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut [u8]) -> Result<(), OpeningError> {
    match stream.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => Err(OpeningError::PeerClosed),
        Err(err) => Err(err.into()),
    }
}

async fn write<S: AsyncWrite + Unpin>(stream: &mut S, bytes: &[u8]) -> Result<(), OpeningError> {
    stream.write_all(bytes).await?;
    stream.flush().await?;
    Ok(())
}

/// The tags of the frames after an opening under `secret` and `transcript`.
fn tags(secret: &AuthSecret, transcript: &Transcript<'_>, end: End) -> Result<FrameTags, OpeningError> {
    Session::derive(secret, transcript, end)
        .map(|session| FrameTags::new(Some(session)))
        .ok_or(OpeningError::NoSessionKeys)
}

/// The sender's side: proves the secret if it holds one (and checks the
/// receiver proves it first), and learns whether the receiver admits it.
/// Returns the tags of the connection's later frames (none without a
/// secret).
pub async fn client<S>(stream: &mut S, secret: Option<&AuthSecret>) -> Result<FrameTags, OpeningError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let client_nonce: Nonce = match secret {
        Some(_) => auth::fresh_nonce().ok_or(OpeningError::NoRandomness)?,
        None => [0; AUTH_TAG_LEN],
    };
    let preamble = encode(VERSION, if secret.is_some() { FLAG_AUTH } else { 0 });
    let mut opening = preamble.to_vec();
    if secret.is_some() {
        opening.extend_from_slice(&client_nonce);
    }
    write(stream, &opening).await?;
    let mut accept = [0u8; OPENING_LEN];
    read(stream, &mut accept).await?;
    let (version, status) = decode(&accept)?;
    match AcceptStatus::from_code(status) {
        AcceptStatus::Accepted if version == VERSION => {}
        AcceptStatus::Accepted | AcceptStatus::UnsupportedVersion => {
            return Err(OpeningError::UnsupportedVersion(version))
        }
        AcceptStatus::UnsupportedFlags => return Err(OpeningError::UnsupportedFlags(FLAG_AUTH)),
        AcceptStatus::AuthRequired => return Err(OpeningError::SecretRequired),
        AcceptStatus::AuthUnavailable => return Err(OpeningError::SecretUnavailable),
        AcceptStatus::Busy => return Err(OpeningError::Busy),
        // No RDMA receiver sends the TCP-only status: unknown here.
        status @ (AcceptStatus::PayloadAuthRequired | AcceptStatus::Unknown(_)) => {
            return Err(OpeningError::Unknown(status.code()))
        }
    }
    let Some(secret) = secret else { return Ok(FrameTags::none()) };
    let mut challenge = [0u8; 2 * AUTH_TAG_LEN];
    read(stream, &mut challenge).await?;
    let (server_nonce, server_proof) = challenge.split_at(AUTH_TAG_LEN);
    let mut nonce: Nonce = [0; AUTH_TAG_LEN];
    nonce.copy_from_slice(server_nonce);
    let context = context(&preamble, &accept);
    let transcript =
        Transcript { channel: Channel::DataRdma, client_nonce: &client_nonce, server_nonce: &nonce, context: &context };
    // The receiver proves first: no client proof for a receiver that could
    // not prove itself (no oracle for the secret).
    if !auth::verify_server_proof(secret, &transcript, server_proof) {
        return Err(OpeningError::BadProof);
    }
    write(stream, &auth::client_proof(secret, &transcript)).await?;
    let mut verdict = [0u8; 1];
    read(stream, &mut verdict).await?;
    match verdict[0] {
        VERDICT_OK => tags(secret, &transcript, End::Client),
        VERDICT_REFUSED => Err(OpeningError::ProofRefused),
        VERDICT_BUSY => Err(OpeningError::Busy),
        other => Err(OpeningError::Unknown(u16::from(other))),
    }
}

/// The receiver's side: checks the preamble, authenticates the sender if
/// this side holds a secret, and then, once all of that succeeded, takes
/// the connection's established place with `establish` (a sender for which
/// it gives none is told so). Returns that place and the tags of the
/// connection's later frames (none without a secret).
pub async fn server<S, P>(
    stream: &mut S,
    secret: Option<&AuthSecret>,
    establish: impl FnOnce() -> Option<P>,
) -> Result<(P, FrameTags), OpeningError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    // Called once, on whichever path succeeds.
    let mut establish = Some(establish);
    let mut establish = move || establish.take().and_then(|establish| establish());
    let mut preamble = [0u8; OPENING_LEN];
    read(stream, &mut preamble).await?;
    let (version, flags) = decode(&preamble)?;
    let announced = flags & FLAG_AUTH != 0;
    // What follows an accepting reply: the place (no secret here), or the
    // proof of this secret.
    let next = if version != VERSION {
        Err((AcceptStatus::UnsupportedVersion, OpeningError::UnsupportedVersion(version)))
    } else if flags & !FLAG_AUTH != 0 {
        Err((AcceptStatus::UnsupportedFlags, OpeningError::UnsupportedFlags(flags)))
    } else {
        match (secret, announced) {
            (Some(_), false) => Err((AcceptStatus::AuthRequired, OpeningError::SecretRequired)),
            (None, true) => Err((AcceptStatus::AuthUnavailable, OpeningError::SecretUnavailable)),
            (Some(secret), true) => Ok(Err(secret)),
            (None, false) => establish().map(Ok).ok_or((AcceptStatus::Busy, OpeningError::Busy)),
        }
    };
    let mut client_nonce: Nonce = [0; AUTH_TAG_LEN];
    if let Ok(Err(_)) = next {
        read(stream, &mut client_nonce).await?;
    }
    let status = next.as_ref().map_or_else(|(status, _)| *status, |_| AcceptStatus::Accepted);
    let accept = encode(VERSION, status.code());
    write(stream, &accept).await?;
    let secret = match next {
        Err((_, refusal)) => return Err(refusal),
        Ok(Ok(place)) => return Ok((place, FrameTags::none())),
        Ok(Err(secret)) => secret,
    };
    let server_nonce = auth::fresh_nonce().ok_or(OpeningError::NoRandomness)?;
    let context = context(&preamble, &accept);
    let transcript = Transcript {
        channel: Channel::DataRdma,
        client_nonce: &client_nonce,
        server_nonce: &server_nonce,
        context: &context,
    };
    let mut challenge = server_nonce.to_vec();
    challenge.extend_from_slice(&auth::server_proof(secret, &transcript));
    write(stream, &challenge).await?;
    let mut proof = [0u8; AUTH_TAG_LEN];
    read(stream, &mut proof).await?;
    let verdict = if auth::verify_client_proof(secret, &transcript, &proof) {
        establish().ok_or(OpeningError::Busy)
    } else {
        Err(OpeningError::BadProof)
    };
    let byte = match &verdict {
        Ok(_) => VERDICT_OK,
        Err(OpeningError::Busy) => VERDICT_BUSY,
        Err(_) => VERDICT_REFUSED,
    };
    let written = write(stream, &[byte]).await;
    // A refusal is reported as such even when the peer is gone before its
    // verdict (so a wrong proof is still told from a broken connection).
    let place = verdict?;
    written?;
    Ok((place, tags(secret, &transcript, End::Server)?))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rstest::rstest;
    use tokio::io::{duplex, DuplexStream};

    use super::*;

    const SECRET: &str = "the data-plane secret";

    fn secret(s: Option<&str>) -> Option<AuthSecret> {
        s.map(AuthSecret::new)
    }

    /// Both sides over a pipe; the receiver has `places` established places.
    async fn open(
        sender: Option<&str>,
        receiver: Option<&str>,
        places: usize,
    ) -> (Result<FrameTags, OpeningError>, Result<((), FrameTags), OpeningError>) {
        let (mut a, mut b) = duplex(4096);
        let (sender, receiver) = (secret(sender), secret(receiver));
        let server = async {
            let result = server(&mut b, receiver.as_ref(), || (places > 0).then_some(())).await;
            // The receiver closes after a refusal; the sender then reads the end.
            drop(b);
            result
        };
        let client = async {
            let result = client(&mut a, sender.as_ref()).await;
            // A sender closes after a failure too.
            drop(a);
            result
        };
        let (client, server) = tokio::join!(client, server);
        (client, server)
    }

    #[rstest]
    #[case::no_secrets(None, None, 1, None)]
    #[case::same_secret(Some(SECRET), Some(SECRET), 1, None)]
    #[case::receiver_requires_it(None, Some(SECRET), 1, Some("requires the data-plane shared secret"))]
    #[case::sender_requires_it(Some(SECRET), None, 1, Some("has no data-plane shared secret"))]
    #[case::different_secrets(Some("guess"), Some(SECRET), 1, Some("proof does not verify"))]
    #[case::busy(None, None, 0, Some("max_connections"))]
    #[case::busy_after_the_proof(Some(SECRET), Some(SECRET), 0, Some("max_connections"))]
    #[tokio::test]
    async fn only_peers_proving_the_same_secret_are_admitted(
        #[case] sender: Option<&str>,
        #[case] receiver: Option<&str>,
        #[case] places: usize,
        #[case] refusal: Option<&str>,
    ) {
        let (client, server) = open(sender, receiver, places).await;
        match refusal {
            None => {
                let tagged = sender.is_some();
                assert_eq!(client.unwrap().is_on(), tagged, "the sender's later frames are tagged iff it proved");
                assert_eq!(server.unwrap().1.is_on(), tagged, "the receiver's too");
            }
            Some(expected) => {
                let err = client.unwrap_err();
                assert!(err.to_string().contains(expected), "{err}");
                assert!(server.is_err(), "the receiver admitted a refused sender");
            }
        }
    }

    /// A sender's stalled proof until the test's deadline: the receiver
    /// never admits it (the caller's deadline closes the connection).
    #[tokio::test(start_paused = true)]
    async fn a_sender_that_never_proves_is_never_admitted() {
        let (mut a, mut b): (DuplexStream, DuplexStream) = duplex(4096);
        let mut opening = encode(VERSION, FLAG_AUTH).to_vec();
        opening.extend_from_slice(&[7; AUTH_TAG_LEN]);
        a.write_all(&opening).await.unwrap();
        let secret = AuthSecret::new(SECRET);
        let admitted = tokio::time::timeout(Duration::from_secs(10), server(&mut b, Some(&secret), || Some(()))).await;
        assert!(admitted.is_err(), "admitted without a proof: {admitted:?}");
    }

    /// Proofs made for the other data planes, over the same transcript, are
    /// refused.
    #[rstest]
    #[case::tcp(Channel::DataTcp)]
    #[case::quic(Channel::DataQuic)]
    #[case::side_channel(Channel::SideChannel)]
    #[tokio::test]
    async fn a_proof_for_another_protocol_is_refused(#[case] channel: Channel) {
        let (mut a, mut b) = duplex(4096);
        let secret = AuthSecret::new(SECRET);
        let server = server(&mut b, Some(&secret), || Some(()));
        let forger = async {
            let client_nonce = [3u8; AUTH_TAG_LEN];
            let preamble = encode(VERSION, FLAG_AUTH);
            let mut opening = preamble.to_vec();
            opening.extend_from_slice(&client_nonce);
            a.write_all(&opening).await.unwrap();
            let mut accept = [0u8; OPENING_LEN];
            a.read_exact(&mut accept).await.unwrap();
            let mut challenge = [0u8; 2 * AUTH_TAG_LEN];
            a.read_exact(&mut challenge).await.unwrap();
            let mut server_nonce = [0u8; AUTH_TAG_LEN];
            server_nonce.copy_from_slice(&challenge[..AUTH_TAG_LEN]);
            let context = context(&preamble, &accept);
            let transcript =
                Transcript { channel, client_nonce: &client_nonce, server_nonce: &server_nonce, context: &context };
            a.write_all(&auth::client_proof(&secret, &transcript)).await.unwrap();
            let mut verdict = [0u8; 1];
            a.read_exact(&mut verdict).await.unwrap();
            verdict[0]
        };
        let (server, verdict) = tokio::join!(server, forger);
        assert!(matches!(server, Err(OpeningError::BadProof)), "{server:?}");
        assert_eq!(verdict, VERDICT_REFUSED);
    }

    #[rstest]
    #[case::bad_magic(*b"KVRX\x01\x00\x00\x00")]
    #[case::version_one_untagged(encode(1, 0))]
    #[case::a_later_version(encode(VERSION + 1, 0))]
    #[case::unknown_flags(encode(VERSION, 2))]
    #[tokio::test]
    async fn a_bad_preamble_is_refused(#[case] preamble: [u8; OPENING_LEN]) {
        let (mut a, mut b) = duplex(4096);
        a.write_all(&preamble).await.unwrap();
        let result = server(&mut b, None, || Some(())).await;
        assert!(result.is_err(), "admitted a bad preamble");
    }
}
