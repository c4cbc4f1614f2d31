//! The little HTTP/1.1 the metrics endpoint speaks, without I/O: what a
//! request head asks for, and the bytes of each answer (where a head ends
//! is `kv_net::http`'s).
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
                let _ = kv_net::http::head_end(&input, 0);
                let _ = kv_net::http::head_end(&input, input.len() / 2);
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
