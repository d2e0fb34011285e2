//! The helper process of the recovery and scale suites. `keel` starts itself again with the
//! hidden subcommand [`CHILD_COMMAND`] and a JSON [`ChildSpec`]; the child fills a store (and
//! for `scale`, measures memory, reads and commits in a process of its own, so resident memory
//! is the store's and nothing else's), prints one JSON line of figures, and then waits to be
//! killed with SIGKILL. The parent then times how long the store takes to reopen.
//!
//! The child never exits on its own after the JSON line: a clean exit would close the store and
//! make the reopen a clean one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde::{Deserialize, Serialize};

use crate::peers::keeldb::KeelStore;
use crate::peers::{self, Mode, Store};
use crate::suites::{key16, value_bytes, IndexStream};
use crate::timing::Samples;

/// The hidden subcommand that runs [`child_main`].
pub const CHILD_COMMAND: &str = "__bench-child";

/// What the child does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChildSpec {
    /// `fill` (recovery), `scale`, or `reopen` (scale: one timed open, then a clean close).
    pub task: String,
    /// `keeldb` or a peer's name.
    pub system: String,
    /// The store directory.
    pub dir: PathBuf,
    /// Keys to write: one commit per key for `fill`, batches of `batch` for `scale`.
    pub records: u64,
    /// Keys per transaction.
    pub batch: u64,
    /// Bytes per value.
    pub value_bytes: usize,
    /// `fill`: checkpoint after the writes; `reopen`: after the open.
    pub checkpoint: bool,
    /// `scale`: point reads to time.
    pub reads: u64,
    /// `scale`: sync commits to time, at most.
    pub sync_commits: u64,
    /// `scale`: time limit for the sync commits, in ms.
    pub sync_budget_ms: u64,
}

/// What the child reports, as one JSON line on stdout.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ChildReport {
    /// Seconds spent writing.
    pub write_s: f64,
    /// Resident bytes added by the load (`scale`).
    pub rss_delta_bytes: f64,
    /// Mean point read, ns (`scale`).
    pub read_ns: f64,
    /// p50 / p99 of one-put `sync` commits, µs (`scale`).
    pub sync_p50_us: f64,
    /// 99th percentile of one-put `sync` commits, µs (`scale`).
    pub sync_p99_us: f64,
    /// Mean one-put `relaxed` commit, µs (`scale`).
    pub relaxed_us: f64,
    /// `reopen`: how long `Database::open` took, ms.
    #[serde(default)]
    pub reopen_ms: f64,
    /// `reopen`: WAL frames the open replayed.
    #[serde(default)]
    pub frames_replayed: u64,
    /// `reopen`: keys in the store after the open.
    #[serde(default)]
    pub keys: u64,
}

/// Entry point of the hidden subcommand: runs the spec, prints the report, waits to be killed.
pub fn child_main(spec: &str) -> anyhow::Result<()> {
    let spec: ChildSpec = serde_json::from_str(spec).context("parsing the child spec")?;
    let report = match spec.task.as_str() {
        "fill" => fill(&spec)?,
        "scale" => scale(&spec)?,
        "reopen" => reopen(&spec)?,
        other => bail!("unknown child task `{other}`"),
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", serde_json::to_string(&report)?)?;
    stdout.flush()?;
    drop(stdout);
    // Wait for SIGKILL; the parent kills within milliseconds, this only bounds an orphan.
    std::thread::sleep(Duration::from_secs(600));
    bail!("the benchmark parent never killed this child")
}

/// Options for the child's KeelDB stores: relaxed, and no automatic checkpoint, so the whole
/// history stays in the WAL until the spec asks for a checkpoint.
pub fn keel_options() -> keeldb::Options {
    keeldb::Options { checkpoint_wal_bytes: 0, ..keeldb::Options::with_durability(keeldb::Durability::Relaxed) }
}

fn open(spec: &ChildSpec) -> anyhow::Result<Box<dyn Store>> {
    if spec.system == "keeldb" {
        return Ok(Box::new(KeelStore::open(&spec.dir, keel_options())?));
    }
    let system =
        peers::by_name(&spec.system).with_context(|| format!("system `{}` is not compiled in", spec.system))?;
    system.open(&spec.dir, Mode::Relaxed)
}

fn fill(spec: &ChildSpec) -> anyhow::Result<ChildReport> {
    let store = open(spec)?;
    let value = value_bytes(spec.value_bytes, 1);
    let started = Instant::now();
    let batch = spec.batch.max(1);
    let mut next = 0;
    while next < spec.records {
        let end = (next + batch).min(spec.records);
        let keys: Vec<[u8; 16]> = (next..end).map(key16).collect();
        let puts: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (&k[..], &value[..])).collect();
        store.write(None, &puts)?;
        next = end;
    }
    if spec.checkpoint {
        store.checkpoint()?;
    }
    let write_s = started.elapsed().as_secs_f64();
    // The store is deliberately not closed: the parent kills this process.
    std::mem::forget(store);
    Ok(ChildReport { write_s, ..ChildReport::default() })
}

fn scale(spec: &ChildSpec) -> anyhow::Result<ChildReport> {
    ensure!(spec.system == "keeldb", "the scale task measures keeldb only");
    let store = KeelStore::open(&spec.dir, keel_options())?;
    let db = &store.db;
    let value = value_bytes(spec.value_bytes, 42);
    let rss_before = crate::machine::resident_bytes();
    let started = Instant::now();
    let mut next = 0;
    while next < spec.records {
        let end = (next + spec.batch.max(1)).min(spec.records);
        let mut tx = db.begin_write()?;
        for i in next..end {
            tx.put(peers::keeldb::TABLE, &key16(i), &value)?;
        }
        tx.commit()?;
        next = end;
    }
    let write_s = started.elapsed().as_secs_f64();
    let rss_after = crate::machine::resident_bytes();
    let rss_delta_bytes = match (rss_before, rss_after) {
        (Some(before), Some(after)) => after.saturating_sub(before) as f64,
        _ => 0.0,
    };

    let rx = db.begin_read()?;
    let mut order = IndexStream::new(0xbead, spec.records);
    let mut found = 0u64;
    let mut buf = Vec::new();
    let started = Instant::now();
    for _ in 0..spec.reads {
        if std::hint::black_box(rx.get_into(peers::keeldb::TABLE, &key16(order.next_index()), &mut buf)?)
            && std::hint::black_box(&buf).len() == spec.value_bytes
        {
            found += 1;
        }
    }
    let read_ns = started.elapsed().as_nanos() as f64 / spec.reads.max(1) as f64;
    ensure!(found == spec.reads, "engine bug: loaded keys not found");
    drop(rx);

    let one_put = |i: u64, durability: keeldb::Durability| -> anyhow::Result<()> {
        let options = keeldb::TxnOptions { durability: Some(durability), ..keeldb::TxnOptions::default() };
        let mut tx = db.begin_write_with(options)?;
        tx.put("commits", &key16(i), &value)?;
        tx.commit()?;
        Ok(())
    };
    let mut sync = Samples::with_capacity(1024);
    let deadline = Instant::now() + Duration::from_millis(spec.sync_budget_ms);
    for i in 0..spec.sync_commits {
        if i >= 5 && Instant::now() >= deadline {
            break;
        }
        let t = Instant::now();
        one_put(i, keeldb::Durability::Sync)?;
        sync.push(t.elapsed());
    }
    let relaxed_count = spec.sync_commits.max(100) * 10;
    let started = Instant::now();
    for i in 0..relaxed_count {
        one_put(u64::MAX / 2 + i, keeldb::Durability::Relaxed)?;
    }
    let relaxed_us = started.elapsed().as_secs_f64() * 1e6 / relaxed_count as f64;
    std::mem::forget(store);
    Ok(ChildReport {
        write_s,
        rss_delta_bytes,
        read_ns,
        sync_p50_us: sync.percentile_ns(50.0) / 1e3,
        sync_p99_us: sync.percentile_ns(99.0) / 1e3,
        relaxed_us,
        ..ChildReport::default()
    })
}

/// Times one open of a KeelDB store in this fresh process, as a restarted application would
/// open it; then, if the spec asks, checkpoints; then closes it cleanly.
fn reopen(spec: &ChildSpec) -> anyhow::Result<ChildReport> {
    ensure!(spec.system == "keeldb", "the reopen task measures keeldb only");
    let started = Instant::now();
    let db = keeldb::Database::open(&spec.dir, keel_options())
        .with_context(|| format!("reopening {}", spec.dir.display()))?;
    let reopen_ms = started.elapsed().as_secs_f64() * 1e3;
    let frames_replayed = db.recovery_report().frames_replayed;
    let keys = db.stats().tables.iter().map(|t| t.keys).sum::<u64>();
    if spec.checkpoint {
        db.checkpoint()?;
    }
    db.close()?;
    Ok(ChildReport { reopen_ms, frames_replayed, keys, ..ChildReport::default() })
}

/// A running child, killed (SIGKILL) and reaped when dropped.
pub struct Running {
    child: Child,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a child with `spec`, waits for its report line, SIGKILLs it and reaps it.
pub fn run_and_kill(command: &[String], spec: &ChildSpec) -> anyhow::Result<ChildReport> {
    let (program, args) = command.split_first().context("empty child command")?;
    let child = Command::new(program)
        .args(args)
        .arg(serde_json::to_string(spec)?)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting the benchmark helper `{program}`"))?;
    let mut running = Running { child };
    let stdout = running.child.stdout.take().context("child stdout")?;
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)?;
    if line.trim().is_empty() {
        let status = running.child.wait()?;
        bail!("the benchmark helper for {} exited ({status}) without a report", spec.system);
    }
    let report: ChildReport =
        serde_json::from_str(line.trim()).with_context(|| format!("parsing the helper's report {line:?}"))?;
    // `Child::kill` sends SIGKILL on Unix: no destructor, no close, no final fsync.
    running.child.kill().context("killing the benchmark helper")?;
    running.child.wait()?;
    Ok(report)
}

/// Whether `dir` holds anything (a sanity check that the child wrote where it was told).
pub fn is_populated(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some())
}
