//! The `group-commit` suite: the raw-fdatasync baseline (4 KiB append + fdatasync in a loop),
//! then KeelDB and every selected peer in `sync` mode (each peer's closest equivalent) with 1
//! to 64 writer threads, each committing one-put transactions (one key per durable commit) on
//! keys no other thread writes, so there are no conflicts. With group commit, many writers
//! share each fdatasync and commits per second rise above the baseline. At one writer the
//! `raw-overwrite` ceiling (`raw_sync::Overwrite`: a 256-byte overwrite of written blocks and
//! an fdatasync) takes a turn between the systems' slices: no system's one-writer rate can
//! pass it by more than the disk's noise.
//!
//! What is measured is what a user's loop gets once it runs: at each writer count every system
//! first commits unmeasured for a warm-up (so the first moments of a just-opened store or of
//! a new writer count are not the figure), then the measured window is cut into slices and the
//! systems take turns slice by slice, so a slow spell of a shared disk (fdatasync latency on
//! the development VM moves several-fold within seconds) hits every system alike. A figure is
//! the sum of a system's slices. See docs/BENCHMARKS.md, "Why the suite and a user's loop
//! disagreed" (issue 12).

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

/// The measured time per system and writer count, its slices, and the unmeasured warm-up.
struct Plan {
    window: Duration,
    slices: u32,
    warmup: Duration,
}

fn plan(scale: Scale) -> Plan {
    let ms = Duration::from_millis;
    match scale {
        Scale::Full => Plan { window: ms(3_000), slices: 6, warmup: ms(500) },
        Scale::Quick => Plan { window: ms(500), slices: 2, warmup: ms(200) },
        Scale::Tiny => Plan { window: ms(30), slices: 2, warmup: ms(10) },
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
    let plan = plan(context.scale);
    // One writer's ceiling takes its turn between the 1-writer slices, so it meets the same
    // spells of the disk as the systems do.
    let mut ceiling = raw_sync::Overwrite::create(dir.path())?;
    let mut ceiling_total = WritersResult::default();
    for &writers in writer_counts(context.scale) {
        for (_, store) in &stores {
            run_writers(store.as_ref(), writers, 0, plan.warmup)?;
        }
        let mut totals: Vec<WritersResult> = stores.iter().map(|_| WritersResult::default()).collect();
        for slice in 1..=plan.slices {
            for ((_, store), total) in stores.iter().zip(&mut totals) {
                total.add(run_writers(store.as_ref(), writers, slice, plan.window / plan.slices)?);
            }
            if writers == 1 {
                let (samples, elapsed) = ceiling.run(Budget::new(1, u64::MAX, plan.window / plan.slices))?;
                ceiling_total.add(WritersResult { samples, elapsed, synced: None });
            }
        }
        if writers == 1 {
            rows.extend(ceiling_rows(context, std::mem::take(&mut ceiling_total).summary()));
        }
        for ((name, _), total) in stores.iter().zip(totals) {
            let result = total.summary();
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

/// The single-writer ceiling's rows (system `raw-overwrite`, case `writers_1`) and its
/// progress line.
fn ceiling_rows(context: &SuiteContext, result: Summary) -> Vec<Row> {
    context.progress.line(
        SUITE,
        format!(
            "raw-overwrite {} B + fdatasync, one writer's ceiling: {:.0} syncs/s, p50 {:.0} µs, p99 {:.0} µs",
            raw_sync::OVERWRITE_BYTES,
            result.commits_per_s,
            result.p50_us,
            result.p99_us
        ),
    );
    let config = format!("{}b-overwrite", raw_sync::OVERWRITE_BYTES);
    [("commits_per_s", result.commits_per_s), ("p50_us", result.p50_us), ("p99_us", result.p99_us)]
        .into_iter()
        .map(|(metric, value)| Row::new(SUITE, raw_sync::OVERWRITE_SYSTEM, &config, "writers_1", metric, value))
        .collect()
}

struct Summary {
    commits_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    /// Commits per WAL fdatasync, from the engine's counters: how well commits shared syncs.
    /// Only systems that count their syncs (KeelDB) report it.
    commits_per_sync: Option<f64>,
}

/// What one or more windows of `run_writers` measured, summed.
#[derive(Default)]
struct WritersResult {
    samples: Samples,
    elapsed: Duration,
    /// Commits and fdatasyncs by the engine's own counters, for systems that count them.
    synced: Option<(u64, u64)>,
}

impl WritersResult {
    fn add(&mut self, other: WritersResult) {
        self.samples.merge(other.samples);
        self.elapsed += other.elapsed;
        self.synced = match (self.synced, other.synced) {
            (Some((c0, s0)), Some((c1, s1))) => Some((c0 + c1, s0 + s1)),
            (None, other) => other,
            (mine, None) => mine,
        };
    }

    fn summary(mut self) -> Summary {
        let commits_per_sync =
            self.synced.map(|(commits, syncs)| if syncs > 0 { commits as f64 / syncs as f64 } else { 0.0 });
        Summary {
            commits_per_sync,
            commits_per_s: per_second(self.samples.len() as u64, self.elapsed),
            p50_us: ns_to_us(self.samples.percentile_ns(50.0)),
            p99_us: ns_to_us(self.samples.percentile_ns(99.0)),
        }
    }
}

/// `writers` threads commit one-put transactions until `window` has passed.
/// Every commit writes a new key: `round` (the warm-up, then each slice) is part of it. A
/// rewrite of an existing key with the same value can be a no-op for an engine (SQLite 3.54
/// writes nothing, so it neither logs nor syncs), which is not the durable commit measured.
fn run_writers(db: &dyn Store, writers: usize, round: u32, window: Duration) -> anyhow::Result<WritersResult> {
    let before = db.sync_counters();
    let barrier = Barrier::new(writers + 1);
    let value = value_bytes(VALUE_BYTES, writers as u64);
    let (per_thread, elapsed) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..writers)
            .map(|thread| {
                let (barrier, value) = (&barrier, &value);
                scope.spawn(move || -> anyhow::Result<Samples> {
                    barrier.wait();
                    writer_loop(db, writers, round, thread, value, window)
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
    let synced = match (before, after) {
        (Some((c0, s0)), Some((c1, s1))) => Some((c1.saturating_sub(c0), s1.saturating_sub(s0))),
        _ => None,
    };
    Ok(WritersResult { samples, elapsed, synced })
}

fn writer_loop(
    db: &dyn Store,
    writers: usize,
    round: u32,
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
        let key = format!("w{writers}-r{round}-t{thread}-{i}");
        i += 1;
        db.write(None, &[(key.as_bytes(), value)]).map_err(|e| {
            e.context(format!("commit by writer {thread} of {writers} (keys are disjoint, so a conflict is a bug)"))
        })?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}
