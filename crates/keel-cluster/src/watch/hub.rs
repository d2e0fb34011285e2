//! The member's watch hub: one task reads the change feed once per commit, decodes each
//! revision's events once, and hands them to every *synced* watcher through the key index, one
//! bounded inbox per gRPC stream.
//!
//! A watcher is synced when the hub will give it every later revision it wants: the hub only
//! takes a watcher in ([`Hub::join`]) while its next needed revision is above the last revision
//! the hub dispatched. A stream whose inbox is full does not slow the hub down: the watchers the
//! undelivered batch was for leave the index and become the stream's *victims*, with the
//! revision they still need; the stream catches them up from the feed itself and joins them
//! again (etcd's synced / unsynced / victims). The hub never blocks on a stream and never reads
//! the WAL.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

use super::event::{decode, read_commits, Batch, Commit};
use super::index::{Index, Span, Target};
use crate::mvcc::{META, REV_KEY};
use crate::state_machine::Shared;

/// Watchers dropped from the synced set because their stream was full, in this process (a
/// statistic: slow consumers).
static VICTIMS_TOTAL: AtomicU64 = AtomicU64::new(0);

/// Watchers made victims (slow consumers) since the process started.
pub fn victims_total() -> u64 {
    VICTIMS_TOTAL.load(Ordering::Relaxed)
}

/// Changes the hub reads from the feed at a time.
const HUB_READ_CHANGES: usize = 4096;

/// One watcher's share of a [`Delivery`]: (batch, event) positions, in revision order.
#[derive(Debug)]
pub struct Hit {
    pub token: u64,
    pub span: Arc<Span>,
    pub events: Vec<(u32, u32)>,
}

/// What the hub hands one stream for one read of the feed.
#[derive(Debug)]
pub struct Delivery {
    pub batches: Arc<Vec<Arc<Batch>>>,
    pub hits: Vec<Hit>,
    /// The last revision the read covered (the responses' header revision).
    pub revision: i64,
}

/// Watchers the hub dropped from the index: (token, first revision still needed).
#[derive(Debug, Default)]
pub struct Victims {
    pub list: Mutex<Vec<(u64, i64)>>,
    pub notify: Notify,
}

struct Link {
    inbox: mpsc::Sender<Delivery>,
    victims: Arc<Victims>,
}

#[derive(Default)]
struct State {
    /// The last revision dispatched: every synced watcher got (or was made a victim for)
    /// each revision up to here that it wants.
    rev: i64,
    index: Index,
    links: HashMap<u64, Link>,
    /// Set when the hub stopped: streams opened later end at once.
    stopped: bool,
}

pub struct Hub {
    pub sm: Arc<Shared>,
    state: Mutex<State>,
    /// `State::rev`, readable without the lock; stored after the deliveries and victims of
    /// each round (so a reader that sees revision R finds every delivery up to R in its inbox
    /// and every victim up to R in its list).
    dispatched: AtomicI64,
    next_stream: AtomicU64,
}

/// What [`Hub::join`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Join {
    Joined,
    /// The hub is already past the watcher's next revision: catch up to this one first.
    Behind(i64),
}

impl Hub {
    /// Starts the hub of the member whose state machine is `sm`; it runs until `stopping`.
    pub fn start(sm: Arc<Shared>, stopping: tokio::sync::watch::Receiver<bool>) -> Arc<Hub> {
        let hub = Arc::new(Hub {
            sm,
            state: Mutex::new(State::default()),
            dispatched: AtomicI64::new(0),
            next_stream: AtomicU64::new(1),
        });
        match hub.origin() {
            Ok((rev, ts)) => {
                hub.state.lock().rev = rev;
                hub.dispatched.store(rev, Ordering::Release);
                tokio::spawn(Arc::clone(&hub).run(ts, stopping));
            }
            Err(e) => {
                eprintln!("keel: watch hub did not start: {e}");
                hub.state.lock().stopped = true;
            }
        }
        hub
    }

    /// The store's revision and the engine timestamp of the same state.
    fn origin(&self) -> keeldb::Result<(i64, u64)> {
        let txn = self.sm.db.begin_read()?;
        let rev = match txn.get(META, REV_KEY)? {
            Some(v) => bincode::deserialize::<i64>(&v).unwrap_or(1),
            None => 1,
        };
        Ok((rev.max(1), txn.snapshot_ts()))
    }

    pub fn dispatched(&self) -> i64 {
        self.dispatched.load(Ordering::Acquire)
    }

    /// A new stream: its id, its inbox and its victims. `None` when the hub has stopped.
    pub fn open_stream(&self, inbox_len: usize) -> Option<(u64, mpsc::Receiver<Delivery>, Arc<Victims>)> {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(inbox_len.max(1));
        let victims = Arc::new(Victims::default());
        let mut state = self.state.lock();
        if state.stopped {
            return None;
        }
        state.links.insert(id, Link { inbox: tx, victims: Arc::clone(&victims) });
        Some((id, rx, victims))
    }

    /// Forgets a stream and its synced watchers.
    pub fn close_stream(&self, stream: u64) {
        let mut state = self.state.lock();
        state.links.remove(&stream);
        state.index.drain_where(|t| t.stream == stream);
    }

    /// Adds a watcher to the synced set if the hub has not dispatched `target.next_rev` yet.
    pub fn join(&self, target: Target) -> Join {
        let mut state = self.state.lock();
        if state.rev >= target.next_rev {
            return Join::Behind(state.rev);
        }
        state.index.insert(target);
        Join::Joined
    }

    /// Removes a synced watcher; whether it was synced.
    pub fn leave(&self, span: &Span, stream: u64, token: u64) -> bool {
        self.state.lock().index.remove(span, stream, token)
    }

    /// Synced watchers now (for the memory test and stats).
    pub fn synced_len(&self) -> usize {
        self.state.lock().index.len()
    }

    async fn run(self: Arc<Self>, mut ts: u64, mut stopping: tokio::sync::watch::Receiver<bool>) {
        let db = &self.sm.db;
        loop {
            if *stopping.borrow() {
                break;
            }
            match read_commits(db, ts, HUB_READ_CHANGES) {
                Ok(changes) if changes.is_empty() => {
                    tokio::select! {
                        r = db.wait_for_commit_after(ts) => if r.is_err() { break },
                        _ = async { let _ = stopping.wait_for(|s| *s).await; } => break,
                    }
                }
                Ok(changes) => {
                    let commits = match decode(changes) {
                        Ok(c) => c,
                        Err(e) => {
                            eprintln!("{e}");
                            break;
                        }
                    };
                    if let Some(last) = commits.last() {
                        ts = last.ts;
                    }
                    self.dispatch(commits);
                }
                Err(keeldb::Error::Compacted { .. }) | Err(keeldb::Error::FutureTimestamp { .. }) => {
                    // The feed restarted past the hub (a snapshot install replaced the store,
                    // or history was freed under it): no list of changes leads from the hub's
                    // position to the new state. Continue from the state now; every watcher
                    // still needing a revision at or below it must be told (compacted).
                    match self.origin() {
                        Ok((rev, now)) => {
                            ts = now;
                            self.restart(rev);
                        }
                        Err(_) => break,
                    }
                }
                Err(_) => break,
            }
        }
        let mut state = self.state.lock();
        state.stopped = true;
        // Dropping the links closes every inbox: the streams end.
        state.links.clear();
        state.index = Index::default();
    }

    /// Moves the hub to `rev` without events: synced watchers that needed a revision up to
    /// `rev` become victims (their catch-up then finds the history gone and cancels them).
    fn restart(&self, rev: i64) {
        let mut state = self.state.lock();
        let old = state.rev;
        if rev <= old {
            return;
        }
        // A synced watcher has every revision up to `old` it wants: it needs the next one.
        let lost = state.index.drain_where(|t| t.next_rev.max(old + 1) <= rev);
        for t in lost {
            if let Some(link) = state.links.get(&t.stream) {
                link.victims.list.lock().push((t.token, t.next_rev.max(old + 1)));
                link.victims.notify.notify_one();
            }
        }
        state.rev = rev;
        self.dispatched.store(state.rev, Ordering::Release);
    }

    /// Hands one read's batches to the synced watchers that want them.
    fn dispatch(&self, commits: Vec<Commit>) {
        let batches: Vec<Arc<Batch>> = commits.into_iter().filter_map(|c| c.batch).collect();
        let Some(last) = batches.last().map(|b| b.revision) else { return };
        let batches = Arc::new(batches);
        let mut state = self.state.lock();
        // stream → token → hit (tokens in first-hit order).
        let mut per_stream: HashMap<u64, Vec<Hit>> = HashMap::new();
        let mut slot: HashMap<(u64, u64), usize> = HashMap::new();
        for (b, batch) in batches.iter().enumerate() {
            if batch.revision <= state.rev {
                continue;
            }
            for (e, event) in batch.events.iter().enumerate() {
                state.index.for_each_match(&event.kv.key, |t| {
                    if !t.wants(batch.revision, event.put) {
                        return;
                    }
                    let hits = per_stream.entry(t.stream).or_default();
                    let at = *slot.entry((t.stream, t.token)).or_insert_with(|| {
                        hits.push(Hit { token: t.token, span: Arc::clone(&t.span), events: Vec::new() });
                        hits.len() - 1
                    });
                    if let Some(h) = hits.get_mut(at) {
                        h.events.push((b as u32, e as u32));
                    }
                });
            }
        }
        let mut gone = Vec::new();
        for (stream, hits) in per_stream {
            let Some(link) = state.links.get(&stream) else { continue };
            let delivery = Delivery { batches: Arc::clone(&batches), hits, revision: last };
            match link.inbox.try_send(delivery) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(d)) => {
                    // A slow stream: its watchers in this delivery leave the synced set and
                    // catch up by themselves from the first revision they did not get.
                    let victims = Arc::clone(&link.victims);
                    for hit in d.hits {
                        let first =
                            hit.events.first().and_then(|(b, _)| batches.get(*b as usize)).map_or(last, |b| b.revision);
                        state.index.remove(&hit.span, stream, hit.token);
                        victims.list.lock().push((hit.token, first));
                        VICTIMS_TOTAL.fetch_add(1, Ordering::Relaxed);
                    }
                    victims.notify.notify_one();
                }
                Err(mpsc::error::TrySendError::Closed(_)) => gone.push(stream),
            }
        }
        for stream in gone {
            state.links.remove(&stream);
            state.index.drain_where(|t| t.stream == stream);
        }
        state.rev = state.rev.max(last);
        self.dispatched.store(state.rev, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
    use super::*;
    use crate::mvcc::{Record, KV};
    use crate::state_machine::StateMachine;
    use std::time::Duration;

    fn commit(sm: &Shared, rev: i64, key: &[u8]) {
        let mut t = sm.db.begin_write().unwrap();
        let r = Record { create_revision: rev, mod_revision: rev, version: 1, lease: 0, value: b"v".to_vec() };
        t.put(KV, key, &r.encode()).unwrap();
        t.put(META, REV_KEY, &bincode::serialize(&rev).unwrap()).unwrap();
        t.commit().unwrap();
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        for _ in 0..2000 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("timed out waiting for {what}");
    }

    fn target(stream: u64, token: u64, key: &[u8], next_rev: i64) -> Target {
        Target {
            stream,
            token,
            next_rev,
            no_put: false,
            no_delete: false,
            span: Arc::new(Span::new(key, b"").unwrap()),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_inbox_makes_victims_from_the_first_revision_they_missed_and_joins_wait_for_the_hub() {
        let dir = tempfile::tempdir().unwrap();
        let sm = StateMachine::open(dir.path(), Arc::new(keeldb::fs::StdFs)).unwrap().shared;
        let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let hub = Hub::start(Arc::clone(&sm), stop_rx);
        assert_eq!(hub.dispatched(), 1);
        let (stream, mut inbox, victims) = hub.open_stream(1).unwrap();
        assert_eq!(hub.join(target(stream, 7, b"a", 2)), Join::Joined);
        assert_eq!(hub.join(target(stream, 8, b"b", 2)), Join::Joined);
        commit(&sm, 2, b"a");
        until("revision 2 dispatched", || hub.dispatched() == 2).await;
        // The inbox (one delivery) is now full; the next revisions for `a` cannot go in.
        commit(&sm, 3, b"a");
        commit(&sm, 4, b"a");
        commit(&sm, 5, b"b");
        until("revision 5 dispatched", || hub.dispatched() == 5).await;
        let d = inbox.try_recv().unwrap();
        assert_eq!((d.revision, d.hits.len(), d.hits[0].token), (2, 1, 7));
        // `a`'s watcher missed 3: it is a victim from there and out of the index; the inbox
        // was still full at 5, so `b`'s watcher is one from 5.
        let list = victims.list.lock().clone();
        assert!(list.contains(&(7, 3)), "{list:?}");
        assert!(list.contains(&(8, 5)), "{list:?}");
        assert_eq!(hub.synced_len(), 0);
        assert!(inbox.try_recv().is_err());
        // A watcher can join only ahead of what the hub dispatched.
        assert_eq!(hub.join(target(stream, 7, b"a", 3)), Join::Behind(5));
        assert_eq!(hub.join(target(stream, 7, b"a", 6)), Join::Joined);
        commit(&sm, 6, b"a");
        until("revision 6 dispatched", || hub.dispatched() == 6).await;
        let d = inbox.try_recv().unwrap();
        assert_eq!((d.revision, d.hits[0].token, d.hits[0].events.len()), (6, 7, 1));
        let batch = &d.batches[d.hits[0].events[0].0 as usize];
        assert_eq!(batch.events[d.hits[0].events[0].1 as usize].kv.key, b"a");
        hub.close_stream(stream);
        assert_eq!(hub.synced_len(), 0);
    }
}
