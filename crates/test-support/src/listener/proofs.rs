//! Failed proofs of the shared secret, counted (`auth_failures`) by the
//! side that saw them: a receiver counts a peer whose proof does not
//! verify (not one that left before proving), a sender counts a receiver
//! that fails its own proof; honest peers add nothing.

use std::future::Future;

use kv_proto::{BatchWriter, WriteOp};

use super::{Listener, BOUND, SECRET};
use crate::stats::{expected, reaches};
use crate::Node;

/// What the proof cases need of a transport besides [`Listener`]: a raw
/// peer that speaks its handshake by hand.
pub trait Proofs: Listener {
    /// What a sender's error says when the receiver's proof does not verify.
    const RECEIVER_PROOF_FAILED: &'static str;

    /// A raw peer announces the secret to `receiver`, reads its challenge,
    /// then ends its side where the proof belongs; returns once the
    /// receiver closed the connection (so it is done with it).
    fn leave_before_proving(&self, receiver: &Node<Self::Transport>) -> impl Future<Output = ()>;

    /// A raw peer proves a secret other than [`SECRET`] to `receiver`;
    /// returns once the receiver refused it on the wire.
    fn prove_a_wrong_secret(&self, receiver: &Node<Self::Transport>) -> impl Future<Output = ()>;
}

/// A peer that goes away before its proof is no failed authentication; one
/// that proves another secret is, once; an honest sender adds nothing.
pub async fn a_wrong_proof_is_counted_on_the_receiver(listener: impl Proofs) {
    let rx = listener.node(Some(SECRET), 1 << 16).await;

    listener.leave_before_proving(&rx).await;
    assert_eq!(rx.transport.stats(), expected(0, &[], 0), "a peer gone mid-handshake is no failed proof");

    listener.prove_a_wrong_secret(&rx).await;
    reaches(&rx.transport, &expected(0, &[], 1), BOUND).await;

    let mut tx = listener.node(Some(SECRET), 1 << 16).await;
    tx.buf.bytes_mut()[..4].fill(9);
    let grant = rx.grant_all().await;
    let ops = [WriteOp { src: tx.buf.addr(), dst: rx.buf.addr(), len: 4 }];
    tx.transport.batch_write(&rx.transport.endpoint(), &grant, &ops).await.unwrap();
    rx.transport.revoke(&grant.id).await;
    assert_eq!(rx.transport.stats(), expected(0, &[], 1));
    assert_eq!(tx.transport.stats(), expected(0, &[], 0));
}

/// A sender holding another secret finds the receiver's proof wrong (the
/// receiver proves first): the sender counts it, and sends no proof.
pub async fn a_receiver_failing_its_proof_is_counted_on_the_sender<L: Proofs>(listener: L) {
    let rx = listener.node(Some(SECRET), 1 << 16).await;
    let tx = listener.node(Some("guess"), 1 << 16).await;
    let grant = rx.grant_all().await;
    let ops = [WriteOp { src: tx.buf.addr(), dst: rx.buf.addr(), len: 4 }];
    let err = tx.transport.batch_write(&rx.transport.endpoint(), &grant, &ops).await.unwrap_err();
    assert!(err.to_string().contains(L::RECEIVER_PROOF_FAILED), "{err}");
    assert_eq!(tx.transport.stats(), expected(0, &[], 1));
    rx.transport.revoke(&grant.id).await;
    assert!(rx.buf.is_zero());
}

/// The proof cases against the [`Proofs`] `$listener` evaluates to (once per
/// test), in a module `proofs`.
///
/// ```ignore
/// test_support::proofs_suite!(Tcp);
/// ```
#[macro_export]
macro_rules! proofs_suite {
    ($listener:expr) => {
        /// Failed proofs counted (`test_support::listener::proofs`), one
        /// test per case.
        mod proofs {
            #[allow(unused_imports)]
            use super::*;
            use $crate::listener::proofs as case;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_wrong_proof_is_counted_on_the_receiver() {
                case::a_wrong_proof_is_counted_on_the_receiver($listener).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_receiver_failing_its_proof_is_counted_on_the_sender() {
                case::a_receiver_failing_its_proof_is_counted_on_the_sender($listener).await;
            }
        }
    };
}
