//! Fuzz target `registered_memory`: see [`kvlink_fuzz::registered_memory`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::registered_memory(data));
