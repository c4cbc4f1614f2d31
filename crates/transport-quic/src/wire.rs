//! Byte layout of the QUIC data plane (what is QUIC-specific; the op list
//! and the verdict are [`kv_proto::dataplane`]'s): pure encode/decode with
//! `bytes`, no I/O.
//!
//! The layout is drawn in the crate documentation. Everything here is public
//! so that tests (and a second implementation beside this one) can speak it
//! byte for byte; the transport itself is the only intended user.

use bytes::{Buf, BufMut};
use kv_proto::auth::{Nonce, Proof, AUTH_TAG_LEN};
use kv_proto::receive::HeaderFields;
use kv_proto::{GrantId, GRANT_ID_LEN};

/// The ALPN protocol a data-plane connection negotiates; a peer offering
/// anything else fails the TLS handshake. The wire version lives here: a new
/// wire gets a new ALPN (`/1` had no grants and no hello stream).
pub const ALPN: &[u8] = b"kvlink-data/2";
/// The TLS server name a sender presents (SNI). Identity is checked by the
/// pinned certificate fingerprint, never by this name.
pub const SERVER_NAME: &str = "kvlink";

/// The TLS exporter label of the keying material that binds a hello's
/// proofs to one TLS connection (RFC 5705 / RFC 8446 §7.5).
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-kvlink-data-quic-hello";
/// Bytes of exported keying material in the authentication transcript.
pub const EXPORTER_LEN: usize = 32;

/// Bytes of a [`BatchHeader`].
pub const BATCH_HEADER_LEN: usize = GRANT_ID_LEN + 16;

/// The four bytes both hellos start with.
pub const HELLO_MAGIC: [u8; 4] = *b"KVLH";
/// The hello layout this build speaks (the wire version of [`ALPN`]).
pub const HELLO_VERSION: u16 = 2;
/// Hello flag: the side holds a shared secret and authenticates.
pub const HELLO_AUTH: u16 = 1;
/// Bytes of a [`ClientHello`].
pub const CLIENT_HELLO_LEN: usize = 8 + AUTH_TAG_LEN;
/// Bytes of a [`ServerHello`].
pub const SERVER_HELLO_LEN: usize = 8 + 2 * AUTH_TAG_LEN;

/// `STOP_SENDING` code: the batch is refused (unknown, expired or revoked
/// grant, or an op outside it); its reply says why.
pub const STOP_REFUSED: u32 = 1;
/// `STOP_SENDING` code: the sender broke the protocol; the reply says how.
pub const STOP_PROTOCOL: u32 = 2;
/// `STOP_SENDING` / `RESET_STREAM` / `CONNECTION_CLOSE` code: the receiver
/// (or sender) is shutting down.
pub const CLOSE_SHUTDOWN: u32 = 3;
/// `CONNECTION_CLOSE` code: the handshake did not negotiate [`ALPN`].
pub const CLOSE_BAD_ALPN: u32 = 4;
/// `CONNECTION_CLOSE` code: the hello failed (no, or a wrong, shared secret
/// on either side); the close reason says why.
pub const CLOSE_AUTH: u32 = 5;
/// `CONNECTION_CLOSE` code: a malformed hello.
pub const CLOSE_PROTOCOL: u32 = 6;
/// `CONNECTION_CLOSE` code: the receiver serves its most connections
/// already; the close reason says so.
pub const CLOSE_BUSY: u32 = 8;
/// `RESET_STREAM` / `STOP_SENDING` code: the sender abandoned the batch
/// (its `batch_write` future was dropped, or a bound ran out).
pub const RESET_CANCELLED: u32 = 7;

/// What a batch's stream starts with:
/// `grant [16] | op_count u64 LE | total_bytes u64 LE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHeader {
    /// The grant the batch writes under (issued by the receiver).
    pub grant: GrantId,
    /// Entries in the op list that follows.
    pub op_count: u64,
    /// Payload bytes after the op list: the sum of the ops' lengths.
    pub total_bytes: u64,
}

impl BatchHeader {
    /// Appends the header's bytes.
    pub fn put(&self, out: &mut impl BufMut) {
        out.put_slice(&self.grant.to_bytes());
        out.put_u64_le(self.op_count);
        out.put_u64_le(self.total_bytes);
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; BATCH_HEADER_LEN] {
        let mut b = [0u8; BATCH_HEADER_LEN];
        self.put(&mut &mut b[..]);
        b
    }

    /// Parses a header (every bit pattern is a header; the receiver checks
    /// the values).
    pub fn decode(b: &[u8; BATCH_HEADER_LEN]) -> Self {
        let mut buf = &b[..];
        let mut grant = [0u8; GRANT_ID_LEN];
        buf.copy_to_slice(&mut grant);
        Self { grant: GrantId::from_bytes(grant), op_count: buf.get_u64_le(), total_bytes: buf.get_u64_le() }
    }
}

/// What the batch-receive machine ([`kv_proto::receive`]) reads of a
/// header: no batch id, no flags.
impl From<BatchHeader> for HeaderFields {
    fn from(header: BatchHeader) -> Self {
        HeaderFields::plain(header.grant, header.op_count, header.total_bytes)
    }
}

/// Why a hello cannot be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    /// Not a kvlink hello.
    #[error("hello starts with {0:02x?}, not \"KVLH\"")]
    BadMagic([u8; 4]),
    /// A hello version this build does not speak.
    #[error("hello version {0}, this build speaks {HELLO_VERSION}")]
    UnsupportedVersion(u16),
    /// Flag bits this build does not know.
    #[error("hello carries unknown flags {0:#06x}")]
    UnknownFlags(u16),
}

/// Reads and checks `magic | version | flags`.
fn get_prefix(buf: &mut &[u8]) -> Result<u16, HelloError> {
    let mut magic = [0u8; 4];
    buf.copy_to_slice(&mut magic);
    if magic != HELLO_MAGIC {
        return Err(HelloError::BadMagic(magic));
    }
    let version = buf.get_u16_le();
    if version != HELLO_VERSION {
        return Err(HelloError::UnsupportedVersion(version));
    }
    let flags = buf.get_u16_le();
    if flags & !HELLO_AUTH != 0 {
        return Err(HelloError::UnknownFlags(flags));
    }
    Ok(flags)
}

fn put_prefix(out: &mut impl BufMut, flags: u16) {
    out.put_slice(&HELLO_MAGIC);
    out.put_u16_le(HELLO_VERSION);
    out.put_u16_le(flags);
}

/// What the sender writes first on a new connection, on its first
/// bidirectional stream: `KVLH | version u16 | flags u16 | client_nonce [32]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientHello {
    /// Whether the sender holds a shared secret ([`HELLO_AUTH`]).
    pub auth: bool,
    /// The sender's fresh nonce (zeros without a secret).
    pub nonce: Nonce,
}

impl ClientHello {
    /// The hello's bytes.
    pub fn encode(&self) -> [u8; CLIENT_HELLO_LEN] {
        let mut b = [0u8; CLIENT_HELLO_LEN];
        let mut out = &mut b[..];
        put_prefix(&mut out, if self.auth { HELLO_AUTH } else { 0 });
        out.put_slice(&self.nonce);
        b
    }

    /// Parses a hello (peer input).
    pub fn decode(b: &[u8; CLIENT_HELLO_LEN]) -> Result<Self, HelloError> {
        let mut buf = &b[..];
        let flags = get_prefix(&mut buf)?;
        let mut nonce = [0u8; AUTH_TAG_LEN];
        buf.copy_to_slice(&mut nonce);
        Ok(Self { auth: flags & HELLO_AUTH != 0, nonce })
    }
}

/// The receiver's answer on the same stream:
/// `KVLH | version u16 | flags u16 | server_nonce [32] | server_proof [32]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerHello {
    /// Whether the receiver holds a shared secret ([`HELLO_AUTH`]).
    pub auth: bool,
    /// The receiver's fresh nonce (zeros without authentication).
    pub nonce: Nonce,
    /// The receiver's proof over the transcript (zeros without authentication).
    pub proof: Proof,
}

impl ServerHello {
    /// The hello's bytes.
    pub fn encode(&self) -> [u8; SERVER_HELLO_LEN] {
        let mut b = [0u8; SERVER_HELLO_LEN];
        let mut out = &mut b[..];
        put_prefix(&mut out, if self.auth { HELLO_AUTH } else { 0 });
        out.put_slice(&self.nonce);
        out.put_slice(&self.proof);
        b
    }

    /// Parses a hello (peer input).
    pub fn decode(b: &[u8; SERVER_HELLO_LEN]) -> Result<Self, HelloError> {
        let mut buf = &b[..];
        let flags = get_prefix(&mut buf)?;
        let mut nonce = [0u8; AUTH_TAG_LEN];
        buf.copy_to_slice(&mut nonce);
        let mut proof = [0u8; AUTH_TAG_LEN];
        buf.copy_to_slice(&mut proof);
        Ok(Self { auth: flags & HELLO_AUTH != 0, nonce, proof })
    }
}

/// The context a hello's proofs are bound to: keying material exported from
/// this TLS connection, then the client hello as sent.
pub fn transcript_context(exported: &[u8; EXPORTER_LEN], client_hello: &[u8; CLIENT_HELLO_LEN]) -> Vec<u8> {
    let mut context = Vec::with_capacity(EXPORTER_LEN + CLIENT_HELLO_LEN);
    context.put_slice(exported);
    context.put_slice(client_hello);
    context
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = BatchHeader { grant: GrantId::from_bytes([9; GRANT_ID_LEN]), op_count: 3, total_bytes: u64::MAX };
        let bytes = h.encode();
        assert_eq!(&bytes[..GRANT_ID_LEN], &[9; GRANT_ID_LEN]);
        assert_eq!(&bytes[GRANT_ID_LEN..GRANT_ID_LEN + 8], &3u64.to_le_bytes());
        assert_eq!(BatchHeader::decode(&bytes), h);
    }

    #[test]
    fn hellos_round_trip_and_malformed_ones_are_errors() {
        let c = ClientHello { auth: true, nonce: [3; AUTH_TAG_LEN] };
        assert_eq!(ClientHello::decode(&c.encode()), Ok(c));
        let s = ServerHello { auth: false, nonce: [4; AUTH_TAG_LEN], proof: [5; AUTH_TAG_LEN] };
        assert_eq!(ServerHello::decode(&s.encode()), Ok(s));
        let mut bad = c.encode();
        bad[0] = b'X';
        assert!(matches!(ClientHello::decode(&bad), Err(HelloError::BadMagic(_))));
        let mut bad = c.encode();
        bad[4] = 1;
        assert_eq!(ClientHello::decode(&bad), Err(HelloError::UnsupportedVersion(1)));
        let mut bad = s.encode();
        bad[6] = 0x02;
        assert_eq!(ServerHello::decode(&bad), Err(HelloError::UnknownFlags(2)));
        assert_eq!(transcript_context(&[1; EXPORTER_LEN], &c.encode()).len(), EXPORTER_LEN + CLIENT_HELLO_LEN);
    }
}
