//! The library behind the `kvlink` command: a minimal simulated engine
//! (scheduler + worker + block allocator per instance) that drives requests
//! through the real kvlink crates exactly as an inference engine would, and
//! verifies every byte that arrives.
//!
//! It exists for the demo, the bench and the end-to-end tests; it never
//! bypasses the library (no private path to the transports or the cores)
//! and never touches the network except through the workers, and, for a
//! bench between two hosts, the bench's own control connection
//! ([`control`], [`serve`]).

pub mod blocks;
pub mod control;
pub mod engine;
mod fill;
pub mod metrics;
pub mod ranks;
pub mod runner;
pub mod serve;
pub mod stats;

pub use blocks::{BlockPattern, BlockPool};
pub use engine::{
    rank_config, rank_shape, Completion, DecodeInstance, EngineError, PrefillInstance, PromptSpec, PullSpec,
};
