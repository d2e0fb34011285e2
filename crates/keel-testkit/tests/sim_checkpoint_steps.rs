//! Crash at every step of the checkpoint protocol (roll the WAL segment, write the temporary
//! file, fsync it, rename it, fsync the directory, delete the old checkpoint and WAL segments,
//! fsync the directory), by power loss with several crash seeds and by process kill. The store
//! must always open, to the old or the new checkpoint, never neither and never a mix, and hold
//! exactly the state the model allows; and it must keep working afterwards.
//!
//! `KEEL_SIM_ITERS=<n>` runs n crash variants per step (default 12).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::collections::BTreeMap;

use keel_testkit::model::{History, Model, WriteSet};
use keel_testkit::sim::SimFs;
use keel_testkit::workload::{sim_options, store_path};
use keeldb::{Database, Durability};

/// A store with two retained checkpoints and WAL across several segments after them, so the
/// next checkpoint deletes a checkpoint and segments. Deterministic for any seed.
struct Built {
    fs: SimFs,
    db: Database,
    hist: History,
    /// Timestamp of the newest checkpoint before the one under test.
    old_ckpt: u64,
}

fn commit(db: &Database, hist: &mut History, i: u64) {
    let mut ws = WriteSet::default();
    let mut tx = db.begin_write().unwrap();
    for j in 0..3u64 {
        let table = format!("t{}", (i + j) % 3);
        let key = format!("k{:02}", (i * 7 + j * 3) % 40);
        if (i + j) % 5 == 4 {
            tx.delete(&table, key.as_bytes()).unwrap();
            ws.delete(&table, key.as_bytes());
        } else {
            let value = vec![(i as u8).wrapping_mul(31) ^ j as u8; 100 + ((i * 53 + j) % 400) as usize];
            tx.put(&table, key.as_bytes(), &value).unwrap();
            ws.put(&table, key.as_bytes(), &value);
        }
    }
    let ts = tx.commit().unwrap().ts;
    hist.acked(ts, ws).unwrap();
}

fn build(seed: u64, durability: Durability) -> Built {
    let fs = SimFs::new(seed);
    fs.create_dir_durable(store_path()).unwrap();
    let db = Database::open(store_path(), sim_options(&fs, durability)).unwrap();
    let mut hist = History::new(Model::default(), 0);
    for i in 0..12 {
        commit(&db, &mut hist, i);
    }
    db.checkpoint().unwrap();
    for i in 12..30 {
        commit(&db, &mut hist, i);
    }
    let old_ckpt = db.checkpoint().unwrap().ts;
    hist.require(old_ckpt);
    for i in 30..45 {
        commit(&db, &mut hist, i);
    }
    if durability == Durability::Sync {
        hist.require_all();
    }
    Built { fs, db, hist, old_ckpt }
}

/// The mutating calls one checkpoint makes, as the simulated disk's trace names them.
fn checkpoint_steps(durability: Durability) -> Vec<String> {
    let b = build(0, durability);
    let before = b.fs.ops();
    b.db.checkpoint().unwrap();
    let n = (b.fs.ops() - before) as usize;
    let trace = b.fs.trace();
    trace
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

/// Crashes one checkpoint after `step` mutating calls and checks the reopened store.
fn crash_at(step: usize, variant: u64, durability: Durability, total: usize) -> Result<(u64, bool), String> {
    let seed = 10_000 + step as u64 * 100 + variant;
    let Built { fs, db, mut hist, old_ckpt } = build(seed, durability);
    fs.stop_after_ops(step as u64);
    let result = db.checkpoint();
    let new_ckpt = hist.last_acked_ts();
    // The engine ignores failures on `accounting.txt` by design (an informational file).
    let essential = fs.stopped_on().is_some_and(|p| !p.to_string_lossy().contains("accounting"));
    match (&result, step < total) {
        (Ok(_), true) if essential => return Err(format!("checkpoint returned Ok although call {} failed", step + 1)),
        (Ok(info), true) => hist.require(info.ts),
        (Err(e), false) => return Err(format!("checkpoint failed with every call allowed: {e}")),
        (Ok(info), false) => hist.require(info.ts),
        (Err(_), true) => {}
    }
    let killed = variant % 3 == 2;
    if killed {
        hist.require_all();
        fs.kill_process();
    } else {
        fs.crash();
    }
    drop(db);
    let db = Database::open(store_path(), sim_options(&fs, durability))
        .map_err(|e| format!("open after the crash failed: {e}"))?;
    let loaded = db.recovery_report().checkpoint.map(|(_, ts)| ts);
    if loaded != Some(old_ckpt) && loaded != Some(new_ckpt) {
        return Err(format!(
            "recovery loaded checkpoint {loaded:?}, neither the old ({old_ckpt}) nor the new ({new_ckpt})"
        ));
    }
    let (state, ts) = hist.check(&db)?;
    // The store keeps working: more commits, another checkpoint, a clean reopen.
    let mut after = History::new(state, ts);
    for i in 100..106 {
        commit(&db, &mut after, i);
    }
    db.checkpoint().map_err(|e| format!("checkpoint after recovery failed: {e}"))?;
    db.close().map_err(|e| format!("close failed: {e}"))?;
    after.require_all();
    let db =
        Database::open(store_path(), sim_options(&fs, durability)).map_err(|e| format!("clean reopen failed: {e}"))?;
    after.check(&db)?;
    Ok((loaded.unwrap_or(0), loaded == Some(new_ckpt)))
}

fn every_step(durability: Durability) {
    let steps = checkpoint_steps(durability);
    assert!(steps.len() >= 8, "a checkpoint makes several calls: {steps:?}");
    let mut failures = Vec::new();
    let mut outcome: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
    for step in 0..=steps.len() {
        for variant in 0..variants() {
            match crash_at(step, variant, durability, steps.len()) {
                Ok((_, new)) => {
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
    println!("checkpoint protocol, {}: crash before call -> (opened to old, opened to new)", durability.name());
    for (step, (old, new)) in &outcome {
        println!(
            "  {step:2} {:<60} old {old} new {new}",
            steps.get(*step).map_or("(after the last call)", String::as_str)
        );
    }
    assert!(failures.is_empty(), "{} failure(s):\n{}", failures.len(), failures.join("\n"));
    // Both outcomes occur: early crashes open to the old checkpoint, late ones to the new.
    assert!(outcome.values().any(|(o, _)| *o > 0) && outcome.values().any(|(_, n)| *n > 0));
}

#[test]
fn checkpoint_every_step_sync() {
    every_step(Durability::Sync);
}

#[test]
fn checkpoint_every_step_relaxed() {
    every_step(Durability::Relaxed);
}
