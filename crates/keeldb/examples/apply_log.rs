//! Applies one-put commands from a (synthetic) replicated log on one thread, `relaxed`
//! durability, the way a Raft state machine would, and prints commands per second for a few
//! batch sizes:
//!
//! ```text
//! cargo run --release -p keeldb --example apply_log [-- COMMANDS [KEYS [BATCH]]]
//! ```
//!
//! Each command puts a 16-byte key with a 32-byte value and records nothing else. Without
//! `KEYS` every key is new (spread by a multiplicative hash, so the index grows to COMMANDS
//! keys); with `KEYS` (0: every key new) the commands cycle over that many keys (overwrites, a
//! bounded index). `BATCH` runs one batch size instead of 1, 16, 256 and 1024 (useful under
//! `perf stat`, whose instruction counts do not depend on how loaded the machine is). The store lives in a temporary directory. Figures are
//! for one machine and one file system; `keel bench` is the project's published report.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use keeldb::{Command, Database, Durability, LogPosition, Options};

fn main() {
    let total: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let keys: Option<u64> = std::env::args().nth(2).and_then(|a| a.parse().ok()).filter(|&k| k > 0);
    let space = keys.map_or("every key new".to_owned(), |k| format!("{k} keys"));
    println!("{total} one-put commands per run ({space}), relaxed durability, one thread");
    let batches: Vec<u64> = match std::env::args().nth(3).and_then(|a| a.parse().ok()) {
        Some(b) if b > 0 => vec![b],
        _ => vec![1, 16, 256, 1024],
    };
    for batch in batches {
        let dir = tempfile::tempdir().unwrap();
        // No background worker or automatic checkpoints: every cycle measured is the apply path
        // on this thread (relaxed commits need no periodic sync).
        let options = Options {
            durability: Durability::Relaxed,
            background_threads: false,
            checkpoint_wal_bytes: 0,
            ..Options::default()
        };
        let db = Database::open(dir.path().join("store"), options).unwrap();
        let started = Instant::now();
        let cpu_started = keeldb::thread_cpu_ns().unwrap_or(0);
        let mut index = 0u64;
        while index < total {
            let n = batch.min(total - index);
            let commands: Vec<(LogPosition, Command)> = (index + 1..=index + n)
                .map(|i| {
                    let id = keys.map_or(i, |k| i % k);
                    let mut k = Vec::with_capacity(16);
                    k.extend_from_slice(&id.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
                    k.extend_from_slice(&id.to_be_bytes());
                    (LogPosition::new(i, 1), Command::new().put("kv", k, [7u8; 32]))
                })
                .collect();
            for r in db.apply_batch(commands) {
                r.unwrap();
            }
            index += n;
        }
        let secs = started.elapsed().as_secs_f64();
        let cpu_secs = keeldb::thread_cpu_ns().unwrap_or(0).saturating_sub(cpu_started) as f64 / 1e9;
        assert_eq!(db.applied(), Some(LogPosition::new(total, 1)));
        let stats = db.stats();
        // Wall time is what a caller sees; thread CPU time excludes time this thread spent
        // descheduled on a shared machine.
        println!(
            "batch {batch:>5}: {:>9.0} commands/s wall, {:>9.0} per CPU-second ({:.2} us CPU each, {} WAL writes)",
            total as f64 / secs,
            total as f64 / cpu_secs,
            cpu_secs * 1e6 / total as f64,
            stats.batches
        );
        db.close().unwrap();
    }
}
