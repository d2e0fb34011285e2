//! Basic API behaviour: CRUD, scans, read-your-own-writes, rollback, tables, limits, reopen.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;
use common::*;
use keeldb::{Database, Durability, Error, ScanRange, MAX_KEY_BYTES, MAX_TABLE_NAME_BYTES, MAX_VALUE_BYTES};

#[test]
fn put_get_delete_and_reopen() {
    let t = TestDir::new();
    let db = open(&t.path());
    let ts1 = put(&db, "t", b"a", b"1");
    let ts2 = put(&db, "t", b"b", b"2");
    assert!(ts2 > ts1);
    let mut tx = db.begin_write().unwrap();
    tx.delete("t", b"a").unwrap();
    tx.commit().unwrap();
    assert_eq!(get(&db, "t", b"a"), None);
    assert_eq!(get(&db, "t", b"b").as_deref(), Some(&b"2"[..]));
    db.close().unwrap();
    let db = open(&t.path());
    assert_eq!(get(&db, "t", b"a"), None);
    assert_eq!(get(&db, "t", b"b").as_deref(), Some(&b"2"[..]));
    assert!(db.recovery_report().clean_shutdown);
}

#[test]
fn scans_forward_reverse_bounds_and_prefix() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut tx = db.begin_write().unwrap();
    for k in ["a1", "a2", "a3", "b1", "b2", "c"] {
        tx.put("t", k.as_bytes(), k.as_bytes()).unwrap();
    }
    tx.commit().unwrap();
    let rx = db.begin_read().unwrap();
    let keys = |r: ScanRange| -> Vec<String> {
        rx.scan("t", r).unwrap().map(|x| String::from_utf8(x.unwrap().0).unwrap()).collect()
    };
    assert_eq!(keys(ScanRange::all()), ["a1", "a2", "a3", "b1", "b2", "c"]);
    assert_eq!(keys(ScanRange::all().reverse()), ["c", "b2", "b1", "a3", "a2", "a1"]);
    assert_eq!(keys(ScanRange::prefix(b"a".to_vec())), ["a1", "a2", "a3"]);
    assert_eq!(keys(ScanRange::prefix(b"b".to_vec()).reverse()), ["b2", "b1"]);
    assert_eq!(keys(ScanRange::all().start(b"a2".to_vec()).end(b"b2".to_vec())), ["a2", "a3", "b1"]);
    assert_eq!(keys(ScanRange::all().start(b"z".to_vec()).end(b"a".to_vec())), Vec::<String>::new());
    assert_eq!(keys(ScanRange::prefix(b"zz".to_vec())), Vec::<String>::new());
    // Scans of a missing table are empty, not an error.
    assert_eq!(rx.scan("nope", ScanRange::all()).unwrap().count(), 0);
}

#[test]
fn long_scans_cross_chunk_boundaries() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut tx = db.begin_write().unwrap();
    for i in 0..2000u32 {
        tx.put("t", &i.to_be_bytes(), b"v").unwrap();
    }
    tx.commit().unwrap();
    let rx = db.begin_read().unwrap();
    let fwd: Vec<u32> =
        rx.scan("t", ScanRange::all()).unwrap().map(|r| u32::from_be_bytes(r.unwrap().0.try_into().unwrap())).collect();
    assert_eq!(fwd, (0..2000).collect::<Vec<_>>());
    let rev: Vec<u32> = rx
        .scan("t", ScanRange::all().reverse())
        .unwrap()
        .map(|r| u32::from_be_bytes(r.unwrap().0.try_into().unwrap()))
        .collect();
    assert_eq!(rev, (0..2000).rev().collect::<Vec<_>>());
}

#[test]
fn read_your_own_writes_in_gets_and_scans() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"a", b"old");
    put(&db, "t", b"c", b"old");
    let mut tx = db.begin_write().unwrap();
    tx.put("t", b"a", b"new").unwrap();
    tx.put("t", b"b", b"new").unwrap();
    tx.delete("t", b"c").unwrap();
    assert_eq!(tx.get("t", b"a").unwrap().as_deref(), Some(&b"new"[..]));
    assert_eq!(tx.get("t", b"c").unwrap(), None);
    let seen: Vec<(Vec<u8>, Vec<u8>)> = tx.scan("t", ScanRange::all()).unwrap().map(|r| r.unwrap()).collect();
    assert_eq!(seen, vec![(b"a".to_vec(), b"new".to_vec()), (b"b".to_vec(), b"new".to_vec())]);
    let rev: Vec<Vec<u8>> = tx.scan("t", ScanRange::all().reverse()).unwrap().map(|r| r.unwrap().0).collect();
    assert_eq!(rev, vec![b"b".to_vec(), b"a".to_vec()]);
    // Others do not see uncommitted writes.
    assert_eq!(get(&db, "t", b"a").as_deref(), Some(&b"old"[..]));
    tx.commit().unwrap();
    assert_eq!(get(&db, "t", b"a").as_deref(), Some(&b"new"[..]));
}

#[test]
fn dropping_a_transaction_rolls_back() {
    let t = TestDir::new();
    let db = open(&t.path());
    {
        let mut tx = db.begin_write().unwrap();
        tx.put("t", b"k", b"v").unwrap();
    }
    let mut tx = db.begin_write().unwrap();
    tx.put("t", b"k2", b"v").unwrap();
    tx.rollback();
    assert_eq!(get(&db, "t", b"k"), None);
    assert_eq!(get(&db, "t", b"k2"), None);
    assert!(db.begin_read().unwrap().tables().is_empty());
}

#[test]
fn empty_transactions_do_not_touch_the_wal() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"k", b"v");
    let before = db.stats();
    for _ in 0..100 {
        let tx = db.begin_write().unwrap();
        tx.commit().unwrap();
    }
    let after = db.stats();
    assert_eq!(before.wal_bytes, after.wal_bytes);
    assert_eq!(before.commits, after.commits);
    assert_eq!(before.wal_syncs, after.wal_syncs);
}

#[test]
fn tables_are_listed_and_dropped_with_snapshots_kept() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "alpha", b"k", b"1");
    put(&db, "beta", b"k", b"2");
    assert_eq!(db.begin_read().unwrap().tables(), ["alpha", "beta"]);
    let old = db.begin_read().unwrap();
    let mut tx = db.begin_write().unwrap();
    assert!(tx.drop_table("alpha").unwrap());
    assert!(!tx.drop_table("missing").unwrap());
    tx.commit().unwrap();
    assert_eq!(db.begin_read().unwrap().tables(), ["beta"]);
    assert_eq!(get(&db, "alpha", b"k"), None);
    // A snapshot from before the drop still reads the table.
    assert_eq!(old.get("alpha", b"k").unwrap().as_deref(), Some(&b"1"[..]));
    drop(old);
    // Recreate with new contents; reopen sees only the new table.
    put(&db, "alpha", b"k2", b"3");
    db.close().unwrap();
    let db = open(&t.path());
    assert_eq!(scan_all(&db, "alpha"), vec![(b"k2".to_vec(), b"3".to_vec())]);
    assert_eq!(get(&db, "beta", b"k").as_deref(), Some(&b"2"[..]));
}

#[test]
fn drop_and_rewrite_in_one_transaction() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"old", b"1");
    let mut tx = db.begin_write().unwrap();
    tx.drop_table("t").unwrap();
    assert_eq!(tx.get("t", b"old").unwrap(), None);
    tx.put("t", b"new", b"2").unwrap();
    assert_eq!(tx.tables(), ["t"]);
    tx.commit().unwrap();
    assert_eq!(scan_all(&db, "t"), vec![(b"new".to_vec(), b"2".to_vec())]);
    db.close().unwrap();
    let db = open(&t.path());
    assert_eq!(scan_all(&db, "t"), vec![(b"new".to_vec(), b"2".to_vec())]);
}

#[test]
fn limits_give_typed_errors_and_write_nothing() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut tx = db.begin_write().unwrap();
    let big_key = vec![0u8; MAX_KEY_BYTES + 1];
    assert!(matches!(tx.put("t", &big_key, b"v"), Err(Error::LimitExceeded { what: "key", .. })));
    let big_value = vec![0u8; MAX_VALUE_BYTES + 1];
    assert!(matches!(tx.put("t", b"k", &big_value), Err(Error::LimitExceeded { what: "value", .. })));
    let long_name = "x".repeat(MAX_TABLE_NAME_BYTES + 1);
    assert!(matches!(tx.put(&long_name, b"k", b"v"), Err(Error::LimitExceeded { what: "table name", .. })));
    assert!(matches!(tx.put("", b"k", b"v"), Err(Error::InvalidArgument(_))));
    assert!(matches!(tx.get("", b"k"), Err(Error::InvalidArgument(_))));
    // Exactly at the limits is fine.
    tx.put(&"y".repeat(MAX_TABLE_NAME_BYTES), &vec![1u8; MAX_KEY_BYTES], b"v").unwrap();
    tx.commit().unwrap();
    assert_eq!(db.begin_read().unwrap().tables(), ["y".repeat(MAX_TABLE_NAME_BYTES)]);
}

#[test]
fn transaction_size_limit() {
    let t = TestDir::new();
    let db = Database::open(
        t.path(),
        keeldb::Options { max_txn_bytes: 1000, background_threads: false, ..Default::default() },
    )
    .unwrap();
    let mut tx = db.begin_write().unwrap();
    tx.put("t", b"a", &[0u8; 500]).unwrap();
    assert!(matches!(tx.put("t", b"b", &[0u8; 500]), Err(Error::LimitExceeded { what: "transaction", .. })));
    tx.commit().unwrap();
    assert_eq!(get(&db, "t", b"b"), None);
    assert!(get(&db, "t", b"a").is_some());
}

#[test]
fn large_values_round_trip_through_wal_and_checkpoint() {
    let t = TestDir::new();
    let db = open(&t.path());
    let big: Vec<u8> = (0..(8 << 20)).map(|i: u32| (i % 251) as u8).collect();
    put(&db, "blobs", b"big", &big);
    db.close().unwrap();
    let db = open(&t.path());
    assert_eq!(get(&db, "blobs", b"big").as_deref(), Some(&big[..]));
    db.checkpoint().unwrap();
    db.close().unwrap();
    let db = open(&t.path());
    assert_eq!(get(&db, "blobs", b"big").as_deref(), Some(&big[..]));
}

#[test]
fn second_opener_gets_locked() {
    let t = TestDir::new();
    let db = open(&t.path());
    let again = Database::open(t.path(), opts(keeldb::Durability::Sync));
    assert!(matches!(again, Err(Error::Locked(_))), "{again:?}");
    db.close().unwrap();
    let db = open(&t.path());
    drop(db);
    // Dropping without close also releases the lock.
    let _db = open(&t.path());
}

#[test]
fn not_a_store_and_newer_version_are_clear_errors() {
    let t = TestDir::new();
    std::fs::create_dir_all(t.path()).unwrap();
    std::fs::write(t.path().join("notes.txt"), b"hello").unwrap();
    let err = Database::open(t.path(), opts(keeldb::Durability::Sync)).unwrap_err();
    assert!(matches!(err, Error::NotAStore { .. }), "{err}");
    assert!(err.to_string().contains(&t.path().display().to_string()));
    // Nothing was written into the foreign directory.
    assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 1);

    let t2 = TestDir::new();
    let db = open(&t2.path());
    db.close().unwrap();
    let ident = t2.path().join("KEELDB");
    let mut bytes = std::fs::read(&ident).unwrap();
    bytes[8..12].copy_from_slice(&99u32.to_le_bytes());
    let crc = crc32c_of(&bytes[..12]);
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&ident, &bytes).unwrap();
    let err = Database::open(t2.path(), opts(keeldb::Durability::Sync)).unwrap_err();
    assert!(matches!(err, Error::UnsupportedVersion { found: 99, supported: 1, .. }), "{err}");
}

fn crc32c_of(b: &[u8]) -> u32 {
    // Bitwise CRC32C (Castagnoli), enough for a 12-byte test input.
    let mut crc = !0u32;
    for &byte in b {
        crc ^= byte as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

#[test]
fn closed_database_refuses_work() {
    let t = TestDir::new();
    let db = open(&t.path());
    let clone = db.clone();
    db.close().unwrap();
    assert!(matches!(clone.begin_read(), Err(Error::Closed)));
    assert!(matches!(clone.begin_write(), Err(Error::Closed)));
}

#[test]
fn transact_returns_the_closure_value() {
    let t = TestDir::new();
    let db = open(&t.path());
    let n = db
        .transact(|tx| {
            tx.put("t", b"k", b"v")?;
            Ok(42)
        })
        .unwrap();
    assert_eq!(n, 42);
    let err = db.transact(|tx| -> keeldb::Result<()> {
        tx.put("t", b"k2", b"v")?;
        Err(Error::InvalidArgument("user abort".into()))
    });
    assert!(err.is_err());
    assert_eq!(get(&db, "t", b"k2"), None);
}

#[test]
fn ids_are_unique_across_threads_reopens_and_never_conflict() {
    let t = TestDir::new();
    let mut seen = std::collections::HashSet::new();
    for _round in 0..3 {
        let db = open(&t.path());
        let ids: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    let db = db.clone();
                    s.spawn(move || (0..3000).map(|_| db.next_id().unwrap()).collect::<Vec<u64>>())
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        for id in ids {
            assert!(id > 0);
            assert!(seen.insert(id), "id {id} handed out twice");
        }
        // Two transactions that both allocate ids and write different keys both commit.
        let mut a = db.begin_write().unwrap();
        let mut b = db.begin_write().unwrap();
        let ia = a.database().next_id().unwrap();
        let ib = b.database().next_id().unwrap();
        a.put("nodes", &ia.to_be_bytes(), b"a").unwrap();
        b.put("nodes", &ib.to_be_bytes(), b"b").unwrap();
        a.commit().unwrap();
        b.commit().unwrap();
        // The allocator's table is the engine's own and is not listed.
        assert_eq!(db.begin_read().unwrap().tables(), ["nodes"]);
        drop(db); // no clean close: ids must still never repeat
    }
}

#[test]
fn reserved_tables_refuse_public_writes_drops_and_creation() {
    let t = TestDir::new();
    let db = open(&t.path());
    let first_id = db.next_id().unwrap();
    put(&db, "users", b"k", b"v");
    let (digest, last) = (db.digest(), db.stats().last_commit_ts);
    for table in ["__keeldb/ids", "__keeldb/graph/g/node", "__keeldb/new"] {
        let mut tx = db.begin_write().unwrap();
        assert!(matches!(tx.put(table, b"next", &1u64.to_le_bytes()), Err(Error::ReservedTable(ref n)) if n == table));
        assert!(matches!(tx.delete(table, b"next"), Err(Error::ReservedTable(_))));
        assert!(matches!(tx.drop_table(table), Err(Error::ReservedTable(_))));
        assert!(!tx.is_dirty(), "{table}: a refused write must leave nothing in the write set");
        tx.commit().unwrap();
    }
    assert_eq!((db.digest(), db.stats().last_commit_ts), (digest, last), "refused writes changed the store");
    // The engine keeps its own access: ids still come from the reserved table, never repeating
    // across a reopen.
    let second_id = db.next_id().unwrap();
    db.close().unwrap();
    let db = open(&t.path());
    let third_id = db.next_id().unwrap();
    assert!(first_id < second_id && second_id < third_id, "{first_id} {second_id} {third_id}");
    assert_eq!(db.begin_read().unwrap().tables(), ["users"]);
}

#[test]
fn reserved_tables_can_still_be_read() {
    let t = TestDir::new();
    let db = open(&t.path());
    db.next_id().unwrap();
    let rx = db.begin_read().unwrap();
    assert!(rx.get("__keeldb/ids", b"next").unwrap().is_some());
}

#[test]
fn an_empty_path_is_an_invalid_argument_and_creates_nothing() {
    let lock_in_cwd = std::path::Path::new("LOCK");
    let existed = lock_in_cwd.exists();
    assert!(matches!(Database::open("", opts(Durability::Sync)), Err(Error::InvalidArgument(_))));
    if !existed {
        assert!(!lock_in_cwd.exists(), "a failed open left a LOCK file in the working directory");
    }
}

#[test]
fn a_path_that_is_a_file_is_not_a_store_and_is_left_alone() {
    let t = TestDir::new();
    let file = t.dir.path().join("plain-file");
    std::fs::write(&file, b"hello").unwrap();
    assert!(matches!(Database::open(&file, opts(Durability::Sync)), Err(Error::NotAStore { .. })));
    assert_eq!(std::fs::read(&file).unwrap(), b"hello");
    let names: Vec<_> = std::fs::read_dir(t.dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["plain-file"], "a failed open created files");
}

#[test]
fn get_into_replaces_the_buffer_and_agrees_with_get() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"short", b"s");
    put(&db, "t", b"long", &[7u8; 300]);
    put(&db, "t", b"gone", b"here before");
    let old = db.begin_read().unwrap();
    let mut tx = db.begin_write().unwrap();
    tx.delete("t", b"gone").unwrap();
    tx.put("t", b"short", b"changed").unwrap();
    tx.commit().unwrap();
    let now = db.begin_read().unwrap();

    let mut buf = b"left over from before".to_vec();
    for rx in [&old, &now] {
        for key in [&b"short"[..], b"long", b"gone", b"never"] {
            let found = rx.get_into("t", key, &mut buf).unwrap();
            let expected = rx.get("t", key).unwrap();
            assert_eq!(found, expected.is_some(), "{key:?}");
            assert_eq!(buf, expected.unwrap_or_default(), "{key:?}: the buffer holds exactly the value");
        }
        buf.extend_from_slice(b"junk");
        assert!(!rx.get_into("no such table", b"k", &mut buf).unwrap());
        assert!(buf.is_empty(), "a missing table empties the buffer too");
    }
    assert_eq!(old.get_into("t", b"short", &mut buf).ok(), Some(true));
    assert_eq!(buf, b"s", "the old snapshot's value");

    // Bad input is refused and leaves the buffer alone.
    let before = buf.clone();
    let big_key = vec![0u8; MAX_KEY_BYTES + 1];
    assert!(matches!(now.get_into("t", &big_key, &mut buf), Err(Error::LimitExceeded { what: "key", .. })));
    assert!(matches!(now.get_into("", b"k", &mut buf), Err(Error::InvalidArgument(_))));
    assert_eq!(buf, before);
}

#[test]
fn get_many_agrees_with_get_key_by_key() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut tx = db.begin_write().unwrap();
    for i in 0..1_000u32 {
        tx.put("t", format!("key-{i}").as_bytes(), &i.to_le_bytes()).unwrap();
    }
    tx.put("t", b"a-long-key-that-is-not-stored-inline-in-its-slot", b"long").unwrap();
    tx.commit().unwrap();
    let old = db.begin_read().unwrap();
    let mut tx = db.begin_write().unwrap();
    for i in (0..1_000u32).step_by(3) {
        tx.delete("t", format!("key-{i}").as_bytes()).unwrap();
    }
    tx.commit().unwrap();
    let now = db.begin_read().unwrap();

    // Present, deleted, never written, repeated, and more keys than one batch.
    let mut keys: Vec<Vec<u8>> = (0..1_100u32).rev().map(|i| format!("key-{i}").into_bytes()).collect();
    keys.push(b"key-5".to_vec());
    keys.push(b"a-long-key-that-is-not-stored-inline-in-its-slot".to_vec());
    keys.push(Vec::new());
    for rx in [&old, &now] {
        let many = rx.get_many("t", &keys).unwrap();
        assert_eq!(many.len(), keys.len());
        for (key, value) in keys.iter().zip(&many) {
            assert_eq!(value, &rx.get("t", key).unwrap(), "{key:?}");
        }
        assert!(rx.get_many("t", &[] as &[&[u8]]).unwrap().is_empty());
        assert_eq!(rx.get_many("no such table", &keys[..3]).unwrap(), vec![None, None, None]);
    }
    assert_eq!(now.get_many("t", &[b"key-3"]).unwrap(), vec![None], "deleted at this snapshot");
    assert_eq!(old.get_many("t", &[b"key-3"]).unwrap(), vec![Some(3u32.to_le_bytes().to_vec())]);

    // One bad key refuses the whole call.
    let big_key = vec![0u8; MAX_KEY_BYTES + 1];
    let err = now.get_many("t", &[&b"key-1"[..], &big_key]).unwrap_err();
    assert!(matches!(err, Error::LimitExceeded { what: "key", .. }), "{err}");
}

#[test]
fn write_txn_get_many_sees_own_writes_and_agrees_with_get() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut tx = db.begin_write().unwrap();
    for i in 0..300u32 {
        tx.put("t", format!("key-{i}").as_bytes(), &i.to_le_bytes()).unwrap();
    }
    tx.commit().unwrap();

    let mut tx = db.begin_write().unwrap();
    for i in (0..300u32).step_by(5) {
        tx.put("t", format!("key-{i}").as_bytes(), b"own").unwrap();
    }
    for i in (1..300u32).step_by(7) {
        tx.delete("t", format!("key-{i}").as_bytes()).unwrap();
    }
    tx.put("t", b"new-key", b"fresh").unwrap();
    // Own puts, own deletes, snapshot values, a new key, absent keys, a repeat.
    let mut keys: Vec<Vec<u8>> = (0..320u32).rev().map(|i| format!("key-{i}").into_bytes()).collect();
    keys.push(b"new-key".to_vec());
    keys.push(b"key-5".to_vec());
    let many = tx.get_many("t", &keys).unwrap();
    assert_eq!(many.len(), keys.len());
    for (key, value) in keys.iter().zip(&many) {
        assert_eq!(value, &tx.get("t", key).unwrap(), "{key:?}");
    }
    assert_eq!(
        tx.get_many("t", &[b"key-5", b"key-1", b"key-2"]).unwrap(),
        vec![Some(b"own".to_vec()), None, Some(2u32.to_le_bytes().to_vec())]
    );
    assert_eq!(tx.get_many("nothing here", &[b"k"]).unwrap(), vec![None]);

    // A table dropped in this transaction shows only what was written after the drop.
    assert!(tx.drop_table("t").unwrap());
    tx.put("t", b"key-9", b"after drop").unwrap();
    assert_eq!(tx.get_many("t", &[b"key-9", b"key-2"]).unwrap(), vec![Some(b"after drop".to_vec()), None]);

    // One bad key refuses the whole call and leaves the transaction usable.
    let big_key = vec![0u8; MAX_KEY_BYTES + 1];
    let err = tx.get_many("t", &[&b"key-9"[..], &big_key]).unwrap_err();
    assert!(matches!(err, Error::LimitExceeded { what: "key", .. }), "{err}");
    tx.commit().unwrap();
    assert_eq!(get(&db, "t", b"key-9").as_deref(), Some(&b"after drop"[..]));
    assert_eq!(get(&db, "t", b"key-2"), None);
}
