//! Raft snapshot files: built, sent, received and installed as streams through KeelDB's
//! file-system seam, never held whole in memory.
//!
//! A snapshot file is immutable once written and lives in the state machine's `snap`
//! directory. `current` is the member's durable snapshot; every other file there is a
//! `*.tmp` being built (`build-N`), received from a leader (`recv-N`) or streamed to a
//! backup client (`backup-N`). A temporary file belongs to one [`SnapshotFile`] and is removed
//! when that is dropped (a failed build, a refused or abandoned transfer, a finished backup),
//! unless it was made `current` first; leftovers of a crash are removed at open.
//!
//! Layout: `KEELSNP2`, the engine's checkpoint stream, the bincode [`SnapshotMeta`], then
//! the meta's length and the checkpoint's length (u64 little-endian each). The metadata goes
//! last because it is read from the engine snapshot the export took, which is known only once
//! the export has run. Files of the earlier layout (meta length, meta, checkpoint) are still
//! read.

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use keeldb::fs::{read_exact_at, write_all_at, FileHandle, FileSystem, OpenMode};
use keeldb::Database;
use parking_lot::Mutex;

use crate::types::SnapshotMeta;

/// Bytes buffered per read or write of a snapshot file (and per peer chunk by default).
pub const IO_CHUNK: usize = 1 << 20;
const MAGIC: &[u8; 8] = b"KEELSNP2";
const TRAILER: u64 = 16;
/// Metadata is an applied log id and a membership; anything near this is not one.
const MAX_META: u64 = 16 << 20;
/// The durable snapshot's file name.
pub const CURRENT: &str = "current";

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("snapshot file: {}", what.into()))
}

fn le_u64(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(bytes.get(..8).unwrap_or(&[0; 8]));
    u64::from_le_bytes(b)
}

/// An open snapshot file: its handle, where the checkpoint stream lies in it, and, while it
/// is a temporary file, its path (removed on drop).
pub struct SnapshotFile {
    fs: Arc<dyn FileSystem>,
    file: Arc<dyn FileHandle>,
    len: u64,
    data_at: u64,
    data_len: u64,
    temp: Option<PathBuf>,
}

impl std::fmt::Debug for SnapshotFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SnapshotFile({} bytes, checkpoint {} at {}, temp {:?})",
            self.len, self.data_len, self.data_at, self.temp
        )
    }
}

impl Drop for SnapshotFile {
    fn drop(&mut self) {
        if let Some(path) = self.temp.take() {
            let _ = self.fs.remove_file(&path);
        }
    }
}

/// A byte range of an open file, read positionally in bounded pieces (cheap to clone into a
/// blocking task).
#[derive(Clone)]
pub struct Range {
    file: Arc<dyn FileHandle>,
    start: u64,
    end: u64,
}

impl Range {
    /// Bytes in the range.
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    /// Up to `max` bytes at `offset` into the range (fewer only at its end).
    pub fn read(&self, offset: u64, max: usize) -> io::Result<Vec<u8>> {
        let left = self.len().saturating_sub(offset);
        let n = usize::try_from(left).map_or(max, |l| l.min(max));
        let mut buf = vec![0u8; n];
        read_exact_at(&*self.file, &mut buf, self.start + offset)?;
        Ok(buf)
    }
}

/// `io::Read` over a [`Range`].
struct RangeReader {
    range: Range,
    at: u64,
}

impl Read for RangeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.range.end.saturating_sub(self.at);
        let n = usize::try_from(left).map_or(buf.len(), |l| l.min(buf.len()));
        let Some(buf) = buf.get_mut(..n) else { return Ok(0) };
        if buf.is_empty() {
            return Ok(0);
        }
        let got = self.range.file.read_at(buf, self.at)?;
        if got == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "snapshot file shorter than its length"));
        }
        self.at += got as u64;
        Ok(got)
    }
}

/// `io::Write` appending to a file handle through positional writes.
struct HandleWriter {
    file: Arc<dyn FileHandle>,
    at: u64,
}

impl Write for HandleWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        write_all_at(&*self.file, buf, self.at)?;
        self.at += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl SnapshotFile {
    /// The whole file's length (what travels to a peer).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file is empty (a transfer not yet begun).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole file, as it travels to a peer.
    pub fn whole(&self) -> Range {
        Range { file: Arc::clone(&self.file), start: 0, end: self.len }
    }

    /// The checkpoint stream inside the file.
    pub fn checkpoint(&self) -> Range {
        Range { file: Arc::clone(&self.file), start: self.data_at, end: self.data_at + self.data_len }
    }

    /// A buffered reader of the checkpoint stream ([`IO_CHUNK`] at a time).
    pub fn checkpoint_reader(&self) -> impl Read {
        BufReader::with_capacity(IO_CHUNK, RangeReader { range: self.checkpoint(), at: self.data_at })
    }

    /// Writes `data` at `offset` of a file being received.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        write_all_at(&*self.file, data, offset)?;
        self.len = self.len.max(offset + data.len() as u64);
        Ok(())
    }

    /// Reads the layout and metadata of the file's first `len` bytes (the whole file, once
    /// written or received). Anything that does not add up is `InvalidData`.
    pub fn parse(mut self) -> io::Result<(SnapshotMeta, SnapshotFile)> {
        let len = self.len;
        let mut head = [0u8; 8];
        if len < 8 {
            return Err(invalid(format!("{len} bytes is too short")));
        }
        read_exact_at(&*self.file, &mut head, 0)?;
        let (meta_at, meta_len, data_at, data_len) = if &head == MAGIC {
            if len < 8 + TRAILER {
                return Err(invalid(format!("{len} bytes is too short")));
            }
            let mut tail = [0u8; TRAILER as usize];
            read_exact_at(&*self.file, &mut tail, len - TRAILER)?;
            let (meta_len, data_len) = (le_u64(&tail), le_u64(tail.get(8..).unwrap_or_default()));
            let total = data_len.checked_add(meta_len).and_then(|n| n.checked_add(8 + TRAILER));
            if total != Some(len) {
                return Err(invalid(format!("lengths {data_len} + {meta_len} do not add up to {len} bytes")));
            }
            (8 + data_len, meta_len, 8, data_len)
        } else {
            // The earlier layout: meta length, meta, checkpoint.
            let meta_len = le_u64(&head);
            if meta_len > len - 8 {
                return Err(invalid(format!("metadata of {meta_len} bytes in {len} bytes")));
            }
            (8, meta_len, 8 + meta_len, len - 8 - meta_len)
        };
        if meta_len > MAX_META {
            return Err(invalid(format!("metadata of {meta_len} bytes")));
        }
        let mut meta_bytes = vec![0u8; meta_len as usize];
        read_exact_at(&*self.file, &mut meta_bytes, meta_at)?;
        let meta: SnapshotMeta =
            bincode::deserialize(&meta_bytes).map_err(|e| invalid(format!("undecodable metadata: {e}")))?;
        self.data_at = data_at;
        self.data_len = data_len;
        Ok((meta, self))
    }
}

/// The `snap` directory: where snapshot files are made, and which one is `current`.
pub struct Snapshots {
    fs: Arc<dyn FileSystem>,
    dir: PathBuf,
    seq: AtomicU64,
    /// The metadata of `current` (None: no snapshot yet). Held while `current` is replaced,
    /// so that a build and an install finishing together never put an older snapshot over a
    /// newer one.
    current: Mutex<Option<SnapshotMeta>>,
    /// `current`'s size in bytes (0: none), for the snapshot policy (`snapshot_due`).
    current_len: AtomicU64,
}

impl Snapshots {
    /// Opens `dir` (made if missing), removes temporary files a crash left, and reads
    /// `current`'s metadata.
    pub fn open(fs: Arc<dyn FileSystem>, dir: &Path) -> io::Result<Snapshots> {
        // Durably: `current` is what the purged log relies on after a power loss (D1).
        crate::files::create_dir_durably(fs.as_ref(), dir)?;
        for name in fs.list_dir(dir)? {
            if name.ends_with(".tmp") {
                fs.remove_file(&dir.join(name))?;
            }
        }
        let snaps = Snapshots {
            fs,
            dir: dir.to_path_buf(),
            seq: AtomicU64::new(0),
            current: Mutex::new(None),
            current_len: AtomicU64::new(0),
        };
        let current = snaps.current()?;
        snaps.current_len.store(current.as_ref().map_or(0, |(_, f)| f.len), Ordering::Relaxed);
        *snaps.current.lock() = current.map(|(m, _)| m);
        Ok(snaps)
    }

    /// The last log index `current` holds (None: there is none). Set as soon as a snapshot is
    /// made `current`, before an install has applied it.
    pub fn current_index(&self) -> Option<u64> {
        self.current.lock().as_ref().and_then(|m| m.last_log_id.map(|l| l.index))
    }

    /// The size of `current` in bytes (0: there is none).
    pub fn current_len(&self) -> u64 {
        self.current_len.load(Ordering::Relaxed)
    }

    /// The directory's path.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The durable snapshot, opened for reading, with its metadata.
    pub fn current(&self) -> io::Result<Option<(SnapshotMeta, SnapshotFile)>> {
        let file = match self.fs.open(&self.dir.join(CURRENT), OpenMode::Read) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let len = file.len()?;
        let snap = SnapshotFile { fs: Arc::clone(&self.fs), file, len, data_at: 0, data_len: 0, temp: None };
        snap.parse().map(Some)
    }

    /// A new, empty temporary file named after `what`.
    pub fn temp(&self, what: &str) -> io::Result<SnapshotFile> {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let path = self.dir.join(format!("{what}-{n}.tmp"));
        let file = self.fs.open(&path, OpenMode::CreateNew)?;
        Ok(SnapshotFile { fs: Arc::clone(&self.fs), file, len: 0, data_at: 0, data_len: 0, temp: Some(path) })
    }

    /// Exports a checkpoint of `db` straight into a new temporary file (through a buffered
    /// writer of [`IO_CHUNK`]), then appends the metadata `meta_of` reads at the exported
    /// snapshot's timestamp. Not synced and not `current` yet (see [`Snapshots::promote`]).
    pub fn export(
        &self,
        db: &Database,
        what: &str,
        meta_of: impl FnOnce(u64) -> io::Result<SnapshotMeta>,
    ) -> io::Result<(SnapshotMeta, SnapshotFile)> {
        let mut snap = self.temp(what)?;
        write_all_at(&*snap.file, MAGIC, 0)?;
        let mut out = BufWriter::with_capacity(IO_CHUNK, HandleWriter { file: Arc::clone(&snap.file), at: 8 });
        let info = db.export_checkpoint(&mut out).map_err(|e| io::Error::other(e.to_string()))?;
        out.flush()?;
        let data_len = out.get_ref().at - 8;
        drop(out);
        let meta = meta_of(info.ts)?;
        let meta_bytes = bincode::serialize(&meta).map_err(|e| io::Error::other(e.to_string()))?;
        let mut tail = meta_bytes;
        tail.extend_from_slice(&(tail.len() as u64).to_le_bytes());
        tail.extend_from_slice(&data_len.to_le_bytes());
        write_all_at(&*snap.file, &tail, 8 + data_len)?;
        snap.len = 8 + data_len + tail.len() as u64;
        snap.data_at = 8;
        snap.data_len = data_len;
        Ok((meta, snap))
    }

    /// Makes a temporary snapshot file durable as `current` (sync the file, rename, sync the
    /// directory), unless `current` is newer: then nothing changes and `false` is returned
    /// (the temporary file goes when `snap` is dropped). A file that is not temporary is
    /// already durable.
    pub fn promote(&self, snap: &mut SnapshotFile, meta: &SnapshotMeta) -> io::Result<bool> {
        let Some(temp) = snap.temp.clone() else { return Ok(true) };
        let mut current = self.current.lock();
        if current.as_ref().is_some_and(|c| c.last_log_id > meta.last_log_id) {
            return Ok(false);
        }
        snap.file.sync_data()?;
        self.fs.rename(&temp, &self.dir.join(CURRENT))?;
        snap.temp = None;
        self.fs.sync_dir(&self.dir)?;
        *current = Some(meta.clone());
        self.current_len.store(snap.len, Ordering::Relaxed);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::types::{LogId, StoredMembership};

    fn meta(index: u64) -> SnapshotMeta {
        let leader = openraft::impls::leader_id_adv::LeaderId { term: 1, node_id: 1 };
        let log_id = LogId::new(leader, index);
        SnapshotMeta { last_log_id: Some(log_id), last_membership: StoredMembership::default() }
    }

    fn store(dir: &Path, keys: usize) -> Database {
        let db = Database::open(dir, keeldb::Options::default()).unwrap();
        let mut txn = db.begin_write().unwrap();
        for k in 0..keys {
            txn.put("t", format!("k{k:06}").as_bytes(), &[7u8; 100]).unwrap();
        }
        txn.commit().unwrap();
        db
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> = keeldb::fs::StdFs.list_dir(dir).unwrap();
        n.sort();
        n
    }

    #[test]
    fn built_files_round_trip_and_an_older_one_never_replaces_current() {
        let tmp = tempfile::tempdir().unwrap();
        let db = store(&tmp.path().join("db"), 5000);
        let fs: Arc<dyn FileSystem> = Arc::new(keeldb::fs::StdFs);
        let snaps = Snapshots::open(Arc::clone(&fs), &tmp.path().join("snap")).unwrap();
        let (m5, mut five) = snaps.export(&db, "build", |_| Ok(meta(5))).unwrap();
        let (m3, mut three) = snaps.export(&db, "build", |_| Ok(meta(3))).unwrap();
        assert!(five.checkpoint().len() > IO_CHUNK as u64 / 4, "a stream of some size");
        assert!(snaps.promote(&mut five, &m5).unwrap());
        assert!(!snaps.promote(&mut three, &m3).unwrap(), "older than current");
        drop((five, three));
        assert_eq!(names(snaps.dir()), ["current"], "the refused temporary file is gone");
        let (read, file) = snaps.current().unwrap().unwrap();
        assert_eq!(read, m5);
        // The checkpoint installs into another store, read through the bounded reader.
        let other = Database::open(tmp.path().join("other"), keeldb::Options::default()).unwrap();
        let opts = keeldb::InstallOptions { expected_bytes: Some(file.checkpoint().len()), ..Default::default() };
        other.install_checkpoint_with(&mut file.checkpoint_reader(), opts).unwrap();
        assert_eq!(other.begin_read().unwrap().get("t", b"k004999").unwrap(), Some(vec![7u8; 100]));
        // A temporary file a crash left is removed at open.
        std::fs::write(snaps.dir().join("recv-9.tmp"), b"partial").unwrap();
        drop(snaps);
        let again = Snapshots::open(fs, &tmp.path().join("snap")).unwrap();
        assert_eq!(names(again.dir()), ["current"]);
    }

    #[test]
    fn damaged_layouts_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let db = store(&tmp.path().join("db"), 10);
        let snaps = Snapshots::open(Arc::new(keeldb::fs::StdFs), &tmp.path().join("snap")).unwrap();
        let (_, built) = snaps.export(&db, "build", |_| Ok(meta(1))).unwrap();
        let bytes = built.whole().read(0, usize::MAX >> 1).unwrap();
        let cases: Vec<Vec<u8>> = vec![
            Vec::new(),
            b"KEELSNP2".to_vec(),
            bytes[..bytes.len() - 1].to_vec(),
            [&bytes[..], b"x"].concat(),
            {
                let mut b = bytes.clone();
                let n = b.len();
                b[n - 16] ^= 0x40; // the meta length
                b
            },
            u64::MAX.to_le_bytes().to_vec(),
        ];
        for (i, case) in cases.iter().enumerate() {
            let mut f = snaps.temp("recv").unwrap();
            f.write_at(0, case).unwrap();
            assert!(f.parse().is_err(), "case {i} must be refused");
        }
        let mut f = snaps.temp("recv").unwrap();
        f.write_at(0, &bytes).unwrap();
        let (read, f) = f.parse().unwrap();
        assert_eq!(read, meta(1));
        let checkpoint = f.checkpoint().read(0, usize::MAX >> 1).unwrap();
        // A `current` of the earlier layout (meta length, meta, checkpoint) still reads.
        let meta_bytes = bincode::serialize(&meta(1)).unwrap();
        let old = [&(meta_bytes.len() as u64).to_le_bytes()[..], &meta_bytes, &checkpoint].concat();
        std::fs::write(snaps.dir().join(CURRENT), old).unwrap();
        let (read, f) = snaps.current().unwrap().unwrap();
        assert_eq!(read, meta(1));
        assert_eq!(f.checkpoint().read(0, usize::MAX >> 1).unwrap(), checkpoint);
    }
}
