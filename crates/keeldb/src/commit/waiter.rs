//! How a queued commit learns its fate: the typed outcome of a commit, and the waiter (a slot
//! plus the thread to unpark) that the pipeline fills in.
//!
//! This module owns only the hand-over between the pipeline and one committer. It never
//! decides an outcome, never touches the sequencer or the WAL, and never blocks anyone but the
//! committer that owns the waiter.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{ConflictReason, Error};

/// Why the pipeline refused or failed a commit that did not conflict.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// The database was closed before the commit was sequenced.
    Closed,
    /// A WAL write or fdatasync failed (this batch's or an earlier one's).
    Poisoned(Arc<str>),
}

impl Failure {
    pub fn to_error(&self) -> Error {
        match self {
            Failure::Closed => Error::Closed,
            Failure::Poisoned(why) => Error::Poisoned(why.to_string()),
        }
    }
}

/// A failed write-write or read validation: which table and key, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Conflict {
    pub table: Arc<str>,
    pub key: Option<Vec<u8>>,
    pub reason: ConflictReason,
}

impl From<Conflict> for Error {
    fn from(c: Conflict) -> Error {
        Error::Conflict { table: c.table.to_string(), key: c.key, reason: c.reason }
    }
}

/// How a commit ended.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// Durable (under its mode) and visible at this timestamp.
    Committed(u64),
    /// Validation failed; nothing was written.
    Conflict(Conflict),
    /// Not committed: the database was closed or poisoned.
    Failed(Failure),
}

impl Outcome {
    pub fn into_result(self) -> Result<u64, Error> {
        match self {
            Outcome::Committed(ts) => Ok(ts),
            Outcome::Conflict(c) => Err(c.into()),
            Outcome::Failed(f) => Err(f.to_error()),
        }
    }
}

/// What a waiting committer is told.
#[derive(Debug)]
pub(crate) enum Slot {
    Waiting,
    /// Leadership was released with work queued: the committer should try to lead.
    TryLead,
    Done(Outcome),
}

/// A committer's mailbox: the slot and the thread to unpark when it changes. Parking on the
/// thread's own futex is the cheapest sleep available, and a committer sleeps once per commit.
#[derive(Debug)]
pub(crate) struct Waiter {
    slot: Mutex<Slot>,
    changed: AtomicBool,
    thread: std::thread::Thread,
}

impl Waiter {
    pub fn new() -> Arc<Waiter> {
        Arc::new(Waiter {
            slot: Mutex::new(Slot::Waiting),
            changed: AtomicBool::new(false),
            thread: std::thread::current(),
        })
    }

    /// Fills the slot and wakes its owner.
    pub fn set(&self, s: Slot) {
        *self.slot.lock() = s;
        self.changed.store(true, Ordering::Release);
        self.thread.unpark();
    }

    /// Blocks until the slot is set; only the thread that created the waiter calls this.
    pub fn wait(&self) -> Slot {
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
