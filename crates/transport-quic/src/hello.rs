//! The hello on a connection's first bidirectional stream: both sides say
//! whether they hold a shared secret and, if both do, prove it to each other
//! with a challenge–response bound to this TLS connection. No batch is sent
//! or served on a connection before its hello completed; the caller bounds
//! the whole exchange by one deadline.
//!
//! The proofs are [`kv_proto::auth`]'s, for [`Channel::DataQuic`], over a
//! transcript whose context is keying material exported from this TLS
//! session ([`EXPORTER_LABEL`]) followed by the client hello as sent: a proof
//! is worthless on any other connection (a relay gets a different exporter
//! value) and for any other protocol or direction.

use kv_proto::auth::{
    client_proof, fresh_nonce, server_proof, verify_client_proof, verify_server_proof, AuthSecret, Channel, Transcript,
    AUTH_TAG_LEN,
};
use kv_proto::dataplane::{bounded_reason, decode_verdict_header, put_verdict, ReplyStatus, VERDICT_HEADER_LEN};
use quinn::{Connection, ConnectionError, ReadError, ReadExactError, RecvStream, VarInt, WriteError};

use crate::wire::{
    transcript_context, ClientHello, HelloError, ServerHello, CLIENT_HELLO_LEN, CLOSE_AUTH, CLOSE_BUSY, CLOSE_PROTOCOL,
    EXPORTER_LABEL, EXPORTER_LEN, SERVER_HELLO_LEN,
};

/// Why a hello failed. Every variant has closed the connection (or found it
/// closed).
#[derive(Debug, thiserror::Error)]
pub(crate) enum HelloFailure {
    /// The peer authenticates, this side has no secret.
    #[error("the peer requires the data-plane shared secret and this side has none (QuicConfig::auth_secret)")]
    PeerRequiresSecret,
    /// This side authenticates, the peer has no secret.
    #[error("the peer has no data-plane shared secret; refusing an unauthenticated peer")]
    PeerHasNoSecret,
    /// The peer's proof does not verify.
    #[error(
        "the peer's proof does not verify (another shared secret, or a proof made for another connection or protocol)"
    )]
    BadProof,
    /// The peer refused this side (it closed the connection with a reason).
    #[error("the peer refused the hello: {0}")]
    Refused(String),
    /// The hello succeeded, but this side serves its most connections
    /// already (the peer was told so).
    #[error("{0}")]
    Busy(String),
    /// The peer's hello is malformed.
    #[error("malformed hello: {0}")]
    Malformed(#[from] HelloError),
    /// The hello stream ended before the exchange was complete.
    #[error("the hello stream ended early")]
    Truncated,
    /// No OS randomness for a nonce (authentication is refused, never weakened).
    #[error("no OS randomness for a nonce")]
    NoRandomness,
    /// The TLS session cannot export keying material.
    #[error("cannot export keying material from the TLS session")]
    NoKeyingMaterial,
    /// The connection or the stream failed.
    #[error("{0}")]
    Connection(String),
}

/// Closes `conn` with [`CLOSE_AUTH`] and `reason` (what the peer reads),
/// and returns `failure` (what this side reports).
fn refuse(conn: &Connection, reason: &str, failure: HelloFailure) -> HelloFailure {
    conn.close(VarInt::from_u32(CLOSE_AUTH), reason.as_bytes());
    failure
}

fn connection_failure(error: ConnectionError) -> HelloFailure {
    match error {
        ConnectionError::ApplicationClosed(close)
            if close.error_code == VarInt::from_u32(CLOSE_AUTH) || close.error_code == VarInt::from_u32(CLOSE_BUSY) =>
        {
            HelloFailure::Refused(bounded_reason(&String::from_utf8_lossy(&close.reason)).to_owned())
        }
        other => HelloFailure::Connection(format!("connection lost during the hello: {other}")),
    }
}

fn read_failure(error: ReadExactError) -> HelloFailure {
    match error {
        ReadExactError::FinishedEarly(_) => HelloFailure::Truncated,
        ReadExactError::ReadError(ReadError::ConnectionLost(e)) => connection_failure(e),
        ReadExactError::ReadError(other) => HelloFailure::Connection(format!("reading the hello: {other}")),
    }
}

fn write_failure(error: WriteError) -> HelloFailure {
    match error {
        WriteError::ConnectionLost(e) => connection_failure(e),
        other => HelloFailure::Connection(format!("writing the hello: {other}")),
    }
}

/// Keying material of this TLS session, for the transcript.
fn exported(conn: &Connection) -> Result<[u8; EXPORTER_LEN], HelloFailure> {
    let mut out = [0u8; EXPORTER_LEN];
    conn.export_keying_material(&mut out, EXPORTER_LABEL, b"").map_err(|_| HelloFailure::NoKeyingMaterial)?;
    Ok(out)
}

/// The sender's side: opens the first stream, says hello, authenticates if
/// both sides hold a secret.
pub(crate) async fn client(conn: &Connection, secret: Option<&AuthSecret>) -> Result<(), HelloFailure> {
    let (mut send, mut recv) = conn.open_bi().await.map_err(connection_failure)?;
    let nonce = match secret {
        Some(_) => {
            fresh_nonce().ok_or_else(|| refuse(conn, "no randomness for a nonce", HelloFailure::NoRandomness))?
        }
        None => [0; AUTH_TAG_LEN],
    };
    let hello = ClientHello { auth: secret.is_some(), nonce }.encode();
    send.write_all(&hello).await.map_err(write_failure)?;
    let mut answer = [0u8; SERVER_HELLO_LEN];
    recv.read_exact(&mut answer).await.map_err(read_failure)?;
    let server = match ServerHello::decode(&answer) {
        Ok(server) => server,
        Err(e) => {
            conn.close(VarInt::from_u32(CLOSE_PROTOCOL), b"malformed hello");
            return Err(e.into());
        }
    };
    let secret = match (secret, server.auth) {
        (None, false) => {
            // Fails only if the peer already stopped the stream; it answered.
            let _ = send.finish();
            return Ok(());
        }
        (None, true) => {
            return Err(refuse(conn, "this sender has no data-plane shared secret", HelloFailure::PeerRequiresSecret))
        }
        (Some(_), false) => {
            return Err(refuse(
                conn,
                "this sender requires the data-plane shared secret",
                HelloFailure::PeerHasNoSecret,
            ))
        }
        (Some(secret), true) => secret,
    };
    let context = transcript_context(&exported(conn)?, &hello);
    let transcript =
        Transcript { channel: Channel::DataQuic, client_nonce: &nonce, server_nonce: &server.nonce, context: &context };
    // The server proves first: a client proof is never produced for a
    // server that could not prove itself (no oracle for the secret).
    if !verify_server_proof(secret, &transcript, &server.proof) {
        let reason = "authentication failed: the receiver's proof does not verify";
        return Err(refuse(conn, reason, HelloFailure::BadProof));
    }
    send.write_all(&client_proof(secret, &transcript)).await.map_err(write_failure)?;
    let _ = send.finish();
    read_verdict(&mut recv).await
}

/// Reads the server's verdict on this side's proof.
async fn read_verdict(recv: &mut RecvStream) -> Result<(), HelloFailure> {
    let mut header = [0u8; VERDICT_HEADER_LEN];
    recv.read_exact(&mut header).await.map_err(read_failure)?;
    let (status, reason_len) = decode_verdict_header(&header);
    // A well-behaved server sends no reason with an OK; anything else is
    // only a message for the log, bounded.
    let mut reason = [0u8; 256];
    let shown = reason.get_mut(..(reason_len as usize).min(256)).unwrap_or_default();
    let reason = match recv.read_exact(shown).await {
        Ok(()) => String::from_utf8_lossy(shown).into_owned(),
        Err(_) => String::new(),
    };
    match status {
        ReplyStatus::Ok => Ok(()),
        _ => Err(HelloFailure::Refused(reason)),
    }
}

/// The receiver's side: accepts the first stream, answers the hello,
/// authenticates the sender if this side holds a secret. Once all of that
/// succeeded, and before the answer that ends the hello, takes the
/// connection's established place with `establish`; without one, closes the
/// connection with [`CLOSE_BUSY`] and the reason `establish` gives.
pub(crate) async fn server<P>(
    conn: &Connection,
    secret: Option<&AuthSecret>,
    establish: impl FnOnce() -> Result<P, String>,
) -> Result<P, HelloFailure> {
    let (mut send, mut recv) = conn.accept_bi().await.map_err(connection_failure)?;
    let mut hello = [0u8; CLIENT_HELLO_LEN];
    recv.read_exact(&mut hello).await.map_err(read_failure)?;
    let client = match ClientHello::decode(&hello) {
        Ok(client) => client,
        Err(e) => {
            conn.close(VarInt::from_u32(CLOSE_PROTOCOL), b"malformed hello");
            return Err(e.into());
        }
    };
    let secret = match (secret, client.auth) {
        (None, _) => {
            let place = established(conn, establish)?;
            // A client with a secret refuses this answer and closes.
            let answer = ServerHello { auth: false, nonce: [0; AUTH_TAG_LEN], proof: [0; AUTH_TAG_LEN] };
            send.write_all(&answer.encode()).await.map_err(write_failure)?;
            let _ = send.finish();
            return Ok(place);
        }
        (Some(_), false) => {
            return Err(refuse(
                conn,
                "this receiver requires the data-plane shared secret",
                HelloFailure::PeerHasNoSecret,
            ))
        }
        (Some(secret), true) => secret,
    };
    let nonce = fresh_nonce().ok_or_else(|| refuse(conn, "no randomness for a nonce", HelloFailure::NoRandomness))?;
    let context = transcript_context(&exported(conn)?, &hello);
    let transcript =
        Transcript { channel: Channel::DataQuic, client_nonce: &client.nonce, server_nonce: &nonce, context: &context };
    let answer = ServerHello { auth: true, nonce, proof: server_proof(secret, &transcript) };
    send.write_all(&answer.encode()).await.map_err(write_failure)?;
    let mut proof = [0u8; AUTH_TAG_LEN];
    recv.read_exact(&mut proof).await.map_err(read_failure)?;
    if !verify_client_proof(secret, &transcript, &proof) {
        let reason = "authentication failed: the sender's proof does not verify";
        return Err(refuse(conn, reason, HelloFailure::BadProof));
    }
    let place = established(conn, establish)?;
    let mut verdict = Vec::with_capacity(VERDICT_HEADER_LEN);
    put_verdict(&mut verdict, ReplyStatus::Ok, "");
    send.write_all(&verdict).await.map_err(write_failure)?;
    let _ = send.finish();
    Ok(place)
}

/// The established place `establish` gives, or the connection closed with
/// [`CLOSE_BUSY`] and its reason.
fn established<P>(conn: &Connection, establish: impl FnOnce() -> Result<P, String>) -> Result<P, HelloFailure> {
    establish().map_err(|reason| {
        conn.close(VarInt::from_u32(CLOSE_BUSY), reason.as_bytes());
        HelloFailure::Busy(reason)
    })
}
