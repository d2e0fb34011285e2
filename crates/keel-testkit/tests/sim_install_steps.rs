//! Crash at every step of a checkpoint install (fdatasync the old WAL, write and fsync the new
//! checkpoint's temporary file, retire a `CLOSED` marker and fsync the directory, write, fsync
//! and rename the `INSTALL` marker, fsync the directory, rename the checkpoint into place,
//! delete the old checkpoints and WAL segments, create the new segment, fsync, remove the
//! marker, fsync), by power loss with several crash seeds and by process kill, into a store
//! that crashed last and into one that was closed cleanly and reopened (so it holds `CLOSED`).
//! The store must always open, to exactly the old state or exactly the new one (same digest,
//! same contents), never a mix and never an open error; an install that returned `Ok` must
//! come back new; and the store must keep working afterwards.
//!
//! `KEEL_SIM_ITERS=<n>` runs n crash variants per step (default 12).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use keel_testkit::sim::{Fault, FaultOp, SimFs};
use keel_testkit::workload::{sim_options, store_path};
use keeldb::{Database, Durability, StateDigest, RESERVED_TABLE_PREFIX};

type Contents = BTreeMap<(String, Vec<u8>), Vec<u8>>;

fn contents(db: &Database) -> Contents {
    let rx = db.begin_read().unwrap();
    let mut tables = rx.tables();
    tables.push(format!("{RESERVED_TABLE_PREFIX}ids"));
    let mut out = Contents::new();
    for t in tables {
        for item in rx.scan(&t, keeldb::ScanRange::all()).unwrap() {
            let (k, v) = item.unwrap();
            out.insert((t.clone(), k), v);
        }
    }
    out
}

fn commit(db: &Database, i: u64, prefix: &str) {
    let mut tx = db.begin_write().unwrap();
    for j in 0..3u64 {
        let table = format!("{prefix}{}", (i + j) % 3);
        let key = format!("k{:02}", (i * 7 + j * 3) % 40);
        if (i + j) % 5 == 4 {
            tx.delete(&table, key.as_bytes()).unwrap();
        } else {
            tx.put(&table, key.as_bytes(), &vec![(i as u8).wrapping_mul(31) ^ j as u8; 100 + (i * 53 % 400) as usize])
                .unwrap();
        }
    }
    tx.commit().unwrap();
}

/// The stream every install under test reads, and the state it holds.
struct Source {
    stream: Vec<u8>,
    digest: StateDigest,
    contents: Contents,
}

/// A source with more commits than the built store (the installer is behind: the stream's
/// timestamp is kept) or fewer (ahead: the install gets a timestamp past the local log).
fn source(ahead: bool) -> &'static Source {
    static BEHIND: OnceLock<Source> = OnceLock::new();
    static AHEAD: OnceLock<Source> = OnceLock::new();
    let cell = if ahead { &AHEAD } else { &BEHIND };
    cell.get_or_init(|| {
        let fs = SimFs::new(7);
        let path = std::path::Path::new("/source");
        fs.create_dir_durable(path).unwrap();
        let db = Database::open(path, sim_options(&fs, Durability::Sync)).unwrap();
        for i in 0..if ahead { 20 } else { 60 } {
            commit(&db, i, "s");
        }
        db.next_id().unwrap();
        let mut stream = Vec::new();
        let info = db.export_checkpoint(&mut stream).unwrap();
        Source { stream, digest: info.digest, contents: contents(&db) }
    })
}

/// A store with two retained checkpoints and WAL in several segments after them (so the
/// install deletes checkpoints and segments), every commit synced. With `closed`, it was closed
/// cleanly and reopened, so its directory holds a `CLOSED` marker that claims the old log.
struct Built {
    fs: SimFs,
    db: Database,
    digest: StateDigest,
    contents: Contents,
}

fn build(seed: u64, closed: bool) -> Built {
    let fs = SimFs::new(seed);
    fs.create_dir_durable(store_path()).unwrap();
    let mut db = Database::open(store_path(), sim_options(&fs, Durability::Sync)).unwrap();
    for i in 0..12 {
        commit(&db, i, "t");
    }
    db.checkpoint().unwrap();
    for i in 12..30 {
        commit(&db, i, "t");
    }
    db.checkpoint().unwrap();
    for i in 30..45 {
        commit(&db, i, "t");
    }
    if closed {
        db.close().unwrap();
        db = Database::open(store_path(), sim_options(&fs, Durability::Sync)).unwrap();
        assert!(fs.describe_dir(store_path()).iter().any(|l| l.contains("CLOSED")));
    }
    let (digest, contents) = (db.digest(), contents(&db));
    Built { fs, db, digest, contents }
}

/// The mutating calls one install makes, as the simulated disk's trace names them.
fn install_steps(ahead: bool, closed: bool) -> Vec<String> {
    let b = build(0, closed);
    let before = b.fs.ops();
    b.db.install_checkpoint(&mut source(ahead).stream.as_slice()).unwrap();
    let n = (b.fs.ops() - before) as usize;
    b.fs.trace()
        .iter()
        .filter(|l| l.starts_with('#'))
        .skip_while(|l| !l.starts_with(&format!("#{} ", before + 1)))
        .take(n)
        .cloned()
        .collect()
}

fn variants() -> u64 {
    std::env::var("KEEL_SIM_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(12)
}

/// Crashes one install after `step` mutating calls; returns whether the store opened new.
fn crash_at(step: usize, variant: u64, total: usize, ahead: bool, closed: bool) -> Result<bool, String> {
    let seed = 20_000 + step as u64 * 100 + variant;
    let Built { fs, db, digest: old_digest, contents: old_contents } = build(seed, closed);
    fs.stop_after_ops(step as u64);
    let result = db.install_checkpoint(&mut source(ahead).stream.as_slice());
    match (&result, step < total) {
        (Ok(_), true) => return Err(format!("install returned Ok although call {} failed", step + 1)),
        (Err(e), false) => return Err(format!("install failed with every call allowed: {e}")),
        _ => {}
    }
    if variant % 3 == 2 {
        fs.kill_process();
    } else {
        fs.crash();
    }
    drop(db);
    let db = Database::open(store_path(), sim_options(&fs, Durability::Sync))
        .map_err(|e| format!("open after the crash failed: {e}"))?;
    let src = source(ahead);
    let (digest, now) = (db.digest(), contents(&db));
    let new = if digest == src.digest && now == src.contents {
        true
    } else if digest == old_digest && now == old_contents {
        false
    } else {
        return Err(format!("opened to neither the old nor the new state (digest {digest})"));
    };
    if result.is_ok() && !new {
        return Err("install returned Ok but the store came back old".into());
    }
    // The store keeps working: more commits, a checkpoint, a clean reopen with them all.
    for i in 100..106 {
        commit(&db, i, "after");
    }
    db.checkpoint().map_err(|e| format!("checkpoint after recovery failed: {e}"))?;
    let (digest, expected) = (db.digest(), contents(&db));
    db.close().map_err(|e| format!("close failed: {e}"))?;
    let db =
        Database::open(store_path(), sim_options(&fs, Durability::Sync)).map_err(|e| format!("reopen failed: {e}"))?;
    if db.digest() != digest || contents(&db) != expected {
        return Err("a clean reopen after recovery lost or changed commits".into());
    }
    Ok(new)
}

fn every_step(ahead: bool, closed: bool) {
    let steps = install_steps(ahead, closed);
    assert!(steps.len() >= 10, "an install makes many calls: {steps:?}");
    let mut failures = Vec::new();
    let mut outcome: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
    for step in 0..=steps.len() {
        for variant in 0..variants() {
            match crash_at(step, variant, steps.len(), ahead, closed) {
                Ok(new) => {
                    let e = outcome.entry(step).or_default();
                    if new {
                        e.1 += 1;
                    } else {
                        e.0 += 1;
                    }
                }
                Err(e) => failures.push(format!("step {step} (before {:?}), variant {variant}: {e}", steps.get(step))),
            }
        }
    }
    println!(
        "install protocol (installer ahead: {ahead}, closed cleanly before: {closed}): crash before call -> \
         (opened to old, opened to new)"
    );
    for (step, (old, new)) in &outcome {
        println!(
            "  {step:2} {:<70} old {old} new {new}",
            steps.get(*step).map_or("(after the last call)", String::as_str)
        );
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
    // Early crashes open to the old state, late ones to the new.
    assert!(outcome.values().any(|(o, _)| *o > 0) && outcome.values().any(|(_, n)| *n > 0));
    let last = outcome.get(&steps.len()).copied().unwrap_or_default();
    assert_eq!(last.0, 0, "a finished install must never come back old");
}

#[test]
fn install_every_step_installer_behind() {
    every_step(false, false);
}

#[test]
fn install_every_step_installer_ahead() {
    every_step(true, false);
}

/// The store was closed cleanly and reopened: its `CLOSED` marker claims the old log's end
/// LSN, last timestamp and digest. The install retires it before its commit point; a crash at
/// every step must still open to the old or the new state, never fail on a stale claim.
#[test]
fn install_every_step_after_a_clean_close() {
    let steps = install_steps(false, true);
    let retire = steps.iter().position(|l| l.contains("remove") && l.contains("CLOSED"));
    let commit_point = steps.iter().position(|l| l.contains("rename") && l.contains("INSTALL"));
    assert!(retire.is_some() && retire < commit_point, "CLOSED is retired before the commit point: {steps:?}");
    every_step(false, true);
}

/// Crashes an install just after its commit point, then crashes the recovery that finishes it
/// after every one of its calls: each later open must still finish it, to the new state.
#[test]
fn recovery_that_finishes_an_install_survives_crashes_at_every_step() {
    let steps = install_steps(false, true);
    let total = steps.len();
    let commit_point = steps.iter().position(|l| l.contains("rename") && l.contains("INSTALL")).unwrap();
    let src = source(false);
    let mut crashed_opens = 0;
    for k in 0..40u64 {
        let Built { fs, db, .. } = build(30_000 + k, true);
        // Calls up to and including the directory fsync after the marker's rename succeed.
        fs.stop_after_ops(commit_point as u64 + 2);
        assert!(db.install_checkpoint(&mut src.stream.as_slice()).is_err() || commit_point + 2 >= total);
        fs.kill_process();
        drop(db);
        fs.stop_after_ops(k);
        match Database::open(store_path(), sim_options(&fs, Durability::Sync)) {
            Ok(db) => {
                assert_eq!((db.digest(), contents(&db)), (src.digest, src.contents.clone()), "open {k}");
                drop(db);
                fs.kill_process();
            }
            Err(_) => crashed_opens += 1,
        }
        if k % 2 == 0 {
            fs.crash();
        } else {
            fs.kill_process();
        }
        let db = Database::open(store_path(), sim_options(&fs, Durability::Sync))
            .unwrap_or_else(|e| panic!("open after a crash in recovery ({k} calls) failed: {e}"));
        assert_eq!((db.digest(), contents(&db)), (src.digest, src.contents.clone()), "after {k} calls");
        commit(&db, 1, "after");
        db.close().unwrap();
    }
    assert!(crashed_opens > 5, "the recovery was interrupted at several steps ({crashed_opens})");
}

/// An I/O error before the commit point leaves the handle working on the old state; one after
/// it poisons the handle (reads still see the old state, writes are refused) and the next open,
/// without any crash, finishes the install.
#[test]
fn install_io_errors_before_and_after_the_commit_point() {
    let src = source(false);
    let Built { fs, db, digest: old_digest, .. } = build(40_000, false);
    fs.inject(Fault::new(FaultOp::SyncData).on_path("checkpoint-"));
    assert!(db.install_checkpoint(&mut src.stream.as_slice()).is_err());
    assert_eq!(db.digest(), old_digest);
    assert!(fs.describe_dir(store_path()).iter().all(|l| !l.contains(".tmp") && !l.contains("INSTALL")));
    commit(&db, 200, "t");
    let digest = db.digest();
    db.close().unwrap();
    let db = Database::open(store_path(), sim_options(&fs, Durability::Sync)).unwrap();
    assert_eq!(db.digest(), digest, "before the commit point: the old state and later commits");
    drop(db);

    let Built { fs, db, digest: old_digest, contents: old_contents } = build(40_001, false);
    fs.inject(Fault::new(FaultOp::Remove).on_path("wal-"));
    assert!(db.install_checkpoint(&mut src.stream.as_slice()).is_err());
    assert_eq!((db.digest(), contents(&db)), (old_digest, old_contents), "memory keeps the old state");
    let mut tx = db.begin_write().unwrap();
    tx.put("t", b"k", b"v").unwrap();
    assert!(matches!(tx.commit(), Err(keeldb::Error::Poisoned(_))));
    drop(db);
    let db = Database::open(store_path(), sim_options(&fs, Durability::Sync)).unwrap();
    assert_eq!((db.digest(), contents(&db)), (src.digest, src.contents.clone()), "after: the new state");
    db.close().unwrap();
}

/// Retiring `CLOSED` fails (before the commit point): the install fails, the handle keeps
/// working on the old state, and the store reopens to it with the later commit.
#[test]
fn a_failure_to_retire_the_close_marker_changes_nothing() {
    let src = source(false);
    let Built { fs, db, digest: old_digest, .. } = build(40_002, true);
    fs.inject(Fault::new(FaultOp::Remove).on_path("CLOSED"));
    assert!(db.install_checkpoint(&mut src.stream.as_slice()).is_err());
    assert_eq!(db.digest(), old_digest);
    assert!(fs.describe_dir(store_path()).iter().all(|l| !l.contains(".tmp") && !l.contains("INSTALL")));
    commit(&db, 200, "t");
    let digest = db.digest();
    db.close().unwrap();
    let db = Database::open(store_path(), sim_options(&fs, Durability::Sync)).unwrap();
    assert_eq!(db.digest(), digest);
    db.close().unwrap();
}

/// A store closed cleanly, reopened, then given `relaxed` commits that nothing has synced yet
/// (neither a later frame nor `CLOSED` claims them). Returns it and the digest after each
/// prefix of those commits (the first is the state at the clean close).
fn build_relaxed_tail(seed: u64) -> (SimFs, Database, Vec<StateDigest>) {
    let Built { fs, db, digest, .. } = build(seed, true);
    let mut prefixes = vec![digest];
    let relaxed = keeldb::TxnOptions { durability: Some(Durability::Relaxed), ..keeldb::TxnOptions::default() };
    for i in 0..8u64 {
        let mut tx = db.begin_write_with(relaxed.clone()).unwrap();
        tx.put("r", format!("k{i}").as_bytes(), &[i as u8; 300]).unwrap();
        tx.commit().unwrap();
        prefixes.push(db.digest());
    }
    (fs, db, prefixes)
}

/// Crashes an install into a store with unsynced `relaxed` commits after every call. The
/// install's quiesce step fdatasyncs the WAL before it touches anything (and so before it
/// retires `CLOSED`): a crash before that sync may lose any suffix of the relaxed commits (the
/// old state, as `relaxed` allows); from that sync on the old state comes back whole or the new
/// state does. Never a state that is not a prefix, never an open error.
#[test]
fn install_with_unsynced_relaxed_commits_syncs_them_before_anything_else() {
    let steps = {
        let (fs, db, _) = build_relaxed_tail(0);
        let before = fs.ops();
        db.install_checkpoint(&mut source(false).stream.as_slice()).unwrap();
        let n = (fs.ops() - before) as usize;
        let trace = fs.trace();
        let ops: Vec<String> = trace
            .iter()
            .filter(|l| l.starts_with('#'))
            .skip_while(|l| !l.starts_with(&format!("#{} ", before + 1)))
            .take(n)
            .cloned()
            .collect();
        ops
    };
    assert!(steps[0].contains("sync_data") && steps[0].contains("wal-"), "the WAL is synced first: {steps:?}");
    let src = source(false);
    let mut failures = Vec::new();
    let (mut lost_some, mut new_count) = (0, 0);
    for step in 0..=steps.len() {
        for variant in 0..variants() {
            let (fs, db, prefixes) = build_relaxed_tail(50_000 + step as u64 * 100 + variant);
            fs.stop_after_ops(step as u64);
            let result = db.install_checkpoint(&mut src.stream.as_slice());
            let killed = variant % 3 == 2;
            if killed {
                fs.kill_process();
            } else {
                fs.crash();
            }
            drop(db);
            let db = match Database::open(store_path(), sim_options(&fs, Durability::Sync)) {
                Ok(db) => db,
                Err(e) => {
                    failures.push(format!("step {step} variant {variant}: open failed: {e}"));
                    continue;
                }
            };
            let digest = db.digest();
            if digest == src.digest && contents(&db) == src.contents {
                new_count += 1;
            } else {
                match prefixes.iter().position(|d| *d == digest) {
                    None => failures.push(format!("step {step} variant {variant}: neither a prefix nor new")),
                    Some(p) if p + 1 < prefixes.len() && (killed || step > 0) => failures.push(format!(
                        "step {step} variant {variant}: relaxed commits lost after the install synced the WAL ({p})"
                    )),
                    Some(_) if result.is_ok() => failures.push(format!("step {step} variant {variant}: Ok but old")),
                    Some(p) => lost_some += usize::from(p + 1 < prefixes.len()),
                }
            }
            commit(&db, 300, "after");
            db.close().unwrap();
        }
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
    println!("relaxed tail: {lost_some} crashes before the WAL sync lost unsynced commits; {new_count} opened new");
    assert!(new_count > 0);
}
