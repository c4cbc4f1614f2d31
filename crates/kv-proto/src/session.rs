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
//!
//! A frame whose bytes come in pieces and may be large (a batch's payload,
//! tagged as it leaves or lands: [`StreamedFrame`]) is first compressed with
//! keyed BLAKE3, several times faster than SHA-256 per byte, under a payload
//! key of its own per direction (derived from the direction key with its own
//! label), and that frame's bytes, under the tag above, are what it is bound
//! to (the batch id) and the 32-byte digest:
//!
//! ```text
//! payload key = HMAC-SHA-256(direction key, "kvlink-payload-key/1")
//! frame       = "kvlink-streamed/1" | bound_to | BLAKE3-keyed(payload key, bytes)
//! ```
//!
//! so a streamed frame is bound to its direction, its place in the sequence
//! and its batch as every other frame is.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::auth::{AuthSecret, Transcript};

/// Bytes of the tag every authenticated frame carries (128 bits).
pub const FRAME_TAG_LEN: usize = 16;

/// Bytes a [`StreamedFrame`] gathers before hashing them: whole, aligned
/// blocks let BLAKE3 hash 16 of its 1 KiB chunks at once (hashing pieces
/// as they come, at the odd offsets a socket hands them out, ran at about
/// half the speed).
const STREAM_BLOCK: usize = 64 * 1024;

/// What the frame of a streamed frame starts with.
const STREAMED_LABEL: &[u8] = b"kvlink-streamed/1";

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
    /// Keys the BLAKE3 digest of a streamed frame's bytes.
    payload_key: [u8; 32],
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

    /// Starts the tag of the next frame in this direction for bytes that
    /// come in pieces (a batch's payload, as it leaves or lands), bound to
    /// `bound_to` (the batch id): feed them with [`StreamedFrame::update`]
    /// (or [`StreamedFrame::spare`] and [`StreamedFrame::commit`]), then
    /// [`FrameAuth::seal_streamed`] or [`FrameAuth::open_streamed`]. Nothing
    /// is counted until then.
    pub fn begin_streamed(&self, bound_to: u64) -> StreamedFrame {
        StreamedFrame {
            digest: blake3::Hasher::new_keyed(&self.payload_key),
            seq: self.next_seq,
            bound_to,
            block: vec![0u8; STREAM_BLOCK].into_boxed_slice(),
            filled: 0,
        }
    }

    /// The tag of a streamed frame begun as this direction's next one;
    /// counts the frame.
    pub fn seal_streamed(&mut self, frame: StreamedFrame) -> FrameTag {
        let (bound_to, digest) = frame.finish();
        self.seal(&[STREAMED_LABEL, &bound_to.to_le_bytes(), &digest])
    }

    /// Checks (in constant time) that `tag` is the tag of a streamed frame
    /// begun as this direction's next one; counts the frame if it is.
    pub fn open_streamed(&mut self, frame: StreamedFrame, tag: &[u8]) -> Result<(), BadTag> {
        let seq = self.next_seq;
        if frame.seq != seq {
            return Err(BadTag { seq });
        }
        let (bound_to, digest) = frame.finish();
        self.open(&[STREAMED_LABEL, &bound_to.to_le_bytes(), &digest], tag)
    }
}

/// The tag of one frame whose bytes come in pieces, being computed
/// ([`FrameAuth::begin_streamed`]): the bytes are gathered into whole blocks
/// and hashed block by block, so how they were split does not matter.
#[derive(Clone)]
pub struct StreamedFrame {
    digest: blake3::Hasher,
    seq: u64,
    bound_to: u64,
    /// Bytes not hashed yet: `block[..filled]`.
    block: Box<[u8]>,
    filled: usize,
}

impl std::fmt::Debug for StreamedFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamedFrame")
            .field("seq", &self.seq)
            .field("bound_to", &self.bound_to)
            .finish_non_exhaustive()
    }
}

impl StreamedFrame {
    /// Adds the next piece of the frame's bytes.
    pub fn update(&mut self, mut piece: &[u8]) {
        while !piece.is_empty() {
            if self.filled == 0 && piece.len() >= self.block.len() {
                // Whole blocks straight from the piece: still aligned.
                let whole = piece.len() - piece.len() % self.block.len();
                let (blocks, rest) = piece.split_at(whole);
                self.digest.update(blocks);
                piece = rest;
                continue;
            }
            let spare = self.spare();
            let n = spare.len().min(piece.len());
            let (now, rest) = piece.split_at(n);
            if let Some(into) = spare.get_mut(..n) {
                into.copy_from_slice(now);
            }
            self.commit(n);
            piece = rest;
        }
    }

    /// Where the next bytes of the frame go when the caller copies them in
    /// itself (from memory it may not make a reference to): never empty;
    /// copy up to its length into its start, then [`StreamedFrame::commit`].
    pub fn spare(&mut self) -> &mut [u8] {
        self.block.get_mut(self.filled..).unwrap_or_default()
    }

    /// Counts `n` bytes copied into [`StreamedFrame::spare`] as the next
    /// bytes of the frame (at most its length).
    pub fn commit(&mut self, n: usize) {
        self.filled = self.filled.saturating_add(n).min(self.block.len());
        if self.filled == self.block.len() {
            self.digest.update(&self.block);
            self.filled = 0;
        }
    }

    /// What the frame is bound to, and the digest of all its bytes.
    fn finish(mut self) -> (u64, [u8; 32]) {
        self.digest.update(self.block.get(..self.filled).unwrap_or_default());
        (self.bound_to, *self.digest.finalize().as_bytes())
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

impl FrameAuth {
    /// One direction under `keyed` (its direction key), from frame 0.
    fn new(keyed: Hmac<Sha256>) -> Self {
        // A label no frame's tag input starts with ("kvlink-frame/1").
        let mut derive = keyed.clone();
        derive.update(b"kvlink-payload-key/1");
        let payload_key = derive.finalize().into_bytes().into();
        Self { keyed, payload_key, next_seq: 0 }
    }
}

impl Session {
    /// The session `end` of a connection whose handshake (`transcript`,
    /// under `secret`) both ends completed; `None` only if a key cannot be
    /// made (HMAC takes keys of any length, so it always can).
    pub fn derive(secret: &AuthSecret, transcript: &Transcript<'_>, end: End) -> Option<Self> {
        let to_server = FrameAuth::new(direction_key(secret, transcript, b"client to server")?);
        let to_client = FrameAuth::new(direction_key(secret, transcript, b"server to client")?);
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

    /// The payload of a batch: a few blocks and a tail, with no period of
    /// a block's length.
    fn payload() -> Vec<u8> {
        (0..3 * STREAM_BLOCK + 1234).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// `bytes` fed in pieces of the given lengths (the last one repeated),
    /// half of them through `spare`/`commit` as the transports copy them.
    fn fed(mut frame: StreamedFrame, bytes: &[u8], pieces: &[usize]) -> StreamedFrame {
        let mut at = 0;
        for (i, &len) in pieces.iter().chain(std::iter::repeat(pieces.last().unwrap_or(&1))).enumerate() {
            let piece = &bytes[at..(at + len.max(1)).min(bytes.len())];
            if i % 2 == 0 {
                frame.update(piece);
            } else {
                let mut rest = piece;
                while !rest.is_empty() {
                    let spare = frame.spare();
                    let n = spare.len().min(rest.len());
                    spare[..n].copy_from_slice(&rest[..n]);
                    frame.commit(n);
                    rest = &rest[n..];
                }
            }
            at += piece.len();
            if at == bytes.len() {
                return frame;
            }
        }
        frame
    }

    #[test]
    fn a_streamed_frame_tags_its_bytes_however_they_are_split() {
        let (mut client, server) = pair(&[1; 32], &[2; 32]);
        let bytes = payload();
        let header = client.send.seal(&[b"header"]);
        let streamed = client.send.seal_streamed(fed(client.send.begin_streamed(7), &bytes, &[bytes.len()]));
        let mut opened = server.clone();
        opened.recv.open(&[b"header"], &header).unwrap();
        for pieces in [&[1usize, 5000, STREAM_BLOCK][..], &[STREAM_BLOCK - 1], &[2 * STREAM_BLOCK + 3, 17], &[4096]] {
            let landed = fed(opened.recv.begin_streamed(7), &bytes, pieces);
            assert_eq!(opened.clone().recv.open_streamed(landed, &streamed), Ok(()), "pieces {pieces:?}");
        }
        let checks: [(&str, u64, Vec<u8>); 4] = [
            ("altered", 7, {
                let mut b = bytes.clone();
                b[2 * STREAM_BLOCK + 5] ^= 1;
                b
            }),
            ("short", 7, bytes[..bytes.len() - 1].to_vec()),
            ("long", 7, [bytes.as_slice(), &[0]].concat()),
            ("another batch", 8, bytes.clone()),
        ];
        for (what, bound_to, landed) in checks {
            let frame = fed(opened.recv.begin_streamed(bound_to), &landed, &[9000]);
            assert_eq!(opened.clone().recv.open_streamed(frame, &streamed), Err(BadTag { seq: 1 }), "{what}");
        }
        let early = server.recv.begin_streamed(7);
        let mut reference = opened.clone();
        assert_eq!(reference.recv.open_streamed(fed(early.clone(), &bytes, &[100]), &streamed), Err(BadTag { seq: 1 }));
        let mut later = opened.clone();
        later.recv.skip();
        let frame = fed(later.recv.begin_streamed(7), &bytes, &[100]);
        assert_eq!(later.recv.open_streamed(frame, &streamed), Err(BadTag { seq: 2 }), "out of order");
        let landed = fed(opened.recv.begin_streamed(7), &bytes, &[100]);
        assert_eq!(opened.recv.open_streamed(landed.clone(), &streamed), Ok(()));
        assert_eq!(opened.recv.open_streamed(landed, &streamed), Err(BadTag { seq: 2 }), "replayed");
        assert_eq!(opened.recv.frames(), 2);
        let reflected = fed(client.recv.begin_streamed(7), &bytes, &[100]);
        assert!(client.recv.open_streamed(reflected, &streamed).is_err(), "the other direction's key");
    }

    #[test]
    fn another_connection_has_other_keys() {
        let (mut one, _) = pair(&[1; 32], &[2; 32]);
        let (_, mut other) = pair(&[1; 32], &[3; 32]);
        let tag = one.send.seal(&[b"frame"]);
        assert!(other.recv.open(&[b"frame"], &tag).is_err());
    }
}
