//! Group commit: validation, timestamp assignment, the WAL batch, apply and publish.
//!
//! Flat combining with a pipelined fdatasync. A committer pushes its write set onto a small
//! queue and parks. If no leader is gathering, it becomes the leader: it takes the whole
//! queue, and under the sequencer lock validates each commit against every commit validated
//! before it (visible or not), gives it the next timestamp and encodes its WAL frame, so commit
//! order, WAL order and timestamp order are one order. It writes the batch with one `write`
//! and, when any commit in it asks for `sync`, one `fdatasync`; commits arriving meanwhile
//! queue up. Then it hands gathering to one of them, so the next batch is validated, written
//! and synced while this one is applied and its committers are woken. Only one fdatasync is in
//! flight at a time (handing off before it made batches of one). Batches publish strictly in
//! order: a finished batch is marked ready, and whoever holds the publish lock applies every
//! ready batch in sequence to the index, advances the visible timestamp and wakes their
//! committers, so no thread waits for a particular other one to be scheduled. There is no
//! timer: an idle database never delays a commit.
//!
//! Committers park once per commit; the sequencer lock is only ever taken by the one
//! gathering leader, so 64 committers do not convoy on it.
//!
//! A failed write or fsync poisons the database: that batch and every later one fail, nothing
//! of them becomes visible, and later commits are refused until reopen.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

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
    /// Leadership was released with work queued: the committer should try to lead.
    TryLead,
    Done(Outcome),
}

/// How a commit ended.
#[derive(Debug)]
enum Outcome {
    Committed(u64),
    Conflict(String),
    Failed(String),
}

impl Outcome {
    fn into_result(self) -> Result<u64> {
        match self {
            Outcome::Committed(ts) => Ok(ts),
            Outcome::Conflict(why) => Err(Error::Conflict(why)),
            Outcome::Failed(why) if why == CLOSED => Err(Error::Closed),
            Outcome::Failed(why) => Err(Error::Poisoned(why)),
        }
    }
}

const CLOSED: &str = "database is closed";

/// A committer's mailbox: the slot and the thread to unpark when it changes. Parking on the
/// thread's own futex is the cheapest sleep available, and a committer sleeps once per commit.
#[derive(Debug)]
struct Waiter {
    slot: Mutex<Slot>,
    changed: AtomicBool,
    thread: std::thread::Thread,
}

impl Waiter {
    fn new() -> Arc<Waiter> {
        Arc::new(Waiter {
            slot: Mutex::new(Slot::Waiting),
            changed: AtomicBool::new(false),
            thread: std::thread::current(),
        })
    }
    fn set(&self, s: Slot) {
        *self.slot.lock() = s;
        self.changed.store(true, Ordering::Release);
        self.thread.unpark();
    }
    /// Blocks until the slot is set; only the thread that created the waiter calls this.
    fn wait(&self) -> Slot {
        loop {
            if self.changed.swap(false, Ordering::Acquire) {
                let taken = std::mem::replace(&mut *self.slot.lock(), Slot::Waiting);
                if !matches!(taken, Slot::Waiting) {
                    return taken;
                }
            }
            std::thread::park();
        }
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

/// A validated commit in a batch.
#[derive(Debug)]
struct Pending {
    ts: u64,
    tables: Vec<TableApply>,
    durability: Durability,
    waiter: Arc<Waiter>,
}

/// A commit request waiting for a leader.
#[derive(Debug)]
struct Queued {
    req: CommitRequest,
    waiter: Arc<Waiter>,
}

#[derive(Debug, Default)]
struct Gather {
    pending: Vec<Queued>,
    leader_active: bool,
}

/// A batch whose I/O is done, waiting for the batches before it to publish.
#[derive(Debug)]
struct Ready {
    commits: Vec<Pending>,
    result: std::result::Result<(), String>,
}

#[derive(Debug, Default)]
struct Publish {
    /// Sequence number of the next batch to publish.
    next_batch: u64,
    /// Batches done with their I/O, by sequence number.
    ready: BTreeMap<u64, Ready>,
    /// Set when a batch failed; every later batch fails too.
    failed: Option<String>,
}

/// The queue committers join and the in-order publication of finished batches.
#[derive(Debug, Default)]
pub(crate) struct Pipeline {
    gather: Mutex<Gather>,
    publish: Mutex<Publish>,
}

impl Pipeline {
    /// Whether no commit is queued, gathering or waiting to publish, given the sequencer's
    /// next batch number.
    pub fn is_idle(&self, next_batch: u64) -> bool {
        let g = self.gather.lock();
        !g.leader_active && g.pending.is_empty() && self.publish.lock().next_batch == next_batch
    }
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
    /// Per table, the newest commit timestamp that wrote each recently written key. Hashed,
    /// not ordered: point checks are O(1), and the rare serializable range check scans the
    /// table's recent set, which trimming keeps small.
    recent: crate::index::FastMap<Arc<str>, crate::index::FastMap<Key, u64>>,
    recent_len: usize,
    trim_at: usize,
    /// Per table name, the newest commit timestamp that dropped it.
    drops: crate::index::FastMap<Arc<str>, u64>,
    /// Sequence number the next batch gets.
    pub next_batch: u64,
    /// Commits whose snapshot is older than this conflict: the state they read was replaced
    /// by an installed checkpoint (`install.rs`). Equal to `last_ts` at creation, so it never
    /// fires for transactions begun after open.
    fence_ts: u64,
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
            next_batch: 0,
            fence_ts: last_ts,
        }
    }

    fn written_after(&self, table: &str, key: &[u8], ts: u64) -> bool {
        self.recent.get(table).and_then(|m| m.get(key)).is_some_and(|&w| w > ts)
    }

    fn range_written_after(&self, table: &str, range: &crate::index::KeyRange, ts: u64) -> bool {
        if range.is_empty() {
            return false;
        }
        let Some(m) = self.recent.get(table) else { return false };
        m.iter().any(|(k, &w)| w > ts && range.contains(k.as_slice()))
    }

    fn dropped_after(&self, table: &str, ts: u64) -> bool {
        self.drops.get(table).is_some_and(|&d| d > ts)
    }

    /// First committer wins: fails if anything this transaction wrote (or, when serializable,
    /// read) was written by a commit validated after this transaction's snapshot.
    fn validate(&self, req: &CommitRequest) -> Result<()> {
        let start = req.start_ts;
        if start < self.fence_ts {
            return Err(Error::Conflict("the database state was replaced by an installed checkpoint".into()));
        }
        for (name, tw) in &req.tables {
            if self.dropped_after(name, start) {
                return Err(Error::Conflict(format!("table {name:?} was dropped by a concurrent commit")));
            }
            if tw.dropped && self.recent.get(name).is_some_and(|m| m.values().any(|&w| w > start)) {
                return Err(Error::Conflict(format!("table {name:?} was written by a concurrent commit")));
            }
            for key in tw.writes.keys() {
                if self.written_after(name, key, start) {
                    return Err(Error::Conflict(format!(
                        "key {} in table {name:?} was written by a concurrent commit",
                        show_key(key)
                    )));
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
                    return Err(Error::Conflict(format!(
                        "data read from table {name:?} was changed by a concurrent commit"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Resolves table names to ids (allocating for new tables) and encodes the payload.
    fn resolve(
        &mut self,
        tables: std::collections::BTreeMap<Arc<str>, TableWrites>,
    ) -> (Vec<TableApply>, PayloadBuilder) {
        // Sized up front: each op is at most a tag, a table id, two lengths and its bytes.
        let size: usize = tables
            .iter()
            .map(|(name, tw)| {
                32 + name.len()
                    + tw.writes.iter().map(|(k, v)| 13 + k.len() + v.as_ref().map_or(0, Vec::len)).sum::<usize>()
            })
            .sum();
        let mut payload = PayloadBuilder::new(size);
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

fn show_key(k: &[u8]) -> String {
    match std::str::from_utf8(k) {
        Ok(s) if s.len() <= 64 => format!("{s:?}"),
        _ => format!("0x{}", k.iter().take(32).map(|b| format!("{b:02x}")).collect::<String>()),
    }
}

/// A batch sequenced and encoded by its leader.
struct Batch {
    seq: u64,
    commits: Vec<Pending>,
    frames: Vec<u8>,
    first_lsn: u64,
}

impl Inner {
    /// Validates, logs and applies a write transaction; returns its commit timestamp once its
    /// durability condition holds and it is visible.
    pub(crate) fn commit(&self, req: CommitRequest) -> Result<u64> {
        self.check_writable()?;
        let waiter = Waiter::new();
        let lead = {
            let mut g = self.pipeline.gather.lock();
            // Checked under the queue lock: close waits for this queue to drain.
            self.check_writable()?;
            g.pending.push(Queued { req, waiter: Arc::clone(&waiter) });
            !std::mem::replace(&mut g.leader_active, true)
        };
        if lead {
            self.lead_while_work();
        }
        loop {
            match waiter.wait() {
                Slot::TryLead => {
                    if self.try_take_leadership() {
                        self.lead_while_work();
                    }
                }
                Slot::Done(outcome) => return outcome.into_result(),
                Slot::Waiting => {}
            }
        }
    }

    /// Validates a transaction without writes (a serializable reader) against every commit
    /// sequenced so far. Never touches the WAL.
    pub(crate) fn validate_read_only(&self, req: &CommitRequest) -> Result<()> {
        self.commit.lock().validate(req)
    }

    /// Takes leadership if nobody holds it and work is queued.
    fn try_take_leadership(&self) -> bool {
        let mut g = self.pipeline.gather.lock();
        if g.leader_active || g.pending.is_empty() {
            return false;
        }
        g.leader_active = true;
        true
    }

    /// Leads a batch, then keeps leading while work is queued and nobody else took over: a
    /// thread that is already running leads, instead of waiting for a woken one to be
    /// scheduled (with many runnable threads on few cores that wait dominated).
    fn lead_while_work(&self) {
        self.lead();
        for _ in 0..64 {
            if !self.try_take_leadership() {
                return;
            }
            self.lead();
        }
    }

    /// Leads one batch: everything queued now (the caller's own commit is in it).
    fn lead(&self) {
        let delay = self.options.commit_delay;
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let queued = std::mem::take(&mut self.pipeline.gather.lock().pending);
        let Some(batch) = self.sequence(queued) else {
            self.release_gather();
            return;
        };
        let last_ts = batch.commits.last().map_or(0, |p| p.ts);
        let needs_sync = batch.commits.iter().any(|p| p.durability.needs_sync());
        let written = self.write_frames(&batch.frames, batch.first_lsn, last_ts);
        let result = written.and_then(|(file, end, path)| {
            if needs_sync {
                file.sync_data().map_err(|e| {
                    let why = Error::io(path, e).to_string();
                    self.poison(why.clone());
                    why
                })?;
                self.counters.wal_syncs.fetch_add(1, Ordering::Relaxed);
                self.durable_lsn.fetch_max(end, Ordering::AcqRel);
            }
            self.after_write(&batch, needs_sync)
        });
        // One fdatasync in flight at a time keeps batches large. From here the next leader
        // gathers, writes and syncs while this batch publishes and wakes its committers.
        self.release_gather();
        self.publish(batch, result);
    }

    /// Validates and encodes the queued commits in order; answers the ones that conflict.
    fn sequence(&self, queued: Vec<Queued>) -> Option<Batch> {
        let mut cs = self.commit.lock();
        let refused = self.check_writable().err().map(|e| match e {
            Error::Closed => CLOSED.to_owned(),
            other => other.to_string(),
        });
        let mut commits = Vec::with_capacity(queued.len());
        let mut frames = Vec::new();
        let first_lsn = cs.next_lsn;
        for Queued { req, waiter } in queued {
            if let Some(why) = &refused {
                waiter.set(Slot::Done(Outcome::Failed(why.clone())));
                continue;
            }
            if let Err(e) = cs.validate(&req) {
                waiter.set(Slot::Done(Outcome::Conflict(match e {
                    Error::Conflict(why) => why,
                    other => other.to_string(),
                })));
                continue;
            }
            let ts = cs.last_ts + 1;
            let (tables, payload) = cs.resolve(req.tables);
            let payload = payload.finish();
            let before = frames.len();
            frames.reserve(wal::frame_bytes(payload.len()));
            let durable = self.durable_lsn.load(Ordering::Acquire);
            wal::encode_frame(&mut frames, cs.next_lsn, durable, ts, &payload, crc32c::crc32c(&payload));
            cs.next_lsn += (frames.len() - before) as u64;
            cs.record(&tables, ts);
            cs.last_ts = ts;
            commits.push(Pending { ts, tables, durability: req.durability, waiter });
        }
        if cs.recent_len > cs.trim_at {
            cs.trim(&self.registry, &self.visible_ts);
        }
        if commits.is_empty() {
            return None;
        }
        let seq = cs.next_batch;
        cs.next_batch += 1;
        Some(Batch { seq, commits, frames, first_lsn })
    }

    /// Gives up leadership. If work is queued, wakes its first committer to try to lead; any
    /// committer that arrives first (or this one, after publishing) may lead instead. So
    /// whenever leadership drops with work queued, someone is on the way to lead it.
    fn release_gather(&self) {
        let mut g = self.pipeline.gather.lock();
        g.leader_active = false;
        if let Some(next) = g.pending.first() {
            next.waiter.set(Slot::TryLead);
        }
    }

    /// One write for the batch. Returns the file to sync, the LSN it reaches and its path.
    fn write_frames(
        &self,
        frames: &[u8],
        first_lsn: u64,
        last_ts: u64,
    ) -> std::result::Result<(Arc<dyn crate::fs::FileHandle>, u64, std::path::PathBuf), String> {
        let mut wal = self.wal.lock();
        if self.is_poisoned.load(Ordering::Acquire) {
            return Err(self.poisoned.lock().clone().unwrap_or_default());
        }
        if let Err(e) = wal.append(frames, first_lsn, last_ts) {
            let why = e.to_string();
            self.poison(why.clone());
            return Err(why);
        }
        // A roll inside `append` synced the sealed segment.
        self.durable_lsn.fetch_max(wal.current().start_lsn, Ordering::AcqRel);
        self.counters.wal_bytes_since_checkpoint.fetch_add(frames.len() as u64, Ordering::Relaxed);
        Ok((wal.file(), wal.end_lsn(), wal.current().path.clone()))
    }

    /// Counters and the periodic-durability schedule, once a batch is written (and synced).
    fn after_write(&self, batch: &Batch, synced: bool) -> std::result::Result<(), String> {
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.commits.fetch_add(batch.commits.len() as u64, Ordering::Relaxed);
        if synced {
            return Ok(());
        }
        let periodic = batch.commits.iter().filter_map(|p| match p.durability {
            Durability::Periodic(d) => Some(d),
            _ => None,
        });
        let Some(interval) = periodic.min() else { return Ok(()) };
        if self.options.background_threads {
            self.schedule.request(Instant::now() + interval);
            return Ok(());
        }
        // No background worker: sync inline once the oldest unsynced commit's interval is up.
        let mut d = self.schedule.deadline.lock();
        let by = *d.get_or_insert(Instant::now() + interval);
        if by <= Instant::now() {
            *d = None;
            drop(d);
            self.sync_wal().map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Marks a batch ready and publishes every ready batch in sequence order: applies it (or
    /// fails it, when it or an earlier batch failed), advances the visible timestamp and wakes
    /// its committers. Whoever finds the next batch ready publishes it, so no thread ever waits
    /// for a particular other thread to be scheduled.
    fn publish(&self, batch: Batch, result: std::result::Result<(), String>) {
        let mut done: Vec<Ready> = Vec::new();
        {
            let mut p = self.pipeline.publish.lock();
            p.ready.insert(batch.seq, Ready { commits: batch.commits, result });
            loop {
                let next = p.next_batch;
                let Some(mut ready) = p.ready.remove(&next) else { break };
                ready.result = match (&p.failed, ready.result) {
                    (Some(why), _) => Err(why.clone()),
                    (None, Err(why)) => {
                        p.failed = Some(why.clone());
                        Err(why)
                    }
                    (None, Ok(())) => Ok(()),
                };
                if ready.result.is_ok() {
                    self.apply_batch(&ready.commits);
                }
                p.next_batch += 1;
                done.push(ready);
            }
        }
        for ready in done {
            for c in &ready.commits {
                let outcome = match &ready.result {
                    Ok(()) => Outcome::Committed(c.ts),
                    Err(why) => Outcome::Failed(why.clone()),
                };
                c.waiter.set(Slot::Done(outcome));
            }
        }
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
