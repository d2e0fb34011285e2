//! The write path: the [`Committer`] owns everything between "a transaction asks to commit" and
//! "its writes are durable and visible".
//!
//! It owns the sequencer state (last timestamp, next LSN, table ids, the recent-writes conflict
//! index), the gather queue and in-order publication (`pipeline.rs`), the [`WalWriter`], the
//! durable LSN, the poison state, the commit counters and the periodic-sync schedule. It also
//! owns [`Published`], the state readers see (catalog, visible timestamp, snapshot registry,
//! digest), because only publication (and a whole-state replacement, `replace.rs`) may change
//! what is visible.
//!
//! It must not know about the database handle: nothing in `commit/` reaches `db.rs`, the
//! transaction types or recovery. `db.rs` builds a committer from what recovery returned and
//! calls it; transactions hand it a [`CommitRequest`]. The invariants it keeps (one order,
//! visible means durable, validation sees everything sequenced, dense timestamps) are stated in
//! `docs/ARCHITECTURE.md`.

mod apply;
mod conflicts;
mod future;
mod pipeline;
mod replace;
pub(crate) mod request;
mod waiter;
pub(crate) mod write_set;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

pub(crate) use self::apply::ApplyPart;
pub use self::apply::{ApplyOutcome, Command, Condition};
pub(crate) use self::future::AsyncCommit;
pub(crate) use self::pipeline::Pipeline;
pub(crate) use self::replace::{Quiesced, ReplaceError, Replacement};
pub(crate) use self::request::{CommitRequest, ReadItem, Sequencer, TableSet, TableWrites};
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::fs::{write_all_at, FileSystem, OpenMode};
use crate::index::Catalog;
use crate::options::Options;
use crate::registry::Registry;
use crate::types::LogPosition;
use crate::wal::{self, WalWriter};

/// The state readers see. Only the committer's publication changes the catalog's contents,
/// the digest and the visible timestamp; readers register snapshots in the registry.
#[derive(Debug)]
pub(crate) struct Published {
    /// Newest commit timestamp whose durability condition holds (and every earlier one's).
    pub visible_ts: AtomicU64,
    pub registry: Registry,
    pub catalog: RwLock<Catalog>,
    /// The digest as of `visible_ts`; publication holds the lock while applying a batch.
    pub digest: Mutex<StateDigest>,
    /// The replicated-log position applied as of `visible_ts`; changed under the digest lock.
    pub applied: Mutex<Option<LogPosition>>,
    /// The change feed (appended by publication) and the waiters for new commits.
    pub history: crate::history::History,
}

impl Published {
    /// Takes and registers a snapshot at the visible timestamp.
    pub fn acquire(&self) -> u64 {
        self.registry.acquire(&self.visible_ts)
    }

    /// Releases a snapshot taken by [`Published::acquire`].
    pub fn release(&self, ts: u64) {
        self.registry.release(ts);
    }

    /// The oldest timestamp any live or future snapshot can read at.
    pub fn horizon(&self) -> u64 {
        self.registry.horizon(&self.visible_ts)
    }

    pub fn visible_ts(&self) -> u64 {
        self.visible_ts.load(Ordering::Acquire)
    }

    /// A registered snapshot, and the digest and applied log position at exactly that
    /// timestamp.
    pub fn acquire_with_digest(&self) -> (u64, StateDigest, Option<LogPosition>) {
        let digest = self.digest.lock();
        (self.acquire(), *digest, *self.applied.lock())
    }
}

/// Counters since open.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub commits: AtomicU64,
    pub batches: AtomicU64,
    pub wal_syncs: AtomicU64,
    pub wal_bytes_since_checkpoint: AtomicU64,
    /// Leaders that waited for returning committers before writing (see `gather_queue`).
    pub gather_waits: AtomicU64,
    /// Gathers that stopped awaiting a committer that did not come back within the bound.
    pub gather_timeouts: AtomicU64,
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

    pub fn stop(&self) {
        let _d = self.deadline.lock();
        self.stop.store(true, Ordering::Release);
        self.wake.notify_all();
    }
}

/// What recovery hands the committer.
pub(crate) struct Start {
    pub last_ts: u64,
    pub wal: WalWriter,
    pub catalog: Catalog,
    pub digest: StateDigest,
    pub live_tables: crate::types::FastMap<Arc<str>, u32>,
    pub next_table_id: u32,
    pub applied: Option<LogPosition>,
}

/// Owns the write path of one open database; see the module comment.
pub(crate) struct Committer {
    dir: PathBuf,
    fs: Arc<dyn FileSystem>,
    commit_delay: Duration,
    background_sync: bool,
    pub published: Published,
    sequencer: Mutex<Sequencer>,
    pipeline: Pipeline,
    wal: Mutex<WalWriter>,
    /// Every WAL byte before this LSN is known to be on stable storage.
    durable_lsn: AtomicU64,
    poisoned: Mutex<Option<Arc<str>>>,
    is_poisoned: AtomicBool,
    closed: AtomicBool,
    pub counters: Counters,
    pub schedule: Arc<SyncSchedule>,
}

impl std::fmt::Debug for Committer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Committer").field("visible_ts", &self.published.visible_ts).finish_non_exhaustive()
    }
}

impl Committer {
    pub fn new(dir: PathBuf, fs: Arc<dyn FileSystem>, options: &Options, start: Start) -> Committer {
        let end_lsn = start.wal.end_lsn();
        Committer {
            dir,
            fs,
            commit_delay: options.commit_delay,
            background_sync: options.background_threads,
            published: Published {
                visible_ts: AtomicU64::new(start.last_ts),
                registry: Registry::default(),
                catalog: RwLock::new(start.catalog),
                digest: Mutex::new(start.digest),
                applied: Mutex::new(start.applied),
                history: crate::history::History::default(),
            },
            sequencer: Mutex::new(Sequencer::new(
                start.last_ts,
                end_lsn,
                start.live_tables,
                start.next_table_id,
                start.applied,
            )),
            pipeline: Pipeline::default(),
            wal: Mutex::new(start.wal),
            durable_lsn: AtomicU64::new(end_lsn),
            poisoned: Mutex::new(None),
            is_poisoned: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            counters: Counters::default(),
            schedule: Arc::new(SyncSchedule::default()),
        }
    }

    /// Refuses new commits from now on. Returns whether it was already closed.
    pub fn close(&self) -> bool {
        self.closed.swap(true, Ordering::AcqRel)
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub fn is_poisoned(&self) -> bool {
        self.is_poisoned.load(Ordering::Acquire)
    }

    /// Why the database was poisoned, if it was.
    pub fn poison_reason(&self) -> Option<Arc<str>> {
        if !self.is_poisoned() {
            return None;
        }
        self.poisoned.lock().clone()
    }

    pub fn check_open(&self) -> Result<()> {
        if self.is_closed() {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// Whether a commit may be sequenced now, as a typed failure.
    fn refusal(&self) -> Option<waiter::Failure> {
        if self.is_closed() {
            return Some(waiter::Failure::Closed);
        }
        self.poison_reason().map(waiter::Failure::Poisoned)
    }

    pub fn check_writable(&self) -> Result<()> {
        match self.refusal() {
            Some(f) => Err(f.to_error()),
            None => Ok(()),
        }
    }

    /// Refuses writes until reopen, and leaves the `POISONED` marker for the next open.
    pub fn poison(&self, why: &str) -> Arc<str> {
        let mut p = self.poisoned.lock();
        let reason = match &*p {
            Some(first) => Arc::clone(first),
            None => {
                // Best effort: tells the next open that the page cache may not match the disk.
                // It records the durable LSN: every WAL byte below it was synced by an fdatasync
                // that succeeded, so recovery never needs to rewrite (and risk) those bytes.
                let marker = self.dir.join(crate::files::POISON_MARKER);
                if let Ok(f) = self.fs.open(&marker, OpenMode::CreateNew) {
                    let durable = self.durable_lsn.load(Ordering::Acquire);
                    let _ = write_all_at(f.as_ref(), format!("durable_lsn {durable}\n{why}\n").as_bytes(), 0);
                }
                let reason: Arc<str> = Arc::from(why);
                *p = Some(Arc::clone(&reason));
                reason
            }
        };
        self.is_poisoned.store(true, Ordering::Release);
        reason
    }

    /// fdatasyncs the WAL up to what has been written, outside the WAL lock.
    pub fn sync_wal(&self) -> Result<()> {
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
                self.poison(&err.to_string());
                Err(err)
            }
        }
    }

    /// Seals the current segment (if it holds frames) so the WAL up to here can be deleted once
    /// a checkpoint covers it. A failure poisons.
    pub fn seal_segment(&self) -> Result<()> {
        let mut wal = self.wal.lock();
        if wal.end_lsn() > wal.current().start_lsn {
            if let Err(e) = wal.roll() {
                self.poison(&e.to_string());
                return Err(e);
            }
        }
        Ok(())
    }

    /// Deletes sealed segments whose every commit is at or below `ts`.
    pub fn remove_sealed_through(&self, ts: u64) -> Result<usize> {
        self.wal.lock().remove_sealed_through(ts)
    }

    /// Bytes and segments of live WAL.
    pub fn wal_size(&self) -> (u64, u64) {
        let wal = self.wal.lock();
        (wal.total_bytes(), wal.sealed().len() as u64 + 1)
    }

    /// Forgets conflict records no live or future transaction can conflict with.
    pub fn trim_conflicts(&self) {
        // Live snapshots only: the history floor keeps versions, not conflict records.
        let horizon = self.published.registry.live_horizon(&self.published.visible_ts);
        self.sequencer.lock().conflicts.trim(horizon);
    }

    /// Validates a transaction without writes (a serializable reader) against every commit
    /// sequenced so far. Never touches the WAL.
    pub fn validate_read_only(&self, req: &CommitRequest) -> Result<()> {
        self.sequencer.lock().conflicts.validate(req).map_err(Error::from)
    }

    /// Waits for the pipeline to drain, then writes a mark frame carrying the digest and syncs:
    /// after a clean close every acknowledged commit is durable whatever its mode. Commits still
    /// queued with nobody leading (futures not polled yet) are led from here; once the database
    /// is closed they fail with `Closed`.
    pub fn write_close_mark(&self) -> Result<()> {
        let mut seq = self.sequencer.lock();
        while !self.pipeline.is_idle(seq.next_batch) {
            drop(seq);
            if self.try_take_leadership() {
                self.lead_while_work(false);
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
            seq = self.sequencer.lock();
        }
        // Every frame is made durable first, so the mark can claim every byte before it: damage to
        // any commit of a cleanly closed store is then corruption, never a torn tail (a `relaxed`
        // store's frames are otherwise claimed by nothing). The claim is repeated in the CLOSED
        // marker file, so one damaged range cannot remove both a commit and its claim.
        let digest = *self.published.digest.lock();
        let payload = wal::mark_payload(digest.0);
        let lsn = seq.next_lsn;
        let last_ts = seq.last_ts;
        let mut wal = self.wal.lock();
        let res = wal.sync().and_then(|()| {
            self.counters.wal_syncs.fetch_add(1, Ordering::Relaxed);
            self.durable_lsn.fetch_max(lsn, Ordering::AcqRel);
            let mut frame = Vec::with_capacity(wal::frame_bytes(payload.len()));
            wal::encode_frame(&mut frame, lsn, lsn, last_ts, &payload, crc32c::crc32c(&payload));
            wal.append(&frame, lsn, last_ts)?;
            seq.next_lsn += frame.len() as u64;
            wal.sync()?;
            let marker = crate::close_marker::CloseMarker { end_lsn: seq.next_lsn, last_ts, digest: digest.0 };
            crate::close_marker::write(self.fs.as_ref(), &self.dir, &marker)
        });
        if let Err(e) = &res {
            self.poison(&e.to_string());
        }
        res
    }
}
