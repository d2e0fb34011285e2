//! Recovery: from the files in a store directory to an in-memory state and a WAL writer.
//!
//! [`analyze`] is read-only: it loads the newest checkpoint that verifies (falling back to
//! older ones), scans and replays the WAL after it, and classifies any bad frame as a torn
//! tail (after every durable claim: legitimately unsynced, to be truncated) or corruption
//! (a typed error naming file and offset). [`recover`] runs it and then makes the changes:
//! truncates the torn tail, sets aside corrupt checkpoints, starts a fresh segment and appends
//! the report to the recovery log. `keel verify` uses [`analyze`] without the changes.
//! The case-by-case argument is in `docs/design/recovery.md`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::checkpoint::{
    parse_checkpoint_name, read_checkpoint_file, CheckpointSink, CheckpointSummary, Discard, READ_WINDOW,
};
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::fs::{read_all, write_all_at, FileSystem, OpenMode};
use crate::index::{Catalog, SortedLoad, Table};
use crate::wal::{
    self, decode_payload_into, decode_segment_header, parse_segment_name, scan_segment, Op, SegmentInfo, WalWriter,
};

// The poison marker: when present at open, recovery rewrites the WAL tail past both its LSN
// and every durable claim before syncing it, so only bytes whose durability was never
// confirmed are rewritten.
use crate::files::{CORRUPT_SUFFIX, POISON_MARKER, RECOVERY_LOG};

/// What recovery found and did when a store was opened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// The checkpoint loaded, if any (path and commit timestamp).
    pub checkpoint: Option<(PathBuf, u64)>,
    /// Checkpoints that failed verification and were skipped (path and reason).
    pub corrupt_checkpoints: Vec<(PathBuf, String)>,
    /// WAL segments read.
    pub segments_scanned: u64,
    /// Older WAL segments not read because the checkpoint holds all their commits (only their
    /// headers were checked).
    pub segments_covered: u64,
    /// Commit frames replayed on top of the checkpoint.
    pub frames_replayed: u64,
    /// Payload bytes replayed.
    pub bytes_replayed: u64,
    /// Bytes cut from a torn WAL tail (0 when the log ended cleanly).
    pub bytes_truncated: u64,
    /// Where the torn tail began, if there was one (file and offset).
    pub torn_tail: Option<(PathBuf, u64)>,
    /// Checksummed frames found after the tear; never acknowledged as durable, so discarded.
    pub discarded_frames: u64,
    /// Commits missing from the log that the loaded checkpoint holds (first and last ts): the
    /// gap a checkpoint ahead of the log left in stores written before 189d312 (see
    /// design/recovery.md, "A checkpoint ahead of the log"). Accepted, never replayed.
    pub gap_covered: Option<(u64, u64)>,
    /// Whether the log ended with a clean-close mark.
    pub clean_shutdown: bool,
    /// The last commit timestamp recovered.
    pub last_ts: u64,
    /// How long recovery took.
    pub duration: Duration,
}

impl std::fmt::Display for RecoveryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.checkpoint {
            Some((path, ts)) => writeln!(f, "checkpoint:        {} (ts {ts})", path.display())?,
            None => writeln!(f, "checkpoint:        none")?,
        }
        for (path, why) in &self.corrupt_checkpoints {
            writeln!(f, "skipped checkpoint: {} ({why})", path.display())?;
        }
        writeln!(
            f,
            "segments scanned:  {} ({} before the checkpoint, headers only)",
            self.segments_scanned, self.segments_covered
        )?;
        writeln!(f, "frames replayed:   {} ({} bytes)", self.frames_replayed, self.bytes_replayed)?;
        match &self.torn_tail {
            Some((path, off)) => writeln!(
                f,
                "torn tail:         {} at offset {off}: {} bytes truncated, {} unsynced frames discarded",
                path.display(),
                self.bytes_truncated,
                self.discarded_frames
            )?,
            None => writeln!(f, "torn tail:         none")?,
        }
        if let Some((first, last)) = self.gap_covered {
            writeln!(
                f,
                "log gap:           ts {first}..={last}, held by the checkpoint (a store written before 189d312)"
            )?;
        }
        writeln!(f, "clean shutdown:    {}", if self.clean_shutdown { "yes" } else { "no" })?;
        writeln!(f, "last commit ts:    {}", self.last_ts)?;
        write!(f, "duration:          {:.3} ms", self.duration.as_secs_f64() * 1e3)
    }
}

impl RecoveryReport {
    /// One JSON line for the recovery log.
    pub(crate) fn to_json_line(&self, unix_ms: u128) -> String {
        fn esc(s: &str) -> String {
            s.chars()
                .flat_map(|c| match c {
                    '"' => "\\\"".chars().collect::<Vec<_>>(),
                    '\\' => "\\\\".chars().collect(),
                    c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32).chars().collect(),
                    c => vec![c],
                })
                .collect()
        }
        let ckpt = self.checkpoint.as_ref().map_or("null".to_owned(), |(p, ts)| {
            format!("{{\"path\":\"{}\",\"ts\":{ts}}}", esc(&p.display().to_string()))
        });
        let torn = self.torn_tail.as_ref().map_or("null".to_owned(), |(p, off)| {
            format!("{{\"path\":\"{}\",\"offset\":{off}}}", esc(&p.display().to_string()))
        });
        let gap = self.gap_covered.map_or("null".to_owned(), |(a, b)| format!("[{a},{b}]"));
        let corrupt: Vec<String> = self
            .corrupt_checkpoints
            .iter()
            .map(|(p, why)| format!("{{\"path\":\"{}\",\"reason\":\"{}\"}}", esc(&p.display().to_string()), esc(why)))
            .collect();
        format!(
            "{{\"unix_ms\":{unix_ms},\"checkpoint\":{ckpt},\"corrupt_checkpoints\":[{}],\"segments_scanned\":{},\"segments_covered\":{},\"frames_replayed\":{},\"bytes_replayed\":{},\"bytes_truncated\":{},\"torn_tail\":{torn},\"discarded_frames\":{},\"gap_covered\":{gap},\"clean_shutdown\":{},\"last_ts\":{},\"duration_us\":{}}}\n",
            corrupt.join(","),
            self.segments_scanned,
            self.segments_covered,
            self.frames_replayed,
            self.bytes_replayed,
            self.bytes_truncated,
            self.discarded_frames,
            self.clean_shutdown,
            self.last_ts,
            self.duration.as_micros()
        )
    }
}

/// Builds an index from checkpoint records and WAL operations.
#[derive(Debug, Default)]
pub(crate) struct StateBuilder {
    pub catalog: Catalog,
    pub live: crate::types::FastMap<Arc<str>, u32>,
    pub next_table_id: u32,
    pub digest: StateDigest,
    /// The replicated-log position of the last applied command (checkpoint, then WAL).
    pub applied: Option<crate::types::LogPosition>,
    /// Between [`StateBuilder::defer_order`] and [`StateBuilder::finish_order`].
    deferring: bool,
    /// The loaded checkpoint's history floor (a version 2 checkpoint).
    pub checkpoint_floor: Option<u64>,
    /// Its history records, until [`StateBuilder::rebuild_history`] uses them.
    pub history_records: crate::history_persist::HistoryRecords,
    /// History kept through recovery (`Options::keep_history`): the floor, and the change feed
    /// rebuilt and replayed so far. `None`: the log is replayed without history.
    pub history: Option<crate::history_persist::Replayed>,
}

impl CheckpointSink for StateBuilder {
    fn table(&mut self, id: u32, name: &str) {
        let name: Arc<str> = Arc::from(name);
        self.catalog.insert(Arc::new(Table::new(id, Arc::clone(&name), 0)));
        self.live.insert(name, id);
        self.next_table_id = self.next_table_id.max(id + 1);
    }
    fn entry(&mut self, table_id: u32, key: &[u8], value: &[u8]) {
        if let Some(t) = self.catalog.by_id(table_id) {
            t.data.write().apply(&t.name, key, Some(value), 0, 0, &mut self.digest);
        }
    }
    fn history(&mut self, record: &crate::checkpoint::HistoryRecord<'_>) {
        self.history_records.push(record);
    }
}

impl StateBuilder {
    /// Defers every table's ordered set (see [`crate::index::TableData::defer_order`]) for a
    /// replay of the log, tables created by it included.
    pub fn defer_order(&mut self) {
        self.deferring = true;
        for t in self.catalog.all() {
            t.data.write().defer_order();
        }
    }

    /// Ends [`StateBuilder::defer_order`]: every table's ordered set is whole again.
    pub fn finish_order(&mut self) {
        self.deferring = false;
        for t in self.catalog.all() {
            t.data.write().finish_order();
        }
    }

    /// The horizon a write at `ts` prunes to: the history floor when history is kept.
    fn horizon(&self, ts: u64) -> u64 {
        self.history.as_ref().map_or(ts, |h| h.floor)
    }

    /// Applies one logged operation at `ts`. Errors describe a structurally impossible log.
    pub fn apply(&mut self, op: &Op<'_>, ts: u64) -> std::result::Result<(), &'static str> {
        let horizon = self.horizon(ts);
        match *op {
            Op::CreateTable { table, name } => {
                if self.live.contains_key(name) || self.catalog.by_id(table).is_some() {
                    return Err("creates a table that already exists");
                }
                let name: Arc<str> = Arc::from(name);
                let created = Arc::new(Table::new(table, Arc::clone(&name), ts));
                if self.deferring {
                    created.data.write().defer_order();
                }
                self.catalog.insert(created);
                self.live.insert(name, table);
                self.next_table_id = self.next_table_id.max(table + 1);
            }
            Op::DropTable { table } => {
                let t = self.catalog.by_id(table).ok_or("drops an unknown table")?;
                let mut digest = self.digest;
                t.data.read().for_each_live(|k, v| digest.remove(&t.name, k, v));
                self.digest = digest;
                self.live.remove(&t.name);
                t.dropped_ts.store(ts, std::sync::atomic::Ordering::Release);
                if let Some(h) = &mut self.history {
                    h.drop_table(ts, &t.name);
                }
                self.catalog.collect(horizon);
            }
            Op::Put { table, key, value } => {
                let t = self.catalog.by_id(table).ok_or("writes to an unknown table")?;
                t.data.write().apply(&t.name, key, Some(value), ts, horizon, &mut self.digest);
                if let Some(h) = &mut self.history {
                    h.write(ts, &t.name, key, Some(value));
                }
            }
            Op::Delete { table, key } => {
                let t = self.catalog.by_id(table).ok_or("deletes from an unknown table")?;
                t.data.write().apply(&t.name, key, None, ts, horizon, &mut self.digest);
                if let Some(h) = &mut self.history {
                    h.write(ts, &t.name, key, None);
                }
            }
        }
        Ok(())
    }
}

impl StateBuilder {
    /// Reads the home hash group of every key `ops` write, changing nothing: a replay
    /// calls it for a batch of frames before applying them, so that the cache misses of the
    /// batch's new keys overlap. A table's read lock is taken once per run of writes to it.
    pub fn touch_writes(&self, ops: &[Op<'_>]) {
        let mut writes = ops
            .iter()
            .filter_map(|op| match *op {
                Op::Put { table, key, .. } | Op::Delete { table, key } => Some((table, key)),
                _ => None,
            })
            .peekable();
        let mut touched = 0u8;
        while let Some((table, key)) = writes.next() {
            let Some(t) = self.catalog.by_id(table) else { continue };
            let data = t.data.read();
            touched ^= data.touch_key(key);
            while let Some((_, key)) = writes.next_if(|&(id, _)| id == table) {
                touched ^= data.touch_key(key);
            }
        }
        std::hint::black_box(touched);
    }

    /// Applies one commit's operations at `ts`, in order, with the same result as
    /// [`StateBuilder::apply`] on each. Two things differ, both for speed:
    /// - a table's write lock is held across consecutive writes to it. Taking and releasing it
    ///   are locked instructions, and each waited for every store still queued from the write
    ///   before (a new slot, a new value, a hash bucket: likely cache misses);
    /// - the digest entries of a run's new values are hashed before any of them is applied.
    ///   The hash reads back bytes it has just laid out on the stack, which cannot be forwarded
    ///   from the store queue and so waited for that same queue to drain.
    ///
    /// The digest is a sum, so adding entries earlier changes nothing. Nothing else can hold
    /// the lock during recovery.
    pub fn apply_all(&mut self, ops: &[Op<'_>], ts: u64) -> std::result::Result<(), &'static str> {
        let horizon = self.horizon(ts);
        let mut i = 0;
        while let Some(op) = ops.get(i) {
            let (Op::Put { table, .. } | Op::Delete { table, .. }) = *op else {
                self.apply(op, ts)?;
                i += 1;
                continue;
            };
            let Some(t) = self.catalog.by_id(table) else {
                // The same error, in the same words, as applying this operation alone.
                return self.apply(op, ts);
            };
            let run = ops.get(i..).unwrap_or_default();
            let run = run
                .iter()
                .position(|op| !matches!(*op, Op::Put { table: id, .. } | Op::Delete { table: id, .. } if id == table))
                .map_or(run, |end| run.get(..end).unwrap_or_default());
            for op in run {
                if let Op::Put { key, value, .. } = *op {
                    self.digest.add(&t.name, key, value);
                }
            }
            fn write<'a>(op: &Op<'a>) -> Option<(&'a [u8], Option<&'a [u8]>)> {
                match *op {
                    Op::Put { key, value, .. } => Some((key, Some(value))),
                    Op::Delete { key, .. } => Some((key, None)),
                    _ => None,
                }
            }
            let mut data = t.data.write();
            if run.len() >= crate::index::RUN_SORT_MIN {
                let writes: Vec<(&[u8], Option<&[u8]>)> = run.iter().filter_map(write).collect();
                data.apply_run(&t.name, &writes, ts, horizon, &mut self.digest, false);
            } else {
                for (key, value) in run.iter().filter_map(write) {
                    data.apply_with(&t.name, key, value, ts, horizon, &mut self.digest, false);
                }
            }
            if let Some(h) = &mut self.history {
                for (key, value) in run.iter().filter_map(write) {
                    h.write(ts, &t.name, key, value);
                }
            }
            i += run.len();
        }
        Ok(())
    }
}

/// Builds each table of a checkpoint with a [`SortedLoad`]. `failed` when the records were
/// not what a checkpoint writer produces (keys out of order, an entry before its table): the
/// caller then loads the general way, which verification decides on.
struct BulkLoad {
    state: StateBuilder,
    /// Entries of the one table of a single-table checkpoint (from its footer). With several
    /// tables each slab grows as it fills: counting first took a whole decode pass on the
    /// critical thread, and growing a large slab is an `mremap`, not a copy (measured no slower
    /// at 10M keys).
    single_table_entries: Option<usize>,
    loads: crate::types::FastMap<u32, SortedLoad>,
    failed: bool,
}

impl CheckpointSink for BulkLoad {
    fn table(&mut self, id: u32, name: &str) {
        if self.failed || self.loads.contains_key(&id) {
            self.failed = true;
            return;
        }
        self.state.table(id, name);
        let entries = self.single_table_entries.unwrap_or(0);
        self.loads.insert(id, SortedLoad::with_capacity(entries));
    }
    fn history(&mut self, record: &crate::checkpoint::HistoryRecord<'_>) {
        self.state.history(record);
    }
    fn entry(&mut self, table_id: u32, key: &[u8], value: &[u8]) {
        if self.failed {
            return;
        }
        match self.loads.get_mut(&table_id) {
            Some(load) => self.failed = load.push(key, value).is_err(),
            None => self.failed = true,
        }
    }
}

/// Finishes every table of `bulk`.
fn finish_load(bulk: BulkLoad) -> Option<StateBuilder> {
    for (id, load) in bulk.loads {
        let table = bulk.state.catalog.by_id(id)?;
        *table.data.write() = load.finish();
    }
    Some(bulk.state)
}

/// Windows read ahead of the verifier at most (each a buffer of about [`READ_WINDOW`]).
const WINDOWS_IN_FLIGHT: usize = 3;

/// A result whose error is a checkpoint's offset and reason.
type Checked<T> = std::result::Result<T, (u64, String)>;

/// Verifies a checkpoint file and builds the state it holds into `state` (empty on entry), a
/// window at a time. Two threads share the work: this one reads each window and builds each
/// table's slab from it (the ordered index comes free with the slab: see
/// [`SortedLoad::finish`]), then the hash tables; the other verifies the same windows (every
/// block's CRC, then the counts and the digest). What was built is kept only if verification
/// passes, so the outcome is [`crate::checkpoint::read_checkpoint`]'s on the file's bytes: the
/// same state, the same first error. At most [`WINDOWS_IN_FLIGHT`] + 1 windows are in memory at
/// once: reading a 1.3 GB checkpoint whole faulted in and zeroed as much fresh memory before
/// the state was built, and freed it after. Falls back to [`read_checkpoint_file`] alone when no verifier
/// thread runs to the end, or when the records are not in a checkpoint writer's order.
fn load_checkpoint_file(
    file: &dyn crate::fs::FileHandle,
    window: usize,
    state: &mut StateBuilder,
) -> std::io::Result<Checked<CheckpointSummary>> {
    use crate::checkpoint::{decode_block_unverified, for_each_block_in, BlockDecoder, Windows};
    use std::sync::mpsc;
    let mut windows = match Windows::open(file, window)? {
        Ok(w) => w,
        Err(e) => return Ok(Err(e)),
    };
    let (header, footer, footer_at) = (windows.header, windows.footer, windows.footer_at);
    let single_table_entries = (footer.tables == 1).then(|| usize::try_from(footer.entries).unwrap_or(0));
    let mut bulk =
        BulkLoad { state: StateBuilder::default(), single_table_entries, loads: Default::default(), failed: false };
    let (to_verifier, verifier_in) = mpsc::sync_channel::<(u64, usize, Arc<Vec<u8>>)>(WINDOWS_IN_FLIGHT);
    let (back, returned) = mpsc::channel::<Arc<Vec<u8>>>();
    let verify = move || {
        let mut decoder = BlockDecoder::for_header(&header);
        let mut verdict = Ok(());
        for (base, len, bytes) in verifier_in {
            if verdict.is_ok() {
                let blocks = bytes.get(..len).unwrap_or_default();
                verdict = for_each_block_in(base, blocks, |p, b, crc| decoder.block(p, b, crc, &mut Discard));
            }
            // The reader may be gone (an I/O error ended it): the buffer is then just freed.
            let _ = back.send(bytes);
        }
        (verdict, decoder)
    };
    let (read, verified) = std::thread::scope(|scope| {
        let Ok(verifier) =
            std::thread::Builder::new().name("keeldb-checkpoint-verify".into()).spawn_scoped(scope, verify)
        else {
            return (Ok(Ok(())), None);
        };
        let mut made = 0;
        let read = loop {
            let buf = match returned.try_recv() {
                Ok(b) => Arc::try_unwrap(b).unwrap_or_default(),
                Err(_) if made <= WINDOWS_IN_FLIGHT => {
                    made += 1;
                    Vec::new()
                }
                Err(_) => returned.recv().ok().and_then(|b| Arc::try_unwrap(b).ok()).unwrap_or_default(),
            };
            let mut buf = buf;
            let (base, len) = match windows.next_into(&mut buf) {
                Ok(Some(Ok(w))) => w,
                Ok(Some(Err(e))) => break Ok(Err(e)),
                Ok(None) => break Ok(Ok(())),
                Err(e) => break Err(e),
            };
            let shared = Arc::new(buf);
            if to_verifier.send((base, len, Arc::clone(&shared))).is_err() {
                break Ok(Ok(())); // the verifier is gone: its join below says so
            }
            if !bulk.failed {
                let blocks = shared.get(..len).unwrap_or_default();
                let built = for_each_block_in(base, blocks, |p, b, _| decode_block_unverified(p, b, &mut bulk));
                bulk.failed |= built.is_err();
            }
        };
        drop(to_verifier);
        if read.is_ok() && !bulk.failed {
            // While the verifier finishes the last windows.
            for load in bulk.loads.values_mut() {
                load.build_index();
            }
        }
        (read, verifier.join().ok())
    });
    let structure = read?;
    let Some((blocks, decoder)) = verified else {
        // No verifier ran to the end (none started, or it panicked): it decided nothing.
        return read_checkpoint_file(file, window, state);
    };
    // The first error in file order: a block the verifier refused lies before any structural
    // error the reader met, which it found only after handing out every block before it.
    let summary = match blocks.and(structure).and_then(|()| decoder.summary(&header, &footer, footer_at)) {
        Ok(summary) => summary,
        Err(e) => return Ok(Err(e)),
    };
    if !bulk.failed {
        if let Some(mut built) = finish_load(bulk) {
            built.digest = summary.digest;
            *state = built;
            return Ok(Ok(summary));
        }
    }
    // Records not in a checkpoint writer's order: verified, so built the general way.
    read_checkpoint_file(file, window, state)
}

/// The torn tail that [`recover`] cuts off.
#[derive(Debug, Clone)]
pub(crate) struct Tear {
    pub path: PathBuf,
    /// The segment's header itself was torn (a crash while it was being created).
    pub whole_segment: bool,
}

/// The read-only result of analysing a store.
#[derive(Debug)]
pub(crate) struct Analysis {
    pub state: StateBuilder,
    pub last_ts: u64,
    pub segments: Vec<SegmentInfo>,
    pub end_lsn: u64,
    pub tear: Option<Tear>,
    pub checkpoints: Vec<(u64, PathBuf)>,
    pub corrupt_checkpoints: Vec<PathBuf>,
    pub mark_digest: Option<u128>,
    /// The largest durable claim found in the log (every frame byte before it was synced).
    pub max_claim: u64,
    /// Zero bytes after the newest segment's last frame, when that is how the file ends
    /// (preallocated space the writer may keep; 0 after a tear).
    pub zero_tail: u64,
    pub report: RecoveryReport,
}

fn list_sorted<T: Ord + Copy>(names: &[String], parse: impl Fn(&str) -> Option<T>) -> Vec<(T, String)> {
    let mut out: Vec<(T, String)> = names.iter().filter_map(|n| parse(n).map(|v| (v, n.clone()))).collect();
    out.sort_by_key(|(v, _)| *v);
    out
}

/// The loaded state and its timestamp, the valid checkpoints (timestamp, path) and the corrupt ones.
type LoadedCheckpoint = (StateBuilder, u64, Vec<(u64, PathBuf)>, Vec<PathBuf>);

/// Loads the newest checkpoint that verifies. Returns it (or an empty state) and the skipped ones.
fn load_checkpoint(
    fs: &dyn FileSystem,
    dir: &Path,
    names: &[String],
    report: &mut RecoveryReport,
) -> Result<LoadedCheckpoint> {
    let mut valid = Vec::new();
    let mut corrupt = Vec::new();
    let mut chosen: Option<(StateBuilder, u64)> = None;
    for (ts, name) in list_sorted(names, parse_checkpoint_name).into_iter().rev() {
        let path = dir.join(&name);
        if chosen.is_some() {
            // Older checkpoints are kept as fallbacks, not read (full verify checks them).
            valid.push((ts, path));
            continue;
        }
        let file = fs.open(&path, OpenMode::Read).map_err(|e| Error::io(&path, e))?;
        refuse_newer_version(file.as_ref(), &path)?;
        let mut state = StateBuilder::default();
        let loaded = load_checkpoint_file(file.as_ref(), READ_WINDOW, &mut state).map_err(|e| Error::io(&path, e))?;
        match loaded {
            Ok(summary) if summary.ts == ts => {
                state.next_table_id = state.next_table_id.max(summary.next_table_id);
                state.applied = summary.applied;
                state.checkpoint_floor = summary.history_floor;
                report.checkpoint = Some((path.clone(), ts));
                valid.push((ts, path));
                chosen = Some((state, ts));
            }
            Ok(_) => {
                report.corrupt_checkpoints.push((path.clone(), "timestamp differs from file name".into()));
                corrupt.push(path);
            }
            Err((offset, reason)) => {
                report.corrupt_checkpoints.push((path.clone(), format!("{reason} at offset {offset}")));
                corrupt.push(path);
            }
        }
    }
    valid.sort_by_key(|(ts, _)| *ts);
    let (state, ts) = chosen.unwrap_or_default();
    Ok((state, ts, valid, corrupt))
}

/// A checkpoint of a newer format than this build reads is not damage to set aside (that
/// would throw its state away and open an older one): the open is refused.
fn refuse_newer_version(file: &dyn crate::fs::FileHandle, path: &Path) -> Result<()> {
    let mut header = [0u8; crate::checkpoint::HEADER_BYTES];
    if file.len().map_err(|e| Error::io(path, e))? < header.len() as u64 {
        return Ok(()); // too short to be anything but damage: the reader reports it
    }
    crate::fs::read_exact_at(file, &mut header, 0).map_err(|e| Error::io(path, e))?;
    match crate::checkpoint::unsupported_version(&header) {
        Some(found) => Err(Error::UnsupportedVersion {
            path: path.to_owned(),
            found,
            supported: crate::checkpoint::VERSION_HISTORY,
        }),
        None => Ok(()),
    }
}

/// How much of the WAL [`analyze`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scan {
    /// Every frame of every segment (verify): damage anywhere is reported.
    Everything,
    /// Open: a segment whose every commit the loaded checkpoint already holds is not read;
    /// only its header, and the next segment's, are checked (see [`covered_segment`]).
    AfterCheckpoint,
}

/// A sealed segment all of whose commits are at or below `ckpt_ts`, described from its own
/// header and the next segment's, without reading its frames. Segments are sealed (synced)
/// before the next one is created, and the next one's header records where the log went on:
/// its start LSN is this one's end, and its first timestamp is one past this one's last
/// commit. So if that first timestamp is at most `ckpt_ts + 1`, nothing in this segment is
/// needed. `None` whenever anything does not fit (a header that does not decode, a gap, a
/// start that does not continue `prev_end`, a first timestamp other than `expect_ts` when it is
/// known): the caller then reads the segment whole, and reports exactly what a full scan finds.
/// Damage inside the frames of a covered segment is left to `keel verify`, as it is in the
/// older checkpoints open does not read.
fn covered_segment(
    fs: &dyn FileSystem,
    path: &Path,
    seq: u64,
    next: &Path,
    prev_end: Option<u64>,
    expect_ts: u64,
    ckpt_ts: u64,
) -> Option<SegmentInfo> {
    let header_of = |p: &Path| -> Option<(wal::SegmentHeader, u64)> {
        let file = fs.open(p, OpenMode::Read).ok()?;
        let mut head = [0u8; wal::SEGMENT_HEADER_BYTES as usize];
        crate::fs::read_exact_at(file.as_ref(), &mut head, 0).ok()?;
        Some((decode_segment_header(&head).ok()?, file.len().ok()?))
    };
    let (header, len) = header_of(path)?;
    let (after, _) = header_of(next)?;
    let fits = header.version == crate::FORMAT_VERSION
        && after.version == crate::FORMAT_VERSION
        && header.seq == seq
        && after.seq == seq + 1
        && prev_end.is_none_or(|end| end == header.start_lsn)
        && (expect_ts == 0 || header.first_ts == expect_ts)
        && (prev_end.is_some() || header.first_ts <= ckpt_ts + 1)
        && after.first_ts >= header.first_ts
        && after.first_ts <= ckpt_ts + 1
        && after.start_lsn >= header.start_lsn
        && after.start_lsn - header.start_lsn <= len.saturating_sub(wal::SEGMENT_HEADER_BYTES);
    fits.then(|| SegmentInfo {
        seq,
        path: path.to_owned(),
        start_lsn: header.start_lsn,
        end_lsn: after.start_lsn,
        last_ts: after.first_ts - 1,
    })
}

/// Whether a log that expects commit `next` may go on at `ts` instead: only when the gap lies
/// wholly inside the loaded checkpoint (`next <= ckpt_ts`) and the log resumes right after it.
///
/// Before 189d312, `checkpoint` could write a checkpoint at ts C while the frames of its last
/// relaxed commits were still only in the page cache (design/recovery.md, "A checkpoint ahead
/// of the log"). After a power loss the log ended at some E < C; the open then started the
/// sequencer at C, and the next commit's frame (C + 1) followed frame E. The state is whole (the
/// checkpoint holds every commit up to C), but the open after that refused the store at the gap.
/// The jump is accepted only onto C + 1 of the checkpoint being loaded: if that checkpoint is
/// found corrupt and an older one is loaded instead, the gap is real loss and stays an error.
fn gap_covered_by_checkpoint(next: u64, ts: u64, ckpt_ts: u64) -> bool {
    next <= ckpt_ts && ts == ckpt_ts + 1
}

/// Frames a replay takes from a segment at a time: decoded together, their keys' hash groups
/// read together, then applied one by one.
const REPLAY_BATCH: usize = 16;

/// Reads a store directory into memory without changing any file.
pub(crate) fn analyze(fs: &dyn FileSystem, dir: &Path, scan: Scan) -> Result<Analysis> {
    analyze_keeping(fs, dir, scan, HistoryMode::Drop)
}

/// What [`analyze_keeping`] does with the history a checkpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HistoryMode {
    /// Verified by the reader and dropped (open without `keep_history`).
    Drop,
    /// Rebuilt, so that records which do not lead back to the checkpoint's state are reported,
    /// then dropped: the log replays without history (`keel verify`).
    Check,
    /// Rebuilt, and the log's replay records its own (open with `keep_history`).
    Keep,
}

/// [`analyze`], with the checkpoint's history handled as `history` says (see
/// `history_persist.rs`).
pub(crate) fn analyze_keeping(fs: &dyn FileSystem, dir: &Path, scan: Scan, history: HistoryMode) -> Result<Analysis> {
    let started = Instant::now();
    let names = fs.list_dir(dir).map_err(|e| Error::io(dir, e))?;
    if names.iter().any(|n| n == crate::files::INSTALL_MARKER) {
        // The files are half old, half new by design until open finishes the install.
        return Err(Error::InvalidArgument(format!(
            "{} holds an unfinished checkpoint install; open the store to finish it",
            dir.display()
        )));
    }
    let mut report = RecoveryReport::default();
    let (mut state, ckpt_ts, checkpoints, corrupt_checkpoints) = load_checkpoint(fs, dir, &names, &mut report)?;
    state.defer_order();
    match (history, state.checkpoint_floor) {
        (HistoryMode::Drop, _) | (HistoryMode::Check, None) => state.history_records = Default::default(),
        (HistoryMode::Keep, None) => state.keep_history_from(ckpt_ts),
        (HistoryMode::Keep | HistoryMode::Check, Some(floor)) => {
            let path = report.checkpoint.as_ref().map_or_else(|| dir.to_owned(), |(p, _)| p.clone());
            state.rebuild_history(floor).map_err(|why| Error::corruption(path, 0, why))?;
            if history == HistoryMode::Check {
                state.history = None;
            }
        }
    }

    let segment_names = list_sorted(&names, parse_segment_name);
    let mut segments: Vec<SegmentInfo> = Vec::new();
    let mut last_ts = ckpt_ts;
    let mut expected_ts: Option<u64> = None; // next commit ts the log must carry
    let mut end_lsn = 0u64;
    // A clean close claims every WAL byte before its marker's LSN durable.
    let marker = crate::close_marker::read(fs, dir)?;
    let mut max_claim = marker.map_or(0, |m| m.end_lsn);
    let mut tear = None;
    let mut mark_digest = None;
    let mut zero_tail = 0;
    let count = segment_names.len();
    let mut segment_buf = Vec::new();
    let mut windows = wal::WindowPool::new();

    for (i, (seq, name)) in segment_names.iter().enumerate() {
        let seq = *seq;
        let path = dir.join(name);
        let is_last = i + 1 == count;
        if scan == Scan::AfterCheckpoint && ckpt_ts > 0 {
            let next = segment_names.get(i + 1).map(|(_, n)| dir.join(n));
            let prev = segments.last().map(|s| s.end_lsn);
            let expect = expected_ts.unwrap_or(0);
            if let Some(info) = next.and_then(|next| covered_segment(fs, &path, seq, &next, prev, expect, ckpt_ts)) {
                if prev.is_some() {
                    max_claim = max_claim.max(info.start_lsn);
                }
                expected_ts = Some(info.last_ts + 1);
                end_lsn = info.end_lsn;
                // A clean-close mark in a skipped segment is followed by a later segment: the
                // close it recorded was not the last thing to happen to the store.
                mark_digest = None;
                report.segments_covered += 1;
                segments.push(info);
                continue;
            }
        }
        let file = fs.open(&path, OpenMode::Read).map_err(|e| Error::io(&path, e))?;
        let mut frames = wal::SegmentFrames::open(file, &mut segment_buf, &mut windows, wal::SEGMENT_WINDOW)
            .map_err(|e| Error::io(&path, e))?;
        report.segments_scanned += 1;
        let header = match decode_segment_header(frames.window()) {
            Ok(h) => h,
            Err(reason) => {
                let bytes = frames.whole().map_err(|e| Error::io(&path, e))?;
                // A crash while creating the newest segment can tear its header; no frame is
                // written to a segment before its header is durable, so it must hold none.
                // Any whole frame anywhere in it (not only in its valid prefix) proves the
                // header was durable once: then the damage is corruption, not a torn creation.
                let no_frames = i > 0 && {
                    let scan = scan_segment(bytes, end_lsn);
                    scan.frames.is_empty() && scan.later_valid_frames == 0
                };
                if is_last && (bytes.len() as u64 <= wal::SEGMENT_HEADER_BYTES || no_frames) {
                    report.torn_tail = Some((path.clone(), 0));
                    report.bytes_truncated = bytes.len() as u64;
                    tear = Some(Tear { path, whole_segment: true });
                    break;
                }
                return Err(Error::corruption(&path, 0, reason));
            }
        };
        if header.version != crate::FORMAT_VERSION {
            return Err(Error::UnsupportedVersion { path, found: header.version, supported: crate::FORMAT_VERSION });
        }
        if header.seq != seq {
            return Err(Error::corruption(&path, 16, "segment sequence number differs from its file name"));
        }
        if let Some(prev) = segments.last() {
            if seq != prev.seq + 1 {
                return Err(Error::corruption(&path, 0, format!("WAL segment {} is missing", prev.seq + 1)));
            }
            if header.start_lsn != prev.end_lsn {
                return Err(Error::corruption(&path, 24, "segment does not continue where the previous one ended"));
            }
            // Segments are sealed with an fdatasync before the next is created.
            max_claim = max_claim.max(header.start_lsn);
        }
        let mut expect = *expected_ts.get_or_insert(header.first_ts);
        if header.first_ts != expect && gap_covered_by_checkpoint(expect, header.first_ts, ckpt_ts) {
            report.gap_covered = Some((expect, ckpt_ts));
            expect = header.first_ts;
            expected_ts = Some(expect);
        }
        if header.first_ts != expect {
            return Err(Error::corruption(
                &path,
                32,
                format!("segment starts at ts {} but ts {expect} was expected", header.first_ts),
            ));
        }
        if i == 0 && header.first_ts > ckpt_ts + 1 {
            return Err(Error::corruption(
                &path,
                32,
                format!(
                    "the WAL needed after checkpoint ts {ckpt_ts} is gone (oldest segment starts at ts {})",
                    header.first_ts
                ),
            ));
        }

        // Frames are decoded and applied in batches right after their checks, while their bytes
        // are cached (design/recovery.md, "Reading the WAL in windows"). A bad frame ends the
        // prefix; what follows it is judged below, after the prefix was applied (if that
        // judgement is corruption, the whole state is discarded with the error).
        frames.start(header.start_lsn);
        let mut seg_last_ts = header.first_ts.saturating_sub(1);
        loop {
            let batch = frames.next_batch(REPLAY_BATCH).map_err(|e| Error::io(&path, e))?;
            if batch.is_empty() {
                break;
            }
            // The batch's operations in one list (a frame that does not decode adds none).
            let mut ops = Vec::with_capacity(batch.len());
            let heads: Vec<_> = batch.iter().map(|frame| decode_payload_into(frame.payload, &mut ops)).collect();
            // The batch's keys' hash groups are read first, so that their cache misses overlap
            // (one per new key, most of a replay's time) instead of each apply waiting on its own.
            state.touch_writes(&ops);
            for (frame, head) in batch.iter().zip(heads) {
                max_claim = max_claim.max(frame.header.durable_lsn);
                let rec = head.map_err(|e| {
                    Error::corruption(&path, frame.offset, format!("checksummed frame does not decode: {e}"))
                })?;
                let rec_ops = ops.get(rec.ops.clone()).unwrap_or_default();
                let ts = frame.header.ts;
                if ts > crate::index::MAX_TS {
                    return Err(Error::corruption(
                        &path,
                        frame.offset,
                        format!("commit ts {ts} above the largest a store uses"),
                    ));
                }
                let next = expected_ts.unwrap_or(1);
                if rec.kind == wal::KIND_MARK {
                    if ts + 1 != next {
                        return Err(Error::corruption(&path, frame.offset, "mark frame out of sequence"));
                    }
                    mark_digest = rec.digest;
                    continue;
                }
                if ts != next && gap_covered_by_checkpoint(next, ts, ckpt_ts) {
                    report.gap_covered = Some((next, ckpt_ts));
                } else if ts != next {
                    return Err(Error::corruption(
                        &path,
                        frame.offset,
                        format!("commit ts {ts} where {next} was expected"),
                    ));
                }
                expected_ts = Some(ts + 1);
                seg_last_ts = ts;
                mark_digest = None;
                if ts > ckpt_ts {
                    state.apply_all(rec_ops, ts).map_err(|why| Error::corruption(&path, frame.offset, why))?;
                    if rec.position.is_some() {
                        state.applied = rec.position;
                    }
                    report.frames_replayed += 1;
                    report.bytes_replayed += frame.payload.len() as u64;
                    last_ts = ts;
                }
            }
        }
        let segment_len = frames.len();
        let scan = frames.finish().map_err(|e| Error::io(&path, e))?;
        let seg_end_lsn = header.start_lsn + (scan.valid_end - wal::SEGMENT_HEADER_BYTES);
        // Zeros after the frames end the segment (preallocated space). In a sealed segment the
        // next one's start LSN, checked below, proves no frame was lost to them.
        zero_tail = scan.zero_tail;
        if let Some(bad) = &scan.bad {
            let claim = max_claim.max(scan.later_max_durable_lsn);
            if !is_last || bad.lsn < claim {
                return Err(Error::corruption(
                    &path,
                    bad.offset,
                    format!("{} in a part of the log that was already durable", bad.reason),
                ));
            }
            report.torn_tail = Some((path.clone(), bad.offset));
            report.bytes_truncated = segment_len.saturating_sub(scan.valid_end);
            report.discarded_frames = scan.later_valid_frames;
            tear = Some(Tear { path: path.clone(), whole_segment: false });
        }
        end_lsn = seg_end_lsn;
        segments.push(SegmentInfo {
            seq,
            path,
            start_lsn: header.start_lsn,
            end_lsn: seg_end_lsn,
            last_ts: seg_last_ts,
        });
    }
    if let Some(m) = marker {
        if end_lsn < m.end_lsn || last_ts.max(ckpt_ts) < m.last_ts {
            return Err(Error::corruption(
                dir.join(crate::close_marker::CLOSE_MARKER),
                0,
                format!(
                    "the WAL ends at LSN {end_lsn} (ts {}) but a clean close made it durable up to LSN {} (ts {})",
                    last_ts.max(ckpt_ts),
                    m.end_lsn,
                    m.last_ts
                ),
            ));
        }
    }
    if let Some(m) = marker.filter(|m| m.last_ts == last_ts.max(ckpt_ts)) {
        if m.digest != state.digest.0 {
            return Err(Error::corruption(
                dir.join(crate::close_marker::CLOSE_MARKER),
                0,
                format!("state digest after replay {} differs from the one recorded at close", state.digest),
            ));
        }
    }
    if segments.is_empty() && ckpt_ts > 0 {
        // Every segment is gone; the checkpoint alone is a consistent state only if nothing
        // followed it, which cannot be known. Refuse rather than silently lose commits.
        return Err(Error::corruption(dir, 0, "no WAL segments found next to the checkpoint"));
    }
    if let Some(expect) = expected_ts {
        if expect <= ckpt_ts {
            // The log ends before the checkpoint: fine, the checkpoint covers it.
            last_ts = last_ts.max(ckpt_ts);
        }
    }
    report.clean_shutdown = mark_digest.is_some() && tear.is_none();
    if tear.is_some() {
        zero_tail = 0;
    }
    state.finish_order();
    report.last_ts = last_ts;
    report.duration = started.elapsed();
    Ok(Analysis {
        state,
        last_ts,
        segments,
        end_lsn,
        tear,
        checkpoints,
        corrupt_checkpoints,
        mark_digest,
        max_claim,
        zero_tail,
        report,
    })
}

/// Everything [`recover`] hands to the database.
pub(crate) struct Recovered {
    pub state: StateBuilder,
    pub last_ts: u64,
    pub wal: WalWriter,
    pub checkpoints: Vec<(u64, PathBuf)>,
    pub report: RecoveryReport,
}

/// Recovers a store: analyses it, checks the clean-close digest, truncates a torn tail, sets
/// aside corrupt checkpoints, starts a new WAL segment and logs the report.
pub(crate) fn recover(
    fs: &Arc<dyn FileSystem>,
    dir: &Path,
    segment_bytes_max: u64,
    keep_history: bool,
) -> Result<Recovered> {
    let started = Instant::now();
    // An install whose marker is durable is finished first, so the analysis sees only the new
    // state; one that never reached its marker left only temporary files (removed below).
    crate::install::finish_pending(fs, dir)?;
    start_newest_segment_writeback(fs.as_ref(), dir);
    let history = if keep_history { HistoryMode::Keep } else { HistoryMode::Drop };
    let mut a = analyze_keeping(fs.as_ref(), dir, Scan::AfterCheckpoint, history)?;
    if let Some(mark) = a.mark_digest {
        if a.tear.is_none() && mark != a.state.digest.0 {
            let path = a.segments.last().map_or_else(|| dir.to_owned(), |s| s.path.clone());
            return Err(Error::corruption(path, 0, "state digest after replay differs from the one recorded at close"));
        }
    }
    // From here on the directory changes; every step is safe to redo after a crash.
    // A torn newest segment is cut to its valid frames below, when it is resumed.
    if let Some(tear) = &a.tear {
        if tear.whole_segment {
            fs.remove_file(&tear.path).map_err(|e| Error::io(&tear.path, e))?;
            fs.sync_dir(dir).map_err(|e| Error::io(dir, e))?;
        }
    }
    for path in &a.corrupt_checkpoints {
        let mut aside = path.clone().into_os_string();
        aside.push(CORRUPT_SUFFIX);
        fs.rename(path, Path::new(&aside)).map_err(|e| Error::io(path, e))?;
    }
    for name in fs.list_dir(dir).map_err(|e| Error::io(dir, e))? {
        if crate::files::is_checkpoint_tmp(&name) {
            let p = dir.join(&name);
            fs.remove_file(&p).map_err(|e| Error::io(&p, e))?;
        }
    }
    fs.sync_dir(dir).map_err(|e| Error::io(dir, e))?;

    // Resume the newest segment. It is fdatasynced first even when it ended cleanly: after a
    // process crash its tail may sit only in the page cache, and the frames written from now
    // on claim everything before them durable. Without this sync a power loss could keep a
    // later sync commit and lose an earlier replayed one, breaking the prefix guarantee.
    let mut sealed = a.segments.clone();
    let wal = match sealed.pop() {
        Some(last) => {
            let file = fs.open(&last.path, OpenMode::ReadWrite).map_err(|e| Error::io(&last.path, e))?;
            let valid_len = wal::SEGMENT_HEADER_BYTES + (last.end_lsn - last.start_lsn);
            // Only after a failed fsync can the page cache hold WAL bytes the disk never got;
            // then (and only then: rewriting puts the last synced batch at risk for a moment)
            // the unclaimed tail is written again so this sync really persists it.
            let marker = dir.join(POISON_MARKER);
            let poisoned_before = fs.exists(&marker).map_err(|e| Error::io(&marker, e))?;
            // Exactly the valid frames, plus the zeros after them when the log ended cleanly
            // in preallocated space (kept: the writer resumes into them). Anything else after
            // the frames (a torn tail, frames after a gap) is cut, and so is every zero tail
            // of a poisoned store: after a failed fsync the page cache may show zeros or
            // frames the disk never got. Then extend over a last frame's torn zero padding so
            // the next frame starts aligned.
            let len = file.len().map_err(|e| Error::io(&last.path, e))?;
            let keep = !poisoned_before && a.zero_tail > 0 && len == valid_len + a.zero_tail;
            let allocated = if keep { len } else { valid_len };
            if len != allocated {
                file.set_len(allocated).map_err(|e| Error::io(&last.path, e))?;
            }
            // A marker whose LSN cannot be read lost its (unsynced) contents to a power loss,
            // which also emptied the page cache that could have lied: nothing to rewrite.
            let synced = if poisoned_before { read_marker_lsn(fs.as_ref(), &marker) } else { None };
            if let Some(synced) = synced {
                if last.end_lsn == last.start_lsn {
                    // A segment gets frames only after its header's fdatasync succeeded, so only
                    // an empty newest segment can have a header that lives in the page cache
                    // alone (its creation's sync failed). Rewriting it risks nothing once the
                    // file is durably cut to the header: torn, it is then a header-sized newest
                    // segment with a bad header, which recovery drops. Without that sync a power
                    // loss could keep what followed the header (allocated zeros, a torn batch)
                    // beside a torn header, and a first segment in that state reads as
                    // corruption (sim seeds 24474 and 28594).
                    file.sync_data().map_err(|e| Error::io(&last.path, e))?;
                    rewrite_range(file.as_ref(), &last.path, 0, wal::SEGMENT_HEADER_BYTES)?;
                }
                rewrite_unclaimed_tail(file.as_ref(), &last, a.max_claim.max(synced))?;
            }
            file.sync_data().map_err(|e| Error::io(&last.path, e))?;
            let writer = WalWriter::resume(Arc::clone(fs), dir, file, last, allocated, sealed, segment_bytes_max);
            if poisoned_before {
                fs.remove_file(&marker).map_err(|e| Error::io(&marker, e))?;
                fs.sync_dir(dir).map_err(|e| Error::io(dir, e))?;
            }
            writer
        }
        None => WalWriter::create(Arc::clone(fs), dir, 1, a.end_lsn, a.last_ts + 1, sealed, segment_bytes_max)?,
    };
    a.report.duration = started.elapsed();
    append_recovery_log(fs.as_ref(), dir, &a.report)?;
    Ok(Recovered { state: a.state, last_ts: a.last_ts, wal, checkpoints: a.checkpoints, report: a.report })
}

/// Queues the newest WAL segment's dirty pages for write-back, so that the disk writes them
/// while the checkpoint loads and the log replays. After a process crash (not a power loss)
/// its unsynced tail is still in the page cache, and the fdatasync that resumes the segment
/// (in [`recover`]) had to write all of it: 58 ms of a 240 ms reopen of 300k relaxed one-put
/// commits. A hint only: that fdatasync still decides durability, and any failure here is
/// left for it to report.
fn start_newest_segment_writeback(fs: &dyn FileSystem, dir: &Path) {
    let Ok(names) = fs.list_dir(dir) else { return };
    let newest = names.iter().filter_map(|n| crate::files::parse_segment_name(n).map(|seq| (seq, n))).max();
    if let Some((_, name)) = newest {
        if let Ok(file) = fs.open(&dir.join(name), OpenMode::Read) {
            file.start_writeback();
        }
    }
}

/// Writes the newest segment's frames after the last durable claim back to the file before
/// it is synced. After a failed fdatasync ("fsyncgate") the kernel may have marked those
/// pages clean without writing them: recovery can read them from the page cache, yet a
/// later fdatasync would not write them, and frames written after this open would claim them
/// durable. Rewriting dirties them again so the sync really persists what recovery replayed.
fn rewrite_unclaimed_tail(file: &dyn crate::fs::FileHandle, seg: &SegmentInfo, max_claim: u64) -> Result<()> {
    let from_lsn = max_claim.clamp(seg.start_lsn, seg.end_lsn);
    if from_lsn == seg.end_lsn {
        return Ok(());
    }
    let offset = wal::SEGMENT_HEADER_BYTES + (from_lsn - seg.start_lsn);
    rewrite_range(file, &seg.path, offset, seg.end_lsn - from_lsn)
}

/// Reads `len` bytes at `offset` and writes them back, dirtying their pages.
fn rewrite_range(file: &dyn crate::fs::FileHandle, path: &Path, offset: u64, len: u64) -> Result<()> {
    let len = usize::try_from(len).map_err(|_| Error::corruption(path, offset, "range too large"))?;
    let mut buf = vec![0u8; len];
    crate::fs::read_exact_at(file, &mut buf, offset).map_err(|e| Error::io(path, e))?;
    write_all_at(file, &buf, offset).map_err(|e| Error::io(path, e))
}

/// The durable LSN recorded in the poison marker, if it can be read.
fn read_marker_lsn(fs: &dyn FileSystem, marker: &Path) -> Option<u64> {
    let bytes = fs.open(marker, OpenMode::Read).and_then(|f| read_all(f.as_ref())).ok()?;
    let text = std::str::from_utf8(&bytes).ok()?;
    text.lines().next()?.strip_prefix("durable_lsn ")?.trim().parse().ok()
}

fn append_recovery_log(fs: &dyn FileSystem, dir: &Path, report: &RecoveryReport) -> Result<()> {
    let path = dir.join(RECOVERY_LOG);
    let file = match fs.open(&path, OpenMode::ReadWrite) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let f = fs.open(&path, OpenMode::CreateNew).map_err(|e| Error::io(&path, e))?;
            fs.sync_dir(dir).map_err(|e| Error::io(dir, e))?;
            f
        }
        Err(e) => return Err(Error::io(&path, e)),
    };
    let unix_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let line = report.to_json_line(unix_ms);
    let len = file.len().map_err(|e| Error::io(&path, e))?;
    write_all_at(file.as_ref(), line.as_bytes(), len).map_err(|e| Error::io(&path, e))?;
    file.sync_data().map_err(|e| Error::io(&path, e))
}

#[cfg(test)]
mod checkpoint_load_tests {
    use super::*;
    use crate::checkpoint::{read_checkpoint, CheckpointWriter};
    use crate::fs::StdFs;

    /// Window sizes that cut a checkpoint every way: every block longer than the window (read
    /// alone), blocks straddling windows, several blocks a window, the whole file in one.
    const WINDOWS: [usize; 4] = [64, 300_000, 1 << 20, READ_WINDOW];

    /// [`load_checkpoint_file`] on `bytes` written to a file, in windows of `window` bytes.
    fn load_file(bytes: &[u8], window: usize, state: &mut StateBuilder) -> Checked<CheckpointSummary> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint");
        std::fs::write(&path, bytes).unwrap();
        let file = StdFs.open(&path, OpenMode::Read).unwrap();
        load_checkpoint_file(file.as_ref(), window, state).unwrap()
    }

    /// A checkpoint of two tables, with the entries of table 2 in the order given.
    fn checkpoint_bytes(dir: &Path, keys_of_two: &[u32]) -> Vec<u8> {
        let fs: Arc<dyn FileSystem> = Arc::new(StdFs);
        let mut w = CheckpointWriter::create(fs, dir, 5, 3, None).unwrap();
        w.table(1, &Arc::from("one")).unwrap();
        for i in 0..3_000u32 {
            w.entry(1, &i.to_be_bytes(), &[1u8; 40]).unwrap();
        }
        w.table(2, &Arc::from("two")).unwrap();
        for i in keys_of_two {
            w.entry(2, &i.to_be_bytes(), &i.to_le_bytes()).unwrap();
        }
        let path = w.finish().unwrap().0;
        std::fs::read(path).unwrap()
    }

    /// The tables' entries, in key order, and the digest.
    fn contents(state: &StateBuilder) -> (Vec<(u32, crate::index::Entries)>, StateDigest) {
        let all = crate::index::KeyRange { start: std::ops::Bound::Unbounded, end: std::ops::Bound::Unbounded };
        let mut tables: Vec<_> = state
            .catalog
            .all()
            .iter()
            .map(|t| (t.id, t.data.read().scan_chunk(&all, false, 0, usize::MAX).0))
            .collect();
        tables.sort_by_key(|(id, _)| *id);
        (tables, state.digest)
    }

    /// Every table's latest entries (finished order), the digest, and each table's live counts.
    fn latest(state: &mut StateBuilder) -> (Vec<(u32, crate::index::Entries)>, StateDigest) {
        let all = crate::index::KeyRange { start: std::ops::Bound::Unbounded, end: std::ops::Bound::Unbounded };
        let mut tables: Vec<_> = state
            .catalog
            .all()
            .iter()
            .map(|t| {
                let mut data = t.data.write();
                data.finish_order();
                (t.id, data.scan_chunk(&all, false, u64::MAX, usize::MAX).0)
            })
            .collect();
        tables.sort_by_key(|(id, _)| *id);
        (tables, state.digest)
    }

    #[test]
    fn applying_a_commit_whole_equals_applying_its_operations_one_by_one() {
        let k = |i: u32| i.to_be_bytes();
        let commits: Vec<Vec<Op<'static>>> = vec![
            vec![Op::CreateTable { table: 1, name: "a" }, Op::CreateTable { table: 2, name: "b" }],
            (0..50u32).map(|i| Op::Put { table: 1, key: Box::leak(Box::new(k(i))), value: b"one" }).collect(),
            // Interleaved tables, deletes of present and absent keys, keys rewritten (a commit
            // writes each key once, as a transaction's write set does).
            vec![
                Op::Put { table: 2, key: b"x", value: b"1" },
                Op::Put { table: 1, key: Box::leak(Box::new(k(3))), value: b"three" },
                Op::Delete { table: 1, key: Box::leak(Box::new(k(4))) },
                Op::Delete { table: 1, key: b"absent" },
                Op::Put { table: 2, key: b"y", value: b"2" },
                Op::Put { table: 1, key: Box::leak(Box::new(k(5))), value: b"five" },
            ],
            vec![
                Op::Delete { table: 2, key: b"x" },
                Op::Put { table: 1, key: Box::leak(Box::new(k(6))), value: b"six" },
            ],
            vec![
                Op::DropTable { table: 2 },
                Op::CreateTable { table: 3, name: "b" },
                Op::Put { table: 3, key: b"z", value: b"3" },
            ],
            // A run long enough to be applied in hash-bucket order: rewrites of present keys,
            // new keys, deletes of present and absent ones.
            (0..300u32)
                .map(|i| {
                    let key: &'static [u8] = Box::leak(Box::new(k(i)));
                    if i % 7 == 0 {
                        Op::Delete { table: 1, key }
                    } else {
                        Op::Put { table: 1, key, value: b"long" }
                    }
                })
                .collect(),
        ];
        assert!(commits.iter().any(|c| c.len() >= crate::index::RUN_SORT_MIN));
        let mut one_by_one = StateBuilder::default();
        let mut whole = StateBuilder::default();
        for s in [&mut one_by_one, &mut whole] {
            s.defer_order();
        }
        for (i, ops) in commits.iter().enumerate() {
            let ts = i as u64 + 1;
            for op in ops {
                one_by_one.apply(op, ts).unwrap();
            }
            whole.apply_all(ops, ts).unwrap();
        }
        let expected = latest(&mut one_by_one);
        // Table 1 keeps the 257 keys below 300 that are not multiples of 7; table 2 was dropped
        // and collected; table 3 has one.
        assert_eq!(expected.0.iter().map(|(id, e)| (*id, e.len())).collect::<Vec<_>>(), vec![(1, 257), (3, 1)]);
        assert_eq!(latest(&mut whole), expected);

        // The same errors, in the same words.
        for bad in [Op::Put { table: 9, key: b"k", value: b"v" }, Op::Delete { table: 9, key: b"k" }] {
            let alone = StateBuilder::default().apply(&bad, 2).unwrap_err();
            let ops = [Op::Put { table: 1, key: b"fine", value: b"v" }, bad];
            let mut s = StateBuilder::default();
            s.apply(&Op::CreateTable { table: 1, name: "a" }, 1).unwrap();
            assert_eq!(s.apply_all(&ops, 2).unwrap_err(), alone);
        }
    }

    #[test]
    fn the_windowed_load_builds_what_the_plain_reader_builds() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = checkpoint_bytes(dir.path(), &(0..500).collect::<Vec<_>>());
        let mut plain = StateBuilder::default();
        read_checkpoint(&bytes, &mut plain).unwrap();
        for window in WINDOWS {
            let mut fast = StateBuilder::default();
            let summary = load_file(&bytes, window, &mut fast).unwrap();
            assert_eq!(summary.entries, 3_500);
            assert_eq!(fast.next_table_id, plain.next_table_id);
            assert_eq!(contents(&fast), contents(&plain), "window {window}");
            assert_eq!(contents(&fast).0.iter().map(|(_, e)| e.len()).collect::<Vec<_>>(), vec![3_000, 500]);
        }
    }

    /// A checkpoint of one table with `n` entries of 100-byte values (about 9 blocks at 20,000).
    fn single_table_bytes(dir: &Path, n: u32) -> Vec<u8> {
        let fs: Arc<dyn FileSystem> = Arc::new(StdFs);
        let mut w = CheckpointWriter::create(fs, dir, 5, 2, None).unwrap();
        w.table(1, &Arc::from("only")).unwrap();
        for i in 0..n {
            w.entry(1, &i.to_be_bytes(), &[(i % 251) as u8; 100]).unwrap();
        }
        std::fs::read(w.finish().unwrap().0).unwrap()
    }

    #[test]
    fn a_single_table_checkpoint_of_many_blocks_loads_in_every_window_size() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = single_table_bytes(dir.path(), 20_000);
        assert!(bytes.len() > 4 * 300_000, "several windows of every size but the largest");
        let mut plain = StateBuilder::default();
        let expected = read_checkpoint(&bytes, &mut plain).unwrap();
        for window in WINDOWS {
            let mut fast = StateBuilder::default();
            let summary = load_file(&bytes, window, &mut fast).unwrap();
            assert_eq!((summary.entries, summary.digest), (expected.entries, expected.digest));
            assert_eq!(contents(&fast), contents(&plain), "window {window}");
            assert_eq!(contents(&fast).0.first().map(|(_, e)| e.len()), Some(20_000));
        }
    }

    #[test]
    fn entries_out_of_key_order_load_the_general_way() {
        // Not what our writer produces, but a checkpoint that verifies: its content counts.
        let dir = tempfile::tempdir().unwrap();
        let keys: Vec<u32> = (0..500).rev().collect();
        let bytes = checkpoint_bytes(dir.path(), &keys);
        let mut plain = StateBuilder::default();
        read_checkpoint(&bytes, &mut plain).unwrap();
        for window in WINDOWS {
            let mut loaded = StateBuilder::default();
            load_file(&bytes, window, &mut loaded).unwrap();
            assert_eq!(contents(&loaded), contents(&plain));
            assert_eq!(contents(&loaded).0.get(1).map(|(_, e)| e.len()), Some(500));
        }
    }

    /// The error `read_checkpoint` gives for `bytes`, which must be damaged.
    fn plain_error(bytes: &[u8]) -> (u64, String) {
        read_checkpoint(bytes, &mut Discard).map(|_| ()).unwrap_err()
    }

    #[test]
    fn a_damaged_checkpoint_is_refused_with_the_plain_readers_error_although_its_records_were_built() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = checkpoint_bytes(dir.path(), &(0..500).collect::<Vec<_>>());
        // Flips inside values change no structure: the builder builds, verification refuses.
        for offset in (0..bytes.len()).step_by(211) {
            let mut bad = bytes.clone();
            bad[offset] ^= 0x10;
            for window in [64, READ_WINDOW] {
                let mut state = StateBuilder::default();
                let got = load_file(&bad, window, &mut state).map(|_| ()).unwrap_err();
                assert_eq!(got, plain_error(&bad), "flip at {offset}, window {window}");
                assert_eq!(state.catalog.all().len(), 0, "flip at {offset}: state kept");
            }
        }
        // Cut short anywhere: the footer is gone or misplaced.
        for cut in [0, 10, 64, 100, bytes.len() / 2, bytes.len() - 1] {
            let mut state = StateBuilder::default();
            let got = load_file(&bytes[..cut], 1 << 20, &mut state).map(|_| ()).unwrap_err();
            assert_eq!(got, plain_error(&bytes[..cut]), "cut at {cut}");
        }
    }

    #[test]
    fn a_bad_block_length_is_reported_after_the_blocks_before_it_as_the_plain_reader_does() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = single_table_bytes(dir.path(), 20_000);
        // The block offsets, walked as the format lays them out.
        let footer_at = bytes.len() - crate::checkpoint::FOOTER_BYTES;
        let mut starts = Vec::new();
        let mut at = crate::checkpoint::HEADER_BYTES;
        while at < footer_at {
            starts.push(at);
            let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
            at += crate::checkpoint::BLOCK_PREFIX_BYTES + len;
        }
        assert!(starts.len() >= 5, "{} blocks", starts.len());
        let third = starts[2];
        for (case, length) in [("huge", u32::MAX), ("past the footer", (footer_at - third) as u32), ("short", 3)] {
            let mut bad = bytes.clone();
            bad[third..third + 4].copy_from_slice(&length.to_le_bytes());
            // With a CRC error in an earlier block too, that one is reported first.
            let mut earlier_too = bad.clone();
            earlier_too[starts[1] + 20] ^= 0x01;
            for damaged in [&bad, &earlier_too] {
                for window in WINDOWS {
                    let mut state = StateBuilder::default();
                    let got = load_file(damaged, window, &mut state).map(|_| ()).unwrap_err();
                    assert_eq!(got, plain_error(damaged), "{case}, window {window}");
                    assert_eq!(state.catalog.all().len(), 0);
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod timestamp_tests {
    use crate::wal::{encode_frame, scan_segment, SEGMENT_HEADER_BYTES};
    use crate::{Database, Options};

    /// A log frame whose checksums match but whose timestamp is above `index::MAX_TS` is
    /// refused as corruption, naming the timestamp: a slot keeps the collector's flag in the
    /// bit above it, and a mark frame at `u64::MAX` overflowed the sequence check.
    #[test]
    fn a_frame_timestamp_above_the_largest_is_refused_as_corruption() {
        for ts in [crate::index::MAX_TS + 1, u64::MAX] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("s");
            let db = Database::open(&path, Options::default()).unwrap();
            let mut tx = db.begin_write().unwrap();
            tx.put("t", b"k", b"v").unwrap();
            tx.commit().unwrap();
            db.close().unwrap();
            let segment = std::fs::read_dir(&path)
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| p.file_name().and_then(|n| n.to_str()).and_then(crate::files::parse_segment_name).is_some())
                .unwrap();
            let bytes = std::fs::read(&segment).unwrap();
            let header = crate::wal::decode_segment_header(&bytes).unwrap();
            let scan = scan_segment(&bytes, header.start_lsn);
            let mut out = bytes[..SEGMENT_HEADER_BYTES as usize].to_vec();
            for (i, frame) in scan.frames.iter().enumerate() {
                let h = &frame.header;
                let frame_ts = if i + 1 == scan.frames.len() { ts } else { h.ts };
                encode_frame(&mut out, h.lsn, h.durable_lsn, frame_ts, frame.payload, h.payload_crc);
            }
            std::fs::write(&segment, &out).unwrap();
            match Database::open(&path, Options::default()) {
                Ok(_) => panic!("a frame at ts {ts} was accepted"),
                Err(err) => assert!(err.to_string().contains("above the largest"), "ts {ts}: {err}"),
            }
        }
    }
}
