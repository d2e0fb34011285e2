//! A deterministic fuzz smoke run of every on-disk decoder and of the whole recovery analysis,
//! on stable Rust so CI runs it: random bytes, and seeded mutations of a real store's files
//! (bit flips, zeroed and random ranges, truncations, extensions, spliced and deleted files).
//! Every input must produce a value or an error, never a panic. `KEEL_FUZZ_ITERS` runs more;
//! a failure prints the seed and iteration to replay with `KEEL_FUZZ_SEED`.
//! Coverage-guided fuzzing of the same entry points lives in `fuzz/` (cargo-fuzz, nightly).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;
use common::*;
use keeldb::fuzz_api;
use keeldb::{Database, Options};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn sample_store() -> Vec<(String, Vec<u8>)> {
    let t = TestDir::new();
    let db =
        Database::open(t.path(), Options { wal_segment_bytes: 2048, background_threads: false, ..Options::default() })
            .unwrap();
    for i in 0..60u32 {
        let mut tx = db.begin_write().unwrap();
        tx.put("alpha", &i.to_be_bytes(), &[i as u8; 40]).unwrap();
        if i % 7 == 0 {
            tx.delete("alpha", &(i / 2).to_be_bytes()).unwrap();
            tx.put("beta", b"k", &i.to_le_bytes()).unwrap();
        }
        tx.commit().unwrap();
        if i == 20 || i == 40 {
            db.checkpoint().unwrap();
        }
    }
    let mut tx = db.begin_write().unwrap();
    tx.drop_table("beta").unwrap();
    tx.commit().unwrap();
    db.close().unwrap();
    fuzz_api::read_store_files(&t.path()).unwrap()
}

fn mutate(rng: &mut StdRng, files: &mut Vec<(String, Vec<u8>)>) {
    if files.is_empty() {
        return;
    }
    let i = rng.gen_range(0..files.len());
    let len = files[i].1.len();
    match rng.gen_range(0..9) {
        0 if len > 0 => {
            let at = rng.gen_range(0..len);
            files[i].1[at] ^= 1 << rng.gen_range(0..8);
        }
        1 if len > 0 => {
            let at = rng.gen_range(0..len);
            let n = rng.gen_range(1..=64.min(len - at));
            files[i].1[at..at + n].fill(0);
        }
        2 if len > 0 => {
            let at = rng.gen_range(0..len);
            let n = rng.gen_range(1..=32.min(len - at));
            rng.fill(&mut files[i].1[at..at + n]);
        }
        3 => {
            let cut = rng.gen_range(0..=len);
            files[i].1.truncate(cut);
        }
        4 => {
            let extra: Vec<u8> = (0..rng.gen_range(1..200)).map(|_| rng.gen()).collect();
            files[i].1.extend(extra);
        }
        5 => {
            files.remove(i);
        }
        6 if len > 8 => {
            // Write a plausible little-endian length or LSN somewhere: the fields decoders trust.
            let at = rng.gen_range(0..len - 8);
            let v: u64 = match rng.gen_range(0..4) {
                0 => u64::MAX,
                1 => u64::MAX - rng.gen_range(0..4),
                2 => rng.gen_range(0..1 << 20),
                _ => 1 << rng.gen_range(20..63),
            };
            files[i].1[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        7 => {
            // Splice: copy a range of one file into another.
            let j = rng.gen_range(0..files.len());
            if files[j].1.len() > 16 && len > 16 {
                let from = rng.gen_range(0..files[j].1.len() - 16);
                let n = rng.gen_range(1..16);
                let chunk = files[j].1[from..from + n].to_vec();
                let at = rng.gen_range(0..len - n);
                files[i].1[at..at + n].copy_from_slice(&chunk);
            }
        }
        _ => {
            // Rename a file to another plausible name.
            let names = [
                "wal-0000000000000001.log",
                "wal-0000000000000009.log",
                "checkpoint-00000000000000000005.kc",
                "checkpoint-18446744073709551615.kc",
                "wal-9999999999999999.log",
            ];
            files[i].0 = names[rng.gen_range(0..names.len())].to_owned();
        }
    }
}

#[test]
fn mutated_stores_and_random_bytes_never_panic() {
    let base = sample_store();
    assert!(fuzz_api::recover_dir(base.clone()).is_ok(), "the unmutated store recovers");
    let iters: u64 = std::env::var("KEEL_FUZZ_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(3000);
    let seed: u64 = std::env::var("KEEL_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    let mut executions = 0u64;
    for iter in 0..iters {
        let iter_seed = seed.wrapping_add(iter);
        let result = std::panic::catch_unwind(|| {
            let mut rng = StdRng::seed_from_u64(iter_seed);
            let mut files = base.clone();
            for _ in 0..rng.gen_range(1..4) {
                mutate(&mut rng, &mut files);
            }
            let _ = fuzz_api::recover_dir(files.clone());
            for (_, bytes) in &files {
                let _ = fuzz_api::wal_segment(bytes);
                let _ = fuzz_api::checkpoint(bytes);
                let _ = fuzz_api::wal_segment_header(bytes);
            }
            let junk: Vec<u8> = (0..rng.gen_range(0..256)).map(|_| rng.gen()).collect();
            let _ = fuzz_api::wal_payload(&junk);
            let _ = fuzz_api::wal_frame_header(&junk);
            let _ = fuzz_api::checkpoint(&junk);
            let _ = fuzz_api::wal_segment(&junk);
        });
        if let Err(e) = result {
            eprintln!("decoder smoke failed; replay with KEEL_FUZZ_SEED={iter_seed} KEEL_FUZZ_ITERS=1");
            std::panic::resume_unwind(e);
        }
        executions += 1;
    }
    assert_eq!(executions, iters);
}
