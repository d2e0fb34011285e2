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
