//! Read and write transactions.
//!
//! A transaction reads one snapshot: the visible timestamp when it began, registered so the
//! collector keeps the versions it may read. A write transaction buffers its writes in a write
//! set (reads see them first: read-your-own-writes) and hands the set to group commit, which
//! validates, logs and applies it. Nothing here touches the WAL or mutates the index.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::Arc;

use crate::accounting::Ending;
use crate::commit::{CommitRequest, ReadItem, TableWrites};
use crate::cpu::MeterCell;
use crate::db::Inner;
use crate::error::{Error, Result};
use crate::index::KeyRange;
use crate::options::{Durability, Isolation, MAX_KEY_BYTES, MAX_TABLE_NAME_BYTES, MAX_VALUE_BYTES};

/// How many entries a scan copies out of the index per lock acquisition.
const SCAN_CHUNK: usize = 256;

/// The result of a successful commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitInfo {
    /// The commit timestamp. Transactions without writes report their snapshot timestamp.
    pub ts: u64,
    /// CPU time the transaction used from begin to its commit request (the group's log write
    /// and fdatasync wait are not charged; see `docs/GUARANTEES.md` on how short transactions
    /// are measured).
    pub cpu_time: std::time::Duration,
    /// Wall time from begin to the end of its commit.
    pub wall_time: std::time::Duration,
}

/// What a transaction has used so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnStats {
    /// CPU time so far (an upper bound, its wall time, while under 50 µs).
    pub cpu_time: std::time::Duration,
    /// Wall time so far.
    pub wall_time: std::time::Duration,
}

/// Accounting that rides along with a transaction and is recorded when it ends.
#[derive(Debug)]
pub(crate) struct Accounted {
    pub meter: MeterCell,
    pub tag: Option<Arc<str>>,
    pub recorded: bool,
}

impl Accounted {
    fn new(
        db: &Inner,
        tag: Option<Arc<str>>,
        budget: Option<std::time::Duration>,
        timeout: Option<std::time::Duration>,
    ) -> Accounted {
        Accounted { meter: MeterCell::new(budget, timeout, db.options.cpu_accounting), tag, recorded: false }
    }

    fn finish(&mut self, db: &Inner, ending: Ending) -> (std::time::Duration, std::time::Duration) {
        if self.recorded || !self.meter.enabled() {
            self.recorded = true;
            return (std::time::Duration::ZERO, std::time::Duration::ZERO);
        }
        self.recorded = true;
        let (cpu, wall) = self.meter.finish();
        let ending = match self.meter.tripped() {
            Some(t) => Ending::Tripped(t),
            None => ending,
        };
        db.accounting.lock().record(self.tag.as_ref(), cpu, wall, ending);
        (cpu, wall)
    }

    fn stats(&self) -> TxnStats {
        let (cpu_time, wall_time) = self.meter.finish();
        TxnStats { cpu_time, wall_time }
    }
}

/// Bounds for a range scan: an optional inclusive start, exclusive end and prefix (all must
/// hold), in forward or reverse key order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanRange {
    start: Option<Vec<u8>>,
    end: Option<Vec<u8>>,
    prefix: Option<Vec<u8>>,
    reverse: bool,
}

impl ScanRange {
    /// Every key of the table.
    pub fn all() -> Self {
        ScanRange::default()
    }
    /// Keys starting with `prefix`.
    pub fn prefix(prefix: impl Into<Vec<u8>>) -> Self {
        ScanRange { prefix: Some(prefix.into()), ..ScanRange::default() }
    }
    /// Keys `>= start`.
    pub fn start(mut self, start: impl Into<Vec<u8>>) -> Self {
        self.start = Some(start.into());
        self
    }
    /// Keys `< end`.
    pub fn end(mut self, end: impl Into<Vec<u8>>) -> Self {
        self.end = Some(end.into());
        self
    }
    /// Also require `prefix`.
    pub fn with_prefix(mut self, prefix: impl Into<Vec<u8>>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }
    /// Descending key order.
    pub fn reverse(mut self) -> Self {
        self.reverse = true;
        self
    }

    pub(crate) fn is_reverse(&self) -> bool {
        self.reverse
    }

    /// The key interval this range denotes.
    pub(crate) fn resolve(&self) -> KeyRange {
        let mut start = self.start.clone().map_or(Bound::Unbounded, Bound::Included);
        let mut end = self.end.clone().map_or(Bound::Unbounded, Bound::Excluded);
        if let Some(p) = &self.prefix {
            if self.start.as_ref().is_none_or(|s| s < p) {
                start = Bound::Included(p.clone());
            }
            if let Some(succ) = prefix_successor(p) {
                if self.end.as_ref().is_none_or(|e| *e > succ) {
                    end = Bound::Excluded(succ);
                }
            }
        }
        KeyRange { start, end }
    }
}

/// The smallest key greater than every key with this prefix, if one exists.
fn prefix_successor(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut succ = prefix.to_vec();
    while let Some(last) = succ.pop() {
        if last < 0xff {
            succ.push(last + 1);
            return Some(succ);
        }
    }
    None
}

pub(crate) fn check_table_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::InvalidArgument("table name must not be empty".into()));
    }
    if name.len() > MAX_TABLE_NAME_BYTES {
        return Err(Error::LimitExceeded { what: "table name", actual: name.len(), limit: MAX_TABLE_NAME_BYTES });
    }
    Ok(())
}

fn check_key(key: &[u8]) -> Result<()> {
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::LimitExceeded { what: "key", actual: key.len(), limit: MAX_KEY_BYTES });
    }
    Ok(())
}

/// A registered snapshot; releases itself when dropped.
#[derive(Debug)]
pub(crate) struct Snapshot {
    pub db: Arc<Inner>,
    pub ts: u64,
}

impl Snapshot {
    pub fn take(db: &Arc<Inner>) -> Result<Snapshot> {
        db.check_open()?;
        let ts = db.published().acquire();
        Ok(Snapshot { db: Arc::clone(db), ts })
    }

    fn get(&self, table: &str, key: &[u8]) -> Option<Vec<u8>> {
        let catalog = self.db.published().catalog.read();
        let t = catalog.table_at(table, self.ts)?;
        let data = t.data.read();
        data.get(key, self.ts)
    }

    fn chunk(&self, table: &str, range: &KeyRange, reverse: bool) -> (crate::index::Entries, bool) {
        let catalog = self.db.published().catalog.read();
        match catalog.table_at(table, self.ts) {
            Some(t) => t.data.read().scan_chunk(range, reverse, self.ts, SCAN_CHUNK),
            None => (Vec::new(), false),
        }
    }

    fn tables(&self) -> Vec<String> {
        self.db.published().catalog.read().names_at(self.ts)
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        self.db.published().release(self.ts);
    }
}

/// A read-only transaction over one snapshot. Never blocks writers and never aborts (unless
/// it has a CPU budget or timeout and exceeds it).
#[derive(Debug)]
pub struct ReadTxn {
    snap: Snapshot,
    acct: Accounted,
}

impl Drop for ReadTxn {
    fn drop(&mut self) {
        self.acct.finish(&self.snap.db, Ending::RolledBack);
    }
}

impl ReadTxn {
    pub(crate) fn new(
        snap: Snapshot,
        tag: Option<Arc<str>>,
        budget: Option<std::time::Duration>,
        timeout: Option<std::time::Duration>,
    ) -> Self {
        let acct = Accounted::new(&snap.db, tag, budget, timeout);
        ReadTxn { snap, acct }
    }

    /// CPU and wall time used so far.
    pub fn stats(&self) -> TxnStats {
        self.acct.stats()
    }

    /// The commit timestamp this transaction reads at.
    pub fn snapshot_ts(&self) -> u64 {
        self.snap.ts
    }

    /// The database this transaction belongs to.
    pub fn database(&self) -> crate::Database {
        crate::Database::from_inner(std::sync::Arc::clone(&self.snap.db))
    }

    /// The value of `key` in `table`, if present.
    pub fn get(&self, table: &str, key: &[u8]) -> Result<Option<Vec<u8>>> {
        check_table_name(table)?;
        check_key(key)?;
        self.acct.meter.check()?;
        Ok(self.snap.get(table, key))
    }

    /// Entries of `table` within `range`, in key order (or reverse).
    pub fn scan(&self, table: &str, range: ScanRange) -> Result<Scan<'_>> {
        check_table_name(table)?;
        self.acct.meter.check()?;
        Ok(Scan::new(&self.snap, &self.acct.meter, table, &range, Vec::new(), false))
    }

    /// Names of the tables that exist in this snapshot.
    pub fn tables(&self) -> Vec<String> {
        self.snap.tables()
    }
}

/// A read-write transaction. Dropping it without [`WriteTxn::commit`] rolls it back.
#[derive(Debug)]
pub struct WriteTxn {
    snap: Snapshot,
    durability: Durability,
    isolation: Isolation,
    tables: BTreeMap<Arc<str>, TableWrites>,
    reads: Vec<(Arc<str>, ReadItem)>,
    bytes: usize,
    acct: Accounted,
}

impl Drop for WriteTxn {
    fn drop(&mut self) {
        self.acct.finish(&self.snap.db, Ending::RolledBack);
    }
}

impl WriteTxn {
    pub(crate) fn new(
        snap: Snapshot,
        durability: Durability,
        isolation: Isolation,
        tag: Option<Arc<str>>,
        budget: Option<std::time::Duration>,
        timeout: Option<std::time::Duration>,
    ) -> Self {
        WriteTxn {
            durability,
            isolation,
            tables: BTreeMap::new(),
            reads: Vec::new(),
            bytes: 0,
            acct: Accounted::new(&snap.db, tag, budget, timeout),
            snap,
        }
    }

    /// CPU and wall time used so far.
    pub fn stats(&self) -> TxnStats {
        self.acct.stats()
    }

    /// The isolation level this transaction validates with at commit.
    pub fn isolation(&self) -> Isolation {
        self.isolation
    }

    /// Checks the budget and timeout; once either trips, the writes are discarded and every
    /// later operation (and the commit) fails the same way.
    fn meter(&mut self) -> Result<()> {
        match self.acct.meter.check() {
            Ok(()) => Ok(()),
            Err(e) => {
                self.tables.clear();
                self.reads.clear();
                Err(e)
            }
        }
    }

    /// The snapshot timestamp this transaction reads at.
    pub fn snapshot_ts(&self) -> u64 {
        self.snap.ts
    }

    /// The database this transaction belongs to.
    pub fn database(&self) -> crate::Database {
        crate::Database::from_inner(std::sync::Arc::clone(&self.snap.db))
    }

    /// The write set of `table`, created on first use (the name is allocated only then).
    fn table_entry(&mut self, table: &str) -> Result<&mut TableWrites> {
        if !self.tables.contains_key(table) {
            self.tables.insert(Arc::from(table), TableWrites::default());
        }
        self.tables
            .get_mut(table)
            .ok_or_else(|| Error::InvalidArgument(format!("table {table:?} vanished from the write set")))
    }

    fn record_read(&mut self, table: &str, item: ReadItem) {
        if self.isolation == Isolation::Serializable {
            self.reads.push((Arc::from(table), item));
        }
    }

    fn add_bytes(&mut self, n: usize) -> Result<()> {
        let limit = self.snap.db.options.max_txn_bytes;
        let total = self.bytes.saturating_add(n);
        if total > limit {
            return Err(Error::LimitExceeded { what: "transaction", actual: total, limit });
        }
        self.bytes = total;
        Ok(())
    }

    /// Sets `key` to `value` in `table` (created on first write).
    pub fn put(&mut self, table: &str, key: &[u8], value: &[u8]) -> Result<()> {
        check_table_name(table)?;
        check_key(key)?;
        self.meter()?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(Error::LimitExceeded { what: "value", actual: value.len(), limit: MAX_VALUE_BYTES });
        }
        self.add_bytes(key.len() + value.len() + 16)?;
        self.table_entry(table)?.writes.insert(key.to_vec(), Some(value.to_vec()));
        Ok(())
    }

    /// Deletes `key` from `table` (no error if absent).
    pub fn delete(&mut self, table: &str, key: &[u8]) -> Result<()> {
        check_table_name(table)?;
        check_key(key)?;
        self.meter()?;
        self.add_bytes(key.len() + 16)?;
        self.table_entry(table)?.writes.insert(key.to_vec(), None);
        Ok(())
    }

    /// Drops `table` with all its keys. Returns whether it existed in this transaction's view.
    /// Later writes in this transaction create it anew.
    pub fn drop_table(&mut self, table: &str) -> Result<bool> {
        check_table_name(table)?;
        self.meter()?;
        let existed_before = self.snap.tables().iter().any(|t| t == table);
        let entry = self.table_entry(table)?;
        let has_writes = entry.writes.values().any(Option::is_some);
        let existed = has_writes || (existed_before && !entry.dropped);
        entry.dropped = entry.dropped || existed_before;
        entry.writes.clear();
        Ok(existed)
    }

    /// The value of `key`, seeing this transaction's own writes.
    pub fn get(&mut self, table: &str, key: &[u8]) -> Result<Option<Vec<u8>>> {
        check_table_name(table)?;
        check_key(key)?;
        self.meter()?;
        if let Some(tw) = self.tables.get(table) {
            if let Some(w) = tw.writes.get(key) {
                return Ok(w.clone());
            }
            if tw.dropped {
                return Ok(None);
            }
        }
        self.record_read(table, ReadItem::Key(key.to_vec()));
        Ok(self.snap.get(table, key))
    }

    /// Entries within `range`, merging this transaction's writes over its snapshot.
    pub fn scan(&mut self, table: &str, range: ScanRange) -> Result<Scan<'_>> {
        check_table_name(table)?;
        self.meter()?;
        let resolved = range.resolve();
        let (overlay, hide_base) = match self.tables.get(table) {
            Some(tw) => {
                let mut items: Vec<(Vec<u8>, Option<Vec<u8>>)> = if resolved.is_empty() {
                    Vec::new()
                } else {
                    tw.writes
                        .range::<Vec<u8>, _>((resolved.start.clone(), resolved.end.clone()))
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect()
                };
                if range.is_reverse() {
                    items.reverse();
                }
                (items, tw.dropped)
            }
            None => (Vec::new(), false),
        };
        if !hide_base {
            self.record_read(table, ReadItem::Range(resolved));
        }
        Ok(Scan::new(&self.snap, &self.acct.meter, table, &range, overlay, hide_base))
    }

    /// Tables visible to this transaction, including ones it created and excluding dropped ones.
    pub fn tables(&self) -> Vec<String> {
        let mut names: Vec<String> = self.snap.tables();
        for (name, tw) in self.tables.iter().filter(|(n, _)| !crate::types::is_reserved(n)) {
            let has_writes = tw.writes.values().any(Option::is_some);
            if tw.dropped && !has_writes {
                names.retain(|n| n.as_str() != &**name);
            } else if has_writes && !names.iter().any(|n| n.as_str() == &**name) {
                names.push(name.to_string());
            }
        }
        names.sort();
        names
    }

    /// Whether the transaction has buffered any write.
    pub fn is_dirty(&self) -> bool {
        self.tables.values().any(|t| t.dropped || !t.writes.is_empty())
    }

    /// Commits. Returns the commit timestamp, or `Conflict` (nothing written; retry), or an
    /// error that says why the commit could not be made durable. A transaction stopped by its
    /// CPU budget or timeout fails here too, with nothing written.
    pub fn commit(mut self) -> Result<CommitInfo> {
        if let Some(t) = self.acct.meter.tripped() {
            return Err(t.error());
        }
        self.acct.meter.check()?;
        let tables = std::mem::take(&mut self.tables);
        let reads = std::mem::take(&mut self.reads);
        let dirty = tables.values().any(|t| t.dropped || !t.writes.is_empty());
        let request = CommitRequest {
            start_ts: self.snap.ts,
            durability: self.durability,
            isolation: self.isolation,
            tables,
            reads,
        };
        self.acct.meter.freeze();
        let result = if dirty {
            self.snap.db.committer.submit(request)
        } else {
            // Nothing to log. A serializable reader still checks that what it read is unchanged.
            self.snap.db.check_open().and_then(|()| {
                if self.isolation == Isolation::Serializable && !request.reads.is_empty() {
                    self.snap.db.committer.validate_read_only(&request)?;
                }
                Ok(self.snap.ts)
            })
        };
        let ending = if result.is_ok() { Ending::Committed } else { Ending::RolledBack };
        let (cpu_time, wall_time) = self.acct.finish(&self.snap.db, ending);
        result.map(|ts| CommitInfo { ts, cpu_time, wall_time })
    }

    /// Discards the transaction's writes.
    pub fn rollback(self) {}
}

/// An iterator over `(key, value)` pairs of a range, copying a chunk at a time out of the index
/// so that a long-lived iterator never holds a lock.
pub struct Scan<'a> {
    snap: &'a Snapshot,
    meter: &'a MeterCell,
    table: String,
    range: KeyRange,
    reverse: bool,
    base: VecDeque<(Vec<u8>, Vec<u8>)>,
    base_more: bool,
    overlay: VecDeque<(Vec<u8>, Option<Vec<u8>>)>,
    /// Set after an error was returned: the iteration is over.
    failed: bool,
}

impl std::fmt::Debug for Scan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scan").field("table", &self.table).field("reverse", &self.reverse).finish()
    }
}

impl<'a> Scan<'a> {
    fn new(
        snap: &'a Snapshot,
        meter: &'a MeterCell,
        table: &str,
        range: &ScanRange,
        overlay: Vec<(Vec<u8>, Option<Vec<u8>>)>,
        hide_base: bool,
    ) -> Self {
        let resolved = range.resolve();
        let base_more = !hide_base && !resolved.is_empty();
        Scan {
            snap,
            meter,
            table: table.to_owned(),
            range: resolved,
            reverse: range.is_reverse(),
            base: VecDeque::new(),
            base_more,
            overlay: overlay.into(),
            failed: false,
        }
    }

    fn refill(&mut self) {
        if !self.base.is_empty() || !self.base_more {
            return;
        }
        let (entries, more) = self.snap.chunk(&self.table, &self.range, self.reverse);
        if let Some((last, _)) = entries.last() {
            if self.reverse {
                self.range.end = Bound::Excluded(last.clone());
            } else {
                self.range.start = Bound::Excluded(last.clone());
            }
        }
        self.base_more = more && !entries.is_empty();
        self.base = entries.into();
    }

    /// Whether `a` comes before `b` in this scan's order.
    fn before(&self, a: &[u8], b: &[u8]) -> bool {
        if self.reverse {
            a > b
        } else {
            a < b
        }
    }
}

impl Iterator for Scan<'_> {
    type Item = Result<(Vec<u8>, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        if let Err(e) = self.meter.check() {
            // The transaction is over: report it once, then end the iteration.
            self.failed = true;
            return Some(Err(e));
        }
        loop {
            self.refill();
            let take_overlay = match (self.base.front(), self.overlay.front()) {
                (None, None) => return None,
                (Some(_), None) => false,
                (None, Some(_)) => true,
                (Some((bk, _)), Some((ok, _))) => {
                    if bk == ok {
                        self.base.pop_front(); // The transaction's own write shadows the snapshot.
                        true
                    } else {
                        !self.before(bk, ok)
                    }
                }
            };
            if take_overlay {
                let (k, v) = self.overlay.pop_front()?;
                match v {
                    Some(v) => return Some(Ok((k, v))),
                    None => continue, // Deleted by this transaction.
                }
            }
            return self.base.pop_front().map(Ok);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_successor_handles_ff() {
        assert_eq!(prefix_successor(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(prefix_successor(&[0x61, 0xff]), Some(vec![0x62]));
        assert_eq!(prefix_successor(&[0xff, 0xff]), None);
        assert_eq!(prefix_successor(b""), None);
    }

    #[test]
    fn prefix_intersects_with_bounds() {
        let r = ScanRange::prefix(b"user:".to_vec()).start(b"user:m".to_vec()).resolve();
        assert!(r.contains(b"user:z"));
        assert!(!r.contains(b"user:a"));
        assert!(!r.contains(b"uses"));
        let r = ScanRange::prefix(b"b".to_vec()).end(b"a".to_vec()).resolve();
        assert!(r.is_empty());
    }
}
