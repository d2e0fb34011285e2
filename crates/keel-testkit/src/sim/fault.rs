//! Injected failures: which simulated file-system call fails, when, and with what error.
//!
//! A [`Fault`] matches calls by kind (and optionally by a substring of the path), lets a given
//! number of matching calls succeed, then fails one, several or all later ones. Faults are
//! checked in the order they were injected; the first that fires decides the error.

use std::io;
use std::path::Path;

/// The kind of file-system call a fault applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultOp {
    /// Opening an existing file (read or read-write), or taking a lock.
    Open,
    /// Creating a file (`OpenMode::CreateNew`) or a directory.
    Create,
    /// `read_at`.
    Read,
    /// `write_at`.
    Write,
    /// `set_len`.
    SetLen,
    /// `sync_data` on a file.
    SyncData,
    /// `sync_dir`.
    SyncDir,
    /// `rename`.
    Rename,
    /// `remove_file`.
    Remove,
    /// `list_dir` and `exists`.
    List,
}

impl FaultOp {
    /// Whether the call changes state. Only these count towards [`crate::sim::SimFs::ops`]
    /// and [`crate::sim::SimFs::stop_after_ops`], so "crash at step n" names a change.
    pub fn is_mutating(self) -> bool {
        matches!(
            self,
            FaultOp::Create
                | FaultOp::Write
                | FaultOp::SetLen
                | FaultOp::SyncData
                | FaultOp::SyncDir
                | FaultOp::Rename
                | FaultOp::Remove
        )
    }

    /// A short name for traces.
    pub fn name(self) -> &'static str {
        match self {
            FaultOp::Open => "open",
            FaultOp::Create => "create",
            FaultOp::Read => "read",
            FaultOp::Write => "write",
            FaultOp::SetLen => "set_len",
            FaultOp::SyncData => "sync_data",
            FaultOp::SyncDir => "sync_dir",
            FaultOp::Rename => "rename",
            FaultOp::Remove => "remove",
            FaultOp::List => "list",
        }
    }
}

/// The error an injected fault produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultError {
    /// `EIO`: the device reported an error.
    Io,
    /// `ENOSPC`: the device is full.
    NoSpace,
    /// For writes: a random proper prefix of the buffer reaches the file, then `EIO`. Other
    /// calls treat it as [`FaultError::Io`].
    PartialWrite,
}

impl FaultError {
    /// The `io::Error` a real kernel would return.
    pub fn to_io_error(self) -> io::Error {
        match self {
            FaultError::NoSpace => io::Error::from_raw_os_error(libc::ENOSPC),
            FaultError::Io | FaultError::PartialWrite => io::Error::from_raw_os_error(libc::EIO),
        }
    }
}

/// One injected failure rule. Build with [`Fault::new`] and the chained setters.
#[derive(Debug, Clone)]
pub struct Fault {
    op: FaultOp,
    skip: u64,
    times: Option<u64>,
    error: FaultError,
    path_contains: Option<String>,
    seen: u64,
    fired: u64,
}

impl Fault {
    /// Fails the next call of kind `op`, once, with `EIO`.
    pub fn new(op: FaultOp) -> Fault {
        Fault { op, skip: 0, times: Some(1), error: FaultError::Io, path_contains: None, seen: 0, fired: 0 }
    }

    /// Lets `n` matching calls succeed before the fault fires (so `after(n - 1)` fails the
    /// n-th call).
    pub fn after(mut self, n: u64) -> Fault {
        self.skip = n;
        self
    }

    /// Fails `n` matching calls (one by default).
    pub fn times(mut self, n: u64) -> Fault {
        self.times = Some(n);
        self
    }

    /// Fails every matching call once it has started firing (a dead disk, a full disk).
    pub fn forever(mut self) -> Fault {
        self.times = None;
        self
    }

    /// The error to return.
    pub fn error(mut self, error: FaultError) -> Fault {
        self.error = error;
        self
    }

    /// Only calls whose path contains `fragment` match (for example `"wal-"`).
    pub fn on_path(mut self, fragment: &str) -> Fault {
        self.path_contains = Some(fragment.to_owned());
        self
    }

    /// How many times this fault has fired.
    pub fn fired(&self) -> u64 {
        self.fired
    }

    /// Records a call; returns the error if the fault fires on it.
    pub(crate) fn check(&mut self, op: FaultOp, path: &Path) -> Option<FaultError> {
        if op != self.op {
            return None;
        }
        if let Some(fragment) = &self.path_contains {
            if !path.to_string_lossy().contains(fragment.as_str()) {
                return None;
            }
        }
        self.seen += 1;
        if self.seen <= self.skip {
            return None;
        }
        if self.times.is_some_and(|t| self.fired >= t) {
            return None;
        }
        self.fired += 1;
        Some(self.error)
    }
}
