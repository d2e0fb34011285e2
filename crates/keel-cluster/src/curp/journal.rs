//! Where a witness keeps its pool across a crash: a store of its own (`member/witness`), written
//! by one thread.
//!
//! Invariants (replication.md, W5):
//! - **A witness acknowledges a record only once the record is on stable storage.** Each
//!   accepted command is one row (its arrival number → the pooled command); the witness's
//!   answer to the client waits for the fdatasync of the commit that holds the row. One commit
//!   carries every record queued while the previous one synced, so concurrent records share an
//!   fdatasync.
//! - **A fence is on stable storage before the pool it returns is handed over.** A member that
//!   restarts after fencing term `t` still refuses records of terms below `t`.
//! - **Removals need no sync.** A command leaves the pool when it has applied (or its term was
//!   dropped, or the leader refused it); a removal lost in a crash brings the row back at the
//!   next start, where it is dropped again if its command has applied. A command that comes
//!   back otherwise can at worst be proposed again by a later recovery, and applying is
//!   idempotent per command id.
//!
//! Jobs are sent under the pool's lock, so the store sees a command's row written before the
//! removal of that row.

use std::io;
use std::path::Path;
use std::sync::{mpsc, Arc};

use keeldb::fs::FileSystem;
use keeldb::{Database, Durability, Options, ScanRange, TxnOptions};

use super::witness::Pooled;

const POOL: &str = "pool";
const META: &str = "meta";
const FENCE_KEY: &[u8] = b"fence";
/// Most jobs one commit carries.
const BATCH: usize = 4096;

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("curp witness store: {e}"))
}

/// Waits for a job's commit.
pub type Done = tokio::sync::oneshot::Receiver<io::Result<()>>;

enum Job {
    Add {
        arrival: u64,
        row: Vec<u8>,
        done: tokio::sync::oneshot::Sender<io::Result<()>>,
    },
    Remove(Vec<u64>),
    Fence {
        term: u64,
        done: tokio::sync::oneshot::Sender<io::Result<()>>,
    },
    /// The member stops: answered once the store is closed (`Journal::close`).
    Close(tokio::sync::oneshot::Sender<()>),
}

/// What a witness store held when opened.
pub struct Loaded {
    /// Pooled commands in arrival order.
    pub pooled: Vec<Pooled>,
    /// The highest fence made durable.
    pub fence: u64,
    /// The highest arrival number ever stored (new arrivals must be above it).
    pub last_arrival: u64,
}

/// The writer's end: jobs go to its thread, which ends on [`Journal::close`] or when this is
/// dropped.
pub struct Journal {
    jobs: mpsc::Sender<Job>,
}

impl Journal {
    /// Opens (or creates) the store in `dir` and starts its writer thread.
    pub fn open(dir: &Path, fs: Arc<dyn FileSystem>) -> io::Result<(Journal, Loaded)> {
        let db = Database::open(dir, Options { fs, ..Options::with_durability(Durability::Sync) }).map_err(io_err)?;
        let mut loaded = Loaded { pooled: Vec::new(), fence: 0, last_arrival: 0 };
        {
            let txn = db.begin_read().map_err(io_err)?;
            if let Some(v) = txn.get(META, FENCE_KEY).map_err(io_err)? {
                loaded.fence = bincode::deserialize(&v).map_err(io_err)?;
            }
            for item in txn.scan(POOL, ScanRange::all()).map_err(io_err)? {
                let (key, value) = item.map_err(io_err)?;
                let arrival = key
                    .as_slice()
                    .try_into()
                    .map(u64::from_be_bytes)
                    .map_err(|_| io_err("a pool row under a key that is not an arrival number"))?;
                let pooled: Pooled = bincode::deserialize(&value).map_err(io_err)?;
                if pooled.arrival != arrival {
                    return Err(io_err("a pool row under another arrival number"));
                }
                loaded.last_arrival = loaded.last_arrival.max(arrival);
                loaded.pooled.push(pooled);
            }
        }
        let (tx, rx) = mpsc::channel();
        let fence = loaded.fence;
        std::thread::Builder::new().name("keel-curp-witness".into()).spawn(move || writer(db, rx, fence))?;
        Ok((Journal { jobs: tx }, loaded))
    }

    /// Queues the row of a newly pooled command; `Done` completes once it is durable.
    pub fn add(&self, pooled: &Pooled) -> Done {
        let (done, wait) = tokio::sync::oneshot::channel();
        match bincode::serialize(pooled) {
            Ok(row) => {
                if let Err(mpsc::SendError(Job::Add { done, .. })) =
                    self.jobs.send(Job::Add { arrival: pooled.arrival, row, done })
                {
                    let _ = done.send(Err(io_err("the writer has stopped")));
                }
            }
            Err(e) => {
                let _ = done.send(Err(io_err(e)));
            }
        }
        wait
    }

    /// Queues the removal of rows (not synced on its own).
    pub fn remove(&self, arrivals: Vec<u64>) {
        if !arrivals.is_empty() {
            let _ = self.jobs.send(Job::Remove(arrivals));
        }
    }

    /// Closes the store: jobs queued before are written, later ones fail, and this returns
    /// once its directory lock is released. The member's stop calls it: the witness is shared
    /// (`Arc`) with tasks that may outlive the stop, and the directory must not stay locked
    /// for them.
    pub async fn close(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.jobs.send(Job::Close(tx)).is_ok() {
            // An error: the thread has ended already (the store is closed).
            let _ = rx.await;
        }
    }

    /// Queues a fence at `term`; `Done` completes once it is durable.
    pub fn fence(&self, term: u64) -> Done {
        let (done, wait) = tokio::sync::oneshot::channel();
        if let Err(mpsc::SendError(Job::Fence { done, .. })) = self.jobs.send(Job::Fence { term, done }) {
            let _ = done.send(Err(io_err("the writer has stopped")));
        }
        wait
    }
}

/// Waits for a queued job's commit.
pub async fn durable(done: Done) -> io::Result<()> {
    done.await.unwrap_or_else(|_| Err(io_err("the writer has stopped")))
}

fn writer(db: Database, rx: mpsc::Receiver<Job>, mut fence: u64) {
    // After a failed commit nothing more is written: what the failed fdatasync left on disk is
    // unknown, so every later job is refused with the first error (the witness stops giving
    // fast paths; the member's Raft path is unaffected).
    let mut failed: Option<String> = None;
    let mut closers = Vec::new();
    while closers.is_empty() {
        let Ok(first) = rx.recv() else { break };
        let (jobs, close) = crate::log_store::take_batch(first, &rx, BATCH, |job| match job {
            Job::Close(tx) => Err(tx),
            job => Ok(job),
        });
        // The jobs queued before a close are still written below.
        closers.extend(close);
        if jobs.is_empty() {
            continue;
        }
        let result = match &failed {
            Some(e) => Err(io_err(e)),
            None => commit(&db, &jobs, &mut fence),
        };
        if let Err(e) = &result {
            if failed.is_none() {
                eprintln!("keel: {e}; this member's witness refuses records from now on");
                failed = Some(e.to_string());
            }
        }
        for job in jobs {
            let reply = || result.as_ref().map(|_| ()).map_err(|e| io::Error::new(e.kind(), e.to_string()));
            match job {
                Job::Add { done, .. } | Job::Fence { done, .. } => {
                    let _ = done.send(reply());
                }
                Job::Remove(_) | Job::Close(_) => {}
            }
        }
    }
    // Jobs queued behind a close fail; once `rx` is dropped, later sends fail at once.
    for job in rx.try_iter() {
        match job {
            Job::Add { done, .. } | Job::Fence { done, .. } => {
                let _ = done.send(Err(io_err("the writer has stopped")));
            }
            Job::Remove(_) => {}
            Job::Close(tx) => closers.push(tx),
        }
    }
    drop(rx);
    let _ = db.close();
    for tx in closers {
        let _ = tx.send(());
    }
}

fn commit(db: &Database, jobs: &[Job], fence: &mut u64) -> io::Result<()> {
    let must_sync = jobs.iter().any(|j| !matches!(j, Job::Remove(_)));
    let durability = if must_sync { Durability::Sync } else { Durability::Relaxed };
    let mut txn =
        db.begin_write_with(TxnOptions { durability: Some(durability), ..TxnOptions::default() }).map_err(io_err)?;
    let mut new_fence = *fence;
    for job in jobs {
        match job {
            Job::Add { arrival, row, .. } => txn.put(POOL, &arrival.to_be_bytes(), row).map_err(io_err)?,
            Job::Remove(arrivals) => {
                for a in arrivals {
                    txn.delete(POOL, &a.to_be_bytes()).map_err(io_err)?;
                }
            }
            Job::Fence { term, .. } => new_fence = new_fence.max(*term),
            Job::Close(_) => {}
        }
    }
    if new_fence > *fence {
        txn.put(META, FENCE_KEY, &bincode::serialize(&new_fence).map_err(io_err)?).map_err(io_err)?;
    }
    txn.commit().map_err(io_err)?;
    *fence = new_fence;
    Ok(())
}
