//! Checkpoint streams end to end on the real file system: export from a store while writers
//! commit, install into another store, and check that the installed state is exactly the
//! exporter's at the exported timestamp, survives reopen, and takes new commits; what
//! snapshots and transactions that straddle an install see; timestamps when the installing
//! store is ahead of or behind the stream; the applied log position a stream carries; the
//! change feed and history floor across an install; a cleanly closed store that installs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::*;
use keeldb::{Command, ConflictReason, Database, Durability, Error, LogPosition, Options, StateDigest};

type State = BTreeMap<(String, Vec<u8>), Vec<u8>>;
/// A committed write: timestamp, table, key, value (`None`: deleted).
type Logged = (u64, String, Vec<u8>, Option<Vec<u8>>);

/// Every entry of every user table (and the engine's id table, which `tables()` hides).
fn contents(db: &Database) -> State {
    let rx = db.begin_read().unwrap();
    let mut names = rx.tables();
    names.push(format!("{}ids", keeldb::RESERVED_TABLE_PREFIX));
    let mut out = State::new();
    for t in names {
        for (k, v) in scan_all(db, &t) {
            out.insert((t.clone(), k), v);
        }
    }
    out
}

fn digest_of(state: &State) -> StateDigest {
    let mut d = StateDigest::default();
    for ((t, k), v) in state {
        d.add(t, k, v);
    }
    d
}

fn seed_store(db: &Database, tables: usize, keys: usize) {
    for t in 0..tables {
        let mut tx = db.begin_write().unwrap();
        for k in 0..keys {
            tx.put(&format!("t{t}"), format!("key-{k:05}").as_bytes(), &vec![(t * 7 + k) as u8; 10 + k % 90]).unwrap();
        }
        tx.commit().unwrap();
    }
}

#[test]
fn round_trip_while_writers_commit_then_reopen_and_commit_more() {
    let (da, db_dir) = (TestDir::new(), TestDir::new());
    let a = Database::open(da.path(), opts(Durability::Relaxed)).unwrap();
    seed_store(&a, 3, 400);
    a.next_id().unwrap();
    let initial = contents(&a);
    let start_ts = a.begin_read().unwrap().snapshot_ts();
    // Each writer owns its keys, so no commit conflicts; every commit is logged with its ts.
    // Writers run until told to stop (at most 20,000 commits each), and the export starts
    // once they have committed and stops them only after they committed more, so the export
    // provably overlaps commits.
    let log: Arc<Mutex<Vec<Logged>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let (a, log, stop) = (a.clone(), Arc::clone(&log), Arc::clone(&stop));
            std::thread::spawn(move || {
                for i in 0..20_000u32 {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    let (table, key) = (format!("t{}", i % 3), format!("w{w}-{:03}", i % 50).into_bytes());
                    let value = (i % 7 != 6).then(|| format!("v{w}-{i}").into_bytes());
                    let mut tx = a.begin_write().unwrap();
                    match &value {
                        Some(v) => tx.put(&table, &key, v).unwrap(),
                        None => tx.delete(&table, &key).unwrap(),
                    }
                    let ts = tx.commit().unwrap().ts;
                    log.lock().unwrap().push((ts, table, key, value));
                }
            })
        })
        .collect();
    let logged = || log.lock().unwrap().len();
    let wait_for = |n: usize| {
        for _ in 0..20_000 {
            if logged() >= n {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    };
    wait_for(100);
    let mut stream = Vec::new();
    let info = a.export_checkpoint(&mut stream).unwrap();
    let after_export = logged();
    wait_for(after_export + 100);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    let log_ts: Vec<u64> = log.lock().unwrap().iter().map(|e| e.0).collect();
    assert!(log_ts.iter().any(|&t| t <= info.ts) && log_ts.iter().any(|&t| t > info.ts), "export overlapped commits");
    assert_eq!(info.bytes, stream.len() as u64);
    assert!(info.ts >= start_ts);
    // The exporter's state at the exported timestamp, rebuilt from the commit log.
    let mut expected = initial;
    let mut log = log.lock().unwrap().clone();
    log.sort_by_key(|e| e.0);
    for (ts, table, key, value) in log.into_iter().filter(|e| e.0 <= info.ts) {
        assert!(ts > start_ts);
        match value {
            Some(v) => expected.insert((table, key), v),
            None => expected.remove(&(table, key)),
        };
    }
    assert_eq!(digest_of(&expected), info.digest, "the stream's digest is the state at its ts");

    let b = open(&db_dir.path());
    seed_store(&b, 2, 50);
    let installed = b.install_checkpoint(&mut stream.as_slice()).unwrap();
    assert_eq!((installed.source_ts, installed.digest, installed.entries), (info.ts, info.digest, info.entries));
    assert_eq!(b.digest(), info.digest);
    assert_eq!(contents(&b), expected);
    // One checkpoint and one fresh segment remain on disk.
    assert_eq!(files(&db_dir.path(), "checkpoint-").len(), 1);
    assert_eq!(files(&db_dir.path(), "wal-").len(), 1);
    assert!(files(&db_dir.path(), "INSTALL").is_empty());
    b.close().unwrap();

    let b = open(&db_dir.path());
    assert_eq!(b.recovery_report().checkpoint.map(|c| c.1), Some(installed.ts));
    assert_eq!((b.digest(), contents(&b)), (info.digest, expected.clone()));
    let ts = put(&b, "after", b"k", b"v");
    assert_eq!(ts, installed.ts + 1, "timestamps continue from the installed state");
    drop(b); // No clean close: the commit must come back from the WAL.
    let b = open(&db_dir.path());
    assert_eq!(get(&b, "after", b"k").as_deref(), Some(&b"v"[..]));
    let mut with_after = expected;
    with_after.insert(("after".into(), b"k".to_vec()), b"v".to_vec());
    assert_eq!(contents(&b), with_after);
    b.checkpoint().unwrap();
    b.close().unwrap();
    a.close().unwrap();
}

#[test]
fn timestamps_continue_from_the_stream_or_past_the_local_log() {
    let (da, db_dir) = (TestDir::new(), TestDir::new());
    let a = open(&da.path());
    for i in 0..20u32 {
        put(&a, "t", &i.to_be_bytes(), b"a");
    }
    let mut stream = Vec::new();
    let exported = a.export_checkpoint(&mut stream).unwrap();
    // Behind: the installing store has fewer commits, so the stream's timestamp is kept.
    let b = open(&db_dir.path());
    put(&b, "t", b"x", b"b");
    let info = b.install_checkpoint(&mut stream.as_slice()).unwrap();
    assert_eq!((info.ts, info.source_ts, info.replaced_ts), (exported.ts, exported.ts, 1));
    // Ahead: past the stream's timestamp, local timestamps never go backwards.
    for i in 0..30u32 {
        put(&b, "u", &i.to_be_bytes(), b"b");
    }
    let last = b.begin_read().unwrap().snapshot_ts();
    let info = b.install_checkpoint(&mut stream.as_slice()).unwrap();
    assert_eq!((info.ts, info.replaced_ts), (last + 1, last));
    assert_eq!(b.digest(), exported.digest);
    assert_eq!(put(&b, "t", b"new", b"n"), last + 2);
    b.close().unwrap();
    let b = open(&db_dir.path());
    assert_eq!(get(&b, "t", b"new").as_deref(), Some(&b"n"[..]));
    assert_eq!(get(&b, "u", &0u32.to_be_bytes()), None);
}

#[test]
fn snapshots_keep_the_old_state_and_straddling_commits_conflict() {
    let (da, db_dir) = (TestDir::new(), TestDir::new());
    let a = open(&da.path());
    put(&a, "t", b"k", b"from-a");
    let ids_a: Vec<u64> = (0..3).map(|_| a.next_id().unwrap()).collect();
    let mut stream = Vec::new();
    a.export_checkpoint(&mut stream).unwrap();

    let b = open(&db_dir.path());
    put(&b, "t", b"k", b"from-b");
    put(&b, "only-b", b"x", b"y");
    let id_b = b.next_id().unwrap();
    let old_reader = b.begin_read().unwrap();
    let mut old_writer = b.begin_write().unwrap();
    old_writer.put("t", b"k2", b"late").unwrap();
    b.install_checkpoint(&mut stream.as_slice()).unwrap();

    assert_eq!(old_reader.get("t", b"k").unwrap().as_deref(), Some(&b"from-b"[..]));
    assert_eq!(old_reader.get("only-b", b"x").unwrap().as_deref(), Some(&b"y"[..]));
    assert_eq!(get(&b, "t", b"k").as_deref(), Some(&b"from-a"[..]));
    assert!(!b.begin_read().unwrap().tables().contains(&"only-b".to_owned()));
    let err = old_writer.commit().expect_err("a transaction begun before the install committed");
    assert!(matches!(err, Error::Conflict { reason: ConflictReason::StateReplaced, .. }), "{err:?}");
    assert!(err.is_retryable());
    assert_eq!(get(&b, "t", b"k2"), None);
    // Ids continue from the installed allocator, not from the replaced handle's block.
    let next = b.next_id().unwrap();
    assert_eq!(id_b, ids_a[0], "both stores handed out ids from their own first block");
    assert!(next > *ids_a.iter().max().unwrap(), "id {next} may repeat one of {ids_a:?}");
    drop(old_reader);
    b.close().unwrap();
}

/// A sink that stalls after its first write until told to go on, like a peer that stopped
/// reading; it gives up waiting after a minute so a regression fails instead of hanging.
struct StalledSink {
    bytes: Vec<u8>,
    started: std::sync::mpsc::Sender<()>,
    go: std::sync::mpsc::Receiver<()>,
}

impl std::io::Write for StalledSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.is_empty() {
            let _ = self.started.send(());
            let _ = self.go.recv_timeout(std::time::Duration::from_secs(60));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn commits_and_checkpoints_never_wait_for_a_stalled_export() {
    let d = TestDir::new();
    let a = open(&d.path());
    seed_store(&a, 4, 500);
    let before = a.digest();
    let (started_tx, started) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let exporter = {
        let (a, done) = (a.clone(), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut sink = StalledSink { bytes: Vec::new(), started: started_tx, go: go_rx };
            let info = a.export_checkpoint(&mut sink).unwrap();
            done.store(true, std::sync::atomic::Ordering::Release);
            (info, sink.bytes)
        })
    };
    started.recv().unwrap();
    for i in 0..50u32 {
        put(&a, "t0", format!("key-{i:05}").as_bytes(), b"overwritten during the export");
    }
    a.checkpoint().unwrap();
    assert!(!done.load(std::sync::atomic::Ordering::Acquire), "the commits waited for the export");
    go.send(()).unwrap();
    let (info, bytes) = exporter.join().unwrap();
    // The export holds the state from before those commits.
    assert_eq!(info.digest, before);
    let e = TestDir::new();
    let b = open(&e.path());
    b.install_checkpoint(&mut bytes.as_slice()).unwrap();
    assert_eq!(b.digest(), before);
    b.close().unwrap();
    a.close().unwrap();
}

/// Installs while writers (through `transact`, which retries the fence's conflicts) and readers
/// run, with the background worker on: nothing deadlocks, every writer's later commits land on
/// the new state, and a reopen recovers exactly the live state.
#[test]
fn install_under_concurrent_writers_and_readers() {
    let (da, db_dir) = (TestDir::new(), TestDir::new());
    let a = open(&da.path());
    seed_store(&a, 2, 300);
    let mut stream = Vec::new();
    a.export_checkpoint(&mut stream).unwrap();
    a.close().unwrap();

    let options = keeldb::Options { durability: Durability::Relaxed, ..keeldb::Options::default() };
    let b = Database::open(db_dir.path(), options.clone()).unwrap();
    seed_store(&b, 3, 100);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let installed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut threads = Vec::new();
    for w in 0..2u32 {
        let (b, stop, installed) = (b.clone(), Arc::clone(&stop), Arc::clone(&installed));
        threads.push(std::thread::spawn(move || {
            // Runs until stopped and at least one commit began after the install returned.
            let (mut last, mut after) = (0, false);
            for i in 0..200_000u32 {
                if after && stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let post = installed.load(std::sync::atomic::Ordering::Acquire);
                let key = format!("writer-{w}");
                last = b
                    .transact(|tx| {
                        tx.put("t0", key.as_bytes(), &i.to_be_bytes())?;
                        Ok(i)
                    })
                    .unwrap();
                after |= post;
            }
            last
        }));
    }
    {
        let (b, stop) = (b.clone(), Arc::clone(&stop));
        threads.push(std::thread::spawn(move || {
            let mut reads = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && reads < 100_000 {
                let rx = b.begin_read().unwrap();
                let _ = rx.get("t0", b"key-00001").unwrap();
                reads += 1;
            }
            reads
        }));
    }
    std::thread::sleep(std::time::Duration::from_millis(30));
    let info = b.install_checkpoint(&mut stream.as_slice()).unwrap();
    installed.store(true, std::sync::atomic::Ordering::Release);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let results: Vec<u32> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    // Every writer's last value is what the store holds, on top of the installed state.
    for (w, last) in results.iter().take(2).enumerate() {
        let got = get(&b, "t0", format!("writer-{w}").as_bytes());
        assert_eq!(got, Some(last.to_be_bytes().to_vec()), "writer {w}");
    }
    assert_eq!(get(&b, "t2", b"key-00001"), None, "nothing of the replaced state survives");
    assert!(b.begin_read().unwrap().snapshot_ts() >= info.ts);
    let (digest, state) = (b.digest(), contents(&b));
    b.close().unwrap();
    let b = Database::open(db_dir.path(), options).unwrap();
    assert_eq!((b.digest(), contents(&b)), (digest, state));
    b.close().unwrap();
}

/// A stream carries the exporter's applied log position; after the install `applied()` is that
/// position (on the handle and after reopen), commands at or before it are refused as out of
/// order and the next one applies.
#[test]
fn the_applied_log_position_travels_with_the_stream() {
    let (da, db_dir) = (TestDir::new(), TestDir::new());
    let a = open(&da.path());
    let commands =
        (1..=5u64).map(|i| (LogPosition::new(i, 2), Command::new().put("kv", i.to_be_bytes(), b"x"))).collect();
    assert!(a.apply_batch(commands).into_iter().all(|r| r.is_ok()));
    let mut stream = Vec::new();
    let info = a.export_checkpoint(&mut stream).unwrap();
    assert_eq!(info.applied, Some(LogPosition::new(5, 2)));

    let b = open(&db_dir.path());
    // The follower had applied a different, shorter log of its own.
    assert!(b.apply_batch(vec![(LogPosition::new(1, 1), Command::new().put("kv", b"own", b"y"))])[0].is_ok());
    let installed = b.install_checkpoint(&mut stream.as_slice()).unwrap();
    assert_eq!(installed.applied, Some(LogPosition::new(5, 2)));
    assert_eq!(b.applied(), Some(LogPosition::new(5, 2)));
    let stale = b.apply_batch(vec![(LogPosition::new(5, 2), Command::new().put("kv", b"stale", b"z"))]);
    assert!(matches!(stale[0], Err(Error::InvalidArgument(_))), "{stale:?}");
    let next = b.apply_batch(vec![(LogPosition::new(6, 2), Command::new().put("kv", b"next", b"n"))]);
    assert_eq!(next[0].as_ref().unwrap().ts(), installed.ts + 1);
    drop(b); // No clean close: the position comes back from the checkpoint and the WAL.
    let b = open(&db_dir.path());
    assert_eq!(b.applied(), Some(LogPosition::new(6, 2)));
    assert_eq!(get(&b, "kv", b"stale"), None);
    b.close().unwrap();
    // Before the command at 6 was logged, the installed checkpoint alone names 5.
    let c_dir = TestDir::new();
    let c = open(&c_dir.path());
    c.install_checkpoint(&mut stream.as_slice()).unwrap();
    drop(c);
    let c = open(&c_dir.path());
    assert_eq!((c.applied(), c.recovery_report().frames_replayed), (Some(LogPosition::new(5, 2)), 0));
    // A stream from a store that never applied a command carries no position, and installing
    // it forgets the position the replaced state had.
    let mut plain = Vec::new();
    let e_dir = TestDir::new();
    let e = open(&e_dir.path());
    put(&e, "t", b"k", b"v");
    assert_eq!(e.export_checkpoint(&mut plain).unwrap().applied, None);
    c.install_checkpoint(&mut plain.as_slice()).unwrap();
    assert_eq!(c.applied(), None);
    c.close().unwrap();
    e.close().unwrap();
    a.close().unwrap();
}

/// The change feed cannot describe an install, so it restarts at the installed timestamp:
/// asking for changes after an earlier timestamp is `Compacted` (the consumer reads the state
/// anew), the floor moves to the installed timestamp, and changes after it flow as before.
#[test]
fn the_change_feed_and_history_floor_restart_at_the_installed_timestamp() {
    let (da, db_dir) = (TestDir::new(), TestDir::new());
    let a = open(&da.path());
    for i in 0..10u32 {
        put(&a, "t", &i.to_be_bytes(), b"a");
    }
    let mut stream = Vec::new();
    a.export_checkpoint(&mut stream).unwrap();
    a.close().unwrap();

    let options = Options { keep_history: true, ..opts(Durability::Sync) };
    let b = Database::open(db_dir.path(), options).unwrap();
    let floor = b.history_floor().unwrap();
    let before = put(&b, "t", b"mine", b"b");
    assert_eq!(b.changes_since(floor, 100).unwrap().len(), 1);
    let reader = b.begin_read_at(before).unwrap();
    let info = b.install_checkpoint(&mut stream.as_slice()).unwrap();
    assert_eq!(b.history_floor(), Some(info.ts));
    for after in [floor, before, info.ts - 1] {
        match b.changes_since(after, 100) {
            Err(Error::Compacted { requested, available }) => assert_eq!((requested, available), (after, info.ts)),
            other => panic!("changes after {after} across the install: {other:?}"),
        }
    }
    assert!(b.changes_since(info.ts, 100).unwrap().is_empty());
    // A read at a past timestamp that was registered before keeps reading the old state; a new
    // one below the installed timestamp is refused once no snapshot holds that history.
    assert_eq!(reader.get("t", b"mine").unwrap().as_deref(), Some(&b"b"[..]));
    drop(reader);
    assert!(matches!(b.begin_read_at(before), Err(Error::Compacted { available, .. }) if available == info.ts));
    let ts = put(&b, "t", b"new", b"n");
    let changes = b.changes_since(info.ts, 100).unwrap();
    assert_eq!(changes.len(), 1);
    assert_eq!((changes[0].ts, &changes[0].key[..]), (ts, &b"new"[..]));
    assert_eq!(b.begin_read_at(info.ts).unwrap().get("t", b"mine").unwrap(), None);
    b.close().unwrap();
}

/// A store that was closed cleanly (so it holds a `CLOSED` marker) and reopened installs a
/// stream; the marker is retired with the old log, and the store opens to the new state, closes
/// cleanly and opens again.
#[test]
fn a_cleanly_closed_store_installs_and_reopens() {
    let (da, db_dir) = (TestDir::new(), TestDir::new());
    let a = open(&da.path());
    seed_store(&a, 2, 100);
    let mut stream = Vec::new();
    let exported = a.export_checkpoint(&mut stream).unwrap();
    a.close().unwrap();

    let b = open(&db_dir.path());
    seed_store(&b, 3, 20);
    b.close().unwrap();
    assert_eq!(files(&db_dir.path(), "CLOSED").len(), 1);
    let b = open(&db_dir.path());
    b.install_checkpoint(&mut stream.as_slice()).unwrap();
    assert!(files(&db_dir.path(), "CLOSED").is_empty(), "the old log's clean-close claim is retired");
    drop(b); // Not a clean close.
    let b = open(&db_dir.path());
    assert_eq!(b.digest(), exported.digest);
    put(&b, "t9", b"k", b"v");
    let digest = b.digest();
    b.close().unwrap();
    let b = open(&db_dir.path());
    assert!(b.recovery_report().clean_shutdown);
    assert_eq!(b.digest(), digest);
    b.close().unwrap();
}
