//! The seeded crash workload: random transactions against a database on a [`SimFs`], crashes
//! at random points (including inside checkpoints and inside `open`), and a check after every
//! recovery that the database holds a legal prefix of the history.
//!
//! One thread interleaves several open write transactions, so conflicts, rollbacks and group
//! commit of one are exercised deterministically: a seed replays exactly (except the timing of
//! `periodic` syncs, which the engine takes from the wall clock). Multi-threaded workloads are
//! in `concurrent.rs`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keeldb::{Database, Durability, Error, Options, TxnOptions, WriteTxn};

use crate::model::{ConflictModel, History, Model, WriteSet};
use crate::rng::SimRng;
use crate::sim::{Fault, FaultError, FaultModel, FaultOp, SimFs};

/// The store's directory on the simulated disk. It is created durably before the engine sees
/// it: the engine does not sync the parent of a directory it creates (see the report).
pub const STORE_DIR: &str = "/data/store";

/// What one seed of the crash workload does.
#[derive(Debug, Clone)]
pub struct CrashWorkload {
    /// Default durability of the database.
    pub durability: Durability,
    /// Whether transactions override the durability at random.
    pub mixed_durability: bool,
    /// Crash/recover cycles per seed.
    pub cycles: usize,
    /// Workload steps per cycle.
    pub steps: usize,
    /// Tables used.
    pub tables: u64,
    /// Distinct keys per table.
    pub keys: u64,
    /// What power losses do.
    pub fault_model: FaultModel,
    /// Chance that a crash is a process kill (page cache survives) instead of a power loss.
    pub process_kill_probability: f64,
    /// Chance that an `open` is itself crashed part-way.
    pub crash_in_open_probability: f64,
    /// Chance that a cycle arms one random injected I/O fault (EIO, ENOSPC or a partial
    /// write on a random kind of call) instead of stopping the world.
    pub io_fault_probability: f64,
    /// Chance that any write returns fewer bytes than asked.
    pub short_write_probability: f64,
}

impl CrashWorkload {
    /// The default workload for a durability mode.
    pub fn new(durability: Durability) -> CrashWorkload {
        CrashWorkload {
            durability,
            mixed_durability: false,
            cycles: 4,
            steps: 120,
            tables: 3,
            keys: 24,
            fault_model: FaultModel::default(),
            process_kill_probability: 0.25,
            crash_in_open_probability: 0.2,
            io_fault_probability: 0.0,
            short_write_probability: 0.0,
        }
    }
}

/// Totals over one or more seeds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Seeds run.
    pub seeds: u64,
    /// Power losses simulated.
    pub power_losses: u64,
    /// Process kills simulated.
    pub process_kills: u64,
    /// Crashes that hit while `open` was recovering.
    pub crashes_in_open: u64,
    /// Commits acknowledged.
    pub commits_acked: u64,
    /// Commits that failed because the world stopped or a fault fired (fate unknown).
    pub commits_failed: u64,
    /// Injected I/O faults that fired.
    pub faults_fired: u64,
    /// Conflicts (all predicted by the model).
    pub conflicts: u64,
    /// Checkpoints that completed.
    pub checkpoints: u64,
    /// Recoveries checked against the model.
    pub recoveries_checked: u64,
    /// Recoveries that truncated a torn tail.
    pub torn_tails: u64,
    /// Acknowledged commits that a crash was allowed to lose and did (relaxed/periodic).
    pub unsynced_commits_lost: u64,
    /// Acknowledged commits that had to survive and did not (always 0 when the run passes).
    pub required_commits_lost: u64,
}

impl Summary {
    /// Adds another summary's counts.
    pub fn add(&mut self, o: &Summary) {
        self.seeds += o.seeds;
        self.power_losses += o.power_losses;
        self.process_kills += o.process_kills;
        self.crashes_in_open += o.crashes_in_open;
        self.commits_acked += o.commits_acked;
        self.commits_failed += o.commits_failed;
        self.faults_fired += o.faults_fired;
        self.conflicts += o.conflicts;
        self.checkpoints += o.checkpoints;
        self.recoveries_checked += o.recoveries_checked;
        self.torn_tails += o.torn_tails;
        self.unsynced_commits_lost += o.unsynced_commits_lost;
        self.required_commits_lost += o.required_commits_lost;
    }
}

/// A failed seed: what went wrong and the last file-system calls before it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The seed that replays it.
    pub seed: u64,
    /// What was wrong.
    pub message: String,
    /// The simulated file system's trace tail.
    pub trace: Vec<String>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "seed {} failed: {}", self.seed, self.message)?;
        writeln!(f, "last file-system calls (KEEL_SIM_TRACE_LINES=<n> shows more):")?;
        let n = std::env::var("KEEL_SIM_TRACE_LINES").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
        for line in self.trace.iter().rev().take(n).collect::<Vec<_>>().into_iter().rev() {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

/// Options for a database on `fs` with small segments, so rolls and multi-segment recovery
/// happen within a short run.
pub fn sim_options(fs: &SimFs, durability: Durability) -> Options {
    Options {
        durability,
        background_threads: false,
        wal_segment_bytes: 4096,
        checkpoint_wal_bytes: 0,
        fs: Arc::new(fs.clone()),
        ..Options::default()
    }
}

struct OpenTxn {
    tx: WriteTxn,
    ws: WriteSet,
    start_ts: u64,
    tables_at_start: BTreeSet<String>,
    durability: Durability,
}

/// State of one seed's run.
struct Run<'a> {
    cfg: &'a CrashWorkload,
    fs: SimFs,
    rng: SimRng,
    path: PathBuf,
    hist: History,
    conflicts: ConflictModel,
    /// Periodic/relaxed commits acknowledged and not yet known durable: (ts, acknowledged at).
    unsynced: Vec<(u64, Instant)>,
    poisoned: bool,
    /// A power loss happened since the last recovered state was checked: the acknowledged
    /// commits beyond what had to survive may be gone already.
    power_lost_since_check: bool,
    /// Set by a process kill: the next recovery must hold every commit acknowledged before it,
    /// unless a power loss comes first (it may take what was only in the page cache).
    kill_floor: Option<u64>,
    /// Faults fired before this cycle began.
    faults_before: u64,
    /// `KEEL_SIM_VERBOSE` is set: print every workload event (for replaying one seed).
    verbose: bool,
    summary: Summary,
}

/// Runs one seed. On failure, returns what went wrong with the trace.
pub fn run_seed(seed: u64, cfg: &CrashWorkload) -> Result<Summary, Failure> {
    let fs = SimFs::with_model(seed, cfg.fault_model.clone());
    let mut run = Run {
        cfg,
        rng: SimRng::new(seed ^ 0x5eed_5eed_5eed_5eed),
        path: PathBuf::from(STORE_DIR),
        hist: History::new(Model::default(), 0),
        conflicts: ConflictModel::default(),
        unsynced: Vec::new(),
        poisoned: false,
        power_lost_since_check: false,
        kill_floor: None,
        faults_before: 0,
        verbose: std::env::var_os("KEEL_SIM_VERBOSE").is_some(),
        summary: Summary { seeds: 1, ..Summary::default() },
        fs,
    };
    match run.all_cycles() {
        Ok(()) => {
            run.summary.faults_fired = run.fs.stats().faults_injected;
            Ok(run.summary)
        }
        Err(message) => Err(Failure { seed, message, trace: run.fs.trace() }),
    }
}

impl Run<'_> {
    fn event(&self, what: impl FnOnce() -> String) {
        if self.verbose {
            eprintln!("[ops {:>4}] {}", self.fs.ops(), what());
        }
    }

    fn all_cycles(&mut self) -> Result<(), String> {
        self.fs.create_dir_durable(&self.path).map_err(|e| format!("setup: {e}"))?;
        for cycle in 0..self.cfg.cycles {
            let db = self.open_checked().map_err(|e| format!("cycle {cycle}: {e}"))?;
            self.cycle(db).map_err(|e| format!("cycle {cycle}: {e}"))?;
        }
        let db = self.open_checked().map_err(|e| format!("final open: {e}"))?;
        db.close().map_err(|e| format!("final close: {e}"))
    }

    fn durability_for_txn(&mut self) -> Durability {
        if !self.cfg.mixed_durability {
            return self.cfg.durability;
        }
        match self.rng.below(3) {
            0 => Durability::Sync,
            1 => Durability::Relaxed,
            // An interval no run reaches keeps mixed runs replayable: the engine times periodic
            // syncs by the wall clock. `crash_random_periodic` covers the interval itself.
            _ => Durability::Periodic(Duration::from_secs(3600)),
        }
    }

    /// Opens the store, possibly crashing inside `open` first, and checks the recovered state.
    fn open_checked(&mut self) -> Result<Database, String> {
        let mut attempts = 0;
        let db = loop {
            attempts += 1;
            if attempts < 4 && self.rng.chance(self.cfg.crash_in_open_probability) {
                self.fs.stop_after_ops(self.rng.below(10));
            }
            let opts = sim_options(&self.fs, self.cfg.durability);
            match Database::open(&self.path, opts) {
                Ok(db) if !self.fs.is_stopped() => break db,
                Ok(_) => return Err("open succeeded although a file-system call failed".into()),
                Err(_) if self.fs.is_stopped() => {
                    self.summary.crashes_in_open += 1;
                    self.crash();
                }
                Err(e) => return Err(format!("open failed: {e}")),
            }
        };
        self.fs.cancel_stop();
        self.event(|| {
            format!(
                "opened: ts {:?}, torn tail {:?}, files {:?}",
                db.begin_read().map(|r| r.snapshot_ts()).ok(),
                db.recovery_report().torn_tail,
                self.fs.describe_dir(&self.path)
            )
        });
        if let Some(floor) = self.kill_floor.take() {
            self.hist.require(floor);
        }
        let (state, ts) = self.hist.check(&db)?;
        let lost = self.hist.last_acked_ts().saturating_sub(ts);
        self.summary.unsynced_commits_lost += lost;
        self.summary.recoveries_checked += 1;
        if db.recovery_report().torn_tail.is_some() {
            self.summary.torn_tails += 1;
        }
        self.hist = History::new(state, ts);
        self.conflicts.reset();
        self.unsynced.clear();
        self.poisoned = false;
        self.power_lost_since_check = false;
        Ok(db)
    }

    /// A power loss or a process kill, per the configured odds. A process kill keeps every
    /// written byte, so every acknowledged commit must survive it, whatever its durability,
    /// unless a power loss before the next recovery takes what was only in the page cache.
    fn crash(&mut self) {
        self.event(|| {
            format!("crash (required ts {}, last acknowledged {})", self.hist.required_ts(), self.hist.last_acked_ts())
        });
        if self.rng.chance(self.cfg.process_kill_probability) {
            self.summary.process_kills += 1;
            if !self.power_lost_since_check {
                self.kill_floor = Some(self.hist.last_acked_ts());
            }
            self.fs.kill_process();
        } else {
            self.summary.power_losses += 1;
            self.power_lost_since_check = true;
            self.kill_floor = None;
            self.fs.crash();
        }
    }

    /// Whether a call may have failed in this cycle (the world stopped or a fault fired), so
    /// that an error from the engine is expected rather than a bug.
    fn failure_possible(&self) -> bool {
        self.fs.is_stopped() || self.fs.stats().faults_injected > self.faults_before
    }

    /// Arms one random fault on a random kind of call, some calls from now.
    fn arm_random_fault(&mut self) {
        // Writes and fdatasyncs are the calls that fail in practice; the rest less often.
        let ops = [
            FaultOp::Write,
            FaultOp::Write,
            FaultOp::Write,
            FaultOp::SyncData,
            FaultOp::SyncData,
            FaultOp::SyncData,
            FaultOp::SyncDir,
            FaultOp::SetLen,
            FaultOp::Create,
            FaultOp::Rename,
            FaultOp::Remove,
        ];
        let op = *self.rng.pick(&ops).unwrap_or(&FaultOp::Write);
        let error = match self.rng.below(4) {
            0 => FaultError::NoSpace,
            1 if op == FaultOp::Write => FaultError::PartialWrite,
            _ => FaultError::Io,
        };
        let mut fault = Fault::new(op).after(self.rng.below(12)).error(error);
        if self.rng.chance(0.3) {
            fault = fault.forever();
        }
        self.fs.inject(fault);
    }

    fn cycle(&mut self, mut db: Database) -> Result<(), String> {
        let mut txns: Vec<OpenTxn> = Vec::new();
        let crash_at_step = self.rng.below(self.cfg.steps as u64 + 1) as usize;
        self.faults_before = self.fs.stats().faults_injected;
        self.fs.set_short_writes(self.cfg.short_write_probability);
        if self.rng.chance(self.cfg.io_fault_probability) {
            self.arm_random_fault();
        } else if self.rng.chance(0.5) {
            self.fs.stop_after_ops(self.rng.below(120));
        }
        let mut after_stop = 0;
        for _ in 0..crash_at_step {
            if self.fs.is_stopped() || self.poisoned {
                after_stop += 1;
                if after_stop > 8 {
                    break;
                }
            }
            if let Some(reopened) = self.step(&db, &mut txns)? {
                db = reopened;
            }
        }
        self.fs.clear_faults();
        self.crash();
        drop(txns);
        drop(db);
        Ok(())
    }

    fn random_key(&mut self) -> (String, Vec<u8>) {
        let table = format!("t{}", self.rng.below(self.cfg.tables));
        let key = format!("k{:03}", self.rng.below(self.cfg.keys)).into_bytes();
        (table, key)
    }

    fn random_value(&mut self) -> Vec<u8> {
        let len = if self.rng.chance(0.06) { self.rng.range(600, 3000) } else { self.rng.below(160) };
        let mut v = vec![0u8; len as usize];
        self.rng.fill(&mut v);
        v
    }

    /// One random step. Returns a new handle when the step closed and reopened the database.
    fn step(&mut self, db: &Database, txns: &mut Vec<OpenTxn>) -> Result<Option<Database>, String> {
        let roll = self.rng.below(100);
        if txns.is_empty() || (roll < 10 && txns.len() < 3) {
            let durability = self.durability_for_txn();
            let tx = db
                .begin_write_with(TxnOptions { durability: Some(durability), ..TxnOptions::default() })
                .map_err(|e| format!("begin_write failed: {e}"))?;
            let tables_at_start = self.hist.latest().table_names().into_iter().collect();
            txns.push(OpenTxn { start_ts: tx.snapshot_ts(), tx, ws: WriteSet::default(), tables_at_start, durability });
            return Ok(None);
        }
        let i = self.rng.index(txns.len());
        match roll {
            10..=44 => {
                let (table, key) = self.random_key();
                let value = self.random_value();
                let t = txns.get_mut(i).ok_or("no txn")?;
                t.tx.put(&table, &key, &value).map_err(|e| format!("put failed: {e}"))?;
                t.ws.put(&table, &key, &value);
            }
            45..=54 => {
                let (table, key) = self.random_key();
                let t = txns.get_mut(i).ok_or("no txn")?;
                t.tx.delete(&table, &key).map_err(|e| format!("delete failed: {e}"))?;
                t.ws.delete(&table, &key);
            }
            55 => {
                let (table, _) = self.random_key();
                let t = txns.get_mut(i).ok_or("no txn")?;
                t.tx.drop_table(&table).map_err(|e| format!("drop_table failed: {e}"))?;
                let in_snapshot = t.tables_at_start.contains(&table);
                t.ws.drop_table(&table, in_snapshot);
            }
            56..=83 => {
                let t = txns.swap_remove(i);
                self.commit(t)?;
            }
            84..=86 => {
                txns.swap_remove(i).tx.rollback();
            }
            87..=94 => self.read_check(db)?,
            95..=97 => self.checkpoint(db)?,
            _ => {
                txns.clear();
                return self.close_and_reopen(db.clone()).map(Some);
            }
        }
        Ok(None)
    }

    fn commit(&mut self, t: OpenTxn) -> Result<(), String> {
        let OpenTxn { tx, ws, start_ts, durability, .. } = t;
        let dirty = ws.is_dirty();
        let predicted_conflict = dirty && self.conflicts.conflicts(&ws, start_ts);
        let started = Instant::now();
        let result = tx.commit();
        self.event(|| {
            format!(
                "commit ({durability:?}, start ts {start_ts}, dirty {dirty}) -> {:?}",
                result.as_ref().map(|i| i.ts)
            )
        });
        match result {
            Ok(info) => {
                if self.poisoned && dirty {
                    return Err(format!("commit at ts {} succeeded on a poisoned database", info.ts));
                }
                if !dirty {
                    return Ok(());
                }
                if predicted_conflict {
                    return Err(format!(
                        "commit at ts {} succeeded although a concurrent commit wrote the same keys",
                        info.ts
                    ));
                }
                self.acked(info.ts, ws, durability, started)
            }
            Err(why @ Error::Conflict { .. }) => {
                if self.poisoned {
                    return Err(format!("a poisoned database reported a conflict instead of Poisoned: {why}"));
                }
                if !predicted_conflict {
                    return Err(format!("unexpected conflict: {why}"));
                }
                self.summary.conflicts += 1;
                Ok(())
            }
            Err(e) => {
                if !self.failure_possible() && !self.poisoned {
                    return Err(format!("commit failed with no injected failure: {e}"));
                }
                if self.poisoned && !matches!(e, Error::Poisoned(_)) {
                    return Err(format!("a commit after poisoning failed with {e:?}, not Poisoned"));
                }
                self.poisoned = true;
                if dirty {
                    self.summary.commits_failed += 1;
                    self.hist.failed(ws);
                }
                Ok(())
            }
        }
    }

    fn acked(&mut self, ts: u64, ws: WriteSet, durability: Durability, started: Instant) -> Result<(), String> {
        self.conflicts.record(&ws, ts);
        self.hist.acked(ts, ws)?;
        self.summary.commits_acked += 1;
        match durability {
            Durability::Sync => {
                self.hist.require(ts);
                self.unsynced.clear();
            }
            Durability::Periodic(interval) => {
                // With no background thread the engine syncs inline in the first periodic
                // commit written after the deadline, so every commit acknowledged `interval`
                // before this one started is durable once this one returns.
                let durable_through =
                    self.unsynced.iter().filter(|(_, at)| *at + interval <= started).map(|(t, _)| *t).max();
                if let Some(t) = durable_through {
                    self.hist.require(t);
                }
                self.unsynced.retain(|(t, _)| durable_through.is_none_or(|d| *t > d));
                self.unsynced.push((ts, Instant::now()));
            }
            Durability::Relaxed => self.unsynced.push((ts, Instant::now())),
        }
        Ok(())
    }

    fn read_check(&mut self, db: &Database) -> Result<(), String> {
        let (table, key) = self.random_key();
        let rx = db.begin_read().map_err(|e| format!("begin_read failed: {e}"))?;
        let got = rx.get(&table, &key).map_err(|e| format!("get failed: {e}"))?;
        let want = self.hist.latest().get(&table, &key).cloned();
        if got != want {
            return Err(format!(
                "read of {table}/{} returned {:?} bytes, the acknowledged state has {:?} (poisoned: {})",
                String::from_utf8_lossy(&key),
                got.map(|v| v.len()),
                want.map(|v| v.len()),
                self.poisoned
            ));
        }
        if rx.snapshot_ts() != self.hist.last_acked_ts() {
            return Err(format!(
                "readers see ts {}, last acknowledged is {}",
                rx.snapshot_ts(),
                self.hist.last_acked_ts()
            ));
        }
        Ok(())
    }

    fn checkpoint(&mut self, db: &Database) -> Result<(), String> {
        let result = db.checkpoint();
        self.event(|| format!("checkpoint -> {:?}", result.as_ref().map(|i| i.ts)));
        match result {
            Ok(info) => {
                if info.ts != self.hist.last_acked_ts() {
                    return Err(format!(
                        "checkpoint at ts {}, last acknowledged {}",
                        info.ts,
                        self.hist.last_acked_ts()
                    ));
                }
                self.hist.require(info.ts);
                self.unsynced.clear();
                self.summary.checkpoints += 1;
                Ok(())
            }
            Err(_) if self.failure_possible() || self.poisoned => Ok(()),
            Err(e) => Err(format!("checkpoint failed with no injected failure: {e}")),
        }
    }

    /// Closes cleanly (which makes every acknowledged commit durable) and reopens. A stop
    /// armed for this cycle may hit the close or the open; then it is a crash like any other.
    fn close_and_reopen(&mut self, db: Database) -> Result<Database, String> {
        let closed = db.close();
        self.event(|| format!("close -> {closed:?}, files {:?}", self.fs.describe_dir(&self.path)));
        let was_poisoned = self.poisoned;
        match &closed {
            Ok(()) if self.poisoned => {}
            Ok(()) => self.hist.require_all(),
            Err(_) if self.failure_possible() => {}
            Err(e) => return Err(format!("close failed with no injected failure: {e}")),
        }
        // An armed fault has had its chance in this cycle; the reopen itself is clean.
        self.fs.clear_faults();
        self.fs.set_short_writes(self.cfg.short_write_probability);
        let crashes_before = self.summary.power_losses + self.summary.process_kills;
        let db = self.open_checked()?;
        let crashed = self.summary.power_losses + self.summary.process_kills > crashes_before;
        if closed.is_ok() && !was_poisoned && !crashed && !self.fs.is_stopped() && !db.recovery_report().clean_shutdown
        {
            return Err("close() returned Ok but the reopen finds no clean-close mark \
                        (was the database poisoned by an earlier failure the caller never saw as Poisoned?)"
                .into());
        }
        Ok(db)
    }
}

/// Seeds to run: `KEEL_SIM_SEED=<n>` replays one; otherwise `count` seeds from `base`
/// (`KEEL_SIM_ITERS=<n>` overrides the count for longer soaks). The simulation is deterministic
/// per seed, so a soak repeated with the same count repeats the same schedules:
/// `KEEL_SIM_OFFSET=<n>` shifts every test's base by n to explore new ones.
pub fn seeds(base: u64, count: u64) -> Vec<u64> {
    let env = |name: &str| std::env::var(name).ok().and_then(|s| s.trim().parse::<u64>().ok());
    if let Some(seed) = env("KEEL_SIM_SEED") {
        return vec![seed];
    }
    let n = env("KEEL_SIM_ITERS").unwrap_or(count);
    let base = base.wrapping_add(env("KEEL_SIM_OFFSET").unwrap_or(0));
    (0..n).map(|i| base.wrapping_add(i)).collect()
}

/// Runs `cfg` over `seeds` without printing; returns the totals and the failures.
pub fn run_seeds_quiet(seeds: &[u64], cfg: &CrashWorkload) -> (Summary, Vec<Failure>) {
    let mut total = Summary::default();
    let mut failures = Vec::new();
    for &seed in seeds {
        match run_seed(seed, cfg) {
            Ok(s) => total.add(&s),
            Err(f) => failures.push(f),
        }
    }
    (total, failures)
}

/// Runs `cfg` over `seeds`, printing each failure with its seed and replay command; returns
/// the totals and the failures.
pub fn run_seeds(name: &str, seeds: &[u64], cfg: &CrashWorkload) -> (Summary, Vec<Failure>) {
    let mut total = Summary::default();
    let mut failures = Vec::new();
    for &seed in seeds {
        match run_seed(seed, cfg) {
            Ok(s) => total.add(&s),
            Err(f) => {
                eprintln!(
                    "{name}: {f}replay: KEEL_SIM_SEED={seed} cargo test -p keel-testkit --test <this test> {name}"
                );
                failures.push(f);
            }
        }
    }
    (total, failures)
}

/// The store directory as a `Path`.
pub fn store_path() -> &'static Path {
    Path::new(STORE_DIR)
}
