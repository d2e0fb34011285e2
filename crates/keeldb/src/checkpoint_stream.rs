//! Checkpoint streams: the newest visible state as the bytes of a checkpoint file, written to
//! any `io::Write` (export), and such bytes read back from any `io::Read` into a verified,
//! not yet installed, in-memory state (receive).
//!
//! This module owns the stream side of checkpoints: the registered snapshot an export reads
//! at, and the bounded, block-at-a-time reader that checks every block's CRC before decoding
//! it and the footer's counts and digest at the end. It reuses `checkpoint.rs`'s encoder and
//! block decoder, so a stream is byte for byte a checkpoint file. It must not touch the
//! store's files or its live state: installing what it received is `install.rs`'s job, and
//! nothing received here is visible to anyone until that succeeds.

use std::io::{Read, Write};
use std::ops::Bound;
use std::sync::Arc;

use crate::checkpoint::{
    decode_footer, decode_header, is_footer_start, BlockDecoder, CheckpointEncoder, CheckpointSink, BLOCK_LEN_MAX,
    BLOCK_PREFIX_BYTES, FOOTER_BYTES, HEADER_BYTES,
};
use crate::codec::le_u32;
use crate::db::Inner;
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::index::{KeyRange, TableData};
use crate::types::{FastMap, LogPosition};

/// The name errors give to an export sink or an install source (they have no file path).
const EXPORT_STREAM: &str = "<checkpoint export stream>";
const INSTALL_STREAM: &str = "<checkpoint install stream>";

/// What [`crate::Database::export_checkpoint`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// The commit timestamp whose state the stream holds.
    pub ts: u64,
    /// Bytes written to the sink (a whole checkpoint file's size).
    pub bytes: u64,
    /// Tables in the stream (the engine's reserved tables included).
    pub tables: u64,
    /// Entries in the stream.
    pub entries: u64,
    /// The state digest at `ts`, as the stream's footer records it.
    pub digest: StateDigest,
    /// The replicated-log position applied at `ts` (see [`crate::Database::applied`]), as the
    /// stream's header records it; `None` when no command was ever applied.
    pub applied: Option<LogPosition>,
}

/// Limits for [`crate::Database::install_checkpoint_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstallOptions {
    /// The most bytes the stream may hold; a longer stream fails with
    /// [`Error::InvalidArgument`] as soon as it passes the limit. The received state is built
    /// in memory next to the current one, so this bounds what a hostile or mistaken sender can
    /// make the store allocate. Default 64 GiB.
    pub max_stream_bytes: u64,
    /// The stream's exact size, when the sender declared it (for example in a Raft snapshot's
    /// metadata): a stream longer or shorter fails with [`Error::InvalidArgument`].
    pub expected_bytes: Option<u64>,
}

impl Default for InstallOptions {
    fn default() -> Self {
        InstallOptions { max_stream_bytes: 64 << 30, expected_bytes: None }
    }
}

/// Releases a registered snapshot when dropped.
struct Registered<'a> {
    inner: &'a Inner,
    ts: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.inner.published().release(self.ts);
    }
}

/// Writes the newest visible state to `out` as a checkpoint file's bytes, the applied log
/// position in its header. Reads a registered snapshot (the collector keeps its versions), a
/// chunk of 1024 entries per table lock, so commits go on meanwhile; checks the streamed
/// digest against the one maintained at that timestamp.
pub(crate) fn export(inner: &Inner, out: &mut dyn Write) -> Result<ExportInfo> {
    inner.check_open()?;
    let (snap, expected, applied) = inner.published().acquire_with_digest();
    let _registered = Registered { inner, ts: snap };
    let tables = {
        let catalog = inner.published().catalog.read();
        let mut ts: Vec<_> = catalog.all().into_iter().filter(|t| t.visible_at(snap)).collect();
        ts.sort_by_key(|t| t.id);
        ts
    };
    let next_id = tables.iter().map(|t| t.id.saturating_add(1)).max().unwrap_or(1);
    let io = |e| Error::io(EXPORT_STREAM, e);
    let mut enc = CheckpointEncoder::new(out, snap, next_id, applied).map_err(io)?;
    for t in &tables {
        enc.table(t.id, &t.name).map_err(io)?;
        // One chunk per read lock, so a long export never holds a table against a commit.
        for_each_entry(
            |range| t.data.read().scan_chunk(range, false, snap, 1024),
            |k, v| enc.entry(t.id, k, v).map_err(io),
        )?;
    }
    let digest = enc.digest();
    if digest != expected {
        return Err(Error::corruption(
            &inner.path,
            0,
            format!("exported digest {digest} differs from the maintained digest {expected} at ts {snap}"),
        ));
    }
    let (tables, entries) = enc.counts();
    let (_, bytes) = enc.finish().map_err(io)?;
    Ok(ExportInfo { ts: snap, bytes, tables, entries, digest, applied })
}

/// Calls `f` on every entry `chunk` yields, in key order, asking for the next chunk after the
/// last key of the previous one (`chunk` is a `TableData::scan_chunk` call).
pub(crate) fn for_each_entry(
    mut chunk: impl FnMut(&KeyRange) -> (Vec<(Vec<u8>, Vec<u8>)>, bool),
    mut f: impl FnMut(&[u8], &[u8]) -> Result<()>,
) -> Result<()> {
    let mut range = KeyRange { start: Bound::Unbounded, end: Bound::Unbounded };
    loop {
        let (entries, more) = chunk(&range);
        for (k, v) in &entries {
            f(k, v)?;
        }
        match entries.last() {
            Some((k, _)) if more => range.start = Bound::Excluded(k.clone()),
            _ => return Ok(()),
        }
    }
}

/// One table of a received state: its name and its entries, every version at timestamp 0
/// (the installer gives the table its id and its creation timestamp).
#[derive(Debug)]
pub(crate) struct ReceivedTable {
    pub name: Arc<str>,
    pub data: TableData,
}

/// A checkpoint stream that passed every check, built in memory and not yet installed.
#[derive(Debug)]
pub(crate) struct Received {
    /// The timestamp the sender's checkpoint was taken at.
    pub source_ts: u64,
    /// The replicated-log position the sender had applied at `source_ts`.
    pub applied: Option<LogPosition>,
    pub tables: Vec<ReceivedTable>,
    pub entries: u64,
    pub digest: StateDigest,
    /// Stream bytes read.
    pub bytes: u64,
}

/// Builds tables from verified records; refuses what a checkpoint can never hold (two live
/// tables of one name, a key twice) instead of applying it.
#[derive(Debug, Default)]
struct Builder {
    tables: Vec<ReceivedTable>,
    by_id: FastMap<u32, usize>,
    names: FastMap<Arc<str>, u32>,
    digest: StateDigest,
    entries: u64,
    error: Option<String>,
}

impl CheckpointSink for Builder {
    fn table(&mut self, id: u32, name: &str) {
        let name: Arc<str> = Arc::from(name);
        if self.names.insert(Arc::clone(&name), id).is_some() {
            self.error.get_or_insert_with(|| format!("two tables named {name:?}"));
            return;
        }
        self.by_id.insert(id, self.tables.len());
        self.tables.push(ReceivedTable { name, data: TableData::default() });
    }
    fn entry(&mut self, table_id: u32, key: &[u8], value: &[u8]) {
        let Some(t) = self.by_id.get(&table_id).and_then(|&i| self.tables.get_mut(i)) else {
            self.error.get_or_insert_with(|| "entry for an unknown table".to_owned());
            return;
        };
        if t.data.get(key, u64::MAX).is_some() {
            self.error.get_or_insert_with(|| format!("a key of table {:?} appears twice", t.name));
            return;
        }
        t.data.apply(&t.name, key, Some(value), 0, 0, &mut self.digest);
        self.entries += 1;
    }
}

/// Reads a stream, refusing to go past a byte limit and allocating only as bytes arrive.
struct Bounded<'a> {
    input: &'a mut dyn Read,
    pos: u64,
    limit: u64,
    declared: bool,
}

impl Bounded<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<Vec<u8>> {
        let end = self.pos.saturating_add(n as u64);
        if end > self.limit {
            let why = if self.declared { "is larger than declared" } else { "exceeds the size limit" };
            return Err(Error::InvalidArgument(format!(
                "checkpoint stream {why} ({} bytes): {what} at offset {} would end at {end}",
                self.limit, self.pos
            )));
        }
        // `take` + `read_to_end` grows the buffer with the bytes that actually arrive, so a
        // length field that lies costs nothing until the sender really sends that much.
        let mut buf = Vec::new();
        let got = (&mut *self.input).take(n as u64).read_to_end(&mut buf).map_err(|e| Error::io(INSTALL_STREAM, e))?;
        if got < n {
            return Err(Error::corruption(
                INSTALL_STREAM,
                self.pos + got as u64,
                format!("stream ended inside {what} ({got} of {n} bytes)"),
            ));
        }
        self.pos = end;
        Ok(buf)
    }

    /// True when the stream has no byte left.
    fn at_end(&mut self) -> Result<bool> {
        let mut one = [0u8; 1];
        loop {
            match self.input.read(&mut one) {
                Ok(n) => return Ok(n == 0),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(INSTALL_STREAM, e)),
            }
        }
    }
}

fn bad((offset, reason): (u64, String)) -> Error {
    Error::corruption(INSTALL_STREAM, offset, reason)
}

/// Reads and verifies a whole checkpoint stream into memory. Every block's CRC is checked
/// before its records are decoded; the counts and the digest against the footer at the end;
/// the stream must end right after the footer. Nothing outside the returned value changes.
pub(crate) fn receive(input: &mut dyn Read, options: &InstallOptions) -> Result<Received> {
    let limit = match options.expected_bytes {
        Some(n) => n.min(options.max_stream_bytes),
        None => options.max_stream_bytes,
    };
    let mut r = Bounded { input, pos: 0, limit, declared: options.expected_bytes.is_some() };
    let header = decode_header(&r.take(HEADER_BYTES, "the header")?).map_err(bad)?;
    // Commits after an install count up from its timestamp and must stay below MAX_TS.
    if header.ts > crate::index::MAX_INSTALL_TS {
        return Err(Error::InvalidArgument(format!("checkpoint stream timestamp {} is out of range", header.ts)));
    }
    let mut decoder = BlockDecoder::default();
    let mut builder = Builder::default();
    let footer = loop {
        let at = r.pos;
        let prefix = r.take(BLOCK_PREFIX_BYTES, "a block header")?;
        if is_footer_start(&prefix) {
            let mut footer = prefix;
            footer.extend_from_slice(&r.take(FOOTER_BYTES - BLOCK_PREFIX_BYTES, "the footer")?);
            break (decode_footer(&footer, header.ts, at).map_err(bad)?, at);
        }
        let (len, crc) = (le_u32(&prefix, 0).unwrap_or(0) as usize, le_u32(&prefix, 4).unwrap_or(0));
        if len > BLOCK_LEN_MAX {
            return Err(Error::corruption(INSTALL_STREAM, at, format!("block length {len} above the maximum")));
        }
        let block = r.take(len, "a block")?;
        decoder.block(at, &block, crc, &mut builder).map_err(bad)?;
        if let Some(why) = builder.error.take() {
            return Err(Error::corruption(INSTALL_STREAM, at, why));
        }
    };
    let (footer, at) = footer;
    let digest = decoder.check(&footer, at).map_err(bad)?;
    if builder.digest != digest {
        return Err(Error::corruption(INSTALL_STREAM, at, "state digest differs from the entries' digest"));
    }
    if !r.at_end()? {
        return Err(Error::InvalidArgument(format!(
            "checkpoint stream continues after its footer at offset {}",
            r.pos
        )));
    }
    if let Some(n) = options.expected_bytes.filter(|&n| n != r.pos) {
        return Err(Error::InvalidArgument(format!("checkpoint stream is {} bytes, {n} were declared", r.pos)));
    }
    Ok(Received {
        source_ts: header.ts,
        applied: header.applied,
        tables: builder.tables,
        entries: builder.entries,
        digest,
        bytes: r.pos,
    })
}

#[cfg(test)]
#[allow(clippy::expect_used)]
mod tests {
    use super::*;
    use crate::checkpoint::read_checkpoint;

    #[derive(Default)]
    struct Count(u64, u64);
    impl CheckpointSink for Count {
        fn table(&mut self, _: u32, _: &str) {
            self.0 += 1;
        }
        fn entry(&mut self, _: u32, _: &[u8], _: &[u8]) {
            self.1 += 1;
        }
    }

    #[test]
    fn an_export_is_a_checkpoint_file_that_read_checkpoint_accepts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = crate::Options { background_threads: false, ..crate::Options::default() };
        let db = crate::Database::open(dir.path().join("s"), options).expect("open");
        for i in 0..3000u32 {
            let mut tx = db.begin_write().expect("begin");
            tx.put(&format!("t{}", i % 4), &i.to_be_bytes(), &[i as u8; 200]).expect("put");
            tx.commit().expect("commit");
        }
        let mut bytes = Vec::new();
        let info = db.export_checkpoint(&mut bytes).expect("export");
        let mut count = Count::default();
        let summary = read_checkpoint(&bytes, &mut count).expect("a valid checkpoint");
        assert_eq!((summary.ts, summary.digest, summary.entries), (info.ts, info.digest, 3000));
        assert_eq!((count.0, count.1, info.tables), (4, 3000, 4));
        assert!(bytes.len() > 2 * 256 * 1024, "several blocks");
        // The stream reader accepts exactly what the file reader accepts.
        let received = receive(&mut bytes.as_slice(), &InstallOptions::default()).expect("receive");
        assert_eq!((received.source_ts, received.digest, received.entries), (info.ts, info.digest, 3000));
        db.close().expect("close");
    }
}
