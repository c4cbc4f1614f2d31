//! Fuzz target `tcp_dataplane`: see [`kvlink_fuzz::tcp_dataplane`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::tcp_dataplane(data));
