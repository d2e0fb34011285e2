//! `close()` (and dropping the last handle) returns the directory only after every background
//! thread of the handle has stopped touching it: the lock is the last thing released.
//!
//! The interleaving test stops the automatic checkpoint thread at each of its file-system
//! operations in turn, closes the database while it is stopped, then lets it go on, and checks
//! from a log of every file-system event that nothing of the checkpoint happened after the
//! directory lock was released. The real-thread test closes and reopens under load.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::TestDir;
use keeldb::fs::{DirLock, FileHandle, FileSystem, OpenMode, StdFs};
use keeldb::{Database, Durability, Error, Options};

const CHECKPOINT_THREAD: &str = "keeldb-checkpoint";

/// Shared state of the gate: an event log and a stop point for the checkpoint thread.
#[derive(Debug, Default)]
struct Gate {
    events: Mutex<Vec<String>>,
    /// The checkpoint thread's operation count, and the operation to stop at.
    ops: Mutex<usize>,
    stop_at: Mutex<Option<usize>>,
    blocked: AtomicBool,
    released: Mutex<bool>,
    wake: Condvar,
}

impl Gate {
    fn event(&self, what: String) {
        let thread = std::thread::current().name().unwrap_or("?").to_owned();
        self.events.lock().unwrap().push(format!("{thread}: {what}"));
        if thread != CHECKPOINT_THREAD {
            return;
        }
        let n = {
            let mut ops = self.ops.lock().unwrap();
            *ops += 1;
            *ops
        };
        if *self.stop_at.lock().unwrap() == Some(n) {
            self.blocked.store(true, Ordering::Release);
            let mut released = self.released.lock().unwrap();
            while !*released {
                released = self.wake.wait(released).unwrap();
            }
        }
    }
    fn release(&self) {
        *self.released.lock().unwrap() = true;
        self.wake.notify_all();
    }
}

#[derive(Debug)]
struct GateFs {
    gate: Arc<Gate>,
}

#[derive(Debug)]
struct GateFile {
    inner: Arc<dyn FileHandle>,
    name: String,
    gate: Arc<Gate>,
}

#[derive(Debug)]
struct GateLock {
    _inner: Box<dyn DirLock>,
    gate: Arc<Gate>,
}
impl DirLock for GateLock {}
impl Drop for GateLock {
    fn drop(&mut self) {
        self.gate.event("unlock".into());
    }
}

fn name(p: &Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

impl FileHandle for GateFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        self.gate.event(format!("write {}", self.name));
        self.inner.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.gate.event(format!("sync {}", self.name));
        self.inner.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.gate.event(format!("set_len {}", self.name));
        self.inner.set_len(len)
    }
}

impl FileSystem for GateFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FileHandle>> {
        self.gate.event(format!("open {} {mode:?}", name(path)));
        let inner = StdFs.open(path, mode)?;
        Ok(Arc::new(GateFile { inner, name: name(path), gate: Arc::clone(&self.gate) }))
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        StdFs.create_dir_all(path)
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        self.gate.event("list_dir".into());
        StdFs.list_dir(path)
    }
    fn exists(&self, path: &Path) -> io::Result<bool> {
        StdFs.exists(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.gate.event(format!("rename {} {}", name(from), name(to)));
        StdFs.rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.gate.event(format!("remove {}", name(path)));
        StdFs.remove_file(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.gate.event("sync_dir".into());
        StdFs.sync_dir(dir)
    }
    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn DirLock>> {
        let inner = StdFs.lock_exclusive(path)?;
        self.gate.event("lock".into());
        Ok(Box::new(GateLock { _inner: inner, gate: Arc::clone(&self.gate) }))
    }
}

fn options(fs: Arc<dyn FileSystem>) -> Options {
    Options {
        durability: Durability::Relaxed,
        background_threads: true,
        checkpoint_wal_bytes: 16 * 1024,
        wal_segment_bytes: 8 * 1024,
        fs,
        ..Options::default()
    }
}

/// Commits on its own thread (a commit can wait on the stopped checkpoint, for example while
/// it holds the WAL during a segment roll) until the checkpoint thread stops at the gate or a
/// bounded number of commits went by. Returns the thread; it yields how many commits succeeded.
fn committer(db: Database, gate: Arc<Gate>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut committed = 0u64;
        while Instant::now() < deadline && committed < 200_000 && !gate.blocked.load(Ordering::Acquire) {
            let mut tx = db.begin_write().unwrap();
            tx.put("t", &committed.to_be_bytes(), &[7u8; 100]).unwrap();
            match tx.commit() {
                Ok(_) => committed += 1,
                Err(Error::Closed) => break,
                Err(e) => panic!("commit failed: {e}"),
            }
            if committed.is_multiple_of(64) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        committed
    })
}

fn wait_blocked(gate: &Gate, writer: &std::thread::JoinHandle<u64>) -> bool {
    while !writer.is_finished() {
        if gate.blocked.load(Ordering::Acquire) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    gate.blocked.load(Ordering::Acquire)
}

/// Asserts that the lock was released once, after the last checkpoint-thread event.
fn assert_lock_released_last(events: &[String], case: &str) {
    let unlock = events.iter().position(|e| e.ends_with(": unlock")).unwrap_or_else(|| panic!("{case}: no unlock"));
    let late: Vec<&String> = events[unlock + 1..].iter().filter(|e| e.starts_with(CHECKPOINT_THREAD)).collect();
    if !late.is_empty() {
        eprintln!("{events:#?}");
    }
    assert!(
        late.is_empty(),
        "{case}: the checkpoint thread touched the directory after the lock was released: {late:?}"
    );
}

/// For each operation k of the automatic checkpoint: stop the checkpoint at k, close (or drop)
/// the database from another thread, release the checkpoint, then check the event order and
/// that the store reopens with every commit.
fn stop_checkpoint_at_each_step(drop_instead_of_close: bool, every: usize) -> usize {
    let mut steps = 0;
    for stop_at in (1..200).step_by(every) {
        let t = TestDir::new();
        let gate = Arc::new(Gate::default());
        *gate.stop_at.lock().unwrap() = Some(stop_at);
        let db = Database::open(t.path(), options(Arc::new(GateFs { gate: Arc::clone(&gate) }))).unwrap();
        let writer = committer(db.clone(), Arc::clone(&gate));
        let blocked = wait_blocked(&gate, &writer);
        let case = format!("stop at checkpoint op {stop_at}, drop={drop_instead_of_close}");
        if !blocked {
            gate.release();
            writer.join().unwrap();
            db.close().unwrap();
            assert!(stop_at > 3, "{case}: the automatic checkpoint never ran");
            break;
        }
        steps += 1;
        let closer = std::thread::Builder::new()
            .name("closer".into())
            .spawn(move || {
                if drop_instead_of_close {
                    drop(db);
                    Ok(())
                } else {
                    db.close()
                }
            })
            .unwrap();
        // While the checkpoint is stopped, the directory must still be held.
        std::thread::sleep(Duration::from_millis(20));
        match Database::open(t.path(), options(Arc::new(StdFs))) {
            Err(Error::Locked(_)) => {}
            Ok(_) => panic!("{case}: a second handle opened the directory while the checkpoint was running"),
            Err(e) => panic!("{case}: unexpected error while the checkpoint was stopped: {e}"),
        }
        gate.release();
        closer.join().unwrap().unwrap();
        let committed = writer.join().unwrap();
        gate.event("close returned".into());
        // After a drop, the checkpoint thread holds the last reference and releases the lock
        // when it finishes: wait for that (bounded).
        let deadline = Instant::now() + Duration::from_secs(10);
        let db = loop {
            match Database::open(t.path(), options(Arc::new(StdFs))) {
                Ok(db) => break db,
                Err(Error::Locked(_)) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
                Err(e) => panic!("{case}: reopen failed: {e}"),
            }
        };
        let events = gate.events.lock().unwrap().clone();
        assert_lock_released_last(&events, &case);
        if !drop_instead_of_close {
            let unlock = events.iter().position(|e| e.ends_with(": unlock")).unwrap();
            let returned = events.iter().position(|e| e.ends_with("close returned")).unwrap();
            assert!(unlock < returned, "{case}: close returned before the lock was released");
        }
        let rx = db.begin_read().unwrap();
        for k in 0..committed {
            assert!(rx.get("t", &k.to_be_bytes()).unwrap().is_some(), "{case}: commit {k} lost");
        }
        drop(rx);
        db.close().unwrap();
    }
    steps
}

#[test]
fn close_waits_for_the_checkpoint_thread_at_every_step() {
    let steps = stop_checkpoint_at_each_step(false, 1);
    assert!(steps >= 5, "the checkpoint was stopped at only {steps} operations");
}

#[test]
fn dropping_the_last_handle_waits_for_the_checkpoint_thread_at_every_step() {
    let steps = stop_checkpoint_at_each_step(true, 3);
    assert!(steps >= 3, "the checkpoint was stopped at only {steps} operations");
}

#[test]
fn reopen_right_after_close_under_frequent_checkpoints() {
    let t = TestDir::new();
    let mut expected = 0u64;
    for round in 0..20 {
        let db = Database::open(t.path(), options(Arc::new(StdFs)))
            .unwrap_or_else(|e| panic!("round {round}: open right after close failed: {e}"));
        let rx = db.begin_read().unwrap();
        for k in 0..expected {
            assert!(rx.get("t", &k.to_be_bytes()).unwrap().is_some(), "round {round}: commit {k} lost");
        }
        drop(rx);
        let writers: Vec<_> = (0..2u64)
            .map(|w| {
                let db = db.clone();
                let base = expected;
                std::thread::spawn(move || {
                    for i in 0..150u64 {
                        let k = base + w * 150 + i;
                        let mut tx = db.begin_write().unwrap();
                        tx.put("t", &k.to_be_bytes(), &[1u8; 200]).unwrap();
                        tx.commit().unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        expected += 300;
        db.close().unwrap();
    }
}
