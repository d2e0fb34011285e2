//! Concurrent committers (group commit batches them) with the background worker doing
//! periodic fdatasyncs and automatic checkpoints, stopped after a random number of file-system
//! calls, then crashed (power loss or process kill) and reopened. See `concurrent.rs` for the
//! check. `KEEL_SIM_SEED=<n>` reruns one seed (same file-system decisions, not necessarily the
//! same thread interleaving); `KEEL_SIM_ITERS=<n>` runs more.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::time::{Duration, Instant};

use keel_testkit::concurrent::{run_concurrent_seed, ConcurrentSummary, ConcurrentWorkload};
use keel_testkit::workload::seeds;
use keeldb::Durability;

fn check(name: &str, base: u64, count: u64, cfg: &ConcurrentWorkload) {
    let started = Instant::now();
    let mut total = ConcurrentSummary::default();
    let mut failures = Vec::new();
    for seed in seeds(base, count) {
        match run_concurrent_seed(seed, cfg) {
            Ok(s) => total.add(&s),
            Err(f) => {
                eprintln!(
                    "{name}: {f}replay: KEEL_SIM_SEED={seed} cargo test -p keel-testkit --test sim_concurrent {name}"
                );
                failures.push(f);
            }
        }
    }
    let per_batch = total.engine_commits as f64 / total.engine_batches.max(1) as f64;
    println!("{name}: {:.1?}: {total:?}, {per_batch:.2} commits per batch", started.elapsed());
    let failed: Vec<u64> = failures.iter().map(|f| f.seed).collect();
    assert!(failures.is_empty(), "{name}: failing seeds {failed:?}; first: {}", failures[0]);
}

#[test]
fn concurrent_sync() {
    check("concurrent_sync", 20_000, 40, &ConcurrentWorkload::new(Durability::Sync));
}

#[test]
fn concurrent_periodic_with_worker() {
    check(
        "concurrent_periodic_with_worker",
        21_000,
        40,
        &ConcurrentWorkload::new(Durability::Periodic(Duration::from_millis(2))),
    );
}

#[test]
fn concurrent_async_and_blocking_committers() {
    let cfg =
        ConcurrentWorkload { async_commits: true, mixed_durability: true, ..ConcurrentWorkload::new(Durability::Sync) };
    check("concurrent_async_and_blocking_committers", 26_000, 30, &cfg);
}

#[test]
fn concurrent_mixed_durability() {
    let cfg = ConcurrentWorkload { mixed_durability: true, ..ConcurrentWorkload::new(Durability::Relaxed) };
    check("concurrent_mixed_durability", 22_000, 40, &cfg);
}

#[test]
fn concurrent_without_worker() {
    let cfg = ConcurrentWorkload {
        background_threads: false,
        mixed_durability: true,
        ..ConcurrentWorkload::new(Durability::Sync)
    };
    check("concurrent_without_worker", 23_000, 40, &cfg);
}
