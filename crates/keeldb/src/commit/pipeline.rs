//! Group commit: the gather queue, the leader, the WAL batch, and in-order publication.
//!
//! Flat combining with a pipelined fdatasync. A committer pushes its write set onto a small
//! queue and parks. If no leader is gathering, it becomes the leader: it takes the whole
//! queue, and under the sequencer lock validates each commit against every commit sequenced
//! before it (visible or not), gives it the next timestamp and encodes its WAL frame, so commit
//! order, WAL order and timestamp order are one order. It writes the batch with one `write`
//! and, when any commit in it asks for `sync`, one `fdatasync`; commits arriving meanwhile
//! queue up. Then it hands gathering to one of them, so the next batch is validated, written
//! and synced while this one is applied and its committers are woken. Only one fdatasync is in
//! flight at a time (handing off before it made batches of one). Batches publish strictly in
//! order: a finished batch is marked ready, and whoever holds the publish lock applies every
//! ready batch in sequence to the index, advances the visible timestamp and wakes their
//! committers, so no thread waits for a particular other one to be scheduled.
//!
//! The gather: with one fdatasync in flight, a few writers would alternate (two writers: one
//! commit per fdatasync, each waking the other). So a leader about to write a `sync` batch first
//! waits for the blocking committers whose `sync` commits were just published and that have not
//! queued again (the committers known to be active), at most half a typical fdatasync, only
//! while they keep arriving, and only when they are few (at most four per core; more writers
//! already fill two alternating batches). There is no timer otherwise: a lone writer is never
//! awaited (its own thread is excluded), a writer that went idle is awaited at most once, and
//! futures never wait (they batch by yielding, `future.rs`).
//!
//! A failed write or fsync poisons the database: that batch and every later one fail, nothing
//! of them becomes visible, and later commits are refused until reopen. This module never
//! reaches the database handle; it only uses the committer's own state.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::apply::BatchOverlay;
use super::request::{CommitRequest, Sequencer, TableApply};
use super::waiter::{Failure, Outcome, Slot, Waiter};
use super::Committer;
use crate::error::{Error, Result};
use crate::fs::FileHandle;
use crate::index::Table;
use crate::options::Durability;
use crate::types::LogPosition;

/// A validated commit in a batch.
#[derive(Debug)]
struct Pending {
    ts: u64,
    tables: Vec<TableApply>,
    durability: Durability,
    waiter: Arc<Waiter>,
    /// For a command from a replicated log: its position, and the condition that failed.
    position: Option<LogPosition>,
    failed_condition: Option<usize>,
}

/// Keeps a transaction's snapshot registered until its commit is validated, so conflict
/// records it must be checked against cannot be trimmed meanwhile. A blocking committer's own
/// transaction does this; a future that may be dropped before validation hands one over.
pub(crate) type SnapshotPin = Box<dyn Send>;

/// A commit request waiting for a leader.
struct Queued {
    req: CommitRequest,
    waiter: Arc<Waiter>,
    pin: Option<SnapshotPin>,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queued").field("req", &self.req).field("waiter", &self.waiter).finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Gather {
    pending: Vec<Queued>,
    /// Someone holds leadership: an active leader, or an async reservation (below).
    leader_active: bool,
    /// Leadership is held by a future that yielded once before leading (so that the other
    /// ready tasks of its runtime queue up behind it) and has not started yet. Anyone who
    /// would otherwise wait for it may take it over: a thread that blocks, a task told to lead,
    /// `close`. The future then finds its reservation gone and waits as a follower. So a future
    /// that is never polled again, or whose thread blocks in a blocking commit, stalls nobody.
    reserved: Option<u64>,
    next_reservation: u64,
    /// Threads whose `sync` commits were published recently and that have not queued a commit
    /// since, with when they were woken: the committers known to be active. A leader about to
    /// write a `sync` batch waits (bounded) for them; see [`Committer::gather_queue`].
    returning: Vec<(ThreadId, Instant)>,
    /// A leader is waiting for returning committers: an arrival notifies `Pipeline::arrived`.
    gathering: bool,
}

/// At most this many returning committers are remembered (the oldest are forgotten first).
const RETURNING_MAX: usize = 256;

/// The longest a leader ever waits for returning committers, whatever the fdatasync costs.
const GATHER_MAX: Duration = Duration::from_millis(1);

impl Gather {
    /// Takes leadership when it is free or only reserved by a yielding future.
    fn take(&mut self) -> bool {
        if self.leader_active && self.reserved.is_none() {
            return false;
        }
        self.leader_active = true;
        self.reserved = None;
        true
    }

    /// The calling thread queued a commit: it is no longer awaited.
    fn arrive(&mut self, me: ThreadId, arrived: &Condvar) {
        if let Some(at) = self.returning.iter().position(|(id, _)| *id == me) {
            self.returning.swap_remove(at);
            if self.gathering {
                arrived.notify_one();
            }
        }
    }

    /// Remembers the threads of a published batch's `sync` commits as returning.
    fn note_returning(&mut self, threads: impl Iterator<Item = ThreadId>, now: Instant) {
        for id in threads {
            match self.returning.iter_mut().find(|(seen, _)| *seen == id) {
                Some(entry) => entry.1 = now,
                None => self.returning.push((id, now)),
            }
        }
        if self.returning.len() > RETURNING_MAX {
            self.returning.sort_by_key(|(_, at)| std::cmp::Reverse(*at));
            self.returning.truncate(RETURNING_MAX);
        }
    }
}

/// A batch whose I/O is done, waiting for the batches before it to publish.
#[derive(Debug)]
struct Ready {
    commits: Vec<Pending>,
    result: std::result::Result<(), Failure>,
}

#[derive(Debug, Default)]
struct Publish {
    /// Sequence number of the next batch to publish.
    next_batch: u64,
    /// Batches done with their I/O, by sequence number.
    ready: BTreeMap<u64, Ready>,
    /// Set when a batch failed; every later batch fails too.
    failed: Option<Failure>,
}

/// The queue committers join and the in-order publication of finished batches.
#[derive(Debug)]
pub(crate) struct Pipeline {
    gather: Mutex<Gather>,
    /// Signalled when an awaited committer queues while a leader is gathering.
    arrived: Condvar,
    publish: Mutex<Publish>,
    /// A moving average of the WAL fdatasync's duration, in nanoseconds: bounds the gather.
    sync_ns: AtomicU64,
    /// The most returning committers a leader waits for (four per core).
    gather_threads_max: usize,
    /// Buffers of the last batch, emptied, for the next leader: a batch's queue and frames grow
    /// to kilobytes, and were allocated afresh, by doubling, for every batch.
    spare: Mutex<Spare>,
}

#[derive(Debug, Default)]
struct Spare {
    queue: Vec<Queued>,
    frames: Vec<u8>,
    commits: Vec<Pending>,
}

/// A recycled batch vector with room for more commits than this is dropped instead.
const SPARE_COMMITS_MAX: usize = 1024;

/// A recycled frames buffer larger than this is dropped instead (after an unusually large
/// batch, so it does not stay allocated).
const SPARE_FRAMES_MAX: usize = 4 << 20;

impl Default for Pipeline {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        Pipeline {
            gather: Mutex::default(),
            arrived: Condvar::new(),
            publish: Mutex::default(),
            sync_ns: AtomicU64::new(0),
            gather_threads_max: 4 * cores,
            spare: Mutex::default(),
        }
    }
}

impl Pipeline {
    /// Runs `f` holding the publish lock: meanwhile no batch is between its apply and its
    /// visibility (a state replacement swaps what readers see under it).
    pub(super) fn with_publication_held<R>(&self, f: impl FnOnce() -> R) -> R {
        let _publishing = self.publish.lock();
        f()
    }

    /// Whether no commit is queued, gathering or waiting to publish, given the sequencer's
    /// next batch number.
    pub fn is_idle(&self, next_batch: u64) -> bool {
        let g = self.gather.lock();
        !g.leader_active && g.pending.is_empty() && self.publish.lock().next_batch == next_batch
    }

    /// Folds one fdatasync's duration into the moving average (weight 1/8).
    fn record_sync(&self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let old = self.sync_ns.load(Ordering::Relaxed);
        let new = if old == 0 { ns } else { old - old / 8 + ns / 8 };
        self.sync_ns.store(new, Ordering::Relaxed);
    }

    /// Takes the gather queue, leaving the last batch's emptied queue in its place.
    fn take_pending(&self, g: &mut Gather) -> Vec<Queued> {
        std::mem::replace(&mut g.pending, std::mem::take(&mut self.spare.lock().queue))
    }

    /// How long a leader may wait for returning committers: half a typical fdatasync (so a
    /// wait that finds nobody costs at most half a commit's latency, once), at most
    /// [`GATHER_MAX`].
    fn gather_bound(&self) -> Duration {
        Duration::from_nanos(self.sync_ns.load(Ordering::Relaxed) / 2).min(GATHER_MAX)
    }
}

/// A batch sequenced and encoded by its leader.
struct Batch {
    seq: u64,
    commits: Vec<Pending>,
    frames: Vec<u8>,
    first_lsn: u64,
}

/// The WAL file a batch was written to, the LSN the write reached and the file's path.
type Written = (Arc<dyn FileHandle>, u64, std::path::PathBuf);

impl Committer {
    /// Validates, logs and applies a write transaction; returns its commit timestamp once its
    /// durability condition holds and it is visible. Blocks the calling thread.
    pub fn submit(&self, req: CommitRequest) -> Result<u64> {
        self.check_writable()?;
        let waiter = Waiter::for_this_thread();
        if self.enqueue(req, &waiter, None, true)? {
            self.lead_while_work(true);
        }
        let outcome = self.wait_outcome(&waiter);
        Waiter::keep_for_this_thread(waiter);
        outcome.into_result()
    }

    /// Parks until the waiter's commit is decided, leading when told to.
    pub(super) fn wait_outcome(&self, waiter: &Waiter) -> Outcome {
        loop {
            match waiter.wait() {
                Slot::TryLead => {
                    if self.try_take_leadership() {
                        self.lead_while_work(true);
                    }
                }
                Slot::Done(outcome) => return outcome,
                Slot::Waiting => {}
            }
        }
    }

    /// Pushes several requests onto the gather queue at once, in order, so one leader takes
    /// them into one batch. Takes leadership if it is free; returns whether it did.
    pub(super) fn enqueue_many(&self, requests: Vec<(CommitRequest, Arc<Waiter>)>) -> Result<bool> {
        let mut g = self.pipeline.gather.lock();
        self.check_writable()?;
        g.pending.extend(requests.into_iter().map(|(req, waiter)| Queued { req, waiter, pin: None }));
        g.arrive(std::thread::current().id(), &self.pipeline.arrived);
        Ok(!g.pending.is_empty() && g.take())
    }

    /// Pushes a request onto the gather queue. With `claim`, takes leadership if it is free and
    /// returns whether the caller became the leader.
    pub(super) fn enqueue(
        &self,
        req: CommitRequest,
        waiter: &Arc<Waiter>,
        pin: Option<SnapshotPin>,
        claim: bool,
    ) -> Result<bool> {
        let mut g = self.pipeline.gather.lock();
        // Checked under the queue lock: close waits for this queue to drain.
        self.check_writable()?;
        g.pending.push(Queued { req, waiter: Arc::clone(waiter), pin });
        if !waiter.is_async() {
            g.arrive(std::thread::current().id(), &self.pipeline.arrived);
        }
        Ok(claim && g.take())
    }

    /// Takes leadership if nobody holds it and work is queued.
    pub(super) fn try_take_leadership(&self) -> bool {
        let mut g = self.pipeline.gather.lock();
        !g.pending.is_empty() && g.take()
    }

    /// For a future's first poll: reserves leadership if it is free and work is queued, and
    /// returns the reservation to claim on the next poll.
    pub(super) fn reserve_leadership(&self) -> Option<u64> {
        let mut g = self.pipeline.gather.lock();
        if g.leader_active || g.pending.is_empty() {
            return None;
        }
        g.next_reservation += 1;
        g.leader_active = true;
        g.reserved = Some(g.next_reservation);
        g.reserved
    }

    /// Turns a reservation into leadership; false when someone took it over meanwhile.
    pub(super) fn claim_reservation(&self, reservation: u64) -> bool {
        let mut g = self.pipeline.gather.lock();
        if g.reserved != Some(reservation) {
            return false;
        }
        g.reserved = None;
        true
    }

    /// Leads a batch, then keeps leading while work is queued and nobody else took over: a
    /// thread that is already running leads, instead of waiting for a woken one to be
    /// scheduled (with many runnable threads on few cores that wait dominated). Leadership that
    /// could not be handed to anyone (every queued committer is a dropped future) is kept.
    /// `may_gather`: the caller is a thread that may block (not a future on a runtime thread),
    /// so it may wait for returning committers before writing a batch.
    pub(super) fn lead_while_work(&self, may_gather: bool) {
        let mut rounds = 0;
        loop {
            if self.lead(may_gather) {
                continue;
            }
            rounds += 1;
            if rounds > 64 || !self.try_take_leadership() {
                return;
            }
        }
    }

    /// Leads one batch: everything queued now (the caller's own commit is in it). Returns
    /// whether the caller is still the leader (see [`Committer::release_gather`]).
    fn lead(&self, may_gather: bool) -> bool {
        if !self.commit_delay.is_zero() {
            std::thread::sleep(self.commit_delay);
        }
        let queued = self.gather_queue(may_gather);
        let Some(mut batch) = self.sequence(queued) else {
            return self.release_gather();
        };
        let last_ts = batch.commits.last().map_or(0, |p| p.ts);
        let needs_sync = batch.commits.iter().any(|p| p.durability.needs_sync());
        let written = self.write_frames(&batch.frames, batch.first_lsn, last_ts);
        if batch.frames.capacity() <= SPARE_FRAMES_MAX {
            self.pipeline.spare.lock().frames = std::mem::take(&mut batch.frames);
        }
        let result = written.and_then(|(file, end, path)| {
            if needs_sync {
                let started = Instant::now();
                file.sync_data().map_err(|e| Failure::Poisoned(self.poison(&Error::io(path, e).to_string())))?;
                self.pipeline.record_sync(started.elapsed());
                self.counters.wal_syncs.fetch_add(1, Ordering::Relaxed);
                self.durable_lsn.fetch_max(end, Ordering::AcqRel);
            }
            self.after_write(&batch, needs_sync)
        });
        // One fdatasync in flight at a time keeps batches large. From here the next leader
        // gathers, writes and syncs while this batch publishes and wakes its committers.
        let still_leading = self.release_gather();
        self.publish(batch, result);
        still_leading
    }

    /// Takes the gather queue. When it holds a `sync` commit and committers whose `sync`
    /// commits were just published have not queued again yet (other writers are known to be
    /// active and about to come back), first waits for them, at most
    /// [`Pipeline::gather_bound`] after each was woken: with one fdatasync in flight, two
    /// writers would otherwise alternate, one commit per fdatasync. A thread that does not
    /// come back within the bound is forgotten until it commits again, so a writer that went
    /// idle delays at most one batch, once. The leader's own thread is never awaited (it cannot
    /// queue while it leads), so a lone writer never waits.
    fn gather_queue(&self, may_gather: bool) -> Vec<Queued> {
        let mut g = self.pipeline.gather.lock();
        let me = std::thread::current().id();
        if let Some(at) = g.returning.iter().position(|(id, _)| *id == me) {
            g.returning.swap_remove(at);
        }
        let bound = self.pipeline.gather_bound();
        let wants_sync = || g.pending.iter().any(|q| q.req.durability.needs_sync());
        if !may_gather || g.returning.is_empty() || bound.is_zero() || !wants_sync() {
            return self.pipeline.take_pending(&mut g);
        }
        let started = Instant::now();
        g.returning.retain(|(_, at)| *at + bound > started);
        // Woken threads come back only as fast as the cores run them: past a few per core the
        // wait grows with their number, and the pipelined fdatasync already halves the writers
        // into two full batches, so the gather is only for a few writers.
        if g.returning.is_empty() || g.returning.len() > self.pipeline.gather_threads_max {
            return self.pipeline.take_pending(&mut g);
        }
        self.counters.gather_waits.fetch_add(1, Ordering::Relaxed);
        g.gathering = true;
        let give_up = started + bound;
        // Once someone has come back, the others are awaited only while they keep coming: on
        // a busy machine the last few woken threads may not be scheduled for a long time, and
        // the batch should not wait for them with most of it already queued.
        let gap = bound / 4;
        let mut stall = give_up;
        while !g.returning.is_empty() {
            let latest = g.returning.iter().map(|(_, at)| *at + bound).max().unwrap_or(give_up);
            let timed_out = self.pipeline.arrived.wait_until(&mut g, latest.min(give_up).min(stall)).timed_out();
            let now = Instant::now();
            if !timed_out {
                stall = now + gap;
                continue;
            }
            // Whoever did not come back within the bound went idle (or is slow): stop awaiting
            // them until they commit again. The first timeout ends the gather.
            g.returning.retain(|(_, at)| *at + bound > now);
            self.counters.gather_timeouts.fetch_add(1, Ordering::Relaxed);
            break;
        }
        g.gathering = false;
        self.pipeline.take_pending(&mut g)
    }

    /// Validates and encodes the queued commits in order; answers the ones that conflict.
    fn sequence(&self, mut queued: Vec<Queued>) -> Option<Batch> {
        let mut seq = self.sequencer.lock();
        let refused = self.refusal();
        let (mut commits, mut frames) = {
            let mut spare = self.pipeline.spare.lock();
            (std::mem::take(&mut spare.commits), std::mem::take(&mut spare.frames))
        };
        commits.reserve(queued.len());
        frames.clear();
        let first_lsn = seq.next_lsn;
        // Conditions of log commands see every earlier commit: the published index (once the
        // batches before this one are published) and this batch's earlier writes.
        let conditional = queued.iter().any(|q| q.req.apply.as_ref().is_some_and(|a| !a.conditions.is_empty()));
        let mut overlay = conditional.then(BatchOverlay::default);
        if conditional {
            self.wait_published(seq.last_ts);
        }
        // Released after the sequencer lock: a pin may hold the last reference to a snapshot.
        let mut pins = Vec::new();
        for Queued { req, waiter, pin } in queued.drain(..) {
            pins.extend(pin);
            if let Some(failure) = &refused {
                waiter.set(Slot::Done(Outcome::Failed(failure.clone())));
                continue;
            }
            let CommitRequest { mut tables, durability, apply, .. } = match self.admit(&seq, req) {
                Ok(req) => req,
                Err(outcome) => {
                    waiter.set(Slot::Done(outcome));
                    continue;
                }
            };
            let position = apply.as_ref().map(|a| a.position);
            let failed_condition = match (&apply, &overlay) {
                (Some(a), Some(o)) => self.first_failed_condition(&a.conditions, o),
                _ => None,
            };
            if failed_condition.is_some() {
                tables.clear();
            }
            let ts = seq.last_ts + 1;
            let before = frames.len();
            let (tables, mut payload) = seq.resolve(tables, ts, std::mem::take(&mut frames));
            if let Some(p) = position {
                payload.applied_position(p);
                seq.last_position = Some(p);
            }
            if let Some(o) = &mut overlay {
                o.record(&tables);
            }
            let durable = self.durable_lsn.load(Ordering::Acquire);
            frames = payload.finish_frame(seq.next_lsn, durable, ts);
            seq.next_lsn += (frames.len() - before) as u64;
            seq.last_ts = ts;
            commits.push(Pending { ts, tables, durability, waiter, position, failed_condition });
        }
        if seq.conflicts.wants_trim() {
            seq.conflicts.trim(self.published.horizon());
        }
        let number = seq.next_batch;
        seq.next_batch += u64::from(!commits.is_empty());
        drop(seq);
        drop(pins);
        self.pipeline.spare.lock().queue = queued;
        if commits.is_empty() {
            return None;
        }
        Some(Batch { seq: number, commits, frames, first_lsn })
    }

    /// First committer wins for a transaction; a log command instead must come after the last
    /// position sequenced (its conditions are checked by the caller).
    fn admit(&self, seq: &Sequencer, req: CommitRequest) -> std::result::Result<CommitRequest, Outcome> {
        match &req.apply {
            None => seq.conflicts.validate(&req).map_err(Outcome::Conflict)?,
            Some(a) => {
                if let Some(last) = seq.last_position.filter(|last| a.position <= *last) {
                    return Err(Outcome::OutOfOrder { position: a.position, last });
                }
            }
        }
        Ok(req)
    }

    /// Gives up leadership. If work is queued, wakes its first live committer to try to lead;
    /// any committer that arrives first (or this one, after publishing) may lead instead. So
    /// whenever leadership drops with work queued, someone is on the way to lead it. When every
    /// queued committer is a dropped future, nobody is: then the caller keeps leadership and
    /// this returns true.
    pub(super) fn release_gather(&self) -> bool {
        let mut g = self.pipeline.gather.lock();
        if g.pending.is_empty() {
            g.leader_active = false;
            g.reserved = None;
            return false;
        }
        let Some(first) = g.pending.iter().position(|q| q.waiter.set(Slot::TryLead)) else { return true };
        g.leader_active = false;
        g.reserved = None;
        // An async committer may not be polled soon (its runtime thread may even be the one
        // blocked in a blocking commit behind it), so a queued blocking committer is told too:
        // whichever comes first leads, the other goes back to waiting.
        if g.pending.get(first).is_some_and(|q| q.waiter.is_async()) {
            if let Some(q) = g.pending.iter().skip(first + 1).find(|q| !q.waiter.is_async()) {
                q.waiter.set(Slot::TryLead);
            }
        }
        false
    }

    /// One write for the batch. Returns the file to sync, the LSN it reaches and its path.
    fn write_frames(&self, frames: &[u8], first_lsn: u64, last_ts: u64) -> std::result::Result<Written, Failure> {
        let mut wal = self.wal.lock();
        if let Some(why) = self.poison_reason() {
            return Err(Failure::Poisoned(why));
        }
        if let Err(e) = wal.append(frames, first_lsn, last_ts) {
            return Err(Failure::Poisoned(self.poison(&e.to_string())));
        }
        // A roll inside `append` synced the sealed segment.
        self.durable_lsn.fetch_max(wal.current().start_lsn, Ordering::AcqRel);
        self.counters.wal_bytes_since_checkpoint.fetch_add(frames.len() as u64, Ordering::Relaxed);
        Ok((wal.file(), wal.end_lsn(), wal.current().path.clone()))
    }

    /// Counters and the periodic-durability schedule, once a batch is written (and synced).
    fn after_write(&self, batch: &Batch, synced: bool) -> std::result::Result<(), Failure> {
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
        if self.background_sync {
            self.schedule.request(Instant::now() + interval);
            return Ok(());
        }
        // No background worker: sync inline once the oldest unsynced commit's interval is up.
        let mut d = self.schedule.deadline.lock();
        let by = *d.get_or_insert(Instant::now() + interval);
        if by <= Instant::now() {
            *d = None;
            drop(d);
            if self.sync_wal().is_err() {
                return Err(self.refusal().unwrap_or(Failure::Closed));
            }
        }
        Ok(())
    }

    /// Marks a batch ready and publishes every ready batch in sequence order: applies it (or
    /// fails it, when it or an earlier batch failed), advances the visible timestamp and wakes
    /// its committers. Whoever finds the next batch ready publishes it, so no thread ever waits
    /// for a particular other thread to be scheduled.
    fn publish(&self, batch: Batch, result: std::result::Result<(), Failure>) {
        // Usually this batch alone, next in sequence: it then skips the map, and `done` stays
        // in `first` (no allocation for either).
        let mut first: Option<Ready> = None;
        let mut more: Vec<Ready> = Vec::new();
        {
            let mut p = self.pipeline.publish.lock();
            let mut this = Some(Ready { commits: batch.commits, result });
            if batch.seq != p.next_batch {
                if let Some(ready) = this.take() {
                    p.ready.insert(batch.seq, ready);
                }
            }
            loop {
                let next = p.next_batch;
                let Some(mut ready) = this.take().or_else(|| p.ready.remove(&next)) else { break };
                ready.result = match (&p.failed, ready.result) {
                    (Some(failure), _) => Err(failure.clone()),
                    (None, Err(failure)) => {
                        p.failed = Some(failure.clone());
                        Err(failure)
                    }
                    (None, Ok(())) => Ok(()),
                };
                if ready.result.is_ok() {
                    self.apply_batch(&ready.commits);
                }
                p.next_batch += 1;
                match first {
                    None => first = Some(ready),
                    Some(_) => more.push(ready),
                }
            }
        }
        // Noted before anyone is woken, so a woken committer's next enqueue finds its entry.
        let returning = first.iter().chain(&more).filter(|r| r.result.is_ok()).flat_map(|r| r.commits.iter());
        let mut returning =
            returning.filter(|c| c.durability.needs_sync()).filter_map(|c| c.waiter.thread_id()).peekable();
        if returning.peek().is_some() {
            self.pipeline.gather.lock().note_returning(returning, Instant::now());
        }
        let mut emptied = None;
        for ready in first.into_iter().chain(more) {
            for c in &ready.commits {
                let outcome = match &ready.result {
                    Ok(()) if c.position.is_some() => {
                        Outcome::Applied { ts: c.ts, failed_condition: c.failed_condition }
                    }
                    Ok(()) => Outcome::Committed(c.ts),
                    Err(failure) => Outcome::Failed(failure.clone()),
                };
                c.waiter.set(Slot::Done(outcome));
            }
            if emptied.is_none() {
                emptied = Some(ready.commits);
            }
        }
        // The first batch's vector goes back for the next leader, emptied here, outside every
        // lock (its write sets and waiter references are dropped now).
        if let Some(mut commits) = emptied {
            commits.clear();
            if commits.capacity() <= SPARE_COMMITS_MAX {
                self.pipeline.spare.lock().commits = commits;
            }
        }
    }

    /// Applies a durable batch to the index in timestamp order, then makes it visible. The
    /// index copies the values out of the write sets, which are freed outside the publish
    /// lock.
    fn apply_batch(&self, batch: &[Pending]) {
        let Some(last_ts) = batch.last().map(|p| p.ts) else { return };
        let view = &self.published;
        if view.history.is_recording() {
            record_history(&view.history, batch);
        }
        let horizon = view.horizon();
        let mut digest = view.digest.lock();
        // The table the previous commit wrote: a log of commands to one table looks it up once
        // per batch, not once per commit.
        let mut last_table: Option<Arc<Table>> = None;
        for p in batch {
            for ta in &p.tables {
                if ta.drop_id.is_some() || ta.create {
                    let mut catalog = view.catalog.write();
                    if let Some(old) = ta.drop_id.and_then(|id| catalog.by_id(id)).cloned() {
                        old.data.read().for_each_live(|k, v| digest.remove(&old.name, k, v));
                        old.dropped_ts.store(p.ts, Ordering::Release);
                    }
                    if ta.create {
                        catalog.insert(Arc::new(Table::new(ta.id, Arc::clone(&ta.name), p.ts)));
                    }
                    last_table = None;
                }
                if ta.id == 0 || ta.writes.is_empty() {
                    continue;
                }
                if last_table.as_ref().is_none_or(|t| t.id != ta.id) {
                    last_table = view.catalog.read().by_id(ta.id).cloned();
                }
                let Some(table) = &last_table else { continue };
                let mut data = table.data.write();
                for (k, v) in &ta.writes {
                    data.apply(&table.name, k.as_slice(), v, p.ts, horizon, &mut digest);
                }
            }
        }
        if let Some(p) = batch.iter().rev().find_map(|p| p.position) {
            *view.applied.lock() = Some(p);
        }
        view.visible_ts.store(last_ts, Ordering::Release);
        drop(digest);
        view.history.notify();
    }

    /// Starts the change feed at the current visible timestamp. Holds the publish lock, so no
    /// batch is between its apply and its visibility: the feed has every commit after its start.
    pub fn start_history(&self) -> u64 {
        let _publishing = self.pipeline.publish.lock();
        let start = self.published.visible_ts();
        self.published.history.start(start);
        start
    }
}

/// Appends a published batch's changes to the change feed, in timestamp order.
fn record_history(history: &crate::history::History, batch: &[Pending]) {
    use crate::history::{Change, ChangeKind};
    for p in batch {
        let changes = p.tables.iter().flat_map(|ta| {
            let dropped = ta.drop_id.map(|_| Change {
                ts: p.ts,
                table: Arc::clone(&ta.name),
                key: Vec::new(),
                kind: ChangeKind::DropTable,
            });
            // As the WAL: nothing for a table that does not exist, no deletes in a table the
            // commit creates.
            let live = ta.id != 0;
            let writes =
                ta.writes.iter().filter(move |(_, v)| live && !(ta.create && v.is_none())).map(|(k, v)| Change {
                    ts: p.ts,
                    table: Arc::clone(&ta.name),
                    key: k.as_slice().to_vec(),
                    kind: v.map_or(ChangeKind::Delete, |v| ChangeKind::Put(v.to_vec())),
                });
            dropped.into_iter().chain(writes)
        });
        history.record(changes);
    }
}
