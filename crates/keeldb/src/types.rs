//! Small shared vocabulary that sits below every other module: the engine's hash map type and
//! the reserved table namespace. Nothing here depends on any other module of the crate, so the
//! dependency between the index, the commit pipeline, recovery and the handle points one way.

/// The hash map used throughout the engine (foldhash: fast, randomly seeded per map).
pub(crate) type FastMap<K, V> = hashbrown::HashMap<K, V, foldhash::fast::RandomState>;

/// Tables whose names start with this prefix are the engine's own; `tables()` hides them.
pub const RESERVED_TABLE_PREFIX: &str = "__keeldb/";

/// Whether `name` is in the engine's reserved namespace.
pub(crate) fn is_reserved(name: &str) -> bool {
    name.starts_with(RESERVED_TABLE_PREFIX)
}

/// A position in a replicated log (for example a Raft log): the entry's index and the term it
/// was written in. Opaque to the engine except for its order: positions applied to one store
/// must increase. Stored in the same WAL frame as the command's writes and in checkpoints, so
/// [`crate::Database::applied`] after recovery names exactly the last command whose writes
/// survived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct LogPosition {
    /// The entry's index in the log.
    pub index: u64,
    /// The term the entry was written in.
    pub term: u64,
}

impl LogPosition {
    /// A position.
    pub fn new(index: u64, term: u64) -> LogPosition {
        LogPosition { index, term }
    }
}

impl std::fmt::Display for LogPosition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.index, self.term)
    }
}
