//! vLLM Mooncake's bootstrap server and its client, over plain HTTP/1.1.
//!
//! A prefill instance runs one [`BootstrapServer`]: every prefill worker
//! registers where its side channel listens (`POST /register`), and routers
//! and decode instances read the registry back (`GET /query`), byte for byte
//! as vLLM 0.16+ serves it, except that `/query` (and `/health`) answer 503
//! until every expected worker registered. [`register`] and [`query`] are
//! the client side. What is registered and how it is decided is kv-proto's
//! [`kv_proto::bootstrap`] contract; this module only carries it.
//!
//! This file holds the little HTTP/1.1 both sides share: reading a message
//! head within a bound, splitting it into its first line and headers, and
//! reading a body of a known length within a bound.
//!
//! What this module must never do: read without a bound on bytes or time,
//! panic on a peer's bytes, log a peer's text unescaped, or send the shared
//! secret (only proofs made with it).

pub mod client;
pub mod server;

pub use client::{query, register, BootstrapClientError};
pub use server::{BootstrapHandle, BootstrapLimits, BootstrapServer, BootstrapServerError, RunningBootstrap};

use std::io;

use kv_net::http::head_end;
use tokio::io::{AsyncRead, AsyncReadExt};

/// What reading a message head gave.
#[derive(Debug)]
enum HeadRead {
    /// A whole head: `buf[..end]`, then whatever of the body came with it.
    Whole {
        /// The bytes read.
        buf: Vec<u8>,
        /// Where the head ends.
        end: usize,
    },
    /// No blank line within the bound.
    TooLarge,
    /// The peer closed before a whole head.
    Closed {
        /// Whether any byte came.
        partial: bool,
    },
}

/// Reads a message head of at most `max` bytes (the caller bounds the time).
async fn read_head<S: AsyncRead + Unpin>(stream: &mut S, max: usize) -> io::Result<HeadRead> {
    let mut buf = vec![0u8; max];
    let mut len = 0;
    loop {
        if len == buf.len() {
            return Ok(HeadRead::TooLarge);
        }
        let n = stream.read(&mut buf[len..]).await?;
        if n == 0 {
            return Ok(HeadRead::Closed { partial: len > 0 });
        }
        let scanned = len;
        len += n;
        if let Some(end) = head_end(&buf[..len], scanned) {
            buf.truncate(len);
            return Ok(HeadRead::Whole { buf, end });
        }
    }
}

/// Reads a body of exactly `len` bytes, `already` of which (or more, read
/// past it) came with the head.
async fn read_body<S: AsyncRead + Unpin>(stream: &mut S, already: &[u8], len: usize) -> io::Result<Vec<u8>> {
    let mut body = vec![0u8; len];
    let have = already.len().min(len);
    body[..have].copy_from_slice(&already[..have]);
    stream.read_exact(&mut body[have..]).await?;
    Ok(body)
}

/// Reads a body until the peer closes, at most `max` bytes (`None` past that).
async fn read_to_close<S: AsyncRead + Unpin>(
    stream: &mut S,
    already: &[u8],
    max: usize,
) -> io::Result<Option<Vec<u8>>> {
    if already.len() > max {
        return Ok(None);
    }
    let mut body = already.to_vec();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(Some(body));
        }
        if body.len() + n > max {
            return Ok(None);
        }
        body.extend_from_slice(&chunk[..n]);
    }
}

/// A message head: its first line and its headers, as sent (UTF-8 only).
#[derive(Debug)]
struct Head<'a> {
    /// The request line or status line.
    first: &'a str,
    headers: Vec<(&'a str, &'a str)>,
}

impl<'a> Head<'a> {
    /// Splits the head `bytes` (up to and including its blank line).
    fn parse(bytes: &'a [u8]) -> Result<Self, &'static str> {
        let text = std::str::from_utf8(bytes).map_err(|_| "the message head is not UTF-8")?;
        let mut lines = text.split('\n').map(|line| line.strip_suffix('\r').unwrap_or(line));
        let first = lines.next().unwrap_or_default();
        if first.is_empty() {
            return Err("the message head starts with an empty line");
        }
        let mut headers = Vec::new();
        for line in lines {
            if line.is_empty() {
                break;
            }
            if line.starts_with([' ', '\t']) {
                return Err("folded header lines are not accepted");
            }
            let (name, value) = line.split_once(':').ok_or("a header line has no ':'")?;
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic()) {
                return Err("a header name is not a token");
            }
            headers.push((name, value.trim_matches([' ', '\t'])));
        }
        Ok(Self { first, headers })
    }

    /// Every value of header `name` (case-insensitive).
    fn values(&self, name: &'a str) -> impl Iterator<Item = &'a str> + '_ {
        self.headers.iter().filter(move |(n, _)| n.eq_ignore_ascii_case(name)).map(|&(_, v)| v)
    }

    /// The one value of header `name`, if any; more than one that differ is an error.
    fn header(&self, name: &'a str) -> Result<Option<&'a str>, &'static str> {
        let mut values = self.values(name);
        let first = values.next();
        if values.any(|v| Some(v) != first) {
            return Err("a header is repeated with different values");
        }
        Ok(first)
    }

    /// The declared body length, if any (digits only).
    fn content_length(&self) -> Result<Option<u64>, &'static str> {
        match self.header("content-length")? {
            None => Ok(None),
            Some(v) if !v.is_empty() && v.len() <= 19 && v.bytes().all(|b| b.is_ascii_digit()) => {
                v.parse().map(Some).map_err(|_| "Content-Length is not a number")
            }
            Some(_) => Err("Content-Length is not a number"),
        }
    }

    /// Whether the body is framed by a transfer coding (never accepted here).
    fn has_transfer_encoding(&self) -> bool {
        self.values("transfer-encoding").next().is_some()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn heads_split_into_line_and_headers() {
        let head = Head::parse(b"POST /register HTTP/1.1\r\nHost: x\r\ncontent-length:  12 \r\nX-A: 1\nx-a: 1\r\n\r\n")
            .unwrap();
        assert_eq!(head.first, "POST /register HTTP/1.1");
        assert_eq!(head.content_length(), Ok(Some(12)));
        assert_eq!(head.header("X-A"), Ok(Some("1")), "repeated with the same value");
        assert!(!head.has_transfer_encoding());
        let bad: &[&[u8]] = &[
            b"\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
            b"GET / HTTP/1.1\r\n folded: x\r\n\r\n",
            b"GET / HTTP/1.1\r\nba d: x\r\n\r\n",
            b"GET / HTTP/1.1\r\n: x\r\n\r\n",
            b"GET /\xff HTTP/1.1\r\n\r\n",
        ];
        for bytes in bad {
            assert!(Head::parse(bytes).is_err(), "{:?}", String::from_utf8_lossy(bytes));
        }
        for length in ["-1", "+1", "1 1", "", "0x10", "99999999999999999999"] {
            let text = format!("POST / HTTP/1.1\r\nContent-Length: {length}\r\n\r\n");
            assert!(Head::parse(text.as_bytes()).unwrap().content_length().is_err(), "{length:?}");
        }
        let twice = Head::parse(b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n").unwrap();
        assert!(twice.content_length().is_err());
        let chunked = Head::parse(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
        assert!(chunked.has_transfer_encoding());
    }
}
