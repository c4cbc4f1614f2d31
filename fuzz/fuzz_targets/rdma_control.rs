//! Fuzz target `rdma_control`: see [`kvlink_fuzz::rdma_control`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::rdma_control(data));
