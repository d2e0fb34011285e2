//! The replicated state machine: a KeelDB store fed committed entries in log order.
//!
//! Invariants:
//! - Each entry is applied by one engine commit that also records its log position
//!   (`WriteTxn::commit_as_command`) and, in `meta/applied`, its full log id: the applied
//!   position is persisted with the data it covers, so after a crash the store is at some
//!   entry boundary and openraft re-applies from there. The store runs relaxed: the log is the
//!   durable record; the log is purged only behind a snapshot, which is a checkpoint (durable).
//! - A snapshot is a checkpoint stream exported from one engine snapshot; its metadata
//!   (applied id, membership) is read from the same snapshot, so applies racing the build can
//!   never make the metadata claim more or less than the data holds. It is a file
//!   (`snapshot_file.rs`), written, read and installed through bounded buffers: no snapshot is
//!   ever held whole in memory.
//! - Installing a snapshot replaces the whole store atomically (old or new after a crash) and
//!   is refused if it is older than what is applied (openraft #1130).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::path::Path;
use std::sync::Arc;

use etcd_client::proto::{PbCompactionRequest, PbDeleteRequest, PbPutRequest, PbPutResponse, PbTxnRequest};
use futures_util::{FutureExt, Stream, StreamExt};
use keeldb::fs::{FileHandle, FileSystem, OpenMode};
use keeldb::{Database, Durability, InstallOptions, LogPosition, Options, ReadTxn};
use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
use openraft::{EntryPayload, OptionalSend};
use parking_lot::Mutex;
use prost::Message;

use crate::auth::{AuthError, AuthState};
use crate::curp::CommandId;
use crate::files;
use crate::mvcc::{self, Writer, COMPACT_KEY, META, REV_KEY};
use crate::snapshot_file::{SnapshotFile, Snapshots};
use crate::types::{
    ApplyError, Entry, LogId, Request, RequestKind, Response, SnapshotMeta, StoredMembership, TypeConfig,
};

const APPLIED_KEY: &[u8] = b"applied";
const MEMBERSHIP_KEY: &[u8] = b"membership";

/// The Raft handle: openraft over this state machine.
pub type Raft = openraft::Raft<crate::types::TypeConfig, StateMachine>;

/// Table of members' published attributes: id (big-endian) → bincode `Member`.
pub const MEMBERS: &str = "members";

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// What readers need without touching the engine: revisions and where history starts.
pub struct Progress {
    /// The current store revision (etcd's header revision).
    pub revision: i64,
    /// The compacted revision (reads below it fail with ErrCompacted).
    pub compact_revision: i64,
    /// (revision, engine timestamp) of each revision since history began, ascending.
    revs: VecDeque<(i64, u64)>,
    /// Last applied log id.
    pub applied: Option<LogId>,
    /// Last applied membership.
    pub membership: StoredMembership,
}

/// The apply trace: appended through the member's file system, never synced.
struct Trace {
    file: Arc<dyn FileHandle>,
    end: u64,
}

impl Trace {
    fn open(fs: &dyn FileSystem, path: &Path) -> io::Result<Trace> {
        let file = match fs.open(path, OpenMode::ReadWrite) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => fs.open(path, OpenMode::CreateNew)?,
            other => other?,
        };
        let end = file.len()?;
        Ok(Trace { file, end })
    }

    /// Appends one line; a failed write only costs the trace.
    fn line(&mut self, text: std::fmt::Arguments<'_>) {
        let line = format!("{text}\n");
        if keeldb::fs::write_all_at(self.file.as_ref(), line.as_bytes(), self.end).is_ok() {
            self.end += line.len() as u64;
        }
    }
}

/// State shared by the state machine, its snapshot builders and the API's readers.
pub struct Shared {
    pub db: Database,
    /// `KEEL_APPLY_TRACE` set: one line per applied entry (index, term, leader, digest of the
    /// request, revision after), so members' applies can be compared after a fault run.
    trace: Option<Mutex<Trace>>,
    /// The snapshot files (`snap`).
    pub snaps: Snapshots,
    pub progress: Mutex<Progress>,
    /// Held (write) by the apply path from making a batch visible in the engine until
    /// `progress` records it; a reader that saw a revision `progress` lacks waits on it.
    applying: parking_lot::RwLock<()>,
    /// The applied log index, for readers waiting on a read index.
    pub applied_tx: tokio::sync::watch::Sender<u64>,
    /// Lease deadlines while this member leads (`lease.rs`); told of applied grants and revokes.
    pub lessor: crate::lease::Lessor,
    /// The auth state as of the last applied entry (its rows are in the store; this is the
    /// copy the API checks requests against).
    pub auth: parking_lot::RwLock<Arc<AuthState>>,
    /// Told the ids of the CURP commands each batch executed (the member's witness forgets
    /// them: `curp::witness`).
    pub on_curp_applied: parking_lot::RwLock<Option<CurpHook>>,
    /// Bytes of log entries applied since this member opened, and that count when `current`
    /// was made (built or installed): the snapshot policy's measure ([`snapshot_due`]).
    pub applied_bytes: std::sync::atomic::AtomicU64,
    pub snapshot_mark: std::sync::atomic::AtomicU64,
    /// Snapshots this member built since it opened (not installed ones).
    pub snapshots_built: std::sync::atomic::AtomicU64,
}

/// Whether a new snapshot is due: `snapshot_count` entries have applied since the last one,
/// and they carry at least `bytes_percent` % as many bytes as the last snapshot file holds.
///
/// The second rule keeps a snapshot's cost, which grows with the state (every key is written
/// out), in proportion to the writes that pay for it: at 50 %, at most two bytes exported per
/// byte applied. With the entry count alone, a store of 1 GB would be exported whole every
/// `snapshot_count` writes on every member, however small the writes. The price is a longer
/// log: up to half the state's size in entries is kept behind the snapshot. etcd does not
/// pay this cost (its snapshot refers to its on-disk B-tree), so its `--snapshot-count` is a
/// plain count; ours is a floor.
pub fn snapshot_due(
    entries_since: u64,
    bytes_since: u64,
    snapshot_len: u64,
    snapshot_count: u64,
    bytes_percent: u64,
) -> bool {
    entries_since >= snapshot_count && bytes_since.saturating_mul(100) >= snapshot_len.saturating_mul(bytes_percent)
}

/// What each applied entry adds to [`Shared::applied_bytes`] besides its request body: the
/// entry's framing (log id, kind, auth), so that empty entries count too.
const ENTRY_OVERHEAD: u64 = 32;

/// See [`Shared::on_curp_applied`].
pub type CurpHook = Arc<dyn Fn(&[CommandId]) + Send + Sync>;

impl Shared {
    /// Whether CURP command `id` has applied on this member: its result is recorded, or its
    /// client has moved past it (the result forgotten because the client has it).
    pub fn curp_applied(&self, id: CommandId) -> io::Result<bool> {
        if self.curp_result(id)?.is_some() {
            return Ok(true);
        }
        let txn = self.db.begin_read().map_err(io_err)?;
        let floor: u64 = match txn.get(crate::curp::CLIENTS, &id.client.to_be_bytes()).map_err(io_err)? {
            Some(v) => bincode::deserialize(&v).map_err(io_err)?,
            None => 0,
        };
        Ok(id.seq < floor)
    }

    /// The recorded result of CURP command `id`, if it has applied on this member and its
    /// client has not yet said it has the answer.
    pub fn curp_result(&self, id: CommandId) -> io::Result<Option<Response>> {
        let txn = self.db.begin_read().map_err(io_err)?;
        match txn.get(crate::curp::DEDUP, &crate::curp::dedup_key(id)).map_err(io_err)? {
            Some(v) => Ok(Some(bincode::deserialize(&v).map_err(io_err)?)),
            None => Ok(None),
        }
    }

    /// The revision of the newest applied state (the apply path's own count; readers use
    /// [`Shared::visible_revision`], which is never behind what they can see).
    pub fn revision(&self) -> i64 {
        self.progress.lock().revision
    }

    /// A read view of the newest state and the store revision of that same view.
    ///
    /// The revision is read from the view itself, never from [`Progress`]: the apply path makes
    /// a batch visible in the engine before it updates `Progress`, so a revision taken from
    /// `Progress` and a view taken after it can disagree (a header below a returned key's
    /// `mod_revision`, issue 36). Engine views only move forward, so the revision of a view
    /// is also at least every revision any earlier view on this member reported.
    pub fn read_now(&self) -> Result<(ReadTxn, i64), ApplyError> {
        let txn = self.db.begin_read().map_err(|e| ApplyError::Invalid(e.to_string()))?;
        let revision = read_i64(&txn, REV_KEY).map_err(|e| ApplyError::Invalid(e.to_string()))?.max(1);
        Ok((txn, revision))
    }

    /// The revision of the newest state readers can see: the header revision of any answer
    /// that is not itself a write (see [`Shared::read_now`]).
    pub fn visible_revision(&self) -> i64 {
        match self.read_now() {
            Ok((_, revision)) => revision,
            Err(_) => self.progress.lock().revision,
        }
    }

    /// A read view at `revision` (0: newest) and the header revision to report: the revision
    /// of the newest state, which is at least every `mod_revision` the view holds.
    pub fn read_at(&self, revision: i64) -> Result<(ReadTxn, i64), ApplyError> {
        // The newest view first: it decides what "current" and "future" mean for this read.
        let (now, current) = self.read_now()?;
        if revision <= 0 || revision == current {
            return Ok((now, current));
        }
        if revision > current {
            return Err(ApplyError::FutureRevision);
        }
        let mut p = self.progress.lock();
        if revision > p.revision {
            // Applied and visible, but `Progress` has not caught up with the batch yet: wait
            // for the apply path to finish recording it (it holds `applying` until then).
            drop(p);
            drop(self.applying.read());
            p = self.progress.lock();
        }
        if revision < p.compact_revision {
            return Err(ApplyError::Compacted);
        }
        // The newest engine commit at or before `revision`.
        let first = p.revs.front().map_or(i64::MAX, |r| r.0);
        if revision < first {
            return Err(ApplyError::Compacted);
        }
        let at = p.revs.partition_point(|r| r.0 <= revision);
        let ts = p.revs.get(at.saturating_sub(1)).map(|r| r.1).ok_or(ApplyError::Compacted)?;
        drop(p);
        let txn = self.db.begin_read_at(ts).map_err(|e| match e {
            keeldb::Error::Compacted { .. } => ApplyError::Compacted,
            other => ApplyError::Invalid(other.to_string()),
        })?;
        Ok((txn, current))
    }

    /// The engine timestamp of the newest commit at or before `revision`: the change feed after
    /// it holds every revision above `revision` (a watcher's catch-up starts there). `Err` with
    /// the oldest revision whose changes the feed still holds when `revision` is older than the
    /// history kept (compacted, or before this member's last snapshot install; a restart keeps it).
    pub fn revision_ts(&self, revision: i64) -> Result<u64, i64> {
        let p = self.progress.lock();
        let first = p.revs.front().map_or(p.revision, |r| r.0);
        // Revision 1 is the empty store etcd starts at: nothing below it is missing.
        if revision < first && first > 1 {
            return Err(first + 1);
        }
        let at = p.revs.partition_point(|r| r.0 <= revision);
        p.revs.get(at.saturating_sub(1)).map(|r| r.1).ok_or(first + 1)
    }

    /// Members' published attributes (name, client URLs) by id.
    pub fn published_members(&self) -> std::collections::BTreeMap<u64, crate::types::Member> {
        let mut out = std::collections::BTreeMap::new();
        let Ok(txn) = self.db.begin_read() else { return out };
        let Ok(scan) = txn.scan(MEMBERS, keeldb::ScanRange::all()) else { return out };
        for (k, v) in scan.flatten() {
            if let (Ok(id), Ok(m)) = (<[u8; 8]>::try_from(k.as_slice()), bincode::deserialize(&v)) {
                out.insert(u64::from_be_bytes(id), m);
            }
        }
        out
    }

    /// The applied index now.
    pub fn applied_index(&self) -> u64 {
        *self.applied_tx.borrow()
    }

    /// Exports a checkpoint into a new temporary snapshot file named after `what`, with the
    /// metadata read from the same engine snapshot.
    pub fn export_snapshot(&self, what: &str) -> io::Result<(SnapshotMeta, SnapshotFile)> {
        self.snaps.export(&self.db, what, |ts| {
            let txn = self.db.begin_read_at(ts).map_err(io_err)?;
            let applied: Option<LogId> = read_meta(&txn, APPLIED_KEY)?;
            let membership: StoredMembership = read_meta(&txn, MEMBERSHIP_KEY)?.unwrap_or_default();
            Ok(SnapshotMeta { last_log_id: applied, last_membership: membership })
        })
    }

    /// A new, empty temporary file to receive a leader's snapshot into.
    pub fn incoming_snapshot(&self) -> io::Result<SnapshotFile> {
        self.snaps.temp("recv")
    }
}

/// The state machine handed to openraft.
#[derive(Clone)]
pub struct StateMachine {
    pub shared: Arc<Shared>,
}

fn read_meta<T: serde::de::DeserializeOwned>(txn: &ReadTxn, key: &[u8]) -> io::Result<Option<T>> {
    match txn.get(META, key).map_err(io_err)? {
        None => Ok(None),
        Some(v) => {
            bincode::deserialize(&v).map(Some).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
        }
    }
}

fn read_i64(txn: &ReadTxn, key: &[u8]) -> io::Result<i64> {
    Ok(read_meta::<i64>(txn, key)?.unwrap_or(0))
}

/// Reads revision, compaction, applied id and membership as of `txn` (the newest state), and
/// which engine commit each revision the engine's history still holds is at: the engine keeps
/// history across a restart, so every revision above the compaction that this member served
/// before is readable again. The compaction is applied as the apply path applies it: history
/// below the revision before it is freed (the floor a reopened engine restores may be older).
fn progress_of(db: &Database, txn: &ReadTxn) -> io::Result<Progress> {
    let revision = read_i64(txn, REV_KEY)?.max(1);
    let compact_revision = read_i64(txn, COMPACT_KEY)?;
    // History that cannot be mapped back to revisions (none kept, or a feed that does not end
    // at the current revision) is not worth refusing the open for: it then begins at `txn`, as
    // after a snapshot install.
    let mut revs = db
        .history_floor()
        .and_then(|floor| revisions_since(db, floor, txn.snapshot_ts()).ok())
        .filter(|revs| revs.back().is_some_and(|&(rev, _)| rev == revision))
        .unwrap_or_else(|| VecDeque::from([(revision, txn.snapshot_ts())]));
    let keep_from = revs.partition_point(|r| r.0 < compact_revision).saturating_sub(1);
    revs.drain(..keep_from);
    if let (Some(&(_, ts)), Some(floor)) = (revs.front(), db.history_floor()) {
        if ts > floor {
            // Frees history below the compacted revision, as the apply path does.
            let _ = db.retain_history_since(ts);
        }
    }
    Ok(Progress {
        revision,
        compact_revision,
        revs,
        applied: read_meta(txn, APPLIED_KEY)?,
        membership: read_meta(txn, MEMBERSHIP_KEY)?.unwrap_or_default(),
    })
}

/// (revision, engine timestamp) of every revision from the history floor to `until`: the
/// revision the floor reads at, then each commit that wrote `meta/rev` (the apply path writes
/// it in the commit of every entry that takes a revision), from the engine's change feed.
fn revisions_since(db: &Database, floor: u64, until: u64) -> io::Result<VecDeque<(i64, u64)>> {
    let at_floor = db.begin_read_at(floor).map_err(io_err)?;
    let mut revs = VecDeque::from([(read_i64(&at_floor, REV_KEY)?.max(1), floor)]);
    drop(at_floor);
    let (mut after, mut max) = (floor, 4096);
    while after < until {
        let page = db.changes_since(after, max).map_err(io_err)?;
        let (Some(first), Some(last)) = (page.first().map(|c| c.ts), page.last().map(|c| c.ts)) else { break };
        if page.len() >= max && first == last {
            // One commit alone fills the page, which may hold only part of it: read it whole.
            max = max.saturating_mul(2);
            continue;
        }
        (after, max) = (last, 4096);
        for c in page.into_iter().filter(|c| c.ts <= until && &*c.table == META && c.key == REV_KEY) {
            if let keeldb::ChangeKind::Put(v) = c.kind {
                let rev: i64 = bincode::deserialize(&v).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                if revs.back().is_none_or(|&(r, _)| r < rev) {
                    revs.push_back((rev, c.ts));
                }
            }
        }
    }
    Ok(revs)
}

/// Makes `dir` (the `sm` directory of a new cluster's member) hold the keys and revision of
/// `checkpoint`, a `Maintenance.Snapshot` stream. The stream is installed into a scratch store
/// first (which checks it whole); then only the keys, the leases, the auth tables (users, roles,
/// enabled) and the revision and compaction point are copied into a fresh store. The old
/// cluster's applied position (which the engine keeps with the data and would refuse the new
/// log's positions against), membership and published members stay behind, so the new cluster's
/// log starts at its own first entry and revisions continue from the snapshot's. Checkpointed
/// before returning (durable). Returns the revision.
pub fn restore(dir: &Path, checkpoint: &[u8], fs: Arc<dyn FileSystem>) -> io::Result<i64> {
    let scratch_dir = dir.join("restore.scratch");
    let relaxed = Options { fs: Arc::clone(&fs), ..Options::with_durability(Durability::Relaxed) };
    let scratch = Database::open(&scratch_dir, relaxed.clone()).map_err(io_err)?;
    let opts = InstallOptions { expected_bytes: Some(checkpoint.len() as u64), ..InstallOptions::default() };
    let mut input = checkpoint;
    scratch.install_checkpoint_with(&mut input, opts).map_err(io_err)?;
    let from = scratch.begin_read().map_err(io_err)?;
    let revision = read_i64(&from, REV_KEY)?;
    let db = Database::open(dir.join("store"), relaxed).map_err(io_err)?;
    let mut txn = db.begin_write().map_err(io_err)?;
    let mut in_txn = 0usize;
    // The keys with their leases (a key's record names its lease; the lease and its key index
    // come along, as etcd's restore keeps leases).
    let tables = [mvcc::KV, crate::lease::LEASES, crate::lease::LEASE_KEYS];
    let rows = tables.into_iter().map(|t| Ok((t, from.scan(t, keeldb::ScanRange::all()).map_err(io_err)?)));
    for item in rows.collect::<io::Result<Vec<_>>>()?.into_iter().flat_map(|(t, scan)| scan.map(move |r| (t, r))) {
        let (table, (key, value)) = (item.0, item.1.map_err(io_err)?);
        txn.put(table, &key, &value).map_err(io_err)?;
        in_txn += 1;
        if in_txn == 10_000 {
            txn.commit().map_err(io_err)?;
            txn = db.begin_write().map_err(io_err)?;
            in_txn = 0;
        }
    }
    // Users, roles and whether auth is on come along, as etcd's restore keeps its auth bucket.
    for table in [crate::auth::USERS, crate::auth::ROLES] {
        for item in from.scan(table, keeldb::ScanRange::all()).map_err(io_err)? {
            let (key, value) = item.map_err(io_err)?;
            txn.put(table, &key, &value).map_err(io_err)?;
        }
    }
    for key in [REV_KEY, COMPACT_KEY].into_iter().chain(crate::auth::META_KEYS) {
        if let Some(v) = from.get(META, key).map_err(io_err)? {
            txn.put(META, key, &v).map_err(io_err)?;
        }
    }
    txn.commit().map_err(io_err)?;
    drop(from);
    db.checkpoint().map_err(io_err)?;
    db.close().map_err(io_err)?;
    scratch.close().map_err(io_err)?;
    files::remove_tree(fs.as_ref(), &scratch_dir)?;
    files::create_dir_durably(fs.as_ref(), &dir.join("snap"))?;
    Ok(revision)
}

impl StateMachine {
    /// Opens the state machine's store in `dir` (relaxed durability; history kept in memory
    /// for reads at past revisions).
    pub fn open(dir: &Path, fs: Arc<dyn FileSystem>) -> io::Result<StateMachine> {
        let options =
            Options { keep_history: true, fs: Arc::clone(&fs), ..Options::with_durability(Durability::Relaxed) };
        let db = Database::open(dir.join("store"), options).map_err(io_err)?;
        let txn = db.begin_read().map_err(io_err)?;
        let progress = progress_of(&db, &txn)?;
        let auth = AuthState::load(&txn).map_err(io_err)?;
        drop(txn);
        let applied = progress.applied.map_or(0, |a| a.index);
        let (applied_tx, _) = tokio::sync::watch::channel(applied);
        // Made durably: the snapshot file inside is what the purged log relies on after a power loss.
        let snaps = Snapshots::open(Arc::clone(&fs), &dir.join("snap"))?;
        let trace = match std::env::var_os("KEEL_APPLY_TRACE") {
            Some(_) => Some(Mutex::new(Trace::open(fs.as_ref(), &dir.join("apply.trace"))?)),
            None => None,
        };
        let sm = StateMachine {
            shared: Arc::new(Shared {
                db,
                trace,
                snaps,
                progress: Mutex::new(progress),
                applying: parking_lot::RwLock::new(()),
                applied_tx,
                lessor: crate::lease::Lessor::new(),
                auth: parking_lot::RwLock::new(Arc::new(auth)),
                on_curp_applied: parking_lot::RwLock::new(None),
                applied_bytes: Default::default(),
                snapshot_mark: Default::default(),
                snapshots_built: Default::default(),
            }),
        };
        // The store is relaxed: after a power loss it may be older than the last snapshot,
        // and the log before the snapshot may be purged. The snapshot file is durable, so
        // bring the store up to it before Raft asks what is applied.
        if let Some((meta, file)) = sm.shared.snaps.current()? {
            let applied = sm.shared.progress.lock().applied;
            if meta.last_log_id > applied {
                sm.install_file(&meta, &file)?;
            }
        }
        Ok(sm)
    }

    /// Applies committed entries in log order as one engine group: each entry is planned
    /// against the store as its predecessors in the batch leave it ([`mvcc::Overlay`]), then
    /// all are committed together by `Database::apply_batch_with` (one WAL write, one commit
    /// timestamp and one recorded log position per entry). Returns each entry's response.
    fn apply_entries(&self, entries: &[Entry]) -> io::Result<Vec<Response>> {
        let db = &self.shared.db;
        let (mut revision, mut compact) = {
            let p = self.shared.progress.lock();
            (p.revision, p.compact_revision)
        };
        let mut snapshot = db.begin_read().map_err(io_err)?;
        let mut view = mvcc::Overlay::new(&mut snapshot);
        // The auth state as the entries before each one leave it; copied only if one changes it.
        let mut auth = Arc::clone(&self.shared.auth.read());
        let mut auth_changed = false;
        let mut commands = Vec::with_capacity(entries.len());
        // CURP commands' dedup records as this batch leaves them, and the ids it applied.
        let mut curp = CurpApply::default();
        let mut applied_ids = Vec::new();
        // Per entry: response, revision it took (if it wrote), new compaction point, membership.
        let mut planned = Vec::with_capacity(entries.len());
        let bytes: u64 = entries
            .iter()
            .map(|e| ENTRY_OVERHEAD + if let EntryPayload::Normal(r) = &e.payload { r.body.len() as u64 } else { 0 })
            .sum();
        self.shared.applied_bytes.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        for entry in entries {
            let log_id = entry.log_id;
            let mut writer = Writer { txn: &mut view, revision: revision + 1, wrote: false };
            let mut command = keeldb::Command::new();
            let mut new_compact = None;
            let mut membership = None;
            // A request checked against an auth state that has changed since is refused whole.
            let refused = match &entry.payload {
                EntryPayload::Normal(req) if req.kind != RequestKind::Publish => auth.admit(req.auth.as_ref()).err(),
                _ => None,
            };
            let response = match &entry.payload {
                _ if refused.is_some() => {
                    Response::Err(ApplyError::Auth(refused.unwrap_or(AuthError::AuthOldRevision)))
                }
                EntryPayload::Blank => Response::Ok(Vec::new()),
                EntryPayload::Membership(m) => {
                    membership = Some(StoredMembership::new(Some(log_id), m.clone()));
                    Response::Ok(Vec::new())
                }
                EntryPayload::Normal(req) if req.kind == RequestKind::Publish => {
                    match bincode::deserialize::<(u64, crate::types::Member)>(&req.body) {
                        Ok((id, member)) => {
                            command =
                                command.put(MEMBERS, id.to_be_bytes(), bincode::serialize(&member).map_err(io_err)?);
                            Response::Ok(Vec::new())
                        }
                        Err(e) => Response::Err(ApplyError::Invalid(format!("bad member attributes: {e}"))),
                    }
                }
                EntryPayload::Normal(req) if req.kind == RequestKind::Auth => {
                    match crate::auth::apply_entry(&auth, &req.body) {
                        Ok((next, writes)) => {
                            for (table, key, value) in writes {
                                command = match value {
                                    Some(v) => command.put(table, key, v),
                                    None => command.delete(table, key),
                                };
                            }
                            auth = Arc::new(next);
                            auth_changed = true;
                            Response::Ok(Vec::new())
                        }
                        Err(e) => Response::Err(e),
                    }
                }
                EntryPayload::Normal(req) if req.kind == RequestKind::Curp => {
                    let (response, id) = curp.apply(&mut writer, req, revision, compact, &mut command)?;
                    applied_ids.extend(id);
                    response
                }
                EntryPayload::Normal(req) => match execute(&mut writer, req, revision, compact) {
                    Ok((bytes, c)) => {
                        new_compact = c;
                        Response::Ok(bytes)
                    }
                    Err(e) => Response::Err(e),
                },
            };
            let ok = matches!(response, Response::Ok(_));
            let wrote = writer.wrote;
            if ok {
                // Other tables a request keeps state in (the lease tables) are written by a
                // request that succeeded, whether or not it took a revision (a lease grant
                // takes none).
                for ((table, key), value) in view.keep_tables() {
                    command = match value {
                        Some(v) => command.put(table, key, v),
                        None => command.delete(table, key),
                    };
                }
            }
            let took = if ok && wrote {
                // Only a request that succeeded and wrote keeps its writes (etcd: one new
                // revision per writing request, none for a failed or read-only one).
                for (key, value) in view.keep_entry() {
                    command = match value {
                        Some(v) => command.put(mvcc::KV, key, v),
                        None => command.delete(mvcc::KV, key),
                    };
                }
                revision += 1;
                command = command.put(META, REV_KEY, bincode::serialize(&revision).map_err(io_err)?);
                Some(revision)
            } else {
                view.discard_entry();
                None
            };
            if let Some(c) = new_compact {
                compact = c;
                command = command.put(META, COMPACT_KEY, bincode::serialize(&c).map_err(io_err)?);
            }
            if let Some(m) = &membership {
                command = command.put(META, MEMBERSHIP_KEY, bincode::serialize(m).map_err(io_err)?);
            }
            command = command.put(META, APPLIED_KEY, bincode::serialize(&log_id).map_err(io_err)?);
            commands.push((LogPosition::new(log_id.index, log_id.leader_id.term), command));
            planned.push((log_id, response, took, new_compact, membership));
        }
        drop(view);
        drop(snapshot);
        // Readers that see this batch in the engine before `progress` records it wait on this.
        let applying = self.shared.applying.write();
        let outcomes = db.apply_batch_with(Durability::Relaxed, commands);
        let mut responses = Vec::with_capacity(planned.len());
        let mut compact_ts = None;
        for ((log_id, response, took, new_compact, membership), outcome) in planned.into_iter().zip(outcomes) {
            let ts = match outcome.map_err(io_err)? {
                keeldb::ApplyOutcome::Applied { ts } => ts,
                other => return Err(io_err(format!("entry {log_id}: unexpected apply outcome {other:?}"))),
            };
            {
                let mut p = self.shared.progress.lock();
                if let Some(rev) = took {
                    p.revision = rev;
                    p.revs.push_back((rev, ts));
                }
                if let Some(c) = new_compact {
                    p.compact_revision = c;
                    // History is kept from the revision before `c`: reads at `c` and the
                    // change feed's commit of `c` itself stay (a watch may start at the
                    // compacted revision, as in etcd); reads below `c` are refused by
                    // `compact_revision`.
                    let keep_from = p.revs.partition_point(|r| r.0 < c).saturating_sub(1);
                    p.revs.drain(..keep_from);
                    compact_ts = p.revs.front().map(|r| r.1);
                }
                if let Some(m) = membership {
                    p.membership = m;
                }
                p.applied = Some(log_id);
            }
            responses.push(response);
        }
        drop(applying);
        for (entry, response) in entries.iter().zip(&responses) {
            self.trace(entry, response);
        }
        crate::lease::applied(&self.shared.lessor, entries, &responses);
        if !applied_ids.is_empty() {
            if let Some(hook) = self.shared.on_curp_applied.read().clone() {
                hook(&applied_ids);
            }
        }
        if auth_changed {
            *self.shared.auth.write() = auth;
        }
        if let Some(ts) = compact_ts {
            // Frees history below the compacted revision (etcd's compaction).
            let _ = db.retain_history_since(ts);
        }
        if let Some(last) = entries.last() {
            self.shared.applied_tx.send_replace(last.log_id.index);
        }
        Ok(responses)
    }

    /// `KEEL_APPLY_TRACE`: one line per applied entry (see [`Shared`]).
    fn trace(&self, entry: &Entry, response: &Response) {
        let Some(t) = &self.shared.trace else { return };
        let log_id = entry.log_id;
        let digest = match &entry.payload {
            EntryPayload::Normal(r) => xxhash_rust::xxh3::xxh3_64(&r.body),
            _ => 0,
        };
        let resp = match response {
            Response::Ok(b) => xxhash_rust::xxh3::xxh3_64(b),
            Response::Err(_) => 1,
        };
        let rev = self.shared.progress.lock().revision;
        t.lock().line(format_args!(
            "{} {} {} {digest:x} {resp:x} {rev}",
            log_id.index, log_id.leader_id.term, log_id.leader_id.node_id
        ));
    }

    /// Replaces the store with a snapshot file's checkpoint stream (read through a bounded
    /// buffer) and reloads the progress from it.
    fn install_file(&self, meta: &SnapshotMeta, file: &SnapshotFile) -> io::Result<()> {
        let opts = InstallOptions { expected_bytes: Some(file.checkpoint().len()), ..InstallOptions::default() };
        let _applying = self.shared.applying.write();
        self.shared.db.install_checkpoint_with(&mut file.checkpoint_reader(), opts).map_err(io_err)?;
        let txn = self.shared.db.begin_read().map_err(io_err)?;
        let progress = progress_of(&self.shared.db, &txn)?;
        if progress.applied != meta.last_log_id {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "snapshot data and metadata disagree"));
        }
        *self.shared.auth.write() = Arc::new(AuthState::load(&txn).map_err(io_err)?);
        let applied = progress.applied.map_or(0, |a| a.index);
        *self.shared.progress.lock() = progress;
        if let Some(t) = &self.shared.trace {
            t.lock().line(format_args!("install {applied} {:?}", meta.last_log_id));
        }
        self.shared.applied_tx.send_replace(applied);
        Ok(())
    }

    /// Exports a checkpoint into a snapshot file (metadata from the same engine snapshot)
    /// and makes it `current` (synced, renamed, directory synced) unless a newer one already
    /// is (an install that finished meanwhile).
    fn build(&self) -> io::Result<(SnapshotMeta, SnapshotFile)> {
        let mark = self.shared.applied_bytes.load(std::sync::atomic::Ordering::Relaxed);
        let (meta, mut file) = self.shared.export_snapshot("build")?;
        if self.shared.snaps.promote(&mut file, &meta)? {
            self.shared.snapshot_mark.store(mark, std::sync::atomic::Ordering::Relaxed);
        }
        self.shared.snapshots_built.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok((meta, file))
    }
}

/// A CURP command executed against the applied state and thrown away: the leader's early
/// answer (`curp::front`), with every header revision 0 (its revision is known only once it
/// applies). `None` if it cannot be answered early (a request that fails, or one whose result
/// depends on leases).
pub fn speculate(shared: &Shared, kind: RequestKind, body: &[u8]) -> Option<Response> {
    if !matches!(kind, RequestKind::Put | RequestKind::DeleteRange | RequestKind::Txn) {
        return None;
    }
    // The revision of the view itself (see `Shared::read_now`), not `Progress`'s.
    let (mut snapshot, revision) = shared.read_now().ok()?;
    let compact = shared.progress.lock().compact_revision;
    let mut view = mvcc::Overlay::new(&mut snapshot);
    let mut writer = Writer { txn: &mut view, revision: revision + 1, wrote: false };
    let req = Request::new(kind, body.to_vec());
    let (bytes, _) = execute(&mut writer, &req, revision, compact).ok()?;
    let zeroed = match kind {
        RequestKind::Put => {
            let mut r = PbPutResponse::decode(bytes.as_slice()).ok()?;
            r.header.iter_mut().for_each(|h| h.revision = 0);
            r.encode_to_vec()
        }
        RequestKind::DeleteRange => {
            let mut r = etcd_client::proto::PbDeleteResponse::decode(bytes.as_slice()).ok()?;
            r.header.iter_mut().for_each(|h| h.revision = 0);
            r.encode_to_vec()
        }
        _ => {
            let mut r = etcd_client::proto::PbTxnResponse::decode(bytes.as_slice()).ok()?;
            set_txn_revision(&mut r, 0);
            r.encode_to_vec()
        }
    };
    Some(Response::Ok(zeroed))
}

/// CURP commands in one applied batch: the dedup records and client floors that earlier
/// entries of the batch wrote (the store's snapshot does not show them yet).
#[derive(Default)]
struct CurpApply {
    records: HashMap<CommandId, Option<Response>>,
    floors: HashMap<u64, u64>,
}

impl CurpApply {
    /// Applies one CURP command at most once per id: a command already recorded is answered
    /// from its record; one below its client's floor is refused; anything else runs like the
    /// etcd request it carries and its response is recorded (success or failure alike, so a
    /// retry never executes again). Returns the response and the command's id (for the
    /// witness to forget it: it has applied, now or before).
    fn apply(
        &mut self,
        w: &mut Writer<'_, '_>,
        req: &Request,
        revision: i64,
        compact: i64,
        command: &mut keeldb::Command,
    ) -> io::Result<(Response, Option<CommandId>)> {
        let Some(cmd) = crate::curp::Command::from_request(req) else {
            return Ok((Response::Err(ApplyError::Invalid("undecodable CURP command".into())), None));
        };
        if !matches!(cmd.kind, RequestKind::Put | RequestKind::DeleteRange | RequestKind::Txn) {
            let why = format!("a CURP command carries Put, DeleteRange or Txn, not {:?}", cmd.kind);
            return Ok((Response::Err(ApplyError::Invalid(why)), None));
        }
        let id = cmd.id;
        let client = id.client.to_be_bytes();
        let floor = match self.floors.get(&id.client) {
            Some(f) => *f,
            None => match w.txn.get_in(crate::curp::CLIENTS, &client).map_err(io_err)? {
                Some(v) => bincode::deserialize(&v).map_err(io_err)?,
                None => 0,
            },
        };
        if id.seq < floor {
            let why = format!("CURP command {id} is older than its client's first incomplete command {floor}");
            return Ok((Response::Err(ApplyError::Invalid(why)), Some(id)));
        }
        let key = crate::curp::dedup_key(id);
        let recorded = match self.records.get(&id) {
            Some(r) => r.clone(),
            None => match w.txn.get_in(crate::curp::DEDUP, &key).map_err(io_err)? {
                Some(v) => Some(bincode::deserialize(&v).map_err(io_err)?),
                None => None,
            },
        };
        if let Some(r) = recorded {
            return Ok((r, Some(id)));
        }
        let inner = Request { kind: cmd.kind, body: cmd.body, auth: req.auth.clone() };
        let response = match execute(w, &inner, revision, compact) {
            Ok((bytes, _)) => Response::Ok(bytes),
            Err(e) => Response::Err(e),
        };
        let mut c = std::mem::replace(command, keeldb::Command::new());
        c = c.put(crate::curp::DEDUP, key, bincode::serialize(&response).map_err(io_err)?);
        self.records.insert(id, Some(response.clone()));
        if cmd.first_incomplete > floor {
            // The client has the answers of everything below `first_incomplete`: forget them.
            // Records exist only from the old floor up, so look those up one by one (usually
            // one: a client's floor moves with each command); only a long jump scans the
            // client's prefix (a scan walks the deleted records' history too, so scanning on
            // every command made each apply slower than the last: 262 -> 754 us of server CPU
            // per op over three 60 s bench runs).
            let mut stale: Vec<CommandId> = Vec::new();
            if cmd.first_incomplete - floor <= 64 {
                for seq in floor..cmd.first_incomplete {
                    let old = CommandId { client: id.client, seq };
                    if w.txn.get_in(crate::curp::DEDUP, &crate::curp::dedup_key(old)).map_err(io_err)?.is_some() {
                        stale.push(old);
                    }
                }
            } else {
                for (k, _) in w.txn.scan_prefix_in(crate::curp::DEDUP, &client).map_err(io_err)? {
                    if let Some(seq) = k.get(8..16).and_then(|b| <[u8; 8]>::try_from(b).ok()).map(u64::from_be_bytes) {
                        stale.push(CommandId { client: id.client, seq });
                    }
                }
            }
            stale.extend(self.records.keys().filter(|r| r.client == id.client).copied());
            stale.sort_unstable();
            stale.dedup();
            for old in stale.into_iter().filter(|o| o.seq < cmd.first_incomplete) {
                if self.records.get(&old).is_some_and(Option::is_none) {
                    continue;
                }
                c = c.delete(crate::curp::DEDUP, crate::curp::dedup_key(old));
                self.records.insert(old, None);
            }
            c = c.put(crate::curp::CLIENTS, client, bincode::serialize(&cmd.first_incomplete).map_err(io_err)?);
            self.floors.insert(id.client, cmd.first_incomplete);
        }
        *command = c;
        Ok((response, Some(id)))
    }
}

/// Runs one etcd write request; returns the encoded response and a new compaction point.
fn execute(
    w: &mut Writer<'_, '_>,
    req: &Request,
    revision: i64,
    compact: i64,
) -> Result<(Vec<u8>, Option<i64>), ApplyError> {
    let bad = |e: prost::DecodeError| ApplyError::Invalid(format!("undecodable request: {e}"));
    match req.kind {
        RequestKind::Put => {
            let r = PbPutRequest::decode(req.body.as_slice()).map_err(bad)?;
            Ok((w.put(&r)?.encode_to_vec(), None))
        }
        RequestKind::DeleteRange => {
            let r = PbDeleteRequest::decode(req.body.as_slice()).map_err(bad)?;
            let mut resp = w.delete_range(&r)?;
            if resp.deleted == 0 {
                resp.header = Some(etcd_client::proto::PbResponseHeader { revision, ..Default::default() });
            }
            Ok((resp.encode_to_vec(), None))
        }
        RequestKind::Txn => {
            let r = PbTxnRequest::decode(req.body.as_slice()).map_err(bad)?;
            mvcc::check_txn(&r)?;
            let mut resp = w.txn(&r)?;
            if !w.wrote {
                set_txn_revision(&mut resp, revision);
            }
            Ok((resp.encode_to_vec(), None))
        }
        RequestKind::Publish | RequestKind::Auth | RequestKind::Curp => {
            Err(ApplyError::Invalid("applied elsewhere".into()))
        }
        RequestKind::LeaseGrant => {
            let r = etcd_client::proto::PbLeaseGrantRequest::decode(req.body.as_slice()).map_err(bad)?;
            Ok((crate::lease::grant(w.txn, &r, revision)?.encode_to_vec(), None))
        }
        RequestKind::LeaseRevoke => {
            let r = etcd_client::proto::PbLeaseRevokeRequest::decode(req.body.as_slice()).map_err(bad)?;
            Ok((crate::lease::revoke(w, &r, revision)?.encode_to_vec(), None))
        }
        RequestKind::Compact => {
            let r = PbCompactionRequest::decode(req.body.as_slice()).map_err(bad)?;
            if r.revision <= compact {
                return Err(ApplyError::Compacted);
            }
            if r.revision > revision {
                return Err(ApplyError::FutureRevision);
            }
            let resp = etcd_client::proto::PbCompactionResponse {
                header: Some(etcd_client::proto::PbResponseHeader { revision, ..Default::default() }),
            };
            Ok((resp.encode_to_vec(), Some(r.revision)))
        }
    }
}

/// A txn that wrote nothing reports the current revision everywhere (it took no new one).
fn set_txn_revision(resp: &mut etcd_client::proto::PbTxnResponse, revision: i64) {
    use etcd_client::proto::PbTxnOpResponse as R;
    if let Some(h) = resp.header.as_mut() {
        h.revision = revision;
    }
    for op in &mut resp.responses {
        match op.response.as_mut() {
            Some(R::ResponseRange(r)) => r.header.as_mut().into_iter().for_each(|h| h.revision = revision),
            Some(R::ResponsePut(r)) => r.header.as_mut().into_iter().for_each(|h| h.revision = revision),
            Some(R::ResponseDeleteRange(r)) => r.header.as_mut().into_iter().for_each(|h| h.revision = revision),
            Some(R::ResponseTxn(t)) => set_txn_revision(t, revision),
            None => {}
        }
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    type SnapshotData = SnapshotFile;

    async fn build_snapshot(&mut self) -> io::Result<openraft::alias::SnapshotOf<TypeConfig, SnapshotFile>> {
        let me = self.clone();
        let (meta, snapshot) = tokio::task::spawn_blocking(move || me.build()).await.map_err(io_err)??;
        Ok(openraft::Snapshot { meta, snapshot })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotData = SnapshotFile;
    type SnapshotBuilder = StateMachine;

    async fn applied_state(&mut self) -> io::Result<(Option<LogId>, StoredMembership)> {
        let p = self.shared.progress.lock();
        Ok((p.applied, p.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> io::Result<()>
    where
        Strm: Stream<Item = io::Result<openraft::storage::EntryResponder<TypeConfig>>> + Unpin + OptionalSend,
    {
        // Entries already committed arrive together: take every one that is ready (up to a
        // bound) and apply them as one group, so a busy member pays one engine commit and one
        // WAL write per batch instead of per entry.
        const MAX_BATCH: usize = 1024;
        while let Some(first) = entries.next().await {
            let mut batch = vec![first?];
            while batch.len() < MAX_BATCH {
                match entries.next().now_or_never() {
                    Some(Some(item)) => batch.push(item?),
                    _ => break,
                }
            }
            let (batch, responders): (Vec<Entry>, Vec<_>) = batch.into_iter().unzip();
            let responses = tokio::task::block_in_place(|| self.apply_entries(&batch))?;
            for (responder, response) in responders.into_iter().zip(responses) {
                if let Some(r) = responder {
                    r.send(response);
                }
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, snapshot: SnapshotFile) -> io::Result<()> {
        let applied = self.shared.progress.lock().applied;
        if meta.last_log_id.is_some() && meta.last_log_id <= applied {
            // Never go back: a stale snapshot must not overwrite newer state (openraft #1130).
            return Ok(());
        }
        let me = self.clone();
        let meta2 = meta.clone();
        tokio::task::spawn_blocking(move || -> io::Result<()> {
            let mut file = snapshot;
            // Snapshot file first: once it is durable as `current`, a crash during the install
            // below is finished at the next open (see `open`). `current` cannot be newer than
            // this snapshot (it never is newer than what is applied once `open` returned), so
            // the promotion happens; were it refused, `current` would cover this install.
            me.shared.snaps.promote(&mut file, &meta2)?;
            let mark = me.shared.applied_bytes.load(std::sync::atomic::Ordering::Relaxed);
            me.shared.snapshot_mark.store(mark, std::sync::atomic::Ordering::Relaxed);
            me.install_file(&meta2, &file)
        })
        .await
        .map_err(io_err)?
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> io::Result<Option<openraft::alias::SnapshotOf<TypeConfig, SnapshotFile>>> {
        let me = self.clone();
        let current = tokio::task::spawn_blocking(move || me.shared.snaps.current()).await.map_err(io_err)??;
        Ok(current.map(|(meta, snapshot)| openraft::Snapshot { meta, snapshot }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn a_snapshot_is_due_after_the_count_and_a_share_of_the_last_snapshots_bytes() {
        // The count is a floor: never before it, whatever the bytes.
        assert!(!snapshot_due(9_999, u64::MAX, 0, 10_000, 50));
        // A small state: the count decides.
        assert!(snapshot_due(10_000, 1_000_000, 4096, 10_000, 50));
        // A large state: wait until the entries carry half its size.
        assert!(!snapshot_due(10_000, 1_000_000, 190_000_000, 10_000, 50));
        assert!(!snapshot_due(900_000, 94_999_999, 190_000_000, 10_000, 50));
        assert!(snapshot_due(950_000, 95_000_000, 190_000_000, 10_000, 50));
        // 0 %: the count alone, as etcd's --snapshot-count.
        assert!(snapshot_due(10_000, 0, 190_000_000, 10_000, 0));
        // No snapshot yet.
        assert!(snapshot_due(10_000, 0, 0, 10_000, 50));
    }
    use etcd_client::proto::{
        PbCompare, PbDeleteResponse, PbRangeRequest, PbTxnOpRequest, PbTxnRequestOp, PbTxnResponse,
    };
    use openraft::entry::RaftEntry;
    use openraft::vote::RaftLeaderId;

    fn entry(index: u64, kind: RequestKind, body: Vec<u8>) -> Entry {
        let leader = openraft::alias::CommittedLeaderIdOf::<TypeConfig>::new(1, 1);
        Entry::new_normal(LogId::new(leader, index), Request::new(kind, body))
    }

    fn put(k: &str, v: &str) -> PbPutRequest {
        PbPutRequest { key: k.into(), value: v.into(), prev_kv: true, ..Default::default() }
    }

    fn op(r: PbTxnOpRequest) -> PbTxnRequestOp {
        PbTxnRequestOp { request: Some(r) }
    }

    /// Requests whose outcomes depend on what the requests before them wrote, failed ones
    /// (whose writes must not be seen by later ones) and reads inside txns.
    fn requests() -> Vec<(RequestKind, Vec<u8>)> {
        let version_is = |k: &str, v: i64| PbCompare {
            key: k.into(),
            target: 0, // version
            result: 0, // equal
            target_union: Some(etcd_client::proto::PbTargetUnion::Version(v)),
            ..Default::default()
        };
        let del = |k: &str, end: &str| PbDeleteRequest { key: k.into(), range_end: end.into(), prev_kv: true };
        let range = |k: &str, end: &str| PbRangeRequest { key: k.into(), range_end: end.into(), ..Default::default() };
        vec![
            (RequestKind::Put, put("a", "1").encode_to_vec()),
            (RequestKind::Put, put("a", "2").encode_to_vec()),
            (RequestKind::Put, put("b", "1").encode_to_vec()),
            // Succeeds only if it sees both puts of `a` (version 2).
            (
                RequestKind::Txn,
                PbTxnRequest {
                    compare: vec![version_is("a", 2)],
                    success: vec![
                        op(PbTxnOpRequest::RequestPut(put("c", "t"))),
                        op(PbTxnOpRequest::RequestRange(range("a", "z"))),
                    ],
                    failure: vec![op(PbTxnOpRequest::RequestPut(put("c", "f")))],
                }
                .encode_to_vec(),
            ),
            // Fails at apply (a lease that does not exist): writes nothing, takes no revision.
            (RequestKind::Put, PbPutRequest { key: "d".into(), lease: 7, ..Default::default() }.encode_to_vec()),
            (
                RequestKind::Txn,
                PbTxnRequest {
                    compare: vec![version_is("d", 0)],
                    success: vec![op(PbTxnOpRequest::RequestPut(put("e", "d-absent")))],
                    failure: vec![],
                }
                .encode_to_vec(),
            ),
            (RequestKind::DeleteRange, del("a", "c").encode_to_vec()),
            // A range inside a txn after the delete: only c and e remain.
            (
                RequestKind::Txn,
                PbTxnRequest {
                    compare: vec![],
                    success: vec![
                        op(PbTxnOpRequest::RequestRange(range("a", "\0"))),
                        op(PbTxnOpRequest::RequestPut(put("a", "3"))),
                    ],
                    failure: vec![],
                }
                .encode_to_vec(),
            ),
            (RequestKind::DeleteRange, del("zz", "").encode_to_vec()),
            (
                RequestKind::Compact,
                etcd_client::proto::PbCompactionRequest { revision: 2, physical: false }.encode_to_vec(),
            ),
            // A txn that fails half way (its second put names a missing lease): its first
            // put must not be seen by the next request.
            (
                RequestKind::Txn,
                PbTxnRequest {
                    compare: vec![],
                    success: vec![
                        op(PbTxnOpRequest::RequestPut(put("x", "1"))),
                        op(PbTxnOpRequest::RequestPut(PbPutRequest {
                            key: "y".into(),
                            lease: 7,
                            ..Default::default()
                        })),
                    ],
                    failure: vec![],
                }
                .encode_to_vec(),
            ),
            (
                RequestKind::Txn,
                PbTxnRequest {
                    compare: vec![version_is("x", 0)],
                    success: vec![op(PbTxnOpRequest::RequestPut(put("f", "x-absent")))],
                    failure: vec![],
                }
                .encode_to_vec(),
            ),
            (RequestKind::Put, put("a", "4").encode_to_vec()),
            // Leases (from index 13): grants take no revision; puts attach, re-puts detach;
            // a revoke deletes its keys in one revision, or takes none if it has no keys.
            (RequestKind::LeaseGrant, grant(100, 10)),
            (RequestKind::Put, leased("g", 100)),
            (
                RequestKind::Txn,
                PbTxnRequest {
                    compare: vec![],
                    success: vec![
                        op(PbTxnOpRequest::RequestPut(PbPutRequest {
                            key: "h".into(),
                            lease: 100,
                            ..Default::default()
                        })),
                        op(PbTxnOpRequest::RequestPut(put("a", "5"))),
                    ],
                    failure: vec![],
                }
                .encode_to_vec(),
            ),
            (RequestKind::LeaseGrant, grant(100, 10)),
            (RequestKind::LeaseGrant, grant(102, crate::lease::MAX_TTL_SECS + 1)),
            (
                RequestKind::Put,
                PbPutRequest { key: "g".into(), value: "g2".into(), ignore_lease: true, ..Default::default() }
                    .encode_to_vec(),
            ),
            (RequestKind::Put, put("h", "h2").encode_to_vec()),
            (RequestKind::LeaseRevoke, etcd_client::proto::PbLeaseRevokeRequest { id: 100 }.encode_to_vec()),
            (RequestKind::LeaseRevoke, etcd_client::proto::PbLeaseRevokeRequest { id: 100 }.encode_to_vec()),
            (RequestKind::LeaseGrant, grant(101, 10)),
            (RequestKind::Put, leased("i", 101)),
            (RequestKind::DeleteRange, del("i", "").encode_to_vec()),
            (RequestKind::LeaseRevoke, etcd_client::proto::PbLeaseRevokeRequest { id: 101 }.encode_to_vec()),
            (RequestKind::Put, leased("j", 101)),
        ]
    }

    fn grant(id: i64, ttl: i64) -> Vec<u8> {
        etcd_client::proto::PbLeaseGrantRequest { id, ttl }.encode_to_vec()
    }

    fn leased(k: &str, lease: i64) -> Vec<u8> {
        PbPutRequest { key: k.into(), value: "v".into(), lease, ..Default::default() }.encode_to_vec()
    }

    fn table(sm: &StateMachine, name: &str) -> mvcc::Rows {
        let txn = sm.shared.db.begin_read().unwrap();
        txn.scan(name, keeldb::ScanRange::all()).unwrap().map(|r| r.unwrap()).collect()
    }

    fn err(r: &Response) -> ApplyError {
        match r {
            Response::Err(e) => e.clone(),
            other => panic!("expected an error, got {other:?}"),
        }
    }

    fn dump(sm: &StateMachine) -> (i64, i64, mvcc::Rows) {
        let (mut txn, rev) = sm.shared.read_at(0).unwrap();
        let rows = mvcc::View::scan_raw(&mut txn, b"", None).unwrap();
        (rev, sm.shared.progress.lock().compact_revision, rows)
    }

    fn curp(client: u64, seq: u64, first_incomplete: u64, k: &str, v: &str) -> (RequestKind, Vec<u8>) {
        let cmd = crate::curp::Command {
            id: CommandId { client, seq },
            first_incomplete,
            kind: RequestKind::Put,
            body: put(k, v).encode_to_vec(),
        };
        (RequestKind::Curp, bincode::serialize(&cmd).unwrap())
    }

    /// A CURP command applies once per id (a copy later in the same batch or in a later batch
    /// is answered from the record and takes no revision), a command below its client's floor
    /// is refused, and records below the floor are forgotten. Batched and one by one agree.
    #[test]
    fn curp_commands_apply_once_per_id() {
        let requests = vec![
            curp(7, 1, 1, "x", "1"),
            curp(7, 1, 1, "x", "1"), // a retry in the same batch
            curp(7, 2, 1, "x", "2"),
            curp(9, 1, 1, "y", "1"), // another client, its own sequence
            curp(7, 2, 1, "x", "2"), // a late copy of 2
            curp(7, 3, 3, "x", "3"), // the client has the answers of 1 and 2
            curp(7, 1, 1, "x", "1"), // a copy of 1 after that: refused
            curp(7, 3, 3, "x", "3"),
            curp(9, 100, 100, "y", "100"), // a long jump: the client's records are scanned
        ];
        let entries: Vec<Entry> =
            requests.into_iter().enumerate().map(|(i, (k, b))| entry(i as u64 + 1, k, b)).collect();
        let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let one = StateMachine::open(d1.path(), Arc::new(keeldb::fs::StdFs)).unwrap();
        let all = StateMachine::open(d2.path(), Arc::new(keeldb::fs::StdFs)).unwrap();
        let singly: Vec<Response> =
            entries.iter().flat_map(|e| one.apply_entries(std::slice::from_ref(e)).unwrap()).collect();
        let batched = all.apply_entries(&entries).unwrap();
        assert_eq!(singly, batched);
        let rev = |r: &Response| match r {
            Response::Ok(b) => PbPutResponse::decode(b.as_slice()).unwrap().header.unwrap().revision,
            r => panic!("{r:?}"),
        };
        assert_eq!([rev(&batched[0]), rev(&batched[2]), rev(&batched[3]), rev(&batched[5])], [2, 3, 4, 5]);
        assert_eq!(batched[1], batched[0]);
        assert_eq!(batched[4], batched[2]);
        assert_eq!(batched[7], batched[5]);
        assert!(
            matches!(&batched[6], Response::Err(ApplyError::Invalid(w)) if w.contains("older")),
            "{:?}",
            batched[6]
        );
        for sm in [&one, &all] {
            assert_eq!(sm.shared.progress.lock().revision, 6);
            let kept: Vec<Vec<u8>> = table(sm, crate::curp::DEDUP).into_iter().map(|(k, _)| k).collect();
            let want: Vec<Vec<u8>> = [(7, 3), (9, 100)]
                .into_iter()
                .map(|(client, seq)| crate::curp::dedup_key(CommandId { client, seq }).to_vec())
                .collect();
            assert_eq!(kept, want);
            assert!(sm.shared.curp_result(CommandId { client: 7, seq: 3 }).unwrap().is_some());
            assert!(sm.shared.curp_result(CommandId { client: 7, seq: 1 }).unwrap().is_none());
        }
    }

    /// The largest `mod_revision` a read of every key at `revision` returns, and the header.
    fn read_all(sm: &StateMachine, revision: i64) -> Result<(i64, i64), ApplyError> {
        let (mut txn, header) = sm.shared.read_at(revision)?;
        let req =
            etcd_client::proto::PbRangeRequest { key: vec![0], range_end: vec![0], revision, ..Default::default() };
        let resp = mvcc::range(&mut txn, &req, header)?;
        Ok((resp.kvs.iter().map(|kv| kv.mod_revision).max().unwrap_or(0), header))
    }

    /// The apply path makes a batch visible in the engine before `Progress` records it. A
    /// read in between must still report a header revision at least every `mod_revision` it
    /// returns, and a read at a revision `Progress` does not know yet must wait for it, never
    /// serve newer data. Here `Progress` is held one put behind the engine, as a reader
    /// racing the apply path sees it.
    #[test]
    fn a_read_reports_the_revision_of_its_own_view_when_progress_lags() {
        let dir = tempfile::tempdir().unwrap();
        let sm = StateMachine::open(dir.path(), Arc::new(keeldb::fs::StdFs)).unwrap();
        let puts: Vec<Entry> =
            (0..3).map(|i| entry(i + 1, RequestKind::Put, put(&format!("k{i}"), "v").encode_to_vec())).collect();
        sm.apply_entries(&puts).unwrap();
        assert_eq!(sm.shared.progress.lock().revision, 4);
        // Roll `Progress` back one revision: the engine holds revision 4, `Progress` says 3.
        {
            let mut p = sm.shared.progress.lock();
            p.revision = 3;
            p.revs.pop_back();
        }
        let (max_mod, header) = read_all(&sm, 0).unwrap();
        assert_eq!(max_mod, 4);
        assert!(header >= max_mod, "header {header} below a returned mod_revision {max_mod}");
        assert_eq!(sm.shared.visible_revision(), 4);
        // A read at the revision `Progress` lacks is served from the newest view (it is that
        // revision), and a read at an older one is served at that revision exactly.
        assert_eq!(read_all(&sm, 4).unwrap(), (4, 4));
        assert_eq!(read_all(&sm, 3).unwrap(), (3, 4));
        assert_eq!(read_all(&sm, 5), Err(ApplyError::FutureRevision));
    }

    /// A read at a revision the engine shows but `Progress` has not recorded yet waits for the
    /// apply path to record it (it holds `applying` until then) instead of serving the newest
    /// revision `Progress` knows, which lacks that revision's writes.
    #[test]
    fn a_read_at_a_revision_progress_lacks_waits_for_the_apply_path() {
        let dir = tempfile::tempdir().unwrap();
        let sm = StateMachine::open(dir.path(), Arc::new(keeldb::fs::StdFs)).unwrap();
        let puts: Vec<Entry> =
            (0..4).map(|i| entry(i + 1, RequestKind::Put, put(&format!("k{i}"), "v").encode_to_vec())).collect();
        sm.apply_entries(&puts).unwrap();
        // As the apply path leaves things between making revisions 4 and 5 visible and
        // recording them: `Progress` at 3, `applying` held.
        let applying = sm.shared.applying.write();
        let recorded: Vec<(i64, u64)> = {
            let mut p = sm.shared.progress.lock();
            let tail = vec![p.revs.pop_back().unwrap(), p.revs.pop_back().unwrap()];
            p.revision = 3;
            tail
        };
        let reader = {
            let sm = sm.clone();
            std::thread::spawn(move || read_all(&sm, 4))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        {
            let mut p = sm.shared.progress.lock();
            p.revs.extend(recorded.into_iter().rev());
            p.revision = 5;
        }
        drop(applying);
        assert_eq!(reader.join().unwrap(), Ok((4, 5)));
    }

    /// The same invariant under a real race: one thread applies puts one entry at a time while
    /// readers check every answer's header against the revisions in its body.
    #[test]
    fn reads_racing_the_apply_path_never_report_a_header_below_their_data() {
        let dir = tempfile::tempdir().unwrap();
        let sm = StateMachine::open(dir.path(), Arc::new(keeldb::fs::StdFs)).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (sm, stop) = (sm.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut last = 0;
                    let mut reads = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) && reads < 2_000_000 {
                        let (max_mod, header) = read_all(&sm, 0).unwrap();
                        assert!(header >= max_mod, "header {header} below a returned mod_revision {max_mod}");
                        assert!(header >= last, "header went back from {last} to {header}");
                        // A read at a revision just seen is served at exactly that revision:
                        // every revision is a put, so its newest key has that mod_revision.
                        if header > 1 {
                            let (at_mod, _) = read_all(&sm, header).unwrap();
                            assert_eq!(at_mod, header, "a read at {header} returned another revision's state");
                        }
                        last = header;
                        reads += 1;
                    }
                    reads
                })
            })
            .collect();
        for i in 0..2_000u64 {
            let e = entry(i + 1, RequestKind::Put, put(&format!("k{}", i % 4), "v").encode_to_vec());
            sm.apply_entries(std::slice::from_ref(&e)).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
    }

    #[test]
    fn a_batch_applies_exactly_as_its_entries_one_by_one() {
        let entries: Vec<Entry> =
            requests().into_iter().enumerate().map(|(i, (k, b))| entry(i as u64 + 1, k, b)).collect();
        let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let one = StateMachine::open(d1.path(), Arc::new(keeldb::fs::StdFs)).unwrap();
        let all = StateMachine::open(d2.path(), Arc::new(keeldb::fs::StdFs)).unwrap();
        let singly: Vec<Response> =
            entries.iter().flat_map(|e| one.apply_entries(std::slice::from_ref(e)).unwrap()).collect();
        let batched = all.apply_entries(&entries).unwrap();
        assert_eq!(singly, batched);
        // The outcomes are the ones etcd gives, not merely equal: the txn saw both puts, the
        // failed put wrote nothing, the delete removed a and b.
        let txn = PbTxnResponse::decode(match &batched[3] {
            Response::Ok(b) => b.as_slice(),
            r => panic!("{r:?}"),
        })
        .unwrap();
        assert!(txn.succeeded);
        assert!(matches!(batched[4], Response::Err(ApplyError::LeaseNotFound)));
        let del = PbDeleteResponse::decode(match &batched[6] {
            Response::Ok(b) => b.as_slice(),
            r => panic!("{r:?}"),
        })
        .unwrap();
        assert_eq!(del.deleted, 2);
        assert_eq!(dump(&one), dump(&all));
        for t in [crate::lease::LEASES, crate::lease::LEASE_KEYS] {
            assert_eq!(table(&one, t), table(&all, t), "{t}");
        }
        // The lease requests: errors as etcd's, the revoke of 100 deleted its one key (g; h
        // was detached by a put without a lease) at one new revision, the revoke of 101 (its
        // key deleted before) took none, and a put naming the revoked lease failed.
        assert_eq!(err(&batched[16]), ApplyError::LeaseExist);
        assert_eq!(err(&batched[17]), ApplyError::LeaseTtlTooLarge);
        assert_eq!(err(&batched[21]), ApplyError::LeaseNotFound);
        assert_eq!(err(&batched[26]), ApplyError::LeaseNotFound);
        let revoked_at = |i: usize| match &batched[i] {
            Response::Ok(b) => {
                etcd_client::proto::PbLeaseRevokeResponse::decode(b.as_slice()).unwrap().header.unwrap().revision
            }
            r => panic!("{r:?}"),
        };
        assert_eq!((revoked_at(20), revoked_at(25)), (15, 17));
        assert!(table(&all, crate::lease::LEASES).is_empty() && table(&all, crate::lease::LEASE_KEYS).is_empty());
        let (rev, compact, rows) = dump(&all);
        // etcd starts at revision 1; sixteen requests wrote.
        assert_eq!((rev, compact), (17, 2));
        assert_eq!(rows.iter().map(|(k, _)| k.as_slice()).collect::<Vec<_>>(), [&b"a"[..], b"c", b"e", b"f", b"h"]);
        let h = mvcc::Record::decode(&rows[4].1).unwrap();
        assert_eq!((h.lease, h.value.as_slice()), (0, &b"h2"[..]));
        // Every revision kept its own engine snapshot: reads in the past see each step.
        for r in 3..=17 {
            let (mut a, _) = all.shared.read_at(r).unwrap();
            let (mut b, _) = one.shared.read_at(r).unwrap();
            assert_eq!(
                mvcc::View::scan_raw(&mut a, b"", None).unwrap(),
                mvcc::View::scan_raw(&mut b, b"", None).unwrap(),
                "revision {r}"
            );
        }
        let (mut at3, _) = all.shared.read_at(3).unwrap();
        let a_at_3 = mvcc::Record::decode(&mvcc::View::get_raw(&mut at3, b"a").unwrap().unwrap()).unwrap();
        assert_eq!((a_at_3.value.as_slice(), a_at_3.version), (&b"2"[..], 2));
        assert_eq!(all.shared.applied_index(), entries.len() as u64);
    }
}
