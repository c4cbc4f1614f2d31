//! The tags of a control connection's frames after its opening. When both
//! sides proved the shared secret, the opening's transcript keys a
//! [`kv_proto::session::Session`] (one key per direction), and every later
//! frame each way carries a 16-byte tag over a count of the frames before it
//! and the frame's bytes: the queue-pair exchange, each "open grant"
//! request, each reply and each progress frame. A frame that fails its tag
//! (altered, injected, replayed, reordered or reflected on the path) is
//! refused before anything in it is acted on, and the connection ends.
//! Without a secret, frames carry no tag.

use kv_proto::session::{BadTag, Session, FRAME_TAG_LEN};
use tokio::io::{AsyncRead, AsyncReadExt};

/// One control connection's frame tags, as one side sees them.
#[derive(Debug, Default)]
pub struct FrameTags {
    session: Option<Session>,
}

/// Why a frame's tag could not be checked, or did not match.
#[derive(Debug)]
pub enum TagFailure {
    /// Reading the tag failed (`UnexpectedEof`: the peer closed).
    Read(std::io::Error),
    /// The tag does not match the frame.
    Bad(BadTag),
}

impl FrameTags {
    /// Tags under `session` (`None`: the connection carries none).
    pub fn new(session: Option<Session>) -> Self {
        Self { session }
    }

    /// No tags: a connection whose sides hold no shared secret.
    pub fn none() -> Self {
        Self::default()
    }

    /// Whether frames carry tags.
    pub fn is_on(&self) -> bool {
        self.session.is_some()
    }

    /// Appends the tag of the frame `out[start..]`, the next this side sends
    /// (nothing without a session).
    pub fn seal(&mut self, out: &mut Vec<u8>, start: usize) {
        if let Some(session) = &mut self.session {
            let tag = session.send.seal(&[out.get(start..).unwrap_or_default()]);
            out.extend_from_slice(&tag);
        }
    }

    /// Checks `tag` against the frame `parts`, the next this side receives.
    pub fn open(&mut self, parts: &[&[u8]], tag: &[u8]) -> Result<(), BadTag> {
        match &mut self.session {
            Some(session) => session.recv.open(parts, tag),
            None => Ok(()),
        }
    }

    /// Reads the tag that follows the frame `parts` and checks it (nothing
    /// to read without a session).
    pub async fn read_and_check<R: AsyncRead + Unpin>(
        &mut self,
        reader: &mut R,
        parts: &[&[u8]],
    ) -> Result<(), TagFailure> {
        if !self.is_on() {
            return Ok(());
        }
        let mut tag = [0u8; FRAME_TAG_LEN];
        reader.read_exact(&mut tag).await.map_err(TagFailure::Read)?;
        self.open(parts, &tag).map_err(TagFailure::Bad)
    }
}
