//! A whole WAL segment file (header, frames, torn tails) from arbitrary bytes.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = keeldb::fuzz_api::wal_segment(data);
});
