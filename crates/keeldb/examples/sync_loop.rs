//! Measurement driver for durable commits the way a user writes them: a fresh store with
//! default options, W threads, each committing one-put `sync` transactions in a loop
//! (`begin_write`, `put`, `commit`) for S seconds. Prints the commit rate, fdatasyncs and
//! commits per fdatasync every half second and in total, so a rate that changes with the
//! store's age shows up.
//!
//! Usage: sync_loop [WRITERS] [SECONDS] [DIR]   (DIR: where the store is created; a temporary
//! directory under the current one when absent, so the file system measured is this one's).
#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use keeldb::{Database, Options};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let writers: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let seconds: f64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(5.0);
    let temp = tempfile::tempdir_in(".").unwrap();
    let path = args.get(3).map_or_else(|| temp.path().join("store"), std::path::PathBuf::from);
    let db = Database::open(&path, Options::default()).unwrap();
    let commits = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let value = [7u8; 100];
    let started = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..writers {
            let (db, commits, stop) = (&db, &commits, &stop);
            scope.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut tx = db.begin_write().unwrap();
                    tx.put("t", format!("w{t}-{i}").as_bytes(), &value).unwrap();
                    tx.commit().unwrap();
                    commits.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            });
        }
        let (mut last_t, mut last_c, mut last_s) = (Instant::now(), 0, db.stats().wal_syncs);
        while started.elapsed().as_secs_f64() < seconds {
            std::thread::sleep(Duration::from_millis(500));
            let (now, c, s) = (Instant::now(), commits.load(Ordering::Relaxed), db.stats().wal_syncs);
            let dt = now.duration_since(last_t).as_secs_f64();
            println!(
                "{:5.1} s  {:8.0} commits/s  {:7.0} fdatasync/s  {:5.2} commits/fdatasync",
                started.elapsed().as_secs_f64(),
                (c - last_c) as f64 / dt,
                (s - last_s) as f64 / dt,
                (c - last_c) as f64 / (s - last_s).max(1) as f64
            );
            (last_t, last_c, last_s) = (now, c, s);
        }
        stop.store(true, Ordering::Relaxed);
    });
    let elapsed = started.elapsed().as_secs_f64();
    let stats = db.stats();
    let c = commits.load(Ordering::Relaxed);
    println!(
        "total: {writers} writers, {:.0} commits/s, {:.2} commits/fdatasync over {elapsed:.1} s \
         ({} fdatasyncs, {} gather waits, {} gave up on someone)",
        c as f64 / elapsed,
        stats.commits as f64 / stats.wal_syncs.max(1) as f64,
        stats.wal_syncs,
        stats.gather_waits,
        stats.gather_timeouts
    );
    db.close().unwrap();
}
