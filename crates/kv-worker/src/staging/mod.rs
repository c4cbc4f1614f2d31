//! Host staging for device KV caches: the slots ([`StagingPool`]) and the
//! flow of each request through them ([`StagingCore`]), both sans-IO.

mod driver;
mod flow;
mod pool;

pub use driver::{CopyWork, StagedWorker};
pub use flow::{stages, CopyDirection, CopyOrder, StagedStep, StagingCore};
pub use pool::{Reservation, StagingEvents, StagingPool};
