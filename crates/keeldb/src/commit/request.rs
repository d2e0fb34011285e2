//! What a committer hands to the pipeline, and what the sequencer turns it into: a write set
//! keyed by table name, resolved to table ids and encoded as one WAL payload.
//!
//! The sequencer state ([`Sequencer`]: last timestamp, next LSN, live table ids, the conflict
//! index, the batch counter) lives here too. It is only ever used under the sequencer lock by
//! the one gathering leader. Nothing here does I/O or touches the in-memory index.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::conflicts::ConflictIndex;
use super::write_set::WriteSet;
use crate::index::KeyRange;
use crate::options::{Durability, Isolation};
use crate::types::{FastMap, LogPosition};
use crate::wal::PayloadBuilder;

/// One table's part of a write set.
#[derive(Debug, Default)]
pub(crate) struct TableWrites {
    /// The transaction dropped the table as it was in its snapshot; `writes` go to a new one.
    pub dropped: bool,
    /// Key to new value (`None` deletes).
    pub writes: WriteSet,
}

/// Something a serializable transaction read, validated at commit.
#[derive(Debug)]
pub(crate) enum ReadItem {
    Key(Vec<u8>),
    Range(KeyRange),
}

/// What a write transaction hands to the commit pipeline.
#[derive(Debug)]
pub(crate) struct CommitRequest {
    pub start_ts: u64,
    pub durability: Durability,
    pub isolation: Isolation,
    pub tables: BTreeMap<Arc<str>, TableWrites>,
    pub reads: Vec<(Arc<str>, ReadItem)>,
    /// Set for a command applied from a replicated log: validated by its conditions in log
    /// order, not by snapshot age.
    pub apply: Option<super::apply::ApplyPart>,
}

/// One table's writes, resolved to table ids.
#[derive(Debug)]
pub(crate) struct TableApply {
    pub name: Arc<str>,
    /// The id of the table instance the commit drops first, if any.
    pub drop_id: Option<u32>,
    /// Whether the commit creates the table `id` (first write, or write after its own drop).
    pub create: bool,
    /// 0 when the commit only deletes in a table that does not exist (nothing to apply).
    pub id: u32,
    pub writes: WriteSet,
}

/// The sequencer's state, behind the committer's sequencer lock.
#[derive(Debug)]
pub(crate) struct Sequencer {
    /// Last timestamp handed out (sequenced commits, durable or not).
    pub last_ts: u64,
    /// LSN the next frame gets.
    pub next_lsn: u64,
    /// Table name to live id, including tables created by commits not yet visible.
    tables: FastMap<Arc<str>, u32>,
    next_table_id: u32,
    pub conflicts: ConflictIndex,
    /// Sequence number the next batch gets.
    pub next_batch: u64,
    /// The log position of the last command sequenced from a replicated log.
    pub last_position: Option<LogPosition>,
}

impl Sequencer {
    pub fn new(
        last_ts: u64,
        next_lsn: u64,
        live_tables: FastMap<Arc<str>, u32>,
        next_table_id: u32,
        last_position: Option<LogPosition>,
    ) -> Sequencer {
        Sequencer {
            last_ts,
            next_lsn,
            tables: live_tables,
            next_table_id: next_table_id.max(1),
            conflicts: ConflictIndex::default(),
            next_batch: 0,
            last_position,
        }
    }

    /// The id the next new table gets (above every id this store has handed out).
    pub fn next_table_id(&self) -> u32 {
        self.next_table_id
    }

    /// Restarts the sequencer on an installed state at `ts`: new tables, ids, log position and
    /// LSN, and a conflict index fenced at `ts`. The batch counter continues (publication
    /// counts batches across the switch).
    pub fn replace(
        &mut self,
        ts: u64,
        next_lsn: u64,
        live_tables: FastMap<Arc<str>, u32>,
        next_table_id: u32,
        applied: Option<LogPosition>,
    ) {
        let next_batch = self.next_batch;
        *self = Sequencer::new(ts, next_lsn, live_tables, next_table_id, applied);
        self.conflicts = ConflictIndex::fenced(ts);
        self.next_batch = next_batch;
    }

    /// Resolves table names to ids (allocating for new tables), starts encoding the payload at
    /// the end of the batch's `frames`, and records the writes in the conflict index at `ts`.
    pub fn resolve(
        &mut self,
        tables: BTreeMap<Arc<str>, TableWrites>,
        ts: u64,
        frames: Vec<u8>,
    ) -> (Vec<TableApply>, PayloadBuilder) {
        // Sized up front: each op is at most a tag, a table id, two lengths and its bytes.
        let size: usize = tables
            .iter()
            .map(|(name, tw)| {
                32 + name.len()
                    + tw.writes.iter().map(|(k, v)| 13 + k.as_slice().len() + v.map_or(0, <[u8]>::len)).sum::<usize>()
            })
            .sum();
        let mut payload = PayloadBuilder::in_frame(frames, size);
        let mut out = Vec::with_capacity(tables.len());
        for (name, tw) in tables {
            let existing = self.tables.get(&name).copied();
            let drop_id = if tw.dropped { existing } else { None };
            if let Some(id) = drop_id {
                payload.drop_table(id);
                self.tables.remove(&name);
            }
            let has_puts = tw.writes.values().any(|v| v.is_some());
            let live = if drop_id.is_some() { None } else { existing };
            let (id, create) = match live {
                Some(id) => (id, false),
                None if has_puts => {
                    let id = self.next_table_id;
                    self.next_table_id += 1;
                    payload.create_table(id, &name);
                    self.tables.insert(Arc::clone(&name), id);
                    (id, true)
                }
                None => (0, false), // Only deletes in a table that does not exist: nothing to do.
            };
            if id != 0 {
                for (k, v) in &tw.writes {
                    match v {
                        Some(v) => payload.put(id, k.as_slice(), v),
                        None if !create => payload.delete(id, k.as_slice()),
                        None => {}
                    }
                }
            }
            self.conflicts.record(&name, drop_id.is_some(), tw.writes.keys(), ts);
            out.push(TableApply { name, drop_id, create, id, writes: tw.writes });
        }
        (out, payload)
    }
}
