//! Fuzz target `side_channel_message`: see [`kvlink_fuzz::side_channel_message`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::side_channel_message(data));
