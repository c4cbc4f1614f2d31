//! The transport conformance suite: the contract every `BatchWriter` keeps,
//! one public function per case, run by each backend's own tests against
//! that backend (kv-worker's in-memory reference writer, TCP, QUIC, RDMA).
//!
//! A backend implements [`Backend`] (it makes writers that reach each
//! other) in its crate's `tests/conformance.rs` and calls
//! [`conformance_suite!`](crate::conformance_suite), which makes one test
//! per case (one per value of a case's parameters): a case added here runs
//! for every backend, and none can be left out.
//!
//! Buffers are real allocations registered with the writers; every byte
//! that should land is checked against a per-op pattern, and every byte that
//! must not land is checked untouched.
//!
//! The grant contract: a peer writes only inside a live grant the receiver
//! issued; a batch for an unknown, expired or revoked grant, or with an op
//! outside it (a source region included), is refused whole; `revoke` is a
//! fence; a writer that registered only sources accepts no write at all.

mod cases;
mod harness;

pub use cases::*;
pub use harness::{
    assert_dead_peer_error, packed_ops, write_and_check, Backend, Harness, Network, Peer, CONNECT_TIMEOUT, GRANT_TTL,
    IO_TIMEOUT, NETWORK_FAILURE_BOUND,
};

/// One test per conformance case (and per value of its parameters) against
/// the backend `$backend` evaluates to (an expression of a type that
/// implements [`Backend`](crate::conformance::Backend), evaluated once per
/// test), in a module `contract`. The calling crate needs `tokio` (with
/// the multi-threaded runtime) and `rstest` as dev-dependencies.
///
/// ```ignore
/// test_support::conformance_suite!(TcpBackend);
/// ```
#[macro_export]
macro_rules! conformance_suite {
    (@each $backend:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                case::$case($backend).await;
            }
        )*
    };
    ($backend:expr) => {
        /// The `BatchWriter` contract (`test_support::conformance`), one
        /// test per case.
        mod contract {
            #[allow(unused_imports)]
            use super::*;
            use $crate::conformance::{self as case, BadDst, Gone, NoGrant, OutsideGrant};

            $crate::conformance_suite!(@each $backend;
                endpoint_names_the_writers_protocol,
                grants_live_follows_grant_and_revoke,
                single_op,
                many_ops,
                scattered_ops,
                zero_length_ops_and_empty_batch,
                huge_batch_of_small_ops,
                large_ops,
                source_out_of_range_is_refused,
                wrong_protocol_and_bad_address_are_refused,
                overlapping_regions_are_refused,
                a_shut_down_writer_refuses_work,
                concurrent_batches_to_one_peer,
                concurrent_peers_into_one_receiver,
                a_sender_only_writer_accepts_no_writes,
                an_honest_peer_is_unaffected_by_a_hostile_one,
                revoke_is_a_fence,
                close_ends_every_grant,
                overlapping_writes_in_one_batch_are_refused_whole,
            );

            #[rstest::rstest]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn destination_out_of_range_is_refused_whole(
                #[values(BadDst::PastEnd, BadDst::StraddlesEnd, BadDst::StraddlesStart, BadDst::Overflows, BadDst::Unregistered)]
                bad: BadDst,
            ) {
                case::destination_out_of_range_is_refused_whole($backend, bad).await;
            }

            #[rstest::rstest]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn writing_to_a_gone_peer_fails_within_the_bound(#[values(Gone::ShutDown, Gone::Dropped)] gone: Gone) {
                case::writing_to_a_gone_peer_fails_within_the_bound($backend, gone).await;
            }

            #[rstest::rstest]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_without_a_live_grant_is_refused_whole(
                #[values(NoGrant::Forged, NoGrant::Revoked, NoGrant::Expired, NoGrant::Elsewhere)] how: NoGrant,
            ) {
                case::a_batch_without_a_live_grant_is_refused_whole($backend, how).await;
            }

            #[rstest::rstest]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_op_outside_the_grant_is_refused_whole(
                #[values(OutsideGrant::UngrantedDestination, OutsideGrant::SourceRegion, OutsideGrant::PastTheGrant)]
                outside: OutsideGrant,
                #[values(64 * 1024, 32 << 20)] batch_bytes: usize,
            ) {
                case::an_op_outside_the_grant_is_refused_whole($backend, outside, batch_bytes).await;
            }
        }
    };
}
