//! The `cpu-accounting` suite: seed 000's thread-CPU-accounting table for KeelDB.
//!
//! - Overhead on seed 000's workload: operations that each do ~1 ms of CPU work inside a
//!   relaxed write transaction, on a store with accounting on and one with it off, interleaved
//!   in rounds so that machine noise hits both alike.
//! - Overhead on the `durability` suite's relaxed single-put transaction, the same way.
//! - The cost of one thread-CPU-clock measurement.
//! - Detection delay: transactions with a CPU budget do work in small steps until the budget
//!   aborts them; the CPU used past the budget when the abort is raised, over many runs.

use std::time::{Duration, Instant};

use anyhow::Context;
use keeldb::{Database, Durability, Error, Options, TxnOptions};

use crate::report::Row;
use crate::timing::Samples;
use crate::{Scale, SuiteContext};

const SUITE: &str = "cpu-accounting";

struct Plan {
    work_ops: u64,
    put_txns: u64,
    rounds: u64,
    clock_reads: u64,
    detection_runs: u64,
}

fn plan(scale: Scale) -> Plan {
    match scale {
        Scale::Full => {
            Plan { work_ops: 1_000, put_txns: 300_000, rounds: 10, clock_reads: 1_000_000, detection_runs: 1_000 }
        }
        Scale::Quick => Plan { work_ops: 200, put_txns: 60_000, rounds: 4, clock_reads: 200_000, detection_runs: 200 },
        Scale::Tiny => Plan { work_ops: 10, put_txns: 500, rounds: 2, clock_reads: 1_000, detection_runs: 5 },
    }
}

/// A fixed amount of arithmetic (not "until the clock says so", which would hide the cost
/// being measured).
fn work(iterations: u64) -> u64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..iterations {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(i | 1);
        x ^= x >> 29;
    }
    std::hint::black_box(x)
}

/// Iterations of [`work`] that take about `target` of CPU on this machine.
fn calibrate(target: Duration) -> u64 {
    let mut n = 10_000u64;
    loop {
        let t = Instant::now();
        work(n);
        let took = t.elapsed();
        if took >= Duration::from_millis(20) {
            return (n as f64 * target.as_secs_f64() / took.as_secs_f64()).max(1.0) as u64;
        }
        n *= 2;
    }
}

fn open(dir: &std::path::Path, accounting: bool) -> anyhow::Result<Database> {
    let options = Options { durability: Durability::Relaxed, cpu_accounting: accounting, ..Options::default() };
    Database::open(dir, options).with_context(|| format!("opening {}", dir.display()))
}

/// Mean latency (ns) of `n` transactions of `body`, on each store, interleaved over rounds.
fn compare(
    on: &Database,
    off: &Database,
    rounds: u64,
    n: u64,
    mut body: impl FnMut(&Database, u64) -> anyhow::Result<()>,
) -> anyhow::Result<(f64, f64)> {
    let (mut on_ns, mut off_ns) = (0u128, 0u128);
    let per_round = (n / rounds).max(1);
    let mut next = 0u64;
    for _ in 0..rounds {
        for (db, total) in [(off, &mut off_ns), (on, &mut on_ns)] {
            let t = Instant::now();
            for i in 0..per_round {
                body(db, next + i)?;
            }
            *total += t.elapsed().as_nanos();
        }
        next += per_round;
    }
    let count = (per_round * rounds) as f64;
    Ok((on_ns as f64 / count, off_ns as f64 / count))
}

/// Runs the suite.
pub fn run(context: &SuiteContext) -> anyhow::Result<Vec<Row>> {
    let plan = plan(context.scale);
    let mut rows = Vec::new();
    let row =
        |config: &str, case: &str, metric: &str, value: f64| Row::new(SUITE, "keeldb", config, case, metric, value);
    let dir_on = context.temp_dir(SUITE)?;
    let dir_off = context.temp_dir(SUITE)?;
    let on = open(dir_on.path(), true)?;
    let off = open(dir_off.path(), false)?;

    // Seed 000: operations of ~1 ms of CPU work each.
    let iterations = calibrate(Duration::from_millis(1));
    let (with_ns, without_ns) = compare(&on, &off, plan.rounds, plan.work_ops, |db, i| {
        let mut tx = db.begin_write()?;
        work(iterations);
        tx.put("ops", &i.to_be_bytes(), b"done")?;
        tx.commit()?;
        Ok(())
    })?;
    let overhead = (with_ns / without_ns - 1.0) * 100.0;
    context.progress.line(
        SUITE,
        format!(
            "1 ms CPU ops: {:.4} ms without, {:.4} ms with accounting ({overhead:+.2}%)",
            without_ns / 1e6,
            with_ns / 1e6
        ),
    );
    rows.push(row("no-accounting", "ops_1ms_cpu", "avg_ms", without_ns / 1e6));
    rows.push(row("accounting", "ops_1ms_cpu", "avg_ms", with_ns / 1e6));
    rows.push(row("accounting", "ops_1ms_cpu", "overhead_pct", overhead));

    // The durability suite's relaxed single-put transaction.
    let value = [7u8; 150];
    let (with_ns, without_ns) = compare(&on, &off, plan.rounds, plan.put_txns, |db, i| {
        let mut tx = db.begin_write()?;
        tx.put("puts", &(i + 1_000_000).to_be_bytes(), &value)?;
        tx.commit()?;
        Ok(())
    })?;
    let overhead = (with_ns / without_ns - 1.0) * 100.0;
    context.progress.line(
        SUITE,
        format!("relaxed single put: {without_ns:.0} ns without, {with_ns:.0} ns with accounting ({overhead:+.2}%)"),
    );
    rows.push(row("no-accounting", "relaxed_single_put", "avg_ns", without_ns));
    rows.push(row("accounting", "relaxed_single_put", "avg_ns", with_ns));
    rows.push(row("accounting", "relaxed_single_put", "overhead_pct", overhead));
    on.close()?;
    off.close()?;

    // One measurement of the thread CPU clock.
    let t = Instant::now();
    let mut sum = 0u64;
    for _ in 0..plan.clock_reads {
        sum = sum.wrapping_add(keeldb::thread_cpu_ns().unwrap_or(0));
    }
    std::hint::black_box(sum);
    let per_read = t.elapsed().as_nanos() as f64 / plan.clock_reads as f64;
    context.progress.line(SUITE, format!("one thread CPU clock measurement: {per_read:.0} ns"));
    rows.push(row("accounting", "thread_cpu_clock_read", "avg_ns", per_read));

    // Detection delay: CPU past the budget when the abort is raised.
    let dir = context.temp_dir(SUITE)?;
    let db = open(dir.path(), true)?;
    let budget = Duration::from_millis(2);
    let step = calibrate(Duration::from_micros(20));
    let mut overshoot = Samples::with_capacity(plan.detection_runs as usize);
    for run in 0..plan.detection_runs {
        let mut tx = db.begin_write_with(TxnOptions { cpu_budget: Some(budget), ..TxnOptions::default() })?;
        let mut i = 0u64;
        let err = loop {
            work(step);
            match tx.put("runaway", &(run * 1_000_000 + i).to_be_bytes(), b"x") {
                Ok(()) => i += 1,
                Err(e) => break e,
            }
            anyhow::ensure!(i < 1_000_000, "the budget never tripped");
        };
        match err {
            Error::CpuBudgetExceeded { used, budget } => overshoot.push(used.saturating_sub(budget)),
            other => return Err(other.into()),
        }
    }
    db.close()?;
    let (p50, p99, max) =
        (overshoot.percentile_ns(50.0) / 1e3, overshoot.percentile_ns(99.0) / 1e3, overshoot.max_ns() / 1e3);
    context.progress.line(
        SUITE,
        format!("detection past a 2 ms budget ({} runs, 20 µs steps): p50 {p50:.1} µs, p99 {p99:.1} µs, max {max:.1} µs of CPU", plan.detection_runs),
    );
    rows.push(row("budget_2ms", "detection_overshoot", "p50_us", p50));
    rows.push(row("budget_2ms", "detection_overshoot", "p99_us", p99));
    rows.push(row("budget_2ms", "detection_overshoot", "max_us", max));
    Ok(rows)
}
