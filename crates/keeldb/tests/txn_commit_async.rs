//! `WriteTxn::commit_async`: many futures on one runtime thread share fdatasyncs, and a dropped
//! future's commit still happens exactly once. Counted through the file-system seam and the
//! engine's counters, never timed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;

use std::future::Future;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use common::*;
use keel_testkit::counting::CountingFs;
use keeldb::fs::{DirLock, FileHandle, FileSystem, OpenMode, StdFs};
use keeldb::{CommitFuture, Database, Durability, Error, Options};

fn open_with(path: &Path, fs: Arc<dyn FileSystem>, d: Durability) -> Database {
    Database::open(path, Options { durability: d, fs, background_threads: false, ..Options::default() }).unwrap()
}

fn put_async(db: &Database, key: &[u8]) -> CommitFuture {
    let mut tx = db.begin_write().unwrap();
    tx.put("t", key, b"v").unwrap();
    tx.commit_async()
}

struct Noop;
impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

/// Polls a future once with a waker that does nothing.
fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    let waker = Waker::from(Arc::new(Noop));
    Pin::new(f).poll(&mut Context::from_waker(&waker))
}

#[test]
fn thousands_of_async_commits_on_one_thread_share_fdatasyncs() {
    let t = TestDir::new();
    let fs = CountingFs::new();
    let db = open_with(&t.path(), Arc::new(fs.clone()), Durability::Sync);
    let commits = 5000u64;
    let before = fs.counts.file_syncs.load(Ordering::SeqCst);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let timestamps = rt.block_on(async {
        let tasks: Vec<_> = (0..commits)
            .map(|i| {
                let db = db.clone();
                tokio::spawn(async move { put_async(&db, &i.to_be_bytes()).await.unwrap().ts })
            })
            .collect();
        let mut ts = Vec::new();
        for task in tasks {
            ts.push(task.await.unwrap());
        }
        ts
    });
    let syncs = fs.counts.file_syncs.load(Ordering::SeqCst) - before;
    let stats = db.stats();
    assert_eq!(stats.commits, commits);
    assert_eq!(scan_all(&db, "t").len() as u64, commits);
    let mut sorted = timestamps.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted, (1..=commits).collect::<Vec<_>>(), "every commit got its own dense timestamp");
    assert_eq!(syncs, stats.wal_syncs, "every WAL fdatasync is counted");
    eprintln!("{commits} async commits on one thread: {syncs} fdatasyncs, {} batches", stats.batches);
    assert!(syncs * 100 <= commits, "{commits} async commits used {syncs} fdatasyncs: not shared");
}

#[test]
fn async_commit_reports_conflicts_and_read_only_commits() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"k", b"0");
    let mut a = db.begin_write().unwrap();
    let mut b = db.begin_write().unwrap();
    a.put("t", b"k", b"a").unwrap();
    b.put("t", b"k", b"b").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let (ra, rb) = rt.block_on(async { (a.commit_async().await, b.commit_async().await) });
    assert!(ra.is_ok());
    match rb {
        Err(Error::Conflict { table, key, .. }) => assert_eq!((table.as_str(), key.as_deref()), ("t", Some(&b"k"[..]))),
        other => panic!("expected a conflict naming the key, got {other:?}"),
    }
    let ro = db.begin_write().unwrap();
    let snapshot = ro.snapshot_ts();
    assert_eq!(rt.block_on(ro.commit_async()).unwrap().ts, snapshot, "no writes: the snapshot timestamp");
}

#[test]
fn dropped_futures_still_commit_exactly_once() {
    let t = TestDir::new();
    let db = open_with(&t.path(), Arc::new(StdFs), Durability::Relaxed);
    // Never polled: the first claims leadership, so dropping it must lead the whole queue.
    let unpolled: Vec<CommitFuture> = (0..100u32).map(|i| put_async(&db, &i.to_be_bytes())).collect();
    // Polled once, then dropped: followers that registered a waker and went away.
    let mut polled: Vec<CommitFuture> = (100..200u32).map(|i| put_async(&db, &i.to_be_bytes())).collect();
    for f in polled.iter_mut().skip(1) {
        assert!(poll_once(f).is_pending(), "a follower waits for the leader");
    }
    drop(unpolled);
    drop(polled);
    let stats = db.stats();
    assert_eq!((stats.commits, stats.last_commit_ts), (200, 200), "each commit sequenced once");
    assert_eq!(scan_all(&db, "t").len(), 200);
    let digest = db.digest();
    db.close().unwrap();
    let db = open(&t.path());
    let report = db.recovery_report();
    assert_eq!((report.frames_replayed, report.last_ts), (200, 200), "one frame per commit in the log");
    assert_eq!(db.digest(), digest);
    assert_eq!(scan_all(&db, "t").len(), 200);
}

/// The real file system, running a hook (once) inside the first WAL fdatasync after it is
/// armed: a way to queue commits while a leader is in the middle of its batch.
#[derive(Clone, Default)]
struct HookFs {
    hook: Arc<Mutex<Option<Hook>>>,
}
type Hook = Box<dyn FnOnce() + Send>;

impl std::fmt::Debug for HookFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HookFs")
    }
}

struct HookFile {
    inner: Arc<dyn FileHandle>,
    hook: Arc<Mutex<Option<Hook>>>,
}

impl std::fmt::Debug for HookFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl FileHandle for HookFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.inner.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        let hook = self.hook.lock().unwrap().take();
        if let Some(hook) = hook {
            hook();
        }
        self.inner.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
}

impl FileSystem for HookFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FileHandle>> {
        Ok(Arc::new(HookFile { inner: StdFs.open(path, mode)?, hook: Arc::clone(&self.hook) }))
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        StdFs.create_dir_all(path)
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        StdFs.list_dir(path)
    }
    fn exists(&self, path: &Path) -> io::Result<bool> {
        StdFs.exists(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        StdFs.rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        StdFs.remove_file(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        StdFs.sync_dir(dir)
    }
    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn DirLock>> {
        StdFs.lock_exclusive(path)
    }
}

#[test]
fn commits_queued_and_dropped_during_a_batch_complete() {
    let t = TestDir::new();
    let fs = HookFs::default();
    let db = open_with(&t.path(), Arc::new(fs.clone()), Durability::Sync);
    // While the leader's batch is being synced, two commits queue up and their futures are
    // dropped: when the leader releases the queue there is nobody alive to hand it to.
    let during = db.clone();
    *fs.hook.lock().unwrap() = Some(Box::new(move || {
        drop(put_async(&during, b"queued-1"));
        drop(put_async(&during, b"queued-2"));
    }));
    let mut leader = put_async(&db, b"leader");
    assert!(poll_once(&mut leader).is_pending(), "a new leader yields once before leading");
    let info = match poll_once(&mut leader) {
        Poll::Ready(r) => r.unwrap(),
        Poll::Pending => panic!("the leader's own commit completes on its leading poll"),
    };
    assert_eq!(info.ts, 1);
    // The queued commits were not stranded: the leader kept leading them.
    assert_eq!(db.stats().commits, 3);
    assert_eq!(get(&db, "t", b"queued-1").as_deref(), Some(&b"v"[..]));
    assert_eq!(get(&db, "t", b"queued-2").as_deref(), Some(&b"v"[..]));
}

#[test]
fn commit_future_is_send() {
    fn assert_send<T: Send + 'static>() {}
    assert_send::<CommitFuture>();
}

#[tokio::test(flavor = "current_thread")]
async fn async_commit_on_a_closed_database_fails_without_queueing() {
    let t = TestDir::new();
    let db = open(&t.path());
    let tx = {
        let mut tx = db.begin_write().unwrap();
        tx.put("t", b"k", b"v").unwrap();
        tx
    };
    db.clone().close().unwrap();
    assert!(matches!(tx.commit_async().await, Err(Error::Closed)));
}

#[test]
fn close_leads_commits_whose_futures_were_never_polled() {
    let t = TestDir::new();
    let db = open(&t.path());
    let pending = put_async(&db, b"k");
    // Nobody leads the queued commit; close must not wait for it forever.
    db.clone().close().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    assert!(matches!(rt.block_on(pending), Err(Error::Closed)), "closed before it was sequenced");
    let db = open(&t.path());
    assert_eq!(get(&db, "t", b"k"), None);
}

#[test]
fn async_and_blocking_committers_share_one_pipeline() {
    let t = TestDir::new();
    let fs = CountingFs::new();
    let db = open_with(&t.path(), Arc::new(fs.clone()), Durability::Sync);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
    std::thread::scope(|s| {
        for th in 0..4u32 {
            let db = db.clone();
            s.spawn(move || {
                for i in 0..100u32 {
                    put(&db, "t", format!("sync-{th}-{i}").as_bytes(), b"v");
                }
            });
        }
        rt.block_on(async {
            let tasks: Vec<_> = (0..2000u32)
                .map(|i| {
                    let db = db.clone();
                    tokio::spawn(async move { put_async(&db, format!("async-{i}").as_bytes()).await.unwrap().ts })
                })
                .collect();
            for task in tasks {
                assert!(task.await.unwrap() > 0);
            }
        });
    });
    let stats = db.stats();
    assert_eq!(stats.commits, 2400);
    assert_eq!(scan_all(&db, "t").len(), 2400);
    assert_eq!(stats.last_commit_ts, 2400, "dense timestamps across both kinds of committer");
    assert!(stats.wal_syncs < 2400, "some fdatasyncs were shared ({} for 2400 commits)", stats.wal_syncs);
}

/// A future that was polled once (and so yielded before leading) must not stall a blocking
/// commit made next on the same thread: before, the future held leadership across its yield,
/// and the blocking commit parked forever behind a leader that could never run.
#[test]
fn a_blocking_commit_after_one_poll_of_a_future_on_the_same_thread_does_not_hang() {
    let t = TestDir::new();
    let path = t.path();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let db = open_with(&path, Arc::new(StdFs), Durability::Sync);
        let mut first = put_async(&db, b"async");
        assert!(poll_once(&mut first).is_pending(), "the first poll yields before leading");
        let mut tx = db.begin_write().unwrap();
        tx.put("t", b"blocking", b"v").unwrap();
        let blocking_ts = tx.commit().unwrap().ts;
        let async_ts = match poll_once(&mut first) {
            Poll::Ready(info) => info.unwrap().ts,
            Poll::Pending => panic!("the blocking commit's leader should have committed the queued future too"),
        };
        let _ = done_tx.send((async_ts, blocking_ts));
    });
    let (async_ts, blocking_ts) =
        done_rx.recv_timeout(std::time::Duration::from_secs(30)).expect("the blocking commit hung behind the future");
    assert_eq!((async_ts, blocking_ts), (1, 2), "the future queued first, so it commits first");
}

/// Tasks that commit in a loop on one current-thread runtime keep sharing fdatasyncs round after
/// round, not only on their first commit. (A version that released leadership during the first
/// poll's yield let tokio re-poll the yielding task before the others queued: 1.1 commits per
/// fdatasync here.)
#[test]
fn looping_tasks_on_one_runtime_thread_keep_sharing_fdatasyncs() {
    let t = TestDir::new();
    let db = open_with(&t.path(), Arc::new(StdFs), Durability::Sync);
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let before = db.stats().wal_syncs;
    runtime.block_on(async {
        let tasks: Vec<_> = (0..64u64)
            .map(|task| {
                let db = db.clone();
                tokio::spawn(async move {
                    for i in 0..20u64 {
                        let mut tx = db.begin_write().unwrap();
                        tx.put("t", &(task << 32 | i).to_be_bytes(), b"v").unwrap();
                        tx.commit_async().await.unwrap();
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
    });
    let syncs = db.stats().wal_syncs - before;
    assert!(syncs * 8 <= 64 * 20, "1,280 commits took {syncs} fdatasyncs (fewer than 8 commits each)");
}
