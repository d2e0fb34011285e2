//! History: reads at past timestamps and the change feed, checked against a model that keeps
//! every version, with the background collector running; compaction and bad timestamps are
//! typed errors; the commit waiter (async, no runtime) wakes on a commit.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use common::TestDir;
use keeldb::{ChangeKind, Database, Durability, Error, Options, ScanRange};

type State = BTreeMap<(String, Vec<u8>), Vec<u8>>;

fn options(keep_history: bool) -> Options {
    Options { durability: Durability::Relaxed, background_threads: true, keep_history, ..Options::default() }
}

fn state_at(db: &Database, ts: u64) -> State {
    let rx = db.begin_read_at(ts).unwrap();
    let mut out = State::new();
    for table in rx.tables() {
        for item in rx.scan(&table, ScanRange::all()).unwrap() {
            let (k, v) = item.unwrap();
            out.insert((table.clone(), k), v);
        }
    }
    out
}

/// Commits a deterministic pseudo-random workload; returns the model's state after each commit
/// timestamp.
fn workload(db: &Database, seed: u64, commits: usize) -> BTreeMap<u64, State> {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let start = db.stats().last_commit_ts;
    let mut model = state_at(db, start);
    let mut states = BTreeMap::new();
    states.insert(start, model.clone());
    for _ in 0..commits {
        let mut tx = db.begin_write().unwrap();
        for _ in 0..(1 + next() % 4) {
            let table = format!("t{}", next() % 2);
            let key = format!("k{}", next() % 20).into_bytes();
            match next() % 10 {
                0 => {
                    tx.delete(&table, &key).unwrap();
                    model.remove(&(table, key));
                }
                1 if next() % 4 == 0 => {
                    tx.drop_table(&table).unwrap();
                    model.retain(|(t, _), _| *t != table);
                }
                _ => {
                    let value = format!("v{}", next() % 1000).into_bytes();
                    tx.put(&table, &key, &value).unwrap();
                    model.insert((table, key), value);
                }
            }
        }
        let info = tx.commit().unwrap();
        states.insert(info.ts, model.clone());
    }
    states
}

#[test]
fn reads_at_every_past_timestamp_match_the_model_while_the_collector_runs() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(true)).unwrap();
    let states = workload(&db, 42, 400);
    std::thread::sleep(Duration::from_millis(150)); // Let the collector run at least twice.
    for (&ts, expected) in &states {
        assert_eq!(&state_at(&db, ts), expected, "state at ts {ts}");
    }
    let latest = *states.keys().last().unwrap();
    assert!(
        matches!(db.begin_read_at(latest + 1), Err(Error::FutureTimestamp { requested, latest: l }) if requested == latest + 1 && l == latest)
    );

    // Compaction: history below the new floor is gone, at and above it is intact.
    let mid = latest / 2;
    assert_eq!(db.retain_history_since(mid).unwrap(), mid);
    std::thread::sleep(Duration::from_millis(150));
    assert!(matches!(db.begin_read_at(mid - 1), Err(Error::Compacted { available, .. }) if available == mid));
    assert!(matches!(db.retain_history_since(mid - 1), Err(Error::Compacted { .. })), "the floor only moves forward");
    for (&ts, expected) in states.range(mid..) {
        assert_eq!(&state_at(&db, ts), expected, "state at ts {ts} after compaction");
    }
    assert_eq!(db.history_floor(), Some(mid));
    db.close().unwrap();
}

#[test]
fn the_change_feed_replays_every_commit_in_order() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(true)).unwrap();
    let start = db.stats().last_commit_ts;
    let states = workload(&db, 7, 300);
    // Page through the feed in small pages and apply it to the model of `start`.
    let mut model = states[&start].clone();
    let mut after = start;
    let mut seen_ts = Vec::new();
    loop {
        let page = db.changes_since(after, 5).unwrap();
        let Some(last) = page.last() else { break };
        after = last.ts;
        for c in page {
            if seen_ts.last() != Some(&c.ts) {
                assert!(seen_ts.last().is_none_or(|&p| p < c.ts), "feed out of order");
                seen_ts.push(c.ts);
            }
            let table = c.table.to_string();
            match c.kind {
                ChangeKind::Put(v) => {
                    model.insert((table, c.key), v);
                }
                ChangeKind::Delete => {
                    model.remove(&(table, c.key));
                }
                ChangeKind::DropTable => model.retain(|(t, _), _| *t != table),
            }
            // After the last change of a commit the model equals that commit's state.
        }
        assert_eq!(&model, &states[&after], "model after the feed up to ts {after}");
    }
    assert_eq!(after, *states.keys().last().unwrap(), "the feed reaches the newest commit");
    let latest = after;
    assert!(matches!(db.changes_since(latest + 1, 10), Err(Error::FutureTimestamp { .. })));
    db.retain_history_since(start + 100).unwrap();
    assert!(
        matches!(db.changes_since(start + 99, 10), Err(Error::Compacted { available, .. }) if available == start + 100)
    );
    assert_eq!(db.changes_since(start + 100, 1).unwrap().first().map(|c| c.ts), Some(start + 101));
    db.discard_history();
    assert!(matches!(db.changes_since(latest, 10), Err(Error::InvalidArgument(_))));
}

#[test]
fn without_history_old_reads_are_refused_and_live_snapshots_still_work() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(false)).unwrap();
    workload(&db, 3, 50);
    let latest = db.stats().last_commit_ts;
    std::thread::sleep(Duration::from_millis(120));
    assert!(matches!(db.begin_read_at(latest - 10), Err(Error::Compacted { .. })));
    assert!(db.begin_read_at(latest).is_ok());
    assert!(matches!(db.changes_since(latest, 10), Err(Error::InvalidArgument(_))));
    // Starting history later keeps versions from then on.
    let floor = db.retain_history_since(latest).unwrap();
    let states = workload(&db, 4, 50);
    std::thread::sleep(Duration::from_millis(120));
    for (&ts, expected) in states.range(floor..) {
        if ts > floor {
            assert_eq!(&state_at(&db, ts), expected);
        }
    }
}

struct Flag(std::sync::Mutex<bool>, std::sync::Condvar);
impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        *self.0.lock().unwrap() = true;
        self.1.notify_all();
    }
}

/// A minimal executor: polls, parks until woken (bounded), polls again.
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    let flag = Arc::new(Flag(std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let waker = Waker::from(Arc::clone(&flag));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    for _ in 0..10_000 {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        let mut woken = flag.0.lock().unwrap();
        while !*woken {
            let (w, timeout) = flag.1.wait_timeout(woken, Duration::from_secs(10)).unwrap();
            woken = w;
            assert!(!timeout.timed_out(), "the waiter was never woken");
        }
        *woken = false;
    }
    panic!("future never completed");
}

#[test]
fn commit_waiters_wake_on_a_commit_and_on_close() {
    let t = TestDir::new();
    let db = Database::open(t.path(), options(true)).unwrap();
    let before = db.stats().last_commit_ts;
    let writer = {
        let db = db.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            let mut tx = db.begin_write().unwrap();
            tx.put("t", b"k", b"v").unwrap();
            tx.commit().unwrap().ts
        })
    };
    let seen = block_on(db.wait_for_commit_after(before)).unwrap();
    let committed = writer.join().unwrap();
    assert_eq!(seen, committed);
    assert_eq!(db.wait_for_commit_after_timeout(before, Duration::from_secs(1)), committed);
    assert_eq!(db.wait_for_commit_after_timeout(committed, Duration::from_millis(20)), committed, "times out");
    let waiter = db.wait_for_commit_after(committed);
    let closer = {
        let db = db.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            db.close().unwrap();
        })
    };
    assert!(matches!(block_on(waiter), Err(Error::Closed)));
    closer.join().unwrap();
}
