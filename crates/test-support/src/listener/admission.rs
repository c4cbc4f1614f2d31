//! Admission of incoming connections: a connection in its handshake holds
//! a handshake place (bounded in total and per source host), and takes an
//! established place only once its handshake (and proof of the secret)
//! succeeded. Peers that never finish a handshake cannot crowd out an
//! honest, authenticated sender, one host cannot take every handshake
//! place, and a peer past the established limit is told why it is closed.
//! Hostile connections come from [`HOSTILE`](super::HOSTILE), honest senders from
//! 127.0.0.1.

use std::future::Future;

use kv_net::ListenerLimits;
use kv_proto::{BatchWriter, TransportError, WriteOp};

use super::{honest_batch, Listener, BOUND};
use crate::{pattern, Node};

/// How a hostile connection holds its handshake place.
#[derive(Clone, Copy, Debug)]
pub enum Stall {
    /// Opens a connection and never starts the kvlink handshake (no
    /// secret configured).
    Silent,
    /// Announces the secret, reads the challenge, never proves it.
    NeverProves,
}

impl Stall {
    /// The secret the victim holds for this stall.
    pub fn secret(self) -> Option<&'static str> {
        match self {
            Stall::Silent => None,
            Stall::NeverProves => Some(super::SECRET),
        }
    }
}

/// The listener limits a case sets; `None` keeps the transport's default.
#[derive(Clone, Copy, Debug, Default)]
pub struct Places {
    /// Established connections at once.
    pub connections: Option<usize>,
    /// Handshake places one source host may hold.
    pub handshakes_per_host: Option<usize>,
}

/// How long the admission cases' listeners hold a stalled handshake: far
/// past any case, so every place a stall takes stays taken while it runs.
pub const STALL_HELD: std::time::Duration = std::time::Duration::from_secs(120);

impl Places {
    /// The listener limits of a case: the defaults, with what it sets,
    /// holding a handshake for [`STALL_HELD`].
    pub fn limits(self) -> ListenerLimits {
        let defaults = ListenerLimits::default();
        ListenerLimits {
            max_connections: self.connections.unwrap_or(defaults.max_connections),
            max_handshakes_per_host: self.handshakes_per_host.unwrap_or(defaults.max_handshakes_per_host),
            handshake_timeout: STALL_HELD,
            ..defaults
        }
    }
}

/// What the admission cases need of a transport besides [`Listener`]: raw
/// connections that speak its wire by hand.
pub trait Admission: Listener {
    /// A hostile connection holding its handshake place, until dropped.
    type Held;

    /// A receiver holding `secret`, limited to `places`, which lets a
    /// handshake run longer than any case (so a stalled one ends only
    /// when the case drops it, or the receiver refuses it).
    fn victim(&self, places: Places, secret: Option<&str>) -> impl Future<Output = Node<Self::Transport>>;

    /// A connection from [`HOSTILE`](super::HOSTILE) stalled as `stall` says; once this
    /// returns, the receiver has accepted it.
    fn stall(&self, victim: &Node<Self::Transport>, stall: Stall) -> impl Future<Output = Self::Held>;

    /// One more connection from [`HOSTILE`](super::HOSTILE) is refused at once, unanswered.
    fn assert_refused_at_accept(&self, victim: &Node<Self::Transport>) -> impl Future<Output = ()>;

    /// A raw peer (proving `secret`, if any) that completes its handshake
    /// while every established place is taken is told on the wire that the
    /// receiver is busy, then closed.
    fn assert_told_busy(&self, victim: &Node<Self::Transport>, secret: Option<&str>) -> impl Future<Output = ()>;
}

/// As many stalled handshakes as the receiver has established places (so
/// one pool for both would be full), from one host up to its share: an
/// honest sender still connects, proves the secret and writes its batch.
pub async fn stalled_handshakes_do_not_crowd_out_an_honest_sender(listener: impl Admission, stall: Stall) {
    const PLACES: usize = 4;
    let places = Places { connections: Some(PLACES), handshakes_per_host: Some(PLACES) };
    let victim = listener.victim(places, stall.secret()).await;
    let mut stalled = Vec::new();
    for _ in 0..PLACES {
        stalled.push(listener.stall(&victim, stall).await);
    }
    // One more from that host is refused at once: every place before it
    // was taken.
    listener.assert_refused_at_accept(&victim).await;
    honest_batch(&listener, &victim, stall.secret()).await.expect("the honest sender was refused");
    drop(stalled);
}

/// A host over its share of handshake places is refused at accept, while
/// another host is still served.
pub async fn a_host_over_its_handshake_share_is_refused_while_others_are_served(listener: impl Admission) {
    let victim = listener.victim(Places { handshakes_per_host: Some(2), ..Places::default() }, None).await;
    let held = [listener.stall(&victim, Stall::Silent).await, listener.stall(&victim, Stall::Silent).await];
    listener.assert_refused_at_accept(&victim).await;
    honest_batch(&listener, &victim, None).await.expect("another host was refused");
    drop(held);
}

/// A peer that finished its handshake when every established place is
/// taken is told so, then closed; the established connection goes on.
pub async fn a_peer_past_the_connection_limit_is_told_why(listener: impl Admission, secret: Option<&str>) {
    let victim = listener.victim(Places { connections: Some(1), ..Places::default() }, secret).await;
    // A sender whose connection holds the one place, writing away from
    // where the refused sender would.
    let mut first = listener.node(secret, 1 << 16).await;
    let ops: Vec<WriteOp> = (0..2)
        .map(|k| WriteOp { src: first.buf.at(k * 512), dst: victim.buf.at(32 * 1024 + k * 512), len: 512 })
        .collect();
    pattern::fill(&mut first.buf, &ops);
    let grant = victim.grant_for(&ops).await;
    first.transport.batch_write(&victim.transport.endpoint(), &grant, &ops).await.unwrap();

    let refused = honest_batch(&listener, &victim, secret).await.expect_err("a second connection was served");
    assert!(matches!(refused, TransportError::Connect { .. }), "{refused:?}");
    assert!(refused.to_string().contains("max_connections"), "{refused}");

    listener.assert_told_busy(&victim, secret).await;

    // The established connection still carries batches.
    let endpoint = victim.transport.endpoint();
    let again = tokio::time::timeout(BOUND, first.transport.batch_write(&endpoint, &grant, &ops));
    again.await.expect("the established connection hung").unwrap();
    victim.transport.revoke(&grant.id).await;
    pattern::check(&victim.buf, &ops);
}

/// The admission cases against the [`Admission`] `$listener` evaluates to
/// (once per test), in a module `admission`, each test `isolated`. The
/// calling crate needs `rstest` as a dev-dependency.
///
/// ```ignore
/// test_support::admission_suite!(Tcp);
/// ```
#[macro_export]
macro_rules! admission_suite {
    ($listener:expr) => {
        /// Admission of incoming connections
        /// (`test_support::listener::admission`), one test per case.
        mod admission {
            #[allow(unused_imports)]
            use super::*;
            use $crate::listener::admission::{self as case, Stall};

            #[rstest::rstest]
            fn stalled_handshakes_do_not_crowd_out_an_honest_sender(
                #[values(Stall::Silent, Stall::NeverProves)] stall: Stall,
            ) {
                let test = case::stalled_handshakes_do_not_crowd_out_an_honest_sender($listener, stall);
                $crate::isolated(test, $crate::listener::BOUND);
            }

            #[test]
            fn a_host_over_its_handshake_share_is_refused_while_others_are_served() {
                let test = case::a_host_over_its_handshake_share_is_refused_while_others_are_served($listener);
                $crate::isolated(test, $crate::listener::BOUND);
            }

            #[rstest::rstest]
            #[case::without_a_secret(None)]
            #[case::with_a_secret(Some($crate::listener::SECRET))]
            fn a_peer_past_the_connection_limit_is_told_why(#[case] secret: Option<&str>) {
                let test = case::a_peer_past_the_connection_limit_is_told_why($listener, secret);
                $crate::isolated(test, $crate::listener::BOUND);
            }
        }
    };
}
