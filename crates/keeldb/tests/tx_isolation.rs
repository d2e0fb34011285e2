//! Isolation: first committer wins, lost updates are impossible, write skew is possible under
//! snapshot isolation and impossible under serializable, snapshots are stable.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;
use common::*;
use keeldb::{Error, Isolation, ScanRange, TxnOptions};

#[test]
fn first_committer_wins_on_write_write_conflict() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"k", b"0");
    let mut a = db.begin_write().unwrap();
    let mut b = db.begin_write().unwrap();
    a.put("t", b"k", b"a").unwrap();
    b.put("t", b"k", b"b").unwrap();
    a.commit().unwrap();
    let err = b.commit().unwrap_err();
    assert!(matches!(err, Error::Conflict { .. }), "{err}");
    assert!(err.is_retryable());
    assert_eq!(get(&db, "t", b"k").as_deref(), Some(&b"a"[..]));
}

#[test]
fn disjoint_writers_both_commit() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut a = db.begin_write().unwrap();
    let mut b = db.begin_write().unwrap();
    a.put("t", b"x", b"a").unwrap();
    b.put("t", b"y", b"b").unwrap();
    a.commit().unwrap();
    b.commit().unwrap();
    assert_eq!(scan_all(&db, "t").len(), 2);
}

#[test]
fn lost_updates_are_impossible_with_concurrent_increments() {
    let t = TestDir::new();
    let db = keeldb::Database::open(t.path(), opts(keeldb::Durability::Relaxed)).unwrap();
    put(&db, "c", b"n", &0u64.to_le_bytes());
    let threads = 8;
    let per = 200;
    std::thread::scope(|s| {
        for _ in 0..threads {
            let db = db.clone();
            s.spawn(move || {
                for _ in 0..per {
                    db.transact(|tx| {
                        let cur = u64::from_le_bytes(tx.get("c", b"n")?.unwrap().try_into().unwrap());
                        tx.put("c", b"n", &(cur + 1).to_le_bytes())
                    })
                    .unwrap();
                }
            });
        }
    });
    let n = u64::from_le_bytes(get(&db, "c", b"n").unwrap().try_into().unwrap());
    assert_eq!(n, threads * per);
}

/// Two on-call doctors; each transaction takes one off call if the other is still on call.
fn write_skew(isolation: Isolation) -> (Result<u64, Error>, Result<u64, Error>, usize) {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "oncall", b"alice", b"1");
    put(&db, "oncall", b"bob", b"1");
    let o = TxnOptions { isolation: Some(isolation), ..Default::default() };
    let mut a = db.begin_write_with(o.clone()).unwrap();
    let mut b = db.begin_write_with(o.clone()).unwrap();
    let on_a = a.scan("oncall", ScanRange::all()).unwrap().count();
    let on_b = b.scan("oncall", ScanRange::all()).unwrap().count();
    assert_eq!((on_a, on_b), (2, 2));
    a.delete("oncall", b"alice").unwrap();
    b.delete("oncall", b"bob").unwrap();
    let ra = a.commit().map(|c| c.ts);
    let rb = b.commit().map(|c| c.ts);
    let left = scan_all(&db, "oncall").len();
    (ra, rb, left)
}

#[test]
fn write_skew_is_possible_under_snapshot_isolation() {
    let (a, b, left) = write_skew(Isolation::Snapshot);
    assert!(a.is_ok() && b.is_ok());
    assert_eq!(left, 0, "both doctors went off call: the anomaly snapshot isolation allows");
}

#[test]
fn write_skew_is_impossible_under_serializable() {
    let (a, b, left) = write_skew(Isolation::Serializable);
    assert!(a.is_ok());
    assert!(matches!(b, Err(Error::Conflict { .. })), "{b:?}");
    assert_eq!(left, 1);
}

#[test]
fn serializable_point_reads_of_absent_keys_are_validated() {
    let t = TestDir::new();
    let db = open(&t.path());
    let o = TxnOptions { isolation: Some(Isolation::Serializable), ..Default::default() };
    let mut a = db.begin_write_with(o.clone()).unwrap();
    assert_eq!(a.get("t", b"flag").unwrap(), None);
    put(&db, "t", b"flag", b"set");
    a.put("t", b"other", b"x").unwrap();
    assert!(matches!(a.commit(), Err(Error::Conflict { .. })));
}

/// `get_many` in a serializable transaction is validated key by key as `get` is: a key it
/// read from the snapshot, changed by a later commit, fails the commit; one it read from its
/// own writes does not.
#[test]
fn serializable_get_many_reads_are_validated() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"a", b"1");
    let o = TxnOptions { isolation: Some(Isolation::Serializable), ..Default::default() };

    let mut a = db.begin_write_with(o.clone()).unwrap();
    a.put("t", b"own", b"x").unwrap();
    assert_eq!(
        a.get_many("t", &[&b"own"[..], b"a", b"absent"]).unwrap(),
        vec![Some(b"x".to_vec()), Some(b"1".to_vec()), None]
    );
    put(&db, "t", b"absent", b"now present");
    a.put("t", b"other", b"y").unwrap();
    assert!(matches!(a.commit(), Err(Error::Conflict { .. })), "a batched read of an absent key was not validated");

    let mut b = db.begin_write_with(o).unwrap();
    b.put("t", b"own", b"x").unwrap();
    assert_eq!(b.get_many("t", &[b"own"]).unwrap(), vec![Some(b"x".to_vec())]);
    put(&db, "t", b"a", b"2");
    b.commit().unwrap();
}

#[test]
fn snapshots_are_stable_while_writers_commit() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"k", b"v1");
    let rx = db.begin_read().unwrap();
    for i in 2..20 {
        put(&db, "t", b"k", format!("v{i}").as_bytes());
        put(&db, "t", format!("new{i}").as_bytes(), b"x");
    }
    assert_eq!(rx.get("t", b"k").unwrap().as_deref(), Some(&b"v1"[..]));
    assert_eq!(rx.scan("t", ScanRange::all()).unwrap().count(), 1);
    assert_eq!(get(&db, "t", b"k").as_deref(), Some(&b"v19"[..]));
}

#[test]
fn concurrent_table_drop_conflicts_with_writers() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"k", b"v");
    let mut writer = db.begin_write().unwrap();
    let mut dropper = db.begin_write().unwrap();
    writer.put("t", b"k2", b"v").unwrap();
    dropper.drop_table("t").unwrap();
    dropper.commit().unwrap();
    assert!(matches!(writer.commit(), Err(Error::Conflict { .. })));
    assert!(db.begin_read().unwrap().tables().is_empty());
}

#[test]
fn readers_never_see_a_partial_commit() {
    let t = TestDir::new();
    let db = keeldb::Database::open(t.path(), opts(keeldb::Durability::Relaxed)).unwrap();
    // Invariant: a + b == 100 in every committed state.
    let mut tx = db.begin_write().unwrap();
    tx.put("acct", b"a", &100i64.to_le_bytes()).unwrap();
    tx.put("acct", b"b", &0i64.to_le_bytes()).unwrap();
    tx.commit().unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let dbw = db.clone();
        let stop_ref = &stop;
        s.spawn(move || {
            for i in 0..2000i64 {
                dbw.transact(|tx| {
                    tx.put("acct", b"a", &(100 - i % 100).to_le_bytes())?;
                    tx.put("acct", b"b", &(i % 100).to_le_bytes())
                })
                .unwrap();
            }
            stop_ref.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        let dbr = db.clone();
        let stop_r = &stop;
        s.spawn(move || {
            let mut checks = 0;
            while !stop_r.load(std::sync::atomic::Ordering::SeqCst) || checks < 10 {
                let rx = dbr.begin_read().unwrap();
                let a = i64::from_le_bytes(rx.get("acct", b"a").unwrap().unwrap().try_into().unwrap());
                let b = i64::from_le_bytes(rx.get("acct", b"b").unwrap().unwrap().try_into().unwrap());
                assert_eq!(a + b, 100);
                checks += 1;
            }
        });
    });
}

#[test]
fn serializable_read_only_transactions_validate_without_logging() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"k", b"1");
    let o = TxnOptions { isolation: Some(Isolation::Serializable), ..Default::default() };
    let before = db.stats();
    // Unchanged reads: commits, and nothing reaches the WAL.
    let mut r = db.begin_write_with(o.clone()).unwrap();
    assert_eq!(r.get("t", b"k").unwrap().as_deref(), Some(&b"1"[..]));
    r.commit().unwrap();
    let after = db.stats();
    assert_eq!((before.wal_bytes, before.commits), (after.wal_bytes, after.commits));
    // A concurrent change to what it read: conflict.
    let mut r = db.begin_write_with(o.clone()).unwrap();
    r.get("t", b"k").unwrap();
    put(&db, "t", b"k", b"2");
    assert!(matches!(r.commit(), Err(Error::Conflict { .. })));
}

/// A snapshot remembers the first table it found by name (reads of it skip the catalog). It
/// must keep reading the tables of its own timestamp: not a table dropped and created again
/// under the same name after it, nor another table's data for a different name.
#[test]
fn a_snapshot_keeps_its_tables_across_drop_and_recreate() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"k", b"old");
    put(&db, "u", b"k", b"u");
    let rx = db.begin_read().unwrap();
    let mut wx = db.begin_write().unwrap();
    let mut before = db.begin_write().unwrap();
    assert_eq!(rx.get("t", b"k").unwrap().as_deref(), Some(&b"old"[..]));
    assert_eq!(before.get("t", b"k").unwrap().as_deref(), Some(&b"old"[..]));
    // Not created yet at these snapshots, and that is not remembered as absent forever for
    // the snapshots that come later.
    assert_eq!(rx.get("n", b"k").unwrap(), None);

    wx.drop_table("t").unwrap();
    wx.commit().unwrap();
    put(&db, "t", b"k", b"new");
    put(&db, "n", b"k", b"n");

    for _ in 0..2 {
        assert_eq!(rx.get("t", b"k").unwrap().as_deref(), Some(&b"old"[..]), "the dropped table, as of the snapshot");
        assert_eq!(rx.get("u", b"k").unwrap().as_deref(), Some(&b"u"[..]), "another table by its own name");
        assert_eq!(rx.get("n", b"k").unwrap(), None, "created after the snapshot");
    }
    let scanned: Vec<_> = rx.scan("t", ScanRange::all()).unwrap().map(|e| e.unwrap()).collect();
    assert_eq!(scanned, vec![(b"k".to_vec(), b"old".to_vec())]);
    assert_eq!(before.get("t", b"k").unwrap().as_deref(), Some(&b"old"[..]));

    let fresh = db.begin_read().unwrap();
    assert_eq!(fresh.get("u", b"k").unwrap().as_deref(), Some(&b"u"[..]));
    assert_eq!(fresh.get("t", b"k").unwrap().as_deref(), Some(&b"new"[..]), "the table created again");
    assert_eq!(fresh.get("n", b"k").unwrap().as_deref(), Some(&b"n"[..]));
}
