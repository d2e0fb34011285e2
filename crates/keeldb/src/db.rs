//! The database handle: opening (identity check, lock, recovery), transactions, checkpoints,
//! the background worker (periodic fsync, automatic checkpoints, version collection), stats
//! and close.
//!
//! `Inner` is the shared state every transaction and the background worker reach through an
//! `Arc`. The write path itself (sequencer, gather queue, WAL writer, publication, poison) is
//! the [`Committer`] in `commit/`, which never calls back into this module.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::accounting::Accounting;
use crate::checkpoint_stream::{ExportInfo, InstallOptions};
use crate::commit::{ApplyOutcome, Command, Committer, Published, Start};
use crate::cpu::TagStats;
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::files::{IDENTITY_FILE, IDENTITY_MAGIC, LOCK_FILE};
use crate::fs::{read_all, write_all_at, DirLock, FileSystem, OpenMode};
use crate::install::InstallInfo;
use crate::options::{Durability, Isolation, Options};
use crate::recovery::{self, RecoveryReport};
use crate::txn::{ReadTxn, Snapshot, WriteTxn};
use crate::types::LogPosition;
use crate::wal::WalWriter;

const IDS_TABLE: &str = "__keeldb/ids";
const ID_BLOCK: u64 = 4096;

/// The unused part of the id block reserved by this handle.
#[derive(Debug, Default)]
pub(crate) struct IdBlock {
    next: u64,
    end: u64,
}

/// Per-transaction overrides of the database defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TxnOptions {
    /// Durability for this transaction's commit.
    pub durability: Option<Durability>,
    /// Isolation for this transaction.
    pub isolation: Option<Isolation>,
    /// A label (tenant, client, job) under which the database totals this transaction's CPU
    /// and latency; see [`Stats::accounting`].
    pub tag: Option<Arc<str>>,
    /// CPU time the transaction may use; past it, the operation that notices fails with
    /// [`Error::CpuBudgetExceeded`] and the transaction is rolled back. Overrides
    /// `Options::cpu_budget`.
    pub cpu_budget: Option<Duration>,
    /// Wall-clock time the transaction may run; past it, operations fail with
    /// [`Error::Timeout`]. Overrides `Options::txn_timeout`.
    pub timeout: Option<Duration>,
}

impl TxnOptions {
    /// Options that only set a tag.
    pub fn tagged(tag: &str) -> TxnOptions {
        TxnOptions { tag: Some(Arc::from(tag)), ..TxnOptions::default() }
    }
}

/// What a checkpoint wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The commit timestamp whose state the checkpoint holds.
    pub ts: u64,
    /// The checkpoint file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Entries written.
    pub entries: u64,
    /// WAL segments deleted afterwards.
    pub segments_removed: usize,
}

/// Per-table figures in [`Stats`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableStats {
    /// Table name.
    pub name: String,
    /// Live keys.
    pub keys: u64,
    /// Bytes of live keys and values.
    pub bytes: u64,
}

/// A snapshot of the database's counters and sizes.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Live tables.
    pub tables: Vec<TableStats>,
    /// Bytes in live WAL segments.
    pub wal_bytes: u64,
    /// Live WAL segments.
    pub wal_segments: u64,
    /// Bytes in retained checkpoints.
    pub checkpoint_bytes: u64,
    /// Timestamp of the newest checkpoint.
    pub checkpoint_ts: Option<u64>,
    /// Newest commit timestamp visible to readers.
    pub last_commit_ts: u64,
    /// Write transactions committed since open.
    pub commits: u64,
    /// Group-commit batches written since open.
    pub batches: u64,
    /// fdatasync calls on the WAL since open.
    pub wal_syncs: u64,
    /// Group-commit leaders that waited (bounded) for other active `sync` committers to queue
    /// before writing their batch. Zero while only one thread commits.
    pub gather_waits: u64,
    /// Of those waits, the ones that gave up on a committer that did not queue in time.
    pub gather_timeouts: u64,
    /// The state digest at `last_commit_ts`.
    pub digest: StateDigest,
    /// The recovery report from open.
    pub recovery: RecoveryReport,
    /// CPU and latency totals and histograms of finished transactions: untagged first, then
    /// one entry per tag, most CPU first.
    pub accounting: Vec<TagStats>,
    /// Whether CPU times are measured with a thread CPU clock (otherwise wall time stands in).
    pub thread_cpu_clock: bool,
    /// The history floor, when history is kept.
    pub history_floor: Option<u64>,
    /// Changes held by the change feed, and the bytes they hold (keys, values, overhead; the
    /// versions the index keeps for reads at past timestamps are not included).
    pub history_changes: u64,
    /// See `history_changes`.
    pub history_bytes: u64,
}

/// Shared state of one open database.
pub(crate) struct Inner {
    pub path: PathBuf,
    pub fs: Arc<dyn FileSystem>,
    pub options: Options,
    /// The write path; also owns what readers see ([`Published`]).
    pub committer: Committer,
    /// Retained checkpoints (timestamp, path), oldest first; held while one is written.
    pub checkpoint_lock: Mutex<Vec<(u64, PathBuf)>>,
    pub checkpoint_running: AtomicBool,
    /// The automatic checkpoint thread, if one was started; `close` joins it before it lets go
    /// of the directory lock.
    pub checkpoint_thread: Mutex<Option<JoinHandle<()>>>,
    recovery: RecoveryReport,
    worker: Mutex<Option<JoinHandle<()>>>,
    ids: Mutex<IdBlock>,
    pub accounting: Mutex<Accounting>,
    dir_lock: Mutex<Option<Box<dyn DirLock>>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Database").field("path", &self.path).field("visible_ts", &self.published().visible_ts).finish()
    }
}

/// An open KeelDB store. Cheap to clone and share between threads; every clone is the same
/// database. [`Database::close`] closes it for all clones.
#[derive(Debug, Clone)]
pub struct Database {
    inner: Arc<Inner>,
}

pub(crate) fn check_identity(fs: &dyn FileSystem, dir: &Path) -> Result<bool> {
    let ident = dir.join(IDENTITY_FILE);
    let not_a_dir = |e: std::io::Error, path: &Path| match e.kind() {
        std::io::ErrorKind::NotADirectory => {
            Error::NotAStore { path: dir.to_owned(), reason: "it is a file, not a directory".into() }
        }
        _ => Error::io(path, e),
    };
    if !fs.exists(&ident).map_err(|e| not_a_dir(e, &ident))? {
        let names = fs.list_dir(dir).map_err(|e| not_a_dir(e, dir))?;
        // A crash during creation can leave the lock and an empty first segment behind.
        if names.iter().all(|n| crate::files::is_creation_leftover(n)) {
            return Ok(false);
        }
        return Err(Error::NotAStore {
            path: dir.to_owned(),
            reason: format!("the directory is not empty and has no {IDENTITY_FILE} file"),
        });
    }
    let bytes = fs.open(&ident, OpenMode::Read).and_then(|f| read_all(f.as_ref())).map_err(|e| Error::io(&ident, e))?;
    if bytes.get(..8) != Some(&IDENTITY_MAGIC[..]) || bytes.len() != 16 {
        return Err(Error::NotAStore {
            path: dir.to_owned(),
            reason: format!("{IDENTITY_FILE} has unexpected contents"),
        });
    }
    let version = crate::codec::le_u32(&bytes, 8).unwrap_or(0);
    let crc = crate::codec::le_u32(&bytes, 12).unwrap_or(0);
    if crc != crc32c::crc32c(bytes.get(..12).unwrap_or_default()) {
        return Err(Error::corruption(&ident, 12, "identity file checksum mismatch"));
    }
    if version != crate::FORMAT_VERSION {
        return Err(Error::UnsupportedVersion {
            path: dir.to_owned(),
            found: version,
            supported: crate::FORMAT_VERSION,
        });
    }
    Ok(true)
}

/// Creates `dir` and any missing parents, then fsyncs each new directory's parent, so that a
/// power loss cannot take away the store's directory entry (and the commits inside it).
fn create_dir_durably(fs: &dyn FileSystem, dir: &Path) -> Result<()> {
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(p) = cur {
        if p.as_os_str().is_empty() || fs.exists(p).map_err(|e| Error::io(p, e))? {
            break;
        }
        missing.push(p.to_owned());
        cur = p.parent();
    }
    fs.create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    for p in missing.iter().rev() {
        let parent = match p.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_owned(),
            _ => PathBuf::from("."),
        };
        fs.sync_dir(&parent).map_err(|e| Error::io(&parent, e))?;
    }
    Ok(())
}

/// Creates a new store: first WAL segment, then the identity file (temp, fsync, rename, fsync
/// directory). A crash before the rename leaves a directory that opens as new again.
fn create_store(fs: &Arc<dyn FileSystem>, dir: &Path) -> Result<()> {
    for name in fs.list_dir(dir).map_err(|e| Error::io(dir, e))? {
        if crate::files::parse_segment_name(&name).is_some() || name.ends_with(crate::files::TMP_SUFFIX) {
            let p = dir.join(name);
            fs.remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    drop(WalWriter::create(Arc::clone(fs), dir, 1, 0, 1, Vec::new(), u64::MAX)?);
    let mut bytes = IDENTITY_MAGIC.to_vec();
    bytes.extend_from_slice(&crate::FORMAT_VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let tmp = dir.join(crate::files::tmp_name(IDENTITY_FILE));
    let f = fs.open(&tmp, OpenMode::CreateNew).map_err(|e| Error::io(&tmp, e))?;
    write_all_at(f.as_ref(), &bytes, 0).map_err(|e| Error::io(&tmp, e))?;
    f.sync_data().map_err(|e| Error::io(&tmp, e))?;
    let ident = dir.join(IDENTITY_FILE);
    fs.rename(&tmp, &ident).map_err(|e| Error::io(&ident, e))?;
    fs.sync_dir(dir).map_err(|e| Error::io(dir, e))
}

impl Database {
    pub(crate) fn from_inner(inner: Arc<Inner>) -> Database {
        Database { inner }
    }

    /// Opens the store at `path`, creating the directory and an empty store if absent.
    /// Recovers from the newest valid checkpoint and the WAL; see [`Database::recovery_report`].
    pub fn open(path: impl AsRef<Path>, options: Options) -> Result<Database> {
        let dir = path.as_ref().to_owned();
        let fs = Arc::clone(&options.fs);
        // Checked before anything touches the file system: an empty path would otherwise
        // resolve to the working directory and leave a LOCK file there.
        if dir.as_os_str().is_empty() {
            return Err(Error::InvalidArgument("the store path is empty".into()));
        }
        options.durability.validate()?;
        if fs.exists(&dir).map_err(|e| Error::io(&dir, e))? {
            check_identity(fs.as_ref(), &dir)?;
        } else {
            create_dir_durably(fs.as_ref(), &dir)?;
        }
        let lock = fs.lock_exclusive(&dir.join(LOCK_FILE)).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock => Error::Locked(dir.clone()),
            _ => Error::io(dir.join(LOCK_FILE), e),
        })?;
        if !check_identity(fs.as_ref(), &dir)? {
            create_store(&fs, &dir)?;
        }
        let rec = recovery::recover(&fs, &dir, options.wal_segment_bytes.max(4096), options.keep_history)?;
        let (fs_for_acct, dir_for_acct) = (Arc::clone(&fs), dir.clone());
        let mut state = rec.state;
        let history = state.history.take();
        let start = Start {
            last_ts: rec.last_ts,
            wal: rec.wal,
            catalog: state.catalog,
            digest: state.digest,
            live_tables: state.live,
            next_table_id: state.next_table_id,
            applied: state.applied,
        };
        let committer = Committer::new(dir.clone(), Arc::clone(&fs), &options, start);
        let inner = Arc::new(Inner {
            path: dir,
            fs,
            committer,
            checkpoint_lock: Mutex::new(rec.checkpoints),
            checkpoint_running: AtomicBool::new(false),
            checkpoint_thread: Mutex::new(None),
            recovery: rec.report,
            worker: Mutex::new(None),
            ids: Mutex::new(IdBlock::default()),
            accounting: Mutex::new(Accounting::load(fs_for_acct.as_ref(), &dir_for_acct).unwrap_or_default()),
            dir_lock: Mutex::new(Some(lock)),
            options,
        });
        if let Some(replayed) = history.filter(|_| inner.options.keep_history) {
            // Recovery rebuilt the versions at or above the floor and the changes after it
            // (history_persist.rs): the feed and the floor continue from them.
            let view = inner.published();
            view.history.start(replayed.floor);
            view.history.record(replayed.changes.into_iter());
            view.registry.restore_floor(replayed.floor);
        }
        if inner.options.background_threads {
            let weak = Arc::downgrade(&inner);
            let schedule = Arc::clone(&inner.committer.schedule);
            let handle = std::thread::Builder::new()
                .name("keeldb-worker".into())
                .spawn(move || crate::maintenance::worker_loop(weak, schedule))
                .map_err(|e| Error::io(&inner.path, e))?;
            *inner.worker.lock() = Some(handle);
        }
        Ok(Database { inner })
    }

    /// The store's directory.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Starts a read-only transaction at the newest visible commit.
    pub fn begin_read(&self) -> Result<ReadTxn> {
        self.begin_read_with(TxnOptions::default())
    }

    /// Starts a read-only transaction with a tag, CPU budget or timeout (durability and
    /// isolation do not apply to reads).
    pub fn begin_read_with(&self, opts: TxnOptions) -> Result<ReadTxn> {
        let (budget, timeout) = self.limits(&opts);
        Ok(ReadTxn::new(Snapshot::take(&self.inner)?, opts.tag, budget, timeout))
    }

    fn limits(&self, opts: &TxnOptions) -> (Option<Duration>, Option<Duration>) {
        (opts.cpu_budget.or(self.inner.options.cpu_budget), opts.timeout.or(self.inner.options.txn_timeout))
    }

    /// Starts a write transaction with the database's default durability and isolation.
    pub fn begin_write(&self) -> Result<WriteTxn> {
        self.begin_write_with(TxnOptions::default())
    }

    /// Starts a write transaction with per-transaction overrides.
    pub fn begin_write_with(&self, opts: TxnOptions) -> Result<WriteTxn> {
        let durability = opts.durability.unwrap_or(self.inner.options.durability);
        durability.validate()?;
        let isolation = opts.isolation.unwrap_or(self.inner.options.isolation);
        let (budget, timeout) = self.limits(&opts);
        Ok(WriteTxn::new(Snapshot::take(&self.inner)?, durability, isolation, opts.tag, budget, timeout))
    }

    /// Runs `f` in a write transaction and commits, retrying on [`Error::Conflict`] with a short
    /// randomized backoff (up to 100 attempts). Any other error is returned as is.
    pub fn transact<T>(&self, mut f: impl FnMut(&mut WriteTxn) -> Result<T>) -> Result<T> {
        self.transact_with(TxnOptions::default(), |tx| f(tx))
    }

    /// [`Database::transact`] with per-transaction options.
    pub fn transact_with<T>(&self, opts: TxnOptions, mut f: impl FnMut(&mut WriteTxn) -> Result<T>) -> Result<T> {
        let mut attempt: u32 = 0;
        loop {
            let mut tx = self.begin_write_with(opts.clone())?;
            let out = f(&mut tx);
            let result = out.and_then(|value| tx.commit().map(|_| value));
            match result {
                Err(e) if e.is_retryable() && attempt < 100 => {
                    attempt += 1;
                    conflict_backoff(attempt);
                }
                other => return other,
            }
        }
    }

    /// A new unique, non-zero 64-bit id (for example for graph nodes), never returned before by
    /// this store, across reopens and crashes. Ids come from blocks of 4096 reserved by a small
    /// transaction of their own, so transactions that use ids never conflict on an allocator
    /// key. Ids are increasing within a handle; ids of a block not used before a crash are
    /// skipped. The reservation commits before any transaction can use its ids, so by the
    /// prefix guarantee a recovered commit never holds an id whose reservation was lost.
    pub fn next_id(&self) -> Result<u64> {
        loop {
            {
                let mut ids = self.inner.ids.lock();
                if ids.next < ids.end {
                    let id = ids.next;
                    ids.next += 1;
                    return Ok(id);
                }
            }
            // Relaxed is enough: the reservation's frame precedes every commit that uses its
            // ids, so whatever makes such a commit durable makes the reservation durable too.
            let relaxed = TxnOptions { durability: Some(Durability::Relaxed), ..TxnOptions::default() };
            let start = self.transact_with(relaxed, |tx| {
                let current =
                    match tx.get(IDS_TABLE, b"next")? {
                        Some(v) => u64::from_le_bytes(v.as_slice().try_into().map_err(|_| {
                            Error::corruption(&self.inner.path, 0, "id allocator record is not 8 bytes")
                        })?),
                        None => 1,
                    };
                let end =
                    current.checked_add(ID_BLOCK).ok_or_else(|| Error::InvalidArgument("ids exhausted".into()))?;
                tx.put_internal(IDS_TABLE, b"next", &end.to_le_bytes())?;
                Ok(current)
            })?;
            let mut ids = self.inner.ids.lock();
            if ids.next >= ids.end {
                ids.next = start;
                ids.end = start + ID_BLOCK;
            }
        }
    }

    /// Starts a read-only transaction at a past commit timestamp `ts`: it sees exactly the
    /// commits at or before `ts`. Fails with [`Error::Compacted`] below the history that is
    /// still kept (the history floor, or the oldest live snapshot when no history is kept) and
    /// [`Error::FutureTimestamp`] above the newest visible commit.
    pub fn begin_read_at(&self, ts: u64) -> Result<ReadTxn> {
        let opts = TxnOptions::default();
        let (budget, timeout) = self.limits(&opts);
        Ok(ReadTxn::new(Snapshot::take_at(&self.inner, ts)?, opts.tag, budget, timeout))
    }

    /// Keeps every version visible at `ts` or later, and every change after `ts` in the change
    /// feed, until this is called again with a later `ts` (which compacts history up to it).
    /// Starting history this way keeps versions from `ts` but the change feed only from now.
    /// Returns the floor in force. [`Error::Compacted`] when `ts` is below history already
    /// freed (the floor only moves forward), [`Error::FutureTimestamp`] above the newest commit.
    pub fn retain_history_since(&self, ts: u64) -> Result<u64> {
        self.inner.check_open()?;
        let floor = self
            .inner
            .published()
            .registry
            .set_floor(ts, &self.inner.published().visible_ts)
            .map_err(|e| at_error(ts, e))?;
        if self.inner.published().history.is_recording() {
            self.inner.published().history.trim_through(floor);
        } else {
            self.inner.committer.start_history();
        }
        Ok(floor)
    }

    /// Stops keeping history: versions no live snapshot reads are freed, the feed is dropped.
    pub fn discard_history(&self) {
        self.inner.published().registry.clear_floor();
        self.inner.published().history.stop();
    }

    /// The history floor (see [`Database::retain_history_since`]), if history is kept.
    pub fn history_floor(&self) -> Option<u64> {
        self.inner.published().registry.floor()
    }

    /// Up to `max` changes (whole commits where possible) of the commits after timestamp
    /// `after`, in commit order, from memory. Empty when nothing newer is visible yet (see
    /// [`Database::wait_for_commit_after`]). Needs history ([`Options::keep_history`] or
    /// [`Database::retain_history_since`]); [`Error::Compacted`] when `after` is older than the
    /// feed, [`Error::FutureTimestamp`] when it is newer than the newest visible commit.
    pub fn changes_since(&self, after: u64, max: usize) -> Result<Vec<crate::history::Change>> {
        self.inner.check_open()?;
        let latest = self.inner.published().visible_ts();
        if after > latest {
            return Err(Error::FutureTimestamp { requested: after, latest });
        }
        if !self.inner.published().history.is_recording() {
            return Err(Error::InvalidArgument(
                "no history is kept: set Options::keep_history or call retain_history_since".into(),
            ));
        }
        self.inner
            .published()
            .history
            .since(after, latest, max)
            .map_err(|start| Error::Compacted { requested: after, available: start })
    }

    /// A future that completes with the newest visible commit timestamp once it is greater
    /// than `after` (or with [`Error::Closed`]). It needs no particular async runtime.
    pub fn wait_for_commit_after(&self, after: u64) -> CommitWait {
        CommitWait { db: Arc::clone(&self.inner), after }
    }

    /// Blocks until a commit newer than `after` is visible or `timeout` passes; returns the
    /// newest visible commit timestamp either way.
    pub fn wait_for_commit_after_timeout(&self, after: u64, timeout: Duration) -> u64 {
        self.inner.published().history.wait_blocking(&self.inner.published().visible_ts, after, timeout)
    }

    /// Writes a checkpoint of the newest visible state now, then deletes WAL no longer needed.
    pub fn checkpoint(&self) -> Result<CheckpointInfo> {
        self.inner.check_open()?;
        self.inner.checkpoint()
    }

    /// Writes a consistent checkpoint of the newest visible state to `out`: exactly the bytes
    /// of a checkpoint file (header with the applied log position, CRC'd blocks, footer with
    /// the state digest). Reads a registered snapshot, so commits go on meanwhile and never
    /// wait for the export. See `docs/design/format.md` ("Checkpoint streams").
    pub fn export_checkpoint(&self, out: &mut impl std::io::Write) -> Result<ExportInfo> {
        crate::checkpoint_stream::export(&self.inner, out)
    }

    /// Replaces this store's whole state with the checkpoint stream `input` (as written by
    /// [`Database::export_checkpoint`]), with the default [`InstallOptions`].
    pub fn install_checkpoint(&self, input: &mut impl std::io::Read) -> Result<InstallInfo> {
        self.install_checkpoint_with(input, InstallOptions::default())
    }

    /// Replaces this store's whole state with the checkpoint stream `input` (a Raft follower
    /// installing a snapshot). The old state stays readable and durable until the stream is
    /// completely received and verified; a bad stream fails with [`Error::Corruption`] or
    /// [`Error::InvalidArgument`] and changes nothing. Then the new state is made durable and
    /// switched to atomically (a crash yields the old or the new state, never a mix).
    /// Afterwards [`Database::applied`] is the stream's position, and the change feed and
    /// history floor restart at the installed timestamp ([`Error::Compacted`] below it).
    /// Snapshots taken before keep reading the old state; write transactions begun before
    /// fail to commit with [`Error::Conflict`] ([`crate::ConflictReason::StateReplaced`]);
    /// commits wait while the new checkpoint is written. See `docs/design/recovery.md`.
    pub fn install_checkpoint_with(
        &self,
        input: &mut impl std::io::Read,
        options: InstallOptions,
    ) -> Result<InstallInfo> {
        self.inner.committer.check_writable()?;
        let received = crate::checkpoint_stream::receive(input, &options)?;
        crate::install::install(&self.inner, received)
    }

    /// What recovery found when this database was opened.
    pub fn recovery_report(&self) -> RecoveryReport {
        self.inner.recovery.clone()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// Applies commands from a replicated log, in the order given, as one group: one WAL
    /// write for all of them (and one fdatasync under `sync`), each with its own commit
    /// timestamp, through the same pipeline as transactions. Each command's conditions are
    /// evaluated against the state produced by every commit before it, so every replica that
    /// applies the same log reaches the same state and outcomes; a command whose condition
    /// fails writes nothing but its position. Positions must increase (across calls too): a
    /// position at or before the last applied one is an `InvalidArgument` and writes nothing.
    /// Uses the database's default durability; see [`Database::apply_batch_with`].
    ///
    /// Determinism assumes the log is the store's only writer: transactions committed
    /// concurrently are ordered among the commands by arrival.
    pub fn apply_batch(&self, commands: Vec<(LogPosition, Command)>) -> Vec<Result<ApplyOutcome>> {
        self.apply_batch_with(self.inner.options.durability, commands)
    }

    /// [`Database::apply_batch`] with a durability for this group. A replicated state machine
    /// whose log store already syncs typically uses [`Durability::Relaxed`].
    pub fn apply_batch_with(
        &self,
        durability: Durability,
        commands: Vec<(LogPosition, Command)>,
    ) -> Vec<Result<ApplyOutcome>> {
        let check = || self.inner.check_open().and_then(|()| durability.validate());
        if check().is_err() {
            return commands.iter().map(|_| Err(check().err().unwrap_or(Error::Closed))).collect();
        }
        self.inner.committer.apply_commands(commands, durability)
    }

    /// The replicated-log position of the last command applied and visible (after open: the
    /// last one whose writes were recovered), or `None` if no command was ever applied.
    pub fn applied(&self) -> Option<LogPosition> {
        *self.inner.published().applied.lock()
    }

    /// The state digest at the newest visible commit.
    pub fn digest(&self) -> StateDigest {
        *self.inner.published().digest.lock()
    }

    /// Flushes the WAL (writing a clean-close mark), stops background work and releases the
    /// directory lock once every clone and transaction is gone. Later calls on any clone fail
    /// with [`Error::Closed`].
    pub fn close(self) -> Result<()> {
        self.inner.shutdown()
    }
}

pub(crate) fn at_error(requested: u64, e: crate::registry::AtError) -> Error {
    match e {
        crate::registry::AtError::Compacted { horizon } => Error::Compacted { requested, available: horizon },
        crate::registry::AtError::Future { latest } => Error::FutureTimestamp { requested, latest },
    }
}

/// Sleeps a random time below an exponentially growing cap (1 us, 2 us, ... 1 ms), so that
/// conflicting retriers spread out instead of colliding again. [`Database::transact`] uses it
/// between attempts; bindings with their own retry loop call it too.
pub fn conflict_backoff(attempt: u32) {
    let cap_us = 1u64 << attempt.min(10);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let mut x = u64::from(nanos) ^ (u64::from(attempt) << 32) ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::thread::sleep(Duration::from_micros(x % cap_us + 1));
}

impl Inner {
    /// The state readers see.
    pub(crate) fn published(&self) -> &Published {
        &self.committer.published
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        self.committer.check_open()
    }

    /// Forgets the unused part of this handle's id block: after an install, ids continue from
    /// the installed state's allocator record.
    pub(crate) fn reset_id_block(&self) {
        *self.ids.lock() = IdBlock::default();
    }

    fn stats(&self) -> Stats {
        let view = self.published();
        let snap = view.visible_ts();
        let tables = view
            .catalog
            .read()
            .live()
            .iter()
            .map(|t| {
                let d = t.data.read();
                TableStats { name: t.name.to_string(), keys: d.live_keys(), bytes: d.live_bytes() }
            })
            .collect();
        let (wal_bytes, wal_segments) = self.committer.wal_size();
        let counters = &self.committer.counters;
        let retained = self.checkpoint_lock.lock().clone();
        let history = self.published().history.footprint();
        let checkpoint_bytes =
            retained.iter().map(|(_, p)| self.fs.open(p, OpenMode::Read).and_then(|f| f.len()).unwrap_or(0)).sum();
        Stats {
            tables,
            wal_bytes,
            wal_segments,
            checkpoint_bytes,
            checkpoint_ts: retained.last().map(|(ts, _)| *ts),
            last_commit_ts: snap,
            commits: counters.commits.load(Ordering::Relaxed),
            batches: counters.batches.load(Ordering::Relaxed),
            wal_syncs: counters.wal_syncs.load(Ordering::Relaxed),
            gather_waits: counters.gather_waits.load(Ordering::Relaxed),
            gather_timeouts: counters.gather_timeouts.load(Ordering::Relaxed),
            digest: *view.digest.lock(),
            recovery: self.recovery.clone(),
            accounting: self.accounting.lock().snapshot(),
            thread_cpu_clock: crate::cpu::thread_cpu_supported(),
            history_floor: self.published().registry.floor(),
            history_changes: history.1 as u64,
            history_bytes: history.2 as u64,
        }
    }

    fn shutdown(&self) -> Result<()> {
        if self.committer.close() {
            return Err(Error::Closed);
        }
        self.committer.schedule.stop();
        // Every thread of this handle stops touching the directory before the lock goes: first
        // the worker (so it starts no new checkpoint), then the checkpoint thread it started,
        // then any checkpoint a caller is running on another clone (it holds `checkpoint_lock`
        // and sees `closed` when it takes it).
        let current = std::thread::current().id();
        let worker = self.worker.lock().take();
        if let Some(h) = worker.filter(|h| h.thread().id() != current) {
            let _ = h.join();
        }
        let checkpointer = self.checkpoint_thread.lock().take();
        if let Some(h) = checkpointer.filter(|h| h.thread().id() != current) {
            let _ = h.join();
        }
        let _no_checkpoint = self.checkpoint_lock.lock();
        // Waiters for new commits learn that none will come.
        self.published().history.notify();
        // A poisoned database cannot make its unsynced commits durable: say so.
        let result = match self.committer.poison_reason() {
            Some(why) => Err(Error::Poisoned(why.to_string())),
            None => self.committer.write_close_mark(),
        };
        self.save_accounting();
        // Release the directory last, even if transactions or clones still hold this handle.
        self.dir_lock.lock().take();
        result
    }

    /// Saves the accounting totals; best effort (they are informational).
    pub(crate) fn save_accounting(&self) {
        let acct = self.accounting.lock();
        let _ = acct.save(self.fs.as_ref(), &self.path);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing without `close()`: still make relaxed and periodic commits durable.
        self.committer.schedule.stop();
        if !self.committer.close() && !self.committer.is_poisoned() {
            let _ = self.committer.write_close_mark();
            self.save_accounting();
        }
    }
}

/// A future that completes with the newest visible commit timestamp once it is greater than
/// the timestamp it was created with. Runtime-agnostic: it stores the task's waker, and
/// publication wakes it.
#[derive(Debug)]
pub struct CommitWait {
    pub(crate) db: Arc<Inner>,
    pub(crate) after: u64,
}

impl std::future::Future for CommitWait {
    type Output = crate::Result<u64>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let view = self.db.published();
        let now = view.visible_ts();
        if now > self.after {
            return std::task::Poll::Ready(Ok(now));
        }
        if let Err(e) = self.db.check_open() {
            return std::task::Poll::Ready(Err(e));
        }
        view.history.register(cx.waker());
        // Checked again after registering, so a commit published in between is not missed.
        let now = view.visible_ts();
        if now > self.after {
            return std::task::Poll::Ready(Ok(now));
        }
        std::task::Poll::Pending
    }
}
