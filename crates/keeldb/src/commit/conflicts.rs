//! The recent-writes conflict index and validation (first committer wins; serializable read
//! validation).
//!
//! It records every commit at the moment it is sequenced, whether or not that commit is durable
//! or visible yet, so validation sees everything sequenced before it. It is owned by the
//! sequencer and only touched under the sequencer lock. It never does I/O, never sees the
//! in-memory index, and forgets a record only when no live or future snapshot can be older.

use std::sync::Arc;

use super::request::{CommitRequest, ReadItem};
use super::waiter::Conflict;
use crate::error::ConflictReason;
use crate::index::{Key, KeyRange};
use crate::options::Isolation;
use crate::types::FastMap;

/// Trimming runs when the index holds more than this many keys (or twice what survived the
/// last trim), so its cost is amortised over many commits.
const TRIM_MIN: usize = 4096;

/// Per table, the newest commit timestamp that wrote each recently written key, and per table
/// name the newest timestamp that dropped it. Hashed, not ordered: point checks are O(1), and
/// the rare serializable range check scans the table's recent set, which trimming keeps small.
/// A transaction whose snapshot is older than `fence` conflicts whatever it touched: the state
/// it read was replaced by an installed checkpoint (0 until an install).
#[derive(Debug)]
pub(crate) struct ConflictIndex {
    recent: FastMap<Arc<str>, FastMap<Key, u64>>,
    recent_len: usize,
    trim_at: usize,
    drops: FastMap<Arc<str>, u64>,
    fence: u64,
    /// The newest timestamp ever recorded (written or dropped at). A transaction whose snapshot
    /// is at or after it conflicts with nothing: every conflict is a record newer than the
    /// snapshot. The common uncontended commit then skips a lookup per key.
    newest: u64,
}

impl Default for ConflictIndex {
    fn default() -> Self {
        ConflictIndex::fenced(0)
    }
}

fn conflict(table: &Arc<str>, key: Option<&[u8]>, reason: ConflictReason) -> Conflict {
    Conflict { table: Arc::clone(table), key: key.map(<[u8]>::to_vec), reason }
}

impl ConflictIndex {
    /// An empty index that fails every transaction whose snapshot is older than `fence`. After
    /// an install the old records name tables of the replaced state; the fence alone decides
    /// for every transaction that could have seen them.
    pub fn fenced(fence: u64) -> ConflictIndex {
        ConflictIndex {
            recent: FastMap::default(),
            recent_len: 0,
            trim_at: TRIM_MIN,
            drops: FastMap::default(),
            fence,
            newest: 0,
        }
    }

    fn written_after(&self, table: &str, key: &[u8], ts: u64) -> bool {
        self.recent.get(table).and_then(|m| m.get(key)).is_some_and(|&w| w > ts)
    }

    fn range_written_after(&self, table: &str, range: &KeyRange, ts: u64) -> Option<&Key> {
        if range.is_empty() {
            return None;
        }
        let m = self.recent.get(table)?;
        m.iter().find(|(k, &w)| w > ts && range.contains(k.as_slice())).map(|(k, _)| k)
    }

    fn dropped_after(&self, table: &str, ts: u64) -> bool {
        self.drops.get(table).is_some_and(|&d| d > ts)
    }

    fn table_written_after(&self, table: &str, ts: u64) -> bool {
        self.recent.get(table).is_some_and(|m| m.values().any(|&w| w > ts))
    }

    /// First committer wins: fails if anything this transaction wrote (or, when serializable,
    /// read) was written by a commit sequenced after this transaction's snapshot.
    pub fn validate(&self, req: &CommitRequest) -> Result<(), Conflict> {
        let start = req.start_ts;
        if start < self.fence {
            let table = req.tables.keys().chain(req.reads.iter().map(|(t, _)| t)).next();
            let table = table.map_or_else(|| Arc::from(""), Arc::clone);
            return Err(Conflict { table, key: None, reason: ConflictReason::StateReplaced });
        }
        if start >= self.newest {
            return Ok(());
        }
        for (name, tw) in &req.tables {
            if self.dropped_after(name, start) {
                return Err(conflict(name, None, ConflictReason::TableDropped));
            }
            if tw.dropped && self.table_written_after(name, start) {
                return Err(conflict(name, None, ConflictReason::TableWritten));
            }
            if let Some(key) = tw.writes.keys().find(|key| self.written_after(name, key.as_slice(), start)) {
                return Err(conflict(name, Some(key.as_slice()), ConflictReason::KeyWritten));
            }
        }
        if req.isolation == Isolation::Serializable {
            for (name, item) in &req.reads {
                if self.dropped_after(name, start) {
                    return Err(conflict(name, None, ConflictReason::TableDropped));
                }
                let changed = match item {
                    ReadItem::Key(k) => self.written_after(name, k, start).then_some(k.as_slice()),
                    ReadItem::Range(r) => self.range_written_after(name, r, start).map(Key::as_slice),
                };
                if let Some(key) = changed {
                    return Err(conflict(name, Some(key), ConflictReason::ReadChanged));
                }
            }
        }
        Ok(())
    }

    /// Records a sequenced commit's writes (and drop) at `ts`.
    pub fn record<'a>(&mut self, table: &Arc<str>, dropped: bool, keys: impl Iterator<Item = &'a Key>, ts: u64) {
        if dropped {
            self.drops.insert(Arc::clone(table), ts);
            self.newest = self.newest.max(ts);
        }
        let mut keys = keys.peekable();
        if keys.peek().is_none() {
            return;
        }
        self.newest = self.newest.max(ts);
        let m = self.recent.entry(Arc::clone(table)).or_default();
        for k in keys {
            if m.insert(k.clone(), ts).is_none() {
                self.recent_len += 1;
            }
        }
    }

    /// Whether enough has accumulated since the last trim to make another worthwhile.
    pub fn wants_trim(&self) -> bool {
        self.recent_len > self.trim_at
    }

    /// Forgets conflict records at or below `horizon`: no live or future transaction has a
    /// snapshot that old, so none can conflict with them.
    pub fn trim(&mut self, horizon: u64) {
        let mut len = 0;
        self.recent.retain(|_, m| {
            m.retain(|_, ts| *ts > horizon);
            len += m.len();
            !m.is_empty()
        });
        self.drops.retain(|_, ts| *ts > horizon);
        self.recent_len = len;
        self.trim_at = (len * 2).max(TRIM_MIN);
    }
}

#[cfg(test)]
mod tests {
    use crate::commit::TableSet;

    use super::*;
    use crate::commit::request::TableWrites;
    use crate::options::Durability;

    fn request(start_ts: u64, table: &str, key: &[u8], isolation: Isolation) -> CommitRequest {
        let mut tw = TableWrites::default();
        tw.writes.insert(key, Some(b"v"));
        let mut tables = TableSet::default();
        tables.insert(Arc::from(table), tw);
        CommitRequest { start_ts, durability: Durability::Relaxed, isolation, tables, reads: Vec::new(), apply: None }
    }

    #[test]
    fn first_committer_wins_and_names_the_key() {
        let mut idx = ConflictIndex::default();
        let t: Arc<str> = Arc::from("t");
        idx.record(&t, false, [Key::new(b"k")].iter(), 5);
        let err = idx.validate(&request(4, "t", b"k", Isolation::Snapshot)).err();
        assert_eq!(err, Some(conflict(&t, Some(b"k"), ConflictReason::KeyWritten)));
        assert!(idx.validate(&request(5, "t", b"k", Isolation::Snapshot)).is_ok(), "snapshot saw the write");
        assert!(idx.validate(&request(4, "t", b"other", Isolation::Snapshot)).is_ok());
    }

    #[test]
    fn a_fence_fails_every_older_snapshot_and_no_newer_one() {
        let idx = ConflictIndex::fenced(10);
        let err = idx.validate(&request(9, "t", b"k", Isolation::Snapshot)).err();
        assert_eq!(err, Some(conflict(&Arc::from("t"), None, ConflictReason::StateReplaced)));
        assert!(idx.validate(&request(10, "t", b"k", Isolation::Snapshot)).is_ok());
    }

    #[test]
    fn a_snapshot_at_the_newest_record_skips_the_lookups_and_an_older_one_does_not() {
        let mut idx = ConflictIndex::default();
        let t: Arc<str> = Arc::from("t");
        idx.record(&t, false, [Key::new(b"a")].iter(), 5);
        idx.record(&t, false, [Key::new(b"b")].iter(), 7);
        assert!(idx.validate(&request(6, "t", b"a", Isolation::Snapshot)).is_ok());
        assert!(idx.validate(&request(6, "t", b"b", Isolation::Snapshot)).is_err());
        assert!(idx.validate(&request(7, "t", b"b", Isolation::Snapshot)).is_ok());
        // A drop with no keys written is a record too.
        idx.record(&t, true, std::iter::empty(), 9);
        let err = idx.validate(&request(8, "t", b"c", Isolation::Snapshot)).err();
        assert_eq!(err, Some(conflict(&t, None, ConflictReason::TableDropped)));
        assert!(idx.validate(&request(9, "t", b"c", Isolation::Snapshot)).is_ok());
    }

    #[test]
    fn trim_forgets_only_records_at_or_below_the_horizon() {
        let mut idx = ConflictIndex::default();
        let t: Arc<str> = Arc::from("t");
        idx.record(&t, false, [Key::new(b"a")].iter(), 3);
        idx.record(&t, true, [Key::new(b"b")].iter(), 7);
        idx.trim(5);
        assert!(idx.validate(&request(2, "t", b"a", Isolation::Snapshot)).is_err(), "dropped at 7 still conflicts");
        assert_eq!(idx.recent_len, 1);
        idx.trim(7);
        assert!(idx.validate(&request(2, "t", b"a", Isolation::Snapshot)).is_ok());
        assert!(!idx.wants_trim());
    }
}
