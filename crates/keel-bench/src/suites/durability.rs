//! The `durability` suite: seed 004's table for each durability mode (`sync`, `periodic`
//! at 100 ms, `relaxed`). A create is one write transaction putting one 100–200 byte JSON
//! record under a fresh key; a read is a fresh read transaction and one point get; the
//! 5-operation transaction reads a record, updates it and creates three; bulk puts 100 records
//! in one transaction.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use keeldb::{Database, Durability};

use super::{open, task_json, IndexStream};
use crate::report::Row;
use crate::timing::{ns_to_us, per_second, Budget, Samples};
use crate::{Scale, SuiteContext};

const SUITE: &str = "durability";
const TABLE: &str = "tasks";

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

/// Runs the suite for each durability mode.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let modes = [
        Durability::Sync,
        Durability::Periodic(Duration::from_millis(100)),
        Durability::Relaxed,
    ];
    let mut rows = Vec::new();
    for durability in modes {
        let dir = context.temp_dir(SUITE)?;
        let db = open(dir.path(), durability)?;
        let mode_rows = run_mode(context, &db, durability.name())?;
        db.close().context("closing the store")?;
        rows.extend(mode_rows);
    }
    Ok(rows)
}

fn run_mode(context: &SuiteContext, db: &Database, config: &str) -> anyhow::Result<Vec<Row>> {
    let budgets = budgets(context.scale);
    let mut rows = Vec::new();
    let mut push = |case: &str, metric: &str, value: f64| {
        rows.push(Row::new(SUITE, "keeldb", config, case, metric, value));
    };
    let mut next_id: u64 = 0;

    let (mut created, elapsed) = creates(db, budgets.creates, &mut next_id)?;
    let create_ops = per_second(created.len() as u64, elapsed);
    push("create", "avg_us", ns_to_us(created.mean_ns()));
    push("create", "min_us", ns_to_us(created.min_ns()));
    push("create", "max_us", ns_to_us(created.max_ns()));
    push("create", "p99_us", ns_to_us(created.percentile_ns(99.0)));
    context.progress.line(
        SUITE,
        format!(
            "keeldb {config} create: {} ops, avg {:.1} µs, {create_ops:.0} ops/s",
            created.len(),
            ns_to_us(created.mean_ns())
        ),
    );

    let (read_ns, read_ops) = reads(db, budgets.reads, next_id)?;
    push("read", "avg_us", ns_to_us(read_ns));

    let txn = five_op_txns(db, budgets.txn_5_ops, &mut next_id)?;
    push("txn_5_ops", "avg_us", ns_to_us(txn.mean_ns()));

    let bulk = bulk_100(db, budgets.bulk_100, &mut next_id)?;
    // Items per second of transaction time; building the records is not part of it.
    let bulk_ops = if bulk.mean_ns() > 0.0 {
        100.0 * 1e9 / bulk.mean_ns()
    } else {
        0.0
    };
    push("bulk_100", "total_us", ns_to_us(bulk.mean_ns()));
    push("bulk_100", "per_item_us", ns_to_us(bulk.mean_ns() / 100.0));

    push("create", "ops_per_s", create_ops);
    push("bulk_100", "ops_per_s", bulk_ops);
    push("read", "ops_per_s", read_ops);
    context.progress.line(
        SUITE,
        format!(
            "keeldb {config} read avg {:.2} µs, 5-op txn {:.1} µs, bulk 100 {:.1} µs ({bulk_ops:.0} items/s)",
            ns_to_us(read_ns),
            ns_to_us(txn.mean_ns()),
            ns_to_us(bulk.mean_ns())
        ),
    );
    Ok(rows)
}

fn task_key(id: u64) -> Vec<u8> {
    format!("task-{id:010}").into_bytes()
}

/// Single creates, each its own committed transaction; per-operation latencies and the time
/// the whole loop took.
fn creates(
    db: &Database,
    budget: Budget,
    next_id: &mut u64,
) -> anyhow::Result<(Samples, Duration)> {
    let mut samples = Samples::with_capacity(1024);
    let mut run = budget.start();
    while run.keep_going() {
        let id = *next_id;
        *next_id += 1;
        let (key, value) = (task_key(id), task_json(id));
        let started = Instant::now();
        let mut tx = db.begin_write()?;
        tx.put(TABLE, &key, &value)?;
        tx.commit()?;
        samples.push(started.elapsed());
    }
    Ok((samples, run.elapsed()))
}

/// Point reads of existing records, each in a fresh read transaction, in a pseudo-random order.
/// Timed as a batch (a clock read per operation would be a visible share of it); returns the
/// mean latency in ns and the operations per second.
fn reads(db: &Database, budget: Budget, existing: u64) -> anyhow::Result<(f64, f64)> {
    ensure!(existing > 0, "no records to read");
    let mut order = IndexStream::new(0x5eed, existing);
    let mut found = 0u64;
    let mut run = budget.start();
    while run.keep_going() {
        let rx = db.begin_read()?;
        if rx.get(TABLE, &task_key(order.next_index()))?.is_some() {
            found += 1;
        }
    }
    let elapsed = run.elapsed();
    ensure!(
        found == run.iterations(),
        "engine bug: {} of {} reads of committed records found nothing",
        run.iterations() - found,
        run.iterations()
    );
    let ops = per_second(run.iterations(), elapsed);
    let mean_ns = elapsed.as_nanos() as f64 / run.iterations().max(1) as f64;
    Ok((mean_ns, ops))
}

/// Transactions of five operations: read a record, update it, create three more.
fn five_op_txns(db: &Database, budget: Budget, next_id: &mut u64) -> anyhow::Result<Samples> {
    let existing = *next_id;
    let mut order = IndexStream::new(0xfeed, existing);
    let mut samples = Samples::with_capacity(1024);
    let mut run = budget.start();
    while run.keep_going() {
        let target = task_key(order.next_index());
        let new_ids = [*next_id, *next_id + 1, *next_id + 2];
        *next_id += 3;
        let started = Instant::now();
        let mut tx = db.begin_write()?;
        let mut record = tx
            .get(TABLE, &target)?
            .context("engine bug: committed record missing")?;
        record.extend_from_slice(b" ");
        tx.put(TABLE, &target, &record)?;
        for id in new_ids {
            tx.put(TABLE, &task_key(id), &task_json(id))?;
        }
        tx.commit()?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

/// Transactions creating 100 records each; per-transaction latencies.
fn bulk_100(db: &Database, budget: Budget, next_id: &mut u64) -> anyhow::Result<Samples> {
    let mut samples = Samples::with_capacity(256);
    let mut run = budget.start();
    while run.keep_going() {
        let first = *next_id;
        *next_id += 100;
        let records: Vec<(Vec<u8>, Vec<u8>)> = (first..first + 100)
            .map(|id| (task_key(id), task_json(id)))
            .collect();
        let started = Instant::now();
        let mut tx = db.begin_write()?;
        for (key, value) in &records {
            tx.put(TABLE, key, value)?;
        }
        tx.commit()?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}
