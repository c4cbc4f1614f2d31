//! The little HTTP/1.1 the metrics endpoint speaks, without I/O: where a
//! request's head ends, what it asks for, and the bytes of each answer.
//! Anything a client sends maps to an answer (never a panic): a request
//! line that is not `METHOD TARGET HTTP/1.x` is a 400, a method other than
//! GET or HEAD a 405, a path other than `/metrics` a 404. Headers are not
//! read (nothing here depends on them), and every answer closes the
//! connection.

/// What a request head asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Request {
    /// `GET /metrics` (`head`: `HEAD /metrics`, the same without a body).
    Metrics {
        /// HEAD rather than GET.
        head: bool,
    },
    /// Another path.
    NotFound,
    /// Another method.
    MethodNotAllowed,
    /// Not an HTTP/1.x request line.
    Malformed,
}

/// Where the head in `buf` ends (the index past its blank line), looking
/// only at bytes from `from` on (minus the 3 a terminator may straddle),
/// so a client that sends one byte at a time costs no rescans.
pub(crate) fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let start = from.saturating_sub(3);
    let tail = buf.get(start..)?;
    let crlf = tail.windows(4).position(|w| w == b"\r\n\r\n").map(|i| start + i + 4);
    // A bare LF line end is tolerated, as most servers do.
    let lf = tail.windows(2).position(|w| w == b"\n\n").map(|i| start + i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What the head `head` (its bytes up to and including the blank line) asks.
pub(crate) fn parse(head: &[u8]) -> Request {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else { return Request::Malformed };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Request::Malformed;
    };
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") || target.is_empty() {
        return Request::Malformed;
    }
    let head = match method {
        "GET" => false,
        "HEAD" => true,
        m if !m.is_empty() && m.bytes().all(|b| b.is_ascii_uppercase()) => return Request::MethodNotAllowed,
        _ => return Request::Malformed,
    };
    let path = target.split_once('?').map_or(target, |(path, _)| path);
    if path == "/metrics" {
        Request::Metrics { head }
    } else {
        Request::NotFound
    }
}

/// A whole response: status line, headers, and `body` unless `head_only`.
pub(crate) fn response(status: &str, content_type: &str, body: &[u8], head_only: bool) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    )
    .into_bytes();
    if status.starts_with("405") {
        out.extend_from_slice(b"Allow: GET, HEAD\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

/// A short plain-text error answer.
pub(crate) fn error(status: &str) -> Vec<u8> {
    response(status, "text/plain; charset=utf-8", format!("{status}\n").as_bytes(), false)
}

/// Written at once to a connection refused for want of a place (one write
/// that never waits), before it is closed.
pub(crate) const BUSY: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\nConnection: close\r\n\r\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_ends_at_the_first_blank_line_wherever_the_reads_split_it() {
        let req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nrest";
        let whole = head_end(req, 0);
        assert_eq!(whole, Some(req.len() - 4));
        for split in 0..req.len() {
            // As if bytes up to `split` were scanned already without a terminator.
            let found = head_end(&req[..split], 0).or_else(|| head_end(req, split));
            assert_eq!(found, whole, "split at {split}");
        }
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n", 0), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n", 0), None);
        assert_eq!(head_end(b"", 5), None);
    }

    #[test]
    fn requests_map_to_answers() {
        let cases: &[(&[u8], Request)] = &[
            (b"GET /metrics HTTP/1.1\r\n\r\n", Request::Metrics { head: false }),
            (b"GET /metrics?x=1 HTTP/1.0\r\n\r\n", Request::Metrics { head: false }),
            (b"HEAD /metrics HTTP/1.1\r\n\r\n", Request::Metrics { head: true }),
            (b"GET / HTTP/1.1\r\n\r\n", Request::NotFound),
            (b"GET /metrics/ HTTP/1.1\r\n\r\n", Request::NotFound),
            (b"POST /metrics HTTP/1.1\r\n\r\n", Request::MethodNotAllowed),
            (b"get /metrics HTTP/1.1\r\n\r\n", Request::Malformed),
            (b"GET /metrics HTTP/2.0\r\n\r\n", Request::Malformed),
            (b"GET  /metrics HTTP/1.1\r\n\r\n", Request::Malformed),
            (b"GET /metrics\r\n\r\n", Request::Malformed),
            (b"\xff\xfe /metrics HTTP/1.1\r\n\r\n", Request::Malformed),
            (b"\r\n\r\n", Request::Malformed),
            (b"", Request::Malformed),
        ];
        for (head, want) in cases {
            assert_eq!(parse(head), *want, "{:?}", String::from_utf8_lossy(head));
        }
    }

    #[test]
    fn no_input_panics() {
        // Every short byte string over a small alphabet that covers the
        // request line's separators.
        let alphabet = [b'G', b'E', b'T', b' ', b'/', b'\r', b'\n', 0xff, b'?'];
        let mut input = Vec::new();
        for n in 0..5u32 {
            for mut code in 0..alphabet.len().pow(n) {
                input.clear();
                for _ in 0..n {
                    input.push(alphabet[code % alphabet.len()]);
                    code /= alphabet.len();
                }
                let _ = parse(&input);
                let _ = head_end(&input, 0);
                let _ = head_end(&input, input.len() / 2);
            }
        }
    }

    #[test]
    fn responses_say_their_length_and_close() {
        let r = String::from_utf8(response("200 OK", "text/plain", b"abc", false)).unwrap();
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains("Content-Length: 3\r\n") && r.contains("Connection: close\r\n"), "{r}");
        assert!(r.ends_with("\r\n\r\nabc"), "{r}");
        let head = String::from_utf8(response("200 OK", "text/plain", b"abc", true)).unwrap();
        assert!(head.contains("Content-Length: 3\r\n") && head.ends_with("\r\n\r\n"), "{head}");
        assert!(String::from_utf8(error("405 Method Not Allowed")).unwrap().contains("Allow: GET, HEAD\r\n"));
    }
}
