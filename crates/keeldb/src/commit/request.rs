//! What a committer hands to the pipeline, and what the sequencer turns it into: a write set
//! keyed by table name, resolved to table ids and encoded as one WAL payload.
//!
//! The sequencer state ([`Sequencer`]: last timestamp, next LSN, live table ids, the conflict
//! index, the batch counter) lives here too. It is only ever used under the sequencer lock by
//! the one gathering leader. Nothing here does I/O or touches the in-memory index.

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

/// A transaction's writes by table, in table-name order.
///
/// A transaction writes one table, or a few: a sorted vector finds a name in a comparison or
/// two and costs one small allocation, where a `BTreeMap` (which this replaces) allocated a
/// ~900-byte node for the first table of every transaction and descended twice per put (once
/// to see whether the table was there, once to take it).
///
/// Invariant: names are strictly ascending, so distinct, and iteration is in name order.
#[derive(Debug, Default)]
pub(crate) struct TableSet(Vec<(Arc<str>, TableWrites)>);

/// One entry of a [`TableSet`] as a pair of references.
type TableRef<'a> = (&'a Arc<str>, &'a TableWrites);

/// A [`TableSet`]'s entries in name order, as pairs of references.
pub(crate) struct TableIter<'a>(std::slice::Iter<'a, (Arc<str>, TableWrites)>);

impl<'a> Iterator for TableIter<'a> {
    type Item = TableRef<'a>;
    #[inline]
    fn next(&mut self) -> Option<TableRef<'a>> {
        self.0.next().map(|(name, tw)| (name, tw))
    }
}

impl TableSet {
    fn search(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(n, _)| (**n).cmp(name))
    }

    pub fn get(&self, name: &str) -> Option<&TableWrites> {
        let i = self.search(name).ok()?;
        self.0.get(i).map(|(_, tw)| tw)
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut TableWrites> {
        let i = self.search(name).ok()?;
        self.0.get_mut(i).map(|(_, tw)| tw)
    }

    /// `name`'s writes, an empty entry named by `make_name()` added first if there are none.
    /// (`None` never happens: the entry was found or has just been added.)
    pub fn entry(&mut self, name: &str, make_name: impl FnOnce() -> Arc<str>) -> Option<&mut TableWrites> {
        let i = match self.search(name) {
            Ok(i) => i,
            Err(i) => {
                self.0.insert(i, (make_name(), TableWrites::default()));
                i
            }
        };
        self.0.get_mut(i).map(|(_, tw)| tw)
    }

    /// Sets `name`'s writes, replacing any.
    pub fn insert(&mut self, name: Arc<str>, writes: TableWrites) {
        match self.search(&name) {
            Ok(i) => {
                if let Some(e) = self.0.get_mut(i) {
                    e.1 = writes;
                }
            }
            Err(i) => self.0.insert(i, (name, writes)),
        }
    }

    pub fn iter(&self) -> TableIter<'_> {
        TableIter(self.0.iter())
    }

    pub fn keys(&self) -> impl Iterator<Item = &Arc<str>> {
        self.0.iter().map(|(name, _)| name)
    }

    pub fn values(&self) -> impl Iterator<Item = &TableWrites> {
        self.0.iter().map(|(_, tw)| tw)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }
}

impl IntoIterator for TableSet {
    type Item = (Arc<str>, TableWrites);
    type IntoIter = std::vec::IntoIter<(Arc<str>, TableWrites)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a> IntoIterator for &'a TableSet {
    type Item = TableRef<'a>;
    type IntoIter = TableIter<'a>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
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
    pub tables: TableSet,
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
    pub fn resolve(&mut self, tables: TableSet, ts: u64, frames: Vec<u8>) -> (Vec<TableApply>, PayloadBuilder) {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;

    /// The set against the `BTreeMap` it replaced: the same tables, each with its own writes,
    /// iterated in name order, whatever order the names first appear in.
    #[test]
    fn keeps_tables_in_name_order_like_the_map_it_replaced() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        for _ in 0..200 {
            let mut set = TableSet::default();
            let mut model: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
            for _ in 0..rng.gen_range(1..30) {
                let name = format!("t{}", rng.gen_range(0..8));
                let key = vec![rng.gen_range(0..=255u8)];
                let made = std::cell::Cell::new(false);
                let tw = set.entry(&name, || {
                    made.set(true);
                    Arc::from(name.as_str())
                });
                tw.unwrap().writes.insert(&key, Some(b"v"));
                assert_eq!(made.get(), !model.contains_key(&name), "a name was made for an existing table");
                model.entry(name).or_default().push(key);
            }
            assert_eq!(set.len(), model.len());
            let names: Vec<&str> = set.keys().map(|n| &**n).collect();
            assert_eq!(names, model.keys().map(String::as_str).collect::<Vec<_>>());
            for (name, keys) in &model {
                let mut keys = keys.clone();
                keys.sort();
                keys.dedup();
                let got: Vec<Vec<u8>> = set.get(name).unwrap().writes.keys().map(|k| k.as_slice().to_vec()).collect();
                assert_eq!(got, keys, "table {name}");
            }
            assert!(set.get("absent").is_none());
            // `insert` replaces a table's writes and keeps the order.
            if let Some(first) = model.keys().next().cloned() {
                set.insert(Arc::from(first.as_str()), TableWrites { dropped: true, writes: WriteSet::default() });
                assert!(set.get(&first).unwrap().dropped && set.get(&first).unwrap().writes.is_empty());
                assert_eq!(set.len(), model.len());
            }
            let owned: Vec<String> = set.into_iter().map(|(n, _)| n.to_string()).collect();
            assert_eq!(owned, model.keys().cloned().collect::<Vec<_>>());
        }
    }
}
