//! A checkpoint stream (what `install_checkpoint` reads) from arbitrary bytes.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = keeldb::fuzz_api::checkpoint_stream(data);
});
