//! Why a pull failed, as one of a fixed set of causes: what P tells D in a
//! failed [`crate::Outcome`], what D's worker decides for its own failures,
//! and the label both count failures under.
//!
//! On the wire a cause is a `u16`; a code this build does not know (a newer
//! peer) reads as [`FailureCause::Other`], never as a decode error.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! causes {
    ($($(#[$doc:meta])* $name:ident = $code:literal, $label:literal;)*) => {
        /// Why the KV of a request did not (entirely) reach D.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(from = "u16", into = "u16")]
        pub enum FailureCause {
            $($(#[$doc])* $name,)*
        }

        impl FailureCause {
            /// Every cause, in code order.
            pub const ALL: &'static [FailureCause] = &[$(FailureCause::$name,)*];

            /// The label metrics and logs use (`snake_case`, stable).
            pub fn as_str(self) -> &'static str {
                match self { $(FailureCause::$name => $label,)* }
            }

            /// Its code on the wire.
            pub fn code(self) -> u16 {
                match self { $(FailureCause::$name => $code,)* }
            }

            /// The cause a code names; unknown codes are [`FailureCause::Other`].
            pub fn from_code(code: u16) -> Self {
                match code { $($code => FailureCause::$name,)* _ => FailureCause::Other }
            }
        }
    };
}

causes! {
    /// Anything not listed (also a code from a newer peer).
    Other = 0, "other";
    /// P has no entry for the request: never scheduled there, aborted, or
    /// already sent.
    UnknownRequest = 1, "unknown_request";
    /// P's lease on the request ended before the pull came; its blocks were freed.
    LeaseEnded = 2, "lease_ended";
    /// Another pull is already transferring the request.
    AlreadyInFlight = 3, "already_in_flight";
    /// The request did not finish prefill within the bound P waits for it.
    NotReady = 4, "not_ready";
    /// No reply within D's transfer timeout (or the wait budget passed
    /// before P wrote).
    Timeout = 5, "timeout";
    /// P refused the transfer request or named another prefill engine.
    PeerRefused = 6, "peer_refused";
    /// P and D disagree on the transport or the cache layout.
    IncompatiblePeer = 7, "incompatible_peer";
    /// The shared secret did not match (either side), or a frame failed its tag.
    AuthFailed = 8, "auth_failed";
    /// The side-channel connection could not be made or ended before the reply.
    ConnectionLost = 9, "connection_lost";
    /// D could not issue the grant, or D's data plane refused P's writes.
    GrantRefused = 10, "grant_refused";
    /// P's writes failed on the data plane (other than a refused grant).
    WriteFailed = 11, "write_failed";
    /// D's and P's block lists cannot be mapped onto each other.
    PlanFailed = 12, "plan_failed";
    /// No staging memory was free within the bound.
    StagingExhausted = 13, "staging_exhausted";
    /// A worker on either side was shutting down.
    Shutdown = 14, "shutdown";
    /// Two requests of one step named the same prefill request.
    DuplicateRequest = 15, "duplicate_request";
    /// A copy between the engine's (device) blocks and host staging failed.
    CopyFailed = 16, "copy_failed";
    /// P's engine never saw the request while D's pull waited for it (the
    /// bootstrap flow, where D may ask first: the router's prefill leg
    /// failed or never came).
    PrefillNeverSeen = 17, "prefill_never_seen";
}

impl From<u16> for FailureCause {
    fn from(code: u16) -> Self {
        FailureCause::from_code(code)
    }
}

impl From<FailureCause> for u16 {
    fn from(cause: FailureCause) -> Self {
        cause.code()
    }
}

impl fmt::Display for FailureCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_labels_are_unique_and_round_trip() {
        let mut codes = std::collections::BTreeSet::new();
        let mut labels = std::collections::BTreeSet::new();
        for &cause in FailureCause::ALL {
            assert!(codes.insert(cause.code()), "{cause:?}");
            assert!(labels.insert(cause.as_str()), "{cause:?}");
            assert_eq!(FailureCause::from_code(cause.code()), cause);
        }
        assert_eq!(FailureCause::from_code(u16::MAX), FailureCause::Other);
    }

    #[test]
    fn an_unknown_code_decodes_as_other() {
        let mut bytes = Vec::new();
        assert!(crate::codec::encode_into(&999u16, &mut bytes).is_ok());
        let cause: Result<FailureCause, _> = crate::codec::decode(&bytes);
        assert_eq!(cause.ok(), Some(FailureCause::Other));
    }
}
