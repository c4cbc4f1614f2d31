//! One budget for the op lists all incoming connections hold
//! (`test_support::listener::op_budget`): TCP connections that keep
//! announcing op lists as large as the whole budget, each batch on a new
//! connection, stay within it while an honest batch completes.
//!
//! One test in this binary: it measures the process's heap and descriptors,
//! which concurrent tests would disturb.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{node, Node, RawClient, Tcp};
use kv_proto::dataplane::ReplyStatus;
use kv_proto::GrantId;
use test_support::listener::op_budget::{huge_op_lists_stay_within_one_budget, OpBudget, ANNOUNCED, ATTACKERS, BUDGET};
use tokio::io::AsyncWriteExt;
use transport_tcp::wire::{BatchHeader, OP_LEN};
use transport_tcp::{OpListLimits, TcpConfig};

/// A hostile peer: where to connect, and what to send.
pub struct Attacker {
    victim: SocketAddr,
    chunk: Arc<[u8]>,
}

impl OpBudget for Tcp {
    type Attacker = Attacker;

    const GIVES_BACK_BEFORE_REPLYING: bool = false;

    async fn victim(&self, len: usize) -> Node {
        let config = TcpConfig {
            op_lists: OpListLimits {
                unauthenticated_budget: BUDGET,
                timeout: Duration::from_secs(5),
                ..OpListLimits::default()
            },
            io_timeout: Duration::from_secs(10),
            ..TcpConfig::default()
        };
        node(config, len).await
    }

    fn budget_used_and_peak(victim: &Node) -> (u64, u64) {
        let budget = victim.transport.op_list_budget();
        (budget.used(), budget.peak())
    }

    async fn attackers(&self, victim: &Node, chunk: Vec<u8>) -> Vec<Attacker> {
        let chunk: Arc<[u8]> = chunk.into();
        (0..ATTACKERS).map(|_| Attacker { victim: victim.transport.local_addr(), chunk: Arc::clone(&chunk) }).collect()
    }

    /// Each batch on a new connection.
    async fn attack(attacker: &mut Attacker, grant: GrantId) -> Option<(ReplyStatus, String)> {
        let (mut client, accept) = RawClient::handshaken_to(attacker.victim).await;
        assert_eq!(accept.max_ops_per_batch, ANNOUNCED, "the bound in force is what the budget holds");
        let header =
            BatchHeader { batch_id: 1, flags: 0, reserved: 0, op_count: ANNOUNCED, total_bytes: ANNOUNCED, grant };
        client.send(&header.encode()).await;
        // The op list, then the payload (any bytes): 17 chunks of 1 MiB.
        let mut left = (ANNOUNCED as usize * OP_LEN) + ANNOUNCED as usize;
        while left > 0 {
            let n = left.min(attacker.chunk.len());
            client.stream.write_all(&attacker.chunk[..n]).await.unwrap();
            left -= n;
        }
        let (reply, reason) = client.reply().await;
        Some((reply.status, reason))
    }
}

#[test]
fn connections_announcing_huge_op_lists_stay_within_one_budget() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(huge_op_lists_stay_within_one_budget(Tcp));
}
