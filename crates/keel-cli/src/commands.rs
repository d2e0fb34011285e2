//! The store commands: verify, stats, get, put, del, scan. Each opens the store, does one thing,
//! closes it, and classifies failures: problems with what the user passed (missing path, not a
//! store, locked, bad argument, over a limit) are usage errors; everything else is a failure.

use std::io::Write;
use std::path::Path;

use keeldb::{Database, Durability, Options, ScanRange};

use crate::encoding::display_bytes;
use crate::{Failure, EXIT_FAILURE};

/// Maps an engine error to the exit code it deserves.
fn classify(error: keeldb::Error) -> Failure {
    let usage = matches!(
        error,
        keeldb::Error::Locked(_)
            | keeldb::Error::NotAStore { .. }
            | keeldb::Error::UnsupportedVersion { .. }
            | keeldb::Error::InvalidArgument(_)
            | keeldb::Error::LimitExceeded { .. }
    );
    if usage {
        Failure::usage(error)
    } else {
        Failure::runtime(error)
    }
}

/// The path must already exist: only `put` may create a store.
fn require_dir(path: &Path) -> Result<(), Failure> {
    if path.is_dir() {
        Ok(())
    } else if path.exists() {
        Err(Failure::usage(anyhow::anyhow!("{} is not a directory", path.display())))
    } else {
        Err(Failure::usage(anyhow::anyhow!("no store at {} (the path does not exist)", path.display())))
    }
}

fn open_existing(path: &Path, durability: Durability) -> Result<Database, Failure> {
    require_dir(path)?;
    Database::open(path, Options::with_durability(durability)).map_err(classify)
}

fn close(db: Database) -> Result<(), Failure> {
    db.close().map_err(classify)
}

/// Writes to stdout; a closed pipe (`keel scan ... | head`) ends the output quietly.
fn print_line(out: &mut impl Write, line: &str) -> Result<bool, Failure> {
    match writeln!(out, "{line}") {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(error) => Err(Failure::runtime(anyhow::Error::from(error).context("writing to stdout"))),
    }
}

/// `keel verify`: 0 intact, 1 corruption found.
pub fn verify(path: &Path) -> Result<u8, Failure> {
    require_dir(path)?;
    let report = keeldb::verify(path).map_err(|error| {
        // Corruption normally arrives inside the report; an error means verify could not check
        // (not a store, locked, unreadable), which is a usage error, unless it is corruption.
        let corrupt = matches!(error, keeldb::Error::Corruption { .. });
        let error = anyhow::Error::from(error).context(format!("cannot verify {}", path.display()));
        if corrupt {
            Failure::runtime(error)
        } else {
            Failure::usage(error)
        }
    })?;
    println!("{report}");
    if report.is_intact() {
        println!("{}: intact", path.display());
        Ok(0)
    } else {
        println!("{}: CORRUPTION FOUND", path.display());
        Ok(EXIT_FAILURE)
    }
}

/// `keel stats`: opens the store (running recovery) and prints what it holds.
pub fn stats(path: &Path) -> Result<(), Failure> {
    let db = open_existing(path, Durability::Sync)?;
    let stats = db.stats();
    let mut out = String::new();
    out.push_str(&format!("store:            {}\n", path.display()));
    out.push_str(&format!("last commit ts:   {}\n", stats.last_commit_ts));
    out.push_str(&format!("wal:              {} bytes in {} segment(s)\n", stats.wal_bytes, stats.wal_segments));
    let checkpoint_ts = stats.checkpoint_ts.map_or_else(|| "none".to_string(), |ts| format!("ts {ts}"));
    out.push_str(&format!("checkpoint:       {} bytes ({checkpoint_ts})\n", stats.checkpoint_bytes));
    out.push_str(&format!("state digest:     {}\n", stats.digest));
    out.push('\n');
    let name_width = stats.tables.iter().map(|t| t.name.chars().count()).max().unwrap_or(0).max(5);
    out.push_str(&format!("{:<name_width$}  {:>12}  {:>14}\n", "table", "keys", "bytes"));
    for table in &stats.tables {
        out.push_str(&format!("{:<name_width$}  {:>12}  {:>14}\n", table.name, table.keys, table.bytes));
    }
    if stats.tables.is_empty() {
        out.push_str("(no tables)\n");
    }
    out.push_str(&accounting_table(&stats));
    out.push_str(&format!("\nlast recovery:\n{}\n", stats.recovery));
    print!("{out}");
    close(db)
}

/// Per-tag CPU and latency totals (cumulative, saved at close and checkpoints).
fn accounting_table(stats: &keeldb::Stats) -> String {
    let mut out = String::new();
    let clock = if stats.thread_cpu_clock { "thread CPU clock" } else { "wall time (no thread CPU clock here)" };
    out.push_str(&format!(
        "\ntransactions by tag (CPU from the {clock}; p50/p99 are histogram bucket upper bounds):\n"
    ));
    if stats.accounting.is_empty() {
        out.push_str("(none recorded)\n");
        return out;
    }
    out.push_str(&format!(
        "{:<24}  {:>10}  {:>10}  {:>7}  {:>8}  {:>12}  {:>9}  {:>9}  {:>9}  {:>9}\n",
        "tag", "txns", "commits", "cpu-abt", "timeouts", "cpu total", "cpu p50", "cpu p99", "lat p50", "lat p99"
    ));
    for t in &stats.accounting {
        let tag = t.tag.clone().unwrap_or_else(|| "(untagged)".to_owned());
        let us = |v: u64| format!("<{v} µs");
        out.push_str(&format!(
            "{:<24}  {:>10}  {:>10}  {:>7}  {:>8}  {:>12}  {:>9}  {:>9}  {:>9}  {:>9}\n",
            tag,
            t.transactions,
            t.commits,
            t.cpu_budget_aborts,
            t.timeouts,
            format!("{:.3} ms", t.cpu_time.as_secs_f64() * 1e3),
            us(t.cpu_histogram.quantile_upper_us(0.5)),
            us(t.cpu_histogram.quantile_upper_us(0.99)),
            us(t.latency_histogram.quantile_upper_us(0.5)),
            us(t.latency_histogram.quantile_upper_us(0.99)),
        ));
    }
    out
}

/// `keel get`: prints the value; exit 1 when the key is absent.
pub fn get(path: &Path, table: &str, key: &[u8]) -> Result<u8, Failure> {
    let db = open_existing(path, Durability::Sync)?;
    let value = {
        let rx = db.begin_read().map_err(classify)?;
        rx.get(table, key).map_err(classify)?
    };
    close(db)?;
    match value {
        Some(value) => {
            print_line(&mut std::io::stdout().lock(), &display_bytes(&value))?;
            Ok(0)
        }
        None => {
            eprintln!("keel: key {} not found in table {table}", display_bytes(key));
            Ok(EXIT_FAILURE)
        }
    }
}

/// `keel put`: one sync-durable transaction; creates the store when the path is new.
pub fn put(path: &Path, table: &str, key: &[u8], value: &[u8]) -> Result<(), Failure> {
    if path.exists() && !path.is_dir() {
        return Err(Failure::usage(anyhow::anyhow!("{} is not a directory", path.display())));
    }
    let db = Database::open(path, Options::with_durability(Durability::Sync)).map_err(classify)?;
    let mut tx = db.begin_write().map_err(classify)?;
    tx.put(table, key, value).map_err(classify)?;
    tx.commit().map_err(classify)?;
    close(db)
}

/// `keel del`: one sync-durable transaction; exit 1 (nothing written) when the key is absent.
pub fn del(path: &Path, table: &str, key: &[u8]) -> Result<u8, Failure> {
    let db = open_existing(path, Durability::Sync)?;
    let mut tx = db.begin_write().map_err(classify)?;
    let existed = tx.get(table, key).map_err(classify)?.is_some();
    if existed {
        tx.delete(table, key).map_err(classify)?;
        tx.commit().map_err(classify)?;
    } else {
        tx.rollback();
    }
    close(db)?;
    if existed {
        Ok(0)
    } else {
        eprintln!("keel: key {} not found in table {table}; nothing deleted", display_bytes(key));
        Ok(EXIT_FAILURE)
    }
}

/// What `keel scan` should read.
#[derive(Debug, Default)]
pub struct ScanRequest {
    /// Only keys with this prefix.
    pub prefix: Option<Vec<u8>>,
    /// Inclusive lower bound.
    pub start: Option<Vec<u8>>,
    /// Exclusive upper bound.
    pub end: Option<Vec<u8>>,
    /// Descending order.
    pub reverse: bool,
    /// At most this many pairs.
    pub limit: Option<usize>,
}

impl ScanRequest {
    fn range(&self) -> ScanRange {
        let mut range = match &self.prefix {
            Some(prefix) => ScanRange::prefix(prefix.clone()),
            None => ScanRange::all(),
        };
        if let Some(start) = &self.start {
            range = range.start(start.clone());
        }
        if let Some(end) = &self.end {
            range = range.end(end.clone());
        }
        if self.reverse {
            range = range.reverse();
        }
        range
    }
}

/// `keel scan`: prints `KEY<TAB>VALUE` lines in key order.
pub fn scan(path: &Path, table: &str, request: ScanRequest) -> Result<(), Failure> {
    let db = open_existing(path, Durability::Sync)?;
    {
        let rx = db.begin_read().map_err(classify)?;
        let stdout = std::io::stdout();
        let mut out = std::io::BufWriter::new(stdout.lock());
        let limit = request.limit.unwrap_or(usize::MAX);
        for item in rx.scan(table, request.range()).map_err(classify)?.take(limit) {
            let (key, value) = item.map_err(classify)?;
            let line = format!("{}\t{}", display_bytes(&key), display_bytes(&value));
            if !print_line(&mut out, &line)? {
                break;
            }
        }
        match out.flush() {
            Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
                return Err(Failure::runtime(anyhow::Error::from(error).context("writing to stdout")));
            }
            _ => {}
        }
    }
    close(db)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_path_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        assert_eq!(require_dir(&missing).unwrap_err().code, crate::EXIT_USAGE);
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(require_dir(&file).unwrap_err().code, crate::EXIT_USAGE);
        assert!(require_dir(dir.path()).is_ok());
    }

    #[test]
    fn engine_errors_are_classified() {
        let locked = classify(keeldb::Error::Locked("/x".into()));
        assert_eq!(locked.code, crate::EXIT_USAGE);
        let conflict = classify(keeldb::Error::Conflict {
            table: "w".into(),
            key: Some(b"k".to_vec()),
            reason: keeldb::ConflictReason::KeyWritten,
        });
        assert_eq!(conflict.code, EXIT_FAILURE);
    }
}
