//! One budget for the op lists all incoming streams hold
//! (`test_support::listener::op_budget`): QUIC connections that keep
//! announcing op lists as large as the whole budget, each batch on a new
//! stream of the same connection, stay within it while an honest batch
//! completes.
//!
//! One test in this binary: it measures the process's heap and descriptors,
//! which concurrent tests would disturb.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{node, reply, Node, Quic, RawClient};
use kv_proto::dataplane::{ReplyStatus, OP_LEN};
use kv_proto::{BatchWriter, GrantId};
use test_support::listener::op_budget::{huge_op_lists_stay_within_one_budget, OpBudget, ANNOUNCED, ATTACKERS, BUDGET};
use transport_quic::wire::BatchHeader;
use transport_quic::{EndpointDetails, OpListLimits, QuicConfig};

/// A hostile peer: its connection, and what it sends (quinn keeps
/// references to the chunk, no copies).
pub struct Attacker {
    client: RawClient,
    chunk: Bytes,
}

impl OpBudget for Quic {
    type Attacker = Attacker;

    const GIVES_BACK_BEFORE_REPLYING: bool = true;

    async fn victim(&self, len: usize) -> Node {
        let config = QuicConfig {
            op_lists: OpListLimits {
                unauthenticated_budget: BUDGET,
                timeout: Duration::from_secs(5),
                ..OpListLimits::default()
            },
            io_timeout: Duration::from_secs(10),
            stream_receive_window: 1 << 20,
            receive_window: 4 << 20,
            // Attackers vanish without closing their connections: the receiver
            // keeps a connection's state until this idle timeout.
            idle_timeout: Duration::from_secs(1),
            ..QuicConfig::default()
        };
        node(config, len).await
    }

    fn budget_used_and_peak(victim: &Node) -> (u64, u64) {
        let budget = victim.transport.op_list_budget();
        (budget.used(), budget.peak())
    }

    /// Connected before the attack, each batch on a new stream.
    async fn attackers(&self, victim: &Node, chunk: Vec<u8>) -> Vec<Attacker> {
        let details = EndpointDetails::decode(&victim.transport.endpoint().details).unwrap();
        assert_eq!(details.max_ops_per_batch, ANNOUNCED, "the bound in force is what the budget holds");
        let chunk = Bytes::from(chunk);
        let mut attackers = Vec::new();
        for _ in 0..ATTACKERS {
            attackers.push(Attacker { client: RawClient::connect(victim).await, chunk: chunk.clone() });
        }
        attackers
    }

    /// `None` also where the receiver timed the connection out: on a loaded
    /// machine its idle bound can pass while the attacker waits for the
    /// budget.
    async fn attack(attacker: &mut Attacker, grant: GrantId) -> Option<(ReplyStatus, String)> {
        let (mut send, mut recv) = attacker.client.try_stream().await?;
        let header = BatchHeader { grant, op_count: ANNOUNCED, total_bytes: ANNOUNCED };
        send.write_all(&header.encode()).await.unwrap();
        // The op list, then the payload (any bytes): 17 chunks of 1 MiB.
        let mut left = (ANNOUNCED as usize * OP_LEN) + ANNOUNCED as usize;
        // The receiver may stop the stream (a refusal) before all of it is sent.
        while left > 0 {
            let n = left.min(attacker.chunk.len());
            if send.write_chunk(attacker.chunk.slice(..n)).await.is_err() {
                break;
            }
            left -= n;
        }
        if left == 0 {
            let _ = send.finish();
        }
        match reply(&mut recv).await {
            Ok(verdict) => Some(verdict),
            Err(quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(_))) => None,
            Err(error) => panic!("attack: {error}"),
        }
    }
}

#[test]
fn streams_announcing_huge_op_lists_stay_within_one_budget() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(huge_op_lists_stay_within_one_budget(Quic));
}
