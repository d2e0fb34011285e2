//! The `recovery` suite: how fast a store comes back after the process is killed.
//!
//! For each system a helper process ([`crate::child`]) commits N records of 16-byte keys and
//! 100-byte values, one record per commit, in `relaxed` mode (each peer's closest equivalent),
//! and is then killed with SIGKILL: once with the whole history in the log (`wal_N`; KeelDB's
//! automatic checkpoints are off, the peers keep their defaults, so SQLite's auto-checkpoint and
//! the LSMs' memtable flushes still run), and once after a checkpoint (`checkpoint_N`, the
//! system's equivalent in the preamble). The parent then times open + one point read of the
//! last key (`reopen_ms`), and checks how many of 200 sampled keys came back (`recovered_pct`:
//! redb's `Durability::None` commits, for one, are not expected to survive a crash). KeelDB's
//! rows add the WAL replay rate from its recovery report.

use std::path::Path;
use std::time::Instant;

use super::key16;
use crate::child::{run_and_kill, ChildSpec};
use crate::peers::keeldb::KeelStore;
use crate::peers::{Mode, Store, System};
use crate::report::Row;
use crate::{Scale, SuiteContext};

const SUITE: &str = "recovery";
const VALUE_BYTES: usize = 100;
const SAMPLES: u64 = 200;

fn records(scale: Scale) -> u64 {
    match scale {
        Scale::Full => 300_000,
        Scale::Quick => 100_000,
        Scale::Tiny => 2_000,
    }
}

/// Runs the suite for every system.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let n = records(context.scale);
    let mut rows = Vec::new();
    for system in context.systems() {
        for checkpoint in [false, true] {
            let dir = context.temp_dir(SUITE)?;
            let store_dir = dir.path().join(system.name());
            rows.extend(one(context, system, &store_dir, n, checkpoint)?);
        }
    }
    Ok(rows)
}

fn one(context: &SuiteContext, system: &dyn System, dir: &Path, n: u64, checkpoint: bool) -> anyhow::Result<Vec<Row>> {
    let name = system.name();
    let spec = ChildSpec {
        task: "fill".to_string(),
        system: name.to_string(),
        dir: dir.to_path_buf(),
        records: n,
        batch: 1,
        value_bytes: VALUE_BYTES,
        checkpoint,
        reads: 0,
        sync_commits: 0,
        sync_budget_ms: 0,
    };
    let written = run_and_kill(&context.child_command, &spec)?;
    anyhow::ensure!(crate::child::is_populated(dir), "the helper wrote nothing to {}", dir.display());

    let started = Instant::now();
    let (store, replay): (Box<dyn Store>, Option<keeldb::RecoveryReport>) = if name == "keeldb" {
        let store = KeelStore::open(dir, keeldb::Options::with_durability(keeldb::Durability::Relaxed))?;
        let report = store.db.recovery_report();
        (Box::new(store), Some(report))
    } else {
        (system.open(dir, Mode::Relaxed)?, None)
    };
    let last = store.reader()?.get(&key16(n - 1))?;
    let reopen = started.elapsed();
    let mut present = 0u64;
    {
        let mut reader = store.reader()?;
        for k in 0..SAMPLES {
            if reader.get(&key16(k * n / SAMPLES))?.is_some() {
                present += 1;
            }
        }
    }
    store.close()?;
    let recovered_pct = 100.0 * present as f64 / SAMPLES as f64;

    let case = if checkpoint { format!("checkpoint_{n}") } else { format!("wal_{n}") };
    let mut rows = vec![
        Row::new(SUITE, name, "relaxed", &case, "reopen_ms", reopen.as_secs_f64() * 1e3),
        Row::new(SUITE, name, "relaxed", &case, "recovered_pct", recovered_pct),
    ];
    if !checkpoint && written.write_s > 0.0 {
        rows.push(Row::new(SUITE, name, "relaxed", &case, "write_records_per_s", n as f64 / written.write_s));
    }
    let mut replay_note = String::new();
    if let Some(report) = replay {
        let seconds = report.duration.as_secs_f64();
        if report.frames_replayed > 0 && seconds > 0.0 {
            let records_per_s = report.frames_replayed as f64 / seconds;
            let mb_per_s = report.bytes_replayed as f64 / seconds / 1e6;
            rows.push(Row::new(SUITE, name, "relaxed", &case, "replay_records_per_s", records_per_s));
            rows.push(Row::new(SUITE, name, "relaxed", &case, "replay_mb_per_s", mb_per_s));
            replay_note = format!(
                ", replayed {} records ({:.1} MB) at {records_per_s:.0} records/s, {mb_per_s:.0} MB/s",
                report.frames_replayed,
                report.bytes_replayed as f64 / 1e6
            );
        }
    }
    context.progress.line(
        SUITE,
        format!(
            "{name} {case}: reopen {:.1} ms after SIGKILL, last key {}, {recovered_pct:.0}% of sampled keys{replay_note}",
            reopen.as_secs_f64() * 1e3,
            if last.is_some() { "present" } else { "missing" },
        ),
    );
    Ok(rows)
}
