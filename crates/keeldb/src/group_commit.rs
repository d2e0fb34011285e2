//! Group commit: validation, timestamp assignment, the WAL batch, apply and publish.
//!
//! Under one mutex (the sequencer) a commit is validated against every commit validated before
//! it (visible or not), given the next timestamp, encoded as a WAL frame and queued. So commit
//! order, WAL order and timestamp order are one order. If no leader is active the committer
//! becomes the leader: it takes the whole queue, writes it with one `write` and, when any
//! commit in it asks for `sync`, one `fdatasync`, applies the batch to the index, publishes the
//! new visible timestamp and wakes the batch's committers. Commits arriving meanwhile queue up
//! for the next leader, chosen from them; there is no timer and no idle delay.
//!
//! A failed write or fsync poisons the database: the batch and everything queued behind it
//! fail, nothing of it becomes visible, and later commits are refused until reopen.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::db::Inner;
use crate::error::{Error, Result};
use crate::index::{Key, Table};
use crate::options::{Durability, Isolation};
use crate::recovery::StateBuilder;
use crate::registry::Registry;
use crate::txn::{CommitRequest, ReadItem, TableWrites};
use crate::wal::{self, PayloadBuilder};

/// How a queued committer learns its fate.
#[derive(Debug)]
enum Slot {
    Waiting,
    /// The committer must lead the next batch (its own commit is in it).
    Lead,
    Done(std::result::Result<(), String>),
}

#[derive(Debug)]
struct Waiter {
    slot: Mutex<Slot>,
    cv: Condvar,
}

impl Waiter {
    fn new() -> Arc<Waiter> {
        Arc::new(Waiter { slot: Mutex::new(Slot::Waiting), cv: Condvar::new() })
    }
    fn set(&self, s: Slot) {
        *self.slot.lock() = s;
        self.cv.notify_one();
    }
    fn wait(&self) -> Slot {
        let mut slot = self.slot.lock();
        while matches!(*slot, Slot::Waiting) {
            self.cv.wait(&mut slot);
        }
        std::mem::replace(&mut *slot, Slot::Waiting)
    }
}

/// One table's writes, resolved to table ids.
#[derive(Debug)]
struct TableApply {
    name: Arc<str>,
    /// The id of the table instance the commit drops first, if any.
    drop_id: Option<u32>,
    /// Whether the commit creates the table `id` (first write, or write after its own drop).
    create: bool,
    id: u32,
    writes: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
}

/// A validated commit waiting for its batch.
#[derive(Debug)]
pub(crate) struct Pending {
    ts: u64,
    tables: Vec<TableApply>,
    durability: Durability,
    waiter: Arc<Waiter>,
}

/// The sequencer's state, behind `Inner::commit`.
#[derive(Debug)]
pub(crate) struct CommitState {
    /// Last timestamp handed out (validated commits, durable or not).
    pub last_ts: u64,
    /// LSN the next frame gets.
    pub next_lsn: u64,
    /// Table name to live id, including tables created by commits not yet visible.
    tables: crate::index::FastMap<Arc<str>, u32>,
    next_table_id: u32,
    /// Per table, the newest commit timestamp that wrote each recently written key.
    recent: crate::index::FastMap<Arc<str>, BTreeMap<Key, u64>>,
    recent_len: usize,
    trim_at: usize,
    /// Per table name, the newest commit timestamp that dropped it.
    drops: crate::index::FastMap<Arc<str>, u64>,
    queue: Vec<Pending>,
    queue_bytes: Vec<u8>,
    queue_first_lsn: u64,
    spare: Vec<u8>,
    scratch: Vec<u8>,
    pub leader_active: bool,
}

const TRIM_MIN: usize = 4096;

impl CommitState {
    pub fn new(last_ts: u64, next_lsn: u64, state: &StateBuilder) -> CommitState {
        CommitState {
            last_ts,
            next_lsn,
            tables: state.live.clone(),
            next_table_id: state.next_table_id.max(1),
            recent: crate::index::FastMap::default(),
            recent_len: 0,
            trim_at: TRIM_MIN,
            drops: crate::index::FastMap::default(),
            queue: Vec::new(),
            queue_bytes: Vec::new(),
            queue_first_lsn: next_lsn,
            spare: Vec::new(),
            scratch: Vec::new(),
            leader_active: false,
        }
    }

    pub fn queue_is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    fn written_after(&self, table: &str, key: &[u8], ts: u64) -> bool {
        self.recent.get(table).and_then(|m| m.get(key)).is_some_and(|&w| w > ts)
    }

    fn range_written_after(&self, table: &str, range: &crate::index::KeyRange, ts: u64) -> bool {
        if range.is_empty() {
            return false;
        }
        let Some(m) = self.recent.get(table) else { return false };
        let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (as_ref(&range.start), as_ref(&range.end));
        m.range::<[u8], _>(bounds).any(|(_, &w)| w > ts)
    }

    fn dropped_after(&self, table: &str, ts: u64) -> bool {
        self.drops.get(table).is_some_and(|&d| d > ts)
    }

    /// First committer wins: fails if anything this transaction wrote (or, when serializable,
    /// read) was written by a commit validated after this transaction's snapshot.
    fn validate(&self, req: &CommitRequest) -> Result<()> {
        let start = req.start_ts;
        for (name, tw) in &req.tables {
            if self.dropped_after(name, start) {
                return Err(Error::Conflict(format!("table {name:?} was dropped by a concurrent commit")));
            }
            if tw.dropped && self.recent.get(name).is_some_and(|m| m.values().any(|&w| w > start)) {
                return Err(Error::Conflict(format!("table {name:?} was written by a concurrent commit")));
            }
            for key in tw.writes.keys() {
                if self.written_after(name, key, start) {
                    return Err(Error::Conflict(format!("key {} in table {name:?} was written by a concurrent commit", show_key(key))));
                }
            }
        }
        if req.isolation == Isolation::Serializable {
            for (name, item) in &req.reads {
                let stale = self.dropped_after(name, start)
                    || match item {
                        ReadItem::Key(k) => self.written_after(name, k, start),
                        ReadItem::Range(r) => self.range_written_after(name, r, start),
                    };
                if stale {
                    return Err(Error::Conflict(format!("data read from table {name:?} was changed by a concurrent commit")));
                }
            }
        }
        Ok(())
    }

    /// Resolves table names to ids (allocating for new tables) and encodes the payload.
    fn resolve(&mut self, tables: std::collections::BTreeMap<Arc<str>, TableWrites>) -> (Vec<TableApply>, PayloadBuilder) {
        let mut payload = PayloadBuilder::new(256);
        let mut out = Vec::with_capacity(tables.len());
        for (name, tw) in tables {
            let existing = self.tables.get(&name).copied();
            let drop_id = if tw.dropped { existing } else { None };
            if let Some(id) = drop_id {
                payload.drop_table(id);
                self.tables.remove(&name);
            }
            let has_puts = tw.writes.values().any(Option::is_some);
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
                        Some(v) => payload.put(id, k, v),
                        None if !create => payload.delete(id, k),
                        None => {}
                    }
                }
            }
            out.push(TableApply { name, drop_id, create, id, writes: tw.writes });
        }
        (out, payload)
    }

    fn record(&mut self, tables: &[TableApply], ts: u64) {
        for ta in tables {
            if ta.drop_id.is_some() {
                self.drops.insert(Arc::clone(&ta.name), ts);
            }
            if ta.writes.is_empty() {
                continue;
            }
            let m = self.recent.entry(Arc::clone(&ta.name)).or_default();
            for k in ta.writes.keys() {
                if m.insert(Key::new(k), ts).is_none() {
                    self.recent_len += 1;
                }
            }
        }
    }

    /// Forgets conflict records no live or future transaction can conflict with.
    pub fn trim(&mut self, registry: &Registry, visible: &AtomicU64) {
        let horizon = registry.horizon(visible);
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

fn as_ref(b: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    match b {
        Bound::Included(v) => Bound::Included(v.as_slice()),
        Bound::Excluded(v) => Bound::Excluded(v.as_slice()),
        Bound::Unbounded => Bound::Unbounded,
    }
}

fn show_key(k: &[u8]) -> String {
    match std::str::from_utf8(k) {
        Ok(s) if s.len() <= 64 => format!("{s:?}"),
        _ => format!("0x{}", k.iter().take(32).map(|b| format!("{b:02x}")).collect::<String>()),
    }
}

impl Inner {
    /// Validates, logs and applies a write transaction; returns its commit timestamp once its
    /// durability condition holds and it is visible.
    pub(crate) fn commit(&self, req: CommitRequest) -> Result<u64> {
        self.check_writable()?;
        let waiter = Waiter::new();
        let mut cs = self.commit.lock();
        // Checked again under the lock: a leader may have failed since.
        self.check_writable()?;
        cs.validate(&req)?;
        let ts = cs.last_ts + 1;
        let (tables, payload) = cs.resolve(req.tables);
        let payload = payload.finish();
        let lsn = cs.next_lsn;
        if cs.queue.is_empty() {
            cs.queue_first_lsn = lsn;
        }
        let before = cs.queue_bytes.len();
        let durable = self.durable_lsn.load(Ordering::Acquire);
        wal::encode_frame(&mut cs.queue_bytes, lsn, durable, ts, &payload, crc32c::crc32c(&payload));
        cs.next_lsn += (cs.queue_bytes.len() - before) as u64;
        cs.record(&tables, ts);
        cs.last_ts = ts;
        if cs.recent_len > cs.trim_at {
            cs.trim(&self.registry, &self.visible_ts);
        }
        cs.queue.push(Pending { ts, tables, durability: req.durability, waiter: Arc::clone(&waiter) });
        if cs.leader_active {
            drop(cs);
            match waiter.wait() {
                Slot::Lead => {
                    let cs = self.commit.lock();
                    self.lead(cs);
                }
                Slot::Done(r) => return r.map(|()| ts).map_err(Error::Poisoned),
                Slot::Waiting => unreachable!("wait returns only when the slot is set"),
            }
        } else {
            cs.leader_active = true;
            self.lead(cs);
        }
        match waiter.wait() {
            Slot::Done(r) => r.map(|()| ts).map_err(Error::Poisoned),
            _ => Err(Error::Poisoned("group commit lost track of a commit".into())),
        }
    }

    /// Leads one batch: everything queued now. The caller's own commit is in it.
    fn lead(&self, mut cs: MutexGuard<'_, CommitState>) {
        let delay = self.options.commit_delay;
        if !delay.is_zero() {
            MutexGuard::unlocked(&mut cs, || std::thread::sleep(delay));
        }
        let batch = std::mem::take(&mut cs.queue);
        let spare = std::mem::take(&mut cs.spare);
        let bytes = std::mem::replace(&mut cs.queue_bytes, spare);
        let first_lsn = cs.queue_first_lsn;
        drop(cs);

        let result = if self.is_poisoned.load(Ordering::Acquire) {
            Err(self.poisoned.lock().clone().unwrap_or_default())
        } else {
            self.write_batch(&batch, &bytes, first_lsn)
        };
        if result.is_ok() {
            self.apply_batch(&batch);
        }
        let mut cs = self.commit.lock();
        let mut bytes = bytes;
        bytes.clear();
        cs.spare = bytes;
        for p in &batch {
            p.waiter.set(Slot::Done(result.clone()));
        }
        match cs.queue.first() {
            Some(next) => next.waiter.set(Slot::Lead),
            None => cs.leader_active = false,
        }
    }

    /// One write for the batch, and one fdatasync if any commit in it asks for `sync`.
    fn write_batch(&self, batch: &[Pending], bytes: &[u8], first_lsn: u64) -> std::result::Result<(), String> {
        let last_ts = batch.last().map_or(0, |p| p.ts);
        let needs_sync = batch.iter().any(|p| p.durability.needs_sync());
        let mut wal = self.wal.lock();
        let res = wal.append(bytes, first_lsn, last_ts).and_then(|()| {
            if needs_sync {
                let end = wal.end_lsn();
                wal.sync()?;
                self.counters.wal_syncs.fetch_add(1, Ordering::Relaxed);
                self.durable_lsn.fetch_max(end, Ordering::AcqRel);
            } else {
                // A roll inside `append` synced the sealed segment.
                self.durable_lsn.fetch_max(wal.current().start_lsn, Ordering::AcqRel);
            }
            Ok(())
        });
        drop(wal);
        if let Err(e) = res {
            let why = e.to_string();
            self.poison(why.clone());
            return Err(why);
        }
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.commits.fetch_add(batch.len() as u64, Ordering::Relaxed);
        self.counters.wal_bytes_since_checkpoint.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let periodic = batch.iter().filter_map(|p| match p.durability {
            Durability::Periodic(d) => Some(d),
            _ => None,
        });
        if let Some(interval) = periodic.min() {
            if !needs_sync {
                if self.options.background_threads {
                    self.schedule.request(Instant::now() + interval);
                } else {
                    // No background worker: sync inline once the oldest unsynced commit's
                    // interval is up.
                    let mut d = self.schedule.deadline.lock();
                    let by = *d.get_or_insert(Instant::now() + interval);
                    if by <= Instant::now() {
                        *d = None;
                        drop(d);
                        self.sync_wal().map_err(|e| e.to_string())?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Applies a durable batch to the index in timestamp order, then publishes it.
    fn apply_batch(&self, batch: &[Pending]) {
        let Some(last) = batch.last() else { return };
        let horizon = self.registry.horizon(&self.visible_ts);
        let mut digest = self.digest.lock();
        for p in batch {
            for ta in &p.tables {
                if ta.drop_id.is_some() || ta.create {
                    let mut catalog = self.catalog.write();
                    if let Some(old) = ta.drop_id.and_then(|id| catalog.by_id(id)).cloned() {
                        old.data.read().for_each_live(|k, v| digest.remove(&old.name, k, v));
                        old.dropped_ts.store(p.ts, Ordering::Release);
                    }
                    if ta.create {
                        catalog.insert(Arc::new(Table::new(ta.id, Arc::clone(&ta.name), p.ts)));
                    }
                }
                if ta.id == 0 || ta.writes.is_empty() {
                    continue;
                }
                let table = self.catalog.read().by_id(ta.id).cloned();
                let Some(table) = table else { continue };
                let mut data = table.data.write();
                for (k, v) in &ta.writes {
                    data.apply(&table.name, k, v.as_deref(), p.ts, horizon, &mut digest);
                }
            }
        }
        self.visible_ts.store(last.ts, Ordering::Release);
        drop(digest);
    }
}
