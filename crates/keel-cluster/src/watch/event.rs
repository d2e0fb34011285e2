//! Watch events from the engine's change feed: one engine commit that took a revision becomes
//! one [`Batch`] of events, decoded once and shared (behind an `Arc`) by every watcher it goes
//! to.
//!
//! Reads only the in-memory change feed (and, for `prev_kv`, an engine snapshot just before the
//! commit); never the WAL.

use std::sync::{Arc, OnceLock};

use etcd_client::proto::{PbEvent, PbKeyValue};
use keeldb::Database;
use keeldb::{Change, ChangeKind};

use crate::mvcc::{self, Record, META, REV_KEY};

/// One put or delete of one key at a revision.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub put: bool,
    /// For a delete: the key and the deleting revision only (as etcd).
    pub kv: PbKeyValue,
}

/// The events of one revision (one engine commit), in the order the commit wrote the keys.
#[derive(Debug)]
pub struct Batch {
    pub revision: i64,
    pub ts: u64,
    pub events: Vec<Event>,
    /// Each event's previous key-value, read once on first use (only `prev_kv` watchers ask).
    prev: OnceLock<Vec<Option<PbKeyValue>>>,
}

/// One engine commit in the feed: its timestamp and, if it took a revision, its events.
#[derive(Debug)]
pub struct Commit {
    pub ts: u64,
    pub batch: Option<Arc<Batch>>,
}

impl Batch {
    pub fn new(revision: i64, ts: u64, events: Vec<Event>) -> Batch {
        Batch { revision, ts, events, prev: OnceLock::new() }
    }

    /// The previous key-value of each event: the key as the commit before this one left it.
    /// A put that created the key (version 1) has none. When that state is no longer readable
    /// (history compacted meanwhile) the events carry none, as etcd does for a compacted
    /// previous version.
    pub fn prev_kvs(&self, db: &Database) -> &[Option<PbKeyValue>] {
        self.prev.get_or_init(|| {
            let needed = self.events.iter().any(|e| !e.put || e.kv.version > 1);
            let snapshot = if needed { db.begin_read_at(self.ts.saturating_sub(1)).ok() } else { None };
            let Some(mut txn) = snapshot else { return vec![None; self.events.len()] };
            self.events
                .iter()
                .map(|e| {
                    if e.put && e.kv.version <= 1 {
                        return None;
                    }
                    match mvcc::View::get_raw(&mut txn, &e.kv.key) {
                        Ok(Some(bytes)) => Record::decode(&bytes).ok().map(|r| to_kv(&e.kv.key, r)),
                        _ => None,
                    }
                })
                .collect()
        })
    }

    /// The wire form of event `i`, with its previous key-value if `prev` is given.
    pub fn to_pb(&self, i: usize, prev: Option<&[Option<PbKeyValue>]>) -> Option<PbEvent> {
        let e = self.events.get(i)?;
        Some(PbEvent {
            r#type: if e.put { 0 } else { 1 },
            kv: Some(e.kv.clone()),
            prev_kv: prev.and_then(|p| p.get(i).cloned().flatten()),
        })
    }
}

fn to_kv(key: &[u8], r: Record) -> PbKeyValue {
    PbKeyValue {
        key: key.to_vec(),
        create_revision: r.create_revision,
        mod_revision: r.mod_revision,
        version: r.version,
        value: r.value,
        lease: r.lease,
    }
}

/// Why the feed could not be turned into events.
#[derive(Debug, thiserror::Error)]
#[error("keel: undecodable change in the feed at ts {ts}: {why}")]
pub struct DecodeError {
    pub ts: u64,
    pub why: String,
}

/// Groups feed changes (whole commits, in commit order) into commits and decodes the ones that
/// took a revision: a commit's `meta/rev` put names its revision; its `kv` puts are PUT events
/// (the row is an [`mvcc::Record`]) and its `kv` deletes DELETE events. A commit without a
/// `meta/rev` put (membership, published members, a failed request, a compaction) has none.
pub fn decode(changes: Vec<Change>) -> Result<Vec<Commit>, DecodeError> {
    let mut out: Vec<Commit> = Vec::new();
    let mut revision: Option<i64> = None;
    let mut events: Vec<Event> = Vec::new();
    let mut current: Option<u64> = None;
    let mut finish = |ts: u64, revision: &mut Option<i64>, events: &mut Vec<Event>| -> Result<(), DecodeError> {
        let batch = match revision.take() {
            Some(rev) => Some(Arc::new(Batch::new(rev, ts, std::mem::take(events)))),
            None if events.is_empty() => None,
            None => return Err(DecodeError { ts, why: "kv rows changed without a revision".into() }),
        };
        out.push(Commit { ts, batch });
        Ok(())
    };
    for c in changes {
        if current.is_some_and(|ts| ts != c.ts) {
            if let Some(ts) = current {
                finish(ts, &mut revision, &mut events)?;
            }
        }
        current = Some(c.ts);
        match (&*c.table, c.kind) {
            (mvcc::KV, ChangeKind::Put(v)) => {
                let r = Record::decode(&v).map_err(|e| DecodeError { ts: c.ts, why: e.to_string() })?;
                events.push(Event { put: true, kv: to_kv(&c.key, r) });
            }
            (mvcc::KV, ChangeKind::Delete) => {
                events.push(Event { put: false, kv: PbKeyValue { key: c.key, ..PbKeyValue::default() } });
            }
            (META, ChangeKind::Put(v)) if c.key == REV_KEY => {
                let rev: i64 = bincode::deserialize(&v).map_err(|e| DecodeError { ts: c.ts, why: e.to_string() })?;
                revision = Some(rev);
            }
            (mvcc::KV, ChangeKind::DropTable) => {
                return Err(DecodeError { ts: c.ts, why: "the kv table was dropped".into() });
            }
            _ => {}
        }
    }
    if let Some(ts) = current {
        finish(ts, &mut revision, &mut events)?;
    }
    // A delete carries the deleting revision (known only once the commit's `meta/rev` is seen).
    for commit in &mut out {
        if let Some(batch) = commit.batch.as_mut().and_then(Arc::get_mut) {
            let rev = batch.revision;
            for e in batch.events.iter_mut().filter(|e| !e.put) {
                e.kv.mod_revision = rev;
            }
        }
    }
    Ok(out)
}

/// Whole commits after `after`, about `max` changes at most (more when one commit alone is
/// bigger: the feed then returns part of it, so ask again for more until it is whole).
pub fn read_commits(db: &Database, after: u64, max: usize) -> keeldb::Result<Vec<Change>> {
    let mut max = max.max(1);
    loop {
        let changes = db.changes_since(after, max)?;
        let one_commit = changes.first().map(|c| c.ts) == changes.last().map(|c| c.ts);
        if changes.len() < max || !one_commit {
            return Ok(changes);
        }
        max = max.saturating_mul(2);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;

    fn change(ts: u64, table: &str, key: &[u8], kind: ChangeKind) -> Change {
        Change { ts, table: Arc::from(table), key: key.to_vec(), kind }
    }

    fn record(create: i64, rev: i64, version: i64, value: &[u8]) -> Vec<u8> {
        Record { create_revision: create, mod_revision: rev, version, lease: 9, value: value.to_vec() }.encode()
    }

    #[test]
    fn one_commit_is_one_revision_of_events_and_commits_without_a_revision_have_none() {
        let rev = |r: i64| ChangeKind::Put(bincode::serialize(&r).unwrap());
        let changes = vec![
            change(5, mvcc::KV, b"a", ChangeKind::Put(record(3, 7, 2, b"x"))),
            change(5, mvcc::KV, b"b", ChangeKind::Delete),
            change(5, META, b"applied", ChangeKind::Put(vec![1, 2, 3])),
            change(5, META, REV_KEY, rev(7)),
            // Published member attributes: no revision, no events.
            change(6, "members", b"\0\0\0\0\0\0\0\x01", ChangeKind::Put(vec![0])),
            change(6, META, b"applied", ChangeKind::Put(vec![4])),
            change(8, mvcc::KV, b"c", ChangeKind::Put(record(8, 8, 1, b""))),
            change(8, META, REV_KEY, rev(8)),
        ];
        let commits = decode(changes).unwrap();
        assert_eq!(commits.iter().map(|c| c.ts).collect::<Vec<_>>(), [5, 6, 8]);
        assert!(commits[1].batch.is_none());
        let b = commits[0].batch.as_ref().unwrap();
        assert_eq!(b.revision, 7);
        assert_eq!(b.events.len(), 2);
        let put = &b.events[0];
        assert!(put.put);
        assert_eq!((put.kv.key.as_slice(), put.kv.value.as_slice()), (&b"a"[..], &b"x"[..]));
        assert_eq!((put.kv.create_revision, put.kv.mod_revision, put.kv.version, put.kv.lease), (3, 7, 2, 9));
        // A delete names its key and the deleting revision only.
        let gone = &b.events[1];
        assert!(!gone.put);
        assert_eq!(gone.kv, PbKeyValue { key: b"b".to_vec(), mod_revision: 7, ..PbKeyValue::default() });
        let pb = b.to_pb(1, None).unwrap();
        assert_eq!(pb.r#type, 1);
        assert_eq!(commits[2].batch.as_ref().unwrap().events[0].kv.version, 1);
    }

    #[test]
    fn kv_rows_without_a_revision_or_a_short_record_are_errors_not_events() {
        let orphan = vec![change(5, mvcc::KV, b"a", ChangeKind::Put(record(1, 1, 1, b"x")))];
        assert!(decode(orphan).is_err());
        let short = vec![change(5, mvcc::KV, b"a", ChangeKind::Put(vec![1, 2]))];
        assert!(decode(short).is_err());
    }
}
