//! placeholder while the worker is written
pub mod in_memory;
