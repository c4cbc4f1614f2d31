//! Bounded reads and writes over any tokio byte stream (a TCP socket, a QUIC
//! stream, RDMA's control connection), so no data plane writes its own loop.
//!
//! A read's bound restarts on progress (a large frame on a slow link is not
//! cut off, a peer that stops sending is); a write of a small frame is
//! bounded as a whole.

use std::time::Duration;
use std::{fmt, io};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Why a bounded read or write failed. `what` names the frame (or part of
/// one) for the operator; the stream's own error is kept as the source (a
/// QUIC stream's names its reset code or the connection's failure).
///
/// `Display` and `Error` are written out rather than derived: kv-net keeps
/// to kv-proto, tokio and tracing, and the fuzz crate's lock file with it.
#[derive(Debug)]
pub enum WireError {
    /// No progress within the bound.
    Timeout {
        /// What was being waited for.
        what: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The peer ended the stream (a TCP connection's FIN, a QUIC stream's
    /// finish) before the frame was whole.
    Eof {
        /// What was being read.
        what: &'static str,
        /// Whether some of it had arrived.
        partial: bool,
    },
    /// The stream failed.
    Io {
        /// What was being read or written.
        what: &'static str,
        /// The stream's error.
        source: io::Error,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Timeout { what, after } => write!(f, "{what} timed out after {after:?}"),
            WireError::Eof { what, partial } => {
                let part_way = if *partial { "part-way " } else { "" };
                write!(f, "stream closed by the peer {part_way}while reading {what}")
            }
            WireError::Io { what, source } => {
                write!(f, "I/O error on {what}: {source}")?;
                // What the stream's error wraps: a QUIC stream's "connection
                // lost" says why only there (timed out, closed by the peer).
                let mut cause = std::error::Error::source(source);
                for _ in 0..MAX_CAUSES {
                    let Some(inner) = cause else { break };
                    write!(f, ": {inner}")?;
                    cause = inner.source();
                }
                Ok(())
            }
        }
    }
}

/// Causes below a stream's error shown in a [`WireError::Io`]'s message.
const MAX_CAUSES: usize = 4;

impl std::error::Error for WireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WireError::Io { source, .. } => Some(source),
            WireError::Timeout { .. } | WireError::Eof { .. } => None,
        }
    }
}

/// Fills `buf` from `reader`; each wait for more bytes is bounded by `after`.
pub async fn read_exact<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    buf: &mut [u8],
    after: Duration,
    what: &'static str,
) -> Result<(), WireError> {
    let mut off = 0;
    while let Some(rest) = buf.get_mut(off..).filter(|r| !r.is_empty()) {
        match tokio::time::timeout(after, reader.read(rest)).await {
            Err(_) => return Err(WireError::Timeout { what, after }),
            Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
            Ok(Err(source)) => return Err(WireError::Io { what, source }),
            Ok(Ok(0)) => return Err(WireError::Eof { what, partial: off > 0 }),
            Ok(Ok(n)) => off += n,
        }
    }
    Ok(())
}

/// Writes all of `buf` (a small frame) to `writer`, bounded by `after` as a
/// whole.
pub async fn write_all<W: AsyncWrite + Unpin + ?Sized>(
    writer: &mut W,
    buf: &[u8],
    after: Duration,
    what: &'static str,
) -> Result<(), WireError> {
    match tokio::time::timeout(after, writer.write_all(buf)).await {
        Err(_) => Err(WireError::Timeout { what, after }),
        Ok(Err(source)) => Err(WireError::Io { what, source }),
        Ok(Ok(())) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHORT: Duration = Duration::from_millis(50);

    #[tokio::test]
    async fn reads_what_arrives_in_pieces() {
        let (mut a, mut b) = tokio::io::duplex(4);
        let writer = tokio::spawn(async move { write_all(&mut a, b"hello world", SHORT * 20, "greeting").await });
        let mut buf = [0u8; 11];
        read_exact(&mut b, &mut buf, SHORT * 20, "greeting").await.unwrap();
        assert_eq!(&buf, b"hello world");
        writer.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn an_early_end_says_whether_part_arrived() {
        for (sent, partial) in [(&b""[..], false), (&b"he"[..], true)] {
            let (mut a, mut b) = tokio::io::duplex(64);
            write_all(&mut a, sent, SHORT, "greeting").await.unwrap();
            drop(a);
            let mut buf = [0u8; 5];
            let error = read_exact(&mut b, &mut buf, SHORT, "greeting").await.unwrap_err();
            assert!(matches!(error, WireError::Eof { what: "greeting", partial: p } if p == partial), "{error}");
            let shown = if partial { "part-way " } else { "" };
            assert_eq!(error.to_string(), format!("stream closed by the peer {shown}while reading greeting"));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_times_out() {
        let (_a, mut b) = tokio::io::duplex(64);
        let mut buf = [0u8; 1];
        let error = read_exact(&mut b, &mut buf, SHORT, "greeting").await.unwrap_err();
        assert!(matches!(error, WireError::Timeout { after: SHORT, .. }), "{error}");
        assert_eq!(error.to_string(), "greeting timed out after 50ms");
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_nobody_reads_times_out() {
        let (mut a, _b) = tokio::io::duplex(4);
        let error = write_all(&mut a, b"more than four", SHORT, "reply").await.unwrap_err();
        assert!(matches!(error, WireError::Timeout { what: "reply", .. }), "{error}");
    }

    /// Like quinn's `ReadError::ConnectionLost`: the why is its source.
    #[derive(Debug)]
    struct Lost(io::Error);

    impl fmt::Display for Lost {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("connection lost")
        }
    }

    impl std::error::Error for Lost {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_stream_error_is_shown_with_what_it_wraps_and_kept_as_the_source() {
        let error = WireError::Io { what: "op list", source: io::Error::other("stream reset by peer: error 3") };
        assert_eq!(error.to_string(), "I/O error on op list: stream reset by peer: error 3");
        let source = std::error::Error::source(&error).map(ToString::to_string);
        assert_eq!(source.as_deref(), Some("stream reset by peer: error 3"));

        let lost = io::Error::new(io::ErrorKind::NotConnected, Lost(io::Error::other("timed out")));
        let error = WireError::Io { what: "payload", source: lost };
        assert_eq!(error.to_string(), "I/O error on payload: connection lost: timed out");
    }
}
