//! The multi-threaded crash workload: several threads commit concurrently (so group commit
//! batches them), optionally with the engine's background worker doing periodic fdatasyncs and
//! automatic checkpoints, until the simulated machine stops after a random number of calls;
//! then a power loss or a process kill, a reopen, and a check.
//!
//! Each thread writes only its own keys and a sequence counter `meta/seq:<thread>`, so the
//! expected state is known from each thread's recovered counter even though the order of
//! concurrent commits is not. The check: every thread's keys equal its first `seq` write sets;
//! the recovered timestamp `R` splits every thread's acknowledged commits exactly at its
//! counter (commits at or below `R` present, above absent: a prefix); the counters account for
//! exactly `R - R_before` commits; and nothing that had to survive is missing. Thread
//! interleavings are not replayable from the seed; the file-system decisions are, given the
//! same interleaving.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use keeldb::{Database, Durability, Options, TxnOptions};
use parking_lot::Mutex;

use crate::model::{Model, WriteSet};
use crate::rng::SimRng;
use crate::sim::{FaultModel, SimFs};
use crate::workload::{Failure, STORE_DIR};

/// What one seed of the concurrent workload does.
#[derive(Debug, Clone)]
pub struct ConcurrentWorkload {
    /// Default durability.
    pub durability: Durability,
    /// Whether each transaction picks sync, periodic or relaxed at random.
    pub mixed_durability: bool,
    /// Committing threads.
    pub threads: u64,
    /// Commits per thread per cycle at most.
    pub commits_per_thread: u64,
    /// Crash/recover cycles.
    pub cycles: usize,
    /// Whether the engine runs its background worker (periodic syncs, automatic checkpoints).
    pub background_threads: bool,
    /// Automatic checkpoint threshold (with the background worker).
    pub checkpoint_wal_bytes: u64,
    /// What power losses do.
    pub fault_model: FaultModel,
    /// How long each simulated fdatasync takes.
    pub sync_delay: Duration,
    /// Whether odd-numbered threads commit through `WriteTxn::commit_async` (each driving its
    /// futures with a minimal executor), so async and blocking committers share the pipeline
    /// when the machine stops.
    pub async_commits: bool,
}

impl ConcurrentWorkload {
    /// Four threads, background worker on, small automatic checkpoints.
    pub fn new(durability: Durability) -> ConcurrentWorkload {
        ConcurrentWorkload {
            durability,
            mixed_durability: false,
            threads: 4,
            commits_per_thread: 60,
            cycles: 3,
            background_threads: true,
            checkpoint_wal_bytes: 12 * 1024,
            fault_model: FaultModel::default(),
            sync_delay: Duration::from_micros(300),
            async_commits: false,
        }
    }
}

/// Totals of a concurrent run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConcurrentSummary {
    /// Seeds run.
    pub seeds: u64,
    /// Crash/recover cycles checked.
    pub cycles: u64,
    /// Commits acknowledged.
    pub commits_acked: u64,
    /// Power losses.
    pub power_losses: u64,
    /// Process kills.
    pub process_kills: u64,
    /// Commits the engine counted (includes the ones whose fate the crash decided).
    pub engine_commits: u64,
    /// Group-commit batches (WAL writes) the engine counted.
    pub engine_batches: u64,
}

impl ConcurrentSummary {
    /// Adds another summary's counts.
    pub fn add(&mut self, o: &ConcurrentSummary) {
        self.seeds += o.seeds;
        self.cycles += o.cycles;
        self.commits_acked += o.commits_acked;
        self.power_losses += o.power_losses;
        self.process_kills += o.process_kills;
        self.engine_commits += o.engine_commits;
        self.engine_batches += o.engine_batches;
    }
}

/// One thread's generated write sets (index = seq - 1) and what happened to them.
#[derive(Debug, Default)]
struct ThreadLog {
    sets: Vec<WriteSet>,
    /// (seq, ts, durability) of acknowledged commits.
    acked: Vec<(u64, u64, Durability)>,
}

fn thread_write_set(rng: &mut SimRng, t: u64, seq: u64) -> WriteSet {
    let mut ws = WriteSet::default();
    for _ in 0..rng.range(1, 3) {
        let table = format!("c{}", rng.below(2));
        let key = format!("{t}:{}", rng.below(10));
        if rng.chance(0.15) {
            ws.delete(&table, key.as_bytes());
        } else {
            let mut v = vec![0u8; rng.below(300) as usize];
            rng.fill(&mut v);
            ws.put(&table, key.as_bytes(), &v);
        }
    }
    ws.put("meta", format!("seq:{t}").as_bytes(), seq.to_string().as_bytes());
    ws
}

fn options(fs: &SimFs, cfg: &ConcurrentWorkload) -> Options {
    Options {
        durability: cfg.durability,
        background_threads: cfg.background_threads,
        wal_segment_bytes: 4096,
        checkpoint_wal_bytes: cfg.checkpoint_wal_bytes,
        fs: Arc::new(fs.clone()),
        ..Options::default()
    }
}

fn commit_loop(
    db: Database,
    log: Arc<Mutex<ThreadLog>>,
    mut rng: SimRng,
    t: u64,
    first_seq: u64,
    cfg: ConcurrentWorkload,
) {
    for seq in first_seq..first_seq + cfg.commits_per_thread {
        let ws = thread_write_set(&mut rng, t, seq);
        let durability = if cfg.mixed_durability {
            match rng.below(3) {
                0 => Durability::Sync,
                1 => Durability::Relaxed,
                _ => Durability::Periodic(Duration::from_millis(2)),
            }
        } else {
            cfg.durability
        };
        log.lock().sets.push(ws.clone());
        let Ok(mut tx) = db.begin_write_with(TxnOptions { durability: Some(durability), ..TxnOptions::default() })
        else {
            return;
        };
        for (table, tw) in &ws.tables {
            for (k, v) in &tw.writes {
                let r = match v {
                    Some(v) => tx.put(table, k, v),
                    None => tx.delete(table, k),
                };
                if r.is_err() {
                    return;
                }
            }
        }
        let committed = if cfg.async_commits && t % 2 == 1 { block_on(tx.commit_async()) } else { tx.commit() };
        match committed {
            Ok(info) => log.lock().acked.push((seq, info.ts, durability)),
            Err(_) => return,
        }
    }
}

/// Drives one future to completion on this thread: poll, park until woken, poll again.
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        // A spurious unpark only costs one more poll.
        std::thread::park_timeout(Duration::from_millis(50));
    }
}

fn read_seq(db: &Database, t: u64) -> Result<u64, String> {
    let rx = db.begin_read().map_err(|e| e.to_string())?;
    match rx.get("meta", format!("seq:{t}").as_bytes()).map_err(|e| e.to_string())? {
        None => Ok(0),
        Some(v) => String::from_utf8_lossy(&v).parse().map_err(|_| "unparsable sequence counter".to_owned()),
    }
}

struct State {
    model: Model,
    ts: u64,
    seqs: BTreeMap<u64, u64>,
    logs: BTreeMap<u64, ThreadLog>,
}

/// Runs one seed of the concurrent workload.
pub fn run_concurrent_seed(seed: u64, cfg: &ConcurrentWorkload) -> Result<ConcurrentSummary, Failure> {
    let fs = SimFs::with_model(seed, cfg.fault_model.clone());
    fs.set_sync_delay(cfg.sync_delay);
    let mut summary = ConcurrentSummary { seeds: 1, ..ConcurrentSummary::default() };
    run_cycles(&fs, seed, cfg, &mut summary).map(|()| summary).map_err(|message| Failure {
        seed,
        message,
        trace: fs.trace(),
    })
}

fn run_cycles(fs: &SimFs, seed: u64, cfg: &ConcurrentWorkload, summary: &mut ConcurrentSummary) -> Result<(), String> {
    let path = PathBuf::from(STORE_DIR);
    fs.create_dir_durable(&path).map_err(|e| e.to_string())?;
    let mut rng = SimRng::new(seed ^ 0xc0c0_c0c0);
    let mut st = State { model: Model::default(), ts: 0, seqs: BTreeMap::new(), logs: BTreeMap::new() };
    for cycle in 0..cfg.cycles {
        let db = Database::open(&path, options(fs, cfg)).map_err(|e| format!("cycle {cycle}: open failed: {e}"))?;
        fs.stop_after_ops(rng.range(10, 300));
        let logs: Vec<Arc<Mutex<ThreadLog>>> =
            (0..cfg.threads).map(|_| Arc::new(Mutex::new(ThreadLog::default()))).collect();
        let handles: Vec<_> = (0..cfg.threads)
            .zip(&logs)
            .map(|(t, log)| {
                let (db, log, trng, cfg) = (db.clone(), Arc::clone(log), rng.fork(t), cfg.clone());
                let first = st.seqs.get(&t).copied().unwrap_or(0) + 1;
                thread::spawn(move || commit_loop(db, log, trng, t, first, cfg))
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !handles.iter().all(|h| h.is_finished()) {
            if Instant::now() > deadline {
                return Err(format!(
                    "cycle {cycle}: committers still blocked 60 s after the machine stopped (a hang in commit?)"
                ));
            }
            thread::sleep(Duration::from_millis(2));
        }
        let stats = db.stats();
        summary.engine_commits += stats.commits;
        summary.engine_batches += stats.batches;
        let power_loss = rng.chance(0.75);
        if power_loss {
            summary.power_losses += 1;
            fs.crash();
        } else {
            summary.process_kills += 1;
            fs.kill_process();
        }
        drop(db);
        for h in handles {
            h.join().map_err(|_| format!("cycle {cycle}: a committer panicked"))?;
        }
        st.logs = logs.into_iter().enumerate().map(|(t, l)| (t as u64, std::mem::take(&mut *l.lock()))).collect();
        summary.commits_acked += st.logs.values().map(|l| l.acked.len() as u64).sum::<u64>();
        let db = Database::open(&path, options(fs, cfg)).map_err(|e| format!("cycle {cycle}: reopen failed: {e}"))?;
        check(&db, &mut st, !power_loss).map_err(|e| format!("cycle {cycle}: {e}"))?;
        summary.cycles += 1;
        fs.kill_process();
        drop(db);
    }
    Ok(())
}

/// Checks the reopened database against the thread logs and advances `st` to it.
fn check(db: &Database, st: &mut State, process_kill: bool) -> Result<(), String> {
    let recovered_ts = db.begin_read().map_err(|e| e.to_string())?.snapshot_ts();
    let mut model = st.model.clone();
    let mut applied = 0;
    let mut seqs = BTreeMap::new();
    for (&t, log) in &st.logs {
        let base = st.seqs.get(&t).copied().unwrap_or(0);
        let seq = read_seq(db, t)?;
        if seq < base || seq - base > log.sets.len() as u64 {
            return Err(format!("thread {t}: counter {seq} outside {base}..={}", base + log.sets.len() as u64));
        }
        for ws in log.sets.iter().take((seq - base) as usize) {
            model.apply(ws);
        }
        applied += seq - base;
        for &(s, ts, durability) in &log.acked {
            let present = s <= seq;
            if present != (ts <= recovered_ts) {
                return Err(format!(
                    "not a prefix: thread {t} commit {s} at ts {ts} is {} but the recovered ts is {recovered_ts}",
                    if present { "present" } else { "missing" }
                ));
            }
            if !present && (process_kill || durability == Durability::Sync) {
                return Err(format!("acknowledged commit lost: thread {t} commit {s} at ts {ts} ({durability:?}), recovered ts {recovered_ts}"));
            }
        }
        seqs.insert(t, seq);
    }
    // Any sync commit acknowledged at ts X forces everything through X.
    let required = st
        .logs
        .values()
        .flat_map(|l| l.acked.iter())
        .filter(|(_, _, d)| *d == Durability::Sync)
        .map(|(_, ts, _)| *ts)
        .max();
    if required.is_some_and(|r| r > recovered_ts) {
        return Err(format!("recovered ts {recovered_ts} is below a sync-acknowledged ts {required:?}"));
    }
    if recovered_ts < st.ts {
        return Err(format!("recovered ts {recovered_ts} is below the previous recovery's {}", st.ts));
    }
    if recovered_ts - st.ts != applied {
        return Err(format!("recovered ts advanced by {} but the thread counters by {applied}", recovered_ts - st.ts));
    }
    model.compare(db)?;
    st.model = model;
    st.ts = recovered_ts;
    st.seqs = seqs;
    Ok(())
}
