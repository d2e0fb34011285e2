//! The whole recovery analysis over a directory built from arbitrary bytes: the input is split
//! into up to four files named like a store's (segments and checkpoints).
#![no_main]
const NAMES: [&str; 4] = [
    "wal-0000000000000001.log",
    "wal-0000000000000002.log",
    "checkpoint-00000000000000000003.kc",
    "checkpoint-00000000000000000007.kc",
];
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let mut files = Vec::new();
    for (i, part) in data.split(|&b| b == 0xA5).take(NAMES.len()).enumerate() {
        files.push((NAMES[i].to_owned(), part.to_vec()));
    }
    let _ = keeldb::fuzz_api::recover_dir(files);
});
