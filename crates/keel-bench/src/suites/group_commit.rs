//! The `group-commit` suite: the raw-fdatasync baseline (4 KiB append + fdatasync in a loop),
//! then KeelDB in `sync` mode with 1 to 64 writer threads, each committing one-put
//! transactions on keys no other thread writes (so there are no conflicts). With group commit,
//! many writers share each fdatasync and commits per second rise above the baseline.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::Context;
use keeldb::{Database, Durability};

use super::{open, value_bytes};
use crate::raw_sync;
use crate::report::Row;
use crate::timing::{ns_to_us, per_second, Budget, Samples};
use crate::{Scale, SuiteContext};

const SUITE: &str = "group-commit";
const TABLE: &str = "commits";
const VALUE_BYTES: usize = 100;

fn writer_counts(scale: Scale) -> &'static [usize] {
    match scale {
        Scale::Full | Scale::Quick => &[1, 2, 4, 8, 16, 32, 64],
        Scale::Tiny => &[1, 4],
    }
}

fn raw_budget(scale: Scale) -> Budget {
    let ms = Duration::from_millis;
    match scale {
        Scale::Full => Budget::new(100, 20_000, ms(3_000)),
        Scale::Quick => Budget::new(20, 5_000, ms(700)),
        Scale::Tiny => Budget::new(5, 5, ms(0)),
    }
}

fn window(scale: Scale) -> Duration {
    match scale {
        Scale::Full => Duration::from_millis(3_000),
        Scale::Quick => Duration::from_millis(500),
        Scale::Tiny => Duration::from_millis(30),
    }
}

/// Runs the baseline and every writer count.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let dir = context.temp_dir(SUITE)?;

    let raw = raw_sync::run(dir.path(), raw_budget(context.scale))?;
    context.progress.line(
        SUITE,
        format!(
            "raw-fdatasync 4 KiB append: {:.0} syncs/s, p50 {:.0} µs, p99 {:.0} µs",
            raw.commits_per_s, raw.p50_us, raw.p99_us
        ),
    );
    let raw_row = |metric: &str, value: f64| {
        Row::new(SUITE, "raw-fdatasync", "4k-append", "single", metric, value)
    };
    rows.push(raw_row("commits_per_s", raw.commits_per_s));
    rows.push(raw_row("p50_us", raw.p50_us));
    rows.push(raw_row("p99_us", raw.p99_us));

    let db = open(&dir.path().join("store"), Durability::Sync)?;
    for &writers in writer_counts(context.scale) {
        let result = run_writers(&db, writers, window(context.scale))?;
        let ratio = if raw.commits_per_s > 0.0 {
            result.commits_per_s / raw.commits_per_s
        } else {
            0.0
        };
        context.progress.line(
            SUITE,
            format!(
                "keeldb sync writers={writers}: {:.0} commits/s ({ratio:.2}× raw), p50 {:.0} µs, p99 {:.0} µs, {:.1} commits/fdatasync",
                result.commits_per_s, result.p50_us, result.p99_us, result.commits_per_sync
            ),
        );
        let case = format!("writers_{writers}");
        for (metric, value) in [
            ("commits_per_s", result.commits_per_s),
            ("p50_us", result.p50_us),
            ("p99_us", result.p99_us),
            ("commits_per_sync", result.commits_per_sync),
        ] {
            rows.push(Row::new(SUITE, "keeldb", "sync", &case, metric, value));
        }
    }
    db.close().context("closing the store")?;
    Ok(rows)
}

struct WritersResult {
    commits_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    /// Commits per WAL fdatasync, from the engine's counters: how well commits shared syncs.
    commits_per_sync: f64,
}

/// `writers` threads commit one-put transactions until `window` has passed.
fn run_writers(db: &Database, writers: usize, window: Duration) -> anyhow::Result<WritersResult> {
    let before = db.stats();
    let barrier = Barrier::new(writers + 1);
    let value = value_bytes(VALUE_BYTES, writers as u64);
    let (per_thread, elapsed) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..writers)
            .map(|thread| {
                let (db, barrier, value) = (db.clone(), &barrier, &value);
                scope.spawn(move || -> anyhow::Result<Samples> {
                    barrier.wait();
                    writer_loop(&db, writers, thread, value, window)
                })
            })
            .collect();
        barrier.wait();
        let started = Instant::now();
        let results: Vec<anyhow::Result<Samples>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a writer thread panicked")))
            })
            .collect();
        (results, started.elapsed())
    });
    let after = db.stats();
    let mut samples = Samples::with_capacity(1 << 16);
    for result in per_thread {
        samples.merge(result?);
    }
    let commits = after.commits.saturating_sub(before.commits);
    let syncs = after.wal_syncs.saturating_sub(before.wal_syncs);
    Ok(WritersResult {
        commits_per_sync: if syncs > 0 {
            commits as f64 / syncs as f64
        } else {
            0.0
        },
        commits_per_s: per_second(samples.len() as u64, elapsed),
        p50_us: ns_to_us(samples.percentile_ns(50.0)),
        p99_us: ns_to_us(samples.percentile_ns(99.0)),
    })
}

fn writer_loop(
    db: &Database,
    writers: usize,
    thread: usize,
    value: &[u8],
    window: Duration,
) -> anyhow::Result<Samples> {
    let deadline = Instant::now() + window;
    let mut samples = Samples::with_capacity(4096);
    let mut i: u64 = 0;
    loop {
        let started = Instant::now();
        if started >= deadline {
            break;
        }
        let key = format!("w{writers}-t{thread}-{i}");
        i += 1;
        let mut tx = db.begin_write()?;
        tx.put(TABLE, key.as_bytes(), value)?;
        tx.commit().with_context(|| {
            format!("commit by writer {thread} of {writers} (keys are disjoint, so a conflict is an engine bug)")
        })?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}
