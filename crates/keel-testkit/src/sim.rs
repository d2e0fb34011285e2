//! `SimFs`: an in-memory, seeded, deterministic file system behind the engine's seam
//! ([`keeldb::fs::FileSystem`]) that models what a real disk may do to unsynced data.
//!
//! It owns the simulated tree, crash resolution and fault injection; it knows nothing of the
//! WAL or checkpoint formats. Per file it keeps the durable bytes and the changes written since
//! the last `sync_data`; per directory the durable entries and the creates, renames and removes
//! since the last `sync_dir`. [`SimFs::crash`] is a power loss: every unsynced change may be
//! lost, kept, torn at 512-byte granularity or bit-flipped, and unsynced directory operations
//! are forgotten (or a prefix of them kept). [`SimFs::kill_process`] is a process crash: the
//! page cache survives, only the handles and locks die. Faults ([`Fault`]) fail chosen calls
//! with `EIO` or `ENOSPC`; short writes return fewer bytes than asked. Every decision comes
//! from one seeded generator, so a failure replays from its seed (single-threaded workloads
//! replay exactly; multi-threaded ones replay the same decisions only if the interleaving
//! repeats). The fault model and its reasons are in `docs/RELIABILITY.md`.
//!
//! After a crash every handle and lock from before it fails with an error, so a `Database`
//! that was open can simply be dropped and a new one opened on the same `SimFs`. Drop the old
//! one *after* the crash: before it, its `Drop` would still write and sync a clean-close mark.

mod crash;
mod fault;
mod state;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keeldb::fs::{DirLock, FileHandle, FileSystem, OpenMode};
use parking_lot::Mutex;

pub use crash::SECTOR_BYTES;
pub use fault::{Fault, FaultError, FaultOp};
use state::{InodeId, Node, State};

/// Probabilities that shape what a power loss does to unsynced data.
#[derive(Debug, Clone)]
pub struct FaultModel {
    /// Chance that the last kept unsynced write of a file is torn at a sector boundary.
    pub tear_probability: f64,
    /// Chance that a file with kept unsynced bytes gets one to three flipped bits in them.
    pub bit_flip_probability: f64,
    /// Chance that a crash keeps a random prefix of each directory's unsynced operations
    /// (otherwise all are forgotten).
    pub dir_prefix_probability: f64,
    /// Whether a failed `sync_data` drops the file's unsynced changes from what can reach the
    /// disk (Linux after fsyncgate); reads keep seeing them until the crash.
    pub lose_on_failed_sync: bool,
    /// A broken disk that acknowledges `sync_data` and `sync_dir` without persisting anything.
    /// Only for checking that the crash tests catch lost data; never the model of a real disk.
    pub lying_fsync: bool,
}

impl Default for FaultModel {
    fn default() -> Self {
        FaultModel {
            tear_probability: 0.5,
            bit_flip_probability: 0.15,
            dir_prefix_probability: 0.5,
            lose_on_failed_sync: true,
            lying_fsync: false,
        }
    }
}

/// Counters over the life of one [`SimFs`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimStats {
    /// `write_at` calls that wrote bytes.
    pub writes: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Successful file `sync_data` calls.
    pub file_syncs: u64,
    /// Successful `sync_dir` calls.
    pub dir_syncs: u64,
    /// Power losses simulated.
    pub crashes: u64,
    /// Process crashes simulated.
    pub process_kills: u64,
    /// Unsynced changes kept by crashes.
    pub writes_kept: u64,
    /// Unsynced changes lost by crashes.
    pub writes_dropped: u64,
    /// Writes torn by crashes.
    pub torn_writes: u64,
    /// Bits flipped by crashes.
    pub bit_flips: u64,
    /// Unsynced directory operations kept by crashes.
    pub dir_ops_kept: u64,
    /// Unsynced directory operations forgotten by crashes.
    pub dir_ops_forgotten: u64,
    /// Calls failed by injected faults.
    pub faults_injected: u64,
    /// Writes cut short.
    pub short_writes: u64,
}

/// What one power loss did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CrashReport {
    /// How unsynced file changes were chosen: `drop-all`, `keep-all`, `keep-prefix`,
    /// `keep-subset`.
    pub file_loss: &'static str,
    /// Whether directories kept a prefix of their unsynced operations.
    pub dir_prefix: bool,
    /// Files with unsynced changes that were resolved.
    pub files_affected: u64,
    /// Unsynced changes kept.
    pub writes_kept: u64,
    /// Unsynced changes lost.
    pub writes_dropped: u64,
    /// Writes torn.
    pub torn_writes: u64,
    /// Bits flipped.
    pub bit_flips: u64,
    /// Directory operations kept.
    pub dir_ops_kept: u64,
    /// Directory operations forgotten.
    pub dir_ops_forgotten: u64,
}

/// The simulated file system. Cheap to clone; clones share one disk.
#[derive(Clone)]
pub struct SimFs {
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for SimFs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.state.lock();
        f.debug_struct("SimFs")
            .field("seed", &st.seed)
            .field("generation", &st.generation)
            .field("ops", &st.ops)
            .finish()
    }
}

impl SimFs {
    /// An empty disk (only `/` exists) with the default fault model.
    pub fn new(seed: u64) -> SimFs {
        SimFs::with_model(seed, FaultModel::default())
    }

    /// An empty disk with a chosen fault model.
    pub fn with_model(seed: u64, model: FaultModel) -> SimFs {
        SimFs { state: Arc::new(Mutex::new(State::new(seed, model))) }
    }

    /// The seed every decision derives from.
    pub fn seed(&self) -> u64 {
        self.state.lock().seed
    }

    /// A power loss: resolves every unsynced change per the fault model, invalidates every
    /// handle and lock, and clears a pending stop. Injected faults stay armed.
    pub fn crash(&self) -> CrashReport {
        let mut st = self.state.lock();
        let report = crash::power_loss(&mut st);
        st.note(format!("-- power loss: {report:?}"));
        restart(&mut st);
        report
    }

    /// A process crash (`kill -9`): handles and locks die, but everything written stays in the
    /// page cache, still unsynced, for a later power loss to decide.
    pub fn kill_process(&self) {
        let mut st = self.state.lock();
        st.stats.process_kills += 1;
        st.note("-- process killed".to_owned());
        restart(&mut st);
    }

    /// Lets `n` more mutating calls succeed, then stops the world: the next mutating call and
    /// every call after it fail, until [`SimFs::crash`] or [`SimFs::kill_process`].
    pub fn stop_after_ops(&self, n: u64) {
        let mut st = self.state.lock();
        st.stop_at = Some(st.ops + n);
    }

    /// Disarms a stop that has not happened yet (a stopped world stays stopped until a crash).
    pub fn cancel_stop(&self) {
        self.state.lock().stop_at = None;
    }

    /// The path of the call that stopped the world, if it has stopped.
    pub fn stopped_on(&self) -> Option<PathBuf> {
        let st = self.state.lock();
        st.stopped.then(|| st.stopped_on.clone()).flatten()
    }

    /// Whether the world has stopped.
    pub fn is_stopped(&self) -> bool {
        self.state.lock().stopped
    }

    /// Mutating calls made so far (creates, writes, set_len, syncs, renames, removes).
    pub fn ops(&self) -> u64 {
        self.state.lock().ops
    }

    /// Adds a fault rule.
    pub fn inject(&self, fault: Fault) {
        self.state.lock().faults.push(fault);
    }

    /// Removes every fault rule and turns short writes off.
    pub fn clear_faults(&self) {
        let mut st = self.state.lock();
        st.faults.clear();
        st.short_write_probability = 0.0;
    }

    /// Makes each write return fewer bytes than asked with probability `p`.
    pub fn set_short_writes(&self, p: f64) {
        self.state.lock().short_write_probability = p;
    }

    /// Makes every file `sync_data` take this long (outside the disk's lock), so that
    /// concurrent committers queue up behind it as they do on a real disk.
    pub fn set_sync_delay(&self, delay: std::time::Duration) {
        self.state.lock().sync_delay = delay;
    }

    /// Counters so far.
    pub fn stats(&self) -> SimStats {
        self.state.lock().stats.clone()
    }

    /// The last few hundred mutating calls, faults and crashes, oldest first.
    pub fn trace(&self) -> Vec<String> {
        self.state.lock().trace.iter().cloned().collect()
    }

    /// The bytes a read of `path` would return now, if it is a file.
    pub fn read_file(&self, path: &Path) -> Option<Vec<u8>> {
        let st = self.state.lock();
        let id = st.file_at(path).ok()?;
        st.inodes.get(&id).map(|i| i.visible.clone())
    }

    /// Names in the directory at `path` with their visible and durable sizes and the number
    /// of unsynced changes, sorted; for diagnostics.
    pub fn describe_dir(&self, path: &Path) -> Vec<String> {
        let st = self.state.lock();
        let Some(dir) = st.dir_at(path).and_then(|d| st.dirs.get(&d)) else { return Vec::new() };
        dir.current
            .iter()
            .map(|(name, node)| match node {
                Node::File(id) => {
                    let i = st.inodes.get(id);
                    let durable_entry = if dir.durable.get(name) == Some(node) { "" } else { " (entry not durable)" };
                    format!(
                        "{name}: {} bytes, {} durable, {} unsynced changes{durable_entry}",
                        i.map_or(0, |i| i.visible.len()),
                        i.map_or(0, |i| i.durable.len()),
                        i.map_or(0, |i| i.pending.len())
                    )
                }
                Node::Dir(_) => format!("{name}/"),
            })
            .collect()
    }

    /// Flips one bit of a file's durable (and visible) bytes: damage to data that was already
    /// on the disk, for corruption tests. Returns false if there is no such byte.
    pub fn corrupt_durable(&self, path: &Path, offset: u64, bit: u8) -> bool {
        let mut st = self.state.lock();
        let Ok(id) = st.file_at(path) else { return false };
        let Some(inode) = st.inodes.get_mut(&id) else { return false };
        let mask = 1u8 << (bit % 8);
        let (Some(d), Some(v)) = (inode.durable.get_mut(offset as usize), inode.visible.get_mut(offset as usize))
        else {
            return false;
        };
        *d ^= mask;
        *v ^= mask;
        true
    }

    /// Creates `path` and its parents and makes every new entry durable (as a careful caller
    /// does before handing a directory to the engine).
    pub fn create_dir_durable(&self, path: &Path) -> io::Result<()> {
        self.create_dir_all(path)?;
        let mut p = path.to_path_buf();
        while let Some(parent) = p.parent() {
            self.sync_dir(parent)?;
            p = parent.to_path_buf();
        }
        Ok(())
    }

    fn enter(&self, op: FaultOp, path: &Path) -> io::Result<(parking_lot::MutexGuard<'_, State>, Option<FaultError>)> {
        let mut st = self.state.lock();
        let fault = st.enter(op, path, None)?;
        Ok((st, fault))
    }
}

fn restart(st: &mut State) {
    st.generation += 1;
    st.locks.clear();
    st.stopped = false;
    st.stopped_on = None;
    st.stop_at = None;
}

/// A handle to one simulated file, valid until the next crash.
struct SimFile {
    state: Arc<Mutex<State>>,
    inode: InodeId,
    generation: u64,
    writable: bool,
    path: PathBuf,
}

impl fmt::Debug for SimFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimFile").field("path", &self.path).field("generation", &self.generation).finish()
    }
}

fn read_only() -> io::Error {
    io::Error::from_raw_os_error(libc::EBADF)
}

impl FileHandle for SimFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut st = self.state.lock();
        if let Some(e) = st.enter(FaultOp::Read, &self.path, Some(self.generation))? {
            return Err(e.to_io_error());
        }
        let data = st.inodes.get(&self.inode).map(|i| i.visible.as_slice()).unwrap_or_default();
        let start = (offset as usize).min(data.len());
        let n = buf.len().min(data.len() - start);
        if let (Some(dst), Some(src)) = (buf.get_mut(..n), data.get(start..start + n)) {
            dst.copy_from_slice(src);
        }
        Ok(n)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        let mut st = self.state.lock();
        let fault = st.enter(FaultOp::Write, &self.path, Some(self.generation))?;
        if !self.writable {
            return Err(read_only());
        }
        match fault {
            Some(FaultError::PartialWrite) => {
                let n = st.partial_len(self.inode, buf.len());
                if n > 0 {
                    st.write(self.inode, offset, buf.get(..n).unwrap_or_default());
                }
                Err(FaultError::PartialWrite.to_io_error())
            }
            Some(e) => Err(e.to_io_error()),
            None => {
                let n = st.short_len(self.inode, buf.len());
                Ok(st.write(self.inode, offset, buf.get(..n).unwrap_or_default()))
            }
        }
    }

    fn sync_data(&self) -> io::Result<()> {
        // A real fdatasync takes time; without it concurrent commits rarely share one.
        let delay = self.state.lock().sync_delay;
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let mut st = self.state.lock();
        if st.enter(FaultOp::SyncData, &self.path, Some(self.generation))?.is_some() {
            st.fail_sync(self.inode);
            return Err(FaultError::Io.to_io_error());
        }
        st.sync_data(self.inode);
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let mut st = self.state.lock();
        if let Some(e) = st.enter(FaultOp::Read, &self.path, Some(self.generation))? {
            return Err(e.to_io_error());
        }
        Ok(st.inodes.get(&self.inode).map_or(0, |i| i.visible.len() as u64))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.state.lock();
        if let Some(e) = st.enter(FaultOp::SetLen, &self.path, Some(self.generation))? {
            return Err(e.to_io_error());
        }
        if !self.writable {
            return Err(read_only());
        }
        st.set_len(self.inode, len);
        Ok(())
    }
}

/// A held simulated lock; released on drop unless a crash already released it.
struct SimLock {
    state: Arc<Mutex<State>>,
    path: PathBuf,
    token: u64,
}

impl fmt::Debug for SimLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimLock").field("path", &self.path).finish()
    }
}

impl DirLock for SimLock {}

impl Drop for SimLock {
    fn drop(&mut self) {
        let mut st = self.state.lock();
        if st.locks.get(&self.path) == Some(&self.token) {
            st.locks.remove(&self.path);
        }
    }
}

impl FileSystem for SimFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FileHandle>> {
        let op = if mode == OpenMode::CreateNew { FaultOp::Create } else { FaultOp::Open };
        let (mut st, fault) = self.enter(op, path)?;
        if let Some(e) = fault {
            return Err(e.to_io_error());
        }
        let inode = match mode {
            OpenMode::CreateNew => st.create_file(path)?,
            OpenMode::Read | OpenMode::ReadWrite => st.file_at(path)?,
        };
        let handle = SimFile {
            state: Arc::clone(&self.state),
            inode,
            generation: st.generation,
            writable: mode != OpenMode::Read,
            path: path.to_owned(),
        };
        Ok(Arc::new(handle))
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let (mut st, fault) = self.enter(FaultOp::Create, path)?;
        if let Some(e) = fault {
            return Err(e.to_io_error());
        }
        st.create_dir_all(path)
    }

    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let (st, fault) = self.enter(FaultOp::List, path)?;
        if let Some(e) = fault {
            return Err(e.to_io_error());
        }
        let dir = st.dir_at(path).and_then(|d| st.dirs.get(&d));
        let dir = dir
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{}: no such directory", path.display())))?;
        Ok(dir.current.keys().cloned().collect())
    }

    fn exists(&self, path: &Path) -> io::Result<bool> {
        let (st, fault) = self.enter(FaultOp::List, path)?;
        if let Some(e) = fault {
            return Err(e.to_io_error());
        }
        Ok(st.lookup(path).is_some())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (mut st, fault) = self.enter(FaultOp::Rename, from)?;
        if let Some(e) = fault {
            return Err(e.to_io_error());
        }
        st.rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let (mut st, fault) = self.enter(FaultOp::Remove, path)?;
        if let Some(e) = fault {
            return Err(e.to_io_error());
        }
        st.remove_file(path)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        let (mut st, fault) = self.enter(FaultOp::Remove, path)?;
        if let Some(e) = fault {
            return Err(e.to_io_error());
        }
        st.remove_dir(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let (mut st, fault) = self.enter(FaultOp::SyncDir, dir)?;
        if let Some(e) = fault {
            return Err(e.to_io_error());
        }
        st.sync_dir(dir)?;
        st.stats.dir_syncs += 1;
        Ok(())
    }

    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn DirLock>> {
        let (mut st, fault) = self.enter(FaultOp::Open, path)?;
        if let Some(e) = fault {
            return Err(e.to_io_error());
        }
        // Like `flock` on a lock file: the file is created if missing (its entry is not synced).
        match st.lookup(path) {
            Some(Node::File(_)) => {}
            Some(Node::Dir(_)) => return Err(io::Error::other(format!("{}: is a directory", path.display()))),
            None => {
                st.create_file(path)?;
            }
        }
        if st.locks.contains_key(path) {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{}: locked by another handle", path.display()),
            ));
        }
        let token = st.alloc_id();
        st.locks.insert(path.to_owned(), token);
        Ok(Box::new(SimLock { state: Arc::clone(&self.state), path: path.to_owned(), token }))
    }
}
