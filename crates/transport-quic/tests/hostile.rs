//! Hostile peers on both sides of the wire: a raw QUIC client (pinned to the
//! victim's certificate, speaking the wire by hand) feeding the receiver bad
//! streams, and fake receivers answering a sender badly. Each bad stream
//! costs only itself: the same connection and other senders keep being
//! served, nothing lands outside the bad batch's own (granted) destinations,
//! every wait is bounded, and once the hostile peer is gone the process's
//! descriptors and memory are back where they were (every test here runs
//! `isolated`, one at a time, so the count is this test's alone).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{
    any_grant, assert_still_serves, default_node, fake_server_hello, isolated, node, reply, request, verdict,
    FakeReceiver, Node, RawClient, BOUND,
};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchWriter, TransportError, WriteOp};
use rstest::rstest;
use test_support::pattern::{check, fill};
use test_support::Resources;
use transport_quic::wire::{BatchHeader, BATCH_HEADER_LEN};
use transport_quic::{OpListLimits, QuicConfig};

/// Small bounds, so the stalling cases end quickly.
fn victim_config() -> QuicConfig {
    QuicConfig {
        io_timeout: Duration::from_millis(300),
        op_lists: OpListLimits { max_ops_per_batch: 1024, timeout: Duration::from_secs(1), ..OpListLimits::default() },
        ..QuicConfig::default()
    }
}

const VICTIM_LEN: usize = 1 << 16;
/// Bad batches aim below this offset of the victim's buffer; the valid batch
/// after them lands above it.
const BAD_AREA: usize = 16 * 1024;

/// What the raw client does wrong on one stream.
#[derive(Clone, Copy, Debug)]
enum Abuse {
    /// Bytes that are not a request (an op count far over the limit).
    Garbage,
    /// One op more than the receiver's limit.
    TooManyOps,
    /// An op count of u64::MAX.
    HugeOpCount,
    /// Op lengths that do not add up to the header's total.
    SumMismatch,
    /// Op lengths whose sum overflows u64.
    SumOverflows,
    /// A stream finished with no data at all.
    EmptyStream,
    /// Part of a header, then FIN.
    TruncatedHeader,
    /// Part of the op list, then FIN.
    TruncatedOpList,
    /// Part of the payload, then FIN.
    TruncatedPayload,
    /// More payload than the header announces.
    ExtraPayload,
    /// Part of a header, then silence.
    StalledHeader,
    /// Part of the op list, then silence.
    StalledOpList,
    /// The op list a byte at a time, each quick enough, never all of it.
    DribbledOpList,
    /// Part of the payload, then silence.
    StalledPayload,
    /// A destination outside the grant (refused, not an error).
    OutsideGrant,
    /// Part of the payload, then RESET_STREAM.
    ResetMidPayload,
    /// Part of the payload, then CONNECTION_CLOSE.
    ClosedMidPayload,
}

/// What the receiver must answer on the bad stream.
#[derive(Debug, PartialEq)]
enum Expect {
    ProtocolError,
    Refused,
    NoOkReply,
}

#[rstest]
fn a_hostile_stream_costs_only_itself(
    #[values(
        Abuse::Garbage,
        Abuse::TooManyOps,
        Abuse::HugeOpCount,
        Abuse::SumMismatch,
        Abuse::SumOverflows,
        Abuse::EmptyStream,
        Abuse::TruncatedHeader,
        Abuse::TruncatedOpList,
        Abuse::TruncatedPayload,
        Abuse::ExtraPayload,
        Abuse::StalledHeader,
        Abuse::StalledOpList,
        Abuse::DribbledOpList,
        Abuse::StalledPayload,
        Abuse::OutsideGrant,
        Abuse::ResetMidPayload,
        Abuse::ClosedMidPayload
    )]
    abuse: Abuse,
) {
    isolated(async move {
        let victim = node(victim_config(), VICTIM_LEN).await;
        let base = victim.buf.addr();
        let grant = victim.grant_range(0, BAD_AREA as u64).await.id;
        let with_victim = Resources::now();
        let client = RawClient::connect(&victim).await;
        let (mut send, mut recv) = client.stream().await;
        let header = |op_count: u64, total_bytes: u64| BatchHeader { grant, op_count, total_bytes }.encode().to_vec();
        let request = |ops: &[(u64, u64)], total: u64, payload: &[u8]| request(&grant, ops, total, payload);
        // Whether bytes of the bad batch may land (inside its valid destinations).
        let mut partial = false;
        let mut expect = Expect::ProtocolError;
        let mut finish = true;
        let bytes: Vec<u8> = match abuse {
            Abuse::Garbage => vec![0x42; 64],
            Abuse::TooManyOps => [header(1025, 0), vec![0; 16 * 8]].concat(),
            Abuse::HugeOpCount => header(u64::MAX, 0),
            Abuse::SumMismatch => request(&[(base, 10), (base + 10, 20)], 100, &[7; 30]),
            Abuse::SumOverflows => request(&[(base, u64::MAX), (base, 2)], 1, &[7]),
            Abuse::EmptyStream => Vec::new(),
            Abuse::TruncatedHeader => vec![1; 10],
            Abuse::TruncatedOpList => {
                let ops = request(&[(base, 32), (base + 32, 32)], 0, &[]);
                [header(4, 64), ops[BATCH_HEADER_LEN..].to_vec()].concat()
            }
            Abuse::TruncatedPayload => {
                partial = true;
                request(&[(base, 64)], 64, &[7; 32])
            }
            Abuse::ExtraPayload => {
                partial = true;
                request(&[(base, 64)], 64, &[7; 80])
            }
            Abuse::StalledHeader => {
                finish = false;
                vec![1; 5]
            }
            Abuse::StalledOpList => {
                finish = false;
                [header(4, 64), request(&[(base, 16)], 0, &[])[BATCH_HEADER_LEN..].to_vec()].concat()
            }
            Abuse::DribbledOpList => {
                finish = false;
                header(1000, 1000)
            }
            Abuse::StalledPayload => {
                finish = false;
                partial = true;
                request(&[(base, 64)], 64, &[7; 32])
            }
            Abuse::OutsideGrant => {
                expect = Expect::Refused;
                request(&[(base, 16), (base + BAD_AREA as u64, 16)], 32, &[7; 32])
            }
            Abuse::ResetMidPayload | Abuse::ClosedMidPayload => {
                finish = false;
                partial = true;
                expect = Expect::NoOkReply;
                request(&[(base, 64)], 64, &[7; 32])
            }
        };
        // The receiver may stop the stream before all of it is written.
        let _ = send.write_all(&bytes).await;
        if finish {
            let _ = send.finish();
        }
        match abuse {
            Abuse::ResetMidPayload => {
                send.reset(7u32.into()).unwrap();
            }
            Abuse::ClosedMidPayload => client.conn.close(7u32.into(), b"bye"),
            _ => {}
        }
        let mut early = None;
        if matches!(abuse, Abuse::DribbledOpList) {
            // A byte every 50 ms (each read well within io_timeout), until
            // the receiver answers: the whole list never arrives.
            let list = request(&vec![(base, 1); 1000], 0, &[])[BATCH_HEADER_LEN..].to_vec();
            let dribble = async {
                let started = tokio::time::Instant::now();
                for b in list {
                    let lived = started.elapsed();
                    assert!(lived < Duration::from_secs(5), "the receiver kept reading a dribbled list for {lived:?}");
                    if send.write_all(&[b]).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                std::future::pending::<()>().await;
            };
            tokio::select! {
                got = reply(&mut recv) => early = Some(got),
                () = dribble => {}
            }
        }
        let got = match early {
            Some(got) => got,
            None => reply(&mut recv).await,
        };
        if let (Abuse::DribbledOpList, Ok((_, reason))) = (abuse, &got) {
            assert!(reason.contains("op list not received within 1s"), "{reason}");
        }
        match expect {
            Expect::ProtocolError => {
                let (status, reason) = got.unwrap_or_else(|e| panic!("{abuse:?}: no reply: {e}"));
                assert_eq!(status, ReplyStatus::ProtocolError, "{abuse:?}: {reason}");
                assert!(!reason.is_empty());
            }
            Expect::Refused => {
                let (status, reason) = got.unwrap();
                assert_eq!(status, ReplyStatus::Refused);
                assert!(reason.contains("op 1"), "{reason}");
            }
            Expect::NoOkReply => assert!(!matches!(got, Ok((ReplyStatus::Ok, _))), "{got:?}"),
        }
        drop(send);
        if !partial {
            assert!(victim.buf.bytes()[..BAD_AREA].iter().all(|&b| b == 0), "{abuse:?}: bytes landed");
        }
        assert!(victim.buf.bytes()[BAD_AREA..].iter().all(|&b| b == 0), "{abuse:?}: bytes landed outside the grant");

        // The same connection still carries a valid batch, unless it was closed.
        if !matches!(abuse, Abuse::ClosedMidPayload) {
            let dst = base + BAD_AREA as u64;
            let good = victim.grant_range(BAD_AREA as u64, 256).await.id;
            let payload: Vec<u8> = (0..256).map(|i| test_support::pattern::byte(99, i)).collect();
            let (status, reason) =
                client.exchange(&common::request(&good, &[(dst, 256)], 256, &payload)).await.unwrap();
            assert_eq!(status, ReplyStatus::Ok, "{abuse:?}: {reason}");
            victim.transport.revoke(&good).await;
            assert_eq!(&victim.buf.bytes()[BAD_AREA..BAD_AREA + 256], &payload[..]);
        }
        assert_still_serves(&victim).await;
        assert_eq!(victim.transport.connections_accepted(), 2, "the raw client's and the sender's");
        drop((client, recv));
        with_victim.back(&format!("after {abuse:?}"), BOUND).await;
    });
}

#[test]
fn garbage_datagrams_and_aborted_handshakes_cost_nothing() {
    isolated(async move {
        let victim = node(victim_config(), VICTIM_LEN).await;
        let with_victim = Resources::now();
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        for len in [1usize, 20, 1200, 1500] {
            socket.send_to(&vec![0xc3; len], victim.transport.local_addr()).await.unwrap();
        }
        // A client that starts a handshake and vanishes.
        let endpoint = common::client_endpoint();
        let config = transport_quic::tls::pinned_client_config(victim.transport.fingerprint()).unwrap();
        drop(endpoint.connect_with(config, victim.transport.local_addr(), transport_quic::wire::SERVER_NAME).unwrap());
        endpoint.close(0u32.into(), b"");
        assert_still_serves(&victim).await;
        drop((socket, endpoint));
        with_victim.back("after garbage datagrams", BOUND).await;
    });
}

/// How a fake receiver answers a batch.
#[derive(Clone, Copy, Debug)]
enum BadReceiver {
    /// Reads the batch and never answers.
    NeverReplies,
    /// Answers with a status this build does not know.
    UnknownStatus,
    /// Announces a reason longer than the limit.
    OverlongReason,
    /// Ends the stream part-way through the reply.
    TruncatedReply,
    /// Resets its side of the stream.
    ResetsStream,
    /// Closes the connection.
    ClosesConnection,
    /// Says "protocol error".
    ReportsProtocolError,
}

#[rstest]
fn a_bad_receiver_fails_the_batch_within_the_bound(
    #[values(
        BadReceiver::NeverReplies,
        BadReceiver::UnknownStatus,
        BadReceiver::OverlongReason,
        BadReceiver::TruncatedReply,
        BadReceiver::ResetsStream,
        BadReceiver::ClosesConnection,
        BadReceiver::ReportsProtocolError
    )]
    bad: BadReceiver,
) {
    isolated(async move {
        let config = QuicConfig { io_timeout: Duration::from_millis(300), ..QuicConfig::default() };
        let mut sender = node(config, 1 << 16).await;
        let fake = FakeReceiver::kvlink();
        let accepting = fake.endpoint.clone();
        let server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Some(incoming) = accepting.accept().await {
                let Ok(conn) = incoming.await else { continue };
                if fake_server_hello(&conn).await.is_err() {
                    continue;
                }
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let _ = recv.read_to_end(1 << 20).await;
                    match bad {
                        BadReceiver::NeverReplies => {}
                        BadReceiver::UnknownStatus => {
                            send.write_all(&verdict(ReplyStatus::Unknown(9), "?")).await.unwrap()
                        }
                        BadReceiver::OverlongReason => {
                            let mut r = verdict(ReplyStatus::Ok, "");
                            r[4..8].copy_from_slice(&5000u32.to_le_bytes());
                            send.write_all(&r).await.unwrap();
                            send.write_all(&[b'x'; 5000]).await.unwrap();
                        }
                        BadReceiver::TruncatedReply => {
                            send.write_all(&[0, 0, 0]).await.unwrap();
                            send.finish().unwrap();
                        }
                        BadReceiver::ResetsStream => send.reset(5u32.into()).unwrap(),
                        BadReceiver::ClosesConnection => conn.close(9u32.into(), b"bye"),
                        BadReceiver::ReportsProtocolError => {
                            send.write_all(&verdict(ReplyStatus::ProtocolError, "nope")).await.unwrap();
                            send.finish().unwrap();
                        }
                    }
                    held.push((send, recv));
                }
            }
        });
        let ops: Vec<WriteOp> = (0..4)
            .map(|k| WriteOp { src: sender.buf.addr() + k * 4096, dst: 0x10_0000 + k * 4096, len: 4096 })
            .collect();
        fill(&mut sender.buf, &ops);
        let result = tokio::time::timeout(BOUND, sender.transport.batch_write(&fake.endpoint(), &any_grant(), &ops))
            .await
            .expect("the batch did not fail within the bound");
        let err = result.expect_err("a batch the receiver did not acknowledge succeeded");
        let ok = match bad {
            BadReceiver::NeverReplies => matches!(err, TransportError::Timeout { .. }),
            BadReceiver::ClosesConnection => matches!(err, TransportError::PeerClosed { .. }),
            _ => matches!(err, TransportError::Protocol { .. }),
        };
        assert!(ok, "{bad:?}: unexpected {err:?}");
        // The sender still works with a real receiver.
        let receiver = default_node(1 << 16).await;
        let good: Vec<WriteOp> =
            ops.iter().map(|op| WriteOp { dst: receiver.buf.addr() + (op.dst - 0x10_0000), ..*op }).collect();
        let grant = receiver.grant_all().await;
        sender.transport.batch_write(&receiver.transport.endpoint(), &grant, &good).await.unwrap();
        receiver.transport.revoke(&grant.id).await;
        check(&receiver.buf, &good);
        fake.endpoint.close(0u32.into(), b"done");
        server.await.unwrap();
    });
}

/// How a hostile writer with a valid connection aims outside a live grant.
#[derive(Clone, Copy, Debug)]
enum Trespass {
    /// A grant id the receiver never issued.
    ForgedGrant,
    /// A grant the receiver revoked.
    RevokedGrant,
    /// A live grant, and an op inside a destination region but outside it.
    OpOutsideGrant,
    /// A live grant, and an op into a region registered only as a source.
    SourceRegion,
    /// A grant whose validity ran out.
    ExpiredGrant,
}

/// Layout of the victim's destination buffer in the grant tests.
const HOSTILE_AREA: u64 = 16 * 1024;
const FOLLOW_UP: u64 = 16 * 1024;
const UNGRANTED: u64 = 20 * 1024;
const HONEST: u64 = 32 * 1024;
const HONEST_LEN: u64 = 8 * 1024;

#[rstest]
fn a_batch_outside_a_live_grant_is_refused_whole(
    #[values(
        Trespass::ForgedGrant,
        Trespass::RevokedGrant,
        Trespass::OpOutsideGrant,
        Trespass::SourceRegion,
        Trespass::ExpiredGrant
    )]
    case: Trespass,
) {
    isolated(async move {
        let victim = node(victim_config(), VICTIM_LEN).await;
        let base = victim.buf.addr();
        // The victim's source KV: readable by its own batches, never writable.
        let source_only = test_support::TestBuf::new(VICTIM_LEN);
        // SAFETY: `source_only` outlives the victim's transport (dropped below first).
        unsafe { victim.transport.register_regions(&[source_only.region()], kv_proto::RegionAccess::Source) }.unwrap();
        let live = victim.grant_range(0, HOSTILE_AREA).await.id;
        let (grant, ops): (kv_proto::GrantId, Vec<(u64, u64)>) = match case {
            Trespass::ForgedGrant => (kv_proto::GrantId::random().unwrap(), vec![(base, 8192), (base + 8192, 8192)]),
            Trespass::RevokedGrant => {
                let revoked = victim.grant_range(0, HOSTILE_AREA).await.id;
                victim.transport.revoke(&revoked).await;
                (revoked, vec![(base, 8192), (base + 8192, 8192)])
            }
            Trespass::OpOutsideGrant => (live, vec![(base, 8192), (base + UNGRANTED, 8192)]),
            Trespass::SourceRegion => (live, vec![(base, 8192), (source_only.addr(), 8192)]),
            Trespass::ExpiredGrant => {
                let range = kv_proto::MemoryRegion::new(base, HOSTILE_AREA);
                let expired = victim.transport.grant(&[range], Duration::ZERO).await.unwrap().id;
                (expired, vec![(base, 8192), (base + 8192, 8192)])
            }
        };
        let with_victim = Resources::now();
        let client = RawClient::connect(&victim).await;
        let hostile = request(&grant, &ops, 16 * 1024, &[0xee; 16 * 1024]);

        // An honest sender writes into the victim at the same time.
        let mut honest = default_node(1 << 16).await;
        let honest_ops: Vec<WriteOp> = (0..8)
            .map(|k| WriteOp { src: honest.buf.addr() + k * 1024, dst: base + HONEST + k * 1024, len: 1024 })
            .collect();
        fill(&mut honest.buf, &honest_ops);
        let honest_grant = victim.grant_range(HONEST, HONEST_LEN).await;
        let endpoint = victim.transport.endpoint();
        let (refused, honest_result) = tokio::join!(
            client.exchange(&hostile),
            tokio::time::timeout(BOUND, honest.transport.batch_write(&endpoint, &honest_grant, &honest_ops)),
        );
        let (status, reason) = refused.unwrap_or_else(|e| panic!("{case:?}: no reply: {e}"));
        assert_eq!(status, ReplyStatus::Refused, "{case:?}: {reason}");
        match case {
            Trespass::OpOutsideGrant | Trespass::SourceRegion => assert!(reason.contains("op 1"), "{reason}"),
            Trespass::ExpiredGrant => {
                assert!(reason.contains("expired") || reason.contains("no live grant"), "{reason}")
            }
            _ => assert!(reason.contains("no live grant"), "{case:?}: {reason}"),
        }
        honest_result.expect("the honest batch hung").expect("the honest batch failed");

        // The connection is still usable: a valid batch on it lands.
        let follow_up = victim.grant_range(FOLLOW_UP, 256).await.id;
        let payload: Vec<u8> = (0..256).map(|i| test_support::pattern::byte(7, i)).collect();
        let (status, reason) =
            client.exchange(&request(&follow_up, &[(base + FOLLOW_UP, 256)], 256, &payload)).await.unwrap();
        assert_eq!(status, ReplyStatus::Ok, "{case:?}: {reason}");

        for grant in [live, follow_up, honest_grant.id] {
            victim.transport.revoke(&grant).await;
        }
        assert_eq!(victim.transport.live_grants(), 0);
        // Every byte: the hostile batch wrote nothing anywhere.
        let bytes = victim.buf.bytes();
        let (f, h) = (FOLLOW_UP as usize, HONEST as usize);
        assert!(bytes[..f].iter().all(|&b| b == 0), "{case:?}: bytes landed in the granted area");
        assert_eq!(&bytes[f..f + 256], &payload[..]);
        assert!(bytes[f + 256..h].iter().all(|&b| b == 0), "{case:?}: bytes landed outside every grant");
        check(&victim.buf, &honest_ops);
        assert!(
            bytes[h + HONEST_LEN as usize..].iter().all(|&b| b == 0),
            "{case:?}: bytes landed past the honest area"
        );
        assert!(source_only.is_zero(), "{case:?}: bytes landed in a source region");
        assert_eq!(victim.transport.connections_accepted(), 2, "the raw client's and the honest sender's");
        drop((client, honest));
        with_victim.back(&format!("after {case:?}"), BOUND).await;
        drop(victim);
    });
}

/// Waits (bounded) until `node` has received at least `n` payload bytes.
async fn received_at_least(node: &Node, n: u64) {
    tokio::time::timeout(BOUND, async {
        while node.transport.bytes_received() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the payload did not arrive");
}

#[test]
fn a_revocation_mid_batch_is_a_fence() {
    isolated(async move {
        const FIRST: usize = 16 * 1024;
        let victim =
            node(QuicConfig { io_timeout: Duration::from_secs(60), ..QuicConfig::default() }, VICTIM_LEN).await;
        let grant = victim.grant_all().await.id;
        let client = RawClient::connect(&victim).await;
        let (mut send, mut recv) = client.stream().await;
        let len = VICTIM_LEN as u64;
        send.write_all(&request(&grant, &[(victim.buf.addr(), len)], len, &[7; FIRST])).await.unwrap();
        // The batch is admitted and its first part has landed.
        received_at_least(&victim, FIRST as u64).await;
        tokio::time::timeout(BOUND, victim.transport.revoke(&grant)).await.expect("revoke hung");
        let _ = send.write_all(&[9; VICTIM_LEN - FIRST]).await;
        let _ = send.finish();
        let (status, reason) = reply(&mut recv).await.unwrap();
        assert_eq!(status, ReplyStatus::Refused, "{reason}");
        assert!(reason.contains("revoked"), "{reason}");
        assert!(victim.buf.bytes()[..FIRST].iter().all(|&b| b == 7));
        assert!(victim.buf.bytes()[FIRST..].iter().all(|&b| b == 0), "bytes landed after the revocation");
        assert_eq!(victim.transport.bytes_received(), FIRST as u64);
        assert_still_serves(&victim).await;
    });
}

#[test]
fn a_batch_racing_a_revocation_lands_nothing_after_it() {
    isolated(async move {
        const OPS: u64 = 256;
        const LEN: u64 = 64 * 1024;
        let mut sender = default_node((OPS * LEN) as usize).await;
        let receiver = default_node((OPS * LEN) as usize).await;
        let ops: Vec<WriteOp> = (0..OPS)
            .map(|k| WriteOp { src: sender.buf.addr() + k * LEN, dst: receiver.buf.addr() + k * LEN, len: LEN })
            .collect();
        fill(&mut sender.buf, &ops);
        let grant = receiver.grant_all().await;
        let writer = std::sync::Arc::clone(&sender.transport);
        let (endpoint, batch_grant, batch_ops) = (receiver.transport.endpoint(), grant.clone(), ops.clone());
        let batch = tokio::spawn(async move { writer.batch_write(&endpoint, &batch_grant, &batch_ops).await });
        received_at_least(&receiver, 1).await;
        tokio::time::timeout(BOUND, receiver.transport.revoke(&grant.id)).await.expect("revoke hung");
        let at_revoke = receiver.transport.bytes_received();
        // No grant is live: the buffer may be read.
        let snapshot = receiver.buf.bytes().to_vec();
        let result = tokio::time::timeout(BOUND, batch).await.expect("the batch hung").unwrap();
        assert_eq!(receiver.buf.bytes(), &snapshot[..], "memory changed after revoke returned");
        assert_eq!(receiver.transport.bytes_received(), at_revoke);
        if at_revoke < OPS * LEN {
            match result {
                Err(TransportError::Refused { reason, .. }) => assert!(reason.contains("revoked"), "{reason}"),
                other => panic!("a batch cut by its revocation reported {other:?}"),
            }
        } else {
            result.unwrap();
        }
        // Everything that landed, landed where the grant said, with the right bytes.
        let landed = usize::try_from(at_revoke).unwrap();
        let mut expected = vec![0u8; (OPS * LEN) as usize];
        for (k, op) in ops.iter().enumerate() {
            let off = (op.dst - receiver.buf.addr()) as usize;
            for i in 0..LEN as usize {
                expected[off + i] = test_support::pattern::byte(k as u64, i);
            }
        }
        assert_eq!(&snapshot[..landed], &expected[..landed]);
        assert!(snapshot[landed..].iter().all(|&b| b == 0));
        assert_still_serves(&receiver).await;
    });
}
