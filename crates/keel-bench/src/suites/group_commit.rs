//! The `group-commit` suite: the raw-fdatasync baseline (4 KiB append + fdatasync in a loop),
//! then KeelDB and every selected peer in `sync` mode (each peer's closest equivalent) with 1
//! to 64 writer threads, each committing one-put transactions (one key per durable commit) on
//! keys no other thread writes, so there are no conflicts. With group commit, many writers
//! share each fdatasync and commits per second rise above the baseline.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use super::value_bytes;
use crate::peers::{Mode, Store};
use crate::raw_sync;
use crate::report::Row;
use crate::timing::{ns_to_us, per_second, Budget, Samples};
use crate::{Scale, SuiteContext};

const SUITE: &str = "group-commit";
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
    let raw_row = |metric: &str, value: f64| Row::new(SUITE, "raw-fdatasync", "4k-append", "single", metric, value);
    rows.push(raw_row("commits_per_s", raw.commits_per_s));
    rows.push(raw_row("p50_us", raw.p50_us));
    rows.push(raw_row("p99_us", raw.p99_us));

    // Every store stays open for the whole suite and the systems take turns at each writer
    // count, so a noisy spell on a shared disk hits all of them at that count alike.
    let mut stores = Vec::new();
    for system in context.systems() {
        let store = system.open(&dir.path().join(system.name()), Mode::Sync)?;
        stores.push((system.name(), store));
    }
    for &writers in writer_counts(context.scale) {
        for (name, store) in &stores {
            let result = run_writers(store.as_ref(), writers, window(context.scale))?;
            let ratio = if raw.commits_per_s > 0.0 { result.commits_per_s / raw.commits_per_s } else { 0.0 };
            let per_sync = result.commits_per_sync.map(|c| format!(", {c:.1} commits/fdatasync")).unwrap_or_default();
            context.progress.line(
                SUITE,
                format!(
                    "{name} sync writers={writers}: {:.0} commits/s ({ratio:.2}× raw), p50 {:.0} µs, p99 {:.0} µs{per_sync}",
                    result.commits_per_s, result.p50_us, result.p99_us
                ),
            );
            let case = format!("writers_{writers}");
            let mut metrics =
                vec![("commits_per_s", result.commits_per_s), ("p50_us", result.p50_us), ("p99_us", result.p99_us)];
            if let Some(per_sync) = result.commits_per_sync {
                metrics.push(("commits_per_sync", per_sync));
            }
            for (metric, value) in metrics {
                rows.push(Row::new(SUITE, name, "sync", &case, metric, value));
            }
        }
    }
    for (_, store) in stores {
        store.close()?;
    }
    Ok(rows)
}

struct WritersResult {
    commits_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    /// Commits per WAL fdatasync, from the engine's counters: how well commits shared syncs.
    /// Only systems that count their syncs (KeelDB) report it.
    commits_per_sync: Option<f64>,
}

/// `writers` threads commit one-put transactions until `window` has passed.
fn run_writers(db: &dyn Store, writers: usize, window: Duration) -> anyhow::Result<WritersResult> {
    let before = db.sync_counters();
    let barrier = Barrier::new(writers + 1);
    let value = value_bytes(VALUE_BYTES, writers as u64);
    let (per_thread, elapsed) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..writers)
            .map(|thread| {
                let (barrier, value) = (&barrier, &value);
                scope.spawn(move || -> anyhow::Result<Samples> {
                    barrier.wait();
                    writer_loop(db, writers, thread, value, window)
                })
            })
            .collect();
        barrier.wait();
        let started = Instant::now();
        let results: Vec<anyhow::Result<Samples>> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a writer thread panicked"))))
            .collect();
        (results, started.elapsed())
    });
    let after = db.sync_counters();
    let mut samples = Samples::with_capacity(1 << 16);
    for result in per_thread {
        samples.merge(result?);
    }
    let commits_per_sync = match (before, after) {
        (Some((c0, s0)), Some((c1, s1))) => {
            let (commits, syncs) = (c1.saturating_sub(c0), s1.saturating_sub(s0));
            Some(if syncs > 0 { commits as f64 / syncs as f64 } else { 0.0 })
        }
        _ => None,
    };
    Ok(WritersResult {
        commits_per_sync,
        commits_per_s: per_second(samples.len() as u64, elapsed),
        p50_us: ns_to_us(samples.percentile_ns(50.0)),
        p99_us: ns_to_us(samples.percentile_ns(99.0)),
    })
}

fn writer_loop(
    db: &dyn Store,
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
        db.write(None, &[(key.as_bytes(), value)]).map_err(|e| {
            e.context(format!("commit by writer {thread} of {writers} (keys are disjoint, so a conflict is a bug)"))
        })?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}
