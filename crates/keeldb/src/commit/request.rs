//! What a committer hands to the pipeline, and what the sequencer turns it into: a write set
//! keyed by table name, resolved to table ids and encoded as one WAL payload.
//!
//! The sequencer state ([`Sequencer`]: last timestamp, next LSN, live table ids, the conflict
//! index, the batch counter) lives here too. It is only ever used under the sequencer lock by
//! the one gathering leader. Nothing here does I/O or touches the in-memory index.

use std::collections::{btree_map, BTreeMap};
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
/// two and costs one small allocation, where a `BTreeMap` allocated a ~900-byte node for the
/// first table of every transaction and descended twice per put (once to see whether the table
/// was there, once to take it). A transaction that writes more than [`FEW`] tables turns the
/// vector into a `BTreeMap` for good, so thousands of tables in one transaction cost no
/// quadratic insertion.
///
/// Invariant: names are distinct, and iteration is in name order (in `Few`, names strictly
/// ascending).
#[derive(Debug, Default)]
pub(crate) struct TableSet(Tables);

/// Most tables a [`TableSet`] keeps in its sorted vector.
const FEW: usize = 32;

#[derive(Debug)]
enum Tables {
    Few(Vec<(Arc<str>, TableWrites)>),
    Many(BTreeMap<Arc<str>, TableWrites>),
}

impl Default for Tables {
    fn default() -> Self {
        Tables::Few(Vec::new())
    }
}

/// One entry of a [`TableSet`] as a pair of references.
type TableRef<'a> = (&'a Arc<str>, &'a TableWrites);

/// A [`TableSet`]'s entries in name order, as pairs of references.
pub(crate) enum TableIter<'a> {
    Few(std::slice::Iter<'a, (Arc<str>, TableWrites)>),
    Many(btree_map::Iter<'a, Arc<str>, TableWrites>),
}

impl<'a> Iterator for TableIter<'a> {
    type Item = TableRef<'a>;
    #[inline]
    fn next(&mut self) -> Option<TableRef<'a>> {
        match self {
            TableIter::Few(i) => i.next().map(|(name, tw)| (name, tw)),
            TableIter::Many(i) => i.next(),
        }
    }
}

/// A [`TableSet`]'s entries in name order, by value.
pub(crate) enum TableIntoIter {
    Few(std::vec::IntoIter<(Arc<str>, TableWrites)>),
    Many(btree_map::IntoIter<Arc<str>, TableWrites>),
}

impl Iterator for TableIntoIter {
    type Item = (Arc<str>, TableWrites);
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            TableIntoIter::Few(i) => i.next(),
            TableIntoIter::Many(i) => i.next(),
        }
    }
}

/// Where `name` is, or would go, in a strictly ascending vector.
fn search(v: &[(Arc<str>, TableWrites)], name: &str) -> Result<usize, usize> {
    v.binary_search_by(|(n, _)| (**n).cmp(name))
}

impl TableSet {
    pub fn get(&self, name: &str) -> Option<&TableWrites> {
        match &self.0 {
            Tables::Few(v) => v.get(search(v, name).ok()?).map(|(_, tw)| tw),
            Tables::Many(m) => m.get(name),
        }
    }

    pub fn get_mut(&mut self, name: &str) -> Option<&mut TableWrites> {
        match &mut self.0 {
            Tables::Few(v) => {
                let i = search(v, name).ok()?;
                v.get_mut(i).map(|(_, tw)| tw)
            }
            Tables::Many(m) => m.get_mut(name),
        }
    }

    /// Turns a full vector into a map before `name`, which it does not hold, is added.
    fn make_room(&mut self, name: &str) {
        if let Tables::Few(v) = &mut self.0 {
            if v.len() >= FEW && search(v, name).is_err() {
                self.0 = Tables::Many(std::mem::take(v).into_iter().collect());
            }
        }
    }

    /// `name`'s writes, an empty entry named by `make_name()` added first if there are none.
    /// (`None` never happens: the entry was found or has just been added.)
    pub fn entry(&mut self, name: &str, make_name: impl FnOnce() -> Arc<str>) -> Option<&mut TableWrites> {
        self.make_room(name);
        match &mut self.0 {
            Tables::Few(v) => {
                let i = match search(v, name) {
                    Ok(i) => i,
                    Err(i) => {
                        v.insert(i, (make_name(), TableWrites::default()));
                        i
                    }
                };
                v.get_mut(i).map(|(_, tw)| tw)
            }
            Tables::Many(m) => {
                if !m.contains_key(name) {
                    m.insert(make_name(), TableWrites::default());
                }
                m.get_mut(name)
            }
        }
    }

    /// Sets `name`'s writes, replacing any.
    pub fn insert(&mut self, name: Arc<str>, writes: TableWrites) {
        self.make_room(&name);
        match &mut self.0 {
            Tables::Few(v) => match search(v, &name) {
                Ok(i) => {
                    if let Some(e) = v.get_mut(i) {
                        e.1 = writes;
                    }
                }
                Err(i) => v.insert(i, (name, writes)),
            },
            Tables::Many(m) => {
                m.insert(name, writes);
            }
        }
    }

    pub fn iter(&self) -> TableIter<'_> {
        match &self.0 {
            Tables::Few(v) => TableIter::Few(v.iter()),
            Tables::Many(m) => TableIter::Many(m.iter()),
        }
    }

    pub fn keys(&self) -> impl Iterator<Item = &Arc<str>> {
        self.iter().map(|(name, _)| name)
    }

    pub fn values(&self) -> impl Iterator<Item = &TableWrites> {
        self.iter().map(|(_, tw)| tw)
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Tables::Few(v) => v.len(),
            Tables::Many(m) => m.len(),
        }
    }

    pub fn clear(&mut self) {
        self.0 = Tables::default();
    }
}

impl IntoIterator for TableSet {
    type Item = (Arc<str>, TableWrites);
    type IntoIter = TableIntoIter;
    fn into_iter(self) -> TableIntoIter {
        match self.0 {
            Tables::Few(v) => TableIntoIter::Few(v.into_iter()),
            Tables::Many(m) => TableIntoIter::Many(m.into_iter()),
        }
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
        let mut converted = 0;
        for _ in 0..200 {
            let mut set = TableSet::default();
            let mut model: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
            // Up to 80 distinct names: past `FEW` the set turns into a map.
            let names = if rng.gen_bool(0.5) { 8 } else { 80 };
            for _ in 0..rng.gen_range(1..200) {
                let name = format!("t{}", rng.gen_range(0..names));
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
            converted += usize::from(matches!(set.0, Tables::Many(_)));
            let owned: Vec<String> = set.into_iter().map(|(n, _)| n.to_string()).collect();
            assert_eq!(owned, model.keys().cloned().collect::<Vec<_>>());
        }
        assert!(converted > 20, "the map form was exercised {converted} times");
    }
}
