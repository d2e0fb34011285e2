//! The simulated disk's state: a directory tree whose entries are durable or not, and file
//! contents split into what is durable and what is only written.
//!
//! Each directory keeps two entry maps: `durable` (what a crash leaves) and `current` (what
//! calls see), plus the log of operations since its last `sync_dir`, so that a crash can keep
//! a prefix of them the way a journaling file system commits metadata in order. Each file
//! (inode) keeps its durable bytes, the bytes calls see, and the changes since its last
//! successful `sync_data`. Nothing here draws random numbers except short writes and partial
//! writes; crash resolution lives in `crash.rs`.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::path::{Component, Path, PathBuf};

use super::fault::{Fault, FaultError, FaultOp};
use super::{FaultModel, SimStats};
use crate::rng::SimRng;

pub(crate) type InodeId = u64;
pub(crate) type DirId = u64;
pub(crate) const ROOT: DirId = 0;
const TRACE_MAX: usize = 256;

/// A directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Node {
    File(InodeId),
    Dir(DirId),
}

/// A directory change not yet made durable by `sync_dir`.
#[derive(Debug, Clone)]
pub(crate) enum DirOp {
    Link(String, Node),
    Unlink(String),
    Rename(String, String, Node),
}

impl DirOp {
    pub(crate) fn apply(&self, map: &mut BTreeMap<String, Node>) {
        match self {
            DirOp::Link(name, node) => {
                map.insert(name.clone(), *node);
            }
            DirOp::Unlink(name) => {
                map.remove(name);
            }
            DirOp::Rename(from, to, node) => {
                map.remove(from);
                map.insert(to.clone(), *node);
            }
        }
    }
}

#[derive(Debug, Default, Clone)]
pub(crate) struct Dir {
    pub durable: BTreeMap<String, Node>,
    pub current: BTreeMap<String, Node>,
    pub log: Vec<DirOp>,
}

/// A change to a file's bytes not yet made durable.
#[derive(Debug, Clone)]
pub(crate) enum Change {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

impl Change {
    pub(crate) fn apply(&self, buf: &mut Vec<u8>) {
        match self {
            Change::Write { offset, data } => write_into(buf, *offset, data),
            Change::SetLen(len) => buf.resize(*len as usize, 0),
        }
    }
}

pub(crate) fn write_into(buf: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let start = offset as usize;
    let end = start + data.len();
    if buf.len() < end {
        buf.resize(end, 0);
    }
    if let Some(dst) = buf.get_mut(start..end) {
        dst.copy_from_slice(data);
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub change: Change,
    /// A failed fdatasync dropped this change from the page cache's dirty set (the kernel
    /// marks the pages clean after reporting the error): reads still see it, the disk never
    /// will.
    pub lost: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct Inode {
    pub durable: Vec<u8>,
    pub visible: Vec<u8>,
    pub pending: Vec<Pending>,
    /// This file's own decisions (short writes, what a crash keeps), seeded from the disk's
    /// seed and the path it was created at, so that the bytes written to one file (say, a
    /// report holding timings) never change the faults another file (the WAL) sees.
    pub rng: SimRng,
}

impl Inode {
    pub fn new(seed: u64, path: &Path) -> Inode {
        // FNV-1a over the path: stable across runs and platforms.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in path.to_string_lossy().bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        Inode { durable: Vec::new(), visible: Vec::new(), pending: Vec::new(), rng: SimRng::new(seed ^ h) }
    }
}

/// Everything behind the [`super::SimFs`] mutex.
#[derive(Debug)]
pub(crate) struct State {
    pub seed: u64,
    pub rng: SimRng,
    pub model: FaultModel,
    pub generation: u64,
    pub dirs: BTreeMap<DirId, Dir>,
    pub inodes: BTreeMap<InodeId, Inode>,
    pub next_id: u64,
    pub locks: BTreeMap<PathBuf, u64>,
    pub ops: u64,
    pub stop_at: Option<u64>,
    pub stopped: bool,
    /// The path of the call that stopped the world.
    pub stopped_on: Option<PathBuf>,
    pub faults: Vec<Fault>,
    pub short_write_probability: f64,
    pub sync_delay: std::time::Duration,
    pub stats: SimStats,
    pub trace: VecDeque<String>,
}

pub(crate) fn stale_error() -> io::Error {
    io::Error::other("simulated file handle from before a crash")
}

pub(crate) fn stopped_error() -> io::Error {
    io::Error::other("simulated machine stopped (crash pending)")
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, format!("{}: no such file or directory", path.display()))
}

/// Splits a path into its normal components (the simulated tree is rooted at `/`).
pub(crate) fn components(path: &Path) -> Vec<String> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect()
}

impl State {
    pub fn new(seed: u64, model: FaultModel) -> State {
        let mut dirs = BTreeMap::new();
        dirs.insert(ROOT, Dir::default());
        State {
            seed,
            rng: SimRng::new(seed),
            model,
            generation: 0,
            dirs,
            inodes: BTreeMap::new(),
            next_id: 1,
            locks: BTreeMap::new(),
            ops: 0,
            stop_at: None,
            stopped: false,
            stopped_on: None,
            faults: Vec::new(),
            short_write_probability: 0.0,
            sync_delay: std::time::Duration::ZERO,
            stats: SimStats::default(),
            trace: VecDeque::new(),
        }
    }

    /// Admits one call: rejects stale handles and calls after a stop, counts mutating calls
    /// (stopping the world when the budget is spent), records the trace and checks faults.
    pub fn enter(&mut self, op: FaultOp, path: &Path, generation: Option<u64>) -> io::Result<Option<FaultError>> {
        if generation.is_some_and(|g| g != self.generation) {
            return Err(stale_error());
        }
        if self.stopped {
            return Err(stopped_error());
        }
        if op.is_mutating() {
            self.ops += 1;
            if self.stop_at.is_some_and(|limit| self.ops > limit) {
                self.stopped = true;
                self.stopped_on = Some(path.to_owned());
                self.note(format!("#{} {} {} -> machine stopped", self.ops, op.name(), path.display()));
                return Err(stopped_error());
            }
            self.note(format!("#{} {} {}", self.ops, op.name(), path.display()));
        }
        for fault in &mut self.faults {
            if let Some(e) = fault.check(op, path) {
                self.stats.faults_injected += 1;
                self.note(format!("   fault {:?} on {} {}", e, op.name(), path.display()));
                return Ok(Some(e));
            }
        }
        Ok(None)
    }

    pub fn note(&mut self, line: String) {
        if self.trace.len() >= TRACE_MAX {
            self.trace.pop_front();
        }
        self.trace.push_back(line);
    }

    pub fn alloc_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// The directory at `path` (following current entries).
    pub fn dir_at(&self, path: &Path) -> Option<DirId> {
        let mut dir = ROOT;
        for name in components(path) {
            match self.dirs.get(&dir)?.current.get(&name)? {
                Node::Dir(d) => dir = *d,
                Node::File(_) => return None,
            }
        }
        Some(dir)
    }

    /// The parent directory and file name of `path`.
    pub fn parent_of(&self, path: &Path) -> io::Result<(DirId, String)> {
        let mut parts = components(path);
        let name = parts.pop().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
        let parent: PathBuf = parts.iter().collect();
        let dir = self.dir_at(&Path::new("/").join(parent)).ok_or_else(|| not_found(path))?;
        Ok((dir, name))
    }

    pub fn lookup(&self, path: &Path) -> Option<Node> {
        let parts = components(path);
        if parts.is_empty() {
            return Some(Node::Dir(ROOT));
        }
        let (dir, name) = self.parent_of(path).ok()?;
        self.dirs.get(&dir)?.current.get(&name).copied()
    }

    pub fn file_at(&self, path: &Path) -> io::Result<InodeId> {
        match self.lookup(path) {
            Some(Node::File(id)) => Ok(id),
            Some(Node::Dir(_)) => Err(io::Error::other(format!("{}: is a directory", path.display()))),
            None => Err(not_found(path)),
        }
    }

    pub fn dir_op(&mut self, dir: DirId, op: DirOp) {
        if let Some(d) = self.dirs.get_mut(&dir) {
            op.apply(&mut d.current);
            d.log.push(op);
        }
    }

    /// Creates a new, empty file at `path`; fails if the name exists.
    pub fn create_file(&mut self, path: &Path) -> io::Result<InodeId> {
        let (dir, name) = self.parent_of(path)?;
        if self.dirs.get(&dir).is_some_and(|d| d.current.contains_key(&name)) {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{}: file exists", path.display())));
        }
        let id = self.alloc_id();
        self.inodes.insert(id, Inode::new(self.seed, path));
        self.dir_op(dir, DirOp::Link(name, Node::File(id)));
        Ok(id)
    }

    pub fn create_dir_all(&mut self, path: &Path) -> io::Result<()> {
        let mut dir = ROOT;
        for name in components(path) {
            let existing = self.dirs.get(&dir).and_then(|d| d.current.get(&name)).copied();
            dir = match existing {
                Some(Node::Dir(d)) => d,
                Some(Node::File(_)) => {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{}: a file is in the way", path.display()),
                    ))
                }
                None => {
                    let id = self.alloc_id();
                    self.dirs.insert(id, Dir::default());
                    self.dir_op(dir, DirOp::Link(name, Node::Dir(id)));
                    id
                }
            };
        }
        Ok(())
    }

    pub fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        let (from_dir, from_name) = self.parent_of(from)?;
        let (to_dir, to_name) = self.parent_of(to)?;
        let node = match self.dirs.get(&from_dir).and_then(|d| d.current.get(&from_name)) {
            Some(Node::File(id)) => Node::File(*id),
            Some(Node::Dir(_)) => return Err(io::Error::other("renaming directories is not simulated")),
            None => return Err(not_found(from)),
        };
        if let Some(Node::Dir(_)) = self.dirs.get(&to_dir).and_then(|d| d.current.get(&to_name)) {
            return Err(io::Error::other(format!("{}: is a directory", to.display())));
        }
        if from_dir == to_dir {
            self.dir_op(from_dir, DirOp::Rename(from_name, to_name, node));
        } else {
            self.dir_op(from_dir, DirOp::Unlink(from_name));
            self.dir_op(to_dir, DirOp::Link(to_name, node));
        }
        Ok(())
    }

    pub fn remove_file(&mut self, path: &Path) -> io::Result<()> {
        let (dir, name) = self.parent_of(path)?;
        match self.dirs.get(&dir).and_then(|d| d.current.get(&name)) {
            Some(Node::File(_)) => {
                self.dir_op(dir, DirOp::Unlink(name));
                Ok(())
            }
            Some(Node::Dir(_)) => Err(io::Error::other(format!("{}: is a directory", path.display()))),
            None => Err(not_found(path)),
        }
    }

    /// Removes an empty directory: an unlink in its parent, durable after the parent's
    /// `sync_dir` like any other.
    pub fn remove_dir(&mut self, path: &Path) -> io::Result<()> {
        let (parent, name) = self.parent_of(path)?;
        match self.dirs.get(&parent).and_then(|d| d.current.get(&name)).copied() {
            Some(Node::Dir(id)) => {
                if self.dirs.get(&id).is_some_and(|d| !d.current.is_empty()) {
                    return Err(io::Error::new(
                        io::ErrorKind::DirectoryNotEmpty,
                        format!("{}: directory not empty", path.display()),
                    ));
                }
                self.dir_op(parent, DirOp::Unlink(name));
                Ok(())
            }
            Some(Node::File(_)) => {
                Err(io::Error::new(io::ErrorKind::NotADirectory, format!("{}: not a directory", path.display())))
            }
            None => Err(not_found(path)),
        }
    }

    pub fn sync_dir(&mut self, path: &Path) -> io::Result<()> {
        let id = self.dir_at(path).ok_or_else(|| not_found(path))?;
        if self.model.lying_fsync {
            return Ok(());
        }
        if let Some(d) = self.dirs.get_mut(&id) {
            d.durable = d.current.clone();
            d.log.clear();
        }
        Ok(())
    }

    /// Applies a write to what calls see and queues it for the disk. Returns bytes written.
    pub fn write(&mut self, inode: InodeId, offset: u64, data: &[u8]) -> usize {
        self.stats.writes += 1;
        self.stats.bytes_written += data.len() as u64;
        if let Some(node) = self.inodes.get_mut(&inode) {
            let change = Change::Write { offset, data: data.to_vec() };
            change.apply(&mut node.visible);
            node.pending.push(Pending { change, lost: false });
        }
        data.len()
    }

    pub fn set_len(&mut self, inode: InodeId, len: u64) {
        if let Some(node) = self.inodes.get_mut(&inode) {
            let change = Change::SetLen(len);
            change.apply(&mut node.visible);
            node.pending.push(Pending { change, lost: false });
        }
    }

    /// A successful fdatasync: every change not lost reaches the disk.
    pub fn sync_data(&mut self, inode: InodeId) {
        self.stats.file_syncs += 1;
        if self.model.lying_fsync {
            return;
        }
        if let Some(node) = self.inodes.get_mut(&inode) {
            for p in node.pending.drain(..) {
                if !p.lost {
                    p.change.apply(&mut node.durable);
                }
            }
        }
    }

    /// A failed fdatasync: with `lose_on_failed_sync`, the kernel forgets the dirty pages
    /// (fsyncgate): the disk keeps its old bytes although reads still return the new ones.
    pub fn fail_sync(&mut self, inode: InodeId) {
        if !self.model.lose_on_failed_sync {
            return;
        }
        if let Some(node) = self.inodes.get_mut(&inode) {
            for p in &mut node.pending {
                p.lost = true;
            }
        }
    }

    /// How many bytes a write of `len` bytes to `inode` actually writes when short writes are on.
    pub fn short_len(&mut self, inode: InodeId, len: usize) -> usize {
        let p = self.short_write_probability;
        let Some(rng) = self.inodes.get_mut(&inode).map(|i| &mut i.rng) else { return len };
        if len > 1 && rng.chance(p) {
            let n = rng.range(1, len as u64 - 1) as usize;
            self.stats.short_writes += 1;
            return n;
        }
        len
    }

    /// A random proper prefix length for a partial write (at least one byte when possible).
    pub fn partial_len(&mut self, inode: InodeId, len: usize) -> usize {
        let Some(rng) = self.inodes.get_mut(&inode).map(|i| &mut i.rng) else { return 0 };
        if len <= 1 {
            return 0;
        }
        rng.range(1, len as u64 - 1) as usize
    }
}
