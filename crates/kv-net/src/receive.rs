//! The steps of kv-proto's batch-receive machine that every byte stream
//! carries out the same way ([`carry_out`]): a read, bounded by the I/O
//! bound and, for an op list, by its one deadline; and a charge to the
//! op-list budget, waiting for room until that deadline. A transport
//! drives the rest (its payload, replies, discards) itself.

use std::time::Duration;

use kv_proto::receive::Step;
use kv_proto::NoRoom;
use tokio::io::AsyncRead;

use crate::budget::Share;
use crate::io::{read_exact, WireError};

/// How a step handed to [`carry_out`] went.
#[derive(Debug)]
pub enum Carried<'a> {
    /// Carried out: tell the machine (`advance`).
    Done,
    /// The op list's deadline passed first (`deadline_passed`).
    Late,
    /// The budget had no room for the op list (`no_room`).
    NoRoom(NoRoom),
    /// Not one of these steps: the transport carries it out.
    Other(Step<'a>),
}

/// Carries out `step` if it is a read from `reader` (each wait bounded by
/// `io_timeout`) or a charge to `share`.
pub async fn carry_out<'a, R: AsyncRead + Unpin + ?Sized>(
    step: Step<'a>,
    reader: &mut R,
    share: &mut Share<'_>,
    io_timeout: Duration,
) -> Result<Carried<'a>, WireError> {
    match step {
        Step::Read { what, into, by: None } => {
            read_exact(reader, into, io_timeout, what).await?;
            Ok(Carried::Done)
        }
        Step::Read { what, into, by: Some(by) } => {
            match tokio::time::timeout_at(by.into(), read_exact(reader, into, io_timeout, what)).await {
                Ok(read) => read.map(|()| Carried::Done),
                Err(_) => Ok(Carried::Late),
            }
        }
        Step::Charge { bytes, by } => match share.grow(bytes, by.into()).await {
            Ok(()) => Ok(Carried::Done),
            Err(no_room) => Ok(Carried::NoRoom(no_room)),
        },
        other => Ok(Carried::Other(other)),
    }
}
