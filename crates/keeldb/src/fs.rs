//! The file-system seam: every byte KeelDB reads from or writes to disk passes through
//! [`FileSystem`] and [`FileHandle`].
//!
//! This module owns the trait and the real implementation ([`StdFs`]). It must not know
//! anything about the WAL or checkpoint formats. Tests swap in a simulated file system
//! (see the `keel-testkit` crate) that loses unsynced writes, tears writes and flips bits,
//! or a counting wrapper that proves group commit shares fdatasync calls.
//!
//! The contract the engine relies on, and which a simulated file system must model:
//! - `write_at` may write fewer bytes than asked (the caller loops);
//! - data written is durable only after `sync_data` on that file returns `Ok`;
//! - a create, rename or remove is durable only after `sync_dir` on its parent returns `Ok`;
//! - `rename` within one directory is atomic: after a crash the target names either the old
//!   or the new file, never a mix.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An open file. Positional I/O only: the engine tracks its own offsets, so one handle can
/// be shared by the WAL writer and a background syncer without a seek race.
// `len` is a fallible query of the file's size, not a collection's; `is_empty` would add nothing.
#[allow(clippy::len_without_is_empty)]
pub trait FileHandle: Send + Sync + fmt::Debug {
    /// Reads up to `buf.len()` bytes at `offset`; returns how many were read (0 at end).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Writes up to `buf.len()` bytes at `offset`; may write fewer (a short write).
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize>;
    /// Makes the file's data (and the size, when it changed) durable: `fdatasync(2)`.
    fn sync_data(&self) -> io::Result<()>;
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// Truncates or extends the file to `len` bytes.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Makes `offset..offset + len` part of the file, reading as zeros, with its blocks
    /// allocated, so that later writes there change neither the size nor the block map:
    /// their `fdatasync` flushes data only. Like a write, it is durable only after a
    /// `sync_data`; until then a crash may keep all, some (as zeros) or none of it. The range
    /// must lie at or past the end of what the file holds. The default writes zeros.
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        write_zeros(self, offset, len)
    }
    /// Starts writing the file's dirty pages to the disk without waiting for them, so that a
    /// later `sync_data` has less left to do. A hint: it makes nothing durable, and it must not
    /// consume a write-back error that a later `sync_data` would report. The default does
    /// nothing.
    fn start_writeback(&self) {}
}

/// A held exclusive lock on a directory; released when dropped.
pub trait DirLock: Send + Sync + fmt::Debug {}

/// How to open a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Read only; the file must exist.
    Read,
    /// Read and write; the file must exist.
    ReadWrite,
    /// Read and write; the file must not exist yet.
    CreateNew,
}

/// The file-system operations the engine uses. Implementations must be thread-safe.
pub trait FileSystem: Send + Sync + fmt::Debug {
    /// Opens a file.
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FileHandle>>;
    /// Creates a directory and its parents (no error if it exists).
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Names of the entries of a directory (files only need be listed), unsorted.
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>>;
    /// Whether a path exists.
    fn exists(&self, path: &Path) -> io::Result<bool>;
    /// Atomically renames `from` to `to` (same directory).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Removes an empty directory. The engine never calls it (a store is one flat directory);
    /// programs built on the engine use it to clean up directories of their own.
    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, format!("{}: remove_dir is not supported", path.display())))
    }
    /// Makes creates, renames and removes inside `dir` durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Takes an exclusive, non-blocking lock tied to `path` (a lock file).
    /// Returns `ErrorKind::WouldBlock` when another holder has it.
    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn DirLock>>;
}

/// Writes all of `buf` at `offset`, looping over short writes.
pub fn write_all_at(file: &dyn FileHandle, mut buf: &[u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        let n = file.write_at(buf, offset)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "write returned 0 bytes"));
        }
        buf = buf.get(n..).unwrap_or_default();
        offset += n as u64;
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes at `offset`, or fails with `UnexpectedEof`.
pub fn read_exact_at(file: &dyn FileHandle, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        let n = file.read_at(buf, offset)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "file ended early"));
        }
        buf = std::mem::take(&mut buf).get_mut(n..).unwrap_or_default();
        offset += n as u64;
    }
    Ok(())
}

/// Writes `len` zeros at `offset`, 64 KiB at a time (short writes continued).
pub fn write_zeros<F: FileHandle + ?Sized>(file: &F, offset: u64, len: u64) -> io::Result<()> {
    const CHUNK: u64 = 64 * 1024;
    let zeros = vec![0u8; CHUNK.min(len) as usize];
    let mut at = offset;
    while at < offset + len {
        let n = CHUNK.min(offset + len - at) as usize;
        match file.write_at(zeros.get(..n).unwrap_or_default(), at) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote nothing")),
            Ok(written) => at += written as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Files at least this long are read by two threads, each into its own half of the buffer.
pub(crate) const PARALLEL_READ_BYTES: usize = 64 << 20;

/// Reads a whole file into `buf`, replacing what it held. Reusing one buffer for many files
/// spares a fresh allocation, and its page faults, per file. (Recovery reads WAL segments and
/// checkpoints a window at a time instead: `wal::SegmentFrames`, `checkpoint::Windows`.)
///
/// Nothing is zeroed that the read overwrites anyway: bytes the buffer already holds are kept
/// until the read replaces them, and a fresh buffer comes from `calloc`, whose large blocks
/// are new pages the kernel zeroes as the read first touches them (no `memset` pass over the
/// whole file, which cost a 1.3 GB checkpoint ~0.3 s). A long file is read by two threads,
/// so the page faults and the copy out of the page cache are split over two cores.
pub fn read_all_into(file: &dyn FileHandle, buf: &mut Vec<u8>) -> io::Result<()> {
    read_all_into_from(file, buf, PARALLEL_READ_BYTES)
}

fn read_all_into_from(file: &dyn FileHandle, buf: &mut Vec<u8>, parallel_from: usize) -> io::Result<()> {
    let len = file.len()?;
    let len = usize::try_from(len).map_err(|_| io::Error::other("file too large to read"))?;
    if buf.is_empty() && buf.capacity() < len {
        *buf = vec![0; len];
    } else {
        buf.truncate(len);
        buf.resize(len, 0);
    }
    if len >= parallel_from && len >= 2 {
        if let Some(done) = read_halves(file, buf) {
            return done;
        }
    }
    read_exact_at(file, buf, 0)
}

/// Reads `buf.len()` bytes from offset 0 on two threads, one per half. `None` when no second
/// thread could be started (nothing useful was read; the caller reads it all itself).
fn read_halves(file: &dyn FileHandle, buf: &mut [u8]) -> Option<io::Result<()>> {
    let mid = buf.len() / 2;
    let (head, tail) = buf.split_at_mut(mid);
    std::thread::scope(|scope| {
        let other = std::thread::Builder::new()
            .name("keeldb-read".into())
            .spawn_scoped(scope, move || read_exact_at(file, tail, mid as u64))
            .ok()?;
        let first = read_exact_at(file, head, 0);
        let second = other.join().unwrap_or_else(|_| Err(io::Error::other("reader thread panicked")));
        Some(first.and(second))
    })
}

/// Reads a whole file into memory.
pub fn read_all(file: &dyn FileHandle) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    read_all_into(file, &mut buf)?;
    Ok(buf)
}

/// The real file system (std, `flock` and `fallocate`).
#[derive(Debug, Default, Clone, Copy)]
pub struct StdFs;

#[derive(Debug)]
struct StdFile {
    file: std::fs::File,
}

impl FileHandle for StdFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(&self.file, buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::write_at(&self.file, buf, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
    fn start_writeback(&self) {
        // `sync_file_range` submits the writes itself and can block for as long as they take
        // to queue (67 ms for 51 MB on the development VM), so a short-lived thread of its own
        // makes the call on a duplicate descriptor. Ignored on failure: the caller's later
        // fdatasync reports what matters.
        let Ok(file) = self.file.try_clone() else { return };
        let _ = std::thread::Builder::new().name("keeldb-writeback".into()).spawn(move || {
            let _ = sys::start_writeback(&file);
        });
    }
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        // Unwritten extents: they read as zeros, and a write into one costs the page cache
        // less than overwriting written zeros (design/recovery.md, "Preallocated segment
        // space"). A file system without fallocate gets the zeros written instead.
        match sys::fallocate(&self.file, offset, len) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => write_zeros(self, offset, len),
            other => other,
        }
    }
}

#[derive(Debug)]
struct StdLock {
    _file: std::fs::File,
    _path: PathBuf,
}
impl DirLock for StdLock {}

impl FileSystem for StdFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FileHandle>> {
        let mut opts = std::fs::OpenOptions::new();
        match mode {
            OpenMode::Read => opts.read(true),
            OpenMode::ReadWrite => opts.read(true).write(true),
            OpenMode::CreateNew => opts.read(true).write(true).create_new(true),
        };
        Ok(Arc::new(StdFile { file: opts.open(path)? }))
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(path)? {
            let entry = entry?;
            if let Some(name) = entry.file_name().to_str() {
                names.push(name.to_owned());
            }
        }
        Ok(names)
    }
    fn exists(&self, path: &Path) -> io::Result<bool> {
        path.try_exists()
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::File::open(dir)?.sync_all()
    }
    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn DirLock>> {
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        sys::flock_exclusive_nonblocking(&file)?;
        Ok(Box::new(StdLock { _file: file, _path: path.to_owned() }))
    }
}

#[allow(unsafe_code)]
mod sys {
    use std::io;
    use std::os::unix::io::AsRawFd;

    /// `flock(LOCK_EX | LOCK_NB)`. The lock belongs to the open file description, so a second
    /// `open` of the same store, even inside this process, is refused.
    pub(super) fn flock_exclusive_nonblocking(file: &std::fs::File) -> io::Result<()> {
        // SAFETY: `flock` takes a file descriptor and flags and touches no memory of ours; the
        // descriptor is valid because `file` is borrowed for the duration of the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// `sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`: queues the whole file's dirty
    /// pages for write-back and returns. Without a `WAIT` flag it never waits on write-back
    /// and so never consumes a recorded write-back error (only waiting does), which the next
    /// `fdatasync` on any descriptor of the file still reports.
    pub(super) fn start_writeback(file: &std::fs::File) -> io::Result<()> {
        // SAFETY: `sync_file_range` takes a file descriptor, a range and flags and touches no
        // memory of ours; the descriptor is valid because `file` is borrowed for the call.
        let rc = unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// `fallocate(fd, 0, offset, len)`: allocates the range, extending the size if it ends
    /// past it.
    pub(super) fn fallocate(file: &std::fs::File, offset: u64, len: u64) -> io::Result<()> {
        let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "range beyond off_t"));
        };
        loop {
            // SAFETY: `fallocate` takes a file descriptor, a mode and a range and touches no
            // memory of ours; the descriptor is valid because `file` is borrowed for the call.
            let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, len) };
            if rc == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A file in memory whose writes stop at 1,000 bytes (short writes).
    #[derive(Debug, Default)]
    struct ShortWrites(Mutex<Vec<u8>>);

    impl FileHandle for ShortWrites {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
            let data = self.0.lock().unwrap();
            let src = data.get(offset as usize..).unwrap_or_default();
            let n = src.len().min(buf.len());
            buf[..n].copy_from_slice(&src[..n]);
            Ok(n)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<usize> {
            let mut data = self.0.lock().unwrap();
            let n = buf.len().min(1_000);
            let end = offset as usize + n;
            if data.len() < end {
                data.resize(end, 0xEE);
            }
            data[offset as usize..end].copy_from_slice(&buf[..n]);
            Ok(n)
        }
        fn sync_data(&self) -> io::Result<()> {
            Ok(())
        }
        fn len(&self) -> io::Result<u64> {
            Ok(self.0.lock().unwrap().len() as u64)
        }
        fn set_len(&self, len: u64) -> io::Result<()> {
            self.0.lock().unwrap().resize(len as usize, 0);
            Ok(())
        }
    }

    /// A file in memory that returns at most 7 bytes per read and can fail reads from an offset.
    #[derive(Debug)]
    struct ShortReads {
        data: Vec<u8>,
        fail_from: u64,
    }

    impl FileHandle for ShortReads {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
            if offset >= self.fail_from {
                return Err(io::Error::other("injected read error"));
            }
            let src = self.data.get(offset as usize..).unwrap_or_default();
            let n = src.len().min(buf.len()).min(7);
            buf[..n].copy_from_slice(&src[..n]);
            Ok(n)
        }
        fn write_at(&self, _: &[u8], _: u64) -> io::Result<usize> {
            Err(io::Error::other("read only"))
        }
        fn sync_data(&self) -> io::Result<()> {
            Ok(())
        }
        fn len(&self) -> io::Result<u64> {
            Ok(self.data.len() as u64)
        }
        fn set_len(&self, _: u64) -> io::Result<()> {
            Err(io::Error::other("read only"))
        }
    }

    #[test]
    fn reading_a_whole_file_in_two_halves_or_into_a_reused_buffer_gives_its_bytes() {
        let data: Vec<u8> = (0..10_001u32).map(|i| (i * 31 % 251) as u8).collect();
        let f = ShortReads { data: data.clone(), fail_from: u64::MAX };
        for parallel_from in [1, 2, 10_001, usize::MAX] {
            // Fresh, longer and shorter reused buffers: stale bytes must never survive.
            for mut buf in [Vec::new(), vec![0xAB; 20_000], vec![0xCD; 3], Vec::with_capacity(50_000)] {
                read_all_into_from(&f, &mut buf, parallel_from).unwrap();
                assert_eq!(buf, data, "parallel from {parallel_from}");
            }
        }
        let empty = ShortReads { data: Vec::new(), fail_from: u64::MAX };
        let mut buf = vec![1, 2, 3];
        read_all_into_from(&empty, &mut buf, 1).unwrap();
        assert!(buf.is_empty());
    }

    #[test]
    fn a_read_error_in_either_half_is_returned() {
        let data = vec![9u8; 1_000];
        // Offsets where a read of 7 bytes starts: in the first half (0, 497) and in the second (500, 994).
        for fail_from in [0, 497, 500, 994] {
            let f = ShortReads { data: data.clone(), fail_from };
            let mut buf = Vec::new();
            let err = read_all_into_from(&f, &mut buf, 1).unwrap_err();
            assert_eq!(err.to_string(), "injected read error", "failing from {fail_from}");
        }
    }

    #[test]
    fn the_default_allocation_writes_zeros_through_short_writes() {
        let f = ShortWrites::default();
        write_all_at(&f, &[7u8; 10], 0).unwrap();
        f.allocate(10, 200_000).unwrap();
        assert_eq!(f.len().unwrap(), 200_010);
        let data = f.0.lock().unwrap();
        assert_eq!(&data[..10], &[7u8; 10]);
        assert!(data[10..].iter().all(|&b| b == 0));
    }

    #[test]
    fn real_allocation_extends_the_file_with_zeros_and_keeps_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let f = StdFs.open(&path, OpenMode::CreateNew).unwrap();
        write_all_at(f.as_ref(), b"header", 0).unwrap();
        f.allocate(6, 1 << 20).unwrap();
        assert_eq!(f.len().unwrap(), 6 + (1 << 20));
        write_all_at(f.as_ref(), b"frame", 6).unwrap();
        f.sync_data().unwrap();
        let data = read_all(f.as_ref()).unwrap();
        assert_eq!(&data[..11], b"headerframe");
        assert!(data[11..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_writeback_hint_changes_no_byte_and_leaves_the_file_usable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let f = StdFs.open(&path, OpenMode::CreateNew).unwrap();
        let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i % 253) as u8).collect();
        write_all_at(f.as_ref(), &data, 0).unwrap();
        // On a read-only descriptor too, as recovery gives it.
        StdFs.open(&path, OpenMode::Read).unwrap().start_writeback();
        f.start_writeback();
        write_all_at(f.as_ref(), b"after", 0).unwrap();
        f.sync_data().unwrap();
        let back = read_all(f.as_ref()).unwrap();
        assert_eq!(&back[..5], b"after");
        assert_eq!(&back[5..], &data[5..]);
    }
}
