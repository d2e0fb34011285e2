//! The async side of submission: a commit that is polled instead of parked on.
//!
//! [`AsyncCommit`] is the engine half of `WriteTxn::commit_async`'s future. Submitting pushes
//! the request onto the same gather queue as a blocking commit, at once, so the commit is
//! sequenced whether or not the future is ever polled. The task never parks its thread: it
//! stores its waker in the waiter. When its first poll finds no leader, it *reserves* leadership
//! and yields once, so every other task that is ready to commit queues up behind it (they see a
//! leader and wait), then leads inline on its next poll (one write and, for `sync`, one
//! fdatasync for the whole queue). A reservation is not leadership: a blocking committer, a task
//! told to lead, or `close` takes it over, and the future then waits as a follower. So a task
//! that is never polled again, or whose thread blocks in a blocking commit, stalls nobody. A
//! task told to try to lead does so on that poll. Submitting does not take leadership: a future that is
//! never polled holds nothing, and whoever comes next (another committer, a drop, or `close`)
//! leads its commit.
//!
//! Dropping the future before it completes abandons only the result: the commit stays queued
//! or sequenced and completes in the background, exactly once. A dropped future never strands
//! the queue: leadership is never handed to it, and when the drop finds nobody leading (or it
//! held or had been handed leadership), it passes leadership to a live committer or, when there
//! is none, leads inline.
//!
//! Nothing here knows about transactions or the database handle; no async runtime is used.

use std::sync::Arc;
use std::task::{Context, Poll};

use super::pipeline::SnapshotPin;
use super::request::CommitRequest;
use super::waiter::{Slot, Waiter};
use super::Committer;
use crate::error::Result;

/// Where an async commit stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Queued, never polled.
    Submitted,
    /// Queued behind a leader; wait to be woken.
    Follower,
    /// Reserved leadership (see the module comment): yield once so others can queue, then
    /// claim it and lead unless it was taken over.
    Reserved(u64),
    /// Holds leadership: lead on this poll.
    LeadNow,
    /// The outcome was returned.
    Finished,
}

/// A submitted commit awaiting its outcome; see the module comment.
#[derive(Debug)]
pub(crate) struct AsyncCommit {
    waiter: Arc<Waiter>,
    role: Role,
}

impl Committer {
    /// Queues a commit for a future. Fails at once (nothing queued) when the database is closed
    /// or poisoned.
    pub fn submit_async(&self, req: CommitRequest, pin: SnapshotPin) -> Result<AsyncCommit> {
        self.check_writable()?;
        let waiter = Waiter::new_async();
        self.enqueue(req, &waiter, Some(pin), false)?;
        Ok(AsyncCommit { waiter, role: Role::Submitted })
    }

    /// Drives an async commit: leads when it holds leadership, otherwise registers the waker.
    pub fn poll_commit(&self, commit: &mut AsyncCommit, cx: &mut Context<'_>) -> Poll<Result<u64>> {
        loop {
            match commit.role {
                Role::Finished => return Poll::Ready(Err(crate::Error::TransactionDone)),
                Role::Submitted => {
                    if let Some(reservation) = self.reserve_leadership() {
                        commit.role = Role::Reserved(reservation);
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    commit.role = Role::Follower;
                }
                Role::Reserved(reservation) => {
                    commit.role = if self.claim_reservation(reservation) { Role::LeadNow } else { Role::Follower };
                    continue;
                }
                Role::LeadNow => {
                    commit.role = Role::Follower;
                    self.lead_while_work(false);
                }
                Role::Follower => {}
            }
            match commit.waiter.poll_slot(cx) {
                None => return Poll::Pending,
                Some(Slot::TryLead) => {
                    if self.try_take_leadership() {
                        commit.role = Role::LeadNow;
                    }
                }
                Some(Slot::Done(outcome)) => {
                    commit.role = Role::Finished;
                    return Poll::Ready(outcome.into_result());
                }
                Some(Slot::Waiting) => {}
            }
        }
    }

    /// The future was dropped before its outcome: leave the commit to complete in the
    /// background, and make sure the queue is not left without a leader because of it.
    pub fn abandon_commit(&self, commit: &mut AsyncCommit) {
        if commit.role == Role::Finished {
            return;
        }
        let _told_to_lead = commit.waiter.abandon();
        // Held, or free with work queued (it was handed to this future, or nobody leads yet).
        let holds_leadership = match commit.role {
            Role::LeadNow => true,
            Role::Reserved(reservation) => self.claim_reservation(reservation) || self.try_take_leadership(),
            _ => self.try_take_leadership(),
        };
        commit.role = Role::Finished;
        if holds_leadership && self.release_gather() {
            // Nobody live is queued to take over: lead inline so the queued commits (this one
            // included) complete.
            self.lead_while_work(false);
        }
    }
}
