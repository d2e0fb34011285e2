//! Profiling driver for async commits: TASKS tasks on ONE current-thread tokio runtime, each
//! committing one 100-byte put at a time with `commit_async` for SECONDS, on a fresh store.
//! Usage: async_loop TASKS SECONDS DURABILITY(sync|relaxed|periodic)
#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keeldb::{Database, Durability, Options};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let tasks: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(64);
    let secs: f64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3.0);
    let durability = Durability::parse(args.get(3).map_or("sync", String::as_str)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(dir.path().join("s"), Options::with_durability(durability)).unwrap();
    let window = Duration::from_secs_f64(secs);
    let committed = Arc::new(AtomicU64::new(0));
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let syncs = db.stats().wal_syncs;
    let started = Instant::now();
    runtime.block_on(async {
        let handles: Vec<_> = (0..tasks)
            .map(|t| {
                let (db, committed) = (db.clone(), Arc::clone(&committed));
                tokio::spawn(async move {
                    let mut i = 0u64;
                    while started.elapsed() < window {
                        let mut tx = db.begin_write().unwrap();
                        tx.put("a", &(t << 40 | i).to_be_bytes(), &[2u8; 100]).unwrap();
                        tx.commit_async().await.unwrap();
                        committed.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                })
            })
            .collect();
        for h in handles {
            h.await.unwrap();
        }
    });
    let n = committed.load(Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let syncs = db.stats().wal_syncs - syncs;
    println!(
        "{tasks} tasks: {:.0} commits/s, {:.1} commits per fdatasync",
        n as f64 / elapsed,
        n as f64 / syncs.max(1) as f64
    );
    db.close().unwrap();
}
