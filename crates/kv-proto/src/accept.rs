//! The accept status a data plane's receiver answers an opening with: one
//! enum and one code table for every wire that has one (TCP's accept reply,
//! RDMA's control opening), so a code means the same on each.

/// The receiver's answer to a sender's opening (a `u16` on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcceptStatus {
    /// The connection is accepted; authentication or batches may follow.
    Accepted,
    /// The receiver does not speak the sender's version; it closes.
    UnsupportedVersion,
    /// The sender asked for flags the receiver does not know; it closes.
    UnsupportedFlags,
    /// The receiver requires the shared secret and the sender did not
    /// announce it; it closes.
    AuthRequired,
    /// The sender announced the shared secret but the receiver has none; it
    /// closes (a sender with a secret writes only to authenticated peers).
    AuthUnavailable,
    /// The receiver serves its most connections already; it closes.
    Busy,
    /// The receiver requires tagged payloads and the sender did not
    /// announce them; it closes (TCP only: no other wire sends it).
    PayloadAuthRequired,
    /// A status this build does not know.
    Unknown(u16),
}

impl AcceptStatus {
    /// The status code on the wire.
    pub fn code(self) -> u16 {
        match self {
            AcceptStatus::Accepted => 0,
            AcceptStatus::UnsupportedVersion => 1,
            AcceptStatus::UnsupportedFlags => 2,
            AcceptStatus::AuthRequired => 3,
            AcceptStatus::AuthUnavailable => 4,
            AcceptStatus::Busy => 5,
            AcceptStatus::PayloadAuthRequired => 6,
            AcceptStatus::Unknown(code) => code,
        }
    }

    /// The status of a wire code (peer input: every code has one).
    pub fn from_code(code: u16) -> Self {
        match code {
            0 => AcceptStatus::Accepted,
            1 => AcceptStatus::UnsupportedVersion,
            2 => AcceptStatus::UnsupportedFlags,
            3 => AcceptStatus::AuthRequired,
            4 => AcceptStatus::AuthUnavailable,
            5 => AcceptStatus::Busy,
            6 => AcceptStatus::PayloadAuthRequired,
            code => AcceptStatus::Unknown(code),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_reads_back_as_itself() {
        for code in [0, 1, 2, 3, 4, 5, 6, 7, 0xffff] {
            assert_eq!(AcceptStatus::from_code(code).code(), code);
        }
        assert_eq!(AcceptStatus::from_code(7), AcceptStatus::Unknown(7));
    }
}
