//! A WAL record payload (commit or mark) from arbitrary bytes.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = keeldb::fuzz_api::wal_payload(data);
    let _ = keeldb::fuzz_api::wal_frame_header(data);
    let _ = keeldb::fuzz_api::wal_segment_header(data);
});
