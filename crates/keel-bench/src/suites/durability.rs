//! The `durability` suite: seed 004's table for each durability mode (`sync`, `periodic`
//! at 100 ms, `relaxed`), for KeelDB and every selected peer (each in its closest equivalent
//! of the mode; the report's preamble says which). A create is one write transaction putting
//! one 100–200 byte JSON record under a fresh key; a read is a fresh read transaction (reader)
//! and one point get; the 5-operation transaction reads a record, updates it and creates
//! three; bulk puts 100 records in one transaction. All systems of one mode are open at once
//! and take turns in rounds (see [`ROUNDS`]).

use std::time::{Duration, Instant};

use anyhow::ensure;

use super::{task_json, IndexStream};
use crate::peers::{Mode, Store, System};
use crate::report::Row;
use crate::timing::{ns_to_us, per_second, Budget, Samples};
use crate::{Scale, SuiteContext};

const SUITE: &str = "durability";

struct Budgets {
    creates: Budget,
    reads: Budget,
    txn_5_ops: Budget,
    bulk_100: Budget,
}

fn budgets(scale: Scale) -> Budgets {
    let ms = Duration::from_millis;
    match scale {
        Scale::Full => Budgets {
            creates: Budget::new(50, 20_000, ms(3_000)),
            reads: Budget::new(1_000, 1_000_000, ms(1_000)),
            txn_5_ops: Budget::new(20, 10_000, ms(2_000)),
            bulk_100: Budget::new(10, 2_000, ms(2_000)),
        },
        Scale::Quick => Budgets {
            creates: Budget::new(20, 5_000, ms(600)),
            reads: Budget::new(1_000, 200_000, ms(200)),
            txn_5_ops: Budget::new(10, 2_000, ms(300)),
            bulk_100: Budget::new(5, 500, ms(300)),
        },
        Scale::Tiny => Budgets {
            creates: Budget::new(5, 20, ms(50)),
            reads: Budget::new(50, 200, ms(20)),
            txn_5_ops: Budget::new(3, 10, ms(20)),
            bulk_100: Budget::new(2, 3, ms(20)),
        },
    }
}

/// Each phase is split into this many rounds, and the systems take turns round by round, so a
/// noisy spell on a shared disk hits every system alike instead of whichever ran during it.
const ROUNDS: u64 = 4;

fn slice(budget: Budget) -> Budget {
    Budget::new(budget.min_iters.div_ceil(ROUNDS), budget.max_iters.div_ceil(ROUNDS), budget.max_time / ROUNDS as u32)
}

/// What one system accumulated over the rounds of one mode.
#[derive(Default)]
struct Tally {
    next_id: u64,
    created: Samples,
    create_time: Duration,
    reads: u64,
    read_time: Duration,
    txn: Samples,
    bulk: Samples,
}

/// A system, its open store, the store's directory (removed on drop) and its tally.
type OpenStore = (&'static dyn System, Box<dyn Store>, tempfile::TempDir, Tally);

/// Runs the suite for every durability mode, with every system's store of that mode open.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let budgets = budgets(context.scale);
    let mut rows = Vec::new();
    for mode in Mode::ALL {
        let mut stores: Vec<OpenStore> = Vec::new();
        for system in context.systems() {
            let dir = context.temp_dir(SUITE)?;
            let store = system.open(dir.path(), mode)?;
            stores.push((system, store, dir, Tally::default()));
        }
        for _ in 0..ROUNDS {
            for (_, store, _, tally) in &mut stores {
                let (samples, elapsed) = creates(store.as_ref(), slice(budgets.creates), &mut tally.next_id)?;
                tally.created.merge(samples);
                tally.create_time += elapsed;
            }
        }
        for _ in 0..ROUNDS {
            for (_, store, _, tally) in &mut stores {
                let (count, elapsed) = reads(store.as_ref(), slice(budgets.reads), tally.next_id)?;
                tally.reads += count;
                tally.read_time += elapsed;
            }
        }
        for _ in 0..ROUNDS {
            for (_, store, _, tally) in &mut stores {
                let samples = five_op_txns(store.as_ref(), slice(budgets.txn_5_ops), &mut tally.next_id)?;
                tally.txn.merge(samples);
            }
        }
        for _ in 0..ROUNDS {
            for (_, store, _, tally) in &mut stores {
                let samples = bulk_100(store.as_ref(), slice(budgets.bulk_100), &mut tally.next_id)?;
                tally.bulk.merge(samples);
            }
        }
        for (system, store, dir, mut tally) in stores {
            rows.extend(tally_rows(context, system.name(), mode.name(), &mut tally));
            store.close()?;
            drop(dir);
        }
    }
    Ok(rows)
}

fn tally_rows(context: &SuiteContext, name: &str, config: &str, tally: &mut Tally) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut push = |case: &str, metric: &str, value: f64| {
        rows.push(Row::new(SUITE, name, config, case, metric, value));
    };
    let created = &mut tally.created;
    let create_ops = per_second(created.len() as u64, tally.create_time);
    push("create", "avg_us", ns_to_us(created.mean_ns()));
    push("create", "min_us", ns_to_us(created.min_ns()));
    push("create", "max_us", ns_to_us(created.max_ns()));
    push("create", "p99_us", ns_to_us(created.percentile_ns(99.0)));
    let read_ns = tally.read_time.as_nanos() as f64 / tally.reads.max(1) as f64;
    let read_ops = per_second(tally.reads, tally.read_time);
    push("read", "avg_us", ns_to_us(read_ns));
    push("txn_5_ops", "avg_us", ns_to_us(tally.txn.mean_ns()));
    let bulk_ns = tally.bulk.mean_ns();
    // Items per second of transaction time; building the records is not part of it.
    let bulk_ops = if bulk_ns > 0.0 { 100.0 * 1e9 / bulk_ns } else { 0.0 };
    push("bulk_100", "total_us", ns_to_us(bulk_ns));
    push("bulk_100", "per_item_us", ns_to_us(bulk_ns / 100.0));
    push("create", "ops_per_s", create_ops);
    push("bulk_100", "ops_per_s", bulk_ops);
    push("read", "ops_per_s", read_ops);
    context.progress.line(
        SUITE,
        format!(
            "{name} {config}: create avg {:.1} µs ({create_ops:.0} ops/s), read avg {:.2} µs, 5-op txn {:.1} µs, bulk 100 {:.1} µs ({bulk_ops:.0} items/s)",
            ns_to_us(created.mean_ns()),
            ns_to_us(read_ns),
            ns_to_us(tally.txn.mean_ns()),
            ns_to_us(bulk_ns)
        ),
    );
    rows
}

fn task_key(id: u64) -> Vec<u8> {
    format!("task-{id:010}").into_bytes()
}

/// Single creates, each its own committed transaction; per-operation latencies and the time
/// the whole loop took.
fn creates(db: &dyn Store, budget: Budget, next_id: &mut u64) -> anyhow::Result<(Samples, Duration)> {
    let mut samples = Samples::with_capacity(1024);
    let mut run = budget.start();
    while run.keep_going() {
        let id = *next_id;
        *next_id += 1;
        let (key, value) = (task_key(id), task_json(id));
        let started = Instant::now();
        db.write(None, &[(&key, &value)])?;
        samples.push(started.elapsed());
    }
    Ok((samples, run.elapsed()))
}

/// Point reads of existing records, each with a fresh reader (read transaction), in a
/// pseudo-random order. Timed as a batch (a clock read per operation would be a visible share
/// of it); returns the number of reads and the time they took.
fn reads(db: &dyn Store, budget: Budget, existing: u64) -> anyhow::Result<(u64, Duration)> {
    ensure!(existing > 0, "no records to read");
    let mut order = IndexStream::new(0x5eed, existing);
    let mut found = 0u64;
    let mut run = budget.start();
    while run.keep_going() {
        let mut reader = db.reader()?;
        if reader.get(&task_key(order.next_index()))?.is_some() {
            found += 1;
        }
    }
    let elapsed = run.elapsed();
    ensure!(
        found == run.iterations(),
        "bug: {} of {} reads of committed records found nothing",
        run.iterations() - found,
        run.iterations()
    );
    Ok((run.iterations(), elapsed))
}

/// Transactions of five operations: read a record, update it, create three more.
fn five_op_txns(db: &dyn Store, budget: Budget, next_id: &mut u64) -> anyhow::Result<Samples> {
    let existing = *next_id;
    let mut order = IndexStream::new(0xfeed, existing);
    let mut samples = Samples::with_capacity(1024);
    let mut run = budget.start();
    while run.keep_going() {
        let target = task_key(order.next_index());
        let new_ids = [*next_id, *next_id + 1, *next_id + 2];
        *next_id += 3;
        let records: Vec<(Vec<u8>, Vec<u8>)> = new_ids.iter().map(|&id| (task_key(id), task_json(id))).collect();
        let puts: Vec<(&[u8], &[u8])> = records.iter().map(|(k, v)| (&k[..], &v[..])).collect();
        let started = Instant::now();
        db.write(Some(&target), &puts)?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

/// Transactions creating 100 records each; per-transaction latencies.
fn bulk_100(db: &dyn Store, budget: Budget, next_id: &mut u64) -> anyhow::Result<Samples> {
    let mut samples = Samples::with_capacity(256);
    let mut run = budget.start();
    while run.keep_going() {
        let first = *next_id;
        *next_id += 100;
        let records: Vec<(Vec<u8>, Vec<u8>)> = (first..first + 100).map(|id| (task_key(id), task_json(id))).collect();
        let puts: Vec<(&[u8], &[u8])> = records.iter().map(|(k, v)| (&k[..], &v[..])).collect();
        let started = Instant::now();
        db.write(None, &puts)?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}
