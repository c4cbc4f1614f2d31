//! Frames altered or injected after the side channel's authenticated
//! handshake: a relay between D and P that lets the handshake through and
//! then flips a byte of one later frame, or sends one twice. Each ends that
//! connection (P closes it, or D drops it) and the pull it carried fails,
//! with nothing written into D's blocks; the same relay passing every byte
//! through changes nothing.
#![cfg(feature = "tcp")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;

use common::{all_zero, fill, holds, metrics_until, pull, ready, shape, start_owned, until, Instance, BOUND};
use kv_proto::{KvRole, Protocol, FRAME_HEADER_LEN};
use kv_worker::{AuthSecret, WorkerConfig};
use rstest::rstest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Bytes of the tag after each frame once the handshake is done.
const TAG_LEN: usize = kv_proto::session::FRAME_TAG_LEN;

/// Which way a frame travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    DecodeToPrefill,
    PrefillToDecode,
}

impl Way {
    /// Frames of this direction sent before the session's tags start: D's
    /// hello and proof; P's challenge.
    fn handshake_frames(self) -> usize {
        match self {
            Way::DecodeToPrefill => 2,
            Way::PrefillToDecode => 1,
        }
    }
}

/// What the relay does to the `nth` frame (from 0) travelling `way`.
#[derive(Clone, Copy, Debug)]
enum Tamper {
    Nothing,
    FlipBody { way: Way, nth: usize },
    FlipTag { way: Way, nth: usize },
    SendTwice { way: Way, nth: usize },
}

/// One direction of the relay ended.
#[derive(Debug)]
struct Seen {
    way: Way,
}

async fn read_frame(from: &mut OwnedReadHalf, tagged: bool) -> Option<Vec<u8>> {
    let mut frame = vec![0u8; FRAME_HEADER_LEN];
    from.read_exact(&mut frame).await.ok()?;
    let len = u32::from_be_bytes(frame[8..12].try_into().unwrap()) as usize;
    let rest = len + if tagged { TAG_LEN } else { 0 };
    frame.resize(FRAME_HEADER_LEN + rest, 0);
    from.read_exact(&mut frame[FRAME_HEADER_LEN..]).await.ok()?;
    Some(frame)
}

/// Forwards frames `way` until either side closes; applies `tamper`.
async fn forward(way: Way, mut from: OwnedReadHalf, mut to: OwnedWriteHalf, tamper: Tamper, seen: mpsc::Sender<Seen>) {
    let mut frames = 0;
    while let Some(mut frame) = read_frame(&mut from, frames >= way.handshake_frames()).await {
        let mut copies = 1;
        match tamper {
            // The body's last byte: the frame still decodes without its tag.
            Tamper::FlipBody { way: w, nth } if w == way && nth == frames => {
                let body_end = frame.len() - if frames >= way.handshake_frames() { TAG_LEN } else { 0 };
                frame[body_end - 1] ^= 0x01;
            }
            Tamper::FlipTag { way: w, nth } if w == way && nth == frames => *frame.last_mut().unwrap() ^= 0x80,
            Tamper::SendTwice { way: w, nth } if w == way && nth == frames => copies = 2,
            _ => {}
        }
        frames += 1;
        for _ in 0..copies {
            if to.write_all(&frame).await.is_err() {
                break;
            }
        }
    }
    // The other side sees this side's end.
    let _ = to.shutdown().await;
    let _ = seen.send(Seen { way }).await;
}

/// A relay in front of `prefill`; every connection made to it is relayed
/// and tampered with alike. Reports each direction's end.
async fn relay(prefill: SocketAddr, tamper: Tamper) -> (SocketAddr, mpsc::Receiver<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen_tx, seen) = mpsc::channel(64);
    tokio::spawn(async move {
        while let Ok((decode, _)) = listener.accept().await {
            let prefill = TcpStream::connect(prefill).await.unwrap();
            let (d_read, d_write) = decode.into_split();
            let (p_read, p_write) = prefill.into_split();
            tokio::spawn(forward(Way::DecodeToPrefill, d_read, p_write, tamper, seen_tx.clone()));
            tokio::spawn(forward(Way::PrefillToDecode, p_read, d_write, tamper, seen_tx.clone()));
        }
    });
    (addr, seen)
}

async fn instance(role: KvRole, name: &str) -> Instance {
    let config = WorkerConfig {
        protocol: Protocol::Tcp,
        auth_secret: Some(AuthSecret::new("shared secret")),
        ..WorkerConfig::loopback(role, name)
    };
    start_owned(config, shape()).await
}

/// How the pull ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pull {
    Moves,
    Fails,
    /// A copy sent after the original is refused after P took the
    /// original, whose reply may or may not make it out first.
    Either,
}

#[rstest]
#[case::relayed_untouched(Tamper::Nothing, Pull::Moves)]
#[case::the_pull_altered(Tamper::FlipBody { way: Way::DecodeToPrefill, nth: 2 }, Pull::Fails)]
#[case::the_pulls_tag_altered(Tamper::FlipTag { way: Way::DecodeToPrefill, nth: 2 }, Pull::Fails)]
#[case::the_pull_sent_twice(Tamper::SendTwice { way: Way::DecodeToPrefill, nth: 2 }, Pull::Either)]
#[case::prefills_acceptance_altered(Tamper::FlipBody { way: Way::PrefillToDecode, nth: 1 }, Pull::Fails)]
#[case::prefills_reply_altered(Tamper::FlipBody { way: Way::PrefillToDecode, nth: 2 }, Pull::Fails)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_altered_after_the_handshake_ends_the_connection(#[case] tamper: Tamper, #[case] pull_ends: Pull) {
    let p = instance(KvRole::Producer, "p").await;
    let d = instance(KvRole::Consumer, "d").await;
    fill(&p.cache, 7, &[0, 1]);
    ready(&p, "r", &[0, 1]);
    let (addr, mut seen) = relay(p.worker.side_channel_addr().unwrap(), tamper).await;
    pull(&d, &addr.ip().to_string(), addr.port(), &[("r", &[5, 6])]);
    let finished = until(&d.worker, |f| !f.receiving.is_empty() || !f.failed_receiving.is_empty()).await;
    if pull_ends == Pull::Moves {
        assert_eq!(finished.receiving.len(), 1, "{finished:?}");
        assert!(holds(&d.cache, 7, &[5, 6]));
    } else {
        if pull_ends == Pull::Fails {
            assert_eq!(finished.failed_receiving.len(), 1, "{finished:?}");
            assert!(finished.receiving.is_empty(), "{finished:?}");
        }
        // An altered pull or acceptance fails before P writes anything. (A
        // reply comes after P wrote, over the data plane, which
        // authenticates itself; a pull sent twice is refused at its copy,
        // after P took the original.)
        if matches!(tamper, Tamper::FlipBody { nth: 1 | 2, way: Way::DecodeToPrefill } | Tamper::FlipTag { .. })
            || matches!(tamper, Tamper::FlipBody { way: Way::PrefillToDecode, nth: 1 })
        {
            assert!(all_zero(&d.cache, &[5, 6]), "bytes landed in D's blocks after {tamper:?}");
        }
        // The tampered connection is closed: both directions of the relay
        // end (D's second connection, if it made one, ends its own way).
        let both = |ends: &[Seen]| {
            ends.iter().any(|s| s.way == Way::DecodeToPrefill) && ends.iter().any(|s| s.way == Way::PrefillToDecode)
        };
        tokio::time::timeout(BOUND, async {
            let mut ends = Vec::new();
            while !both(&ends) {
                ends.push(seen.recv().await.unwrap());
            }
        })
        .await
        .expect("the tampered connection stayed open");
    }
    // The side that read the tampered frame counts a tag failure for each
    // connection it was altered on (a frame altered on the path, not a peer
    // that failed authentication). D's connection was opened before the
    // pull, to learn P's topology, so D sends a pull whose connection was
    // lost once more on a new one, which the relay alters alike.
    let reader = match tamper {
        Tamper::Nothing => None,
        Tamper::FlipBody { way, .. } | Tamper::FlipTag { way, .. } | Tamper::SendTwice { way, .. } => Some(way),
    };
    let (on_p, on_d) = match reader {
        Some(Way::DecodeToPrefill) => {
            (metrics_until(&p.worker, |m| m.tag_failures.side_channel >= 1).await, d.worker.metrics())
        }
        Some(Way::PrefillToDecode) => {
            (p.worker.metrics(), metrics_until(&d.worker, |m| m.tag_failures.side_channel >= 1).await)
        }
        None => (p.worker.metrics(), d.worker.metrics()),
    };
    let counted = |way| if reader == Some(way) { 1..=2 } else { 0..=0 };
    assert!(counted(Way::DecodeToPrefill).contains(&on_p.tag_failures.side_channel), "{tamper:?}: {on_p:?}");
    assert!(counted(Way::PrefillToDecode).contains(&on_d.tag_failures.side_channel), "{tamper:?}: {on_d:?}");
    assert_eq!((on_p.auth_failures, on_d.auth_failures), (0, 0), "{tamper:?}");
    assert_eq!((on_p.tag_failures.data_plane, on_d.tag_failures.data_plane), (0, 0), "{tamper:?}");
    p.worker.shutdown().await;
    d.worker.shutdown().await;
}
