//! Installing a received checkpoint: an open handle replaces its whole state, on disk and in
//! memory, crash-safely.
//!
//! This module owns the `INSTALL` marker (its byte layout is in `docs/design/format.md`), the
//! on-disk switch from the old checkpoints and WAL to the new checkpoint and a fresh WAL
//! segment (retiring the `CLOSED` marker on the way), and the idempotent completion recovery
//! runs when it finds the marker. The in-memory switch and the fence are the committer's
//! (`commit/replace.rs`); this module hands it the new state from inside
//! `Committer::replace_state`. The argument, crash point by crash point, is in
//! `docs/design/recovery.md` ("Checkpoint install"). It must not read the stream (that is
//! `checkpoint_stream.rs`) and must not leave the directory in a state that recovery would
//! open as a mix of old and new: the marker's durable rename is the one commit point.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::checkpoint::{
    checkpoint_name, parse_checkpoint_name, read_checkpoint_file, CheckpointWriter, Discard, READ_WINDOW,
};
use crate::checkpoint_stream::{for_each_entry, Received};
use crate::codec::{le_u32, le_u64, PutBytes};
use crate::commit::{Quiesced, ReplaceError, Replacement};
use crate::db::Inner;
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::files::{tmp_name, INSTALL_MARKER};
use crate::fs::{read_all, write_all_at, FileSystem, OpenMode};
use crate::index::{MAX_INSTALL_TS, MAX_TS};
use crate::types::LogPosition;
use crate::wal::{self, SegmentInfo, WalWriter};

const MARKER_MAGIC: &[u8; 8] = b"KEELINST";
const MARKER_BYTES: usize = 64;

/// What [`crate::Database::install_checkpoint`] installed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallInfo {
    /// The local commit timestamp of the installed state: the sender's timestamp, or one past
    /// the local last commit when that is higher (local timestamps never go backwards; see
    /// `docs/design/recovery.md`). The next commit gets `ts + 1`.
    pub ts: u64,
    /// The timestamp the sender's checkpoint was taken at.
    pub source_ts: u64,
    /// The last local commit timestamp the install replaced.
    pub replaced_ts: u64,
    /// The replicated-log position the installed state has applied (the stream's), now
    /// returned by [`crate::Database::applied`].
    pub applied: Option<LogPosition>,
    /// Tables installed (reserved tables included).
    pub tables: u64,
    /// Entries installed.
    pub entries: u64,
    /// Stream bytes read.
    pub stream_bytes: u64,
    /// The installed checkpoint file.
    pub path: PathBuf,
    /// The state digest after the install (equal to the sender's at `source_ts`).
    pub digest: StateDigest,
}

/// The marker's contents: which checkpoint is the new state, and where the new WAL starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Marker {
    pub ckpt_ts: u64,
    pub first_seq: u64,
    pub start_lsn: u64,
    pub digest: StateDigest,
}

impl Marker {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(MARKER_BYTES);
        out.extend_from_slice(MARKER_MAGIC);
        out.put_u32(crate::FORMAT_VERSION);
        out.put_u32(0);
        out.put_u64(self.ckpt_ts);
        out.put_u64(self.first_seq);
        out.put_u64(self.start_lsn);
        out.extend_from_slice(&self.digest.0.to_le_bytes());
        out.resize(60, 0);
        let crc = crc32c::crc32c(&out);
        out.put_u32(crc);
        out
    }

    fn decode(bytes: &[u8], path: &Path) -> Result<Marker> {
        let bad = |offset: u64, why: &str| Error::corruption(path, offset, why);
        if bytes.len() != MARKER_BYTES || bytes.get(..8) != Some(&MARKER_MAGIC[..]) {
            return Err(bad(0, "install marker has the wrong size or magic"));
        }
        if crc32c::crc32c(bytes.get(..60).unwrap_or_default()) != le_u32(bytes, 60).unwrap_or(0) {
            return Err(bad(60, "install marker checksum mismatch"));
        }
        let version = le_u32(bytes, 8).unwrap_or(0);
        if version != crate::FORMAT_VERSION {
            return Err(Error::UnsupportedVersion {
                path: path.to_owned(),
                found: version,
                supported: crate::FORMAT_VERSION,
            });
        }
        let mut digest = [0u8; 16];
        digest.copy_from_slice(bytes.get(40..56).unwrap_or(&[0u8; 16]));
        Ok(Marker {
            ckpt_ts: le_u64(bytes, 16).unwrap_or(0),
            first_seq: le_u64(bytes, 24).unwrap_or(0),
            start_lsn: le_u64(bytes, 32).unwrap_or(0),
            digest: StateDigest(u128::from_le_bytes(digest)),
        })
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

fn before(error: Error) -> ReplaceError {
    ReplaceError { committed: false, error }
}

fn after(error: Error) -> ReplaceError {
    ReplaceError { committed: true, error }
}

/// Writes the marker: temporary file, fdatasync, rename, directory fsync. A failure counts as
/// committed once the rename was attempted (the marker may be, or become, durable).
fn write_marker(fs: &dyn FileSystem, dir: &Path, marker: &Marker) -> std::result::Result<(), ReplaceError> {
    let tmp = dir.join(tmp_name(INSTALL_MARKER));
    let b = |e| before(Error::io(&tmp, e));
    if fs.exists(&tmp).map_err(b)? {
        fs.remove_file(&tmp).map_err(b)?;
    }
    let file = fs.open(&tmp, OpenMode::CreateNew).map_err(b)?;
    write_all_at(file.as_ref(), &marker.encode(), 0).map_err(b)?;
    file.sync_data().map_err(b)?;
    let target = dir.join(INSTALL_MARKER);
    fs.rename(&tmp, &target).map_err(|e| after(Error::io(&target, e)))?;
    fs.sync_dir(dir).map_err(|e| after(Error::io(dir, e)))
}

/// Checks that a checkpoint file is complete and is the one the marker names.
fn verify_checkpoint(fs: &dyn FileSystem, path: &Path, marker: &Marker) -> Result<()> {
    let file = fs.open(path, OpenMode::Read).map_err(io(path))?;
    let summary = read_checkpoint_file(file.as_ref(), READ_WINDOW, &mut Discard)
        .map_err(io(path))?
        .map_err(|(off, why)| Error::corruption(path, off, why))?;
    if summary.ts != marker.ckpt_ts || summary.digest != marker.digest {
        return Err(Error::corruption(path, 0, "installed checkpoint differs from the one the install marker names"));
    }
    Ok(())
}

/// Makes the marker's checkpoint the whole durable state: renames it into place, deletes
/// every other checkpoint and every older WAL segment, creates the new WAL's first segment
/// (at `first_seq`, `start_lsn`, first timestamp `ckpt_ts + 1`), fsyncs the directory and
/// removes the marker. Idempotent: recovery runs it again after a crash at any point.
/// `verify` re-reads the checkpoint before anything is deleted (recovery does; the live
/// install has just written and synced it).
pub(crate) fn complete(fs: &Arc<dyn FileSystem>, dir: &Path, marker: &Marker, verify: bool) -> Result<PathBuf> {
    let marker_path = dir.join(INSTALL_MARKER);
    let first_ts = Some(marker.ckpt_ts)
        .filter(|&t| t <= MAX_TS)
        .map(|t| t + 1)
        .ok_or_else(|| Error::corruption(&marker_path, 16, "install timestamp out of range"))?;
    let target = dir.join(checkpoint_name(marker.ckpt_ts));
    let tmp = dir.join(tmp_name(&checkpoint_name(marker.ckpt_ts)));
    if fs.exists(&tmp).map_err(io(&tmp))? {
        if verify {
            verify_checkpoint(fs.as_ref(), &tmp, marker)?;
        }
        fs.rename(&tmp, &target).map_err(io(&target))?;
    } else if !fs.exists(&target).map_err(io(&target))? {
        return Err(Error::corruption(&marker_path, 0, "the installed checkpoint is missing"));
    } else if verify {
        verify_checkpoint(fs.as_ref(), &target, marker)?;
    }
    for name in fs.list_dir(dir).map_err(io(dir))? {
        let old_checkpoint = parse_checkpoint_name(&name).is_some_and(|ts| ts != marker.ckpt_ts);
        let old_segment = wal::parse_segment_name(&name).is_some_and(|seq| seq < marker.first_seq);
        if old_checkpoint || old_segment {
            let p = dir.join(&name);
            fs.remove_file(&p).map_err(io(&p))?;
        }
    }
    let segment = dir.join(wal::segment_name(marker.first_seq));
    if fs.exists(&segment).map_err(io(&segment))? {
        let bytes = fs.open(&segment, OpenMode::Read).and_then(|f| read_all(f.as_ref())).map_err(io(&segment))?;
        let expected = (marker.first_seq, marker.start_lsn, first_ts);
        let keep = wal::decode_segment_header(&bytes).is_ok_and(|h| (h.seq, h.start_lsn, h.first_ts) == expected);
        if !keep {
            // A creation the crash tore: nothing is written after its header while the marker
            // exists.
            fs.remove_file(&segment).map_err(io(&segment))?;
        }
    }
    if !fs.exists(&segment).map_err(io(&segment))? {
        drop(WalWriter::create(
            Arc::clone(fs),
            dir,
            marker.first_seq,
            marker.start_lsn,
            first_ts,
            Vec::new(),
            u64::MAX,
        )?);
    }
    fs.sync_dir(dir).map_err(io(dir))?;
    fs.remove_file(&marker_path).map_err(io(&marker_path))?;
    fs.sync_dir(dir).map_err(io(dir))?;
    Ok(target)
}

/// Called by recovery before anything else: finishes an install whose marker is durable, or
/// removes the temporary marker of one that never reached its commit point.
pub(crate) fn finish_pending(fs: &Arc<dyn FileSystem>, dir: &Path) -> Result<()> {
    let marker_path = dir.join(INSTALL_MARKER);
    if fs.exists(&marker_path).map_err(io(&marker_path))? {
        let bytes =
            fs.open(&marker_path, OpenMode::Read).and_then(|f| read_all(f.as_ref())).map_err(io(&marker_path))?;
        let marker = Marker::decode(&bytes, &marker_path)?;
        complete(fs, dir, &marker, true)?;
    }
    let tmp = dir.join(tmp_name(INSTALL_MARKER));
    if fs.exists(&tmp).map_err(io(&tmp))? {
        fs.remove_file(&tmp).map_err(io(&tmp))?;
        fs.sync_dir(dir).map_err(io(dir))?;
    }
    Ok(())
}

/// Writes the received tables as `checkpoint-ts.kc.tmp` with ids from `base` and the stream's
/// applied position, and fsyncs it. Returns the id after the last one used.
fn write_checkpoint(inner: &Inner, rx: &Received, ts: u64, base: u32) -> Result<u32> {
    let count = u32::try_from(rx.tables.len()).map_err(|_| Error::InvalidArgument("too many tables".into()))?;
    let next_id = base.checked_add(count).ok_or_else(|| Error::InvalidArgument("table ids exhausted".into()))?;
    let mut writer = CheckpointWriter::create(Arc::clone(&inner.fs), &inner.path, ts, next_id, rx.applied)?;
    // Tables first in the zip: the id range is never advanced past the last table.
    for (t, id) in rx.tables.iter().zip(base..) {
        writer.table(id, &t.name)?;
        for_each_entry(|range| t.data.scan_chunk(range, false, u64::MAX, 1024), |k, v| writer.entry(id, k, v))?;
    }
    if writer.digest() != rx.digest {
        return Err(Error::corruption(&inner.path, 0, "installed checkpoint digest differs from the stream's"));
    }
    writer.finish_unrenamed()?;
    Ok(next_id)
}

/// Steps 2 to 4 of the protocol: chooses the timestamp and ids, writes and syncs the
/// checkpoint, retires `CLOSED`, writes the marker (the commit point). Before the commit point
/// an error removes the temporary files (best effort; recovery removes them too).
fn prepare(inner: &Inner, q: &Quiesced, rx: &Received) -> std::result::Result<(Marker, u32), ReplaceError> {
    let ts = rx.source_ts.max(q.last_ts.saturating_add(1));
    if ts > MAX_INSTALL_TS {
        return Err(before(Error::InvalidArgument(format!("install timestamp {ts} is out of range"))));
    }
    let tmp = inner.path.join(tmp_name(&checkpoint_name(ts)));
    let cleanup = || {
        let _ = inner.fs.remove_file(&tmp);
        let _ = inner.fs.remove_file(&inner.path.join(tmp_name(INSTALL_MARKER)));
    };
    let marker = Marker { ckpt_ts: ts, first_seq: q.next_segment, start_lsn: q.wal_end_lsn, digest: rx.digest };
    let written = write_checkpoint(inner, rx, ts, q.next_table_id)
        .and_then(|next_id| crate::close_marker::retire(inner.fs.as_ref(), &inner.path).map(|_| next_id))
        .map_err(before)
        .and_then(|next_id| write_marker(inner.fs.as_ref(), &inner.path, &marker).map(|()| next_id));
    match written {
        Ok(next_id) => Ok((marker, next_id)),
        Err(e) => {
            if !e.committed {
                cleanup();
            }
            Err(e)
        }
    }
}

/// Installs a received state. See the module comment and `docs/design/recovery.md`.
pub(crate) fn install(inner: &Inner, rx: Received) -> Result<InstallInfo> {
    // No checkpoint runs meanwhile (it would seal segments and delete files under us).
    let mut retained = inner.checkpoint_lock.lock();
    inner.committer.check_writable()?;
    let (source_ts, applied, stream_bytes) = (rx.source_ts, rx.applied, rx.bytes);
    let (tables, entries, digest) = (rx.tables.len() as u64, rx.entries, rx.digest);
    let (ts, replaced_ts, path) = inner.committer.replace_state(|q| {
        let (marker, next_table_id) = prepare(inner, q, &rx)?;
        // Committed: from here a failure poisons the handle (memory keeps the old state) and
        // the next open finishes the install.
        let path = complete(&inner.fs, &inner.path, &marker, false).map_err(after)?;
        let wal = open_new_segment(inner, &marker).map_err(after)?;
        let tables = rx.tables.into_iter().zip(q.next_table_id..).map(|(t, id)| (id, t.name, t.data)).collect();
        let new = Replacement { ts: marker.ckpt_ts, wal, tables, next_table_id, digest, applied };
        Ok((new, (marker.ckpt_ts, q.last_ts, path)))
    })?;
    *retained = vec![(ts, path.clone())];
    inner.reset_id_block();
    Ok(InstallInfo { ts, source_ts, replaced_ts, applied, tables, entries, stream_bytes, path, digest })
}

/// A writer at the start of the new WAL's first segment, which `complete` created.
fn open_new_segment(inner: &Inner, marker: &Marker) -> Result<WalWriter> {
    let seg = inner.path.join(wal::segment_name(marker.first_seq));
    let file = inner.fs.open(&seg, OpenMode::ReadWrite).map_err(io(&seg))?;
    let info = SegmentInfo {
        seq: marker.first_seq,
        path: seg,
        start_lsn: marker.start_lsn,
        end_lsn: marker.start_lsn,
        last_ts: marker.ckpt_ts,
    };
    let segment_bytes_max = inner.options.wal_segment_bytes.max(4096);
    // `complete` created it with its header only; nothing has been written after it since.
    let allocated = wal::SEGMENT_HEADER_BYTES;
    Ok(WalWriter::resume(Arc::clone(&inner.fs), &inner.path, file, info, allocated, Vec::new(), segment_bytes_max))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_round_trips_and_rejects_every_flipped_bit() {
        let m = Marker { ckpt_ts: 77, first_seq: 5, start_lsn: 4096, digest: StateDigest(0x1234_5678_9abc) };
        let path = Path::new("INSTALL");
        let bytes = m.encode();
        assert_eq!(Marker::decode(&bytes, path).ok(), Some(m));
        for bit in 0..bytes.len() * 8 {
            let mut bad = bytes.clone();
            if let Some(b) = bad.get_mut(bit / 8) {
                *b ^= 1 << (bit % 8);
            }
            assert!(Marker::decode(&bad, path).is_err(), "bit {bit}");
        }
    }
}
