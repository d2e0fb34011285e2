//! The checkpoint format's history part, seen from outside: which version a store writes, that
//! a version 1 checkpoint (no history) still opens with history kept, that a newer version
//! refuses the open instead of being set aside, and what a reopen keeps when the history after
//! the floor holds something version 2 cannot state (a dropped table).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;

use std::path::Path;

use common::{files, put, TestDir};
use keeldb::{ChangeKind, Database, Durability, Error, Options};

fn options(keep_history: bool) -> Options {
    Options { durability: Durability::Sync, background_threads: false, keep_history, ..Options::default() }
}

fn version(checkpoint: &Path) -> u32 {
    let bytes = std::fs::read(checkpoint).unwrap();
    u32::from_le_bytes(bytes[8..12].try_into().unwrap())
}

fn get_at(db: &Database, ts: u64, table: &str, key: &[u8]) -> Option<Vec<u8>> {
    db.begin_read_at(ts).unwrap().get(table, key).unwrap()
}

fn has_table(db: &Database, ts: u64, table: &str) -> bool {
    db.begin_read_at(ts).unwrap().tables().iter().any(|t| t == table)
}

#[test]
fn a_store_without_history_writes_version_1_and_one_with_history_version_2() {
    for (keep, expected) in [(false, 1), (true, 2)] {
        let t = TestDir::new();
        let db = Database::open(t.path(), options(keep)).unwrap();
        put(&db, "t", b"a", b"1");
        put(&db, "t", b"a", b"2");
        let info = db.checkpoint().unwrap();
        assert_eq!(version(&info.path), expected, "keep_history {keep}");
        db.close().unwrap();
    }
}

/// A generated fixture of today's format: a checkpoint written without history (version 1,
/// the layout every earlier build wrote) and log after it. Opened with history kept, history
/// starts at the checkpoint and the log after it is history.
#[test]
fn a_version_1_checkpoint_opens_with_history_from_its_timestamp() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(false)).unwrap();
    put(&db, "t", b"a", b"1");
    let ckpt = db.checkpoint().unwrap();
    let after = put(&db, "t", b"a", b"2");
    let last = put(&db, "t", b"b", b"3");
    db.close().unwrap();
    assert_eq!(version(&ckpt.path), 1);

    let db = Database::open(t.path(), options(true)).unwrap();
    assert_eq!(db.history_floor(), Some(ckpt.ts));
    assert_eq!(get_at(&db, ckpt.ts, "t", b"a").as_deref(), Some(&b"1"[..]));
    assert_eq!(get_at(&db, after, "t", b"a").as_deref(), Some(&b"2"[..]));
    assert_eq!(get_at(&db, after, "t", b"b"), None);
    assert_eq!(get_at(&db, last, "t", b"b").as_deref(), Some(&b"3"[..]));
    let changes = db.changes_since(ckpt.ts, 100).unwrap();
    assert_eq!(changes.iter().map(|c| c.ts).collect::<Vec<_>>(), vec![after, last]);
    assert!(matches!(db.begin_read_at(ckpt.ts - 1), Err(Error::Compacted { .. })));
    db.close().unwrap();
}

/// A version 2 checkpoint opened without history: the history records are read (and checked)
/// and dropped; the state is the newest one.
#[test]
fn a_version_2_checkpoint_opens_without_history() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(true)).unwrap();
    put(&db, "t", b"a", b"1");
    put(&db, "t", b"a", b"2");
    db.checkpoint().unwrap();
    db.close().unwrap();
    let db = Database::open(t.path(), options(false)).unwrap();
    assert_eq!(db.history_floor(), None);
    assert_eq!(common::get(&db, "t", b"a").as_deref(), Some(&b"2"[..]));
    db.close().unwrap();
}

/// A checkpoint of a newer format is not damage: the open is refused with the version, and the
/// file stays where it is (setting it aside would open an older state).
#[test]
fn a_newer_checkpoint_version_refuses_the_open() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(true)).unwrap();
    put(&db, "t", b"a", b"1");
    let path = db.checkpoint().unwrap().path;
    db.close().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
    let crc = crc32c::crc32c(&bytes[..60]);
    bytes[60..64].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    for keep in [true, false] {
        match Database::open(t.path(), options(keep)) {
            Err(Error::UnsupportedVersion { found: 3, .. }) => {}
            other => panic!("keep_history {keep}: expected UnsupportedVersion, got {:?}", other.map(|_| ())),
        }
    }
    assert!(path.exists(), "the checkpoint was set aside");
    assert!(files(&t.path(), "checkpoint-").iter().all(|p| !p.to_string_lossy().ends_with(".corrupt")));
}

/// A table dropped after the floor cannot be stated by version 2's records: that checkpoint is
/// written without history, and the reopened store's history starts at it (less history,
/// never a wrong one). Dropped after the checkpoint, the WAL replay records it.
#[test]
fn a_dropped_table_after_the_floor_restarts_history_at_the_checkpoint() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(true)).unwrap();
    let first = put(&db, "gone", b"a", b"1");
    put(&db, "kept", b"a", b"1");
    let mut tx = db.begin_write().unwrap();
    tx.drop_table("gone").unwrap();
    tx.commit().unwrap();
    let ckpt = db.checkpoint().unwrap();
    assert_eq!(version(&ckpt.path), 1, "written without history");
    let later = put(&db, "kept", b"a", b"2");
    let mut tx = db.begin_write().unwrap();
    tx.drop_table("kept").unwrap();
    let dropped = tx.commit().unwrap().ts;
    db.close().unwrap();

    let db = Database::open(t.path(), options(true)).unwrap();
    assert_eq!(db.history_floor(), Some(ckpt.ts));
    assert!(first < ckpt.ts);
    assert_eq!(get_at(&db, ckpt.ts, "kept", b"a").as_deref(), Some(&b"1"[..]));
    assert_eq!(get_at(&db, later, "kept", b"a").as_deref(), Some(&b"2"[..]));
    assert!(!has_table(&db, dropped, "kept"), "the table is gone at {dropped}");
    assert!(has_table(&db, later, "kept"));
    let kinds: Vec<_> = db.changes_since(ckpt.ts, 100).unwrap().into_iter().map(|c| (c.ts, c.kind)).collect();
    assert_eq!(kinds, vec![(later, ChangeKind::Put(b"2".to_vec())), (dropped, ChangeKind::DropTable)]);
    db.close().unwrap();
}

/// History kept across reopens on a real file system: a second checkpoint, written from a
/// history that was itself rebuilt, keeps the versions and the tables' creation of the first.
#[test]
fn history_survives_two_checkpoints_and_reopens() {
    let t = TestDir::new();
    let mut db = Database::open(t.path(), options(true)).unwrap();
    let mut stamps = Vec::new();
    for i in 0..30u32 {
        stamps.push((put(&db, &format!("t{}", i % 3), b"k", &i.to_le_bytes()), i));
        if i % 10 == 9 {
            db.checkpoint().unwrap();
            db.close().unwrap();
            db = Database::open(t.path(), options(true)).unwrap();
            assert_eq!(db.history_floor(), Some(0));
            for &(ts, i) in &stamps {
                let table = format!("t{}", i % 3);
                assert_eq!(get_at(&db, ts, &table, b"k"), Some(i.to_le_bytes().to_vec()), "{table} at {ts}");
                // A table created after the floor is absent before its creation.
                if i < 3 {
                    assert!(!has_table(&db, ts - 1, &table) && has_table(&db, ts, &table), "{table} at {ts}");
                }
            }
        }
    }
    db.close().unwrap();
}

/// Damage in a version 2 checkpoint's history records is damage to the checkpoint: it is set
/// aside and the older checkpoint, with its own (older) floor, and the log after it give the
/// history back, whole.
#[test]
fn damaged_history_records_fall_back_to_the_older_checkpoint() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(true)).unwrap();
    let mut stamps = Vec::new();
    for i in 0..40u32 {
        stamps.push((put(&db, "t", format!("k{}", i % 5).as_bytes(), &i.to_le_bytes()), i));
        match i {
            10 => assert_eq!(version(&db.checkpoint().unwrap().path), 2),
            20 => assert_eq!(db.retain_history_since(stamps[15].0).unwrap(), stamps[15].0),
            30 => assert_eq!(version(&db.checkpoint().unwrap().path), 2),
            _ => {}
        }
    }
    db.close().unwrap();
    let newest = files(&t.path(), "checkpoint-").into_iter().next_back().unwrap();
    let mut bytes = std::fs::read(&newest).unwrap();
    let at = bytes.len() - 64 - 12; // inside the last block: the history's last change
    bytes[at] ^= 0x10;
    std::fs::write(&newest, &bytes).unwrap();

    let db = Database::open(t.path(), options(true)).unwrap();
    assert_eq!(db.history_floor(), Some(0), "the older checkpoint's floor");
    assert!(files(&t.path(), "checkpoint-").iter().any(|p| p.to_string_lossy().ends_with(".corrupt")));
    let mut latest = std::collections::BTreeMap::new();
    for &(ts, i) in &stamps {
        latest.insert(format!("k{}", i % 5), i);
        for (key, &v) in &latest {
            assert_eq!(get_at(&db, ts, "t", key.as_bytes()), Some(v.to_le_bytes().to_vec()), "{key} at {ts}");
        }
    }
    assert_eq!(db.changes_since(0, 1000).unwrap().len(), 40);
    db.close().unwrap();
}

/// A commit larger than a page of the change feed is written whole into the checkpoint's
/// history (the feed pages whole commits, except one that alone fills a page).
#[test]
fn a_commit_larger_than_a_feed_page_keeps_every_change() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(true)).unwrap();
    let before = put(&db, "t", b"k", b"0");
    let mut tx = db.begin_write().unwrap();
    for i in 0..10_000u32 {
        tx.put("t", &i.to_be_bytes(), b"v").unwrap();
    }
    let big = tx.commit().unwrap().ts;
    let after = put(&db, "t", b"k", b"1");
    let feed_before = db.changes_since(0, 100_000).unwrap();
    assert_eq!(feed_before.len(), 10_002);
    db.checkpoint().unwrap();
    db.close().unwrap();
    let db = Database::open(t.path(), options(true)).unwrap();
    let feed_after = db.changes_since(0, 100_000).unwrap();
    assert_eq!(feed_after.len(), feed_before.len());
    assert!(feed_after == feed_before, "the feed differs after the reopen");
    assert_eq!(get_at(&db, before, "t", &9_999u32.to_be_bytes()), None);
    assert_eq!(get_at(&db, big, "t", &9_999u32.to_be_bytes()).as_deref(), Some(&b"v"[..]));
    assert_eq!(get_at(&db, big, "t", b"k").as_deref(), Some(&b"0"[..]));
    assert_eq!(get_at(&db, after, "t", b"k").as_deref(), Some(&b"1"[..]));
    db.close().unwrap();
}

/// History records that pass every CRC but do not lead back to the checkpoint's state (here
/// the last change's value, its block's CRC recomputed) are never served as history: an open
/// keeping history is refused as corruption, `keel verify` reports it, and an open without
/// history reads the checkpoint's state as ever.
#[test]
fn history_that_does_not_lead_back_to_the_state_refuses_an_open_that_keeps_history() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(true)).unwrap();
    put(&db, "t", b"a", b"1");
    put(&db, "t", b"a", b"2");
    let path = db.checkpoint().unwrap().path;
    db.close().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let len = u32::from_le_bytes(bytes[64..68].try_into().unwrap()) as usize;
    assert_eq!(64 + 8 + len + 64, bytes.len(), "one block");
    bytes[64 + 8 + len - 1] ^= 0x01; // the last change's value: "2" becomes "3"
    let crc = crc32c::crc32c(&bytes[72..72 + len]);
    bytes[68..72].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();

    assert!(!keeldb::verify(t.path()).unwrap().problems.is_empty(), "verify reports it");
    assert!(matches!(Database::open(t.path(), options(true)), Err(Error::Corruption { .. })));
    let db = Database::open(t.path(), options(false)).unwrap();
    assert_eq!(common::get(&db, "t", b"a").as_deref(), Some(&b"2"[..]));
    db.close().unwrap();
}
