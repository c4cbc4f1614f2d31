//! Fuzz target `side_channel_frame`: see [`kvlink_fuzz::side_channel_frame`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlink_fuzz::side_channel_frame(data));
