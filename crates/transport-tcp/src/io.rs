//! Bounded socket I/O shared by the sender and the receiver: every wait is
//! cut off by a timeout that restarts on progress.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Why a bounded read or write failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    /// No progress within the bound.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was being waited for.
        what: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The peer closed the stream.
    #[error("connection closed {}while reading {what}", if *.partial { "part-way " } else { "" })]
    Eof {
        /// What was being read.
        what: &'static str,
        /// Whether some of it had arrived.
        partial: bool,
    },
    /// The socket failed.
    #[error("I/O error on {what}: {source}")]
    Io {
        /// What was being read or written.
        what: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// Fills `buf`; each wait for more bytes is bounded by `after`.
pub(crate) async fn read_exact(
    stream: &mut TcpStream,
    buf: &mut [u8],
    after: Duration,
    what: &'static str,
) -> Result<(), WireError> {
    let mut off = 0;
    while let Some(rest) = buf.get_mut(off..).filter(|r| !r.is_empty()) {
        match tokio::time::timeout(after, stream.read(rest)).await {
            Err(_) => return Err(WireError::Timeout { what, after }),
            Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
            Ok(Err(source)) => return Err(WireError::Io { what, source }),
            Ok(Ok(0)) => return Err(WireError::Eof { what, partial: off > 0 }),
            Ok(Ok(n)) => off += n,
        }
    }
    Ok(())
}

/// Writes all of `buf` (a small frame), bounded by `after` as a whole.
pub(crate) async fn write_all(
    stream: &mut TcpStream,
    buf: &[u8],
    after: Duration,
    what: &'static str,
) -> Result<(), WireError> {
    match tokio::time::timeout(after, stream.write_all(buf)).await {
        Err(_) => Err(WireError::Timeout { what, after }),
        Ok(Err(source)) => Err(WireError::Io { what, source }),
        Ok(Ok(())) => Ok(()),
    }
}
