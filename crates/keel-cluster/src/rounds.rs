//! One read-index round shared by every linearizable read waiting for it.
//!
//! A linearizable read needs a read index taken *after* the read arrived: the leader confirms
//! with a quorum that it still leads, then reports its commit index, and the read is served
//! once the local state has applied that far. Each round costs a peer call to the leader and a
//! heartbeat round to the followers, so with many reads in flight a round per read spends
//! most of a member's CPU on the same answer.
//!
//! [`Rounds`] runs at most one round at a time and gives its result to every read that joined
//! the queue before the round began. The invariant that keeps reads linearizable: **a waiter
//! is answered only by a round that started after the waiter joined.** The driver takes the
//! whole queue and only then starts the round, so every waiter it answers was queued before
//! the round started; a read that arrives while a round is in flight waits for the next one.
//! A round's index is therefore at least the commit index when each of its waiters arrived,
//! confirmed by a quorum after that.
//!
//! The rounds run on a spawned task, not in a caller's future: a client that gives up (its
//! future dropped) must not strand the reads queued behind it. The task ends when the queue
//! is empty.

use std::future::Future;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;

/// A queue of waiters for the next round, and whether a driver task is running.
pub(crate) struct Rounds<T> {
    queue: Arc<Mutex<Queue<T>>>,
}

struct Queue<T> {
    running: bool,
    waiting: Vec<oneshot::Sender<T>>,
}

impl<T> Default for Rounds<T> {
    fn default() -> Self {
        Rounds { queue: Arc::new(Mutex::new(Queue { running: false, waiting: Vec::new() })) }
    }
}

/// Clears `running` if the driver task ends for any reason (the runtime shutting down drops
/// it mid-round): the next waiter then starts a new driver instead of waiting forever.
struct Running<T>(Arc<Mutex<Queue<T>>>);

impl<T> Drop for Running<T> {
    fn drop(&mut self) {
        self.0.lock().running = false;
    }
}

impl<T: Clone + Send + 'static> Rounds<T> {
    /// Waits for the result of a round that starts after this call. `round` runs one round;
    /// it is used only if this call starts the driver (all rounds of a queue are alike).
    /// `None` if the driver ended without answering (the runtime is shutting down).
    pub(crate) async fn join<F, Fut>(&self, round: F) -> Option<T>
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut q = self.queue.lock();
            q.waiting.push(tx);
            !std::mem::replace(&mut q.running, true)
        };
        if start {
            tokio::spawn(drive(Arc::clone(&self.queue), round));
        }
        rx.await.ok()
    }
}

async fn drive<T: Clone, F, Fut>(queue: Arc<Mutex<Queue<T>>>, round: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = T>,
{
    let running = Running(Arc::clone(&queue));
    loop {
        // Take the queue first, then start the round: everyone taken arrived before it.
        let batch = {
            let mut q = queue.lock();
            if q.waiting.is_empty() {
                q.running = false;
                std::mem::forget(running);
                return;
            }
            std::mem::take(&mut q.waiting)
        };
        let result = round().await;
        for tx in batch {
            // A waiter that gave up has dropped its receiver; nothing to do for it.
            let _ = tx.send(result.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use super::*;

    /// A round reports the value of a counter read when the round *starts*; every waiter must
    /// get a value at least the counter's value when it joined (the invariant above), and
    /// concurrent waiters must share rounds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_waiter_gets_a_round_that_started_after_it_joined() {
        let rounds = Arc::new(Rounds::<u64>::default());
        let clock = Arc::new(AtomicU64::new(0));
        let started = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for i in 0..400u64 {
            let rounds = Arc::clone(&rounds);
            let clock = Arc::clone(&clock);
            let started = Arc::clone(&started);
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_micros(50 * (i % 40))).await;
                // The event this read must observe happened before it joined.
                let joined = clock.fetch_add(1, Ordering::SeqCst) + 1;
                let c = Arc::clone(&clock);
                let s = Arc::clone(&started);
                let seen = rounds
                    .join(move || {
                        let c = Arc::clone(&c);
                        let s = Arc::clone(&s);
                        async move {
                            s.fetch_add(1, Ordering::SeqCst);
                            let at = c.load(Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_micros(300)).await;
                            at
                        }
                    })
                    .await
                    .expect("answered");
                (joined, seen)
            }));
        }
        for t in tasks {
            let (joined, seen) = t.await.expect("task");
            assert!(seen >= joined, "a read that joined at {joined} was answered by a round started at {seen}");
        }
        let rounds_run = started.load(Ordering::SeqCst);
        assert!(rounds_run < 400, "400 concurrent reads ran {rounds_run} rounds: none were shared");
    }

    /// A waiter that gives up does not stop the rounds for the others, and a new waiter after
    /// the queue drained starts a new driver.
    #[tokio::test]
    async fn a_cancelled_waiter_does_not_strand_the_queue() {
        let rounds = Arc::new(Rounds::<u32>::default());
        let slow = || async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            7
        };
        // The first waiter starts the driver, then is dropped mid-round.
        let first = tokio::time::timeout(Duration::from_millis(5), rounds.join(slow)).await;
        assert!(first.is_err(), "the first waiter was meant to time out");
        assert_eq!(rounds.join(slow).await, Some(7));
        // Drained: the driver has ended; a later join starts another.
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!rounds.queue.lock().running);
        assert_eq!(rounds.join(|| async { 8 }).await, Some(8));
    }
}
