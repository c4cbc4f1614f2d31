//! The bootstrap client: a prefill worker registers its side channel
//! ([`register`]), a decode instance reads the registry ([`query`]). Plain
//! HTTP/1.1 over one tokio TCP connection per attempt, closed after the
//! answer.
//!
//! [`register`] tries again, with backoff, while the server cannot be
//! reached, drops the connection, or says it is busy or not ready (503),
//! all within its timeout: a worker may start before the server does. A
//! 4xx is final. [`query`] makes one attempt; a 503 is
//! [`BootstrapClientError::NotReady`].
//!
//! What this file must never do: wait past the caller's timeout; read a
//! reply past its bound (head 8 KiB, body 16 KiB, or
//! [`MAX_QUERY_REPLY_BYTES`] for a query); put a server's text in an error
//! unescaped or uncut; send the shared secret itself (only the proof).

use std::time::Duration;

use kv_proto::auth::AuthSecret;
use kv_proto::bootstrap::{
    registration_proof, reply_detail, BootstrapError, BootstrapUrl, QueryReply, Registration, MAX_QUERY_REPLY_BYTES,
    PROOF_HEADER,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::{read_body, read_head, read_to_close, Head, HeadRead};

/// Bound on a reply's head.
const MAX_REPLY_HEAD_BYTES: usize = 8 * 1024;
/// Bound on the body of a reply to a registration (an error's detail).
const MAX_REGISTER_REPLY_BYTES: usize = 16 * 1024;
/// Characters of a server's detail kept in an error.
const MAX_DETAIL_CHARS: usize = 512;
/// The first pause between registration attempts; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest pause between registration attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Why a registration or a query did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapClientError {
    /// No answer that ends the exchange came within the timeout.
    #[error("no answer from the bootstrap server at {url} within {timeout:?} ({attempts} attempts; last: {last})")]
    TimedOut {
        /// The server.
        url: BootstrapUrl,
        /// The caller's timeout.
        timeout: Duration,
        /// Attempts made.
        attempts: u32,
        /// What the last attempt met.
        last: String,
    },
    /// The server could not be reached (a query's one attempt).
    #[error("cannot reach the bootstrap server at {url}: {reason}")]
    Unreachable {
        /// The server.
        url: BootstrapUrl,
        /// Why.
        reason: String,
    },
    /// The server answered 503: not every prefill worker registered yet.
    #[error("the bootstrap server at {url} is not ready: {detail}")]
    NotReady {
        /// The server.
        url: BootstrapUrl,
        /// Its detail, escaped and cut.
        detail: String,
    },
    /// The server refused the request (a 4xx): final.
    #[error("the bootstrap server at {url} refused the request ({status}): {detail}")]
    Refused {
        /// The server.
        url: BootstrapUrl,
        /// The status.
        status: u16,
        /// Its detail, escaped and cut.
        detail: String,
    },
    /// The server answered another status that is no success.
    #[error("the bootstrap server at {url} answered {status}: {detail}")]
    Status {
        /// The server.
        url: BootstrapUrl,
        /// The status.
        status: u16,
        /// Its detail, escaped and cut.
        detail: String,
    },
    /// The server's answer is not HTTP/1.x as expected.
    #[error("the bootstrap server at {url} answered malformed HTTP: {reason}")]
    Protocol {
        /// The server.
        url: BootstrapUrl,
        /// What is wrong.
        reason: &'static str,
    },
    /// The query reply is not a registry.
    #[error("the bootstrap server at {url} answered a query reply that cannot be used: {error}")]
    Reply {
        /// The server.
        url: BootstrapUrl,
        /// Why.
        #[source]
        error: BootstrapError,
    },
}

/// A whole reply.
#[derive(Debug)]
struct Reply {
    status: u16,
    body: Vec<u8>,
}

/// Why one attempt got no reply.
#[derive(Debug)]
enum Failed {
    /// The connection failed or closed early: worth another attempt.
    Io(std::io::Error),
    /// The answer cannot be read: final.
    Protocol(&'static str),
}

impl From<std::io::Error> for Failed {
    fn from(error: std::io::Error) -> Self {
        Failed::Io(error)
    }
}

/// Registers `reg` with the server at `base` (with `secret`, proving it),
/// trying again while the server is unreachable or answers 503, all within
/// `timeout`. A 4xx is final and returned with the server's detail.
pub async fn register(
    base: &BootstrapUrl,
    reg: &Registration,
    secret: Option<&AuthSecret>,
    timeout: Duration,
) -> Result<(), BootstrapClientError> {
    let body = reg.to_json();
    let proof = secret.map(|secret| registration_proof(secret, body.as_bytes()));
    let request = request(base, "POST", "/register", Some((body.as_bytes(), proof.as_deref())));
    let deadline = Instant::now() + timeout;
    let mut backoff = FIRST_BACKOFF;
    let mut attempts = 0;
    let mut last = String::from("no attempt finished");
    loop {
        attempts += 1;
        let attempt = tokio::time::timeout_at(deadline, exchange(base, &request, MAX_REGISTER_REPLY_BYTES)).await;
        match attempt {
            Err(_) => break,
            Ok(Ok(reply)) => match reply.status {
                200..=299 => return Ok(()),
                503 => last = format!("503: {}", detail(&reply)),
                status @ 400..=499 => {
                    return Err(BootstrapClientError::Refused { url: base.clone(), status, detail: detail(&reply) })
                }
                status => {
                    return Err(BootstrapClientError::Status { url: base.clone(), status, detail: detail(&reply) })
                }
            },
            Ok(Err(Failed::Io(error))) => last = error.to_string(),
            Ok(Err(Failed::Protocol(reason))) => {
                return Err(BootstrapClientError::Protocol { url: base.clone(), reason })
            }
        }
        let wake = (Instant::now() + backoff).min(deadline);
        tokio::time::sleep_until(wake).await;
        if wake >= deadline {
            break;
        }
        tracing::debug!(url = %base, attempts, last = %last, "bootstrap registration: trying again");
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
    Err(BootstrapClientError::TimedOut { url: base.clone(), timeout, attempts, last })
}

/// Reads the registry of the server at `base` (one attempt within
/// `timeout`). A 503 (not every prefill worker registered) is
/// [`BootstrapClientError::NotReady`].
pub async fn query(base: &BootstrapUrl, timeout: Duration) -> Result<QueryReply, BootstrapClientError> {
    let request = request(base, "GET", "/query", None);
    let reply = match tokio::time::timeout(timeout, exchange(base, &request, MAX_QUERY_REPLY_BYTES)).await {
        Err(_) => {
            return Err(BootstrapClientError::TimedOut {
                url: base.clone(),
                timeout,
                attempts: 1,
                last: "no whole answer".into(),
            })
        }
        Ok(Err(Failed::Io(error))) => {
            return Err(BootstrapClientError::Unreachable { url: base.clone(), reason: error.to_string() })
        }
        Ok(Err(Failed::Protocol(reason))) => return Err(BootstrapClientError::Protocol { url: base.clone(), reason }),
        Ok(Ok(reply)) => reply,
    };
    match reply.status {
        200..=299 => QueryReply::from_bytes(&reply.body)
            .map_err(|error| BootstrapClientError::Reply { url: base.clone(), error }),
        503 => Err(BootstrapClientError::NotReady { url: base.clone(), detail: detail(&reply) }),
        status @ 400..=499 => Err(BootstrapClientError::Refused { url: base.clone(), status, detail: detail(&reply) }),
        status => Err(BootstrapClientError::Status { url: base.clone(), status, detail: detail(&reply) }),
    }
}

/// A reply's detail, escaped and cut.
fn detail(reply: &Reply) -> String {
    reply_detail(&reply.body, MAX_DETAIL_CHARS)
}

/// The bytes of a request (closing the connection after its answer).
fn request(base: &BootstrapUrl, method: &str, path: &str, body: Option<(&[u8], Option<&str>)>) -> Vec<u8> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\nConnection: close\r\n",
        base.authority()
    );
    let Some((body, proof)) = body else {
        head.push_str("\r\n");
        return head.into_bytes();
    };
    head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    if let Some(proof) = proof {
        head.push_str(&format!("{PROOF_HEADER}: {proof}\r\n"));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    out
}

/// One attempt: connect, send `request`, read the reply (body at most
/// `max_body` bytes). The caller bounds the time.
async fn exchange(base: &BootstrapUrl, request: &[u8], max_body: usize) -> Result<Reply, Failed> {
    let mut stream = TcpStream::connect((base.host(), base.port())).await?;
    // Small request and reply: no reason to wait for more bytes.
    let _ = stream.set_nodelay(true);
    stream.write_all(request).await?;
    let (buf, end) = match read_head(&mut stream, MAX_REPLY_HEAD_BYTES).await? {
        HeadRead::Whole { buf, end } => (buf, end),
        HeadRead::TooLarge => return Err(Failed::Protocol("the reply head is over 8 KiB")),
        HeadRead::Closed { partial } => {
            let what = if partial {
                "the server closed part-way through its reply"
            } else {
                "the server closed without a reply"
            };
            return Err(Failed::Io(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, what)));
        }
    };
    let head = Head::parse(&buf[..end]).map_err(Failed::Protocol)?;
    let status = status(head.first).ok_or(Failed::Protocol("the status line is not HTTP/1.x NNN"))?;
    if (100..200).contains(&status) {
        return Err(Failed::Protocol("an interim (1xx) reply was not asked for"));
    }
    if head.has_transfer_encoding() {
        return Err(Failed::Protocol("replies with a transfer coding are not accepted"));
    }
    let already = &buf[end..];
    let body = match head.content_length().map_err(Failed::Protocol)? {
        Some(length) => {
            let length = usize::try_from(length).ok().filter(|&l| l <= max_body);
            let length = length.ok_or(Failed::Protocol("the reply body is over its bound"))?;
            read_body(&mut stream, already, length).await?
        }
        None => read_to_close(&mut stream, already, max_body)
            .await?
            .ok_or(Failed::Protocol("the reply body is over its bound"))?,
    };
    Ok(Reply { status, body })
}

/// The status code of a status line `HTTP/1.x NNN reason`.
fn status(line: &str) -> Option<u16> {
    let mut parts = line.splitn(3, ' ');
    let version = parts.next()?;
    let code = parts.next()?;
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") || code.len() != 3 || !code.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    code.parse().ok().filter(|c| (100..600).contains(c))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn status_lines_parse() {
        assert_eq!(status("HTTP/1.1 200 OK"), Some(200));
        assert_eq!(status("HTTP/1.0 503"), Some(503));
        assert_eq!(status("HTTP/1.1 422 Unprocessable Entity"), Some(422));
        for bad in
            ["HTTP/2 200 OK", "HTTP/1.1 20 OK", "HTTP/1.1 2000 OK", "HTTP/1.1 +20 OK", "HTTP/1.1 700 X", "", "200"]
        {
            assert_eq!(status(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn requests_carry_their_length_and_proof() {
        let base = BootstrapUrl::parse("http://[::1]:8998").unwrap();
        let get = String::from_utf8(request(&base, "GET", "/query", None)).unwrap();
        assert_eq!(
            get,
            "GET /query HTTP/1.1\r\nHost: [::1]:8998\r\nAccept: application/json\r\nConnection: close\r\n\r\n"
        );
        let post = String::from_utf8(request(&base, "POST", "/register", Some((b"{}", Some("ab"))))).unwrap();
        assert!(post.contains("Content-Length: 2\r\n") && post.contains("X-Kvlink-Proof: ab\r\n"), "{post}");
        assert!(post.ends_with("\r\n\r\n{}"), "{post}");
    }
}
