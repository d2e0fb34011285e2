//! The Raft log and vote, kept in a KeelDB store in sync mode.
//!
//! Invariant: an append's flush callback fires only after the fdatasync that covers the
//! entries (openraft #618, #2118). A single writer thread takes every log write in call order
//! (appends, truncations, purges, votes), folds all that are waiting into one transaction and
//! commits it with `Durability::Sync`: concurrent appends share one fdatasync, and a later
//! write is never durable before an earlier one because they are one WAL in order. Entries are
//! also kept in memory from the moment `append` returns (openraft reads them back before they
//! are flushed); the memory copy is bounded by log purging behind snapshots.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;

use keeldb::fs::FileSystem;
use keeldb::{Database, Durability, Options, ScanRange};
use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader};
use parking_lot::Mutex;

use crate::types::{Entry, LogId, TypeConfig, Vote};

const LOG: &str = "log";
const RAFT: &str = "raft";
const VOTE_KEY: &[u8] = b"vote";
const PURGED_KEY: &[u8] = b"purged";
const COMMITTED_KEY: &[u8] = b"committed";

/// What the in-memory mirror holds: every entry not purged, the vote, the purge point.
#[derive(Default)]
struct Mirror {
    entries: BTreeMap<u64, Entry>,
    vote: Option<Vote>,
    purged: Option<LogId>,
    committed: Option<LogId>,
}

/// One durable write for the writer thread.
enum Op {
    Put(Vec<u8>, Vec<u8>, &'static str),
    DeleteRange(u64, u64),
}

struct Job {
    ops: Vec<Op>,
    done: Box<dyn FnOnce(io::Result<()>) + Send>,
}

/// What the writer thread is sent: a write, or the member's stop (answered once the store is
/// closed and its directory lock released).
enum Work {
    Write(Job),
    Close(tokio::sync::oneshot::Sender<()>),
}

/// Told, for each CURP command handed to the log store, its id and the leader (term, member)
/// that appended it: a leader's early answer waits for this (`curp::front`).
pub type AppendHook = Arc<dyn Fn(&[(crate::curp::CommandId, u64, u64)]) + Send + Sync>;

/// The log store handed to openraft; cheap to clone.
#[derive(Clone)]
pub struct LogStore {
    mirror: Arc<Mutex<Mirror>>,
    /// See [`AppendHook`].
    on_append: Arc<parking_lot::RwLock<Option<AppendHook>>>,
    jobs: mpsc::Sender<Work>,
    /// The newest committed id not yet written: it rides along with the next log write
    /// instead of costing an fdatasync of its own.
    pending_committed: Arc<Mutex<Option<LogId>>>,
}

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

fn encode<T: serde::Serialize>(value: &T) -> io::Result<Vec<u8>> {
    bincode::serialize(value).map_err(io_err)
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> io::Result<T> {
    bincode::deserialize(bytes)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("raft log: bad {what}: {e}")))
}

impl LogStore {
    /// Opens (or creates) the log store in `dir` on `fs` and starts its writer thread, which
    /// ends on [`LogStore::close`] or when every clone of the store is dropped.
    pub fn open(dir: &Path, fs: Arc<dyn FileSystem>) -> io::Result<LogStore> {
        let db = Database::open(dir, Options { fs, ..Options::with_durability(Durability::Sync) }).map_err(io_err)?;
        let mut mirror = Mirror::default();
        {
            let txn = db.begin_read().map_err(io_err)?;
            for item in txn.scan(LOG, ScanRange::all()).map_err(io_err)? {
                let (key, value) = item.map_err(io_err)?;
                let index = index_of(&key)?;
                let entry: Entry = decode(&value, "entry")?;
                if entry.log_id.index != index {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "raft log: entry stored under another index",
                    ));
                }
                mirror.entries.insert(index, entry);
            }
            if let Some(v) = txn.get(RAFT, VOTE_KEY).map_err(io_err)? {
                mirror.vote = Some(decode(&v, "vote")?);
            }
            if let Some(v) = txn.get(RAFT, PURGED_KEY).map_err(io_err)? {
                mirror.purged = Some(decode(&v, "purge point")?);
            }
            if let Some(v) = txn.get(RAFT, COMMITTED_KEY).map_err(io_err)? {
                mirror.committed = Some(decode(&v, "committed id")?);
            }
        }
        check_contiguous(&mirror)?;
        let (tx, rx) = mpsc::channel::<Work>();
        let pending_committed = Arc::new(Mutex::new(None));
        let pending = Arc::clone(&pending_committed);
        let last_written = mirror.entries.keys().next_back().copied().or(mirror.purged.map(|p| p.index));
        std::thread::Builder::new()
            .name("keel-raft-log".into())
            .spawn(move || writer(db, rx, pending, last_written))?;
        Ok(LogStore { mirror: Arc::new(Mutex::new(mirror)), on_append: Arc::default(), jobs: tx, pending_committed })
    }

    /// Sets the hook told of the CURP commands appended (see [`AppendHook`]).
    pub fn set_on_append(&self, hook: AppendHook) {
        *self.on_append.write() = Some(hook);
    }

    /// Whether the log holds nothing at all: no entry, no purge point, no vote.
    pub fn is_empty(&self) -> bool {
        let m = self.mirror.lock();
        m.entries.is_empty() && m.purged.is_none() && m.vote.is_none()
    }

    fn submit(&self, ops: Vec<Op>, done: Box<dyn FnOnce(io::Result<()>) + Send>) -> io::Result<()> {
        self.jobs.send(Work::Write(Job { ops, done })).map_err(|_| closed())
    }

    /// Closes the store for every clone: writes already sent are made durable first, later
    /// ones fail, and this returns once the store is closed and its directory lock released.
    /// The member's stop calls it after Raft has stopped. Without it the store stayed open
    /// until the last clone was dropped, and a clone can outlive the stop (openraft gives
    /// clones to its replication tasks as log readers, and any task still holding the member
    /// holds one): the member's data directory then stayed locked and a restart in the same
    /// process failed. Reads keep being served from memory.
    pub async fn close(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.jobs.send(Work::Close(tx)).is_ok() {
            // An error: the thread has ended already (the store is closed).
            let _ = rx.await;
        }
    }

    /// Submits `ops` and waits until they are durable.
    async fn write_durably(&self, ops: Vec<Op>) -> io::Result<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(
            ops,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        )?;
        rx.await.map_err(|_| closed())?
    }
}

fn closed() -> io::Error {
    io::Error::other("raft log writer stopped (the member is stopping, or an earlier write failed)")
}

fn index_of(key: &[u8]) -> io::Result<u64> {
    let bytes: [u8; 8] =
        key.try_into().map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "raft log: key is not an index"))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Refuses a log with a hole: Raft only looks at the last id, so a hole would be believed.
fn check_contiguous(m: &Mirror) -> io::Result<()> {
    let mut prev = m.purged.map(|p| p.index);
    for &i in m.entries.keys() {
        if prev.is_some_and(|p| i != p + 1) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("raft log: hole before index {i}")));
        }
        prev = Some(i);
    }
    Ok(())
}

/// What a store's writer thread takes at once: `first` and whatever else is queued, up to
/// `max` writes, stopping at a close request (`as_write` tells the two apart). The log and
/// the CURP witness's journal both batch this way.
pub(crate) fn take_batch<M, W, C>(
    first: M,
    rx: &mpsc::Receiver<M>,
    max: usize,
    as_write: impl Fn(M) -> Result<W, C>,
) -> (Vec<W>, Option<C>) {
    let mut writes = Vec::new();
    let mut next = Some(first);
    while let Some(m) = next {
        match as_write(m) {
            Ok(w) => writes.push(w),
            Err(close) => return (writes, Some(close)),
        }
        next = if writes.len() < max { rx.try_recv().ok() } else { None };
    }
    (writes, None)
}

/// The writer thread: all waiting jobs become one sync commit, then their callbacks run.
fn writer(
    db: Database,
    rx: mpsc::Receiver<Work>,
    pending_committed: Arc<Mutex<Option<LogId>>>,
    mut last_written: Option<u64>,
) {
    let mut closers = Vec::new();
    while closers.is_empty() {
        let Ok(first) = rx.recv() else { break };
        let (jobs, close) = take_batch(first, &rx, 4096, |work| match work {
            Work::Write(job) => Ok(job),
            Work::Close(tx) => Err(tx),
        });
        // The writes sent before a close are still committed below.
        closers.extend(close);
        if jobs.is_empty() {
            continue;
        }
        for op in jobs.iter().flat_map(|j| j.ops.iter()) {
            if let Op::Put(key, _, LOG) = op {
                let index = index_of(key).ok();
                last_written = last_written.max(index);
            }
        }
        // The committed id rides along only once its entry is in this commit or an earlier
        // one: never durable ahead of the entries it covers (entries below a committed id are
        // never truncated, so the highest index ever written bounds them).
        let committed = {
            let mut pending = pending_committed.lock();
            match *pending {
                Some(c) if committed_is_covered(c.index, last_written) => pending.take(),
                _ => None,
            }
        };
        let result = commit_jobs(&db, &jobs, committed.and_then(|c| encode(&c).ok()));
        for job in jobs {
            (job.done)(result.as_ref().map(|_| ()).map_err(|e| io::Error::new(e.kind(), e.to_string())));
        }
        if result.is_err() {
            // The store is poisoned or full; every later write fails the same way, and openraft
            // stops this node on the first storage error it is told of.
            break;
        }
    }
    // Writes queued behind a close fail; once `rx` is dropped, later sends fail at once.
    for work in rx.try_iter() {
        match work {
            Work::Write(job) => (job.done)(Err(closed())),
            Work::Close(tx) => closers.push(tx),
        }
    }
    drop(rx);
    let _ = db.close();
    for tx in closers {
        let _ = tx.send(());
    }
}

/// Whether a committed id may be written once entries up to `last_written` are in the log.
fn committed_is_covered(committed: u64, last_written: Option<u64>) -> bool {
    last_written.is_some_and(|l| committed <= l)
}

fn commit_jobs(db: &Database, jobs: &[Job], committed: Option<Vec<u8>>) -> io::Result<()> {
    let mut txn = db.begin_write().map_err(io_err)?;
    if let Some(bytes) = committed {
        txn.put(RAFT, COMMITTED_KEY, &bytes).map_err(io_err)?;
    }
    for op in jobs.iter().flat_map(|j| j.ops.iter()) {
        match op {
            Op::Put(key, value, table) => txn.put(table, key, value).map_err(io_err)?,
            Op::DeleteRange(lo, hi) => {
                for i in *lo..=*hi {
                    txn.delete(LOG, &i.to_be_bytes()).map_err(io_err)?;
                }
            }
        }
    }
    txn.commit().map(|_| ()).map_err(io_err)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let m = self.mirror.lock();
        let start = match range.start_bound() {
            Bound::Included(&s) => Bound::Included(s),
            Bound::Excluded(&s) => Bound::Excluded(s),
            Bound::Unbounded => Bound::Unbounded,
        };
        let end = match range.end_bound() {
            Bound::Included(&s) => Bound::Included(s),
            Bound::Excluded(&s) => Bound::Excluded(s),
            Bound::Unbounded => Bound::Unbounded,
        };
        if let (Bound::Included(s) | Bound::Excluded(s), Bound::Included(e) | Bound::Excluded(e)) = (start, end) {
            if s > e {
                return Ok(Vec::new());
            }
        }
        let entries: Vec<Entry> = m.entries.range((start, end)).map(|(_, e)| e.clone()).collect();
        // openraft sends `entries` right after a `prev_log_id` of `start - 1`: the answer must
        // begin exactly at `start`. When the start is already purged (a purge racing a reader:
        // a leader that just stepped down purges at once while its replication tasks still
        // read), the rest of the range would look contiguous to the follower and leave a hole
        // in its log. Answer nothing instead; openraft treats that as a heartbeat.
        let wanted = match start {
            Bound::Included(s) => Some(s),
            Bound::Excluded(s) => s.checked_add(1),
            Bound::Unbounded => None,
        };
        let purged_start = wanted.is_some_and(|w| m.purged.is_some_and(|p| w <= p.index));
        if purged_start && entries.first().is_some_and(|first| Some(first.log_id.index) != wanted) {
            return Ok(Vec::new());
        }
        Ok(entries)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(self.mirror.lock().vote)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let m = self.mirror.lock();
        let last = m.entries.values().next_back().map(|e| e.log_id).or(m.purged);
        Ok(LogState { last_purged_log_id: m.purged, last_log_id: last })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        let bytes = encode(vote)?;
        // Durable before returning: a vote forgotten in a crash could let this member vote twice
        // in one term.
        self.write_durably(vec![Op::Put(VOTE_KEY.to_vec(), bytes, RAFT)]).await?;
        self.mirror.lock().vote = Some(*vote);
        Ok(())
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        // Written with the next log write (append, vote, purge), never on its own: a stale
        // committed id after a crash is only a lower bound, which is all openraft takes it for,
        // and a write of its own would cost every commit a second fdatasync that the next
        // append must queue behind.
        if let Some(c) = committed {
            *self.pending_committed.lock() = Some(c);
            self.mirror.lock().committed = Some(c);
        }
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.mirror.lock().committed)
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<TypeConfig>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut ops = Vec::new();
        let mut curp = Vec::new();
        {
            let mut m = self.mirror.lock();
            // The log stays contiguous: each appended entry follows the last one (or the purge
            // point). openraft truncates before it overwrites, so anything else is a request
            // that would leave a hole; refusing it stops Raft on this member instead of
            // applying a log with an entry missing.
            let mut next = m.entries.keys().next_back().map(|l| l + 1).or(m.purged.map(|p| p.index + 1));
            for entry in entries {
                let index = entry.log_id.index;
                if next.is_some_and(|n| index != n) {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!(
                            "raft log: appending index {index} where {} comes next would leave a hole",
                            next.unwrap_or(0)
                        ),
                    ));
                }
                next = Some(index + 1);
                ops.push(Op::Put(index.to_be_bytes().to_vec(), encode(&entry)?, LOG));
                if let openraft::EntryPayload::Normal(req) = &entry.payload {
                    if req.kind == crate::types::RequestKind::Curp {
                        // A command's body starts with its id (bincode, fixed width).
                        if let Ok(id) = bincode::deserialize::<crate::curp::CommandId>(&req.body) {
                            curp.push((id, entry.log_id.leader_id.term, entry.log_id.leader_id.node_id));
                        }
                    }
                }
                m.entries.insert(index, entry);
            }
        }
        if !curp.is_empty() {
            if let Some(hook) = self.on_append.read().as_ref() {
                hook(&curp);
            }
        }
        self.submit(ops, Box::new(move |r| callback.io_completed(r)))
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let first = last_log_id.map_or(0, |l| l.index + 1);
        let last = {
            let mut m = self.mirror.lock();
            let last = m.entries.keys().next_back().copied();
            m.entries.split_off(&first);
            last
        };
        match last {
            Some(last) if last >= first => self.write_durably(vec![Op::DeleteRange(first, last)]).await,
            _ => Ok(()),
        }
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        let first = {
            let mut m = self.mirror.lock();
            let first = m.entries.keys().next().copied();
            let keep = m.entries.split_off(&(log_id.index + 1));
            m.entries = keep;
            m.purged = Some(log_id);
            first
        };
        let mut ops = vec![Op::Put(PURGED_KEY.to_vec(), encode(&log_id)?, RAFT)];
        if let Some(first) = first.filter(|f| *f <= log_id.index) {
            ops.push(Op::DeleteRange(first, log_id.index));
        }
        // The purge point is written in the same commit as the deletions, so a crash leaves
        // either both or neither: never a log that starts after its recorded purge point + 1.
        self.write_durably(ops).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_committed_id_waits_for_its_entry() {
        assert!(!committed_is_covered(5, None));
        assert!(!committed_is_covered(5, Some(4)));
        assert!(committed_is_covered(5, Some(5)));
        assert!(committed_is_covered(5, Some(9)));
    }

    /// A clone that outlives the close (openraft's replication tasks hold log readers) must
    /// not keep the directory locked: the store reopens at once, the clone's writes fail
    /// instead of hanging, and a write sent before the close is durable.
    #[tokio::test]
    async fn close_releases_the_directory_while_clones_live() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let fs: Arc<dyn FileSystem> = Arc::new(keeldb::fs::StdFs);
        let mut store = LogStore::open(dir.path(), Arc::clone(&fs)).unwrap_or_else(|e| panic!("{e}"));
        let mut lingering = store.clone();
        let vote = Vote::new(3, 1);
        store.save_vote(&vote).await.unwrap_or_else(|e| panic!("{e}"));
        store.close().await;
        let mut reopened = LogStore::open(dir.path(), Arc::clone(&fs)).unwrap_or_else(|e| panic!("reopen: {e}"));
        assert_eq!(reopened.read_vote().await.unwrap_or_else(|e| panic!("{e}")), Some(vote));
        assert!(lingering.save_vote(&Vote::new(4, 1)).await.is_err(), "a write after the close must fail");
        // Closing twice (or a clone after the store closed) returns at once.
        lingering.close().await;
        store.close().await;
        reopened.close().await;
    }
}
