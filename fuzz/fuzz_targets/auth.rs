//! Fuzz target `auth`: see [`kvlink_fuzz::auth`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::auth(data));
