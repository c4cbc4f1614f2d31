//! Write grants on the TCP data plane: a peer with a valid connection writes
//! only inside a live grant the receiver issued, a bad batch is refused
//! whole with nothing written and the connection kept, and `revoke` is a
//! fence: once it returns, no byte of that grant lands.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{RawClient, BOUND};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchWriter, Grant, GrantId, MemoryRegion, RegionAccess, TransportError, WriteOp};
use rstest::rstest;
use test_support::pattern::{check, covering, fill};
use test_support::{Logs, TestBuf};
use transport_tcp::{TcpConfig, TcpTransport};

const KIB: usize = 1024;

/// A receiver with one destination region and one region registered only
/// as a source, both filled with known bytes (zero and 0x11).
struct Receiver {
    transport: Arc<TcpTransport>,
    dst: TestBuf,
    src_only: TestBuf,
}

impl Receiver {
    async fn new(dst_len: usize) -> Self {
        let transport = TcpTransport::bind(TcpConfig::default()).await.unwrap();
        let dst = TestBuf::new(dst_len);
        let mut src_only = TestBuf::new(64 * KIB);
        src_only.bytes_mut().fill(0x11);
        // SAFETY: both buffers live in the returned value, whose transport is
        // dropped first (field order); tests read them only after the
        // batches into them completed or their grant was revoked.
        unsafe {
            transport.register_regions(&[dst.region()], RegionAccess::Destination).unwrap();
            transport.register_regions(&[src_only.region()], RegionAccess::Source).unwrap();
        }
        Self { transport, dst, src_only }
    }

    fn at(&self, offset: usize) -> u64 {
        self.dst.addr() + offset as u64
    }

    async fn grant(&self, offset: usize, len: usize) -> Grant {
        self.transport.grant(&[MemoryRegion::new(self.at(offset), len as u64)], BOUND).await.unwrap()
    }
}

/// A sender whose buffer is registered as a source.
async fn sender(len: usize) -> (Arc<TcpTransport>, TestBuf) {
    let transport = TcpTransport::bind(TcpConfig::default()).await.unwrap();
    let buf = TestBuf::new(len);
    // SAFETY: the caller keeps `buf` until after the transport is dropped.
    unsafe { transport.register_regions(&[buf.region()], RegionAccess::Source) }.unwrap();
    (transport, buf)
}

/// How a hostile peer with a valid connection tries to write.
#[derive(Clone, Copy, Debug)]
enum Hostile {
    /// Under a grant id the receiver never issued.
    ForgedGrant,
    /// Under a grant the receiver revoked.
    RevokedGrant,
    /// Under its own live grant, one op inside the registered destination
    /// region but outside the grant.
    OutsideItsGrant,
    /// Under its own live grant, one op into a region registered only as a
    /// source.
    IntoASource,
    /// Under a grant whose validity ran out.
    ExpiredGrant,
}

/// Receiver layout (1 MiB destination): the honest sender's grant covers
/// [0, 256 KiB); the hostile client's own grant [512 KiB, 576 KiB); a
/// revoked grant [640 KiB, 704 KiB); an expired one [768 KiB, 832 KiB).
#[rstest]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_batch_is_refused_whole_and_an_honest_sender_is_unaffected(
    #[values(
        Hostile::ForgedGrant,
        Hostile::RevokedGrant,
        Hostile::OutsideItsGrant,
        Hostile::IntoASource,
        Hostile::ExpiredGrant
    )]
    hostile: Hostile,
) {
    let rx = Receiver::new(1024 * KIB).await;
    let honest_grant = rx.grant(0, 256 * KIB).await;
    let own = rx.grant(512 * KIB, 64 * KIB).await;
    let revoked = rx.grant(640 * KIB, 64 * KIB).await;
    rx.transport.revoke(&revoked.id).await;
    let expired =
        rx.transport.grant(&[MemoryRegion::new(rx.at(768 * KIB), 64 * KIB as u64)], Duration::ZERO).await.unwrap();

    // The honest sender: 32 batches of 8 × 1 KiB under its grant, running
    // while the hostile client works.
    let (honest, mut honest_buf) = sender(256 * KIB).await;
    let honest_ops: Vec<WriteOp> = (0..256)
        .map(|k| WriteOp { src: honest_buf.addr() + k * KIB as u64, dst: rx.at(k as usize * KIB), len: KIB as u64 })
        .collect();
    fill(&mut honest_buf, &honest_ops);
    let honest_task = {
        let (honest, endpoint, grant, ops) =
            (Arc::clone(&honest), rx.transport.endpoint(), honest_grant.clone(), honest_ops.clone());
        tokio::spawn(async move {
            for chunk in ops.chunks(8) {
                honest.batch_write(&endpoint, &grant, chunk).await?;
            }
            Ok::<(), TransportError>(())
        })
    };

    let (mut client, _) = RawClient::handshaken_to(rx.transport.local_addr()).await;
    // Every hostile batch has one op its grant allows (the first 1 KiB of its
    // range) and the hostile one; the payload follows in full.
    let (grant, ops) = match hostile {
        Hostile::ForgedGrant => (GrantId::from_bytes([0x42; 16]), [(rx.at(512 * KIB), 1024), (rx.at(520 * KIB), 1024)]),
        Hostile::RevokedGrant => (revoked.id, [(rx.at(640 * KIB), 1024), (rx.at(650 * KIB), 1024)]),
        Hostile::OutsideItsGrant => (own.id, [(rx.at(512 * KIB), 1024), (rx.at(600 * KIB), 1024)]),
        Hostile::IntoASource => (own.id, [(rx.at(512 * KIB), 1024), (rx.src_only.addr(), 1024)]),
        Hostile::ExpiredGrant => (expired.id, [(rx.at(768 * KIB), 1024), (rx.at(770 * KIB), 1024)]),
    };
    client.batch(1, grant, &ops, 2048, &[0xEE; 2048]).await;
    let (reply, reason) = client.reply().await;
    assert_eq!((reply.batch_id, reply.status), (1, ReplyStatus::Refused), "{hostile:?}: {reason}");
    let expected = match hostile {
        Hostile::ForgedGrant | Hostile::RevokedGrant => "no live grant",
        Hostile::OutsideItsGrant | Hostile::IntoASource => "op 1",
        Hostile::ExpiredGrant => "expired",
    };
    assert!(reason.contains(expected), "{hostile:?}: reason {reason:?}");

    // The connection stays usable: a batch inside its own grant lands.
    client.batch(2, own.id, &[(rx.at(520 * KIB), 4)], 4, &[1, 2, 3, 4]).await;
    assert_eq!(client.reply().await.0.status, ReplyStatus::Ok);

    honest_task.await.unwrap().expect("the honest sender was disturbed");
    for grant in [&honest_grant, &own, &expired] {
        rx.transport.revoke(&grant.id).await;
    }
    assert_eq!(rx.transport.live_grants(), 0);
    drop(client);

    // Every byte: the honest ops and the one good hostile-connection write
    // landed, nothing else in the destination, the source untouched.
    check(&rx.dst, &honest_ops);
    let bytes = rx.dst.bytes();
    assert_eq!(&bytes[520 * KIB..520 * KIB + 4], &[1, 2, 3, 4]);
    assert!(bytes[256 * KIB..520 * KIB].iter().all(|&b| b == 0), "{hostile:?} wrote into the destination");
    assert!(bytes[520 * KIB + 4..].iter().all(|&b| b == 0), "{hostile:?} wrote into the destination");
    assert!(rx.src_only.bytes().iter().all(|&b| b == 0x11), "{hostile:?} wrote into a source region");
}

/// Waits until byte `i` of `buf` reads `value` (the receiver is then inside
/// the batch's payload); bounded by `BOUND`.
async fn wait_until_landed(buf: &TestBuf, i: usize, value: u8) {
    tokio::time::timeout(BOUND, async {
        while buf.peek_volatile(i) != value {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the payload never started landing");
}

/// Bytes `[0, len)` hold `value` up to some point and zero after it: what a
/// payload cut off part-way leaves.
fn landed_prefix(bytes: &[u8], value: u8) -> usize {
    let landed = bytes.iter().take_while(|&&b| b == value).count();
    assert!(bytes[landed..].iter().all(|&b| b == 0), "a byte landed past the cut at {landed}");
    landed
}

/// A raw client sends the header, the op list and half the payload; the
/// test revokes the grant once the first bytes landed; then the client sends
/// the rest. Nothing after the revocation lands, the batch is refused, and
/// the connection stays usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_mid_batch_is_a_fence_for_a_raw_client() {
    const LEN: usize = 256 * KIB;
    let rx = Receiver::new(1024 * KIB).await;
    let grant = rx.grant(0, LEN).await;
    let (mut client, _) = RawClient::handshaken_to(rx.transport.local_addr()).await;
    client.batch(7, grant.id, &[(rx.at(0), LEN as u64)], LEN as u64, &[0xAA; LEN / 2]).await;
    wait_until_landed(&rx.dst, 0, 0xAA).await;

    rx.transport.revoke(&grant.id).await;
    let after_revoke = rx.dst.bytes().to_vec();
    let landed = landed_prefix(&after_revoke[..LEN], 0xAA);
    assert!(landed > 0 && landed <= LEN / 2);

    client.send(&[0xBB; LEN / 2]).await;
    let (reply, reason) = client.reply().await;
    assert_eq!((reply.batch_id, reply.status), (7, ReplyStatus::Refused), "{reason}");
    assert!(reason.contains("revoked"), "{reason}");
    assert_eq!(rx.dst.bytes(), &after_revoke[..], "bytes landed after the revocation returned");
    assert!(!after_revoke.contains(&0xBB));

    // The connection was kept in step: a batch under a new grant lands.
    let next = rx.grant(LEN, 4).await;
    client.batch(8, next.id, &[(rx.at(LEN), 4)], 4, &[1, 2, 3, 4]).await;
    assert_eq!(client.reply().await.0.status, ReplyStatus::Ok);
    rx.transport.revoke(&next.id).await;
    assert_eq!(&rx.dst.bytes()[LEN..LEN + 5], &[1, 2, 3, 4, 0]);
}

/// The same through `batch_write`: a large batch (split over two
/// connections) races `revoke`; memory does not change after `revoke`
/// returned, and the sender is told the batch was refused.
#[rstest]
#[case::split(2)]
#[case::one_stream(1)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_during_batch_write_is_a_fence(#[case] streams: usize) {
    const LEN: usize = 128 << 20;
    let rx = Receiver::new(LEN).await;
    let config = TcpConfig { parallel_streams: streams, ..TcpConfig::default() };
    let tx = TcpTransport::bind(config).await.unwrap();
    let mut src = TestBuf::new(LEN);
    // SAFETY: `src` outlives `tx`, which is dropped at the end of the test first.
    unsafe { tx.register_regions(&[src.region()], RegionAccess::Source) }.unwrap();
    src.bytes_mut().fill(0xAB);
    let ops = vec![WriteOp { src: src.addr(), dst: rx.at(0), len: LEN as u64 }];
    let grant = rx.transport.grant(&covering(&ops), BOUND).await.unwrap();

    let writing = {
        let (tx, endpoint, grant, ops) = (Arc::clone(&tx), rx.transport.endpoint(), grant.clone(), ops.clone());
        tokio::spawn(async move { tx.batch_write(&endpoint, &grant, &ops).await })
    };
    wait_until_landed(&rx.dst, 0, 0xAB).await;
    rx.transport.revoke(&grant.id).await;
    let after_revoke = rx.dst.bytes().to_vec();

    let result = writing.await.unwrap();
    assert_eq!(rx.dst.bytes(), &after_revoke[..], "bytes landed after the revocation returned");
    let err = result.expect_err("the batch completed before the revocation: the race was not exercised");
    assert!(matches!(&err, TransportError::Refused { reason, .. } if reason.contains("revoked")), "{err:?}");
    let landed = after_revoke.iter().filter(|&&b| b == 0xAB).count();
    assert!(landed > 0 && landed < LEN, "{landed} bytes landed");
    assert!(after_revoke.iter().all(|&b| b == 0 || b == 0xAB));

    // A batch under the revoked grant is refused; a new grant works.
    let small = [WriteOp { src: src.addr(), dst: rx.at(LEN - 4096), len: 4096 }];
    let err = tx.batch_write(&rx.transport.endpoint(), &grant, &small).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { .. }), "{err:?}");
    let fresh = rx.transport.grant(&covering(&small), BOUND).await.unwrap();
    let zero_before = rx.dst.bytes()[LEN - 4096..].iter().all(|&b| b == 0);
    tx.batch_write(&rx.transport.endpoint(), &fresh, &small).await.unwrap();
    rx.transport.revoke(&fresh.id).await;
    assert!(rx.dst.bytes()[LEN - 4096..].iter().all(|&b| b == 0xAB), "zero before: {zero_before}");
    drop(tx);
}

/// A refused batch is logged with the peer's address and the grant's short
/// form, never the whole id (a capability). On a current-thread runtime, so
/// every task logs to this test's subscriber.
#[tokio::test]
async fn a_refusal_is_logged_with_the_peer_and_the_grants_short_form() {
    let (logs, _guard) = Logs::capture(tracing::Level::WARN);
    let rx = Receiver::new(64 * KIB).await;
    let (mut client, _) = RawClient::handshaken_to(rx.transport.local_addr()).await;
    let forged = GrantId::from_bytes([0xC3; 16]);
    client.batch(1, forged, &[(rx.at(0), 8)], 8, &[1; 8]).await;
    assert_eq!(client.reply().await.0.status, ReplyStatus::Refused);
    assert!(rx.dst.is_zero());

    let text = logs.text();
    let line =
        text.lines().find(|l| l.contains("refusing batch")).unwrap_or_else(|| panic!("no refusal logged: {text}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains(&client.stream.local_addr().unwrap().to_string()), "no peer address: {line}");
    assert!(line.contains(&format!("grant={forged}")), "no grant: {line}");
    assert!(!text.contains(&"c3".repeat(16)), "the whole grant id was logged: {text}");
}

/// A flood of batches naming forged grants (48 bytes each, no secret
/// needed) costs the log at most one line a second, each saying how many it
/// left out; every batch is still refused and nothing lands.
#[tokio::test]
async fn a_flood_of_forged_grants_logs_a_bounded_number_of_lines() {
    const FLOOD: u64 = 2_000;
    let (logs, _guard) = Logs::capture(tracing::Level::WARN);
    let rx = Receiver::new(64 * KIB).await;
    let (mut client, _) = RawClient::handshaken_to(rx.transport.local_addr()).await;
    let started = std::time::Instant::now();
    for batch_id in 1..=FLOOD {
        let forged = GrantId::from_bytes(u128::from(batch_id).to_le_bytes());
        client.batch(batch_id, forged, &[(rx.at(0), 8)], 8, &[1; 8]).await;
        assert_eq!(client.reply().await.0.status, ReplyStatus::Refused);
    }
    let seconds = started.elapsed().as_secs();
    assert!(rx.dst.is_zero());
    let text = logs.text();
    let lines = text.lines().filter(|l| l.contains("refusing batch")).count();
    // One line when the flood starts, then at most one per second of it.
    assert!(lines >= 1 && lines as u64 <= 2 + seconds, "{lines} lines for {FLOOD} refusals in {seconds} s:\n{text}");
}

/// Connections that open with garbage (no secret needed to reach the port)
/// cost the log at most one line a second for all of them.
#[tokio::test]
async fn a_flood_of_bad_connections_logs_a_bounded_number_of_lines() {
    const FLOOD: usize = 300;
    let (logs, _guard) = Logs::capture(tracing::Level::WARN);
    let rx = Receiver::new(64 * KIB).await;
    let started = std::time::Instant::now();
    for _ in 0..FLOOD {
        let mut client = RawClient::connect_to(rx.transport.local_addr()).await;
        client.send(b"NOTKVLT!").await;
        client.until_closed().await;
    }
    let seconds = started.elapsed().as_secs();
    let text = logs.text();
    let lines = text.lines().filter(|l| l.contains("closing data-plane connection")).count();
    assert!(
        lines >= 1 && lines as u64 <= 2 + seconds,
        "{lines} lines for {FLOOD} bad connections in {seconds} s:\n{text}"
    );
}

/// The receiver's side of PRECHECK: a verdict before any payload byte is
/// read; a refused question sends no payload and keeps the connection in
/// step; an admitted batch whose sender goes away before the payload writes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prechecked_batch_is_answered_before_its_payload() {
    use transport_tcp::wire::BATCH_FLAG_PRECHECK;
    let rx = Receiver::new(64 * KIB).await;
    let grant = rx.grant(0, 4 * KIB).await;
    let (mut client, _) = RawClient::handshaken_to(rx.transport.local_addr()).await;

    client.batch_with_flags(1, BATCH_FLAG_PRECHECK, grant.id, &[(rx.at(0), 4)], 4, &[]).await;
    let (admitted, _) = client.reply().await;
    assert_eq!((admitted.batch_id, admitted.status), (1, ReplyStatus::Ok), "admitted before the payload");
    client.send(&[1, 2, 3, 4]).await;
    assert_eq!(client.reply().await.0.status, ReplyStatus::Ok);

    let forged = GrantId::from_bytes([0x77; 16]);
    client.batch_with_flags(2, BATCH_FLAG_PRECHECK, forged, &[(rx.at(8), 4)], 4, &[]).await;
    let (refused, reason) = client.reply().await;
    assert_eq!((refused.batch_id, refused.status), (2, ReplyStatus::Refused), "{reason}");
    // No payload follows a refused question: the next batch is in step.
    client.batch(3, grant.id, &[(rx.at(16), 2)], 2, &[5, 6]).await;
    assert_eq!(client.reply().await.0.status, ReplyStatus::Ok);

    client.batch_with_flags(4, BATCH_FLAG_PRECHECK, grant.id, &[(rx.at(100), 4)], 4, &[]).await;
    assert_eq!(client.reply().await.0.status, ReplyStatus::Ok);
    drop(client); // abandoned before its payload

    // The receiver keeps serving, and nothing of the abandoned batch landed.
    let (mut client, _) = RawClient::handshaken_to(rx.transport.local_addr()).await;
    client.batch(5, grant.id, &[(rx.at(200), 1)], 1, &[9]).await;
    assert_eq!(client.reply().await.0.status, ReplyStatus::Ok);
    rx.transport.revoke(&grant.id).await;
    let bytes = rx.dst.bytes();
    assert_eq!((&bytes[..4], &bytes[16..18], bytes[200]), (&[1, 2, 3, 4][..], &[5, 6][..], 9));
    let mut expected = vec![0u8; 64 * KIB];
    expected[..4].copy_from_slice(&[1, 2, 3, 4]);
    expected[16..18].copy_from_slice(&[5, 6]);
    expected[200] = 9;
    assert_eq!(bytes, &expected[..], "bytes landed outside the acknowledged batches");
}
