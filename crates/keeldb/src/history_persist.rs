//! History across a restart: what a checkpoint writes of the history kept in memory, and
//! what recovery does with those records and with the WAL replayed after them.
//!
//! A checkpoint holds the newest state at its timestamp `C`. With history it also holds, for
//! a floor `F <= C`: the tables created after `F`, each key changed after `F` at its value at
//! `F` (its *base*), and every change after `F` in the change feed's order (format.md,
//! "History records"). Recovery loads the state at `C`, rewinds each changed key to its base,
//! and applies the changes again with `F` as the horizon: that rebuilds every version at or
//! above `F` and the change feed after `F`, and must end at the checkpoint's state again (its
//! digest is checked). The WAL after `C` is then replayed with the same horizon, recording
//! its changes too, so the reopened store has the history it had.
//!
//! It owns only what to write and how to rebuild; it never opens files (the checkpoint writer
//! and reader carry the records) and does nothing when history is not kept.

use std::sync::Arc;

use crate::checkpoint::{CheckpointWriter, HistoryRecord};
use crate::commit::Published;
use crate::error::{Error, Result};
use crate::history::{Change, ChangeKind};
use crate::index::Table;
use crate::recovery::StateBuilder;
use crate::types::FastMap;

/// What a checkpoint at `snap` writes of the history: every change in `floor + 1 ..= snap`.
/// Holds a registered snapshot at `floor` (released on drop), so the values at the floor stay
/// readable while the checkpoint is written even if the floor rises meanwhile.
pub(crate) struct HistoryPlan<'a> {
    view: &'a Published,
    pub floor: u64,
    changes: Vec<Change>,
}

impl Drop for HistoryPlan<'_> {
    fn drop(&mut self) {
        self.view.registry.release(self.floor);
    }
}

/// Attempts at pinning the floor before giving up on writing history this time (the floor rose
/// between reading it and pinning it each time).
const PIN_ATTEMPTS: usize = 4;

/// The history a checkpoint at `snap` of `tables` (those visible at `snap`) writes, or `None`
/// when it writes none: no history kept, none before `snap`, or one this format cannot state
/// (a table dropped after the floor). Without history the reopened store's history starts at
/// the checkpoint, as it did before history was persisted: less history, never a wrong one.
pub(crate) fn plan<'a>(view: &'a Published, snap: u64, tables: &[Arc<Table>]) -> Option<HistoryPlan<'a>> {
    if !view.history.is_recording() {
        return None;
    }
    for _ in 0..PIN_ATTEMPTS {
        let floor = view.registry.floor()?.max(view.history.footprint().0);
        if floor >= snap {
            return None;
        }
        if view.registry.acquire_at(floor, &view.visible_ts).is_err() {
            continue;
        }
        let mut plan = HistoryPlan { view, floor, changes: Vec::new() };
        let Some(changes) = changes_through(view, floor, snap) else {
            continue; // trimmed past `floor` meanwhile: the plan's drop releases the pin
        };
        let live = |c: &Change| tables.iter().any(|t| t.name == c.table && t.created_ts <= c.ts);
        if changes.iter().any(|c| c.kind == ChangeKind::DropTable || !live(c)) {
            return None;
        }
        plan.changes = changes;
        return Some(plan);
    }
    None
}

/// Changes a page read at a time: the feed's lock is held for one page, never for a copy of
/// the whole feed, so publication is not held up behind a large history.
const FEED_PAGE: usize = 4096;

/// The feed's changes in `floor + 1 ..= snap`, or `None` if it was trimmed past `floor`
/// while they were read (the floor rose).
fn changes_through(view: &Published, floor: u64, snap: u64) -> Option<Vec<Change>> {
    let mut out: Vec<Change> = Vec::new();
    let mut after = floor;
    let mut max = FEED_PAGE;
    while after < snap {
        let page = view.history.since(after, snap, max).ok()?;
        let (Some(first), Some(last)) = (page.first().map(|c| c.ts), page.last().map(|c| c.ts)) else { break };
        if page.len() >= max && first == last {
            // One commit alone fills the page, which may hold only part of it: read it whole.
            max = max.saturating_mul(2);
            continue;
        }
        out.extend(page.into_iter().filter(|c| c.ts <= snap));
        after = last;
        max = FEED_PAGE;
    }
    Some(out)
}

impl HistoryPlan<'_> {
    /// Writes the history records after the checkpoint's entries: the tables created after the
    /// floor, the base of every key changed after it (its value at the floor, read through the
    /// pinned snapshot), then the changes in feed order.
    pub fn write(&self, writer: &mut CheckpointWriter, tables: &[Arc<Table>]) -> Result<()> {
        let (enc, path) = writer.history();
        let io = |e| Error::io(path, e);
        let by_name: FastMap<&str, &Arc<Table>> = tables.iter().map(|t| (&*t.name, t)).collect();
        for t in tables.iter().filter(|t| t.created_ts > self.floor) {
            enc.created(t.id, t.created_ts).map_err(io)?;
        }
        let mut seen: std::collections::HashSet<(u32, &[u8])> = Default::default();
        for c in &self.changes {
            let t = by_name.get(&*c.table).ok_or_else(|| Error::corruption(path, 0, "change to an unknown table"))?;
            if seen.insert((t.id, c.key.as_slice())) {
                let base = t.data.read().get(&c.key, self.floor);
                enc.base(t.id, &c.key, base.as_deref()).map_err(io)?;
            }
        }
        for c in &self.changes {
            let t = by_name.get(&*c.table).ok_or_else(|| Error::corruption(path, 0, "change to an unknown table"))?;
            let value = match &c.kind {
                ChangeKind::Put(v) => Some(v.as_slice()),
                _ => None,
            };
            enc.change(c.ts, t.id, &c.key, value).map_err(io)?;
        }
        Ok(())
    }
}

/// A change record copied out: timestamp, table id, key, value (`None`: a deletion).
type ChangeRecord = (u64, u32, Vec<u8>, Option<Vec<u8>>);

/// The history records of a checkpoint, copied out as its blocks are read.
#[derive(Debug, Default)]
pub(crate) struct HistoryRecords {
    created: Vec<(u32, u64)>,
    bases: Vec<(u32, Vec<u8>, Option<Vec<u8>>)>,
    changes: Vec<ChangeRecord>,
}

impl HistoryRecords {
    pub fn push(&mut self, record: &HistoryRecord<'_>) {
        match *record {
            HistoryRecord::Created { table, ts } => self.created.push((table, ts)),
            HistoryRecord::Base { table, key, value } => {
                self.bases.push((table, key.to_vec(), value.map(<[u8]>::to_vec)))
            }
            HistoryRecord::Change { ts, table, key, value } => {
                self.changes.push((ts, table, key.to_vec(), value.map(<[u8]>::to_vec)))
            }
        }
    }
}

/// History being rebuilt by recovery: the floor, and the change feed after it so far.
#[derive(Debug, Default)]
pub(crate) struct Replayed {
    pub floor: u64,
    pub changes: Vec<Change>,
}

impl Replayed {
    /// Records one logged write (`None`: a deletion), as publication records it.
    pub fn write(&mut self, ts: u64, table: &Arc<str>, key: &[u8], value: Option<&[u8]>) {
        let kind = value.map_or(ChangeKind::Delete, |v| ChangeKind::Put(v.to_vec()));
        self.changes.push(Change { ts, table: Arc::clone(table), key: key.to_vec(), kind });
    }

    pub fn drop_table(&mut self, ts: u64, table: &Arc<str>) {
        self.changes.push(Change { ts, table: Arc::clone(table), key: Vec::new(), kind: ChangeKind::DropTable });
    }
}

impl StateBuilder {
    /// Starts keeping history at `floor` with nothing to rebuild: a checkpoint without history
    /// (its own timestamp) or none at all (0). The WAL replayed after it records its changes.
    pub fn keep_history_from(&mut self, floor: u64) {
        self.history_records = HistoryRecords::default();
        self.history = Some(Replayed { floor, changes: Vec::new() });
    }

    /// Rebuilds the history after `floor` from the loaded checkpoint's history records (see the
    /// module comment). Errors say how the records fail to lead back to the checkpoint's state:
    /// every block passed its CRC, so that is a writer's fault, reported as corruption.
    pub fn rebuild_history(&mut self, floor: u64) -> std::result::Result<(), &'static str> {
        let records = std::mem::take(&mut self.history_records);
        let target = self.digest;
        for (id, created_ts) in records.created {
            let old = Arc::clone(self.catalog.by_id(id).ok_or("history names an unknown table")?);
            let table = Table::new(id, Arc::clone(&old.name), created_ts);
            *table.data.write() = std::mem::take(&mut *old.data.write());
            self.catalog.insert(Arc::new(table));
        }
        for (id, key, value) in &records.bases {
            let t = self.catalog.by_id(*id).ok_or("history names an unknown table")?;
            t.data.write().reset(&t.name, key, value.as_deref(), &mut self.digest);
        }
        let mut replayed = Replayed { floor, changes: Vec::with_capacity(records.changes.len()) };
        for (ts, id, key, value) in records.changes {
            let t = self.catalog.by_id(id).ok_or("history names an unknown table")?;
            if t.created_ts > ts {
                return Err("history changes a table before its creation");
            }
            t.data.write().apply(&t.name, &key, value.as_deref(), ts, floor, &mut self.digest);
            let kind = value.map_or(ChangeKind::Delete, ChangeKind::Put);
            replayed.changes.push(Change { ts, table: Arc::clone(&t.name), key, kind });
        }
        if self.digest != target {
            return Err("the history's changes do not lead to the checkpoint's state");
        }
        self.history = Some(replayed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::CheckpointSink;

    /// A state at ts 5 holding `t/a = 2`, with history records from floor 2.
    fn loaded(records: &[HistoryRecord<'_>]) -> StateBuilder {
        let mut state = StateBuilder::default();
        state.table(1, "t");
        state.entry(1, b"a", b"2");
        for r in records {
            state.history(r);
        }
        state
    }

    #[test]
    fn history_that_leads_back_to_the_checkpoint_is_rebuilt() {
        let mut state = loaded(&[
            HistoryRecord::Base { table: 1, key: b"a", value: Some(b"0") },
            HistoryRecord::Change { ts: 3, table: 1, key: b"a", value: None },
            HistoryRecord::Change { ts: 5, table: 1, key: b"a", value: Some(b"2") },
        ]);
        state.rebuild_history(2).expect("consistent");
        let t = state.catalog.by_id(1).expect("table");
        let data = t.data.read();
        assert_eq!(data.get(b"a", 2).as_deref(), Some(&b"0"[..]));
        assert_eq!(data.get(b"a", 4), None);
        assert_eq!(data.get(b"a", 5).as_deref(), Some(&b"2"[..]));
        assert_eq!(state.history.map(|h| h.changes.len()), Some(2));
    }

    /// Records whose every block passed its CRC but which do not lead to the checkpoint's
    /// state (a writer's fault) are refused, not served as history.
    #[test]
    fn history_that_does_not_lead_back_to_the_checkpoint_is_refused() {
        let cases: [&[HistoryRecord<'_>]; 3] = [
            &[HistoryRecord::Change { ts: 3, table: 1, key: b"a", value: Some(b"9") }],
            &[HistoryRecord::Base { table: 1, key: b"b", value: Some(b"1") }],
            &[
                HistoryRecord::Created { table: 1, ts: 4 },
                HistoryRecord::Change { ts: 3, table: 1, key: b"a", value: Some(b"2") },
            ],
        ];
        for records in cases {
            assert!(loaded(records).rebuild_history(2).is_err(), "{records:?}");
        }
    }
}
