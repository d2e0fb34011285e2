//! Injected I/O errors on the simulated disk. A failed fdatasync or write poisons the database:
//! the commit fails, every later commit fails with `Poisoned`, reads of already-visible data
//! still work, and after a reopen (with or without a crash) every acknowledged commit is there.
//! Short writes are invisible to users. ENOSPC is an error, poisons, and the store recovers once
//! space is free. A failed fdatasync is modelled the Linux way (the dirty pages are dropped, a
//! retried fsync "succeeds"), so nothing may rely on retrying one.
//!
//! `KEEL_SIM_SEED=<n>` replays one seed of the random-fault workload; `KEEL_SIM_ITERS=<n>`
//! runs more.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use keel_testkit::model::{History, Model, WriteSet};
use keel_testkit::sim::{Fault, FaultError, FaultModel, FaultOp, SimFs};
use keel_testkit::workload::{run_seeds, seeds, sim_options, store_path, CrashWorkload};
use keeldb::{Database, Durability, Error};

fn open(fs: &SimFs, d: Durability) -> keeldb::Result<Database> {
    Database::open(store_path(), sim_options(fs, d))
}

/// A fresh store on a fresh disk.
fn fresh(seed: u64, d: Durability) -> (SimFs, Database, History) {
    let fs = SimFs::new(seed);
    fs.create_dir_durable(store_path()).unwrap();
    let db = open(&fs, d).unwrap();
    (fs, db, History::new(Model::default(), 0))
}

/// Commits `n` puts of ~`size` bytes; returns the acknowledged timestamps.
fn commit_n(db: &Database, hist: &mut History, from: u64, n: u64, size: usize) {
    for i in from..from + n {
        let mut ws = WriteSet::default();
        let mut tx = db.begin_write().unwrap();
        let key = format!("k{:03}", i % 50);
        let value = vec![i as u8; size];
        tx.put("t", key.as_bytes(), &value).unwrap();
        ws.put("t", key.as_bytes(), &value);
        let ts = tx.commit().unwrap().ts;
        hist.acked(ts, ws).unwrap();
    }
}

/// Tries one commit that is expected to fail; records it as of unknown fate.
fn failing_commit(db: &Database, hist: &mut History, i: u64) -> Error {
    let mut ws = WriteSet::default();
    let mut tx = db.begin_write().unwrap();
    let value = vec![0xEE; 200];
    tx.put("t", format!("f{i}").as_bytes(), &value).unwrap();
    ws.put("t", format!("f{i}").as_bytes(), &value);
    let err = tx.commit().expect_err("the commit must fail");
    hist.failed(ws);
    err
}

/// After a poisoning failure: later commits fail with `Poisoned`, reads see exactly the
/// acknowledged state.
fn assert_poisoned(db: &Database, hist: &mut History) {
    for i in 0..3 {
        let mut tx = db.begin_write().unwrap();
        tx.put("t", b"after", b"x").unwrap();
        match tx.commit() {
            Err(Error::Poisoned(_)) => {}
            other => panic!("commit {i} after the failure returned {other:?}, not Poisoned"),
        }
    }
    hist.latest().compare(db).expect("reads of visible data still work and match the acknowledged state");
}

/// Reopens by each route (no crash, process kill, power loss) and checks the history.
fn reopen_each_way(fs: &SimFs, db: Database, hist: &History, d: Durability, route: u8) {
    let mut hist = hist.clone();
    match route {
        0 => {
            hist.require_all();
            drop(db);
        }
        1 => {
            hist.require_all();
            fs.kill_process();
            drop(db);
        }
        _ => {
            fs.crash();
            drop(db);
        }
    }
    fs.clear_faults();
    let db = open(fs, d).unwrap_or_else(|e| panic!("reopen (route {route}) failed: {e}"));
    hist.check(&db).unwrap_or_else(|e| panic!("route {route}: {e}"));
    // And the store takes writes again.
    let mut tx = db.begin_write().unwrap();
    tx.put("t", b"again", b"1").unwrap();
    tx.commit().expect("a reopened store accepts commits");
}

fn poison_then_reopen(fault: Fault, d: Durability, size: usize) {
    for route in 0..3u8 {
        for seed in 0..8 {
            let (fs, db, mut hist) = fresh(seed * 10 + u64::from(route), d);
            commit_n(&db, &mut hist, 0, 20, size);
            if d == Durability::Sync {
                hist.require_all();
            }
            fs.inject(fault.clone());
            // Relaxed commits do not fsync: keep committing until the fault fires.
            let mut i = 0;
            let err = loop {
                let mut tx = db.begin_write().unwrap();
                let mut ws = WriteSet::default();
                let value = vec![i as u8; size];
                tx.put("t", format!("k{:03}", i % 50).as_bytes(), &value).unwrap();
                ws.put("t", format!("k{:03}", i % 50).as_bytes(), &value);
                match tx.commit() {
                    Ok(info) => hist.acked(info.ts, ws).unwrap(),
                    Err(e) => {
                        hist.failed(ws);
                        break e;
                    }
                }
                assert!(i < 400, "the injected fault never failed a commit");
                i += 1;
            };
            assert!(matches!(err, Error::Poisoned(_) | Error::Io { .. }), "{err:?}");
            assert_poisoned(&db, &mut hist);
            reopen_each_way(&fs, db, &hist, d, route);
        }
    }
}

#[test]
fn failed_fsync_poisons_and_reopen_recovers() {
    poison_then_reopen(Fault::new(FaultOp::SyncData).on_path("wal-"), Durability::Sync, 100);
}

#[test]
fn failed_write_poisons_and_reopen_recovers() {
    poison_then_reopen(Fault::new(FaultOp::Write).on_path("wal-"), Durability::Sync, 100);
    poison_then_reopen(Fault::new(FaultOp::Write).on_path("wal-"), Durability::Relaxed, 100);
}

#[test]
fn partial_write_poisons_and_the_fragment_is_a_torn_tail() {
    poison_then_reopen(
        Fault::new(FaultOp::Write).on_path("wal-").error(FaultError::PartialWrite),
        Durability::Sync,
        1500,
    );
}

#[test]
fn failed_segment_creation_poisons_and_reopen_recovers() {
    // Large values fill the 4 KiB segments quickly, so a commit must roll.
    poison_then_reopen(Fault::new(FaultOp::Create).on_path("wal-"), Durability::Sync, 1500);
    poison_then_reopen(Fault::new(FaultOp::SyncDir), Durability::Sync, 1500);
}

#[test]
fn enospc_is_an_error_poisons_and_the_store_recovers_once_space_is_free() {
    for seed in 0..6 {
        let (fs, db, mut hist) = fresh(100 + seed, Durability::Sync);
        commit_n(&db, &mut hist, 0, 10, 300);
        hist.require_all();
        fs.inject(Fault::new(FaultOp::Write).forever().error(FaultError::NoSpace));
        let err = failing_commit(&db, &mut hist, 0);
        let text = err.to_string();
        assert!(text.contains("os error 28") || text.contains("No space"), "the error names ENOSPC: {text}");
        assert_poisoned(&db, &mut hist);
        // Still full: reopening is refused with an error (never a panic), or works read-only.
        fs.kill_process();
        drop(db);
        match open(&fs, Durability::Sync) {
            Ok(db) => {
                hist.clone().check(&db).unwrap();
                let mut tx = db.begin_write().unwrap();
                tx.put("t", b"x", b"y").unwrap();
                assert!(tx.commit().is_err(), "a commit on a full disk must fail");
                fs.kill_process();
            }
            Err(e) => assert!(e.to_string().contains("os error 28"), "open on a full disk: {e}"),
        }
        fs.clear_faults();
        let db = open(&fs, Durability::Sync).expect("open once space is free");
        hist.require_all();
        hist.check(&db).unwrap();
        commit_n(&db, &mut History::new(hist.latest().clone(), db.begin_read().unwrap().snapshot_ts()), 500, 5, 100);
    }
}

#[test]
fn short_writes_are_invisible() {
    for seed in 0..6 {
        let (fs, db, mut hist) = fresh(200 + seed, Durability::Sync);
        fs.set_short_writes(0.8);
        commit_n(&db, &mut hist, 0, 60, 2000);
        db.checkpoint().unwrap();
        commit_n(&db, &mut hist, 60, 20, 700);
        hist.require_all();
        assert!(fs.stats().short_writes > 50);
        hist.latest().compare(&db).unwrap();
        fs.crash();
        drop(db);
        let db = open(&fs, Durability::Sync).unwrap();
        hist.check(&db).unwrap();
    }
}

#[test]
fn failed_checkpoint_calls_leave_the_store_usable() {
    let faults = [
        Fault::new(FaultOp::SyncData).on_path("checkpoint-"),
        Fault::new(FaultOp::Write).on_path("checkpoint-").error(FaultError::NoSpace),
        Fault::new(FaultOp::Create).on_path("checkpoint-"),
        Fault::new(FaultOp::Rename).on_path("checkpoint-"),
        Fault::new(FaultOp::Remove).on_path("checkpoint-"),
        Fault::new(FaultOp::Remove).on_path("wal-"),
    ];
    for (n, fault) in faults.iter().enumerate() {
        for route in 0..3u8 {
            let (fs, db, mut hist) = fresh(300 + n as u64 * 3 + u64::from(route), Durability::Sync);
            commit_n(&db, &mut hist, 0, 30, 500);
            db.checkpoint().unwrap();
            commit_n(&db, &mut hist, 30, 30, 500);
            db.checkpoint().unwrap();
            commit_n(&db, &mut hist, 60, 30, 500);
            fs.inject(fault.clone());
            let result = db.checkpoint();
            assert!(fs.stats().faults_injected > 0, "fault {n} fired");
            assert!(result.is_err(), "fault {n}: a checkpoint whose call failed reports it");
            // Whether or not the engine poisons itself here, commits either work or fail
            // with Poisoned, and nothing acknowledged is lost.
            let mut tx = db.begin_write().unwrap();
            let mut ws = WriteSet::default();
            tx.put("t", b"later", b"v").unwrap();
            ws.put("t", b"later", b"v");
            match tx.commit() {
                Ok(info) => hist.acked(info.ts, ws).unwrap(),
                Err(Error::Poisoned(_)) => hist.failed(ws),
                Err(e) => panic!("fault {n}: commit after a failed checkpoint: {e:?}"),
            }
            hist.require_all();
            reopen_each_way(&fs, db, &hist, Durability::Sync, route);
        }
    }
}

/// Poisons a fresh store with `fault` on a commit, then checkpoints the poisoned database.
/// Refusing is fine; if the checkpoint succeeds, what it wrote must hold up.
fn checkpoint_on_poisoned(seed: u64, fault: Fault, power_loss: bool) -> Result<(), String> {
    let (fs, db, mut hist) = fresh(seed, Durability::Sync);
    commit_n(&db, &mut hist, 0, 10, 300);
    hist.require_all();
    fs.inject(fault);
    failing_commit(&db, &mut hist, 0);
    assert_poisoned(&db, &mut hist);
    match db.checkpoint() {
        Ok(info) => hist.require(info.ts),
        Err(Error::Poisoned(_)) => {}
        Err(e) => return Err(format!("checkpoint on a poisoned database failed with {e:?}, not Poisoned")),
    }
    if power_loss {
        fs.crash();
    } else {
        fs.kill_process();
    }
    drop(db);
    fs.clear_faults();
    let db = open(&fs, Durability::Sync).map_err(|e| format!("reopen failed: {e}"))?;
    hist.check(&db).map(drop)
}

#[test]
fn checkpoint_on_a_poisoned_database_does_not_break_recovery() {
    // After a failed fdatasync (fsyncgate: the bytes are gone from the disk although reads
    // still see them), or a partial write, the WAL has a hole or a fragment past the last good
    // frame. A checkpoint on the poisoned database must not roll the segment over it: a
    // sealed segment with a bad tail is corruption, and the store would no longer open.
    let mut failures = Vec::new();
    for seed in 0..6 {
        let cases = [
            ("failed fsync, power loss", Fault::new(FaultOp::SyncData).on_path("wal-"), true),
            (
                "partial write, power loss",
                Fault::new(FaultOp::Write).on_path("wal-").error(FaultError::PartialWrite),
                true,
            ),
            (
                "partial write, process crash",
                Fault::new(FaultOp::Write).on_path("wal-").error(FaultError::PartialWrite),
                false,
            ),
        ];
        for (name, fault, power_loss) in cases {
            if let Err(e) = checkpoint_on_poisoned(400 + seed, fault, power_loss) {
                failures.push(format!("seed {}: {name}: {e}", 400 + seed));
            }
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn failed_fsync_then_process_crash_then_power_loss_keeps_later_sync_commits() {
    // Relaxed commits sit in the page cache; the fdatasync that should make them durable
    // fails, and Linux drops the dirty pages (reads still return them). The process dies.
    // Recovery reads the commits back from the page cache and shows them; its own fdatasync
    // "succeeds" without writing them. New sync commits are acknowledged after them. A power
    // loss then must not lose the sync commits, and the store must open.
    let mut failures = Vec::new();
    for seed in 0..6 {
        let (fs, db, mut hist) = fresh(450 + seed, Durability::Relaxed);
        commit_n(&db, &mut hist, 0, 8, 200);
        fs.inject(Fault::new(FaultOp::SyncData).on_path("wal-"));
        assert!(db.checkpoint().is_err(), "the checkpoint's fdatasync fails");
        fs.kill_process();
        drop(db);
        let db = open(&fs, Durability::Sync).unwrap();
        hist.require_all();
        let (state, ts) = hist.check(&db).unwrap();
        let mut after = History::new(state, ts);
        commit_n(&db, &mut after, 100, 4, 200);
        after.require_all();
        fs.crash();
        drop(db);
        match open(&fs, Durability::Sync) {
            Ok(db) => {
                if let Err(e) = after.check(&db) {
                    failures.push(format!("seed {}: {e}", 450 + seed));
                }
            }
            Err(e) => failures.push(format!("seed {}: the store no longer opens: {e}", 450 + seed)),
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn close_after_a_failure_that_poisoned_the_database_says_so() {
    // A checkpoint's segment roll fails (its fdatasync), which poisons the database; the caller
    // sees only an I/O error from `checkpoint`. A later `close()` then cannot flush and writes
    // no clean-close mark, so it must not return Ok: under `relaxed` an Ok close is the
    // caller's promise that its acknowledged commits are durable.
    let (fs, db, mut hist) = fresh(600, Durability::Relaxed);
    commit_n(&db, &mut hist, 0, 5, 100);
    fs.inject(Fault::new(FaultOp::SyncData).on_path("wal-"));
    db.checkpoint().expect_err("the roll's fdatasync fails");
    let mut tx = db.begin_write().unwrap();
    tx.put("t", b"x", b"y").unwrap();
    assert!(matches!(tx.commit(), Err(Error::Poisoned(_))), "the failed roll poisoned the database");
    let closed = db.close();
    assert!(closed.is_err(), "close() on a poisoned database returned {closed:?}");
}

#[test]
fn a_failed_wal_segment_removal_does_not_leave_a_gap() {
    // A checkpoint deletes the WAL segments it covers, oldest first. If one removal fails, the
    // checkpoint reports an error; the segment stays on disk. A later checkpoint deletes newer
    // segments. The store must still open: an old segment left behind is not a hole in the log.
    let mut failures = Vec::new();
    for route in 0..3u8 {
        let (fs, db, mut hist) = fresh(650 + u64::from(route), Durability::Sync);
        let mut i = 0;
        let mut round = |db: &Database, hist: &mut History| {
            commit_n(db, hist, i, 12, 1200);
            i += 12;
        };
        round(&db, &mut hist);
        db.checkpoint().unwrap();
        round(&db, &mut hist);
        db.checkpoint().unwrap();
        round(&db, &mut hist);
        fs.inject(Fault::new(FaultOp::Remove).on_path("wal-"));
        assert!(db.checkpoint().is_err(), "the removal failure is reported");
        for _ in 0..3 {
            round(&db, &mut hist);
            db.checkpoint().unwrap();
        }
        hist.require_all();
        match route {
            0 => db.close().unwrap(),
            1 => {
                fs.kill_process();
                drop(db);
            }
            _ => {
                fs.crash();
                drop(db);
            }
        }
        match open(&fs, Durability::Sync) {
            Ok(db) => {
                if let Err(e) = hist.check(&db) {
                    failures.push(format!("route {route}: {e}"));
                }
            }
            Err(e) => failures.push(format!(
                "route {route}: the store no longer opens: {e} (files {:?})",
                fs.describe_dir(store_path())
            )),
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn read_errors_in_open_are_errors_not_panics() {
    for skip in 0..12 {
        let (fs, db, mut hist) = fresh(500 + skip, Durability::Sync);
        commit_n(&db, &mut hist, 0, 20, 400);
        db.checkpoint().unwrap();
        commit_n(&db, &mut hist, 20, 10, 400);
        hist.require_all();
        fs.kill_process();
        drop(db);
        fs.inject(Fault::new(FaultOp::Read).after(skip));
        if let Ok(db) = open(&fs, Durability::Sync) {
            // The fault fired on a read the engine does not need, or not at all.
            hist.clone().check(&db).unwrap();
            fs.kill_process();
        }
        fs.clear_faults();
        let db = open(&fs, Durability::Sync).unwrap();
        hist.check(&db).unwrap();
    }
}

fn random_faults(name: &str, base: u64, model: FaultModel) {
    let cfg = CrashWorkload {
        io_fault_probability: 0.7,
        mixed_durability: true,
        fault_model: model,
        ..CrashWorkload::new(Durability::Sync)
    };
    let seeds = seeds(base, 400);
    let (summary, failures) = run_seeds(name, &seeds, &cfg);
    println!("{name}: {summary:?}");
    let failed: Vec<u64> = failures.iter().map(|f| f.seed).collect();
    assert!(failures.is_empty(), "{} failing seed(s) {failed:?}; first: {}", failed.len(), failures[0]);
    if seeds.len() > 10 {
        assert!(summary.faults_fired > 0 && summary.commits_failed > 0, "faults fired: {summary:?}");
    }
}

#[test]
fn random_faults_in_random_workloads() {
    // A failed fdatasync leaves the data dirty (it may still reach the disk later).
    random_faults(
        "random_faults_in_random_workloads",
        6_000,
        FaultModel { lose_on_failed_sync: false, ..FaultModel::default() },
    );
}

#[test]
fn random_faults_in_random_workloads_fsyncgate() {
    // A failed fdatasync drops the dirty pages, as Linux does.
    random_faults("random_faults_in_random_workloads_fsyncgate", 7_000, FaultModel::default());
}
