//! Checkpoint files: the full state at one commit timestamp, in checksummed blocks.
//!
//! This module owns the checkpoint byte format (see `docs/design/format.md`): writing a
//! checkpoint from a stream of tables and entries, and reading one back, verifying every
//! block's CRC32C before its records are decoded and the footer's digest after. It does not
//! decide when to checkpoint or which WAL to delete; `db.rs` does, in the order that
//! `docs/design/recovery.md` argues is crash safe (temp file, fsync, rename, directory fsync,
//! and only then WAL deletion).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::codec::{le_u32, le_u64, PutBytes, Reader};
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::fs::{write_all_at, FileHandle, FileSystem, OpenMode};
use crate::options::{MAX_KEY_BYTES, MAX_TABLE_NAME_BYTES, MAX_VALUE_BYTES};
use crate::types::LogPosition;

const HEADER_MAGIC: &[u8; 8] = b"KEELCKP\0";
const FOOTER_MAGIC: &[u8; 8] = b"KEELCKPF";
pub(crate) const HEADER_BYTES: usize = 64;
pub(crate) const FOOTER_BYTES: usize = 64;
const BLOCK_HEADER_BYTES: usize = 8;
const BLOCK_TARGET_BYTES: usize = 256 * 1024;
/// A block never exceeds one maximal entry plus the target size.
const BLOCK_MAX_BYTES: usize = BLOCK_TARGET_BYTES + MAX_KEY_BYTES + MAX_VALUE_BYTES + 64;

const REC_TABLE: u8 = 1;
const REC_ENTRY: u8 = 2;

pub(crate) use crate::files::{checkpoint_name, parse_checkpoint_name};

/// Streams a checkpoint into a temporary file; [`CheckpointWriter::finish`] makes it durable
/// and renames it into place.
pub(crate) struct CheckpointWriter {
    fs: Arc<dyn FileSystem>,
    dir: PathBuf,
    tmp: PathBuf,
    file: Arc<dyn FileHandle>,
    ts: u64,
    offset: u64,
    block: Vec<u8>,
    blocks: u64,
    tables: u64,
    entries: u64,
    digest: StateDigest,
    current_table: Option<Arc<str>>,
    next_table_id: u32,
    applied: Option<LogPosition>,
}

/// Header bytes 24..44 (reserved before): the applied log position, if any. Flag 1 at 40 says
/// it is present; a checkpoint written before the field existed has zeros there.
fn encode_header(next_table_id: u32, ts: u64, applied: Option<LogPosition>) -> Vec<u8> {
    let mut header = Vec::with_capacity(HEADER_BYTES);
    header.extend_from_slice(HEADER_MAGIC);
    header.put_u32(crate::FORMAT_VERSION);
    header.put_u32(next_table_id);
    header.put_u64(ts);
    let pos = applied.unwrap_or_default();
    header.put_u64(pos.index);
    header.put_u64(pos.term);
    header.put_u32(u32::from(applied.is_some()));
    header.resize(60, 0);
    let crc = crc32c::crc32c(&header);
    header.put_u32(crc);
    header
}

impl CheckpointWriter {
    pub fn create(fs: Arc<dyn FileSystem>, dir: &Path, ts: u64, next_table_id: u32) -> Result<Self> {
        let tmp = dir.join(crate::files::tmp_name(&checkpoint_name(ts)));
        if fs.exists(&tmp).map_err(|e| Error::io(&tmp, e))? {
            fs.remove_file(&tmp).map_err(|e| Error::io(&tmp, e))?;
        }
        let file = fs.open(&tmp, OpenMode::CreateNew).map_err(|e| Error::io(&tmp, e))?;
        let header = encode_header(next_table_id, ts, None);
        write_all_at(file.as_ref(), &header, 0).map_err(|e| Error::io(&tmp, e))?;
        Ok(CheckpointWriter {
            fs,
            dir: dir.to_owned(),
            tmp,
            file,
            ts,
            offset: HEADER_BYTES as u64,
            block: Vec::with_capacity(BLOCK_TARGET_BYTES + 1024),
            blocks: 0,
            tables: 0,
            entries: 0,
            digest: StateDigest::default(),
            current_table: None,
            next_table_id,
            applied: None,
        })
    }

    /// Records the replicated-log position applied at the checkpoint's timestamp; written into
    /// the header by [`CheckpointWriter::finish`].
    pub fn set_applied(&mut self, applied: Option<LogPosition>) {
        self.applied = applied;
    }

    pub fn table(&mut self, id: u32, name: &Arc<str>) -> Result<()> {
        self.block.put_u8(REC_TABLE);
        self.block.put_u32(id);
        self.block.put_bytes32(name.as_bytes());
        self.tables += 1;
        self.current_table = Some(Arc::clone(name));
        self.maybe_flush()
    }

    /// Adds an entry of the table last passed to [`CheckpointWriter::table`].
    pub fn entry(&mut self, table_id: u32, key: &[u8], value: &[u8]) -> Result<()> {
        self.block.put_u8(REC_ENTRY);
        self.block.put_u32(table_id);
        self.block.put_bytes32(key);
        self.block.put_bytes32(value);
        self.entries += 1;
        if let Some(name) = &self.current_table {
            self.digest.add(name, key, value);
        }
        self.maybe_flush()
    }

    fn maybe_flush(&mut self) -> Result<()> {
        if self.block.len() >= BLOCK_TARGET_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.block.is_empty() {
            return Ok(());
        }
        let mut framed = Vec::with_capacity(self.block.len() + BLOCK_HEADER_BYTES);
        framed.put_u32(self.block.len() as u32);
        framed.put_u32(crc32c::crc32c(&self.block));
        framed.extend_from_slice(&self.block);
        write_all_at(self.file.as_ref(), &framed, self.offset).map_err(|e| Error::io(&self.tmp, e))?;
        self.offset += framed.len() as u64;
        self.blocks += 1;
        self.block.clear();
        Ok(())
    }

    /// The digest of everything written so far.
    pub fn digest(&self) -> StateDigest {
        self.digest
    }

    /// Writes the footer, fsyncs, renames into place and fsyncs the directory. Returns the
    /// final path and size.
    pub fn finish(mut self) -> Result<(PathBuf, u64)> {
        self.flush()?;
        let mut footer = Vec::with_capacity(FOOTER_BYTES);
        footer.extend_from_slice(FOOTER_MAGIC);
        footer.put_u64(self.ts);
        footer.put_u64(self.tables);
        footer.put_u64(self.entries);
        footer.put_u64(self.blocks);
        footer.extend_from_slice(&self.digest.0.to_le_bytes());
        footer.resize(60, 0);
        let crc = crc32c::crc32c(&footer);
        footer.put_u32(crc);
        write_all_at(self.file.as_ref(), &footer, self.offset).map_err(|e| Error::io(&self.tmp, e))?;
        if self.applied.is_some() {
            let header = encode_header(self.next_table_id, self.ts, self.applied);
            write_all_at(self.file.as_ref(), &header, 0).map_err(|e| Error::io(&self.tmp, e))?;
        }
        let size = self.offset + FOOTER_BYTES as u64;
        self.file.sync_data().map_err(|e| Error::io(&self.tmp, e))?;
        let target = self.dir.join(checkpoint_name(self.ts));
        self.fs.rename(&self.tmp, &target).map_err(|e| Error::io(&target, e))?;
        self.fs.sync_dir(&self.dir).map_err(|e| Error::io(&self.dir, e))?;
        Ok((target, size))
    }
}

/// What a verified checkpoint holds, delivered record by record.
pub(crate) trait CheckpointSink {
    fn table(&mut self, id: u32, name: &str);
    fn entry(&mut self, table_id: u32, key: &[u8], value: &[u8]);
}

/// Summary of a checkpoint that passed every check.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CheckpointSummary {
    pub ts: u64,
    pub next_table_id: u32,
    pub entries: u64,
    pub digest: StateDigest,
    /// The replicated-log position applied at `ts`, if the header records one.
    pub applied: Option<LogPosition>,
}

/// Reads and verifies a whole checkpoint file's bytes, delivering records to `sink` as each
/// block's checksum passes. On error returns the byte offset and the reason; the sink may have
/// received records from earlier blocks and must then be discarded by the caller.
pub(crate) fn read_checkpoint(
    bytes: &[u8],
    sink: &mut dyn CheckpointSink,
) -> std::result::Result<CheckpointSummary, (u64, String)> {
    let fail = |offset: usize, reason: &str| Err((offset as u64, reason.to_owned()));
    if bytes.len() < HEADER_BYTES + FOOTER_BYTES {
        return fail(0, "file shorter than header and footer");
    }
    let header = bytes.get(..HEADER_BYTES).unwrap_or_default();
    if header.get(..8) != Some(&HEADER_MAGIC[..]) {
        return fail(0, "bad checkpoint magic");
    }
    if crc32c::crc32c(header.get(..60).unwrap_or_default()) != le_u32(header, 60).unwrap_or(0) {
        return fail(0, "checkpoint header checksum mismatch");
    }
    let version = le_u32(header, 8).unwrap_or(0);
    if version != crate::FORMAT_VERSION {
        return fail(8, &format!("unsupported checkpoint format version {version}"));
    }
    let next_table_id = le_u32(header, 12).unwrap_or(0);
    let ts = le_u64(header, 16).unwrap_or(0);
    let applied = match le_u32(header, 40).unwrap_or(0) {
        0 => None,
        1 => Some(LogPosition { index: le_u64(header, 24).unwrap_or(0), term: le_u64(header, 32).unwrap_or(0) }),
        _ => return fail(40, "bad applied-position flag in checkpoint header"),
    };
    let footer_at = bytes.len() - FOOTER_BYTES;
    let footer = bytes.get(footer_at..).unwrap_or_default();
    if footer.get(..8) != Some(&FOOTER_MAGIC[..]) {
        return fail(footer_at, "missing checkpoint footer (incomplete file)");
    }
    if crc32c::crc32c(footer.get(..60).unwrap_or_default()) != le_u32(footer, 60).unwrap_or(0) {
        return fail(footer_at, "checkpoint footer checksum mismatch");
    }
    let footer_ts = le_u64(footer, 8).unwrap_or(0);
    let want_tables = le_u64(footer, 16).unwrap_or(0);
    let want_entries = le_u64(footer, 24).unwrap_or(0);
    let want_blocks = le_u64(footer, 32).unwrap_or(0);
    let mut digest_bytes = [0u8; 16];
    digest_bytes.copy_from_slice(footer.get(40..56).unwrap_or(&[0u8; 16]));
    let want_digest = StateDigest(u128::from_le_bytes(digest_bytes));
    if footer_ts != ts {
        return fail(footer_at, "footer timestamp differs from header");
    }

    let mut pos = HEADER_BYTES;
    let (mut blocks, mut tables, mut entries) = (0u64, 0u64, 0u64);
    let mut digest = StateDigest::default();
    let mut names: crate::types::FastMap<u32, String> = crate::types::FastMap::default();
    while pos < footer_at {
        let (Some(len), Some(crc)) = (le_u32(bytes, pos), le_u32(bytes, pos + 4)) else {
            return fail(pos, "truncated block header");
        };
        let len = len as usize;
        if len > BLOCK_MAX_BYTES || pos + BLOCK_HEADER_BYTES + len > footer_at {
            return fail(pos, "block length runs past the footer");
        }
        let block = bytes.get(pos + BLOCK_HEADER_BYTES..pos + BLOCK_HEADER_BYTES + len).unwrap_or_default();
        if crc32c::crc32c(block) != crc {
            return fail(pos, "block checksum mismatch");
        }
        let mut r = Reader::new(block);
        while !r.is_empty() {
            let bad = |e: crate::codec::DecodeError| (pos as u64, format!("bad record in block: {e}"));
            match r.u8("record tag").map_err(bad)? {
                REC_TABLE => {
                    let id = r.u32("table id").map_err(bad)?;
                    let raw = r.bytes32(MAX_TABLE_NAME_BYTES, "table name").map_err(bad)?;
                    let name =
                        std::str::from_utf8(raw).map_err(|_| (pos as u64, "table name is not UTF-8".to_owned()))?;
                    if name.is_empty() || names.insert(id, name.to_owned()).is_some() {
                        return fail(pos, "duplicate or empty table record");
                    }
                    sink.table(id, name);
                    tables += 1;
                }
                REC_ENTRY => {
                    let id = r.u32("table id").map_err(bad)?;
                    let key = r.bytes32(MAX_KEY_BYTES, "key").map_err(bad)?;
                    let value = r.bytes32(MAX_VALUE_BYTES, "value").map_err(bad)?;
                    let Some(name) = names.get(&id) else {
                        return fail(pos, "entry for an unknown table");
                    };
                    digest.add(name, key, value);
                    sink.entry(id, key, value);
                    entries += 1;
                }
                _ => return fail(pos, "unknown record tag"),
            }
        }
        blocks += 1;
        pos += BLOCK_HEADER_BYTES + len;
    }
    if (blocks, tables, entries) != (want_blocks, want_tables, want_entries) {
        return fail(footer_at, "footer counts differ from the blocks");
    }
    if digest != want_digest {
        return fail(footer_at, "state digest mismatch");
    }
    Ok(CheckpointSummary { ts, next_table_id, entries, digest, applied })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::{read_all, StdFs};

    #[derive(Default)]
    struct Collect {
        tables: Vec<(u32, String)>,
        entries: Vec<(u32, Vec<u8>, Vec<u8>)>,
    }
    impl CheckpointSink for Collect {
        fn table(&mut self, id: u32, name: &str) {
            self.tables.push((id, name.to_owned()));
        }
        fn entry(&mut self, table_id: u32, key: &[u8], value: &[u8]) {
            self.entries.push((table_id, key.to_vec(), value.to_vec()));
        }
    }

    fn write_sample(dir: &Path) -> PathBuf {
        let fs: Arc<dyn FileSystem> = Arc::new(StdFs);
        let mut w = CheckpointWriter::create(fs, dir, 7, 3).expect("create");
        let a: Arc<str> = Arc::from("alpha");
        w.table(1, &a).expect("table");
        for i in 0..1000u32 {
            w.entry(1, &i.to_be_bytes(), &[7u8; 300]).expect("entry");
        }
        w.finish().expect("finish").0
    }

    #[test]
    fn applied_position_round_trips_in_the_header() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fs: Arc<dyn FileSystem> = Arc::new(StdFs);
        let mut w = CheckpointWriter::create(fs, dir.path(), 9, 2).expect("create");
        w.set_applied(Some(LogPosition::new(41, 3)));
        let path = w.finish().expect("finish").0;
        let bytes = read_all(StdFs.open(&path, OpenMode::Read).expect("open").as_ref()).expect("read");
        let summary = read_checkpoint(&bytes, &mut Collect::default()).expect("valid");
        assert_eq!((summary.ts, summary.applied), (9, Some(LogPosition::new(41, 3))));
    }

    #[test]
    fn round_trip_and_every_flipped_byte_is_caught() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write_sample(dir.path());
        let bytes = read_all(StdFs.open(&path, OpenMode::Read).expect("open").as_ref()).expect("read");
        let mut sink = Collect::default();
        let summary = read_checkpoint(&bytes, &mut sink).expect("valid");
        assert_eq!((summary.ts, summary.next_table_id, summary.entries), (7, 3, 1000));
        assert_eq!(summary.applied, None);
        assert_eq!(sink.tables, vec![(1, "alpha".to_owned())]);
        // A flipped bit anywhere must be reported, never accepted.
        for offset in (0..bytes.len()).step_by(97) {
            let mut bad = bytes.clone();
            bad[offset] ^= 0x04;
            assert!(read_checkpoint(&bad, &mut Collect::default()).is_err(), "flip at {offset} accepted");
        }
        // Truncation anywhere is reported too.
        for cut in [1, 10, 64, 1000, bytes.len() / 2, bytes.len() - 1] {
            assert!(read_checkpoint(&bytes[..cut], &mut Collect::default()).is_err(), "cut at {cut} accepted");
        }
    }
}
