//! The bytes of HTTP/1.x that every small HTTP listener of the project
//! (the metrics endpoint, P's bootstrap server) reads the same way: where a
//! request head ends, and what a client still sends after its answer.

use tokio::io::{AsyncRead, AsyncReadExt};

/// Where a message head in `buf` ends (the index past its blank line),
/// scanning from `from` on (less the 3 bytes a terminator may straddle), so
/// a peer sending one byte at a time costs no rescans. A bare LF line end
/// is tolerated, as most servers do.
pub fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let start = from.saturating_sub(3);
    let tail = buf.get(start..)?;
    let crlf = tail.windows(4).position(|w| w == b"\r\n\r\n").map(|i| start + i + 4);
    let lf = tail.windows(2).position(|w| w == b"\n\n").map(|i| start + i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Reads and drops what a client still sends after its answer, until it
/// closes or `max_bytes` came (so closing does not reset the answer away).
/// The caller bounds it in time.
pub async fn linger<S: AsyncRead + Unpin>(stream: &mut S, max_bytes: usize) {
    let mut chunk = [0u8; 4096];
    let mut read = 0;
    while read < max_bytes {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => read += n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_end_at_the_first_blank_line_wherever_reads_split_them() {
        let msg = b"POST /register HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}";
        let whole = head_end(msg, 0);
        assert_eq!(whole, Some(msg.len() - 2));
        for split in 0..msg.len() {
            let found = head_end(&msg[..split], 0).or_else(|| head_end(msg, split));
            assert_eq!(found, whole, "split at {split}");
        }
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n", 0), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n", 0), None);
        assert_eq!(head_end(b"", 9), None);
    }

    #[tokio::test]
    async fn linger_reads_to_its_bound_or_the_close() {
        let mut closed: &[u8] = b"abc";
        linger(&mut closed, 1 << 20).await;
        assert!(closed.is_empty(), "read to the close");
        let long = vec![0u8; 3 * 4096];
        let mut stream: &[u8] = &long;
        linger(&mut stream, 4096).await;
        assert_eq!(stream.len(), 2 * 4096, "stops once the bound is read");
    }
}
