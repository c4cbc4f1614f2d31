//! Fuzz target `bench_control`: see [`kvlink_fuzz::bench_control`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::bench_control(data));
