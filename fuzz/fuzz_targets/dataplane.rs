//! Fuzz target `dataplane`: see [`kvlink_fuzz::dataplane`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::dataplane(data));
