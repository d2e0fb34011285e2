//! The `raw-fdatasync` baseline: append 4 KiB to a file and fdatasync it, in a loop. This is
//! the floor a durable commit cannot beat on this disk, so group-commit figures are quoted as
//! ratios to it.
//!
//! The `raw-overwrite` ceiling ([`Overwrite`]): a small write over a file whose blocks are
//! already allocated and written, then fdatasync, in a loop. That is all a single synchronous
//! writer's commit must do on an engine that overwrites preallocated or recycled log space (no
//! size change for the file system to journal), so no engine's one-writer rate can exceed it
//! by more than the noise of the disk: one writer waits for each commit's flush before it
//! starts the next.
//!
//! This module knows nothing about KeelDB; it must stay compilable without the engine.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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

/// The system name of the ceiling's rows in reports.
pub const OVERWRITE_SYSTEM: &str = "raw-overwrite";

/// Bytes each overwrite writes: about one small commit's log frame (a 100-byte value, its
/// key and the frame's headers).
pub const OVERWRITE_BYTES: usize = 256;

/// Size of the file the overwrites cycle through: large enough that the writes walk many
/// blocks, small enough to prepare in a moment.
const OVERWRITE_FILE_BYTES: u64 = 4 << 20;

/// The single-writer ceiling (see the module comment): a file of [`OVERWRITE_FILE_BYTES`],
/// written and synced once, then overwritten [`OVERWRITE_BYTES`] at a time, each write
/// followed by fdatasync. The file is removed on drop.
#[derive(Debug)]
pub struct Overwrite {
    file: File,
    path: PathBuf,
    size: u64,
    offset: u64,
}

impl Overwrite {
    /// Creates the file in `dir` and writes and syncs all of it, so every later write lands on
    /// allocated, written blocks.
    pub fn create(dir: &Path) -> anyhow::Result<Overwrite> {
        Overwrite::create_sized(dir, OVERWRITE_FILE_BYTES)
    }

    /// [`Overwrite::create`] with a file of `size` bytes (a multiple of 64 KiB).
    fn create_sized(dir: &Path, size: u64) -> anyhow::Result<Overwrite> {
        let path = dir.join("raw-overwrite.dat");
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let chunk = vec![0x5au8; 64 << 10];
        let mut written = 0u64;
        while written < size {
            file.write_all(&chunk).with_context(|| format!("writing {}", path.display()))?;
            written += chunk.len() as u64;
        }
        file.sync_all().with_context(|| format!("fsync {}", path.display()))?;
        Ok(Overwrite { file, path, size, offset: 0 })
    }

    /// Overwrites and fdatasyncs under `budget`; each pair's latency, and the time taken.
    pub fn run(&mut self, budget: Budget) -> anyhow::Result<(Samples, Duration)> {
        let record = [0xa5u8; OVERWRITE_BYTES];
        let mut samples = Samples::with_capacity(4096);
        let mut run = budget.start();
        while run.keep_going() {
            let started = Instant::now();
            self.file.seek(SeekFrom::Start(self.offset)).with_context(|| format!("seeking {}", self.path.display()))?;
            self.file.write_all(&record).with_context(|| format!("writing {}", self.path.display()))?;
            self.file.sync_data().with_context(|| format!("fdatasync {}", self.path.display()))?;
            samples.push(started.elapsed());
            self.offset = (self.offset + OVERWRITE_BYTES as u64) % self.size;
        }
        Ok((samples, run.elapsed()))
    }
}

impl Drop for Overwrite {
    fn drop(&mut self) {
        // Best effort: a leftover file in a temp dir is harmless.
        let _ = std::fs::remove_file(&self.path);
    }
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

    #[test]
    fn overwrites_never_grow_the_file_and_clean_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raw-overwrite.dat");
        {
            let size = 64 << 10;
            let mut o = Overwrite::create_sized(dir.path(), size).unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().len(), size);
            // More overwrites than the file holds records: the offset wraps around.
            let records = size / OVERWRITE_BYTES as u64;
            let (samples, elapsed) = o.run(Budget::new(records + 3, records + 3, Duration::ZERO)).unwrap();
            assert_eq!(samples.len() as u64, records + 3);
            assert!(elapsed > Duration::ZERO);
            assert_eq!(o.offset, 3 * OVERWRITE_BYTES as u64);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), size);
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(bytes[..3 * OVERWRITE_BYTES], [0xa5; 3 * OVERWRITE_BYTES]);
            assert_eq!(bytes[bytes.len() - 1], 0xa5, "the last record before the wrap was written");
            assert!(path.exists());
        }
        assert!(!path.exists());
    }
}
