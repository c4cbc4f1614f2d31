//! Sends our handshake message and reads the peer's, concurrently (so two
//! peers that both write first cannot block each other), within
//! [`HandshakeLimits::timeout`]. After an authenticated opening each message
//! carries its tag ([`crate::tags`]), checked before the peer's is decoded.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::codec::{self, HEADER_LEN};
use super::{ConnectionInfo, HandshakeError, HandshakeLimits};
use crate::tags::{FrameTags, TagFailure};

/// Exchanges connection info over `stream` (a connected TCP stream, or any
/// byte stream), each message under `tags`: returns the peer's, checked
/// against `limits`.
pub async fn exchange<S>(
    stream: &mut S,
    local: &ConnectionInfo,
    limits: &HandshakeLimits,
    tags: &mut FrameTags,
) -> Result<ConnectionInfo, HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut message = Vec::new();
    codec::encode(local, limits, &mut message)?;
    tags.seal(&mut message, 0);
    let (mut reader, mut writer) = tokio::io::split(stream);
    let send = async {
        writer.write_all(&message).await?;
        writer.flush().await?;
        Ok::<(), HandshakeError>(())
    };
    let receive = read_message(&mut reader, limits, tags);
    let both = async { tokio::try_join!(send, receive) };
    let ((), peer) =
        tokio::time::timeout(limits.timeout, both).await.map_err(|_| HandshakeError::TimedOut(limits.timeout))??;
    tracing::debug!(
        peer_qpn = peer.qp.qpn,
        peer_psn = peer.qp.psn,
        peer_regions = peer.regions.len(),
        "rdma handshake done"
    );
    Ok(peer)
}

/// Reads one message: the header first, so the region count is checked
/// against the limit before the rest is read or allocated, then its tag,
/// checked before the message is decoded. The peer's half of [`exchange`],
/// which reads every handshake through it.
pub async fn read_message<R>(
    reader: &mut R,
    limits: &HandshakeLimits,
    tags: &mut FrameTags,
) -> Result<ConnectionInfo, HandshakeError>
where
    R: AsyncRead + Unpin,
{
    let mut message = vec![0u8; HEADER_LEN];
    read_exact(reader, &mut message).await?;
    let header = codec::decode_header(&message, limits)?;
    message.resize(header.message_len(), 0);
    read_exact(reader, &mut message[HEADER_LEN..]).await?;
    tags.read_and_check(reader, &[&message]).await.map_err(|failure| match failure {
        TagFailure::Read(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => HandshakeError::PeerClosed,
        TagFailure::Read(err) => HandshakeError::Io(err),
        TagFailure::Bad(bad) => HandshakeError::BadTag(bad),
    })?;
    codec::decode(&message, limits)
}

async fn read_exact<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut [u8]) -> Result<(), HandshakeError> {
    match reader.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => Err(HandshakeError::PeerClosed),
        Err(err) => Err(err.into()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;

    use super::*;
    use crate::handshake::QpEndpoint;
    use crate::region::RemoteRegion;

    fn info(qpn: u32, regions: usize) -> ConnectionInfo {
        ConnectionInfo {
            qp: QpEndpoint { gid: [qpn as u8; 16], qpn, psn: qpn * 3 },
            regions: (0..regions as u64)
                .map(|i| RemoteRegion { addr: 0x1000 + i * 0x1000, len: 0x1000, rkey: i as u32 })
                .collect(),
        }
    }

    fn limits() -> HandshakeLimits {
        HandshakeLimits { max_regions: 4096, timeout: Duration::from_secs(5) }
    }

    #[tokio::test]
    async fn both_sides_learn_the_other() {
        // A pipe smaller than either message: each side must read while it writes.
        let (mut a, mut b) = tokio::io::duplex(64);
        let (sender, receiver, limits) = (info(0x10, 0), info(0x20, 1000), limits());
        let (mut tags_a, mut tags_b) = (FrameTags::none(), FrameTags::none());
        let (from_a, from_b) = tokio::join!(
            exchange(&mut a, &sender, &limits, &mut tags_a),
            exchange(&mut b, &receiver, &limits, &mut tags_b)
        );
        assert_eq!(from_a.unwrap(), receiver);
        assert_eq!(from_b.unwrap(), sender);
    }

    #[tokio::test]
    async fn over_tcp() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            exchange(&mut stream, &info(0x20, 3), &limits(), &mut FrameTags::none()).await.unwrap()
        });
        let mut client = tokio::net::TcpStream::connect(address).await.unwrap();
        let from_server = exchange(&mut client, &info(0x10, 0), &limits(), &mut FrameTags::none()).await.unwrap();
        assert_eq!(from_server, info(0x20, 3));
        assert_eq!(server.await.unwrap(), info(0x10, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_times_out() {
        let (mut a, _b) = tokio::io::duplex(4096);
        let result = exchange(&mut a, &info(0x10, 0), &limits(), &mut FrameTags::none()).await;
        assert!(matches!(result, Err(HandshakeError::TimedOut(_))), "{result:?}");
    }

    #[tokio::test]
    async fn a_peer_that_hangs_up_mid_message_is_an_error() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let mut partial = Vec::new();
        codec::encode(&info(0x20, 2), &limits(), &mut partial).unwrap();
        b.write_all(&partial[..HEADER_LEN + 5]).await.unwrap();
        drop(b);
        let result = exchange(&mut a, &info(0x10, 0), &limits(), &mut FrameTags::none()).await;
        // Our write may fail first (broken pipe) or the read hits the end.
        assert!(matches!(result, Err(HandshakeError::PeerClosed | HandshakeError::Io(_))), "{result:?}");
    }

    #[tokio::test]
    async fn a_hostile_region_count_is_refused_before_reading_on() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let mut header = Vec::new();
        codec::encode(&info(0x20, 0), &limits(), &mut header).unwrap();
        header[32..36].copy_from_slice(&u32::MAX.to_le_bytes());
        b.write_all(&header).await.unwrap();
        // The peer keeps the connection open and sends nothing more.
        let result = exchange(&mut a, &info(0x10, 0), &limits(), &mut FrameTags::none()).await;
        assert!(matches!(result, Err(HandshakeError::TooManyRegions { .. })), "{result:?}");
    }
}
