//! Checkpoint files: the full state at one commit timestamp, in checksummed blocks.
//!
//! This module owns the checkpoint byte format (see `docs/design/format.md`): writing a
//! checkpoint from a stream of tables and entries (to a file, or to any `io::Write` for a
//! checkpoint stream), and reading one back, verifying every block's CRC32C before its records
//! are decoded and the footer's digest after; the decoding steps are shared with the stream
//! reader in `checkpoint_stream.rs`. It does not decide when to checkpoint or which WAL to
//! delete; `maintenance.rs` and `install.rs` do, in the order that
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
/// History records (version 2 only, after every table and entry record; see format.md).
const REC_CREATED: u8 = 3;
const REC_BASE: u8 = 4;
const REC_CHANGE: u8 = 5;

/// The checkpoint version without history: what a store that keeps none writes, and what every
/// checkpoint stream is.
pub(crate) const VERSION_STATE: u32 = 1;
/// The checkpoint version that also holds the history after a floor (header bytes 44..52).
pub(crate) const VERSION_HISTORY: u32 = 2;

pub(crate) use crate::files::{checkpoint_name, parse_checkpoint_name};

/// Encodes a checkpoint (header, CRC'd blocks, footer) into any byte sink: a file through
/// [`CheckpointWriter`], or a stream a caller exports (`checkpoint_stream.rs`). The one encoder
/// of the format, so a streamed checkpoint is byte for byte what a checkpoint file holds.
pub(crate) struct CheckpointEncoder<W: std::io::Write> {
    out: W,
    ts: u64,
    offset: u64,
    block: Vec<u8>,
    blocks: u64,
    tables: u64,
    entries: u64,
    digest: StateDigest,
    current_table: Option<Arc<str>>,
}

/// Header bytes 24..44 (reserved before): the applied log position, if any. Flag 1 at 40 says
/// it is present; a checkpoint written before the field existed has zeros there.
/// With a history floor the header is version 2 and bytes 44..52 hold the floor; without one
/// it is byte for byte the version 1 header.
fn encode_header(next_table_id: u32, ts: u64, applied: Option<LogPosition>, floor: Option<u64>) -> Vec<u8> {
    let mut header = Vec::with_capacity(HEADER_BYTES);
    header.extend_from_slice(HEADER_MAGIC);
    header.put_u32(if floor.is_some() { VERSION_HISTORY } else { VERSION_STATE });
    header.put_u32(next_table_id);
    header.put_u64(ts);
    let pos = applied.unwrap_or_default();
    header.put_u64(pos.index);
    header.put_u64(pos.term);
    header.put_u32(u32::from(applied.is_some()));
    if let Some(floor) = floor {
        header.put_u64(floor);
    }
    header.resize(60, 0);
    let crc = crc32c::crc32c(&header);
    header.put_u32(crc);
    header
}

impl<W: std::io::Write> CheckpointEncoder<W> {
    /// Writes the header, which carries the replicated-log position applied at `ts`.
    pub fn new(out: W, ts: u64, next_table_id: u32, applied: Option<LogPosition>) -> std::io::Result<Self> {
        Self::with_floor(out, ts, next_table_id, applied, None)
    }

    /// [`CheckpointEncoder::new`]; with a history floor, a version 2 checkpoint whose history
    /// records follow the entries.
    pub fn with_floor(
        mut out: W,
        ts: u64,
        next_table_id: u32,
        applied: Option<LogPosition>,
        floor: Option<u64>,
    ) -> std::io::Result<Self> {
        out.write_all(&encode_header(next_table_id, ts, applied, floor))?;
        Ok(CheckpointEncoder {
            out,
            ts,
            offset: HEADER_BYTES as u64,
            block: Vec::with_capacity(BLOCK_TARGET_BYTES + 1024),
            blocks: 0,
            tables: 0,
            entries: 0,
            digest: StateDigest::default(),
            current_table: None,
        })
    }

    pub fn table(&mut self, id: u32, name: &Arc<str>) -> std::io::Result<()> {
        self.block.put_u8(REC_TABLE);
        self.block.put_u32(id);
        self.block.put_bytes32(name.as_bytes());
        self.tables += 1;
        self.current_table = Some(Arc::clone(name));
        self.maybe_flush()
    }

    /// Adds an entry of the table last passed to [`CheckpointEncoder::table`].
    pub fn entry(&mut self, table_id: u32, key: &[u8], value: &[u8]) -> std::io::Result<()> {
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

    /// History: a table created after the floor, at `created_ts`.
    pub fn created(&mut self, table_id: u32, created_ts: u64) -> std::io::Result<()> {
        self.block.put_u8(REC_CREATED);
        self.block.put_u32(table_id);
        self.block.put_u64(created_ts);
        self.maybe_flush()
    }

    /// History: a key's value at the floor (`None`: absent), for a key changed after it.
    pub fn base(&mut self, table_id: u32, key: &[u8], value: Option<&[u8]>) -> std::io::Result<()> {
        self.block.put_u8(REC_BASE);
        self.block.put_u32(table_id);
        self.block.put_bytes32(key);
        put_optional(&mut self.block, value);
        self.maybe_flush()
    }

    /// History: one change after the floor, in the change feed's order.
    pub fn change(&mut self, ts: u64, table_id: u32, key: &[u8], value: Option<&[u8]>) -> std::io::Result<()> {
        self.block.put_u8(REC_CHANGE);
        self.block.put_u64(ts);
        self.block.put_u32(table_id);
        self.block.put_bytes32(key);
        put_optional(&mut self.block, value);
        self.maybe_flush()
    }

    fn maybe_flush(&mut self) -> std::io::Result<()> {
        if self.block.len() >= BLOCK_TARGET_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.block.is_empty() {
            return Ok(());
        }
        let mut framed = Vec::with_capacity(self.block.len() + BLOCK_HEADER_BYTES);
        framed.put_u32(self.block.len() as u32);
        framed.put_u32(crc32c::crc32c(&self.block));
        framed.extend_from_slice(&self.block);
        self.out.write_all(&framed)?;
        self.offset += framed.len() as u64;
        self.blocks += 1;
        self.block.clear();
        Ok(())
    }

    /// The digest of everything written so far.
    pub fn digest(&self) -> StateDigest {
        self.digest
    }

    /// Tables and entries written so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.tables, self.entries)
    }

    /// Writes the last block and the footer and flushes the sink. Returns the sink and the
    /// total bytes written.
    pub fn finish(mut self) -> std::io::Result<(W, u64)> {
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
        self.out.write_all(&footer)?;
        self.out.flush()?;
        Ok((self.out, self.offset + FOOTER_BYTES as u64))
    }
}

/// `present:u8 (0 or 1) [value:bytes]`.
fn put_optional(block: &mut Vec<u8>, value: Option<&[u8]>) {
    block.put_u8(u8::from(value.is_some()));
    if let Some(v) = value {
        block.put_bytes32(v);
    }
}

/// A file as an `io::Write` sink: positional writes from offset 0 through the seam.
pub(crate) struct FileOut {
    file: Arc<dyn FileHandle>,
    offset: u64,
}

impl std::io::Write for FileOut {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        write_all_at(self.file.as_ref(), buf, self.offset)?;
        self.offset += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Streams a checkpoint into a temporary file; [`CheckpointWriter::finish`] makes it durable
/// and renames it into place.
pub(crate) struct CheckpointWriter {
    fs: Arc<dyn FileSystem>,
    dir: PathBuf,
    tmp: PathBuf,
    ts: u64,
    enc: CheckpointEncoder<FileOut>,
}

impl CheckpointWriter {
    /// Starts `checkpoint-ts.kc.tmp` (replacing a leftover one). `applied` is the
    /// replicated-log position applied at `ts`, known before the first byte is written.
    pub fn create(
        fs: Arc<dyn FileSystem>,
        dir: &Path,
        ts: u64,
        next_table_id: u32,
        applied: Option<LogPosition>,
    ) -> Result<Self> {
        Self::create_with_floor(fs, dir, ts, next_table_id, applied, None)
    }

    /// [`CheckpointWriter::create`] for a checkpoint that also holds the history after
    /// `floor` (version 2), when it is `Some`.
    pub fn create_with_floor(
        fs: Arc<dyn FileSystem>,
        dir: &Path,
        ts: u64,
        next_table_id: u32,
        applied: Option<LogPosition>,
        floor: Option<u64>,
    ) -> Result<Self> {
        let tmp = dir.join(crate::files::tmp_name(&checkpoint_name(ts)));
        if fs.exists(&tmp).map_err(|e| Error::io(&tmp, e))? {
            fs.remove_file(&tmp).map_err(|e| Error::io(&tmp, e))?;
        }
        let file = fs.open(&tmp, OpenMode::CreateNew).map_err(|e| Error::io(&tmp, e))?;
        let enc = CheckpointEncoder::with_floor(FileOut { file, offset: 0 }, ts, next_table_id, applied, floor)
            .map_err(|e| Error::io(&tmp, e))?;
        Ok(CheckpointWriter { fs, dir: dir.to_owned(), tmp, ts, enc })
    }

    pub fn table(&mut self, id: u32, name: &Arc<str>) -> Result<()> {
        self.enc.table(id, name).map_err(|e| Error::io(&self.tmp, e))
    }

    /// Adds an entry of the table last passed to [`CheckpointWriter::table`].
    pub fn entry(&mut self, table_id: u32, key: &[u8], value: &[u8]) -> Result<()> {
        self.enc.entry(table_id, key, value).map_err(|e| Error::io(&self.tmp, e))
    }

    /// The digest of everything written so far.
    pub fn digest(&self) -> StateDigest {
        self.enc.digest()
    }

    /// The encoder, for the history records (after every entry).
    pub fn history(&mut self) -> (&mut CheckpointEncoder<FileOut>, &Path) {
        (&mut self.enc, &self.tmp)
    }

    /// Writes the footer and fsyncs the temporary file, without renaming it. Returns the
    /// temporary path and the size. (A checkpoint install names the temporary file in its
    /// marker and renames it later; see `install.rs`.)
    pub fn finish_unrenamed(self) -> Result<(PathBuf, u64)> {
        let tmp = self.tmp;
        let (out, size) = self.enc.finish().map_err(|e| Error::io(&tmp, e))?;
        out.file.sync_data().map_err(|e| Error::io(&tmp, e))?;
        Ok((tmp, size))
    }

    /// Writes the footer, fsyncs, renames into place and fsyncs the directory. Returns the
    /// final path and size.
    pub fn finish(self) -> Result<(PathBuf, u64)> {
        let (fs, dir, ts) = (Arc::clone(&self.fs), self.dir.clone(), self.ts);
        let (tmp, size) = self.finish_unrenamed()?;
        let target = dir.join(checkpoint_name(ts));
        fs.rename(&tmp, &target).map_err(|e| Error::io(&target, e))?;
        fs.sync_dir(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok((target, size))
    }
}

/// What a verified checkpoint holds, delivered record by record.
pub(crate) trait CheckpointSink {
    fn table(&mut self, id: u32, name: &str);
    fn entry(&mut self, table_id: u32, key: &[u8], value: &[u8]);
    /// A history record of a version 2 checkpoint (after every table and entry).
    fn history(&mut self, _record: &HistoryRecord<'_>) {}
}

/// A history record (format.md, "History"), as decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HistoryRecord<'a> {
    /// A table created after the floor, at `ts`.
    Created { table: u32, ts: u64 },
    /// A key's value at the floor (`None`: absent).
    Base { table: u32, key: &'a [u8], value: Option<&'a [u8]> },
    /// A change after the floor (`None`: a deletion).
    Change { ts: u64, table: u32, key: &'a [u8], value: Option<&'a [u8]> },
}

/// A sink that keeps nothing: for a pass that only verifies.
pub(crate) struct Discard;

impl CheckpointSink for Discard {
    fn table(&mut self, _: u32, _: &str) {}
    fn entry(&mut self, _: u32, _: &[u8], _: &[u8]) {}
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
    /// The history floor of a version 2 checkpoint: its history records hold every change
    /// after it.
    pub history_floor: Option<u64>,
}

/// A checkpoint header that passed its checks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Header {
    pub ts: u64,
    pub next_table_id: u32,
    pub applied: Option<LogPosition>,
    /// Version 2: the history floor (at or below `ts`).
    pub history_floor: Option<u64>,
}

/// The version of a checkpoint header whose magic and CRC are intact but whose version this
/// build does not read (a newer one): open refuses the store rather than set the file aside.
pub(crate) fn unsupported_version(header: &[u8]) -> Option<u32> {
    let header = header.get(..HEADER_BYTES)?;
    if header.get(..8) != Some(&HEADER_MAGIC[..]) || crc32c::crc32c(header.get(..60)?) != le_u32(header, 60)? {
        return None;
    }
    let version = le_u32(header, 8)?;
    (version > VERSION_HISTORY).then_some(version)
}

/// Checks a checkpoint header (magic, CRC, version, position flag). Errors carry offset and
/// reason.
pub(crate) fn decode_header(header: &[u8]) -> std::result::Result<Header, (u64, String)> {
    let fail = |offset: u64, reason: &str| Err((offset, reason.to_owned()));
    let header = header.get(..HEADER_BYTES).unwrap_or_default();
    if header.get(..8) != Some(&HEADER_MAGIC[..]) {
        return fail(0, "bad checkpoint magic");
    }
    if crc32c::crc32c(header.get(..60).unwrap_or_default()) != le_u32(header, 60).unwrap_or(0) {
        return fail(0, "checkpoint header checksum mismatch");
    }
    let version = le_u32(header, 8).unwrap_or(0);
    if version != VERSION_STATE && version != VERSION_HISTORY {
        return fail(8, &format!("unsupported checkpoint format version {version}"));
    }
    let applied = match le_u32(header, 40).unwrap_or(0) {
        0 => None,
        1 => Some(LogPosition { index: le_u64(header, 24).unwrap_or(0), term: le_u64(header, 32).unwrap_or(0) }),
        _ => return fail(40, "bad applied-position flag in checkpoint header"),
    };
    let ts = le_u64(header, 16).unwrap_or(0);
    let history_floor = (version == VERSION_HISTORY).then(|| le_u64(header, 44).unwrap_or(0));
    if history_floor.is_some_and(|floor| floor > ts) {
        return fail(44, "history floor above the checkpoint timestamp");
    }
    Ok(Header { next_table_id: le_u32(header, 12).unwrap_or(0), ts, applied, history_floor })
}

/// [`decode_header`] for a checkpoint file in a store's directory, which also refuses a
/// timestamp above [`MAX_TS`](crate::index::MAX_TS) as corruption: no store writes one (a
/// slot keeps the collector's flag in the bit above). A received stream's timestamp is
/// checked by its reader instead (`checkpoint_stream.rs`: an invalid argument, not damage).
pub(crate) fn decode_file_header(header: &[u8]) -> std::result::Result<Header, (u64, String)> {
    let decoded = decode_header(header)?;
    if decoded.ts > crate::index::MAX_TS {
        return Err((16, format!("checkpoint timestamp {} above the largest a store uses", decoded.ts)));
    }
    Ok(decoded)
}

/// Whether the 8 bytes at a block boundary start the footer rather than a block. A block's
/// length field can never read as the footer magic: `KEEL` as a length is over 1 GB, far
/// above [`BLOCK_MAX_BYTES`].
pub(crate) fn is_footer_start(bytes: &[u8]) -> bool {
    bytes.get(..8) == Some(&FOOTER_MAGIC[..])
}

/// The largest block length a valid checkpoint holds; a reader refuses longer ones before
/// reading them.
pub(crate) const BLOCK_LEN_MAX: usize = BLOCK_MAX_BYTES;
/// Bytes before each block's records: `len:u32 crc:u32`.
pub(crate) const BLOCK_PREFIX_BYTES: usize = BLOCK_HEADER_BYTES;

/// Footer fields of a checkpoint whose footer passed its CRC.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Footer {
    pub tables: u64,
    pub entries: u64,
    pub blocks: u64,
    pub digest: StateDigest,
}

/// Checks a footer (magic, CRC, timestamp equal to the header's) at offset `at`.
pub(crate) fn decode_footer(footer: &[u8], ts: u64, at: u64) -> std::result::Result<Footer, (u64, String)> {
    let fail = |reason: &str| Err((at, reason.to_owned()));
    let footer = footer.get(..FOOTER_BYTES).unwrap_or_default();
    if !is_footer_start(footer) {
        return fail("missing checkpoint footer (incomplete file)");
    }
    if crc32c::crc32c(footer.get(..60).unwrap_or_default()) != le_u32(footer, 60).unwrap_or(0) {
        return fail("checkpoint footer checksum mismatch");
    }
    if le_u64(footer, 8).unwrap_or(0) != ts {
        return fail("footer timestamp differs from header");
    }
    let mut digest_bytes = [0u8; 16];
    digest_bytes.copy_from_slice(footer.get(40..56).unwrap_or(&[0u8; 16]));
    Ok(Footer {
        tables: le_u64(footer, 16).unwrap_or(0),
        entries: le_u64(footer, 24).unwrap_or(0),
        blocks: le_u64(footer, 32).unwrap_or(0),
        digest: StateDigest(u128::from_le_bytes(digest_bytes)),
    })
}

/// One record of a checkpoint block.
enum Record<'a> {
    Table { id: u32, name: &'a str },
    Entry { table: u32, key: &'a [u8], value: &'a [u8] },
    History(HistoryRecord<'a>),
}

/// `present:u8 [value:bytes]`; a flag other than 0 or 1 is damage.
fn read_optional<'a>(r: &mut Reader<'a>) -> std::result::Result<Option<&'a [u8]>, crate::codec::DecodeError> {
    match r.u8("value flag")? {
        0 => Ok(None),
        1 => r.bytes32(MAX_VALUE_BYTES, "value").map(Some),
        _ => Err(crate::codec::DecodeError { offset: 0, what: "value flag" }),
    }
}

/// Decodes the records of one block (at offset `pos`, used in errors) into `f`, checking only
/// their structure: the caller checks the block's CRC.
fn decode_records<'a>(
    pos: u64,
    block: &'a [u8],
    mut f: impl FnMut(Record<'a>) -> std::result::Result<(), (u64, String)>,
) -> std::result::Result<(), (u64, String)> {
    let mut r = Reader::new(block);
    while !r.is_empty() {
        let bad = |e: crate::codec::DecodeError| (pos, format!("bad record in block: {e}"));
        match r.u8("record tag").map_err(bad)? {
            REC_TABLE => {
                let id = r.u32("table id").map_err(bad)?;
                let raw = r.bytes32(MAX_TABLE_NAME_BYTES, "table name").map_err(bad)?;
                let name = std::str::from_utf8(raw).map_err(|_| (pos, "table name is not UTF-8".to_owned()))?;
                f(Record::Table { id, name })?;
            }
            REC_ENTRY => {
                let table = r.u32("table id").map_err(bad)?;
                let key = r.bytes32(MAX_KEY_BYTES, "key").map_err(bad)?;
                let value = r.bytes32(MAX_VALUE_BYTES, "value").map_err(bad)?;
                f(Record::Entry { table, key, value })?;
            }
            REC_CREATED => {
                let table = r.u32("table id").map_err(bad)?;
                let ts = r.u64("creation timestamp").map_err(bad)?;
                f(Record::History(HistoryRecord::Created { table, ts }))?;
            }
            REC_BASE => {
                let table = r.u32("table id").map_err(bad)?;
                let key = r.bytes32(MAX_KEY_BYTES, "key").map_err(bad)?;
                let value = read_optional(&mut r).map_err(bad)?;
                f(Record::History(HistoryRecord::Base { table, key, value }))?;
            }
            REC_CHANGE => {
                let ts = r.u64("change timestamp").map_err(bad)?;
                let table = r.u32("table id").map_err(bad)?;
                let key = r.bytes32(MAX_KEY_BYTES, "key").map_err(bad)?;
                let value = read_optional(&mut r).map_err(bad)?;
                f(Record::History(HistoryRecord::Change { ts, table, key, value }))?;
            }
            _ => return Err((pos, "unknown record tag".to_owned())),
        }
    }
    Ok(())
}

/// Calls `f` with each block's offset, bytes and stored CRC, in order, between the header and
/// the footer at `footer_at`.
fn for_each_block(
    bytes: &[u8],
    footer_at: usize,
    mut f: impl FnMut(u64, &[u8], u32) -> std::result::Result<(), (u64, String)>,
) -> std::result::Result<(), (u64, String)> {
    let mut pos = HEADER_BYTES;
    while pos < footer_at {
        let (Some(len), Some(crc)) = (le_u32(bytes, pos), le_u32(bytes, pos + 4)) else {
            return Err((pos as u64, "truncated block header".to_owned()));
        };
        let len = len as usize;
        if len > BLOCK_MAX_BYTES || pos + BLOCK_HEADER_BYTES + len > footer_at {
            return Err((pos as u64, "block length runs past the footer".to_owned()));
        }
        let block = bytes.get(pos + BLOCK_HEADER_BYTES..pos + BLOCK_HEADER_BYTES + len).unwrap_or_default();
        f(pos as u64, block, crc)?;
        pos += BLOCK_HEADER_BYTES + len;
    }
    Ok(())
}

/// Decodes blocks in order, each only after its CRC matched, and keeps the counts and the
/// digest the footer must agree with. Shared by the file reader and the stream reader.
#[derive(Debug, Default)]
pub(crate) struct BlockDecoder {
    names: crate::types::FastMap<u32, String>,
    digest: StateDigest,
    blocks: u64,
    tables: u64,
    entries: u64,
    /// `(floor, checkpoint ts)` of a version 2 checkpoint: history records are allowed, with
    /// timestamps in `floor + 1 ..= ts`. `None` (every stream, every version 1 file): refused.
    history: Option<(u64, u64)>,
    /// The last record kind seen, in the order records must come: tables and entries, then
    /// creations, then bases, then changes.
    stage: u8,
    /// The timestamp of the last change record (changes come in commit order).
    last_change_ts: u64,
}

impl BlockDecoder {
    /// A decoder for the blocks of a checkpoint with this header: history records are
    /// accepted only after a version 2 header.
    pub fn for_header(header: &Header) -> BlockDecoder {
        BlockDecoder { history: header.history_floor.map(|floor| (floor, header.ts)), ..BlockDecoder::default() }
    }

    /// Checks a history record against the header and the records before it.
    fn check_history(&mut self, record: &HistoryRecord<'_>) -> std::result::Result<(), &'static str> {
        let Some((floor, ts)) = self.history else {
            return Err("history record in a checkpoint without history");
        };
        let (stage, table) = match *record {
            HistoryRecord::Created { table, ts: at } => {
                if at <= floor || at > ts {
                    return Err("table creation outside the checkpoint's history");
                }
                (REC_CREATED, table)
            }
            HistoryRecord::Base { table, .. } => (REC_BASE, table),
            HistoryRecord::Change { table, ts: at, .. } => {
                if at <= floor || at > ts || at < self.last_change_ts {
                    return Err("change timestamp out of order or outside the checkpoint's history");
                }
                self.last_change_ts = at;
                (REC_CHANGE, table)
            }
        };
        if stage < self.stage {
            return Err("history records out of order");
        }
        self.stage = stage;
        if !self.names.contains_key(&table) {
            return Err("history record for an unknown table");
        }
        Ok(())
    }

    /// Checks one block's CRC, then decodes its records into `sink`. `pos` is the block's
    /// offset, used in errors.
    pub fn block(
        &mut self,
        pos: u64,
        block: &[u8],
        crc: u32,
        sink: &mut dyn CheckpointSink,
    ) -> std::result::Result<(), (u64, String)> {
        let fail = |reason: &str| Err((pos, reason.to_owned()));
        if crc32c::crc32c(block) != crc {
            return fail("block checksum mismatch");
        }
        decode_records(pos, block, |record| {
            match record {
                Record::Table { .. } | Record::Entry { .. } if self.stage > REC_ENTRY => {
                    return fail("state record after history records");
                }
                Record::Table { id, name } => {
                    if name.is_empty() || self.names.insert(id, name.to_owned()).is_some() {
                        return fail("duplicate or empty table record");
                    }
                    sink.table(id, name);
                    self.tables += 1;
                }
                Record::Entry { table, key, value } => {
                    let Some(name) = self.names.get(&table) else {
                        return fail("entry for an unknown table");
                    };
                    self.digest.add(name, key, value);
                    sink.entry(table, key, value);
                    self.entries += 1;
                }
                Record::History(h) => {
                    self.check_history(&h).or_else(fail)?;
                    sink.history(&h);
                }
            }
            Ok(())
        })?;
        self.blocks += 1;
        Ok(())
    }

    /// Checks the counts and the recomputed digest against the footer at offset `at`.
    pub fn check(&self, footer: &Footer, at: u64) -> std::result::Result<StateDigest, (u64, String)> {
        if (self.blocks, self.tables, self.entries) != (footer.blocks, footer.tables, footer.entries) {
            return Err((at, "footer counts differ from the blocks".to_owned()));
        }
        if self.digest != footer.digest {
            return Err((at, "state digest mismatch".to_owned()));
        }
        Ok(self.digest)
    }
}

/// Delivers one block's records to `sink` checking their structure only (no CRC): for a
/// reader that builds while another thread verifies the same blocks (and keeps what
/// it built only if that verification passes).
pub(crate) fn decode_block_unverified(
    pos: u64,
    block: &[u8],
    sink: &mut dyn CheckpointSink,
) -> std::result::Result<(), (u64, String)> {
    decode_records(pos, block, |record| {
        match record {
            Record::Table { id, name } => sink.table(id, name),
            Record::Entry { table, key, value } => sink.entry(table, key, value),
            Record::History(h) => sink.history(&h),
        }
        Ok(())
    })
}

/// Calls `f` with each block's offset, bytes and stored CRC in `bytes`, a run of whole blocks
/// that starts at file offset `base` (as [`Windows`] hands them out).
pub(crate) fn for_each_block_in(
    base: u64,
    bytes: &[u8],
    mut f: impl FnMut(u64, &[u8], u32) -> std::result::Result<(), (u64, String)>,
) -> std::result::Result<(), (u64, String)> {
    let mut off = 0;
    while off < bytes.len() {
        let at = base + off as u64;
        let (Some(len), Some(crc)) = (le_u32(bytes, off), le_u32(bytes, off + 4)) else {
            return Err((at, "truncated block header".to_owned()));
        };
        let end = off + BLOCK_HEADER_BYTES + len as usize;
        let Some(block) = bytes.get(off + BLOCK_HEADER_BYTES..end) else {
            return Err((at, "block length runs past the footer".to_owned()));
        };
        f(at, block, crc)?;
        off = end;
    }
    Ok(())
}

/// Bytes of a checkpoint file read at a time ([`Windows`]): whole blocks, a longer block alone.
pub(crate) const READ_WINDOW: usize = 8 << 20;

/// A checkpoint file read a window at a time: runs of whole blocks into a buffer the caller
/// reuses, instead of the whole file into memory at once. At 10M keys the file is 1.3 GB, and
/// reading it whole cost as much fresh memory to fault in and zero (then free) before the
/// state itself was built.
///
/// Reports exactly what [`read_checkpoint`] reports, in the same order: the header and footer
/// are checked on opening; a block whose length does not fit is reported only after the whole
/// blocks before it were handed out (and so verified, or refused, first).
pub(crate) struct Windows<'f> {
    file: &'f dyn FileHandle,
    /// The checked header.
    pub header: Header,
    /// The footer, checked on its own (its counts and digest are for the caller to compare).
    pub footer: Footer,
    /// The footer's offset: where the blocks end.
    pub footer_at: u64,
    pos: u64,
    window: usize,
    /// A structural error found past the blocks last handed out.
    pending: Option<(u64, String)>,
}

/// A window's place: the file offset of its first block, and how many bytes of whole blocks
/// the caller's buffer now holds from its start.
pub(crate) type Window = (u64, usize);

impl<'f> Windows<'f> {
    /// Checks `file`'s header and footer; windows of about `window` bytes (at least 64) follow.
    pub fn open(
        file: &'f dyn FileHandle,
        window: usize,
    ) -> std::io::Result<std::result::Result<Windows<'f>, (u64, String)>> {
        let len = file.len()?;
        if len < (HEADER_BYTES + FOOTER_BYTES) as u64 {
            return Ok(Err((0, "file shorter than header and footer".to_owned())));
        }
        let mut header = [0u8; HEADER_BYTES];
        crate::fs::read_exact_at(file, &mut header, 0)?;
        let header = match decode_file_header(&header) {
            Ok(h) => h,
            Err(e) => return Ok(Err(e)),
        };
        let footer_at = len - FOOTER_BYTES as u64;
        let mut footer = [0u8; FOOTER_BYTES];
        crate::fs::read_exact_at(file, &mut footer, footer_at)?;
        let footer = match decode_footer(&footer, header.ts, footer_at) {
            Ok(f) => f,
            Err(e) => return Ok(Err(e)),
        };
        let window = window.max(HEADER_BYTES);
        Ok(Ok(Windows { file, header, footer, footer_at, pos: HEADER_BYTES as u64, window, pending: None }))
    }

    /// Reads the next run of whole blocks into `buf` (replacing what it held): `None` once
    /// the blocks are done, or the structural error that ends them. A block longer than the
    /// window is read whole, alone.
    pub fn next_into(
        &mut self,
        buf: &mut Vec<u8>,
    ) -> std::io::Result<Option<std::result::Result<Window, (u64, String)>>> {
        if let Some(e) = self.pending.take() {
            self.pos = self.footer_at; // an error ends the blocks
            return Ok(Some(Err(e)));
        }
        if self.pos >= self.footer_at {
            return Ok(None);
        }
        let want = usize::try_from(self.footer_at - self.pos).unwrap_or(usize::MAX).min(self.window);
        buf.resize(want, 0);
        crate::fs::read_exact_at(self.file, buf, self.pos)?;
        let mut off = 0;
        loop {
            let at = self.pos + off as u64;
            if at >= self.footer_at {
                break;
            }
            // A block's 8-byte prefix that reaches into the footer reads its length from the
            // footer's bytes: [`for_each_block`] reports that as a length past the footer.
            if at + BLOCK_HEADER_BYTES as u64 > self.footer_at {
                self.pending = Some((at, "block length runs past the footer".to_owned()));
                break;
            }
            if off + BLOCK_HEADER_BYTES > want {
                break; // the prefix lies past this window: the next one starts with it
            }
            let len = le_u32(buf, off).map_or(usize::MAX, |l| l as usize);
            if len > BLOCK_MAX_BYTES || at + (BLOCK_HEADER_BYTES + len) as u64 > self.footer_at {
                self.pending = Some((at, "block length runs past the footer".to_owned()));
                break;
            }
            let end = off + BLOCK_HEADER_BYTES + len;
            if end > want {
                if off == 0 {
                    buf.resize(end, 0);
                    crate::fs::read_exact_at(
                        self.file,
                        buf.get_mut(want..).unwrap_or_default(),
                        self.pos + want as u64,
                    )?;
                    off = end;
                }
                break;
            }
            off = end;
        }
        if off == 0 {
            let e = self.pending.take().unwrap_or((self.pos, "unreadable block".to_owned()));
            self.pos = self.footer_at;
            return Ok(Some(Err(e)));
        }
        let base = self.pos;
        self.pos += off as u64;
        Ok(Some(Ok((base, off))))
    }
}

impl BlockDecoder {
    /// The summary of a checkpoint whose every block went through [`BlockDecoder::block`]:
    /// the footer's counts and digest checked against what was decoded.
    pub fn summary(
        &self,
        header: &Header,
        footer: &Footer,
        footer_at: u64,
    ) -> std::result::Result<CheckpointSummary, (u64, String)> {
        let digest = self.check(footer, footer_at)?;
        Ok(CheckpointSummary {
            ts: header.ts,
            next_table_id: header.next_table_id,
            entries: self.entries,
            digest,
            applied: header.applied,
            history_floor: header.history_floor,
        })
    }
}

/// [`read_checkpoint`] on a file, a window at a time, on this thread alone: for `keel verify`,
/// and for open when it cannot build on two threads.
pub(crate) fn read_checkpoint_file(
    file: &dyn FileHandle,
    window: usize,
    sink: &mut dyn CheckpointSink,
) -> std::io::Result<std::result::Result<CheckpointSummary, (u64, String)>> {
    let mut windows = match Windows::open(file, window)? {
        Ok(w) => w,
        Err(e) => return Ok(Err(e)),
    };
    let mut decoder = BlockDecoder::for_header(&windows.header);
    let mut buf = Vec::new();
    while let Some(next) = windows.next_into(&mut buf)? {
        let (base, len) = match next {
            Ok(w) => w,
            Err(e) => return Ok(Err(e)),
        };
        let blocks = buf.get(..len).unwrap_or_default();
        if let Err(e) = for_each_block_in(base, blocks, |p, b, crc| decoder.block(p, b, crc, sink)) {
            return Ok(Err(e));
        }
    }
    Ok(decoder.summary(&windows.header, &windows.footer, windows.footer_at))
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
    let header = decode_file_header(bytes)?;
    let footer_at = bytes.len() - FOOTER_BYTES;
    let footer = decode_footer(bytes.get(footer_at..).unwrap_or_default(), header.ts, footer_at as u64)?;
    let mut decoder = BlockDecoder::for_header(&header);
    for_each_block(bytes, footer_at, |pos, block, crc| decoder.block(pos, block, crc, sink))?;
    decoder.summary(&header, &footer, footer_at as u64)
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
        let mut w = CheckpointWriter::create(fs, dir, 7, 3, None).expect("create");
        let a: Arc<str> = Arc::from("alpha");
        w.table(1, &a).expect("table");
        for i in 0..1000u32 {
            w.entry(1, &i.to_be_bytes(), &[7u8; 300]).expect("entry");
        }
        w.finish().expect("finish").0
    }

    #[derive(Default)]
    struct CollectHistory(Vec<String>);
    impl CheckpointSink for CollectHistory {
        fn table(&mut self, _: u32, _: &str) {}
        fn entry(&mut self, _: u32, _: &[u8], _: &[u8]) {}
        fn history(&mut self, record: &HistoryRecord<'_>) {
            self.0.push(format!("{record:?}"));
        }
    }

    /// A checkpoint at ts 20 of table 1 with `floor`, its history records written by `f`.
    fn with_history(floor: Option<u64>, f: impl FnOnce(&mut CheckpointEncoder<&mut Vec<u8>>)) -> Vec<u8> {
        let mut out = Vec::new();
        let mut enc = CheckpointEncoder::with_floor(&mut out, 20, 2, None, floor).expect("header");
        enc.table(1, &Arc::from("t")).expect("table");
        enc.entry(1, b"a", b"2").expect("entry");
        f(&mut enc);
        enc.finish().expect("finish");
        out
    }

    #[test]
    fn history_records_round_trip_after_a_version_2_header() {
        let bytes = with_history(Some(10), |enc| {
            enc.created(1, 11).unwrap();
            enc.base(1, b"a", None).unwrap();
            enc.change(11, 1, b"a", Some(b"1")).unwrap();
            enc.change(12, 1, b"a", Some(b"2")).unwrap();
        });
        let mut sink = CollectHistory::default();
        let summary = read_checkpoint(&bytes, &mut sink).expect("valid");
        assert_eq!(summary.history_floor, Some(10));
        assert_eq!(le_u32(&bytes, 8), Some(VERSION_HISTORY));
        assert_eq!(sink.0.len(), 4);
        // Without a floor the header is version 1, byte for byte what earlier builds wrote.
        let plain = with_history(None, |_| {});
        assert_eq!(le_u32(&plain, 8), Some(VERSION_STATE));
        assert_eq!(read_checkpoint(&plain, &mut Discard).expect("valid").history_floor, None);
    }

    /// A version 1 checkpoint laid out by hand from format.md (not by the encoder): one table
    /// `t` (id 1) holding `a = 1` at ts 7. Every build before history was persisted wrote this
    /// layout; this build must read it and, without history, write it byte for byte.
    #[test]
    fn a_hand_made_version_1_checkpoint_reads_and_is_what_the_encoder_writes() {
        let mut header = Vec::new();
        header.extend_from_slice(b"KEELCKP\0");
        header.put_u32(1); // version
        header.put_u32(2); // next table id
        header.put_u64(7); // timestamp
        header.resize(60, 0); // no applied position, reserved
        let crc = crc32c::crc32c(&header);
        header.put_u32(crc);
        let mut block = Vec::new();
        block.extend_from_slice(&[1, 1, 0, 0, 0, 1, 0, 0, 0, b't']); // table 1 "t"
        block.extend_from_slice(&[2, 1, 0, 0, 0, 1, 0, 0, 0, b'a', 1, 0, 0, 0, b'1']); // entry a = 1
        let mut digest = StateDigest::default();
        digest.add("t", b"a", b"1");
        let mut footer = Vec::new();
        footer.extend_from_slice(b"KEELCKPF");
        for n in [7u64, 1, 1, 1] {
            footer.put_u64(n); // timestamp, tables, entries, blocks
        }
        footer.extend_from_slice(&digest.0.to_le_bytes());
        footer.resize(60, 0);
        let crc = crc32c::crc32c(&footer);
        footer.put_u32(crc);
        let mut file = header;
        file.put_u32(block.len() as u32);
        file.put_u32(crc32c::crc32c(&block));
        file.extend_from_slice(&block);
        file.extend_from_slice(&footer);

        let summary = read_checkpoint(&file, &mut Discard).expect("a version 1 checkpoint reads");
        assert_eq!((summary.ts, summary.entries, summary.history_floor), (7, 1, None));
        let mut out = Vec::new();
        let mut enc = CheckpointEncoder::new(&mut out, 7, 2, None).expect("header");
        enc.table(1, &Arc::from("t")).expect("table");
        enc.entry(1, b"a", b"1").expect("entry");
        enc.finish().expect("finish");
        assert_eq!(out, file, "without history the encoder writes version 1 byte for byte");
    }

    #[test]
    fn history_records_that_break_the_rules_are_refused() {
        type Write = fn(&mut CheckpointEncoder<&mut Vec<u8>>);
        let cases: [(Option<u64>, Write, &str); 7] = [
            (None, |e| e.change(12, 1, b"a", None).unwrap(), "without history"),
            (Some(10), |e| e.change(10, 1, b"a", None).unwrap(), "outside"),
            (Some(10), |e| e.change(21, 1, b"a", None).unwrap(), "outside"),
            (
                Some(10),
                |e| {
                    e.change(13, 1, b"a", None).unwrap();
                    e.change(12, 1, b"a", None).unwrap();
                },
                "out of order",
            ),
            (
                Some(10),
                |e| {
                    e.change(12, 1, b"a", None).unwrap();
                    e.base(1, b"a", None).unwrap();
                },
                "out of order",
            ),
            (Some(10), |e| e.base(7, b"a", None).unwrap(), "unknown table"),
            (
                Some(10),
                |e| {
                    e.base(1, b"a", None).unwrap();
                    e.entry(1, b"b", b"1").unwrap();
                },
                "after history",
            ),
        ];
        for (floor, write, why) in cases {
            let bytes = with_history(floor, write);
            match read_checkpoint(&bytes, &mut Discard) {
                Err((_, reason)) => assert!(reason.contains(why), "{why}: {reason}"),
                Ok(_) => panic!("accepted: {why}"),
            }
        }
        // A floor above the checkpoint's timestamp is a bad header.
        let bytes = with_history(Some(21), |_| {});
        assert!(read_checkpoint(&bytes, &mut Discard).is_err());
        // A stream reader (no header context) refuses history records.
        let mut decoder = BlockDecoder::default();
        let mut block = Vec::new();
        block.put_u8(REC_TABLE);
        block.put_u32(1);
        block.put_bytes32(b"t");
        block.put_u8(REC_BASE);
        block.put_u32(1);
        block.put_bytes32(b"a");
        block.put_u8(0);
        let crc = crc32c::crc32c(&block);
        assert!(decoder.block(64, &block, crc, &mut Discard).is_err());
    }

    #[test]
    fn only_a_newer_version_with_an_intact_header_is_unsupported() {
        for (version, newer) in [(1, false), (2, false), (3, true), (u32::MAX, true)] {
            let mut header = encode_header(2, 7, None, None);
            header[8..12].copy_from_slice(&u32::to_le_bytes(version));
            let crc = crc32c::crc32c(&header[..60]);
            header[60..64].copy_from_slice(&crc.to_le_bytes());
            assert_eq!(unsupported_version(&header), newer.then_some(version), "version {version}");
            header[20] ^= 1; // a damaged header is damage, whatever its version says
            assert_eq!(unsupported_version(&header), None);
        }
    }

    #[test]
    fn applied_position_round_trips_in_the_header() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fs: Arc<dyn FileSystem> = Arc::new(StdFs);
        let w = CheckpointWriter::create(fs, dir.path(), 9, 2, Some(LogPosition::new(41, 3))).expect("create");
        let path = w.finish().expect("finish").0;
        let bytes = read_all(StdFs.open(&path, OpenMode::Read).expect("open").as_ref()).expect("read");
        let summary = read_checkpoint(&bytes, &mut Collect::default()).expect("valid");
        assert_eq!((summary.ts, summary.applied), (9, Some(LogPosition::new(41, 3))));
    }

    /// A checkpoint file whose header checksum matches but whose timestamp no store reaches is
    /// refused: a slot keeps the collector's flag in the bit above the largest timestamp
    /// (`index::MAX_TS`).
    #[test]
    fn a_timestamp_above_the_largest_is_refused() {
        for (ts, ok) in [(crate::index::MAX_TS, true), (crate::index::MAX_TS + 1, false), (u64::MAX, false)] {
            let mut header = encode_header(2, ts, None, None);
            let crc = crc32c::crc32c(&header[..60]);
            header[60..64].copy_from_slice(&crc.to_le_bytes());
            match decode_file_header(&header) {
                Ok(h) => assert!(ok && h.ts == ts, "ts {ts} accepted"),
                Err((at, why)) => assert!(!ok && at == 16 && why.contains("timestamp"), "ts {ts}: {why} at {at}"),
            }
        }
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
