//! Data-plane shared-secret authentication: only peers that prove the
//! secret exchange batches; a failed proof writes nothing and costs only
//! that connection.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{check, fill, ops, Node, RawClient};
use kv_proto::auth::AuthSecret;
use kv_proto::{BatchWriter, TransportError};
use rstest::rstest;
use transport_tcp::wire::{AcceptStatus, Preamble, AUTH_FAILED, AUTH_TAG_LEN, FLAG_AUTH, VERSION};
use transport_tcp::TcpConfig;

fn config(secret: Option<&str>) -> TcpConfig {
    TcpConfig { auth_secret: secret.map(AuthSecret::new), ..TcpConfig::default() }
}

#[rstest]
#[case::same_secret(Some("s3cret"), Some("s3cret"), None)]
#[case::receiver_requires_it(None, Some("s3cret"), Some("requires the data-plane shared secret"))]
#[case::sender_requires_it(Some("s3cret"), None, Some("has no data-plane shared secret"))]
#[case::different_secrets(Some("guess"), Some("s3cret"), Some("failed to prove"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_flow_only_between_peers_proving_the_same_secret(
    #[case] sender: Option<&str>,
    #[case] receiver: Option<&str>,
    #[case] refusal: Option<&str>,
) {
    let mut a = Node::new(config(sender), 1 << 16).await;
    let b = Node::new(config(receiver), 1 << 16).await;
    let batch = ops(&a.buf, &b.buf, 8, 1024);
    fill(&mut a.buf, &batch);
    let result = a.transport.batch_write(&b.transport.endpoint(), &batch).await;
    match refusal {
        None => {
            result.unwrap();
            check(&b.buf, &batch);
        }
        Some(expected) => {
            let err = result.unwrap_err();
            assert!(matches!(err, TransportError::Connect { .. }), "{err:?}");
            assert!(err.to_string().contains(expected), "{err}");
            assert!(b.buf.is_zero(), "nothing lands without authentication");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_proof_is_refused_and_the_receiver_keeps_serving() {
    let b = Node::new(config(Some("s3cret")), 1 << 16).await;
    let mut raw = RawClient::connect(&b).await;
    let mut opening = Preamble { version: VERSION, flags: FLAG_AUTH }.encode().to_vec();
    opening.extend_from_slice(&[7u8; AUTH_TAG_LEN]);
    raw.send(&opening).await;
    assert_eq!(raw.accept().await.status, AcceptStatus::Accepted);
    raw.send(&[0u8; AUTH_TAG_LEN]).await; // a proof made without the secret
    let rest = raw.until_closed().await;
    assert_eq!(rest.len(), 2 * AUTH_TAG_LEN + 1, "challenge, then the verdict, then close");
    assert_eq!(rest[2 * AUTH_TAG_LEN], AUTH_FAILED);

    let mut unannounced = RawClient::connect(&b).await;
    unannounced.send(&Preamble::current().encode()).await;
    assert_eq!(unannounced.accept().await.status, AcceptStatus::AuthRequired);
    unannounced.until_closed().await;

    let mut a = Node::new(config(Some("s3cret")), 1 << 16).await;
    let batch = ops(&a.buf, &b.buf, 4, 512);
    fill(&mut a.buf, &batch);
    a.transport.batch_write(&b.transport.endpoint(), &batch).await.unwrap();
    check(&b.buf, &batch);
}
