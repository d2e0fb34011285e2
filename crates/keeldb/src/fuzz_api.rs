//! Entry points for fuzzers and the decoder smoke tests: every function that decodes bytes
//! read from disk, callable on arbitrary input. Not a stable API (hidden from the docs).
//!
//! Each function must return (an error or a value) for any input: never panic, never hang,
//! never allocate much more than its input. The fuzz targets in `fuzz/` and
//! `tests/decoders_fuzz_smoke.rs` hold them to that.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::fs::{DirLock, FileHandle, FileSystem, OpenMode};

/// Decodes a WAL frame payload (commit or mark record). Returns the number of operations.
pub fn wal_payload(bytes: &[u8]) -> Result<usize, String> {
    let mut ops = Vec::new();
    crate::wal::decode_payload_into(bytes, &mut ops).map(|r| r.ops.len()).map_err(|e| e.to_string())
}

/// Decodes a WAL frame header.
pub fn wal_frame_header(bytes: &[u8]) -> bool {
    crate::wal::decode_frame_header(bytes).is_some()
}

/// Decodes a segment header.
pub fn wal_segment_header(bytes: &[u8]) -> Result<u64, String> {
    crate::wal::decode_segment_header(bytes).map(|h| h.seq).map_err(str::to_owned)
}

/// Scans a whole segment file's bytes; returns (valid frames, frames found after a bad one).
pub fn wal_segment(bytes: &[u8]) -> (usize, u64) {
    let scan = crate::wal::scan_segment(bytes, 0);
    let mut ops = Vec::new();
    for f in &scan.frames {
        let _ = crate::wal::decode_payload_into(f.payload, &mut ops);
    }
    (scan.frames.len(), scan.later_valid_frames)
}

/// Reads and verifies a checkpoint file's bytes; returns its entry count.
pub fn checkpoint(bytes: &[u8]) -> Result<u64, String> {
    let mut sink = crate::recovery::StateBuilder::default();
    crate::checkpoint::read_checkpoint(bytes, &mut sink)
        .map(|s| s.entries)
        .map_err(|(off, why)| format!("{why} at {off}"))
}

/// Reads and verifies a checkpoint stream the way `Database::install_checkpoint` does, with a
/// 16 MiB limit; returns its entry count. Never touches a store.
pub fn checkpoint_stream(mut bytes: &[u8]) -> Result<u64, String> {
    let options = crate::InstallOptions { max_stream_bytes: 16 << 20, expected_bytes: None };
    crate::checkpoint_stream::receive(&mut bytes, &options).map(|r| r.entries).map_err(|e| e.to_string())
}

/// Runs the whole read-only recovery analysis over an in-memory directory of files (name,
/// contents). Returns the last recovered commit timestamp, or the error recovery reports.
pub fn recover_dir(files: Vec<(String, Vec<u8>)>) -> Result<u64, String> {
    let fs = MemFs { files };
    crate::recovery::analyze(&fs, Path::new("/fuzz"), crate::recovery::Scan::AfterCheckpoint)
        .map(|a| a.last_ts)
        .map_err(|e| e.to_string())
}

/// A read-only in-memory directory, enough for `recovery::analyze`.
#[derive(Debug)]
struct MemFs {
    files: Vec<(String, Vec<u8>)>,
}

#[derive(Debug)]
struct MemFile {
    data: Arc<Vec<u8>>,
}

impl FileHandle for MemFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(self.data.len());
        let src = self.data.get(start..).unwrap_or_default();
        let n = src.len().min(buf.len());
        if let (Some(dst), Some(src)) = (buf.get_mut(..n), src.get(..n)) {
            dst.copy_from_slice(src);
        }
        Ok(n)
    }
    fn write_at(&self, _: &[u8], _: u64) -> io::Result<usize> {
        Err(io::Error::other("read-only"))
    }
    fn sync_data(&self) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.data.len() as u64)
    }
    fn set_len(&self, _: u64) -> io::Result<()> {
        Err(io::Error::other("read-only"))
    }
}

#[derive(Debug)]
struct NoLock;
impl DirLock for NoLock {}

impl MemFs {
    fn find(&self, path: &Path) -> Option<&Vec<u8>> {
        let name = path.file_name()?.to_str()?;
        self.files.iter().find(|(n, _)| n == name).map(|(_, d)| d)
    }
}

impl FileSystem for MemFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FileHandle>> {
        if mode != OpenMode::Read {
            return Err(io::Error::other("read-only"));
        }
        let data = self.find(path).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        Ok(Arc::new(MemFile { data: Arc::new(data.clone()) }))
    }
    fn create_dir_all(&self, _: &Path) -> io::Result<()> {
        Ok(())
    }
    fn list_dir(&self, _: &Path) -> io::Result<Vec<String>> {
        Ok(self.files.iter().map(|(n, _)| n.clone()).collect())
    }
    fn exists(&self, path: &Path) -> io::Result<bool> {
        Ok(self.find(path).is_some())
    }
    fn rename(&self, _: &Path, _: &Path) -> io::Result<()> {
        Err(io::Error::other("read-only"))
    }
    fn remove_file(&self, _: &Path) -> io::Result<()> {
        Err(io::Error::other("read-only"))
    }
    fn sync_dir(&self, _: &Path) -> io::Result<()> {
        Ok(())
    }
    fn lock_exclusive(&self, _: &Path) -> io::Result<Box<dyn DirLock>> {
        Ok(Box::new(NoLock))
    }
}

/// The files of a real store directory, for seeding fuzzers and smoke tests.
pub fn read_store_files(dir: &Path) -> io::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "LOCK" {
            continue;
        }
        let path: PathBuf = entry.path();
        if path.is_file() {
            out.push((name, std::fs::read(&path)?));
        }
    }
    out.sort();
    Ok(out)
}
