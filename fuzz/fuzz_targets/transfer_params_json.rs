//! Fuzz target `transfer_params_json`: see [`kvlink_fuzz::transfer_params_json`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::transfer_params_json(data));
