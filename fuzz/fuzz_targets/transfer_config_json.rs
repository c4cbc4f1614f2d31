//! Fuzz target `transfer_config_json`: see [`kvlink_fuzz::transfer_config_json`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::transfer_config_json(data));
