//! Replacing the whole state under the committer (a checkpoint install): the quiescent point
//! the install works at, the fence that fails every transaction begun before it, and the
//! switch of the sequencer, the WAL writer and what readers see.
//!
//! This module owns only the in-memory side and its ordering: `install.rs` does every file
//! operation, inside the closure [`Committer::replace_state`] calls while it holds the
//! sequencer lock. It never reads a stream, never touches a file and never reaches the
//! database handle.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use super::Committer;
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::index::{Table, TableData};
use crate::types::{FastMap, LogPosition};
use crate::wal::WalWriter;

/// The write path at rest, as an install sees it: every sequenced commit is published and its
/// WAL bytes are durable, and nothing is sequenced until the replacement returns.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Quiesced {
    /// The last commit timestamp (every commit up to it is visible and durable).
    pub last_ts: u64,
    /// Above every table id the replaced state holds in memory.
    pub next_table_id: u32,
    /// The sequence number after the current WAL segment's.
    pub next_segment: u64,
    /// Where the current WAL ends (every byte before it is durable).
    pub wal_end_lsn: u64,
}

/// The state a replacement switches to.
pub(crate) struct Replacement {
    /// Its commit timestamp: above [`Quiesced::last_ts`]; the next commit gets `ts + 1`.
    pub ts: u64,
    /// A writer at the end of the new WAL (an empty segment whose first timestamp is `ts + 1`).
    pub wal: WalWriter,
    /// Its tables: id (at or above [`Quiesced::next_table_id`]), name and data.
    pub tables: Vec<(u32, Arc<str>, TableData)>,
    pub next_table_id: u32,
    pub digest: StateDigest,
    pub applied: Option<LogPosition>,
}

/// Why a replacement's preparation failed, and whether it had passed its commit point (then
/// the files already hold the new state, memory does not, and the committer poisons itself so
/// the next open finishes the job).
#[derive(Debug)]
pub(crate) struct ReplaceError {
    pub committed: bool,
    pub error: Error,
}

impl Committer {
    /// Replaces the whole state. Holds the sequencer lock throughout, so commits wait (they are
    /// never refused for it); waits until every sequenced commit is published and fdatasyncs
    /// the WAL; calls `prepare` with that quiescent point (it makes the new state durable and
    /// opens its WAL); then switches, in this order: the WAL writer; under the publish and
    /// digest locks, the old tables end at `ts` (snapshots older than `ts` keep reading them),
    /// the new ones begin at `ts`, the change feed restarts at `ts`, and the visible timestamp,
    /// digest and applied position move together; the history floor rises to `ts` if one is
    /// kept; the sequencer restarts at `ts` with a fence that fails every transaction whose
    /// snapshot is older than `ts` with `ConflictReason::StateReplaced`. Log commands are not
    /// fenced: they are ordered by their positions, which continue from the new `applied`.
    pub fn replace_state<T>(
        &self,
        prepare: impl FnOnce(&Quiesced) -> std::result::Result<(Replacement, T), ReplaceError>,
    ) -> Result<T> {
        self.check_writable()?;
        let mut seq = self.sequencer.lock();
        while self.published.visible_ts() != seq.last_ts {
            // Earlier batches finish their I/O and publish without the sequencer lock.
            self.check_writable()?;
            std::thread::sleep(Duration::from_micros(100));
        }
        self.sync_wal()?;
        let quiesced = {
            let wal = self.wal.lock();
            Quiesced {
                last_ts: seq.last_ts,
                next_table_id: seq.next_table_id(),
                next_segment: wal.current().seq + 1,
                wal_end_lsn: wal.end_lsn(),
            }
        };
        let (new, out) = prepare(&quiesced).map_err(|ReplaceError { committed, error }| {
            if committed {
                self.poison(&format!(
                    "checkpoint install interrupted after its commit point ({error}); reopen to finish it"
                ));
            }
            error
        })?;
        assert!(new.ts > quiesced.last_ts, "a replacement never moves timestamps backwards");
        let start_lsn = new.wal.end_lsn();
        *self.wal.lock() = new.wal;
        self.durable_lsn.fetch_max(start_lsn, Ordering::AcqRel);
        let live: FastMap<Arc<str>, u32> = new.tables.iter().map(|(id, name, _)| (Arc::clone(name), *id)).collect();
        self.switch_published(new.ts, new.tables, new.digest, new.applied);
        seq.replace(new.ts, start_lsn, live, new.next_table_id, new.applied);
        drop(seq);
        self.counters.wal_bytes_since_checkpoint.store(0, Ordering::Relaxed);
        // Without older snapshots the old tables can go now (a handle without background
        // threads has no collector to free them later).
        let horizon = self.published.horizon();
        self.published.catalog.write().collect(horizon);
        self.published.history.notify();
        Ok(out)
    }

    /// Swaps what readers see; see [`Committer::replace_state`].
    fn switch_published(
        &self,
        ts: u64,
        tables: Vec<(u32, Arc<str>, TableData)>,
        digest: StateDigest,
        applied: Option<LogPosition>,
    ) {
        let view = &self.published;
        self.pipeline.with_publication_held(|| {
            let mut current = view.digest.lock();
            {
                let mut catalog = view.catalog.write();
                for old in catalog.live() {
                    old.dropped_ts.store(ts, Ordering::Release);
                }
                for (id, name, data) in tables {
                    let dropped_ts = AtomicU64::new(u64::MAX);
                    catalog.insert(Arc::new(Table { id, name, created_ts: ts, dropped_ts, data: RwLock::new(data) }));
                }
            }
            // Before `ts` is visible: nobody reads a feed that claims to cover the jump.
            view.history.restart(ts);
            *current = digest;
            *view.applied.lock() = applied;
            view.visible_ts.store(ts, Ordering::Release);
        });
        if view.registry.floor().is_some() {
            // Cannot fail: `ts` is visible and the horizon is at most the visible timestamp.
            let _ = view.registry.set_floor(ts, &view.visible_ts);
        }
    }
}
