//! Error types. One umbrella [`Error`] that every public operation returns; its variants are
//! the failure modes a caller can act on (retry a conflict, reopen after poisoning, repair
//! corruption). Corruption is always a value here, never a panic.

use std::io;
use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where corrupt bytes were found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The file holding the bad bytes.
    pub path: PathBuf,
    /// Byte offset inside that file.
    pub offset: u64,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at offset {}", self.path.display(), self.offset)
    }
}

/// Every error KeelDB returns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O error from the file system.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Bytes on disk failed a checksum or a structural check. The store was not changed.
    #[error("corruption in {location}: {reason}")]
    Corruption {
        /// Where.
        location: Location,
        /// What was wrong.
        reason: String,
    },
    /// Another writer committed a conflicting change first (write-write, or under
    /// `serializable` a write to something this transaction read). Retrying may succeed.
    #[error("transaction conflict: {}", describe_conflict(table, key.as_deref(), *reason))]
    Conflict {
        /// The table where the conflict was found.
        table: String,
        /// The key, when the conflict is about one key (not a whole table).
        key: Option<Vec<u8>>,
        /// What the concurrent commit did.
        reason: ConflictReason,
    },
    /// An earlier write or fsync failed; the database refuses writes until it is reopened.
    #[error("database is poisoned by an earlier I/O failure ({0}); reopen it to recover")]
    Poisoned(String),
    /// Another handle (in this or another process) holds the directory.
    #[error("{0} is locked by another open handle")]
    Locked(PathBuf),
    /// The path exists but is not a KeelDB store.
    #[error("{path} is not a KeelDB store: {reason}")]
    NotAStore {
        /// The directory.
        path: PathBuf,
        /// Why it was rejected.
        reason: String,
    },
    /// The store was written by a newer (or unknown) format version.
    #[error("{path} has format version {found}; this build supports version {supported}")]
    UnsupportedVersion {
        /// The directory.
        path: PathBuf,
        /// Version found on disk.
        found: u32,
        /// Version this build reads and writes.
        supported: u32,
    },
    /// A key, value, table name or transaction exceeded a documented limit. Nothing was written.
    #[error("limit exceeded: {what} is {actual} bytes, the limit is {limit}")]
    LimitExceeded {
        /// What was too large.
        what: &'static str,
        /// Its size.
        actual: usize,
        /// The limit.
        limit: usize,
    },
    /// An argument was not valid (for example an empty table name).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The database was closed.
    #[error("database is closed")]
    Closed,
    /// The transaction used more CPU time than its budget. It was rolled back; other
    /// transactions are unaffected.
    #[error("transaction exceeded its CPU budget: used {used:?} of {budget:?}; it was rolled back")]
    CpuBudgetExceeded {
        /// CPU time used when the budget check tripped.
        used: std::time::Duration,
        /// The budget.
        budget: std::time::Duration,
    },
    /// The transaction ran longer (wall clock) than its timeout. It was rolled back.
    #[error("transaction timed out after {elapsed:?} (timeout {timeout:?}); it was rolled back")]
    Timeout {
        /// Wall time when the check tripped.
        elapsed: std::time::Duration,
        /// The timeout.
        timeout: std::time::Duration,
    },
    /// The transaction was already committed or rolled back.
    #[error("transaction is no longer active")]
    TransactionDone,
    /// The table belongs to the engine (its name starts with
    /// [`RESERVED_TABLE_PREFIX`](crate::RESERVED_TABLE_PREFIX)): the public API may read it but
    /// never create, write or drop it. Nothing was written.
    #[error("table {0:?} is reserved for the engine; it cannot be created, written or dropped")]
    ReservedTable(String),
    /// A read or change-feed request at a timestamp whose history is no longer kept.
    #[error("history at timestamp {requested} is compacted; the oldest available is {available}")]
    Compacted {
        /// The timestamp asked for.
        requested: u64,
        /// The oldest timestamp that can be asked for now.
        available: u64,
    },
    /// A read or change-feed request at a timestamp no commit has reached yet.
    #[error("timestamp {requested} is in the future; the newest visible commit is {latest}")]
    FutureTimestamp {
        /// The timestamp asked for.
        requested: u64,
        /// The newest visible commit timestamp.
        latest: u64,
    },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    pub(crate) fn corruption(path: impl Into<PathBuf>, offset: u64, reason: impl Into<String>) -> Self {
        Error::Corruption { location: Location { path: path.into(), offset }, reason: reason.into() }
    }

    /// True for errors that a retry of the same transaction may cure.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Conflict { .. })
    }
}

/// Why a commit conflicted, in [`Error::Conflict`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConflictReason {
    /// A key this transaction writes was written by a commit after its snapshot.
    KeyWritten,
    /// The table was dropped by a commit after this transaction's snapshot.
    TableDropped,
    /// This transaction drops a table that a commit after its snapshot wrote to.
    TableWritten,
    /// (Serializable) a key or range this transaction read was changed after its snapshot.
    ReadChanged,
    /// The whole state was replaced by an installed checkpoint after this transaction's
    /// snapshot (`Database::install_checkpoint`): everything it read is gone. A retry runs on
    /// the installed state.
    StateReplaced,
}

/// A key for messages: quoted text when it is short UTF-8, otherwise hex (first 32 bytes).
pub(crate) fn show_key(k: &[u8]) -> String {
    match std::str::from_utf8(k) {
        Ok(s) if s.len() <= 64 => format!("{s:?}"),
        _ => format!("0x{}", k.iter().take(32).map(|b| format!("{b:02x}")).collect::<String>()),
    }
}

fn describe_conflict(table: &str, key: Option<&[u8]>, reason: ConflictReason) -> String {
    let key = key.map(show_key);
    match (reason, key) {
        (ConflictReason::KeyWritten, Some(k)) => {
            format!("key {k} in table {table:?} was written by a concurrent commit")
        }
        (ConflictReason::ReadChanged, Some(k)) => {
            format!("key {k} read from table {table:?} was changed by a concurrent commit")
        }
        (ConflictReason::ReadChanged, None) => {
            format!("data read from table {table:?} was changed by a concurrent commit")
        }
        (ConflictReason::TableDropped, _) => format!("table {table:?} was dropped by a concurrent commit"),
        (ConflictReason::TableWritten, _) => format!("table {table:?} was written by a concurrent commit"),
        (ConflictReason::KeyWritten, None) => format!("table {table:?} was changed by a concurrent commit"),
        (ConflictReason::StateReplaced, _) => "the state it read was replaced by an installed checkpoint".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflict_messages_name_table_and_key() {
        let e =
            Error::Conflict { table: "users".into(), key: Some(b"alice".to_vec()), reason: ConflictReason::KeyWritten };
        assert_eq!(
            e.to_string(),
            "transaction conflict: key \"alice\" in table \"users\" was written by a concurrent commit"
        );
        let e = Error::Conflict { table: "t".into(), key: Some(vec![0xff; 40]), reason: ConflictReason::ReadChanged };
        assert!(e.to_string().contains("0xffff"), "{e}");
        assert!(e.is_retryable());
    }
}
