//! History: the change feed and the waiters for new commits.
//!
//! Reads at a past timestamp need no storage of their own: the index keeps every version
//! visible at the registry's history floor or later (see `registry.rs`). This module keeps the
//! *change feed*: every `(table, key, value or deletion)` of every commit after the feed's start,
//! in commit order, in memory. It is appended by publication (in timestamp order, under the
//! publish lock) and trimmed when the floor rises. It also wakes tasks and threads waiting for a
//! commit after a given timestamp.
//!
//! It never reads the WAL and never does I/O.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Waker;

use parking_lot::{Condvar, Mutex};

/// What a change did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangeKind {
    /// The key was set to this value.
    Put(Vec<u8>),
    /// The key was deleted.
    Delete,
    /// The whole table was dropped (the key is empty). Writes to the same table in the same
    /// commit follow as their own changes.
    DropTable,
}

/// One change in the feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Commit timestamp of the commit that made it.
    pub ts: u64,
    /// Table name.
    pub table: Arc<str>,
    /// The key (empty for [`ChangeKind::DropTable`]).
    pub key: Vec<u8>,
    /// What happened.
    pub kind: ChangeKind,
}

impl Change {
    /// Bytes this change holds in memory (its key, value and a fixed overhead).
    pub fn memory_bytes(&self) -> usize {
        let value = match &self.kind {
            ChangeKind::Put(v) => v.capacity(),
            _ => 0,
        };
        std::mem::size_of::<Change>() + self.key.capacity() + value
    }
}

#[derive(Debug, Default)]
struct Feed {
    /// Changes of every commit with timestamp > `start`, oldest first.
    changes: VecDeque<Change>,
    /// The feed holds every commit after this timestamp.
    start: u64,
    bytes: usize,
}

/// The change feed and commit waiters of one database.
#[derive(Debug, Default)]
pub(crate) struct History {
    /// Whether publication records changes (history is on).
    recording: AtomicBool,
    feed: Mutex<Feed>,
    wakers: Mutex<Vec<Waker>>,
    has_waiters: AtomicBool,
    blocking: Condvar,
    blocking_lock: Mutex<()>,
}

impl History {
    /// Starts recording: the feed holds every commit after `start` from now on.
    pub fn start(&self, start: u64) {
        let mut feed = self.feed.lock();
        if !self.recording.load(Ordering::Acquire) {
            feed.changes.clear();
            feed.bytes = 0;
            feed.start = start;
            self.recording.store(true, Ordering::Release);
        }
    }

    /// Empties the feed and restarts it at `start`, if it is recording: the whole state was
    /// replaced at `start` (a checkpoint install), and no list of changes describes that jump.
    /// A consumer asking for changes after an earlier timestamp gets `Error::Compacted` and
    /// must read the state anew. Called under the publish lock, before `start` is visible.
    pub fn restart(&self, start: u64) {
        let mut feed = self.feed.lock();
        if self.recording.load(Ordering::Acquire) {
            feed.changes = VecDeque::new();
            feed.bytes = 0;
            feed.start = start;
        }
    }

    /// Stops recording and frees the feed.
    pub fn stop(&self) {
        let mut feed = self.feed.lock();
        self.recording.store(false, Ordering::Release);
        feed.changes = VecDeque::new();
        feed.bytes = 0;
    }

    pub fn is_recording(&self) -> bool {
        self.recording.load(Ordering::Acquire)
    }

    /// Appends one commit's changes; called in timestamp order by publication. Checked again
    /// under the lock: a `stop` between publication's check and here leaves the feed empty.
    pub fn record(&self, changes: impl Iterator<Item = Change>) {
        let mut feed = self.feed.lock();
        if !self.is_recording() {
            return;
        }
        for c in changes {
            feed.bytes += c.memory_bytes();
            feed.changes.push_back(c);
        }
    }

    /// Forgets changes at or below `ts` (the floor rose to `ts`).
    pub fn trim_through(&self, ts: u64) {
        let mut feed = self.feed.lock();
        if ts <= feed.start {
            return;
        }
        while feed.changes.front().is_some_and(|c| c.ts <= ts) {
            if let Some(c) = feed.changes.pop_front() {
                feed.bytes = feed.bytes.saturating_sub(c.memory_bytes());
            }
        }
        feed.start = ts;
    }

    /// Up to `max` changes of commits after `after` and at most `upto` (whole commits only,
    /// unless one commit alone has more than `max`), or the feed's start when `after` is older
    /// than it. A batch is recorded here before it becomes visible to readers; a caller passes
    /// the visible timestamp as `upto`, so nothing it hands on is newer than what a read sees.
    pub fn since(&self, after: u64, upto: u64, max: usize) -> std::result::Result<Vec<Change>, u64> {
        let feed = self.feed.lock();
        if !self.is_recording() || after < feed.start {
            return Err(feed.start);
        }
        let first = feed.changes.partition_point(|c| c.ts <= after);
        let mut out: Vec<Change> =
            feed.changes.range(first..).take_while(|c| c.ts <= upto).take(max.max(1)).cloned().collect();
        // Do not end in the middle of a commit when a whole one fits.
        if out.len() == max.max(1) {
            if let Some(last_ts) = feed.changes.get(first + out.len()).map(|c| c.ts) {
                if out.last().is_some_and(|c| c.ts == last_ts) && out.first().is_some_and(|c| c.ts != last_ts) {
                    out.retain(|c| c.ts != last_ts);
                }
            }
        }
        Ok(out)
    }

    /// The feed's start and the bytes it holds.
    pub fn footprint(&self) -> (u64, usize, usize) {
        let feed = self.feed.lock();
        (feed.start, feed.changes.len(), feed.bytes)
    }

    /// Wakes every waiter; called after the visible timestamp advanced.
    pub fn notify(&self) {
        if self.has_waiters.swap(false, Ordering::AcqRel) {
            for w in std::mem::take(&mut *self.wakers.lock()) {
                w.wake();
            }
            let _guard = self.blocking_lock.lock();
            self.blocking.notify_all();
        }
    }

    pub fn register(&self, waker: &Waker) {
        let mut wakers = self.wakers.lock();
        if !wakers.iter().any(|w| w.will_wake(waker)) {
            wakers.push(waker.clone());
        }
        self.has_waiters.store(true, Ordering::Release);
    }

    /// Blocks until `visible` passes `after` or `timeout` elapses; returns the visible timestamp.
    pub fn wait_blocking(&self, visible: &AtomicU64, after: u64, timeout: std::time::Duration) -> u64 {
        let deadline = std::time::Instant::now() + timeout;
        let mut guard = self.blocking_lock.lock();
        loop {
            self.has_waiters.store(true, Ordering::Release);
            let now = visible.load(Ordering::Acquire);
            if now > after || std::time::Instant::now() >= deadline {
                return now;
            }
            self.blocking.wait_until(&mut guard, deadline);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn put(ts: u64, key: &[u8]) -> Change {
        Change { ts, table: Arc::from("t"), key: key.to_vec(), kind: ChangeKind::Put(b"v".to_vec()) }
    }

    /// Publication records a batch before it makes it visible: a reader of the feed must not be
    /// handed a commit a read at the visible timestamp cannot see yet (a watch event above the
    /// header of a later read on the same member).
    #[test]
    fn since_stops_at_the_visible_timestamp() {
        let h = History::default();
        h.start(0);
        h.record([put(1, b"a"), put(2, b"b"), put(2, b"c"), put(3, b"d")].into_iter());
        let upto_2: Vec<u64> = h.since(0, 2, 10).unwrap().iter().map(|c| c.ts).collect();
        assert_eq!(upto_2, vec![1, 2, 2]);
        assert!(h.since(2, 2, 10).unwrap().is_empty());
        let all: Vec<u64> = h.since(0, 3, 10).unwrap().iter().map(|c| c.ts).collect();
        assert_eq!(all, vec![1, 2, 2, 3]);
    }
}
