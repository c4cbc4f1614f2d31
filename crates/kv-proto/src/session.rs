//! Authentication of every frame after the handshake.
//!
//! The handshake ([`crate::auth`]) proves that both ends hold the shared
//! secret; on its own it protects nothing that follows, so anyone on the
//! path who lets the handshake through could alter or inject later frames.
//! Once the handshake succeeds both ends derive two session keys from the
//! secret and the handshake's transcript (both nonces, the channel, the
//! opening message), one per direction, and every later frame carries a
//! tag:
//!
//! ```text
//! tag = HMAC-SHA-256(direction key, "kvlink-frame/1" | sequence number | frame)[..16]
//! ```
//!
//! The sequence number counts the frames sent in that direction (from 0) and
//! is never sent: a frame dropped, replayed, reordered or moved to the other
//! direction fails its check, as does one from another connection (its
//! nonces differ, so its keys do). A frame that fails is the end of the
//! connection. This authenticates frames; it does not encrypt them.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::auth::{AuthSecret, Transcript};

/// Bytes of the tag every authenticated frame carries (128 bits).
pub const FRAME_TAG_LEN: usize = 16;

/// The tag of one frame.
pub type FrameTag = [u8; FRAME_TAG_LEN];

/// A frame whose tag does not match: altered, injected, replayed or out of
/// order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("frame {seq} of this direction failed its authentication tag (altered or injected after the handshake)")]
pub struct BadTag {
    /// The sequence number the frame was checked under.
    pub seq: u64,
}

/// One direction of a session: the key and the next frame's number.
#[derive(Clone)]
pub struct FrameAuth {
    keyed: Hmac<Sha256>,
    next_seq: u64,
}

impl std::fmt::Debug for FrameAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameAuth").field("next_seq", &self.next_seq).finish_non_exhaustive()
    }
}

impl FrameAuth {
    fn tag_of(&self, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = self.keyed.clone();
        mac.update(b"kvlink-frame/1");
        mac.update(&self.next_seq.to_le_bytes());
        for part in parts {
            mac.update(part);
        }
        mac
    }

    /// The tag of the next frame sent in this direction, the concatenation
    /// of `parts`; counts the frame.
    pub fn seal(&mut self, parts: &[&[u8]]) -> FrameTag {
        let full = self.tag_of(parts).finalize().into_bytes();
        self.next_seq += 1;
        let mut tag = [0u8; FRAME_TAG_LEN];
        tag.copy_from_slice(&full[..FRAME_TAG_LEN]);
        tag
    }

    /// Checks (in constant time) that `tag` is the tag of the next frame
    /// received in this direction, the concatenation of `parts`; counts the
    /// frame if it is.
    pub fn open(&mut self, parts: &[&[u8]], tag: &[u8]) -> Result<(), BadTag> {
        let seq = self.next_seq;
        if tag.len() != FRAME_TAG_LEN || self.tag_of(parts).verify_truncated_left(tag).is_err() {
            return Err(BadTag { seq });
        }
        self.next_seq += 1;
        Ok(())
    }

    /// Counts a frame the receiver discards unread (the op list of a batch
    /// it refuses whole): what it would have been does not matter, and the
    /// next frame is checked under the next number, as the sender tagged it.
    pub fn skip(&mut self) {
        self.next_seq += 1;
    }

    /// Frames counted so far in this direction.
    pub fn frames(&self) -> u64 {
        self.next_seq
    }
}

/// Both directions of a session, as one end sees them.
#[derive(Clone, Debug)]
pub struct Session {
    /// Tags the frames this end sends.
    pub send: FrameAuth,
    /// Checks the frames this end receives.
    pub recv: FrameAuth,
}

/// Which end of the connection a [`Session`] is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The end that connected.
    Client,
    /// The end that accepted.
    Server,
}

fn direction_key(secret: &AuthSecret, transcript: &Transcript<'_>, direction: &[u8]) -> Option<Hmac<Sha256>> {
    let mut kdf = Hmac::<Sha256>::new_from_slice(secret.bytes()).ok()?;
    for field in [
        b"kvlink-session/1".as_slice(),
        transcript.channel_label(),
        direction,
        transcript.client_nonce,
        transcript.server_nonce,
        transcript.context,
    ] {
        kdf.update(&(field.len() as u64).to_le_bytes());
        kdf.update(field);
    }
    let key = kdf.finalize().into_bytes();
    Hmac::<Sha256>::new_from_slice(&key).ok()
}

impl Session {
    /// The session `end` of a connection whose handshake (`transcript`,
    /// under `secret`) both ends completed; `None` only if a key cannot be
    /// made (HMAC takes keys of any length, so it always can).
    pub fn derive(secret: &AuthSecret, transcript: &Transcript<'_>, end: End) -> Option<Self> {
        let to_server = FrameAuth { keyed: direction_key(secret, transcript, b"client to server")?, next_seq: 0 };
        let to_client = FrameAuth { keyed: direction_key(secret, transcript, b"server to client")?, next_seq: 0 };
        Some(match end {
            End::Client => Self { send: to_server, recv: to_client },
            End::Server => Self { send: to_client, recv: to_server },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::Channel;

    fn pair(c: &[u8; 32], s: &[u8; 32]) -> (Session, Session) {
        let secret = AuthSecret::new("secret");
        let t = Transcript { channel: Channel::SideChannel, client_nonce: c, server_nonce: s, context: b"hello" };
        (Session::derive(&secret, &t, End::Client).unwrap(), Session::derive(&secret, &t, End::Server).unwrap())
    }

    #[test]
    fn a_frame_opens_once_in_order_in_its_direction_only() {
        let (mut client, mut server) = pair(&[1; 32], &[2; 32]);
        let first = client.send.seal(&[b"head", b"body"]);
        let second = client.send.seal(&[b"next"]);
        // Split differently, the same bytes carry the same tag.
        assert_eq!(server.clone().recv.open(&[b"hea", b"dbody"], &first), Ok(()));
        assert_eq!(server.recv.open(&[b"next"], &second), Err(BadTag { seq: 0 }), "out of order");
        assert_eq!(server.recv.open(&[b"head", b"bodY"], &first), Err(BadTag { seq: 0 }), "altered");
        assert_eq!(server.recv.open(&[b"head", b"body"], &first[..15]), Err(BadTag { seq: 0 }), "truncated");
        assert_eq!(server.recv.open(&[b"head", b"body"], &first), Ok(()));
        assert_eq!(server.recv.open(&[b"head", b"body"], &first), Err(BadTag { seq: 1 }), "replayed");
        assert_eq!(server.recv.open(&[b"next"], &second), Ok(()));
        assert_eq!(server.recv.frames(), 2);
        let reflected = server.send.seal(&[b"head", b"body"]);
        assert_ne!(reflected, first, "the two directions have their own keys");
        assert_eq!(client.recv.open(&[b"head", b"body"], &first), Err(BadTag { seq: 0 }), "reflected");
        assert_eq!(client.recv.open(&[b"head", b"body"], &reflected), Ok(()));
    }

    #[test]
    fn another_connection_has_other_keys() {
        let (mut one, _) = pair(&[1; 32], &[2; 32]);
        let (_, mut other) = pair(&[1; 32], &[3; 32]);
        let tag = one.send.seal(&[b"frame"]);
        assert!(other.recv.open(&[b"frame"], &tag).is_err());
    }
}
