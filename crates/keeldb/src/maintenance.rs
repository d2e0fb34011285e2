//! Background upkeep of an open database: checkpoints (snapshot the visible state, stream it
//! to a checkpoint file, then delete WAL no longer needed), version and conflict-record
//! collection below the horizon, and the worker thread that runs periodic fdatasyncs,
//! automatic checkpoints and collection.
//!
//! It decides *when* and in which crash-safe order (see `docs/design/recovery.md`); it never
//! encodes a checkpoint (that is `checkpoint.rs`) and never writes to the WAL itself (the
//! committer seals segments and syncs on its behalf).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::checkpoint::CheckpointWriter;
use crate::checkpoint_stream::for_each_entry;
use crate::commit::SyncSchedule;
use crate::db::{CheckpointInfo, Inner};
use crate::error::{Error, Result};
use crate::fs::OpenMode;

impl Inner {
    pub(crate) fn checkpoint(&self) -> Result<CheckpointInfo> {
        let mut retained = self.checkpoint_lock.lock();
        // A poisoned WAL may end in a fragment or a hole the kernel dropped after a failed
        // fsync; sealing it (or deleting WAL on the strength of a new checkpoint) would turn a
        // torn tail into corruption of a sealed segment.
        self.committer.check_writable()?;
        let view = self.published();
        let (snap, expected, applied) = view.acquire_with_digest();
        let release = scopeguard(|| view.release(snap));
        if retained.last().is_some_and(|(ts, _)| *ts == snap) {
            drop(release);
            let (ts, path) = retained.last().cloned().unwrap_or_default();
            let bytes = self.fs.open(&path, OpenMode::Read).and_then(|f| f.len()).unwrap_or(0);
            return Ok(CheckpointInfo { ts, path, bytes, entries: 0, segments_removed: 0 });
        }
        self.options.checkpoint_step_hook.call();
        // Seal the current segment (so the WAL up to here can be deleted later), and so make
        // every frame of every commit in the snapshot durable before the checkpoint exists:
        // each was written before it became visible, the roll fdatasyncs the segment, and
        // every older segment was synced when it was sealed. Sealed before the snapshot was
        // taken instead, a relaxed commit landing in between was in the checkpoint but only in
        // the page cache's WAL; a power loss then left a checkpoint ahead of the log, the next
        // commits followed the log's end with a gap in timestamps, and the open after that
        // refused the store (design/recovery.md, "A checkpoint ahead of the log").
        self.committer.seal_segment()?;
        let tables = {
            let catalog = view.catalog.read();
            let mut ts: Vec<_> = catalog.all().into_iter().filter(|t| t.visible_at(snap)).collect();
            ts.sort_by_key(|t| t.id);
            ts
        };
        let next_id = tables.iter().map(|t| t.id + 1).max().unwrap_or(1);
        // With history kept, the checkpoint also holds the history after the floor, so that
        // a reopened store reads what this one reads (history_persist.rs).
        let history = crate::history_persist::plan(view, snap, &tables);
        let floor = history.as_ref().map(|h| h.floor);
        let mut writer =
            CheckpointWriter::create_with_floor(Arc::clone(&self.fs), &self.path, snap, next_id, applied, floor)?;
        let mut entries = 0u64;
        for t in &tables {
            writer.table(t.id, &t.name)?;
            // One chunk per read lock, so a long checkpoint never holds a table against a commit.
            for_each_entry(
                |range| t.data.read().scan_chunk(range, false, snap, 1024),
                |k, v| {
                    entries += 1;
                    writer.entry(t.id, k, v)
                },
            )?;
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
        if let Some(history) = &history {
            history.write(&mut writer, &tables)?;
        }
        let (path, bytes) = writer.finish()?;
        drop(history);
        drop(release);
        self.committer.counters.wal_bytes_since_checkpoint.store(0, Ordering::Relaxed);
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
                segments_removed = self.committer.remove_sealed_through(*oldest_ts)?;
            }
        }
        self.fs.sync_dir(&self.path).map_err(|e| Error::io(&self.path, e))?;
        self.save_accounting();
        Ok(CheckpointInfo { ts: snap, path, bytes, entries, segments_removed })
    }

    /// Collects versions and dropped tables no snapshot can see any more, a bounded chunk per
    /// table per call so the write lock is held only briefly.
    pub(crate) fn collect_garbage(&self) {
        let view = self.published();
        let horizon = view.horizon();
        let tables = view.catalog.read().all();
        for t in tables {
            if t.data.read().gc_due(horizon) {
                t.data.write().collect(horizon, 4096);
            }
        }
        view.catalog.write().collect(horizon);
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
pub(crate) fn worker_loop(weak: Weak<Inner>, schedule: Arc<SyncSchedule>) {
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
            let _ = db.committer.sync_wal();
        }
        let threshold = db.options.checkpoint_wal_bytes;
        let wal_bytes = db.committer.counters.wal_bytes_since_checkpoint.load(Ordering::Relaxed);
        if threshold > 0
            && wal_bytes >= threshold
            && !db.committer.is_poisoned()
            && !db.checkpoint_running.swap(true, Ordering::AcqRel)
        {
            // On its own thread, so a long checkpoint never delays a periodic fdatasync.
            let weak_ckpt = Weak::clone(&weak);
            let spawned = std::thread::Builder::new().name("keeldb-checkpoint".into()).spawn(move || {
                if let Some(db) = weak_ckpt.upgrade() {
                    if !db.committer.is_closed() {
                        let _ = db.checkpoint();
                    }
                    db.checkpoint_running.store(false, Ordering::Release);
                }
            });
            match spawned {
                // Kept so that `close` can wait for it: the directory lock must outlive every
                // thread that touches the directory.
                Ok(handle) => *db.checkpoint_thread.lock() = Some(handle),
                Err(_) => db.checkpoint_running.store(false, Ordering::Release),
            }
        }
        if last_gc.elapsed() >= Duration::from_millis(50) {
            db.collect_garbage();
            db.committer.trim_conflicts();
            last_gc = Instant::now();
        }
    }
}
