//! Fuzz target `quic_dataplane`: see [`kvlink_fuzz::quic_dataplane`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::quic_dataplane(data));
