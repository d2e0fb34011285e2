//! The WAL writer: appends encoded batches to the current segment and rolls to new segments.
//!
//! Used by one group-commit leader at a time (the committer holds it behind a mutex). It
//! writes bytes it is given and keeps segment bookkeeping; it never encodes frames (that is
//! `wal.rs`), never decides when to sync a batch (the committer does), and never reads the
//! log back (only recovery and verify do). Every segment but the newest is fdatasynced before
//! the next one is created, so every sealed segment is entirely durable.
//!
//! The newest segment keeps zeros written ahead of the log's end ([`PREALLOCATE_BYTES`] at a
//! time, carried by the write of the batch that needs them), so a commit's fdatasync finds
//! the file's size unchanged and flushes data only. A roll truncates the zeros off before it
//! seals the segment. The argument is in `docs/design/recovery.md`, "Preallocated segment
//! space".

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::fs::{write_all_at, FileHandle, FileSystem, OpenMode};
use crate::wal::{encode_segment_header, segment_name, SegmentHeader, SEGMENT_HEADER_BYTES};

/// The newest segment's zeros are written ahead up to the next multiple of this file offset
/// (capped at the segment's size): one fdatasync per this many bytes of log also carries the
/// new size; every other one flushes data only.
pub(crate) const PREALLOCATE_BYTES: u64 = 1 << 20;

/// Description of a segment on disk, as the writer and recovery know it.
#[derive(Debug, Clone)]
pub(crate) struct SegmentInfo {
    pub seq: u64,
    pub path: PathBuf,
    pub start_lsn: u64,
    /// LSN just past the last frame written so far.
    pub end_lsn: u64,
    /// Timestamp of the last commit in the segment (`first_ts - 1` when it holds none).
    pub last_ts: u64,
}

/// Appends frames to the current segment and rolls to new ones. Used by one group-commit
/// leader at a time (the caller holds it behind a mutex).
#[derive(Debug)]
pub(crate) struct WalWriter {
    fs: Arc<dyn FileSystem>,
    dir: PathBuf,
    file: Arc<dyn FileHandle>,
    current: SegmentInfo,
    /// File offset up to which the current segment holds what this writer wrote or recovery
    /// verified: frames up to the log's end, zeros after it.
    allocated: u64,
    sealed: Vec<SegmentInfo>,
    segment_bytes_max: u64,
}

impl WalWriter {
    /// Continues an existing segment whose valid frames end at `current.end_lsn`, followed
    /// by zeros up to file offset `allocated` (the caller has truncated anything else after
    /// the frames and synced the file; `allocated` is at least the frames' end).
    pub fn resume(
        fs: Arc<dyn FileSystem>,
        dir: &Path,
        file: Arc<dyn FileHandle>,
        current: SegmentInfo,
        allocated: u64,
        sealed: Vec<SegmentInfo>,
        segment_bytes_max: u64,
    ) -> Self {
        let allocated = allocated.max(SEGMENT_HEADER_BYTES + (current.end_lsn - current.start_lsn));
        WalWriter { fs, dir: dir.to_owned(), file, current, allocated, sealed, segment_bytes_max }
    }

    /// Creates segment `seq` (header written, file and directory synced) and returns a writer.
    pub fn create(
        fs: Arc<dyn FileSystem>,
        dir: &Path,
        seq: u64,
        start_lsn: u64,
        first_ts: u64,
        sealed: Vec<SegmentInfo>,
        segment_bytes_max: u64,
    ) -> Result<Self> {
        let (file, info) = create_segment(fs.as_ref(), dir, seq, start_lsn, first_ts)?;
        let allocated = SEGMENT_HEADER_BYTES;
        Ok(WalWriter { fs, dir: dir.to_owned(), file, current: info, allocated, sealed, segment_bytes_max })
    }

    pub fn file(&self) -> Arc<dyn FileHandle> {
        Arc::clone(&self.file)
    }

    pub fn current(&self) -> &SegmentInfo {
        &self.current
    }

    pub fn sealed(&self) -> &[SegmentInfo] {
        &self.sealed
    }

    /// The LSN the next frame gets.
    pub fn end_lsn(&self) -> u64 {
        self.current.end_lsn
    }

    /// Total WAL bytes (all live segments, including headers; not the newest segment's
    /// preallocated zeros).
    pub fn total_bytes(&self) -> u64 {
        self.sealed
            .iter()
            .chain(std::iter::once(&self.current))
            .map(|s| s.end_lsn - s.start_lsn + SEGMENT_HEADER_BYTES)
            .sum()
    }

    /// Writes a batch of encoded frames whose first frame has LSN `first_lsn` and whose last
    /// commit has timestamp `last_ts`. Rolls to a new segment first when this one is full; the
    /// full segment is fdatasynced before the new one is created, so every segment but the
    /// newest is entirely durable.
    pub fn append(&mut self, frames: &[u8], first_lsn: u64, last_ts: u64) -> Result<()> {
        debug_assert_eq!(first_lsn, self.current.end_lsn, "WAL batch out of order");
        if first_lsn != self.current.end_lsn {
            // An engine bug, never user input: refuse rather than write a log that cannot be read.
            return Err(Error::corruption(
                &self.current.path,
                SEGMENT_HEADER_BYTES + (self.current.end_lsn - self.current.start_lsn),
                format!("internal error: WAL batch at LSN {first_lsn}, log ends at {}", self.current.end_lsn),
            ));
        }
        let used = self.current.end_lsn - self.current.start_lsn;
        if used > 0 && used + frames.len() as u64 > self.segment_bytes_max {
            self.roll()?;
        }
        let offset = SEGMENT_HEADER_BYTES + (self.current.end_lsn - self.current.start_lsn);
        let end = offset + frames.len() as u64;
        if end > self.allocated {
            // Past the space allocated so far: allocate the next chunk (zeros) first; this
            // batch's fdatasync makes it and the new size durable with the batch.
            let target = preallocation_target(end, SEGMENT_HEADER_BYTES.saturating_add(self.segment_bytes_max));
            let from = self.allocated.max(offset);
            self.file.allocate(from, target - from).map_err(|e| Error::io(&self.current.path, e))?;
            self.allocated = target;
        }
        write_all_at(self.file.as_ref(), frames, offset).map_err(|e| Error::io(&self.current.path, e))?;
        self.current.end_lsn += frames.len() as u64;
        self.current.last_ts = last_ts;
        Ok(())
    }

    /// Seals the current segment (cut to its frames, fdatasync) and starts the next one.
    pub fn roll(&mut self) -> Result<()> {
        let end = SEGMENT_HEADER_BYTES + (self.current.end_lsn - self.current.start_lsn);
        if self.allocated > end {
            // A sealed segment is exactly its header and frames; recovery holds it to that.
            self.file.set_len(end).map_err(|e| Error::io(&self.current.path, e))?;
            self.allocated = end;
        }
        self.file.sync_data().map_err(|e| Error::io(&self.current.path, e))?;
        let next_seq = self.current.seq + 1;
        let (file, info) =
            create_segment(self.fs.as_ref(), &self.dir, next_seq, self.current.end_lsn, self.current.last_ts + 1)?;
        let old = std::mem::replace(&mut self.current, info);
        self.sealed.push(old);
        self.file = file;
        self.allocated = SEGMENT_HEADER_BYTES;
        Ok(())
    }

    /// fdatasyncs the current segment.
    pub fn sync(&self) -> Result<()> {
        self.file.sync_data().map_err(|e| Error::io(&self.current.path, e))
    }

    /// Deletes sealed segments whose every commit is at or below `ts`. The directory is synced
    /// afterwards. Returns how many were removed.
    pub fn remove_sealed_through(&mut self, ts: u64) -> Result<usize> {
        // Oldest first, and a segment is forgotten only once its file is gone: a crash or a
        // failed delete midway leaves a contiguous suffix of segments that this writer still
        // knows about, never a gap.
        let mut removed = 0;
        while let Some(seg) = self.sealed.first() {
            if seg.last_ts > ts {
                break;
            }
            let path = seg.path.clone();
            self.fs.remove_file(&path).map_err(|e| Error::io(&path, e))?;
            self.sealed.remove(0);
            removed += 1;
        }
        if removed > 0 {
            self.fs.sync_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        }
        Ok(removed)
    }
}

/// Where the zeros written ahead of a batch ending at file offset `end` stop: the next
/// multiple of [`PREALLOCATE_BYTES`], at most the segment's size, never short of the batch.
fn preallocation_target(end: u64, segment_end: u64) -> u64 {
    end.div_ceil(PREALLOCATE_BYTES).saturating_mul(PREALLOCATE_BYTES).min(segment_end).max(end)
}

fn create_segment(
    fs: &dyn FileSystem,
    dir: &Path,
    seq: u64,
    start_lsn: u64,
    first_ts: u64,
) -> Result<(Arc<dyn FileHandle>, SegmentInfo)> {
    let path = dir.join(segment_name(seq));
    let file = fs.open(&path, OpenMode::CreateNew).map_err(|e| Error::io(&path, e))?;
    let header = encode_segment_header(&SegmentHeader { version: crate::FORMAT_VERSION, seq, start_lsn, first_ts });
    write_all_at(file.as_ref(), &header, 0).map_err(|e| Error::io(&path, e))?;
    file.sync_data().map_err(|e| Error::io(&path, e))?;
    fs.sync_dir(dir).map_err(|e| Error::io(dir, e))?;
    let info = SegmentInfo { seq, path, start_lsn, end_lsn: start_lsn, last_ts: first_ts.saturating_sub(1) };
    Ok((file, info))
}
