//! How a queued commit learns its fate: the typed outcome of a commit, and the waiter (a slot
//! plus the thread to unpark) that the pipeline fills in.
//!
//! This module owns only the hand-over between the pipeline and one committer. It never
//! decides an outcome, never touches the sequencer or the WAL, and never blocks anyone but the
//! committer that owns the waiter.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Waker};

use parking_lot::Mutex;

use crate::error::{ConflictReason, Error};
use crate::types::LogPosition;

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
    /// A log command was decided at `ts`: applied, or (with the index of the failed condition)
    /// logged as position only.
    Applied { ts: u64, failed_condition: Option<usize> },
    /// A log command's position was not after the last one applied; nothing was written.
    OutOfOrder { position: LogPosition, last: LogPosition },
}

impl Outcome {
    pub fn into_result(self) -> Result<u64, Error> {
        match self {
            Outcome::Committed(ts) | Outcome::Applied { ts, .. } => Ok(ts),
            Outcome::OutOfOrder { position, last } => Err(Error::InvalidArgument(format!(
                "log position {position} is not after the last applied position {last}"
            ))),
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

/// The slot, the async owner's waker, and whether the owner is gone.
#[derive(Debug)]
struct State {
    slot: Slot,
    waker: Option<Waker>,
    /// The owner (a dropped future) will never look at the slot again: it must not be chosen
    /// to lead.
    abandoned: bool,
}

/// A committer's mailbox: the slot, and the thread to unpark or the task to wake when it
/// changes. Parking on the thread's own futex is the cheapest sleep available, and a
/// committer sleeps once per commit; an async committer stores its task's waker instead and
/// never parks its thread.
#[derive(Debug)]
pub(crate) struct Waiter {
    state: Mutex<State>,
    changed: AtomicBool,
    /// `None` for an async committer.
    thread: Option<std::thread::Thread>,
}

std::thread_local! {
    /// The waiter of this thread's last blocking commit (see [`Waiter::for_this_thread`]).
    static SPARE: std::cell::RefCell<Option<Arc<Waiter>>> = const { std::cell::RefCell::new(None) };
}

impl Waiter {
    fn with_thread(thread: Option<std::thread::Thread>) -> Arc<Waiter> {
        let state = State { slot: Slot::Waiting, waker: None, abandoned: false };
        Arc::new(Waiter { state: Mutex::new(state), changed: AtomicBool::new(false), thread })
    }

    /// A waiter for the calling thread, which will block in [`Waiter::wait`].
    pub fn new() -> Arc<Waiter> {
        Waiter::with_thread(Some(std::thread::current()))
    }

    /// The calling thread's waiter: the one its last blocking commit used, renewed, when
    /// nothing else holds that any more (usually: the leader drops a batch's references right
    /// after waking its committers); otherwise a new one. A commit then allocates no waiter
    /// and clones no thread handle.
    pub fn for_this_thread() -> Arc<Waiter> {
        let spare = SPARE.try_with(|s| s.borrow_mut().take()).ok().flatten();
        spare.and_then(Waiter::renewed).unwrap_or_else(Waiter::new)
    }

    /// Keeps `w`, whose commit is decided, for the calling thread's next commit.
    pub fn keep_for_this_thread(w: Arc<Waiter>) {
        let _ = SPARE.try_with(|s| *s.borrow_mut() = Some(w));
    }

    /// `w` made as new, if no one else holds a reference to it (then no one can see the reset).
    fn renewed(mut w: Arc<Waiter>) -> Option<Arc<Waiter>> {
        let inner = Arc::get_mut(&mut w)?;
        *inner.state.get_mut() = State { slot: Slot::Waiting, waker: None, abandoned: false };
        *inner.changed.get_mut() = false;
        Some(w)
    }

    /// A waiter for `thread` (the caller's, looked up once for many waiters).
    pub fn for_thread(thread: &std::thread::Thread) -> Arc<Waiter> {
        Waiter::with_thread(Some(thread.clone()))
    }

    /// A waiter for a future, which will poll it with [`Waiter::poll_slot`].
    pub fn new_async() -> Arc<Waiter> {
        Waiter::with_thread(None)
    }

    /// Whether the owner is a future (woken through its waker) rather than a parked thread.
    pub fn is_async(&self) -> bool {
        self.thread.is_none()
    }

    /// The blocking owner's thread, `None` for a future.
    pub fn thread_id(&self) -> Option<std::thread::ThreadId> {
        self.thread.as_ref().map(std::thread::Thread::id)
    }

    /// Fills the slot and wakes its owner. Returns false (and changes nothing) when asked to
    /// hand leadership to an owner that is gone.
    pub fn set(&self, s: Slot) -> bool {
        let waker = {
            let mut st = self.state.lock();
            if st.abandoned && matches!(s, Slot::TryLead) {
                return false;
            }
            st.slot = s;
            st.waker.take()
        };
        self.changed.store(true, Ordering::Release);
        if let Some(t) = &self.thread {
            t.unpark();
        }
        if let Some(w) = waker {
            w.wake();
        }
        true
    }

    /// Blocks until the slot is set; only the thread that created the waiter calls this.
    pub fn wait(&self) -> Slot {
        loop {
            if self.changed.swap(false, Ordering::Acquire) {
                let taken = std::mem::replace(&mut self.state.lock().slot, Slot::Waiting);
                if !matches!(taken, Slot::Waiting) {
                    return taken;
                }
            }
            std::thread::park();
        }
    }

    /// Takes the slot if it was set; otherwise registers the task's waker and returns `None`.
    /// The check and the registration happen under one lock, so no wake-up is lost.
    pub fn poll_slot(&self, cx: &Context<'_>) -> Option<Slot> {
        let mut st = self.state.lock();
        match std::mem::replace(&mut st.slot, Slot::Waiting) {
            Slot::Waiting => {
                if !st.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    st.waker = Some(cx.waker().clone());
                }
                None
            }
            taken => Some(taken),
        }
    }

    /// Marks the owner gone. Returns whether it had been told to try to lead (and so now owes
    /// the pipeline a leader).
    pub fn abandon(&self) -> bool {
        let mut st = self.state.lock();
        st.abandoned = true;
        st.waker = None;
        matches!(std::mem::replace(&mut st.slot, Slot::Waiting), Slot::TryLead)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// A thread's next commit reuses its last waiter only when nobody else holds it, and then
    /// finds it as new: a decision left in it would end the next commit's wait at once.
    #[test]
    fn a_thread_reuses_its_waiter_only_when_unshared_and_renewed() {
        std::thread::spawn(|| {
            let w = Waiter::for_this_thread();
            assert!(w.set(Slot::Done(Outcome::Committed(7))));
            let kept_ptr = Arc::as_ptr(&w);
            Waiter::keep_for_this_thread(w);
            let again = Waiter::for_this_thread();
            assert_eq!(Arc::as_ptr(&again), kept_ptr, "an unshared waiter is reused");
            assert!(!again.changed.load(Ordering::Acquire), "the reused waiter still says it changed");
            assert!(matches!(again.state.lock().slot, Slot::Waiting), "the reused waiter kept a decision");

            // Someone (a batch not yet dropped) still holds it: the next commit gets a new one.
            let held = Arc::clone(&again);
            again.set(Slot::Done(Outcome::Committed(8)));
            Waiter::keep_for_this_thread(again);
            let fresh = Waiter::for_this_thread();
            assert_ne!(Arc::as_ptr(&fresh), Arc::as_ptr(&held));
            assert!(matches!(held.state.lock().slot, Slot::Done(Outcome::Committed(8))), "a shared waiter was reset");
        })
        .join()
        .unwrap();
    }
}
