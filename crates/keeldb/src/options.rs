//! Configuration: durability modes, isolation levels and database options, with the limits
//! that bound user input. Nothing here does I/O.

use std::sync::Arc;
use std::time::Duration;

use crate::fs::{FileSystem, StdFs};

/// Largest key, in bytes.
pub const MAX_KEY_BYTES: usize = 64 * 1024;
/// Largest value, in bytes.
pub const MAX_VALUE_BYTES: usize = 64 * 1024 * 1024;
/// Largest table name, in bytes of UTF-8.
pub const MAX_TABLE_NAME_BYTES: usize = 255;

/// Checks a table name against the limits (1..=255 bytes).
pub(crate) fn check_table_name(name: &str) -> crate::Result<()> {
    if name.is_empty() {
        return Err(crate::Error::InvalidArgument("table name must not be empty".into()));
    }
    if name.len() > MAX_TABLE_NAME_BYTES {
        return Err(crate::Error::LimitExceeded {
            what: "table name",
            actual: name.len(),
            limit: MAX_TABLE_NAME_BYTES,
        });
    }
    Ok(())
}

/// Checks a key against [`MAX_KEY_BYTES`].
pub(crate) fn check_key(key: &[u8]) -> crate::Result<()> {
    if key.len() > MAX_KEY_BYTES {
        return Err(crate::Error::LimitExceeded { what: "key", actual: key.len(), limit: MAX_KEY_BYTES });
    }
    Ok(())
}

/// Checks a value against [`MAX_VALUE_BYTES`].
pub(crate) fn check_value(value: &[u8]) -> crate::Result<()> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(crate::Error::LimitExceeded { what: "value", actual: value.len(), limit: MAX_VALUE_BYTES });
    }
    Ok(())
}

/// When `commit()` returns, and what a crash can take away. See `docs/GUARANTEES.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Returns once the commit's WAL record is on stable storage (fdatasync, shared by
    /// concurrent commits). Survives process crash and power loss.
    Sync,
    /// Returns once the record is written to the OS; a background fdatasync runs at least every
    /// `interval`. Survives process crash; power loss loses at most `interval` of commits.
    Periodic(Duration),
    /// Returns once the record is written to the OS; fdatasync only at checkpoint and close.
    /// Survives process crash; after power loss nothing beyond the last checkpoint is promised.
    Relaxed,
}

impl Durability {
    /// Whether this mode requires an fdatasync before acknowledging.
    pub fn needs_sync(self) -> bool {
        matches!(self, Durability::Sync)
    }

    /// Parses `sync`, `relaxed`, `periodic` (100 ms) or `periodic:<ms>`.
    pub fn parse(text: &str) -> Option<Durability> {
        match text {
            "sync" => Some(Durability::Sync),
            "relaxed" => Some(Durability::Relaxed),
            "periodic" => Some(Durability::Periodic(Duration::from_millis(100))),
            other => {
                let ms = other.strip_prefix("periodic:")?.parse::<u64>().ok()?;
                (ms > 0).then(|| Durability::Periodic(Duration::from_millis(ms)))
            }
        }
    }

    /// Refuses a periodic interval of zero (it would mean "sync", spelled confusingly).
    pub fn validate(self) -> crate::Result<()> {
        match self {
            Durability::Periodic(d) if d.is_zero() => {
                Err(crate::Error::InvalidArgument("periodic durability needs a non-zero interval".into()))
            }
            _ => Ok(()),
        }
    }

    /// Short name used in reports: `sync`, `periodic`, `relaxed`.
    pub fn name(self) -> &'static str {
        match self {
            Durability::Sync => "sync",
            Durability::Periodic(_) => "periodic",
            Durability::Relaxed => "relaxed",
        }
    }
}

/// Isolation level of write transactions. Read transactions always read one snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// Snapshot isolation: a commit fails only when another transaction committed a write to one
    /// of the same keys after this one began (first committer wins). Write skew is possible.
    #[default]
    Snapshot,
    /// Serializable: additionally fails when any key or range this transaction read was written
    /// by a transaction that committed after this one began.
    Serializable,
}

/// Options for [`crate::Database::open`].
#[derive(Debug, Clone)]
pub struct Options {
    /// Default durability for write transactions.
    pub durability: Durability,
    /// Default isolation for write transactions.
    pub isolation: Isolation,
    /// A WAL segment is sealed and a new one started past this size.
    pub wal_segment_bytes: u64,
    /// A background checkpoint starts once this many WAL bytes were written since the last one.
    /// `0` disables automatic checkpoints.
    pub checkpoint_wal_bytes: u64,
    /// Optional wait before a group-commit leader writes, to gather more commits. Off (zero) by
    /// default: an idle database never delays a commit.
    pub commit_delay: Duration,
    /// Largest total size of one transaction's writes, in bytes.
    pub max_txn_bytes: usize,
    /// The file system. Tests swap in a simulated one.
    pub fs: Arc<dyn FileSystem>,
    /// Default CPU budget for every transaction (`None`: unlimited). See `TxnOptions::cpu_budget`.
    pub cpu_budget: Option<Duration>,
    /// Default wall-clock timeout for every transaction (`None`: unlimited).
    pub txn_timeout: Option<Duration>,
    /// Whether to measure every transaction's CPU and wall time and keep per-tag totals
    /// (two monotonic clock reads and one counter update per transaction). Off, transactions
    /// without a budget or timeout are not measured: `CommitInfo` reports zero times.
    pub cpu_accounting: bool,
    /// Whether to start background threads (periodic fsync, checkpoints, version GC).
    /// Turning this off is for deterministic tests; periodic durability then syncs inline.
    pub background_threads: bool,
    /// Keep history from open on: every version stays readable with
    /// [`Database::begin_read_at`](crate::Database::begin_read_at) and every change is in
    /// [`Database::changes_since`](crate::Database::changes_since) until
    /// [`Database::retain_history_since`](crate::Database::retain_history_since) compacts it.
    /// History lives in memory; a checkpoint also writes it (format version 2) and open
    /// rebuilds it, so a reopened store has the history it had, from the floor the newest
    /// checkpoint recorded (see `docs/design/recovery.md`, "History across a restart").
    pub keep_history: bool,
    /// Test instrumentation, not a stable API: called by `checkpoint` between choosing the
    /// snapshot it writes and making the WAL durable through it (so a test can commit there).
    #[doc(hidden)]
    pub checkpoint_step_hook: TestHook,
}

/// A callback for tests (see [`Options::checkpoint_step_hook`]); does nothing by default.
#[doc(hidden)]
#[derive(Clone, Default)]
pub struct TestHook(pub Option<Arc<dyn Fn() + Send + Sync>>);

impl TestHook {
    pub(crate) fn call(&self) {
        if let Some(f) = &self.0 {
            f();
        }
    }
}

impl std::fmt::Debug for TestHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "TestHook(set)" } else { "TestHook(none)" })
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            durability: Durability::Sync,
            isolation: Isolation::Snapshot,
            wal_segment_bytes: 64 * 1024 * 1024,
            checkpoint_wal_bytes: 256 * 1024 * 1024,
            commit_delay: Duration::ZERO,
            max_txn_bytes: 1 << 30,
            fs: Arc::new(StdFs),
            cpu_budget: None,
            txn_timeout: None,
            cpu_accounting: true,
            background_threads: true,
            keep_history: false,
            checkpoint_step_hook: TestHook::default(),
        }
    }
}

impl Options {
    /// Options with the given durability and defaults otherwise.
    pub fn with_durability(durability: Durability) -> Self {
        Options { durability, ..Options::default() }
    }
}
