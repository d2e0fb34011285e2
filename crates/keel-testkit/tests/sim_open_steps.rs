//! Crash at every step of creating a store, of recovering one (torn tail truncation, resume
//! fsync, recovery log), of a WAL segment roll and of a clean close. The store must always open
//! afterwards with a legal state; and a store the engine created itself must not vanish.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::path::Path;

use keel_testkit::model::{History, Model, WriteSet};
use keel_testkit::sim::SimFs;
use keel_testkit::workload::{sim_options, store_path};
use keeldb::{Database, Durability};

/// One put commit; a failure is recorded as a commit of unknown fate and returned.
fn try_put(db: &Database, hist: &mut History, i: u64, size: usize) -> Result<(), String> {
    let mut tx = db.begin_write().map_err(|e| e.to_string())?;
    let mut ws = WriteSet::default();
    let key = format!("k{:03}", i % 30);
    let value = vec![i as u8 ^ 0x5a; size];
    tx.put("t", key.as_bytes(), &value).map_err(|e| e.to_string())?;
    ws.put("t", key.as_bytes(), &value);
    match tx.commit() {
        Ok(info) => hist.acked(info.ts, ws),
        Err(e) => {
            hist.failed(ws);
            Err(e.to_string())
        }
    }
}

fn put(db: &Database, hist: &mut History, i: u64, size: usize) {
    try_put(db, hist, i, size).unwrap();
}

/// Runs `action` once to count its mutating calls, then for every step crashes it there (with
/// a power loss for three crash seeds and a process kill for one) and checks the reopened
/// store against what `setup` says must hold.
type Setup<'a> = &'a dyn Fn(&SimFs) -> (Option<Database>, History);
type Action<'a> = &'a dyn Fn(&SimFs, Option<Database>, &mut History) -> Result<(), String>;

/// `kill_keeps_acked`: whether every acknowledged commit is still in the page cache when the
/// action starts (false when the setup itself ended in a power loss).
fn every_step(name: &str, kill_keeps_acked: bool, setup: Setup<'_>, action: Action<'_>) {
    let fs = SimFs::new(0);
    let (db, mut hist) = setup(&fs);
    let before = fs.ops();
    action(&fs, db, &mut hist).unwrap_or_else(|e| panic!("{name}: the uncrashed action failed: {e}"));
    let total = fs.ops() - before;
    let mut failures = Vec::new();
    // Crash seeds shape the state the action starts from, so its call count varies a little:
    // go a few steps past the uncrashed count.
    for step in 0..=total + 4 {
        for variant in 0..4u64 {
            let fs = SimFs::new(step * 10 + variant + 1);
            let (db, mut hist) = setup(&fs);
            fs.stop_after_ops(step);
            let result = action(&fs, db, &mut hist);
            // The engine ignores failures on `accounting.txt` by design (informational file).
            let on_state = fs.stopped_on().is_some_and(|p| !p.to_string_lossy().contains("accounting"));
            if on_state && result.is_ok() {
                failures.push(format!("step {step}: the action succeeded although a call failed"));
            }
            if variant == 3 {
                if kill_keeps_acked {
                    hist.require_all();
                }
                fs.kill_process();
            } else {
                fs.crash();
            }
            match Database::open(store_path(), sim_options(&fs, Durability::Sync)) {
                Ok(db) => {
                    if let Err(e) = hist.check(&db) {
                        failures.push(format!("step {step} variant {variant}: {e}"));
                    }
                }
                Err(e) => failures.push(format!("step {step} variant {variant}: open failed: {e}")),
            }
        }
    }
    println!("{name}: {total} steps x 4 crash variants");
    assert!(failures.is_empty(), "{name}: {} failure(s):\n{}", failures.len(), failures.join("\n"));
}

fn durable_dir(fs: &SimFs) {
    fs.create_dir_durable(store_path()).unwrap();
}

#[test]
fn crash_while_creating_a_store() {
    every_step(
        "create",
        true,
        &|fs| {
            durable_dir(fs);
            (None, History::new(Model::default(), 0))
        },
        &|fs, _, hist| {
            let db = Database::open(store_path(), sim_options(fs, Durability::Sync)).map_err(|e| e.to_string())?;
            std::mem::forget(db.clone()); // keep it open: the crash, not a close, ends it
            try_put(&db, hist, 0, 10)?;
            hist.require_all();
            Ok(())
        },
    );
}

/// A store whose newest segment ends in a torn, never-synced tail (relaxed commits, power loss
/// that keeps a prefix with a tear), so the next open truncates and resumes it.
fn store_with_torn_tail(fs: &SimFs) -> (Option<Database>, History) {
    durable_dir(fs);
    let db = Database::open(store_path(), sim_options(fs, Durability::Sync)).unwrap();
    let mut hist = History::new(Model::default(), 0);
    for i in 0..6 {
        put(&db, &mut hist, i, 300);
    }
    hist.require_all();
    for i in 6..10 {
        let mut tx = db
            .begin_write_with(keeldb::TxnOptions {
                durability: Some(Durability::Relaxed),
                ..keeldb::TxnOptions::default()
            })
            .unwrap();
        let mut ws = WriteSet::default();
        let value = vec![i as u8; 700];
        tx.put("t", format!("r{i}").as_bytes(), &value).unwrap();
        ws.put("t", format!("r{i}").as_bytes(), &value);
        hist.acked(tx.commit().unwrap().ts, ws).unwrap();
    }
    fs.crash();
    drop(db);
    (None, hist)
}

#[test]
fn crash_while_recovering() {
    every_step("recover", false, &store_with_torn_tail, &|fs, _, hist| {
        let db = Database::open(store_path(), sim_options(fs, Durability::Sync)).map_err(|e| e.to_string())?;
        let (state, ts) = hist.check(&db)?;
        // What recovery showed is what every later open must show (it made it durable).
        *hist = History::new(state, ts);
        std::mem::forget(db.clone());
        Ok(())
    });
}

#[test]
fn crash_while_rolling_a_segment() {
    every_step(
        "roll",
        true,
        &|fs| {
            durable_dir(fs);
            let db = Database::open(store_path(), sim_options(fs, Durability::Sync)).unwrap();
            let mut hist = History::new(Model::default(), 0);
            // Fill the 4 KiB segment to just below a roll.
            for i in 0..6 {
                put(&db, &mut hist, i, 500);
            }
            hist.require_all();
            (Some(db), hist)
        },
        &|_, db, hist| {
            let db = db.ok_or("no database")?;
            let mut tx = db.begin_write().map_err(|e| e.to_string())?;
            let mut ws = WriteSet::default();
            tx.put("t", b"roll", &[9u8; 2000]).map_err(|e| e.to_string())?;
            ws.put("t", b"roll", &[9u8; 2000]);
            match tx.commit() {
                Ok(info) => {
                    hist.acked(info.ts, ws)?;
                    hist.require_all();
                    std::mem::forget(db);
                    Ok(())
                }
                Err(e) => {
                    hist.failed(ws);
                    std::mem::forget(db);
                    Err(e.to_string())
                }
            }
        },
    );
}

#[test]
fn crash_while_closing() {
    every_step(
        "close",
        true,
        &|fs| {
            durable_dir(fs);
            let db = Database::open(store_path(), sim_options(fs, Durability::Relaxed)).unwrap();
            let mut hist = History::new(Model::default(), 0);
            for i in 0..8 {
                put(&db, &mut hist, i, 400);
            }
            (Some(db), hist)
        },
        &|_, db, hist| {
            db.ok_or("no database")?.close().map_err(|e| e.to_string())?;
            hist.require_all();
            Ok(())
        },
    );
}

#[test]
fn a_store_directory_the_engine_created_survives_power_loss() {
    // The caller passes a path whose directory does not exist; `open` creates it. Its entry in
    // the parent directory is durable only once the parent is fsynced. Until the engine does
    // that, a power loss after acknowledged `sync` commits can take the whole store with it.
    let mut failures = Vec::new();
    for seed in 0..20 {
        let fs = SimFs::new(seed);
        fs.create_dir_durable(Path::new("/data")).unwrap();
        let db = Database::open(store_path(), sim_options(&fs, Durability::Sync)).unwrap();
        let mut hist = History::new(Model::default(), 0);
        for i in 0..5 {
            put(&db, &mut hist, i, 50);
        }
        hist.require_all();
        fs.crash();
        drop(db);
        match Database::open(store_path(), sim_options(&fs, Durability::Sync)) {
            Ok(db) => {
                if let Err(e) = hist.check(&db) {
                    failures.push(format!("seed {seed}: {e}"));
                }
            }
            Err(e) => failures.push(format!("seed {seed}: open failed: {e}")),
        }
    }
    assert!(failures.is_empty(), "{} of 20 seeds lost acknowledged commits:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn a_tear_inside_the_last_frames_padding_does_not_lose_later_commits() {
    // Frames are padded with zeros to 8 bytes. A torn write (or a short write followed by a
    // crash) can keep the last frame's payload but not all of its padding. That frame is valid;
    // the log then ends a few bytes short of an 8-byte boundary. Recovery must resume writing at
    // the frame's padded end: a later `sync` commit, acknowledged and followed by a clean close,
    // must still be there on the next open.
    use keeldb::fs::FileSystem;
    let mut failures = Vec::new();
    for value_len in 1..=16usize {
        let fs = SimFs::new(700 + value_len as u64);
        fs.create_dir_durable(store_path()).unwrap();
        let db = Database::open(store_path(), sim_options(&fs, Durability::Relaxed)).unwrap();
        let mut hist = History::new(Model::default(), 0);
        put(&db, &mut hist, 0, 100);
        db.checkpoint().unwrap(); // everything so far durable
        put(&db, &mut hist, 1, value_len); // relaxed: its frame is still unsynced
                                           // The crash keeps the frame's payload but cuts the last byte (padding, if it has any).
        let wal = fs.list_dir(store_path()).unwrap().into_iter().filter(|n| n.starts_with("wal-")).max().unwrap();
        let wal = store_path().join(wal);
        let len = fs.read_file(&wal).unwrap().len() as u64;
        fs.open(&wal, keeldb::fs::OpenMode::ReadWrite).unwrap().set_len(len - 1).unwrap();
        fs.kill_process();
        drop(db);
        let db = Database::open(store_path(), sim_options(&fs, Durability::Sync)).unwrap();
        let (state, ts) = hist.check(&db).unwrap();
        let mut after = History::new(state, ts);
        put(&db, &mut after, 2, 50); // sync
        db.close().unwrap();
        after.require_all();
        let db = Database::open(store_path(), sim_options(&fs, Durability::Sync)).unwrap();
        if let Err(e) = after.check(&db) {
            failures.push(format!("value of {value_len} bytes: {e} (torn tail {:?})", db.recovery_report().torn_tail));
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
}
