//! A checkpoint must never get ahead of the durable WAL. `checkpoint` takes its snapshot and then
//! seals (fdatasyncs) the current segment; when it sealed first, a relaxed commit landing between
//! the two steps was in the checkpoint but its WAL frame only in the page cache. A power loss then
//! left the checkpoint ahead of the log: the open that followed resumed the log at its end with the
//! checkpoint's timestamp, the next commit's frame followed the log's end with a gap, and the open
//! after that refused the store ("commit ts N+1 where N was expected"). Found by
//! `sim_concurrent concurrent_mixed_durability` under CPU contention (not replayable there); here
//! the commit is made between the steps on purpose, through the test hook.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::sync::{Arc, Mutex};

use keel_testkit::sim::SimFs;
use keeldb::{Database, Durability, Options, TestHook};

const DIR: &str = "/data/store";

fn options(fs: &SimFs, hook: TestHook) -> Options {
    Options {
        durability: Durability::Relaxed,
        background_threads: false,
        checkpoint_wal_bytes: u64::MAX,
        fs: Arc::new(fs.clone()),
        checkpoint_step_hook: hook,
        ..Options::default()
    }
}

fn put(db: &Database, key: &str, durability: Durability) {
    let mut tx =
        db.begin_write_with(keeldb::TxnOptions { durability: Some(durability), ..Default::default() }).unwrap();
    tx.put("t", key.as_bytes(), b"v").unwrap();
    tx.commit().unwrap();
}

fn get(db: &Database, key: &str) -> bool {
    db.begin_read().unwrap().get("t", key.as_bytes()).unwrap().is_some()
}

#[test]
fn a_commit_during_a_checkpoint_never_leaves_the_checkpoint_ahead_of_the_log() {
    for seed in 0..24 {
        let fs = SimFs::new(seed);
        fs.create_dir_durable(Path::new(DIR)).unwrap();
        // The hook commits once, relaxed, between the checkpoint's two steps, through a handle
        // it takes (and drops) so the options do not keep the database alive.
        let slot: Arc<Mutex<Option<Database>>> = Arc::new(Mutex::new(None));
        let hook = {
            let slot = Arc::clone(&slot);
            TestHook(Some(Arc::new(move || {
                if let Some(db) = slot.lock().unwrap().take() {
                    put(&db, "during", Durability::Relaxed);
                }
            })))
        };
        let db = Database::open(DIR, options(&fs, hook)).unwrap();
        put(&db, "before", Durability::Sync);
        *slot.lock().unwrap() = Some(db.clone());
        let info = db.checkpoint().unwrap();
        assert!(slot.lock().unwrap().is_none(), "seed {seed}: the hook did not run");
        fs.crash();
        drop(db);

        let db = Database::open(DIR, options(&fs, TestHook::default()))
            .unwrap_or_else(|e| panic!("seed {seed}: open after the power loss: {e}"));
        assert!(get(&db, "before"), "seed {seed}: a sync commit was lost");
        let during = get(&db, "during");
        put(&db, "after", Durability::Sync);
        fs.kill_process();
        drop(db);

        let db = Database::open(DIR, options(&fs, TestHook::default()))
            .unwrap_or_else(|e| panic!("seed {seed}: second open (checkpoint at ts {}): {e}", info.ts));
        assert!(get(&db, "before") && get(&db, "after"), "seed {seed}: a sync commit was lost");
        assert_eq!(get(&db, "during"), during, "seed {seed}: the relaxed commit changed between opens");
        drop(db);
    }
}
