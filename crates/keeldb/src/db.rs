//! The database handle: opening (identity check, lock, recovery), transactions, checkpoints,
//! the background worker (periodic fsync, automatic checkpoints, version collection), stats
//! and close.
//!
//! `Inner` is the shared state every transaction and the background worker reach through an
//! `Arc`. The commit path itself lives in `group_commit.rs`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::accounting::Accounting;
use crate::checkpoint::CheckpointWriter;
use crate::checkpoint_stream::{ExportInfo, InstallOptions};
use crate::cpu::TagStats;
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::fs::{read_all, write_all_at, DirLock, FileSystem, OpenMode};
use crate::group_commit::{CommitState, Pipeline};
use crate::index::{Catalog, KeyRange};
use crate::install::InstallInfo;
use crate::options::{Durability, Isolation, Options};
use crate::recovery::{self, RecoveryReport};
use crate::registry::Registry;
use crate::txn::{ReadTxn, Snapshot, WriteTxn};
use crate::wal::{self, WalWriter};

/// Name of the identity file that marks a directory as a KeelDB store.
pub(crate) const IDENTITY_FILE: &str = "KEELDB";
const IDENTITY_MAGIC: &[u8; 8] = b"KEELDB\0\0";
const LOCK_FILE: &str = "LOCK";
/// Tables whose names start with this prefix are the engine's own; `tables()` hides them.
pub const RESERVED_TABLE_PREFIX: &str = "__keeldb/";
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
    /// The state digest at `last_commit_ts`.
    pub digest: StateDigest,
    /// The recovery report from open.
    pub recovery: RecoveryReport,
    /// CPU and latency totals and histograms of finished transactions: untagged first, then
    /// one entry per tag, most CPU first.
    pub accounting: Vec<TagStats>,
    /// Whether CPU times are measured with a thread CPU clock (otherwise wall time stands in).
    pub thread_cpu_clock: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub commits: AtomicU64,
    pub batches: AtomicU64,
    pub wal_syncs: AtomicU64,
    pub wal_bytes_since_checkpoint: AtomicU64,
}

/// State for periodic durability: the earliest moment the WAL must be synced by.
#[derive(Debug, Default)]
pub(crate) struct SyncSchedule {
    pub deadline: Mutex<Option<Instant>>,
    pub wake: Condvar,
    pub stop: AtomicBool,
}

impl SyncSchedule {
    /// Asks for a WAL sync no later than `by`.
    pub fn request(&self, by: Instant) {
        let mut d = self.deadline.lock();
        if d.is_none_or(|cur| by < cur) {
            *d = Some(by);
            self.wake.notify_one();
        }
    }
    fn stop(&self) {
        let _d = self.deadline.lock();
        self.stop.store(true, Ordering::Release);
        self.wake.notify_all();
    }
}

/// Shared state of one open database.
pub(crate) struct Inner {
    pub path: PathBuf,
    pub fs: Arc<dyn FileSystem>,
    pub options: Options,
    /// Newest commit timestamp whose durability condition holds (and every earlier one's).
    pub visible_ts: AtomicU64,
    pub registry: Registry,
    pub catalog: RwLock<Catalog>,
    pub commit: Mutex<CommitState>,
    pub pipeline: Pipeline,
    pub wal: Mutex<WalWriter>,
    /// Every WAL byte before this LSN is known to be on stable storage.
    pub durable_lsn: AtomicU64,
    /// The digest as of `visible_ts`; the leader holds the lock while applying a batch.
    pub digest: Mutex<StateDigest>,
    pub poisoned: Mutex<Option<String>>,
    pub is_poisoned: AtomicBool,
    pub closed: AtomicBool,
    pub counters: Counters,
    pub schedule: Arc<SyncSchedule>,
    pub checkpoint_lock: Mutex<Vec<(u64, PathBuf)>>,
    pub checkpoint_running: AtomicBool,
    pub recovery: RecoveryReport,
    pub worker: Mutex<Option<JoinHandle<()>>>,
    pub ids: Mutex<IdBlock>,
    pub accounting: Mutex<Accounting>,
    pub dir_lock: Mutex<Option<Box<dyn DirLock>>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Database").field("path", &self.path).field("visible_ts", &self.visible_ts).finish()
    }
}

/// An open KeelDB store. Cheap to clone and share between threads; every clone is the same
/// database. [`Database::close`] closes it for all clones.
#[derive(Debug, Clone)]
pub struct Database {
    inner: Arc<Inner>,
}

fn check_identity(fs: &dyn FileSystem, dir: &Path) -> Result<bool> {
    let ident = dir.join(IDENTITY_FILE);
    if !fs.exists(&ident).map_err(|e| Error::io(&ident, e))? {
        let names = fs.list_dir(dir).map_err(|e| Error::io(dir, e))?;
        // A crash during creation can leave the lock and an empty first segment behind.
        let ours = |n: &String| {
            n == LOCK_FILE
                || n == crate::recovery::POISON_MARKER
                || wal::parse_segment_name(n).is_some()
                || n.ends_with(".tmp")
        };
        if names.iter().all(ours) {
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
        if wal::parse_segment_name(&name).is_some() || name.ends_with(".tmp") {
            let p = dir.join(name);
            fs.remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    drop(WalWriter::create(Arc::clone(fs), dir, 1, 0, 1, Vec::new(), u64::MAX)?);
    let mut bytes = IDENTITY_MAGIC.to_vec();
    bytes.extend_from_slice(&crate::FORMAT_VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let tmp = dir.join(format!("{IDENTITY_FILE}.tmp"));
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
        let rec = recovery::recover(&fs, &dir, options.wal_segment_bytes.max(4096))?;
        let (fs_for_acct, dir_for_acct) = (Arc::clone(&fs), dir.clone());
        let end_lsn = rec.wal.end_lsn();
        let commit = CommitState::new(rec.last_ts, end_lsn, &rec.state);
        let inner = Arc::new(Inner {
            path: dir,
            fs,
            visible_ts: AtomicU64::new(rec.last_ts),
            registry: Registry::default(),
            catalog: RwLock::new(rec.state.catalog),
            commit: Mutex::new(commit),
            pipeline: Pipeline::default(),
            wal: Mutex::new(rec.wal),
            durable_lsn: AtomicU64::new(end_lsn),
            digest: Mutex::new(rec.state.digest),
            poisoned: Mutex::new(None),
            is_poisoned: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            counters: Counters::default(),
            schedule: Arc::new(SyncSchedule::default()),
            checkpoint_lock: Mutex::new(rec.checkpoints),
            checkpoint_running: AtomicBool::new(false),
            recovery: rec.report,
            worker: Mutex::new(None),
            ids: Mutex::new(IdBlock::default()),
            accounting: Mutex::new(Accounting::load(fs_for_acct.as_ref(), &dir_for_acct).unwrap_or_default()),
            dir_lock: Mutex::new(Some(lock)),
            options,
        });
        if inner.options.background_threads {
            let weak = Arc::downgrade(&inner);
            let schedule = Arc::clone(&inner.schedule);
            let handle = std::thread::Builder::new()
                .name("keeldb-worker".into())
                .spawn(move || worker_loop(weak, schedule))
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
                tx.put(IDS_TABLE, b"next", &end.to_le_bytes())?;
                Ok(current)
            })?;
            let mut ids = self.inner.ids.lock();
            if ids.next >= ids.end {
                ids.next = start;
                ids.end = start + ID_BLOCK;
            }
        }
    }

    /// Writes a checkpoint of the newest visible state now, then deletes WAL no longer needed.
    pub fn checkpoint(&self) -> Result<CheckpointInfo> {
        self.inner.check_open()?;
        self.inner.checkpoint()
    }

    // --- Checkpoint streams (issue 10 item 5); the work is in checkpoint_stream.rs and install.rs.

    /// Writes a consistent checkpoint of the newest visible state to `out`: exactly the bytes
    /// of a checkpoint file (header, CRC'd blocks, footer with the state digest). Reads a
    /// registered snapshot, so commits go on meanwhile and never wait for the export.
    pub fn export_checkpoint(&self, out: &mut impl std::io::Write) -> Result<ExportInfo> {
        crate::checkpoint_stream::export(&self.inner, out)
    }

    /// Replaces this store's whole state with the checkpoint stream `input` (as written by
    /// [`Database::export_checkpoint`]), with the default [`InstallOptions`].
    pub fn install_checkpoint(&self, input: &mut impl std::io::Read) -> Result<InstallInfo> {
        self.install_checkpoint_with(input, InstallOptions::default())
    }

    /// Replaces this store's whole state with the checkpoint stream `input`. The old state stays
    /// readable and durable until the stream is completely received and verified; a bad stream
    /// fails with [`Error::Corruption`] or [`Error::InvalidArgument`] and changes nothing. Then
    /// the new state is made durable and switched to atomically (a crash yields the old or the
    /// new state, never a mix). Snapshots taken before keep reading the old state; write
    /// transactions begun before fail to commit with [`Error::Conflict`]; commits wait while the
    /// new checkpoint is written. See `docs/design/recovery.md`.
    pub fn install_checkpoint_with(
        &self,
        input: &mut impl std::io::Read,
        options: InstallOptions,
    ) -> Result<InstallInfo> {
        self.inner.check_writable()?;
        let received = crate::checkpoint_stream::receive(input, &options)?;
        crate::install::install(&self.inner, received)
    }

    // --- End of checkpoint streams.

    /// What recovery found when this database was opened.
    pub fn recovery_report(&self) -> RecoveryReport {
        self.inner.recovery.clone()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// The state digest at the newest visible commit.
    pub fn digest(&self) -> StateDigest {
        *self.inner.digest.lock()
    }

    /// Flushes the WAL (writing a clean-close mark), stops background work and releases the
    /// directory lock once every clone and transaction is gone. Later calls on any clone fail
    /// with [`Error::Closed`].
    pub fn close(self) -> Result<()> {
        self.inner.shutdown()
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
    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        Ok(())
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        self.check_open()?;
        if self.is_poisoned.load(Ordering::Acquire) {
            let why = self.poisoned.lock().clone().unwrap_or_default();
            return Err(Error::Poisoned(why));
        }
        Ok(())
    }

    pub(crate) fn poison(&self, why: String) {
        let mut p = self.poisoned.lock();
        if p.is_none() {
            // Best effort: tells the next open that the page cache may not match the disk.
            // It records the durable LSN: every WAL byte below it was synced by an fdatasync
            // that succeeded, so recovery never needs to rewrite (and risk) those bytes.
            let marker = self.path.join(crate::recovery::POISON_MARKER);
            if let Ok(f) = self.fs.open(&marker, OpenMode::CreateNew) {
                let durable = self.durable_lsn.load(Ordering::Acquire);
                let _ = write_all_at(f.as_ref(), format!("durable_lsn {durable}\n{why}\n").as_bytes(), 0);
            }
            *p = Some(why);
        }
        self.is_poisoned.store(true, Ordering::Release);
    }

    /// fdatasyncs the WAL up to what has been written, outside the WAL lock.
    pub(crate) fn sync_wal(&self) -> Result<()> {
        let (file, end, path) = {
            let wal = self.wal.lock();
            (wal.file(), wal.end_lsn(), wal.current().path.clone())
        };
        if self.durable_lsn.load(Ordering::Acquire) >= end {
            return Ok(());
        }
        match file.sync_data() {
            Ok(()) => {
                self.counters.wal_syncs.fetch_add(1, Ordering::Relaxed);
                self.durable_lsn.fetch_max(end, Ordering::AcqRel);
                Ok(())
            }
            Err(e) => {
                let err = Error::io(path, e);
                self.poison(err.to_string());
                Err(err)
            }
        }
    }

    pub(crate) fn checkpoint(&self) -> Result<CheckpointInfo> {
        let mut retained = self.checkpoint_lock.lock();
        // A poisoned WAL may end in a fragment or a hole the kernel dropped after a failed
        // fsync; sealing it (or deleting WAL on the strength of a new checkpoint) would turn a
        // torn tail into corruption of a sealed segment.
        self.check_writable()?;
        // Seal the current segment so that the WAL up to here can be deleted later.
        {
            let mut wal = self.wal.lock();
            if wal.end_lsn() > wal.current().start_lsn {
                if let Err(e) = wal.roll() {
                    self.poison(e.to_string());
                    return Err(e);
                }
            }
        }
        let (snap, expected) = {
            let digest = self.digest.lock();
            (self.registry.acquire(&self.visible_ts), *digest)
        };
        let release = scopeguard(|| self.registry.release(snap));
        if retained.last().is_some_and(|(ts, _)| *ts == snap) {
            drop(release);
            let (ts, path) = retained.last().cloned().unwrap_or_default();
            let bytes = self.fs.open(&path, OpenMode::Read).and_then(|f| f.len()).unwrap_or(0);
            return Ok(CheckpointInfo { ts, path, bytes, entries: 0, segments_removed: 0 });
        }
        let tables = {
            let catalog = self.catalog.read();
            let mut ts: Vec<_> = catalog.all().into_iter().filter(|t| t.visible_at(snap)).collect();
            ts.sort_by_key(|t| t.id);
            ts
        };
        let next_id = tables.iter().map(|t| t.id + 1).max().unwrap_or(1);
        let mut writer = CheckpointWriter::create(Arc::clone(&self.fs), &self.path, snap, next_id)?;
        let mut entries = 0u64;
        for t in &tables {
            writer.table(t.id, &t.name)?;
            let mut range = KeyRange { start: std::ops::Bound::Unbounded, end: std::ops::Bound::Unbounded };
            loop {
                let (chunk, more) = t.data.read().scan_chunk(&range, false, snap, 1024);
                for (k, v) in &chunk {
                    writer.entry(t.id, k, v)?;
                    entries += 1;
                }
                match chunk.last() {
                    Some((k, _)) if more => range.start = std::ops::Bound::Excluded(k.clone()),
                    _ => break,
                }
            }
        }
        if writer.digest() != expected {
            return Err(Error::corruption(
                &self.path,
                0,
                format!(
                    "checkpoint digest {} differs from the maintained digest {expected} at ts {snap}",
                    writer.digest()
                ),
            ));
        }
        let (path, bytes) = writer.finish()?;
        drop(release);
        self.counters.wal_bytes_since_checkpoint.store(0, Ordering::Relaxed);
        retained.push((snap, path.clone()));
        // Keep this checkpoint and the previous one; the WAL the previous one needs stays too,
        // so a corrupt newest checkpoint can fall back to the older one plus the log.
        let mut segments_removed = 0;
        while retained.len() > 2 {
            let (_, old) = retained.remove(0);
            self.fs.remove_file(&old).map_err(|e| Error::io(&old, e))?;
        }
        if let Some((oldest_ts, _)) = retained.first() {
            if retained.len() == 2 {
                segments_removed = self.wal.lock().remove_sealed_through(*oldest_ts)?;
            }
        }
        self.fs.sync_dir(&self.path).map_err(|e| Error::io(&self.path, e))?;
        self.save_accounting();
        Ok(CheckpointInfo { ts: snap, path, bytes, entries, segments_removed })
    }

    fn stats(&self) -> Stats {
        let snap = self.visible_ts.load(Ordering::Acquire);
        let tables = self
            .catalog
            .read()
            .live()
            .iter()
            .map(|t| {
                let d = t.data.read();
                TableStats { name: t.name.to_string(), keys: d.live_keys(), bytes: d.live_bytes() }
            })
            .collect();
        let (wal_bytes, wal_segments) = {
            let wal = self.wal.lock();
            (wal.total_bytes(), wal.sealed().len() as u64 + 1)
        };
        let retained = self.checkpoint_lock.lock().clone();
        let checkpoint_bytes =
            retained.iter().map(|(_, p)| self.fs.open(p, OpenMode::Read).and_then(|f| f.len()).unwrap_or(0)).sum();
        Stats {
            tables,
            wal_bytes,
            wal_segments,
            checkpoint_bytes,
            checkpoint_ts: retained.last().map(|(ts, _)| *ts),
            last_commit_ts: snap,
            commits: self.counters.commits.load(Ordering::Relaxed),
            batches: self.counters.batches.load(Ordering::Relaxed),
            wal_syncs: self.counters.wal_syncs.load(Ordering::Relaxed),
            digest: *self.digest.lock(),
            recovery: self.recovery.clone(),
            accounting: self.accounting.lock().snapshot(),
            thread_cpu_clock: crate::cpu::thread_cpu_supported(),
        }
    }

    /// Collects versions and dropped tables no snapshot can see any more, a bounded chunk per
    /// table per call so the write lock is held only briefly.
    pub(crate) fn collect_garbage(&self) {
        let horizon = self.registry.horizon(&self.visible_ts);
        let tables = self.catalog.read().all();
        for t in tables {
            if t.data.read().pending_gc() > 0 {
                t.data.write().collect(horizon, 4096);
            }
        }
        self.catalog.write().collect(horizon);
    }

    fn shutdown(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Err(Error::Closed);
        }
        self.schedule.stop();
        let worker = self.worker.lock().take();
        if let Some(h) = worker {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        // A poisoned database cannot make its unsynced commits durable: say so.
        let result = if self.is_poisoned.load(Ordering::Acquire) {
            Err(Error::Poisoned(self.poisoned.lock().clone().unwrap_or_default()))
        } else {
            self.write_close_mark()
        };
        self.save_accounting();
        // Release the directory now, even if transactions or clones still hold this handle.
        self.dir_lock.lock().take();
        result
    }

    /// Saves the accounting totals; best effort (they are informational).
    fn save_accounting(&self) {
        let acct = self.accounting.lock();
        let _ = acct.save(self.fs.as_ref(), &self.path);
    }

    /// Waits for the commit pipeline to drain, then writes a mark frame carrying the digest and
    /// syncs: after a clean close every acknowledged commit is durable whatever its mode.
    fn write_close_mark(&self) -> Result<()> {
        let mut cs = self.commit.lock();
        while !self.pipeline.is_idle(cs.next_batch) {
            drop(cs);
            std::thread::sleep(Duration::from_micros(200));
            cs = self.commit.lock();
        }
        let digest = *self.digest.lock();
        let payload = wal::mark_payload(digest.0);
        let mut frame = Vec::new();
        let lsn = cs.next_lsn;
        let last_ts = cs.last_ts;
        wal::encode_frame(
            &mut frame,
            lsn,
            self.durable_lsn.load(Ordering::Acquire),
            last_ts,
            &payload,
            crc32c::crc32c(&payload),
        );
        cs.next_lsn += frame.len() as u64;
        let mut wal = self.wal.lock();
        let res = wal.append(&frame, lsn, last_ts).and_then(|()| wal.sync());
        if let Err(e) = &res {
            self.poison(e.to_string());
        }
        res
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing without `close()`: still make relaxed and periodic commits durable.
        self.schedule.stop();
        if !self.closed.swap(true, Ordering::AcqRel) && !self.is_poisoned.load(Ordering::Acquire) {
            let _ = self.write_close_mark();
            self.save_accounting();
        }
    }
}

struct Guard<F: FnOnce()>(Option<F>);
impl<F: FnOnce()> Drop for Guard<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}
fn scopeguard<F: FnOnce()>(f: F) -> Guard<F> {
    Guard(Some(f))
}

/// The background worker: periodic fdatasync by deadline, automatic checkpoints by WAL volume,
/// and version collection. It sleeps on the schedule without holding the database, and holds a
/// strong reference only while working, so dropping the database ends it promptly.
fn worker_loop(weak: Weak<Inner>, schedule: Arc<SyncSchedule>) {
    let mut last_gc = Instant::now();
    loop {
        let due = {
            let mut deadline = schedule.deadline.lock();
            let tick = Instant::now() + Duration::from_millis(20);
            let until = deadline.map_or(tick, |d| d.min(tick));
            if until > Instant::now() && !schedule.stop.load(Ordering::Acquire) {
                schedule.wake.wait_until(&mut deadline, until);
            }
            let due = deadline.is_some_and(|d| d <= Instant::now());
            if due {
                *deadline = None;
            }
            due
        };
        if schedule.stop.load(Ordering::Acquire) {
            return;
        }
        let Some(db) = weak.upgrade() else { return };
        if due {
            let _ = db.sync_wal();
        }
        let threshold = db.options.checkpoint_wal_bytes;
        let wal_bytes = db.counters.wal_bytes_since_checkpoint.load(Ordering::Relaxed);
        if threshold > 0
            && wal_bytes >= threshold
            && !db.is_poisoned.load(Ordering::Acquire)
            && !db.checkpoint_running.swap(true, Ordering::AcqRel)
        {
            // On its own thread, so a long checkpoint never delays a periodic fdatasync.
            let weak_ckpt = Weak::clone(&weak);
            let spawned = std::thread::Builder::new().name("keeldb-checkpoint".into()).spawn(move || {
                if let Some(db) = weak_ckpt.upgrade() {
                    if !db.closed.load(Ordering::Acquire) {
                        let _ = db.checkpoint();
                    }
                    db.checkpoint_running.store(false, Ordering::Release);
                }
            });
            if spawned.is_err() {
                db.checkpoint_running.store(false, Ordering::Release);
            }
        }
        if last_gc.elapsed() >= Duration::from_millis(50) {
            db.collect_garbage();
            db.commit.lock().trim(&db.registry, &db.visible_ts);
            last_gc = Instant::now();
        }
    }
}
