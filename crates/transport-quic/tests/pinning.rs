//! The trust model: a sender talks only to the certificate its endpoint
//! pins, only over the kvlink ALPN, and refuses malformed endpoint details
//! before sending anything.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::{any_grant, assert_still_serves, client_endpoint, default_node, FakeReceiver, Node, BOUND};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchWriter, Endpoint, TransportError, WriteOp};
use rstest::rstest;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use test_support::pattern::fill;
use transport_quic::details::{EndpointDetails, DETAILS_LEN};
use transport_quic::wire::SERVER_NAME;

fn one_op(a: &Node, b: &Node) -> Vec<WriteOp> {
    vec![WriteOp { src: a.buf.addr(), dst: b.buf.addr(), len: 4096 }]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_fingerprint_fails_the_handshake_and_writes_nothing() {
    let mut a = default_node(1 << 16).await;
    let b = default_node(1 << 16).await;
    let ops = one_op(&a, &b);
    fill(&mut a.buf, &ops);
    let mut details = EndpointDetails::decode(&b.transport.endpoint().details).unwrap();
    assert_eq!(details.fingerprint, b.transport.fingerprint());
    details.fingerprint[0] ^= 1;
    let pinned_elsewhere = Endpoint { details: details.encode(), ..b.transport.endpoint() };
    let grant = b.grant_all().await;
    let err = tokio::time::timeout(BOUND, a.transport.batch_write(&pinned_elsewhere, &grant, &ops))
        .await
        .unwrap()
        .unwrap_err();
    match &err {
        TransportError::Connect { reason, .. } => {
            assert!(reason.contains("fingerprint mismatch"), "unclear reason: {reason}")
        }
        other => panic!("expected Connect, got {other:?}"),
    }
    assert!(b.buf.is_zero(), "bytes landed through an unpinned connection");
    assert_eq!(a.transport.connections_opened(), 0);
    assert_eq!(b.transport.connections_accepted(), 0);
    // The right pin works, from the same sender.
    a.transport.batch_write(&b.transport.endpoint(), &grant, &ops).await.unwrap();
    b.transport.revoke(&grant.id).await;
    test_support::pattern::check(&b.buf, &ops);
    assert_eq!(a.transport.connections_opened(), 1);
}

/// Details that must be refused as a bad endpoint.
#[derive(Clone, Copy, Debug)]
enum Malformed {
    Empty,
    /// What a TCP endpoint advertises: nothing.
    TcpStyle,
    Truncated,
    OneByteMore,
    BadMagic,
    FutureVersion,
    /// Version 1 (with a region list): the old wire, without grants.
    OldVersion,
    UnknownFlags,
    TooLong,
}

#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_details_are_a_bad_endpoint(
    #[values(
        Malformed::Empty,
        Malformed::TcpStyle,
        Malformed::Truncated,
        Malformed::OneByteMore,
        Malformed::BadMagic,
        Malformed::FutureVersion,
        Malformed::OldVersion,
        Malformed::UnknownFlags,
        Malformed::TooLong
    )]
    malformed: Malformed,
) {
    let mut a = default_node(1 << 16).await;
    let b = default_node(1 << 16).await;
    let ops = one_op(&a, &b);
    fill(&mut a.buf, &ops);
    let good = b.transport.endpoint().details;
    let details = match malformed {
        Malformed::Empty | Malformed::TcpStyle => Vec::new(),
        Malformed::Truncated => good[..DETAILS_LEN - 8].to_vec(),
        Malformed::OneByteMore => [&good[..], &[0]].concat(),
        Malformed::BadMagic => [b"KVLT", &good[4..]].concat(),
        Malformed::FutureVersion => [&good[..4], &3u16.to_le_bytes(), &good[6..]].concat(),
        Malformed::OldVersion => {
            // Version 1's layout: header, region count, one region.
            let region = [b.buf.addr().to_le_bytes(), (1u64 << 16).to_le_bytes()].concat();
            [&good[..4], &1u16.to_le_bytes(), &good[6..], &1u32.to_le_bytes(), &region].concat()
        }
        Malformed::UnknownFlags => [&good[..6], &0x0100u16.to_le_bytes(), &good[8..]].concat(),
        Malformed::TooLong => vec![0; kv_proto::MAX_ENDPOINT_DETAILS_LEN + 1],
    };
    let endpoint = Endpoint { details, ..b.transport.endpoint() };
    let grant = b.grant_all().await;
    let err = a.transport.batch_write(&endpoint, &grant, &ops).await.unwrap_err();
    assert!(matches!(err, TransportError::BadEndpoint { .. }), "{malformed:?}: {err:?}");
    assert!(!err.to_string().is_empty());
    b.transport.revoke(&grant.id).await;
    assert!(b.buf.is_zero());
    assert_eq!(a.transport.connections_opened(), 0, "{malformed:?}: a connection was opened");
    assert_still_serves(&b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_without_the_kvlink_alpn_is_refused() {
    let mut a = default_node(1 << 16).await;
    let fake = FakeReceiver::bind(b"h3");
    let accepting = fake.endpoint.clone();
    // Drive the fake's handshakes (they fail: no common ALPN).
    let server = tokio::spawn(async move {
        while let Some(incoming) = accepting.accept().await {
            let _ = incoming.await;
        }
    });
    let ops = vec![WriteOp { src: a.buf.addr(), dst: 0x1000, len: 16 }];
    fill(&mut a.buf, &ops);
    let err = tokio::time::timeout(BOUND, a.transport.batch_write(&fake.endpoint(), &any_grant(), &ops))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
    fake.endpoint.close(0u32.into(), b"done");
    server.await.unwrap();
}

/// Accepts any server certificate (test only: to reach the receiver with a
/// client that breaks the ALPN rule).
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[rstest]
#[case::other_alpn(Some(b"h3".as_slice()))]
#[case::no_alpn(None)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_the_kvlink_alpn_gets_no_service(#[case] alpn: Option<&[u8]>) {
    let victim = default_node(1 << 16).await;
    let grant = victim.grant_all().await.id;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut crypto = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
        .with_no_client_auth();
    crypto.alpn_protocols = alpn.map(|a| vec![a.to_vec()]).unwrap_or_default();
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(crypto).unwrap();
    let endpoint = client_endpoint();
    let connecting =
        endpoint.connect_with(quinn::ClientConfig::new(Arc::new(crypto)), victim.transport.local_addr(), SERVER_NAME);
    let served = tokio::time::timeout(BOUND, async {
        let conn = connecting.unwrap().await?;
        let (mut send, mut recv) = conn.open_bi().await?;
        let bytes = common::request(&grant, &[(victim.buf.addr(), 4)], 4, &[1, 2, 3, 4]);
        send.write_all(&bytes).await?;
        send.finish()?;
        anyhow::Ok(common::reply(&mut recv).await?)
    })
    .await
    .expect("the receiver neither refused nor closed the connection");
    assert!(!matches!(served, Ok((ReplyStatus::Ok, _))), "served without the ALPN: {served:?}");
    victim.transport.revoke(&grant).await;
    assert!(victim.buf.is_zero());
    assert_eq!(victim.transport.connections_accepted(), 0);
    assert_still_serves(&victim).await;
}
