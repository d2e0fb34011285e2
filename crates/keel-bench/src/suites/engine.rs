//! The `engine` suite: KeelDB-only figures for what a replicated state machine needs from the
//! engine (issue 10), measured side by side in one run:
//! - `apply`: one-put commands from a (synthetic) replicated log applied on one thread, relaxed,
//!   one command per `apply_batch` call and 64 per call;
//! - `async-commit`: `sync` one-put commits from 64 and 1,024 tasks of ONE current-thread tokio
//!   runtime (`commit_async`), beside 64 blocking threads on the same store; with SurrealKV
//!   selected, its async commit (`Durability::Immediate`) driven the same way;
//! - `history`: memory per retained version with `keep_history` (process RSS growth per
//!   overwrite, and the change feed's own count of bytes per change).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use keeldb::{Command, Database, Durability, LogPosition, Options};

use super::mix64;
use crate::report::Row;
use crate::{Scale, SuiteContext};

const SUITE: &str = "engine";

fn apply_commands(scale: Scale) -> u64 {
    match scale {
        Scale::Full => 1_000_000,
        Scale::Quick => 200_000,
        Scale::Tiny => 2_000,
    }
}

fn window(scale: Scale) -> Duration {
    match scale {
        Scale::Full => Duration::from_millis(3_000),
        Scale::Quick => Duration::from_millis(700),
        Scale::Tiny => Duration::from_millis(30),
    }
}

fn history_versions(scale: Scale) -> u64 {
    match scale {
        Scale::Full => 1_000_000,
        Scale::Quick => 200_000,
        Scale::Tiny => 2_000,
    }
}

/// Runs the three parts.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for batch in [1u64, 64] {
        let per_s = apply(context, batch)?;
        context.progress.line(SUITE, format!("apply one-put commands, relaxed, batch {batch}: {per_s:.0} commands/s"));
        rows.push(Row::new(SUITE, "keeldb", "relaxed", &format!("apply_batch_{batch}"), "commands_per_s", per_s));
    }
    rows.extend(async_commit(context)?);
    rows.extend(history(context)?);
    Ok(rows)
}

fn open(context: &SuiteContext, label: &str, options: Options) -> anyhow::Result<(tempfile::TempDir, Database)> {
    let dir = context.temp_dir(label)?;
    let path = dir.path().join("store");
    let db = Database::open(&path, options).with_context(|| format!("opening {}", path.display()))?;
    Ok((dir, db))
}

/// Commands per second applying `apply_commands` one-put commands, `batch` per call.
fn apply(context: &SuiteContext, batch: u64) -> anyhow::Result<f64> {
    let options = Options { durability: Durability::Relaxed, ..Options::default() };
    let (_dir, db) = open(context, "apply", options)?;
    let total = apply_commands(context.scale);
    let started = Instant::now();
    let mut index = 0;
    while index < total {
        let n = batch.min(total - index);
        let commands = (index + 1..=index + n)
            .map(|i| (LogPosition::new(i, 1), Command::new().put("kv", mix64(i).to_be_bytes(), [7u8; 32])))
            .collect();
        for outcome in db.apply_batch(commands) {
            outcome.context("applying a command")?;
        }
        index += n;
    }
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(db.applied() == Some(LogPosition::new(total, 1)), "applied position is not the last command");
    db.close()?;
    Ok(total as f64 / secs)
}

/// 64 blocking threads, then 64 and 1,024 async tasks on one runtime thread, one store.
fn async_commit(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let (_dir, db) = open(context, "async", Options::with_durability(Durability::Sync))?;
    let window = window(context.scale);
    let mut rows = Vec::new();
    let record = |case: &str, commits: u64, syncs: u64, secs: f64, rows: &mut Vec<Row>| {
        let per_s = commits as f64 / secs;
        let per_sync = commits as f64 / syncs.max(1) as f64;
        context.progress.line(SUITE, format!("sync {case}: {per_s:.0} commits/s, {per_sync:.1} commits/fdatasync"));
        rows.push(Row::new(SUITE, "keeldb", "sync", case, "commits_per_s", per_s));
        rows.push(Row::new(SUITE, "keeldb", "sync", case, "commits_per_sync", per_sync));
    };
    let (commits, syncs, secs) = blocking_threads(&db, 64, window)?;
    record("threads_64", commits, syncs, secs, &mut rows);
    for tasks in [64u64, 1024] {
        let (commits, syncs, secs) = async_tasks(&db, tasks, window)?;
        record(&format!("async_tasks_{tasks}_one_thread"), commits, syncs, secs, &mut rows);
    }
    db.close()?;
    #[cfg(feature = "surrealkv")]
    if context.peers.iter().any(|p| p.name() == "surrealkv") {
        for tasks in [64u64, 1024] {
            let dir = context.temp_dir("surrealkv-async")?;
            let (commits, secs) = surrealkv_async::tasks(dir.path(), tasks, window)?;
            let per_s = commits as f64 / secs;
            let case = format!("async_tasks_{tasks}_one_thread");
            context.progress.line(SUITE, format!("surrealkv sync {case}: {per_s:.0} commits/s"));
            rows.push(Row::new(SUITE, "surrealkv", "sync", &case, "commits_per_s", per_s));
        }
    }
    Ok(rows)
}

/// SurrealKV's async commit driven as KeelDB's is above: `tasks` tasks on ONE current-thread
/// tokio runtime, each committing one 100-byte put at a time with `Durability::Immediate`
/// (its fsync-per-batch mode) until the window closes.
#[cfg(feature = "surrealkv")]
mod surrealkv_async {
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Duration;

    use anyhow::Context;
    use surrealkv::{Durability, TreeBuilder};

    use super::mix64;

    pub fn tasks(dir: &Path, tasks: u64, window: Duration) -> anyhow::Result<(u64, f64)> {
        let runtime =
            tokio::runtime::Builder::new_current_thread().enable_all().build().context("building a tokio runtime")?;
        runtime.block_on(async {
            let tree = Arc::new(
                TreeBuilder::new().with_path(dir.join("store")).build_async().await.context("opening surrealkv")?,
            );
            let driven = {
                let tree = Arc::clone(&tree);
                super::drive_tasks(tasks, window, move |t, i| {
                    let tree = Arc::clone(&tree);
                    async move {
                        let mut tx = tree.begin()?;
                        tx.set_durability(Durability::Immediate);
                        tx.set(mix64((t + 2_000_000) << 40 | i).to_be_bytes().to_vec(), vec![3u8; 100])?;
                        tx.commit().await
                    }
                })
                .await
            };
            tree.close().await.context("closing surrealkv")?;
            driven.context("a surrealkv async commit failed")
        })
    }
}

fn blocking_threads(db: &Database, threads: u64, window: Duration) -> anyhow::Result<(u64, u64, f64)> {
    let syncs_before = db.stats().wal_syncs;
    let committed = AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let committed = &committed;
                scope.spawn(move || -> anyhow::Result<()> {
                    let mut i = 0u64;
                    while started.elapsed() < window {
                        let mut tx = db.begin_write()?;
                        tx.put("t", &mix64(t << 40 | i).to_be_bytes(), &[1u8; 100])?;
                        tx.commit()?;
                        committed.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("a writer thread panicked"))??;
        }
        Ok(())
    })?;
    let secs = started.elapsed().as_secs_f64();
    Ok((committed.load(Ordering::Relaxed), db.stats().wal_syncs - syncs_before, secs))
}

fn async_tasks(db: &Database, tasks: u64, window: Duration) -> anyhow::Result<(u64, u64, f64)> {
    let runtime = tokio::runtime::Builder::new_current_thread().build().context("building a tokio runtime")?;
    let syncs_before = db.stats().wal_syncs;
    let handle = db.clone();
    let (commits, secs) = runtime
        .block_on(drive_tasks(tasks, window, move |t, i| {
            let db = handle.clone();
            async move {
                let mut tx = db.begin_write()?;
                tx.put("a", &mix64((t + 1_000_000) << 40 | i).to_be_bytes(), &[2u8; 100])?;
                tx.commit_async().await.map(|_| ())
            }
        }))
        .context("an async commit failed")?;
    Ok((commits, db.stats().wal_syncs - syncs_before, secs))
}

/// Runs `tasks` tasks on the current runtime, each awaiting `commit(task, i)` for i = 0, 1, ...
/// until `window` has passed or any commit failed. Returns the commits made and the seconds
/// taken, or the first failure.
async fn drive_tasks<F, Fut, E>(tasks: u64, window: Duration, commit: F) -> anyhow::Result<(u64, f64)>
where
    F: Fn(u64, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), E>> + Send,
    E: std::fmt::Display + Send + 'static,
{
    let committed = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let (commit, committed, failed) = (commit.clone(), Arc::clone(&committed), Arc::clone(&failed));
            tokio::spawn(async move {
                let mut i = 0u64;
                while started.elapsed() < window && !failed.load(Ordering::Relaxed) {
                    match commit(t, i).await {
                        Ok(()) => {
                            committed.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            return Err(e.to_string());
                        }
                    }
                    i += 1;
                }
                Ok(())
            })
        })
        .collect();
    let mut first_error = None;
    for h in handles {
        let outcome = h.await.map_err(|e| e.to_string()).and_then(|r| r);
        if let Err(e) = outcome {
            first_error.get_or_insert(e);
        }
    }
    let secs = started.elapsed().as_secs_f64();
    match first_error {
        Some(e) => Err(anyhow::anyhow!(e)),
        None => Ok((committed.load(Ordering::Relaxed), secs)),
    }
}

/// Resident set size of this process in bytes (Linux `VmRSS`; 0 elsewhere).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
        .unwrap_or(0);
    kib * 1024
}

/// Overwrites 1,000 keys `history_versions` times with history kept; RSS growth per retained
/// version, and the feed's own bytes per change.
fn history(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let options = Options { durability: Durability::Relaxed, keep_history: true, ..Options::default() };
    let (_dir, db) = open(context, "history", options)?;
    let versions = history_versions(context.scale);
    let before = rss_bytes();
    for i in 0..versions {
        let mut tx = db.begin_write()?;
        tx.put("h", &(i % 1_000).to_be_bytes(), &mix64(i).to_le_bytes().repeat(4))?;
        tx.commit()?;
    }
    let grown = rss_bytes().saturating_sub(before);
    let stats = db.stats();
    let rss_per_version = grown as f64 / versions as f64;
    let feed_per_change = stats.history_bytes as f64 / stats.history_changes.max(1) as f64;
    context.progress.line(
        SUITE,
        format!(
            "history: {versions} retained versions (8-byte keys, 32-byte values): {rss_per_version:.0} B RSS each, change feed {feed_per_change:.0} B per change"
        ),
    );
    db.close()?;
    Ok(vec![
        Row::new(
            SUITE,
            "keeldb",
            "keep_history",
            "overwrite_8b_key_32b_value",
            "rss_bytes_per_version",
            rss_per_version,
        ),
        Row::new(
            SUITE,
            "keeldb",
            "keep_history",
            "overwrite_8b_key_32b_value",
            "feed_bytes_per_change",
            feed_per_change,
        ),
    ])
}
