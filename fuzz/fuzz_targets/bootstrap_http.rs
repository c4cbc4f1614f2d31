//! Fuzz target `bootstrap_http`: see [`kvlink_fuzz::bootstrap_http`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::bootstrap_http(data));
