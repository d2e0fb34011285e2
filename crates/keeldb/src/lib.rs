//! KeelDB: an embedded, memory-resident, durable transactional key-value store.
//!
//! The whole data set lives in memory (an MVCC index); a write-ahead log with group commit and
//! periodic checkpoints makes it durable. See `docs/ARCHITECTURE.md` for the map and
//! `docs/GUARANTEES.md` for what each durability mode promises.
//!
//! ```no_run
//! use keeldb::{Database, Options, ScanRange};
//! let db = Database::open("/tmp/example-store", Options::default())?;
//! let mut tx = db.begin_write()?;
//! tx.put("users", b"alice", b"{\"age\": 30}")?;
//! let info = tx.commit()?;
//! let rx = db.begin_read()?;
//! assert_eq!(rx.get("users", b"alice")?.as_deref(), Some(&b"{\"age\": 30}"[..]));
//! for item in rx.scan("users", ScanRange::all())? {
//!     let (key, value) = item?;
//!     println!("{key:?} = {value:?} (committed at or before ts {})", info.ts);
//! }
//! db.close()?;
//! # Ok::<(), keeldb::Error>(())
//! ```

#![warn(missing_docs)]

mod accounting;
mod checkpoint;
mod checkpoint_stream;
mod close_marker;
mod codec;
mod commit;
mod cpu;
mod db;
mod digest;
mod error;
mod files;
pub mod fs;
#[doc(hidden)]
pub mod fuzz_api;
pub mod graph;
mod history;
mod history_persist;
mod huge;
mod index;
mod install;
mod maintenance;
mod options;
mod order;
mod recovery;
mod registry;
mod scan;
mod slot_table;
mod txn;
mod types;
mod value_arena;
mod verify;
mod wal;
mod wal_writer;

pub use checkpoint_stream::{ExportInfo, InstallOptions};
pub use commit::{ApplyOutcome, Command, Condition};
pub use cpu::{thread_cpu_ns, Histogram, TagStats, HISTOGRAM_BUCKETS};
pub use db::{conflict_backoff, CheckpointInfo, CommitWait, Database, Stats, TableStats, TxnOptions};
pub use digest::StateDigest;
pub use error::{ConflictReason, Error, Location, Result};
pub use graph::{Graph, GraphError};
pub use history::{Change, ChangeKind};
pub use install::InstallInfo;
#[doc(hidden)]
pub use options::TestHook;
pub use options::{Durability, Isolation, Options, MAX_KEY_BYTES, MAX_TABLE_NAME_BYTES, MAX_VALUE_BYTES};
pub use recovery::RecoveryReport;
pub use txn::{CommitFuture, CommitInfo, ReadTxn, Scan, ScanRange, TxnStats, WriteTxn};
pub use types::{LogPosition, RESERVED_TABLE_PREFIX};
pub use verify::{verify, VerifyReport};

/// The README's example, compiled and run as a doctest so it cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeExample;

/// The on-disk format version this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
