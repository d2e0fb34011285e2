//! The `raw-fdatasync` baseline: append 4 KiB to a file and fdatasync it, in a loop. This is
//! the floor a durable commit cannot beat on this disk, so group-commit figures are quoted as
//! ratios to it.
//!
//! This module knows nothing about KeelDB; it must stay compilable without the engine.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::Context;

use crate::timing::{per_second, Budget, Samples};

/// Bytes appended before each fdatasync.
pub const APPEND_BYTES: usize = 4096;

/// What one run of the baseline measured.
#[derive(Debug, Clone)]
pub struct RawSyncResult {
    /// Append + fdatasync pairs per second, over the whole run.
    pub commits_per_s: f64,
    /// Latency of one append + fdatasync, in microseconds.
    pub p50_us: f64,
    /// 99th percentile latency, in microseconds.
    pub p99_us: f64,
    /// Number of fdatasync calls made.
    pub iterations: u64,
}

/// Runs the baseline in `dir` (the file is removed afterwards) under `budget`.
pub fn run(dir: &Path, budget: Budget) -> anyhow::Result<RawSyncResult> {
    let path = dir.join("raw-fdatasync.dat");
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    let block = vec![0x5au8; APPEND_BYTES];
    let mut samples = Samples::with_capacity(4096);
    let mut run = budget.start();
    while run.keep_going() {
        let started = Instant::now();
        file.write_all(&block).with_context(|| format!("writing {}", path.display()))?;
        // `sync_data` is fdatasync(2) on Linux: the same call the WAL uses.
        file.sync_data().with_context(|| format!("fdatasync {}", path.display()))?;
        samples.push(started.elapsed());
    }
    let elapsed = run.elapsed();
    drop(file);
    // Best effort: a leftover file in a temp dir is harmless.
    let _ = std::fs::remove_file(&path);
    Ok(RawSyncResult {
        commits_per_s: per_second(run.iterations(), elapsed),
        p50_us: samples.percentile_ns(50.0) / 1_000.0,
        p99_us: samples.percentile_ns(99.0) / 1_000.0,
        iterations: run.iterations(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn measures_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let result = run(dir.path(), Budget::new(3, 3, Duration::ZERO)).unwrap();
        assert_eq!(result.iterations, 3);
        assert!(result.p50_us > 0.0 && result.p99_us >= result.p50_us);
        assert!(result.commits_per_s > 0.0);
        assert!(!dir.path().join("raw-fdatasync.dat").exists());
    }
}
