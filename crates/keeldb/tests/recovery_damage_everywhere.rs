//! Damage to any byte of a cleanly closed store, in every durability mode: `open` must return
//! either the whole acknowledged history or a typed `Corruption` (never a silent truncation),
//! and `keel verify` must call the store corrupt whenever `open` would lose a commit.
//!
//! The store has several WAL segments, two retained checkpoints, the identity file and the
//! accounting and recovery logs. Every file is damaged at positions spread over its whole
//! length (a stride that hits every frame header, payload and padding of the small segments),
//! with three kinds of damage: one flipped bit, eight zeroed bytes, eight bytes of garbage.
//! Each trial starts from a fresh copy of the pristine store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::TestDir;
use keeldb::{Database, Durability, Error, Options, ScanRange};

const COMMITS: u32 = 900;
const SEGMENT_HEADER: usize = 64;
const FRAME_HEADER: usize = 40;

#[derive(Clone, Copy, Debug)]
enum Damage {
    FlipBit,
    Zero8,
    Garbage8,
}

fn options(durability: Durability) -> Options {
    Options { durability, background_threads: false, wal_segment_bytes: 8 * 1024, ..Options::default() }
}

/// Builds the pristine store: `COMMITS` small commits with a checkpoint after a third and after
/// two thirds of them (so two checkpoints are retained and the WAL spans several segments).
fn build(path: &Path, durability: Durability) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let db = Database::open(path, options(durability)).unwrap();
    let mut model = BTreeMap::new();
    for i in 0..COMMITS {
        let key = format!("key-{:05}", i % 700).into_bytes();
        let value = format!("value-{i}-{}", "x".repeat((i % 13) as usize)).into_bytes();
        let mut tx = db.begin_write().unwrap();
        tx.put("t", &key, &value).unwrap();
        tx.commit().unwrap();
        model.insert(key, value);
        if i == COMMITS / 3 || i == 2 * COMMITS / 3 {
            db.checkpoint().unwrap();
        }
    }
    db.close().unwrap();
    model
}

fn read_dir(path: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(path)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| (e.file_name().into_string().unwrap(), std::fs::read(e.path()).unwrap()))
        .collect()
}

fn write_dir(path: &Path, files: &BTreeMap<String, Vec<u8>>) {
    std::fs::create_dir_all(path).unwrap();
    for (name, bytes) in files {
        std::fs::write(path.join(name), bytes).unwrap();
    }
}

fn damage(bytes: &mut [u8], at: usize, how: Damage, seed: u64) {
    let end = (at + 8).min(bytes.len());
    match how {
        Damage::FlipBit => bytes[at] ^= 1 << (seed % 8),
        Damage::Zero8 => bytes[at..end].fill(0),
        Damage::Garbage8 => {
            let mut x = seed | 1;
            for b in &mut bytes[at..end] {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
        }
    }
}

#[derive(Default, Debug)]
struct Tally {
    trials: u64,
    full_history: u64,
    corruption: u64,
    other_typed: u64,
}

/// One trial: copy, damage, open, check; then verify on a second copy.
fn trial(
    base: &Path,
    pristine: &BTreeMap<String, Vec<u8>>,
    model: &BTreeMap<Vec<u8>, Vec<u8>>,
    durability: Durability,
    (file, at, how): (&str, usize, Damage),
    tally: &mut Tally,
) {
    let mut files = pristine.clone();
    let bytes = files.get_mut(file).unwrap();
    let before = bytes.clone();
    damage(bytes, at, how, tally.trials.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ at as u64);
    if *bytes == before {
        return; // Zeroing bytes that were already zero damages nothing.
    }
    tally.trials += 1;
    let case = format!("{durability:?}: {how:?} at {file}:{at}");
    let dir = base.join(format!("trial-{}", tally.trials));
    write_dir(&dir, &files);
    let verdict = keeldb::verify(&dir);
    let opened = Database::open(&dir, options(durability));
    let lost = match opened {
        Ok(db) => {
            let rx = db.begin_read().unwrap();
            let got: BTreeMap<Vec<u8>, Vec<u8>> = rx.scan("t", ScanRange::all()).unwrap().map(|r| r.unwrap()).collect();
            if &got != model {
                let missing = model.keys().filter(|k| got.get(*k) != model.get(*k)).count();
                panic!(
                    "{case}: open succeeded but the acknowledged history is not whole: {missing} keys differ; recovery: {}",
                    db.recovery_report()
                );
            }
            drop(rx);
            db.close().unwrap();
            tally.full_history += 1;
            false
        }
        Err(Error::Corruption { .. }) => {
            tally.corruption += 1;
            true
        }
        // Damage to the identity file's magic makes the directory unrecognisable.
        Err(Error::NotAStore { .. }) if file == "KEELDB" => {
            tally.other_typed += 1;
            true
        }
        Err(e) => panic!("{case}: open failed with an error that is not Corruption: {e}"),
    };
    if lost {
        // Open refused: verify must not call the store intact.
        match verdict {
            Ok(report) => assert!(!report.is_intact(), "{case}: open refused the store but verify says intact"),
            Err(Error::Corruption { .. } | Error::NotAStore { .. }) => {}
            Err(e) => panic!("{case}: verify failed with an unexpected error: {e}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Where to damage a file. By default: every byte of the small files; in WAL segments every
/// fourth header byte and, rotating over the frames, one of each frame's fields (magic, length,
/// LSN, durable claim, timestamp, payload CRC, header CRC, payload start, middle, end); a prime
/// stride through checkpoints. `KEEL_DAMAGE_STRIDE=n` instead damages every n-th byte of every
/// file with all three kinds (the exhaustive run quoted in docs/RELIABILITY.md).
fn positions(name: &str, bytes: &[u8]) -> Vec<usize> {
    if let Some(stride) = std::env::var("KEEL_DAMAGE_STRIDE").ok().and_then(|s| s.parse::<usize>().ok()) {
        return (0..bytes.len()).step_by(stride.max(1)).collect();
    }
    if name.starts_with("checkpoint-") {
        return (0..bytes.len()).step_by(211).chain([bytes.len().saturating_sub(1)]).collect();
    }
    if !name.starts_with("wal-") {
        return (0..bytes.len()).collect();
    }
    let mut out: Vec<usize> = (0..SEGMENT_HEADER.min(bytes.len())).step_by(4).collect();
    let mut pos = SEGMENT_HEADER;
    let mut frame = 0;
    while pos + FRAME_HEADER <= bytes.len() {
        let len = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap()) as usize;
        let fields = [0, 4, 8, 16, 24, 32, 36, FRAME_HEADER, FRAME_HEADER + len / 2, FRAME_HEADER + len.max(1) - 1];
        out.push(pos + fields[frame % fields.len()]);
        pos += FRAME_HEADER + ((len + 7) & !7);
        frame += 1;
    }
    out.retain(|&p| p < bytes.len());
    out
}

fn run_mode(durability: Durability) -> Tally {
    let t = TestDir::new();
    let store = t.dir.path().join("pristine");
    let model = build(&store, durability);
    let pristine = read_dir(&store);
    let segments = pristine.keys().filter(|n| n.starts_with("wal-")).count();
    let checkpoints = pristine.keys().filter(|n| n.starts_with("checkpoint-")).count();
    assert!(segments >= 3, "the store should span several segments, has {segments}");
    assert_eq!(checkpoints, 2, "two checkpoints are retained");
    let mut tally = Tally::default();
    let only = std::env::var("KEEL_DAMAGE_FILE").ok();
    for (name, bytes) in &pristine {
        if name == "LOCK" || only.as_ref().is_some_and(|o| o != name) {
            continue; // LOCK is an empty file whose contents mean nothing.
        }
        for (i, at) in positions(name, bytes).into_iter().enumerate() {
            let kinds = [Damage::FlipBit, Damage::Zero8, Damage::Garbage8];
            if std::env::var("KEEL_DAMAGE_STRIDE").is_ok() {
                for how in kinds {
                    trial(t.dir.path(), &pristine, &model, durability, (name, at, how), &mut tally);
                }
            } else {
                trial(t.dir.path(), &pristine, &model, durability, (name, at, kinds[i % 3]), &mut tally);
            }
        }
    }
    assert!(tally.corruption > 0, "{durability:?}: some damage must be detected as corruption: {tally:?}");
    tally
}

#[test]
fn damage_anywhere_in_a_cleanly_closed_relaxed_store_never_loses_a_commit_silently() {
    let tally = run_mode(Durability::Relaxed);
    eprintln!("relaxed: {tally:?}");
}

#[test]
fn damage_anywhere_in_a_cleanly_closed_periodic_store_never_loses_a_commit_silently() {
    let tally = run_mode(Durability::Periodic(Duration::from_secs(3600)));
    eprintln!("periodic: {tally:?}");
}

#[test]
fn damage_anywhere_in_a_cleanly_closed_sync_store_never_loses_a_commit_silently() {
    let tally = run_mode(Durability::Sync);
    eprintln!("sync: {tally:?}");
}
