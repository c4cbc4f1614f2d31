//! One budget for the op lists all incoming connections hold: connections
//! that keep announcing op lists as large as the whole budget (under a live
//! grant) and sending them keep the receiver's op-list memory (and the
//! process's live heap) within the budget, each gets a refusal naming the
//! reason, and an honest sender's 100,000-op batch completes meanwhile.
//!
//! One test in this binary: it measures the process's heap and descriptors,
//! which concurrent tests would disturb.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{default_node, node, RawClient, BOUND};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::{BatchWriter, WriteOp};
use test_support::pattern::{check, fill};
use test_support::Resources;
use test_support::{peak_heap_growth, peak_rss_growth, reset_peak_heap, reset_peak_rss};
use tokio::io::AsyncWriteExt;
use transport_tcp::wire::{encode_op, BatchHeader, OP_LEN};
use transport_tcp::{OpListLimits, TcpConfig};

/// The receiver's op-list budget (no secret: every peer is unauthenticated).
const BUDGET: u64 = 16 << 20;
/// Hostile connections, each announcing (and sending) an op list as large
/// as the whole budget: without it they would hold eight times the budget.
const ATTACKERS: usize = 8;
const ANNOUNCED: u64 = BUDGET / OP_LEN as u64;
/// The honest batch: 100,000 ops of 64 bytes.
const HONEST_OPS: usize = 100_000;
const HONEST_LEN: usize = 64;
/// Live heap the test may add beyond the budget while the attack runs: the
/// honest batch's op list on both sides (100,000 ops, 2.4 MB decoded, as
/// much again while a list grows by doubling), the connections' buffers
/// (with QUIC, each stream's receive window). Measured at 8–14 MiB. Without
/// the budget the attack alone adds eight times the budget (128 MiB).
const HEAP_SLACK: u64 = 32 << 20;

fn victim_config() -> TcpConfig {
    TcpConfig {
        op_lists: OpListLimits {
            unauthenticated_budget: BUDGET,
            timeout: Duration::from_secs(5),
            ..OpListLimits::default()
        },
        io_timeout: Duration::from_secs(10),
        ..TcpConfig::default()
    }
}

/// One hostile batch on a new connection: announces `ANNOUNCED` ops (out
/// of every region, under a live grant) and sends all of them and the
/// payload (`chunk` over and over, so the attackers themselves hold
/// little); returns the receiver's verdict.
async fn attack(victim: std::net::SocketAddr, grant: kv_proto::GrantId, chunk: &[u8]) -> (ReplyStatus, String) {
    let (mut client, accept) = RawClient::handshaken_to(victim).await;
    assert_eq!(accept.max_ops_per_batch, ANNOUNCED, "the bound in force is what the budget holds");
    let header = BatchHeader { batch_id: 1, flags: 0, reserved: 0, op_count: ANNOUNCED, total_bytes: ANNOUNCED, grant };
    client.send(&header.encode()).await;
    // The op list, then the payload (any bytes): 17 chunks of 1 MiB.
    let mut left = (ANNOUNCED as usize * OP_LEN) + ANNOUNCED as usize;
    while left > 0 {
        let n = left.min(chunk.len());
        client.stream.write_all(&chunk[..n]).await.unwrap();
        left -= n;
    }
    let (reply, reason) = client.reply().await;
    (reply.status, reason)
}

#[test]
fn connections_announcing_huge_op_lists_stay_within_one_budget() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let before = Resources::now();
        let mut victim = node(victim_config(), HONEST_OPS * HONEST_LEN).await;
        // Resident from the start (the honest batch lands there), so it
        // does not count as growth. No grant is live yet.
        victim.buf.bytes_mut().fill(0);
        let mut sender = default_node(HONEST_OPS * HONEST_LEN).await;
        let grant = victim.grant_all().await;
        let ops: Vec<WriteOp> = (0..HONEST_OPS as u64)
            .map(|k| WriteOp {
                src: sender.buf.addr() + k * HONEST_LEN as u64,
                dst: victim.buf.addr() + k * HONEST_LEN as u64,
                len: HONEST_LEN as u64,
            })
            .collect();
        fill(&mut sender.buf, &ops);
        let with_nodes = Resources::now();
        let rss_from = reset_peak_rss();
        let heap_from = reset_peak_heap();

        let addr = victim.transport.local_addr();
        // Each attacker repeats its batch until the honest one is done.
        let stop = Arc::new(AtomicBool::new(false));
        let chunk: Arc<[u8]> = (0..64 * 1024).flat_map(|_| encode_op(0x1000, 1)).collect();
        let attackers: Vec<_> = (0..ATTACKERS)
            .map(|_| {
                let (stop, chunk) = (Arc::clone(&stop), Arc::clone(&chunk));
                tokio::spawn(async move {
                    let mut verdicts = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        verdicts.push(attack(addr, grant.id, &chunk).await);
                    }
                    verdicts
                })
            })
            .collect();
        // The attack holds the budget before the honest batch starts.
        let deadline = tokio::time::Instant::now() + BOUND;
        while victim.transport.op_list_budget().used() < BUDGET / 2 {
            assert!(tokio::time::Instant::now() < deadline, "the attack never filled the budget");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let honest =
            tokio::time::timeout(BOUND, sender.transport.batch_write(&victim.transport.endpoint(), &grant, &ops))
                .await
                .expect("the honest batch hung");
        honest.expect("the honest batch failed");
        stop.store(true, Ordering::Relaxed);
        let mut attacks = 0;
        for attacker in attackers {
            let verdicts = tokio::time::timeout(BOUND, attacker).await.expect("an attacker hung").unwrap();
            for (status, reason) in &verdicts {
                assert_eq!(*status, ReplyStatus::Refused, "{reason}");
                assert!(reason.contains("no room") || reason.contains("outside"), "{reason}");
            }
            attacks += verdicts.len();
        }
        let peak = victim.transport.op_list_budget().peak();
        let grown = peak_heap_growth(heap_from);
        let resident = peak_rss_growth(rss_from);
        eprintln!(
            "{attacks} batches on {ATTACKERS} connections at once, each announcing {} MiB of op list: op lists \
             peaked at {} MiB (budget {} MiB), live heap grew by at most {} MiB, resident memory by {} MiB",
            (ANNOUNCED * OP_LEN as u64) >> 20,
            peak >> 20,
            BUDGET >> 20,
            grown >> 20,
            resident >> 20
        );
        assert!(peak <= BUDGET, "op lists held {peak} bytes, the budget is {BUDGET}");
        assert!(grown <= BUDGET + HEAP_SLACK, "live heap grew by {grown} bytes under a {BUDGET}-byte budget");
        // Every share is given back (the last one just after its reply).
        let deadline = tokio::time::Instant::now() + BOUND;
        while victim.transport.op_list_budget().used() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} bytes still charged",
                victim.transport.op_list_budget().used()
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        victim.transport.revoke(&grant.id).await;
        check(&victim.buf, &ops);

        drop(sender);
        with_nodes.back("after the attack", BOUND).await;
        drop((victim, ops));
        before.back("after the nodes", BOUND).await;
    });
}
