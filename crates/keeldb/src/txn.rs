//! Read and write transactions.
//!
//! A transaction reads one snapshot: the visible timestamp when it began, registered so the
//! collector keeps the versions it may read. A write transaction buffers its writes in a write
//! set (reads see them first: read-your-own-writes) and hands the set to group commit, which
//! validates, logs and applies it. Nothing here touches the WAL or mutates the index.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use crate::accounting::Ending;
use crate::commit::{AsyncCommit, CommitRequest, ReadItem, TableSet, TableWrites};
use crate::cpu::MeterCell;
use crate::db::Inner;
use crate::error::{Error, Result};
use crate::index::{KeyRange, Table};
use crate::options::{Durability, Isolation, MAX_KEY_BYTES, MAX_TABLE_NAME_BYTES, MAX_VALUE_BYTES};
pub use crate::scan::{Scan, ScanRange};
use crate::types::LogPosition;

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
    /// Nothing to measure or record: what a transaction keeps after handing its accounting on.
    fn handed_on() -> Accounted {
        Accounted { meter: MeterCell::new(None, None, false), tag: None, recorded: true }
    }

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

pub(crate) fn check_table_name(name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::InvalidArgument("table name must not be empty".into()));
    }
    if name.len() > MAX_TABLE_NAME_BYTES {
        return Err(Error::LimitExceeded { what: "table name", actual: name.len(), limit: MAX_TABLE_NAME_BYTES });
    }
    Ok(())
}

/// A table name the public write API accepts: valid, and not the engine's own.
fn check_public_table(name: &str) -> Result<()> {
    check_table_name(name)?;
    if name.starts_with(crate::types::RESERVED_TABLE_PREFIX) {
        return Err(Error::ReservedTable(name.to_owned()));
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
    /// The first table this snapshot found by name, kept so that later reads of it skip the
    /// catalog (its lock and a hash of the name). Which table a name means at `ts` never
    /// changes: a table created or dropped later does so at a timestamp above every visible
    /// one, so above `ts`; a state replacement ends the old tables at a new timestamp too;
    /// and the collector frees only tables dropped below the horizon, which this snapshot
    /// holds at or below `ts`.
    table: OnceLock<Arc<Table>>,
}

impl Snapshot {
    pub fn take(db: &Arc<Inner>) -> Result<Snapshot> {
        db.check_open()?;
        let ts = db.published().acquire();
        Ok(Snapshot::new(db, ts))
    }

    fn new(db: &Arc<Inner>, ts: u64) -> Snapshot {
        Snapshot { db: Arc::clone(db), ts, table: OnceLock::new() }
    }

    /// A snapshot at a past (or the current) commit timestamp, refused below the horizon.
    pub fn take_at(db: &Arc<Inner>, ts: u64) -> Result<Snapshot> {
        db.check_open()?;
        let view = db.published();
        let ts = view.registry.acquire_at(ts, &view.visible_ts).map_err(|e| crate::db::at_error(ts, e))?;
        Ok(Snapshot::new(db, ts))
    }

    /// Calls `f` with the table `name` means at this snapshot, if it exists there.
    fn with_table<R>(&self, name: &str, f: impl FnOnce(&Table) -> R) -> Option<R> {
        if let Some(t) = self.table.get() {
            if *t.name == *name {
                return Some(f(t));
            }
        }
        let catalog = self.db.published().catalog.read();
        let t = catalog.table_at(name, self.ts)?;
        // Only the first table found is kept; a snapshot reading several looks the rest up.
        if self.table.get().is_none() {
            let _ = self.table.set(Arc::clone(t));
        }
        Some(f(t))
    }

    fn get(&self, table: &str, key: &[u8]) -> Option<Vec<u8>> {
        self.with_table(table, |t| t.data.read().get(key, self.ts))?
    }

    fn get_many<K: AsRef<[u8]>>(&self, table: &str, keys: &[K]) -> Vec<Option<Vec<u8>>> {
        let mut out = Vec::new();
        if self.with_table(table, |t| t.data.read().get_many(keys, self.ts, &mut out)).is_none() {
            out.resize(keys.len(), None);
        }
        out
    }

    fn get_into(&self, table: &str, key: &[u8], out: &mut Vec<u8>) -> bool {
        match self.with_table(table, |t| t.data.read().get_into(key, self.ts, out)) {
            Some(found) => found,
            None => {
                out.clear();
                false
            }
        }
    }

    pub(crate) fn chunk(&self, table: &str, range: &KeyRange, reverse: bool) -> (crate::index::Entries, bool) {
        self.with_table(table, |t| t.data.read().scan_chunk(range, reverse, self.ts, crate::scan::SCAN_CHUNK))
            .unwrap_or_default()
    }

    fn tables(&self) -> Vec<String> {
        self.db.published().catalog.read().names_at(self.ts)
    }
}

impl Snapshot {
    /// A second registration of the same snapshot, released on its own.
    fn pin(&self) -> Snapshot {
        self.db.published().registry.pin(self.ts);
        Snapshot::new(&self.db, self.ts)
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

    /// [`ReadTxn::get`] into a buffer the caller keeps: on `Ok(true)` `out` holds exactly the
    /// value; on `Ok(false)` (no such key or table) it is empty; on an error it is unchanged.
    /// Reusing one buffer across reads spares an allocation and a free per read.
    pub fn get_into(&self, table: &str, key: &[u8], out: &mut Vec<u8>) -> Result<bool> {
        check_table_name(table)?;
        check_key(key)?;
        self.acct.meter.check()?;
        Ok(self.snap.get_into(table, key, out))
    }

    /// The values of `keys` in `table`, in the order of `keys` (`None` where absent). On a
    /// large table this is several times faster per key than as many [`ReadTxn::get`] calls:
    /// the keys' cache misses overlap (see `TableData::get_many`). The table is locked for
    /// reading once per call, so split very long lists to let writers in between. Any key
    /// over the size limit refuses the whole call before anything is read.
    pub fn get_many<K: AsRef<[u8]>>(&self, table: &str, keys: &[K]) -> Result<Vec<Option<Vec<u8>>>> {
        check_table_name(table)?;
        for key in keys {
            check_key(key.as_ref())?;
        }
        self.acct.meter.check()?;
        Ok(self.snap.get_many(table, keys))
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
    tables: TableSet,
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
            tables: TableSet::default(),
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
        self.tables
            .entry(table, || Arc::from(table))
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

    /// Sets `key` to `value` in `table` (created on first write). Tables under
    /// [`RESERVED_TABLE_PREFIX`](crate::RESERVED_TABLE_PREFIX) are refused with
    /// [`Error::ReservedTable`].
    pub fn put(&mut self, table: &str, key: &[u8], value: &[u8]) -> Result<()> {
        check_public_table(table)?;
        self.put_internal(table, key, value)
    }

    /// `put` without the reserved-table check: for the engine's own tables (ids, graphs).
    pub(crate) fn put_internal(&mut self, table: &str, key: &[u8], value: &[u8]) -> Result<()> {
        check_table_name(table)?;
        check_key(key)?;
        self.meter()?;
        if value.len() > MAX_VALUE_BYTES {
            return Err(Error::LimitExceeded { what: "value", actual: value.len(), limit: MAX_VALUE_BYTES });
        }
        self.add_bytes(key.len() + value.len() + 16)?;
        self.table_entry(table)?.writes.insert(key, Some(value));
        Ok(())
    }

    /// Deletes `key` from `table` (no error if absent). Refuses reserved tables.
    pub fn delete(&mut self, table: &str, key: &[u8]) -> Result<()> {
        check_public_table(table)?;
        self.delete_internal(table, key)
    }

    /// `delete` without the reserved-table check: for the engine's own tables.
    pub(crate) fn delete_internal(&mut self, table: &str, key: &[u8]) -> Result<()> {
        check_table_name(table)?;
        check_key(key)?;
        self.meter()?;
        self.add_bytes(key.len() + 16)?;
        self.table_entry(table)?.writes.insert(key, None);
        Ok(())
    }

    /// Drops `table` with all its keys. Returns whether it existed in this transaction's view.
    /// Later writes in this transaction create it anew.
    /// Reserved tables are refused.
    pub fn drop_table(&mut self, table: &str) -> Result<bool> {
        check_public_table(table)?;
        self.meter()?;
        let existed_before = self.snap.tables().iter().any(|t| t == table);
        let entry = self.table_entry(table)?;
        let has_writes = entry.writes.values().any(|v| v.is_some());
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
                return Ok(w.map(<[u8]>::to_vec));
            }
            if tw.dropped {
                return Ok(None);
            }
        }
        self.record_read(table, ReadItem::Key(key.to_vec()));
        Ok(self.snap.get(table, key))
    }

    /// The values of `keys` in `table`, in the order of `keys` (`None` where absent), seeing
    /// this transaction's own writes: as many [`WriteTxn::get`] calls, but the keys this
    /// transaction has not written are looked up in the snapshot in one batched call
    /// ([`ReadTxn::get_many`]), whose cache misses overlap. Under serializable isolation each
    /// key read from the snapshot is validated at commit, as `get` does. Any key over the size
    /// limit refuses the whole call before anything is read.
    pub fn get_many<K: AsRef<[u8]>>(&mut self, table: &str, keys: &[K]) -> Result<Vec<Option<Vec<u8>>>> {
        check_table_name(table)?;
        for key in keys {
            check_key(key.as_ref())?;
        }
        self.meter()?;
        let mut out: Vec<Option<Vec<u8>>> = Vec::with_capacity(keys.len());
        // Positions in `out` still to be read from the snapshot, and their keys.
        let mut pending: Vec<(usize, &[u8])> = Vec::new();
        match self.tables.get(table) {
            Some(tw) => {
                for (i, key) in keys.iter().enumerate() {
                    match tw.writes.get(key.as_ref()) {
                        Some(own) => out.push(own.map(<[u8]>::to_vec)),
                        None => {
                            out.push(None);
                            if !tw.dropped {
                                pending.push((i, key.as_ref()));
                            }
                        }
                    }
                }
            }
            None => {
                out.resize(keys.len(), None);
                pending.extend(keys.iter().map(AsRef::as_ref).enumerate());
            }
        }
        if pending.is_empty() {
            return Ok(out);
        }
        let lookup: Vec<&[u8]> = pending.iter().map(|&(_, k)| k).collect();
        let found = self.snap.get_many(table, &lookup);
        for (&(i, _), value) in pending.iter().zip(found) {
            if let Some(slot) = out.get_mut(i) {
                *slot = value;
            }
        }
        if self.isolation == Isolation::Serializable {
            let name: Arc<str> = Arc::from(table);
            self.reads.extend(pending.iter().map(|&(_, key)| (Arc::clone(&name), ReadItem::Key(key.to_vec()))));
        }
        Ok(out)
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
                        .range((resolved.start.clone(), resolved.end.clone()))
                        .map(|(k, v)| (k.as_slice().to_vec(), v.map(<[u8]>::to_vec)))
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
            let has_writes = tw.writes.values().any(|v| v.is_some());
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
        let (request, dirty) = self.prepare()?;
        let result = if dirty { self.snap.db.committer.submit(request) } else { self.commit_read_only(&request) };
        let (cpu_time, wall_time) = self.acct.finish(&self.snap.db, ending_of(&result));
        result.map(|ts| CommitInfo { ts, cpu_time, wall_time })
    }

    /// Commits without blocking the calling thread: the returned future completes when the
    /// commit is acknowledged under its durability mode, with what [`WriteTxn::commit`] would
    /// return. Needs no particular async runtime.
    ///
    /// The commit is queued when this is called, so it is sequenced even if the future is
    /// never polled. Dropping the future before it completes discards only the result: the
    /// commit still completes in the background, exactly once (a dropped future's transaction
    /// is not counted in the accounting totals). The task that finds no leader leads the group
    /// inline on its next poll, so with a single-threaded runtime the thread blocks for the
    /// group's write and fdatasync; every commit queued by then shares that one fdatasync.
    pub fn commit_async(mut self) -> CommitFuture {
        let db = Arc::clone(&self.snap.db);
        let state = match self.prepare() {
            Err(e) => FutureState::Ready(Some(Err(e))),
            Ok((request, false)) => FutureState::Ready(Some(self.commit_read_only(&request))),
            Ok((request, true)) => match db.committer.submit_async(request, Box::new(self.snap.pin())) {
                Ok(commit) => FutureState::Submitted(commit),
                Err(e) => FutureState::Ready(Some(Err(e))),
            },
        };
        let acct = std::mem::replace(&mut self.acct, Accounted::handed_on());
        CommitFuture { db, state, acct }
    }

    /// Commits this transaction as the replicated-log command at `position` (a Raft state
    /// machine applying an entry whose effect depends on reads: compare-and-swap, range
    /// deletes). Like [`crate::Database::apply_batch_with`], it is sequenced after every position
    /// before it (a position at or before the last applied one fails with
    /// [`Error::InvalidArgument`] and writes nothing), its writes and the position commit
    /// atomically, and [`crate::Database::applied`] then reports `position`; a transaction
    /// without writes still records the position. Its reads are not validated: determinism
    /// assumes the log is the store's only writer, so nothing can have changed what it read.
    pub fn commit_as_command(mut self, position: LogPosition, durability: Durability) -> Result<CommitInfo> {
        durability.validate()?;
        let (mut request, _) = self.prepare()?;
        request.durability = durability;
        request.reads.clear();
        request.apply = Some(crate::commit::ApplyPart { position, conditions: Vec::new() });
        let result = self.snap.db.committer.submit(request);
        let (cpu_time, wall_time) = self.acct.finish(&self.snap.db, ending_of(&result));
        result.map(|ts| CommitInfo { ts, cpu_time, wall_time })
    }

    /// Checks the budget, then takes the write set out as a request; `true` if it has writes.
    fn prepare(&mut self) -> Result<(CommitRequest, bool)> {
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
            apply: None,
        };
        self.acct.meter.freeze();
        Ok((request, dirty))
    }

    /// Nothing to log. A serializable reader still checks that what it read is unchanged.
    fn commit_read_only(&self, request: &CommitRequest) -> Result<u64> {
        self.snap.db.check_open()?;
        if self.isolation == Isolation::Serializable && !request.reads.is_empty() {
            self.snap.db.committer.validate_read_only(request)?;
        }
        Ok(self.snap.ts)
    }

    /// Discards the transaction's writes.
    pub fn rollback(self) {}
}

fn ending_of<T>(result: &Result<T>) -> Ending {
    if result.is_ok() {
        Ending::Committed
    } else {
        Ending::RolledBack
    }
}

enum FutureState {
    /// Decided without the pipeline (no writes, or refused before queueing).
    Ready(Option<Result<u64>>),
    Submitted(AsyncCommit),
    /// The outcome was returned.
    Done,
}

/// A commit in flight, from [`WriteTxn::commit_async`]. Resolves to the same result as
/// [`WriteTxn::commit`]. Dropping it does not cancel the commit.
#[must_use = "the commit proceeds even if the future is dropped, but only awaiting it tells whether it succeeded"]
pub struct CommitFuture {
    db: Arc<Inner>,
    state: FutureState,
    acct: Accounted,
}

impl std::fmt::Debug for CommitFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            FutureState::Ready(_) => "ready",
            FutureState::Submitted(_) => "submitted",
            FutureState::Done => "done",
        };
        f.debug_struct("CommitFuture").field("state", &state).finish()
    }
}

impl Future for CommitFuture {
    type Output = Result<CommitInfo>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let result = match &mut this.state {
            FutureState::Ready(r) => r.take().unwrap_or(Err(Error::TransactionDone)),
            FutureState::Submitted(commit) => match this.db.committer.poll_commit(commit, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r,
            },
            FutureState::Done => Err(Error::TransactionDone),
        };
        this.state = FutureState::Done;
        let (cpu_time, wall_time) = this.acct.finish(&this.db, ending_of(&result));
        Poll::Ready(result.map(|ts| CommitInfo { ts, cpu_time, wall_time }))
    }
}

impl Drop for CommitFuture {
    fn drop(&mut self) {
        if let FutureState::Submitted(commit) = &mut self.state {
            self.db.committer.abandon_commit(commit);
        }
    }
}
