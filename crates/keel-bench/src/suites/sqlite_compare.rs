//! The `sqlite-compare` suite: seed 001's SQLite figures, measured side by side with KeelDB.
//! SQLite runs with `journal_mode=DELETE` and `WAL` (both `synchronous=FULL`, which is durable
//! like KeelDB's `sync`) and with `WAL, synchronous=NORMAL` (durable at checkpoint, closest to
//! `periodic`); KeelDB runs `sync` and `relaxed`.
//!
//! Each store first gets 1,000 records (100–200 byte JSON, as seed 001's 1,000 consensus runs).
//! Cases: a read (fresh read transaction and one point get); a write (one insert, committed);
//! 100 inserts in one transaction against 100 individually committed inserts; and 10 threads
//! × 100 concurrent reads (wall time of the whole burst, each thread with its own reader per
//! read, as a 10-connection pool would do).

use std::time::{Duration, Instant};

use anyhow::ensure;

use super::{task_json, IndexStream};
use crate::peers::keeldb::KeelDb;
use crate::peers::{Mode, Store, System};
use crate::report::Row;
use crate::timing::{ns_to_us, Budget, Samples};
use crate::{Scale, SuiteContext};

const SUITE: &str = "sqlite-compare";
const PRELOAD: u64 = 1_000;

struct Plan {
    reads: Budget,
    writes: Budget,
    batches: Budget,
    bursts: Budget,
}

fn plan(scale: Scale) -> Plan {
    let ms = Duration::from_millis;
    match scale {
        Scale::Full => Plan {
            reads: Budget::new(1_000, 500_000, ms(1_000)),
            writes: Budget::new(50, 10_000, ms(1_500)),
            batches: Budget::new(3, 200, ms(2_000)),
            bursts: Budget::new(5, 200, ms(1_000)),
        },
        Scale::Quick => Plan {
            reads: Budget::new(1_000, 100_000, ms(200)),
            writes: Budget::new(20, 2_000, ms(300)),
            batches: Budget::new(2, 20, ms(400)),
            bursts: Budget::new(3, 50, ms(200)),
        },
        Scale::Tiny => Plan {
            reads: Budget::new(20, 50, ms(10)),
            writes: Budget::new(3, 5, ms(10)),
            batches: Budget::new(1, 1, ms(0)),
            bursts: Budget::new(1, 1, ms(0)),
        },
    }
}

/// Opens one configuration's store in a directory.
type Opener = Box<dyn Fn(&std::path::Path) -> anyhow::Result<Box<dyn Store>>>;

/// One configuration: a label for the `config` column and a way to open it.
struct Config {
    system: &'static str,
    config: &'static str,
    open: Opener,
}

fn configs(context: &SuiteContext) -> Vec<Config> {
    let mut configs = vec![
        Config { system: "keeldb", config: "sync", open: Box::new(|dir| KeelDb.open(dir, Mode::Sync)) },
        Config { system: "keeldb", config: "relaxed", open: Box::new(|dir| KeelDb.open(dir, Mode::Relaxed)) },
    ];
    #[cfg(feature = "sqlite")]
    if context.has_peer("sqlite") {
        use crate::peers::sqlite::{open_with, Journal};
        let sqlite = |config: &'static str, journal: Journal, mode: Mode| Config {
            system: "sqlite",
            config,
            open: Box::new(move |dir| {
                let store: Box<dyn Store> = Box::new(open_with(dir, journal, mode)?);
                Ok(store)
            }),
        };
        configs.push(sqlite("delete-full", Journal::Delete, Mode::Sync));
        configs.push(sqlite("wal-full", Journal::Wal, Mode::Sync));
        configs.push(sqlite("wal-normal", Journal::Wal, Mode::Periodic));
    }
    if !context.has_peer("sqlite") {
        context.progress.line(SUITE, "sqlite is not selected or not compiled in: keeldb rows only");
    }
    configs
}

/// Runs every configuration.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let plan = plan(context.scale);
    let mut rows = Vec::new();
    for config in configs(context) {
        let dir = context.temp_dir(SUITE)?;
        let store = (config.open)(dir.path())?;
        let mut push = |case: &str, metric: &str, value: f64| {
            rows.push(Row::new(SUITE, config.system, config.config, case, metric, value));
        };
        let keys: Vec<Vec<u8>> = (0..PRELOAD).map(key).collect();
        let values: Vec<Vec<u8>> = (0..PRELOAD).map(task_json).collect();
        let puts: Vec<(&[u8], &[u8])> = keys.iter().zip(&values).map(|(k, v)| (&k[..], &v[..])).collect();
        store.write(None, &puts)?;
        let mut next = PRELOAD;

        let read_ns = reads(store.as_ref(), plan.reads)?;
        push("read", "avg_us", ns_to_us(read_ns));

        let mut writes = Samples::with_capacity(1024);
        let mut run = plan.writes.start();
        while run.keep_going() {
            let (k, v) = (key(next), task_json(next));
            next += 1;
            let started = Instant::now();
            store.write(None, &[(&k, &v)])?;
            writes.push(started.elapsed());
        }
        push("write", "avg_us", ns_to_us(writes.mean_ns()));
        push("write", "p99_us", ns_to_us(writes.percentile_ns(99.0)));

        let (mut one_txn, mut individual) = (Samples::default(), Samples::default());
        let mut run = plan.batches.start();
        while run.keep_going() {
            let records: Vec<(Vec<u8>, Vec<u8>)> = (next..next + 100).map(|i| (key(i), task_json(i))).collect();
            next += 100;
            let puts: Vec<(&[u8], &[u8])> = records.iter().map(|(k, v)| (&k[..], &v[..])).collect();
            let started = Instant::now();
            store.write(None, &puts)?;
            one_txn.push(started.elapsed());
            let records: Vec<(Vec<u8>, Vec<u8>)> = (next..next + 100).map(|i| (key(i), task_json(i))).collect();
            next += 100;
            let started = Instant::now();
            for (k, v) in &records {
                store.write(None, &[(k, v)])?;
            }
            individual.push(started.elapsed());
        }
        push("insert_100_one_txn", "total_us", ns_to_us(one_txn.mean_ns()));
        push("insert_100_individual", "total_us", ns_to_us(individual.mean_ns()));

        let burst = concurrent_reads(store.as_ref(), plan.bursts)?;
        push("concurrent_reads_10x100", "total_us", ns_to_us(burst.mean_ns()));
        push("concurrent_reads_10x100", "per_read_us", ns_to_us(burst.mean_ns() / 1_000.0));
        context.progress.line(
            SUITE,
            format!(
                "{} {}: read {:.2} µs, write {:.1} µs, 100 in one txn {:.0} µs vs individually {:.0} µs, 10×100 reads {:.0} µs",
                config.system,
                config.config,
                ns_to_us(read_ns),
                ns_to_us(writes.mean_ns()),
                ns_to_us(one_txn.mean_ns()),
                ns_to_us(individual.mean_ns()),
                ns_to_us(burst.mean_ns())
            ),
        );
        store.close()?;
    }
    Ok(rows)
}

fn key(i: u64) -> Vec<u8> {
    format!("run-{i:010}").into_bytes()
}

/// Fresh reader and one get per read over the preloaded records; mean ns.
fn reads(store: &dyn Store, budget: Budget) -> anyhow::Result<f64> {
    let mut order = IndexStream::new(0x001, PRELOAD);
    let mut found = 0;
    let mut run = budget.start();
    while run.keep_going() {
        if store.reader()?.get(&key(order.next_index()))?.is_some() {
            found += 1;
        }
    }
    ensure!(found == run.iterations(), "preloaded records missing");
    Ok(run.elapsed().as_nanos() as f64 / run.iterations().max(1) as f64)
}

/// Bursts of 10 threads × 100 reads; the wall time of each burst.
fn concurrent_reads(store: &dyn Store, budget: Budget) -> anyhow::Result<Samples> {
    let mut bursts = Samples::default();
    let mut run = budget.start();
    while run.keep_going() {
        let barrier = std::sync::Barrier::new(11);
        let elapsed = std::thread::scope(|scope| -> anyhow::Result<Duration> {
            let handles: Vec<_> = (0..10u64)
                .map(|thread| {
                    let barrier = &barrier;
                    scope.spawn(move || -> anyhow::Result<()> {
                        let mut order = IndexStream::new(thread, PRELOAD);
                        barrier.wait();
                        for _ in 0..100 {
                            let value = store.reader()?.get(&key(order.next_index()))?;
                            ensure!(value.is_some(), "preloaded record missing");
                        }
                        Ok(())
                    })
                })
                .collect();
            barrier.wait();
            let started = Instant::now();
            for handle in handles {
                handle.join().map_err(|_| anyhow::anyhow!("a reader thread panicked"))??;
            }
            Ok(started.elapsed())
        })?;
        bursts.push(elapsed);
    }
    Ok(bursts)
}
