//! A file system wrapper that counts operations and can fail chosen ones. Wraps the real file
//! system, so data is real; only the counts and the injected errors are simulated.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use keeldb::fs::{DirLock, FileHandle, FileSystem, OpenMode, StdFs};

/// Counters shared by a [`CountingFs`] and every file it opened.
#[derive(Debug, Default)]
pub struct Counts {
    /// `sync_data` calls on files.
    pub file_syncs: AtomicU64,
    /// `sync_dir` calls.
    pub dir_syncs: AtomicU64,
    /// `write_at` calls.
    pub writes: AtomicU64,
    /// `start_writeback` hints (passed on to the real file).
    pub writebacks: AtomicU64,
    /// When set, every later `sync_data` fails with an I/O error.
    pub fail_syncs: AtomicBool,
    /// When set, every later `write_at` fails with an I/O error.
    pub fail_writes: AtomicBool,
}

/// The real file system with counters and switchable failures.
#[derive(Debug, Clone, Default)]
pub struct CountingFs {
    /// The shared counters.
    pub counts: Arc<Counts>,
}

impl CountingFs {
    /// A new wrapper with zeroed counters.
    pub fn new() -> Self {
        Self::default()
    }
}

#[derive(Debug)]
struct CountingFile {
    inner: Arc<dyn FileHandle>,
    counts: Arc<Counts>,
}

impl FileHandle for CountingFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        if self.counts.fail_writes.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected write failure"));
        }
        self.counts.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.write_at(buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        if self.counts.fail_syncs.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected fdatasync failure"));
        }
        self.counts.file_syncs.fetch_add(1, Ordering::SeqCst);
        self.inner.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len)
    }
    fn start_writeback(&self) {
        self.counts.writebacks.fetch_add(1, Ordering::SeqCst);
        self.inner.start_writeback();
    }
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.counts.fail_writes.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected write failure"));
        }
        self.inner.allocate(offset, len)
    }
}

impl FileSystem for CountingFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FileHandle>> {
        let inner = StdFs.open(path, mode)?;
        Ok(Arc::new(CountingFile { inner, counts: Arc::clone(&self.counts) }))
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
    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        StdFs.remove_dir(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.counts.dir_syncs.fetch_add(1, Ordering::SeqCst);
        StdFs.sync_dir(dir)
    }
    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn DirLock>> {
        StdFs.lock_exclusive(path)
    }
}
