//! Installing a received checkpoint: an open handle replaces its whole state, on disk and in
//! memory, crash-safely.
//!
//! This module owns the `INSTALL` marker (its byte layout is in `docs/design/format.md`), the
//! on-disk switch from the old checkpoints and WAL to the new checkpoint and a fresh WAL
//! segment, the idempotent completion recovery runs when it finds the marker, and the
//! in-memory switch. The argument, crash point by crash point, is in
//! `docs/design/recovery.md` ("Checkpoint install"). It must not read the stream (that is
//! `checkpoint_stream.rs`) and must not leave the directory in a state that recovery would
//! open as a mix of old and new: the marker's durable rename is the one commit point.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use crate::checkpoint::{checkpoint_name, parse_checkpoint_name, read_checkpoint, CheckpointSink, CheckpointWriter};
use crate::checkpoint_stream::{for_each_entry, Received, ReceivedTable};
use crate::codec::{le_u32, le_u64, PutBytes};
use crate::db::{IdBlock, Inner};
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::fs::{read_all, write_all_at, FileSystem, OpenMode};
use crate::group_commit::CommitState;
use crate::index::{FastMap, Table};
use crate::recovery::StateBuilder;
use crate::wal::{self, SegmentInfo, WalWriter};

/// The marker that names an installed checkpoint until the install is complete.
pub(crate) const INSTALL_MARKER: &str = "INSTALL";
const INSTALL_MARKER_TMP: &str = "INSTALL.tmp";
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

/// Writes the marker: temporary file, fdatasync, rename, directory fsync. A failure is tagged
/// `true` once the rename was attempted (the marker may be durable: the install is committed)
/// and `false` before (nothing changed that recovery would honour).
fn write_marker(fs: &dyn FileSystem, dir: &Path, marker: &Marker) -> std::result::Result<(), (bool, Error)> {
    let tmp = dir.join(INSTALL_MARKER_TMP);
    let before = |e: Error| (false, e);
    if fs.exists(&tmp).map_err(io(&tmp)).map_err(before)? {
        fs.remove_file(&tmp).map_err(io(&tmp)).map_err(before)?;
    }
    let file = fs.open(&tmp, OpenMode::CreateNew).map_err(io(&tmp)).map_err(before)?;
    write_all_at(file.as_ref(), &marker.encode(), 0).map_err(io(&tmp)).map_err(before)?;
    file.sync_data().map_err(io(&tmp)).map_err(before)?;
    let target = dir.join(INSTALL_MARKER);
    // From the rename on, the marker may be (or become) durable: the install is committed.
    fs.rename(&tmp, &target).map_err(|e| (true, Error::io(&target, e)))?;
    fs.sync_dir(dir).map_err(|e| (true, Error::io(dir, e)))
}

/// Checks that a checkpoint file is complete and is the one the marker names.
fn verify_checkpoint(fs: &dyn FileSystem, path: &Path, marker: &Marker) -> Result<()> {
    struct Discard;
    impl CheckpointSink for Discard {
        fn table(&mut self, _: u32, _: &str) {}
        fn entry(&mut self, _: u32, _: &[u8], _: &[u8]) {}
    }
    let bytes = fs.open(path, OpenMode::Read).and_then(|f| read_all(f.as_ref())).map_err(io(path))?;
    let summary = read_checkpoint(&bytes, &mut Discard).map_err(|(off, why)| Error::corruption(path, off, why))?;
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
    let first_ts = marker
        .ckpt_ts
        .checked_add(1)
        .ok_or_else(|| Error::corruption(dir.join(INSTALL_MARKER), 16, "install timestamp out of range"))?;
    let target = dir.join(checkpoint_name(marker.ckpt_ts));
    let tmp = dir.join(format!("{}.tmp", checkpoint_name(marker.ckpt_ts)));
    if fs.exists(&tmp).map_err(io(&tmp))? {
        if verify {
            verify_checkpoint(fs.as_ref(), &tmp, marker)?;
        }
        fs.rename(&tmp, &target).map_err(io(&target))?;
    } else if !fs.exists(&target).map_err(io(&target))? {
        return Err(Error::corruption(dir.join(INSTALL_MARKER), 0, "the installed checkpoint is missing"));
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
            // A creation the crash tore: nothing was ever written after its header.
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
    let marker_path = dir.join(INSTALL_MARKER);
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
    let tmp = dir.join(INSTALL_MARKER_TMP);
    if fs.exists(&tmp).map_err(io(&tmp))? {
        fs.remove_file(&tmp).map_err(io(&tmp))?;
        fs.sync_dir(dir).map_err(io(dir))?;
    }
    Ok(())
}

/// Writes the received tables as `checkpoint-ts.kc.tmp` with ids from `base`, and fsyncs it.
/// Returns the id after the last one used.
fn write_checkpoint(inner: &Inner, rx: &Received, ts: u64, base: u32) -> Result<u32> {
    let count = u32::try_from(rx.tables.len()).map_err(|_| Error::InvalidArgument("too many tables".into()))?;
    let next_id = base.checked_add(count).ok_or_else(|| Error::InvalidArgument("table ids exhausted".into()))?;
    let mut writer = CheckpointWriter::create(Arc::clone(&inner.fs), &inner.path, ts, next_id)?;
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

/// Waits, holding the sequencer, until every sequenced commit has been published.
fn drain(inner: &Inner, cs: &CommitState) -> Result<()> {
    while inner.visible_ts.load(Ordering::Acquire) != cs.last_ts {
        inner.check_writable()?;
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok(())
}

/// What the install decided under the sequencer lock, before its commit point.
struct Plan {
    marker: Marker,
    replaced_ts: u64,
    /// The first new table id, and the one after the last.
    base: u32,
    next_id: u32,
}

/// Steps 1 to 3 of the protocol: chooses the timestamp and ids, writes and syncs the
/// checkpoint, writes the marker. On an error before the commit point the temporary files are
/// removed (best effort; recovery removes them too) and nothing else changed.
fn prepare(inner: &Inner, cs: &CommitState, rx: &Received) -> Result<Plan> {
    drain(inner, cs)?;
    let replaced_ts = cs.last_ts;
    let ts = rx.source_ts.max(replaced_ts + 1);
    let base = inner.catalog.read().all().iter().map(|t| t.id).max().unwrap_or(0).saturating_add(1);
    let (first_seq, start_lsn) = {
        let w = inner.wal.lock();
        (w.current().seq + 1, w.end_lsn())
    };
    let tmp = inner.path.join(format!("{}.tmp", checkpoint_name(ts)));
    let next_id = write_checkpoint(inner, rx, ts, base).inspect_err(|_| {
        let _ = inner.fs.remove_file(&tmp);
    })?;
    let marker = Marker { ckpt_ts: ts, first_seq, start_lsn, digest: rx.digest };
    if let Err((committed, e)) = write_marker(inner.fs.as_ref(), &inner.path, &marker) {
        if committed {
            inner.poison(format!("checkpoint install interrupted after its commit point ({e}); reopen to finish it"));
        } else {
            let _ = inner.fs.remove_file(&tmp);
            let _ = inner.fs.remove_file(&inner.path.join(INSTALL_MARKER_TMP));
        }
        return Err(e);
    }
    Ok(Plan { marker, replaced_ts, base, next_id })
}

/// Installs a received state. See the module comment and `docs/design/recovery.md`.
pub(crate) fn install(inner: &Inner, rx: Received) -> Result<InstallInfo> {
    // No checkpoint runs meanwhile, and no commit is sequenced until the switch is done.
    let mut retained = inner.checkpoint_lock.lock();
    inner.check_writable()?;
    let mut cs = inner.commit.lock();
    let Plan { marker, replaced_ts, base, next_id } = prepare(inner, &cs, &rx)?;
    let (ts, first_seq, start_lsn) = (marker.ckpt_ts, marker.first_seq, marker.start_lsn);
    // Committed: from here a failure leaves the old state in memory, refuses writes, and the
    // next open finishes the install.
    let finished = complete(&inner.fs, &inner.path, &marker, false).and_then(|path| {
        let seg = inner.path.join(wal::segment_name(first_seq));
        let file = inner.fs.open(&seg, OpenMode::ReadWrite).map_err(io(&seg))?;
        Ok((path, seg, file))
    });
    let (path, seg, file) = finished.inspect_err(|e| {
        inner.poison(format!("checkpoint install interrupted after its commit point ({e}); reopen to finish it"));
    })?;
    let info = SegmentInfo { seq: first_seq, path: seg, start_lsn, end_lsn: start_lsn, last_ts: ts };
    let segment_bytes_max = inner.options.wal_segment_bytes.max(4096);
    *inner.wal.lock() =
        WalWriter::resume(Arc::clone(&inner.fs), &inner.path, file, info, Vec::new(), segment_bytes_max);
    inner.durable_lsn.fetch_max(start_lsn, Ordering::AcqRel);
    let (tables, entries, stream_bytes, digest) = (rx.tables.len() as u64, rx.entries, rx.bytes, rx.digest);
    let live = switch_memory(inner, rx.tables, ts, base, digest);
    // Batch numbers continue: the publication queue counts them across the switch.
    let next_batch = cs.next_batch;
    *cs = CommitState::new(ts, start_lsn, &StateBuilder { live, next_table_id: next_id, ..StateBuilder::default() });
    cs.next_batch = next_batch;
    *retained = vec![(ts, path.clone())];
    inner.counters.wal_bytes_since_checkpoint.store(0, Ordering::Relaxed);
    *inner.ids.lock() = IdBlock::default();
    // Without old snapshots the old tables can go now (the background collector would free
    // them later, but a handle without background threads has no collector).
    let horizon = inner.registry.horizon(&inner.visible_ts);
    inner.catalog.write().collect(horizon);
    drop(cs);
    Ok(InstallInfo { ts, source_ts: rx.source_ts, replaced_ts, tables, entries, stream_bytes, path, digest })
}

/// Swaps the state readers see: the old tables end at `ts` (snapshots older than `ts` keep
/// reading them until they finish; the collector frees them after), the new ones begin at
/// `ts`, and the visible timestamp and digest move to the new state together.
fn switch_memory(
    inner: &Inner,
    tables: Vec<ReceivedTable>,
    ts: u64,
    base: u32,
    new_digest: StateDigest,
) -> FastMap<Arc<str>, u32> {
    let mut live = FastMap::default();
    let mut digest = inner.digest.lock();
    let mut catalog = inner.catalog.write();
    for old in catalog.live() {
        old.dropped_ts.store(ts, Ordering::Release);
    }
    for (t, id) in tables.into_iter().zip(base..) {
        live.insert(Arc::clone(&t.name), id);
        catalog.insert(Arc::new(Table {
            id,
            name: t.name,
            created_ts: ts,
            dropped_ts: AtomicU64::new(u64::MAX),
            data: RwLock::new(t.data),
        }));
    }
    inner.visible_ts.store(ts, Ordering::Release);
    *digest = new_digest;
    live
}
