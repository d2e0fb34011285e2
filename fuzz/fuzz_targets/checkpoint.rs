//! A checkpoint file (header, blocks, footer, digest) from arbitrary bytes.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = keeldb::fuzz_api::checkpoint(data);
});
