//! The reference model: what the database must contain, computed without the engine.
//!
//! [`Model`] is a map of tables to `BTreeMap`s with the engine's table semantics (a table
//! exists from its first put until it is dropped, even when empty). [`WriteSet`] mirrors one
//! transaction's buffered writes. [`History`] records, since a known recovered state, the
//! acknowledged commits, the failed ones whose fate is unknown, and the newest timestamp a
//! crash must not lose; [`History::check`] decides whether a recovered database is a legal
//! outcome. [`ConflictModel`] predicts first-committer-wins conflicts. Nothing here does I/O.

use std::collections::{BTreeMap, BTreeSet};

use keeldb::{Database, ScanRange, StateDigest};

/// One table's part of a write set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableWrite {
    /// The transaction dropped the table as it was in its snapshot.
    pub dropped: bool,
    /// Key to new value (`None` deletes).
    pub writes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
}

/// A transaction's writes, with the same merging rules as the engine's write set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteSet {
    /// Per table name.
    pub tables: BTreeMap<String, TableWrite>,
}

impl WriteSet {
    /// Records a put.
    pub fn put(&mut self, table: &str, key: &[u8], value: &[u8]) {
        self.tables.entry(table.to_owned()).or_default().writes.insert(key.to_vec(), Some(value.to_vec()));
    }

    /// Records a delete.
    pub fn delete(&mut self, table: &str, key: &[u8]) {
        self.tables.entry(table.to_owned()).or_default().writes.insert(key.to_vec(), None);
    }

    /// Records a drop of `table`; `in_snapshot` says whether the table existed in the
    /// transaction's snapshot (only then does the engine drop anything).
    pub fn drop_table(&mut self, table: &str, in_snapshot: bool) {
        let tw = self.tables.entry(table.to_owned()).or_default();
        tw.dropped = tw.dropped || in_snapshot;
        tw.writes.clear();
    }

    /// Whether committing would write a WAL record (and take a timestamp).
    pub fn is_dirty(&self) -> bool {
        self.tables.values().any(|t| t.dropped || !t.writes.is_empty())
    }
}

/// The expected contents of a database.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Model {
    tables: BTreeMap<String, BTreeMap<Vec<u8>, Vec<u8>>>,
}

impl Model {
    /// Applies a committed write set, with the engine's rules for drops and table creation.
    pub fn apply(&mut self, ws: &WriteSet) {
        for (name, tw) in &ws.tables {
            if tw.dropped {
                self.tables.remove(name);
            }
            let has_puts = tw.writes.values().any(Option::is_some);
            if !self.tables.contains_key(name) && !has_puts {
                continue;
            }
            let table = self.tables.entry(name.clone()).or_default();
            for (k, v) in &tw.writes {
                match v {
                    Some(v) => {
                        table.insert(k.clone(), v.clone());
                    }
                    None => {
                        table.remove(k);
                    }
                }
            }
        }
    }

    /// The value of `key` in `table`.
    pub fn get(&self, table: &str, key: &[u8]) -> Option<&Vec<u8>> {
        self.tables.get(table)?.get(key)
    }

    /// Whether `table` exists.
    pub fn has_table(&self, table: &str) -> bool {
        self.tables.contains_key(table)
    }

    /// Names of existing tables, sorted.
    pub fn table_names(&self) -> Vec<String> {
        self.tables.keys().cloned().collect()
    }

    /// Number of live entries.
    pub fn len(&self) -> usize {
        self.tables.values().map(BTreeMap::len).sum()
    }

    /// Whether there are no live entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The state digest the engine must report for this content.
    pub fn digest(&self) -> StateDigest {
        let mut d = StateDigest::default();
        for (t, kv) in &self.tables {
            for (k, v) in kv {
                d.add(t, k, v);
            }
        }
        d
    }

    /// Compares the database's newest visible state with the model: table list, every entry
    /// of every table, and the maintained state digest. Returns a description of the first
    /// differences.
    pub fn compare(&self, db: &Database) -> Result<(), String> {
        let rx = db.begin_read().map_err(|e| format!("begin_read failed: {e}"))?;
        let mut names = rx.tables();
        names.sort();
        if names != self.table_names() {
            return Err(format!("tables differ: database has {names:?}, model has {:?}", self.table_names()));
        }
        for name in &names {
            let mut got = BTreeMap::new();
            for item in rx.scan(name, ScanRange::all()).map_err(|e| format!("scan {name} failed: {e}"))? {
                let (k, v) = item.map_err(|e| format!("scan {name} failed: {e}"))?;
                got.insert(k, v);
            }
            let empty = BTreeMap::new();
            let want = self.tables.get(name).unwrap_or(&empty);
            if &got != want {
                return Err(format!("table {name:?} differs: {}", diff(want, &got)));
            }
        }
        let digest = db.digest();
        if digest != self.digest() {
            return Err(format!("state digest {digest} differs from the model's {}", self.digest()));
        }
        Ok(())
    }
}

fn show(k: &[u8]) -> String {
    String::from_utf8_lossy(k.get(..k.len().min(24)).unwrap_or_default()).into_owned()
}

fn diff(want: &BTreeMap<Vec<u8>, Vec<u8>>, got: &BTreeMap<Vec<u8>, Vec<u8>>) -> String {
    let mut out = Vec::new();
    for (k, v) in want {
        match got.get(k) {
            None => out.push(format!("missing {}", show(k))),
            Some(g) if g != v => {
                out.push(format!("{} has a wrong value ({} bytes, want {})", show(k), g.len(), v.len()))
            }
            Some(_) => {}
        }
    }
    for k in got.keys().filter(|k| !want.contains_key(*k)) {
        out.push(format!("unexpected {}", show(k)));
    }
    let n = out.len();
    out.truncate(6);
    format!("{} difference(s): {}", n, out.join(", "))
}

/// Commits since a known state, and what a crash may and may not take away.
#[derive(Debug, Clone, Default)]
pub struct History {
    base: Model,
    base_ts: u64,
    acked: Vec<(u64, WriteSet)>,
    maybe: Vec<WriteSet>,
    required_ts: u64,
    latest: Model,
}

impl History {
    /// A history starting from `base`, the state at commit timestamp `base_ts`.
    pub fn new(base: Model, base_ts: u64) -> History {
        History { latest: base.clone(), base, base_ts, acked: Vec::new(), maybe: Vec::new(), required_ts: base_ts }
    }

    /// Records an acknowledged commit. Timestamps of a single committer are dense: returns an
    /// error if `ts` is not the next one.
    pub fn acked(&mut self, ts: u64, ws: WriteSet) -> Result<(), String> {
        if !self.maybe.is_empty() {
            return Err(format!("commit ts {ts} acknowledged after an earlier commit failed"));
        }
        let expect = self.last_acked_ts() + 1;
        if ts != expect {
            return Err(format!("commit acknowledged with ts {ts}, expected {expect}"));
        }
        self.latest.apply(&ws);
        self.acked.push((ts, ws));
        Ok(())
    }

    /// Records a commit that returned an error other than a conflict: it may or may not have
    /// reached the log, and takes the next timestamp if it did.
    pub fn failed(&mut self, ws: WriteSet) {
        self.maybe.push(ws);
    }

    /// Everything through `ts` must survive a crash from now on.
    pub fn require(&mut self, ts: u64) {
        self.required_ts = self.required_ts.max(ts);
    }

    /// Every acknowledged commit must survive (a clean close, a process crash).
    pub fn require_all(&mut self) {
        self.require(self.last_acked_ts());
    }

    /// The newest acknowledged timestamp.
    pub fn last_acked_ts(&self) -> u64 {
        self.acked.last().map_or(self.base_ts, |(ts, _)| *ts)
    }

    /// The newest timestamp that must survive.
    pub fn required_ts(&self) -> u64 {
        self.required_ts
    }

    /// Failed commits of unknown fate.
    pub fn maybe_count(&self) -> usize {
        self.maybe.len()
    }

    /// The state after every acknowledged commit (what readers must see now).
    pub fn latest(&self) -> &Model {
        &self.latest
    }

    /// The state after every commit through `ts`, if `ts` is a possible outcome.
    pub fn state_at(&self, ts: u64) -> Option<Model> {
        let last = self.last_acked_ts();
        if ts < self.base_ts || ts > last + self.maybe.len() as u64 {
            return None;
        }
        let mut m = self.base.clone();
        for (_, ws) in self.acked.iter().take_while(|(t, _)| *t <= ts) {
            m.apply(ws);
        }
        for ws in self.maybe.iter().take(ts.saturating_sub(last) as usize) {
            m.apply(ws);
        }
        Some(m)
    }

    /// Checks a database recovered after a crash: it must hold exactly the state after a
    /// prefix of the history that includes every commit that had to survive. Returns that
    /// state and its timestamp.
    pub fn check(&self, db: &Database) -> Result<(Model, u64), String> {
        let ts = db.begin_read().map_err(|e| format!("begin_read failed: {e}"))?.snapshot_ts();
        if ts < self.required_ts {
            return Err(format!(
                "acknowledged commits lost: recovered through ts {ts}, but ts {} had to survive (last acknowledged {})",
                self.required_ts,
                self.last_acked_ts()
            ));
        }
        let state = self.state_at(ts).ok_or_else(|| {
            format!(
                "recovered through ts {ts}, beyond anything committed (base {}, last acknowledged {}, {} failed)",
                self.base_ts,
                self.last_acked_ts(),
                self.maybe.len()
            )
        })?;
        state.compare(db).map_err(|e| format!("recovered state at ts {ts} is not the prefix of the history: {e}"))?;
        Ok((state, ts))
    }
}

/// Predicts write-write conflicts under snapshot isolation (first committer wins).
#[derive(Debug, Clone, Default)]
pub struct ConflictModel {
    last_write: BTreeMap<(String, Vec<u8>), u64>,
    last_drop: BTreeMap<String, u64>,
}

impl ConflictModel {
    /// Whether a transaction that started at `start_ts` with these writes must fail.
    pub fn conflicts(&self, ws: &WriteSet, start_ts: u64) -> bool {
        ws.tables.iter().any(|(name, tw)| {
            let newer = |ts: &u64| *ts > start_ts;
            self.last_drop.get(name).is_some_and(newer)
                || (tw.dropped && self.last_write.iter().any(|((t, _), ts)| t == name && newer(ts)))
                || tw.writes.keys().any(|k| self.last_write.get(&(name.clone(), k.clone())).is_some_and(newer))
        })
    }

    /// Records a successful (or possibly logged) commit at `ts`.
    pub fn record(&mut self, ws: &WriteSet, ts: u64) {
        for (name, tw) in &ws.tables {
            if tw.dropped {
                self.last_drop.insert(name.clone(), ts);
            }
            for k in tw.writes.keys() {
                self.last_write.insert((name.clone(), k.clone()), ts);
            }
        }
    }

    /// Forgets everything (after a reopen no old transaction survives).
    pub fn reset(&mut self) {
        self.last_write.clear();
        self.last_drop.clear();
    }

    /// Tables touched by the model so far (for diagnostics).
    pub fn tables(&self) -> BTreeSet<String> {
        self.last_drop.keys().cloned().chain(self.last_write.keys().map(|(t, _)| t.clone())).collect()
    }
}
