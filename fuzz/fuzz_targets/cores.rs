//! Fuzz target `cores`: see [`kvlink_fuzz::cores`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::cores(data));
