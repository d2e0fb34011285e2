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

use std::collections::VecDeque;
use std::io;
use std::path::Path;
use std::sync::Arc;

use etcd_client::proto::{PbCompactionRequest, PbDeleteRequest, PbPutRequest, PbTxnRequest};
use futures_util::{Stream, StreamExt};
use keeldb::{Database, Durability, InstallOptions, LogPosition, Options, ReadTxn};
use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
use openraft::{EntryPayload, OptionalSend};
use parking_lot::Mutex;
use prost::Message;

use crate::mvcc::{self, Writer, COMPACT_KEY, META, REV_KEY};
use crate::snapshot_file::{SnapshotFile, Snapshots};
use crate::types::{ApplyError, LogId, Request, RequestKind, Response, SnapshotMeta, StoredMembership, TypeConfig};

const APPLIED_KEY: &[u8] = b"applied";
const MEMBERSHIP_KEY: &[u8] = b"membership";
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

/// State shared by the state machine, its snapshot builders and the API's readers.
pub struct Shared {
    pub db: Database,
    /// `KEEL_APPLY_TRACE` set: one line per applied entry (index, term, leader, digest of the
    /// request, revision after), so members' applies can be compared after a fault run.
    trace: Option<Mutex<std::io::BufWriter<std::fs::File>>>,
    /// The snapshot files (`snap`).
    pub snaps: Snapshots,
    pub progress: Mutex<Progress>,
    /// The applied log index, for readers waiting on a read index.
    pub applied_tx: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    /// A read view at `revision` (0: newest) and the header revision to report.
    pub fn read_at(&self, revision: i64) -> Result<(ReadTxn, i64), ApplyError> {
        let p = self.progress.lock();
        if revision <= 0 || revision >= p.revision {
            if revision > p.revision {
                return Err(ApplyError::FutureRevision);
            }
            let current = p.revision;
            drop(p);
            let txn = self.db.begin_read().map_err(|e| ApplyError::Invalid(e.to_string()))?;
            return Ok((txn, current));
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
        let current = p.revision;
        drop(p);
        let txn = self.db.begin_read_at(ts).map_err(|e| match e {
            keeldb::Error::Compacted { .. } => ApplyError::Compacted,
            other => ApplyError::Invalid(other.to_string()),
        })?;
        Ok((txn, current))
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

/// Reads revision, compaction, applied id and membership as of `txn`; history begins there.
fn progress_of(txn: &ReadTxn) -> io::Result<Progress> {
    let revision = read_i64(txn, REV_KEY)?.max(1);
    let mut revs = VecDeque::new();
    revs.push_back((revision, txn.snapshot_ts()));
    Ok(Progress {
        revision,
        compact_revision: read_i64(txn, COMPACT_KEY)?,
        revs,
        applied: read_meta(txn, APPLIED_KEY)?,
        membership: read_meta(txn, MEMBERSHIP_KEY)?.unwrap_or_default(),
    })
}

/// Makes `dir` (the `sm` directory of a new cluster's member) hold the keys and revision of
/// `checkpoint`, a `Maintenance.Snapshot` stream. The stream is installed into a scratch store
/// first (which checks it whole); then only the keys and the revision and compaction point are
/// copied into a fresh store. The old cluster's applied position (which the engine keeps with
/// the data and would refuse the new log's positions against), membership and published members
/// stay behind, so the new cluster's log starts at its own first entry and revisions continue
/// from the snapshot's. Checkpointed before returning (durable). Returns the revision.
pub fn restore(dir: &Path, checkpoint: &[u8]) -> io::Result<i64> {
    let scratch_dir = dir.join("restore.scratch");
    let scratch = Database::open(&scratch_dir, Options::with_durability(Durability::Relaxed)).map_err(io_err)?;
    let opts = InstallOptions { expected_bytes: Some(checkpoint.len() as u64), ..InstallOptions::default() };
    let mut input = checkpoint;
    scratch.install_checkpoint_with(&mut input, opts).map_err(io_err)?;
    let from = scratch.begin_read().map_err(io_err)?;
    let revision = read_i64(&from, REV_KEY)?;
    let db = Database::open(dir.join("store"), Options::with_durability(Durability::Relaxed)).map_err(io_err)?;
    let mut txn = db.begin_write().map_err(io_err)?;
    let mut in_txn = 0usize;
    for item in from.scan(mvcc::KV, keeldb::ScanRange::all()).map_err(io_err)? {
        let (key, value) = item.map_err(io_err)?;
        txn.put(mvcc::KV, &key, &value).map_err(io_err)?;
        in_txn += 1;
        if in_txn == 10_000 {
            txn.commit().map_err(io_err)?;
            txn = db.begin_write().map_err(io_err)?;
            in_txn = 0;
        }
    }
    for key in [REV_KEY, COMPACT_KEY] {
        if let Some(v) = from.get(META, key).map_err(io_err)? {
            txn.put(META, key, &v).map_err(io_err)?;
        }
    }
    txn.commit().map_err(io_err)?;
    drop(from);
    db.checkpoint().map_err(io_err)?;
    db.close().map_err(io_err)?;
    scratch.close().map_err(io_err)?;
    std::fs::remove_dir_all(&scratch_dir)?;
    std::fs::create_dir_all(dir.join("snap"))?;
    Ok(revision)
}

impl StateMachine {
    /// Opens the state machine's store in `dir` (relaxed durability; history kept in memory
    /// for reads at past revisions).
    pub fn open(dir: &Path, fs: Arc<dyn keeldb::fs::FileSystem>) -> io::Result<StateMachine> {
        let options = Options { keep_history: true, ..Options::with_durability(Durability::Relaxed) };
        let db = Database::open(dir.join("store"), options).map_err(io_err)?;
        let txn = db.begin_read().map_err(io_err)?;
        let progress = progress_of(&txn)?;
        drop(txn);
        let applied = progress.applied.map_or(0, |a| a.index);
        let (applied_tx, _) = tokio::sync::watch::channel(applied);
        let snaps = Snapshots::open(fs, &dir.join("snap"))?;
        let trace = match std::env::var_os("KEEL_APPLY_TRACE") {
            Some(_) => Some(Mutex::new(std::io::BufWriter::new(
                std::fs::OpenOptions::new().create(true).append(true).open(dir.join("apply.trace"))?,
            ))),
            None => None,
        };
        let sm =
            StateMachine { shared: Arc::new(Shared { db, trace, snaps, progress: Mutex::new(progress), applied_tx }) };
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

    fn apply_one(&self, log_id: LogId, payload: &openraft::alias::EntryPayloadOf<TypeConfig>) -> io::Result<Response> {
        let db = &self.shared.db;
        let mut txn = db.begin_write().map_err(io_err)?;
        let (revision, compact) = {
            let p = self.shared.progress.lock();
            (p.revision, p.compact_revision)
        };
        let mut new_compact = None;
        let mut membership = None;
        let mut publish = None;
        let mut writer = Writer { txn: &mut txn, revision: revision + 1, wrote: false };
        let response = match payload {
            EntryPayload::Blank => Response::Ok(Vec::new()),
            EntryPayload::Membership(m) => {
                membership = Some(StoredMembership::new(Some(log_id), m.clone()));
                Response::Ok(Vec::new())
            }
            EntryPayload::Normal(req) if req.kind == RequestKind::Publish => {
                match bincode::deserialize::<(u64, crate::types::Member)>(&req.body) {
                    Ok(p) => {
                        publish = Some(p);
                        Response::Ok(Vec::new())
                    }
                    Err(e) => Response::Err(ApplyError::Invalid(format!("bad member attributes: {e}"))),
                }
            }
            EntryPayload::Normal(req) => match execute(&mut writer, req, revision, compact) {
                Ok((bytes, c)) => {
                    new_compact = c;
                    Response::Ok(bytes)
                }
                Err(e) => Response::Err(e),
            },
        };
        let wrote = writer.wrote;
        if matches!(response, Response::Err(_)) || !wrote {
            // Nothing a failed or read-only request did may survive: start over with only the
            // bookkeeping below.
            txn = db.begin_write().map_err(io_err)?;
        }
        let put = |txn: &mut keeldb::WriteTxn, key: &[u8], bytes: Vec<u8>| txn.put(META, key, &bytes).map_err(io_err);
        let ok_and_wrote = wrote && matches!(response, Response::Ok(_));
        if ok_and_wrote {
            put(&mut txn, REV_KEY, bincode::serialize(&(revision + 1)).map_err(io_err)?)?;
        }
        if let Some(c) = new_compact {
            put(&mut txn, COMPACT_KEY, bincode::serialize(&c).map_err(io_err)?)?;
        }
        if let Some((id, member)) = &publish {
            txn.put(MEMBERS, &id.to_be_bytes(), &bincode::serialize(member).map_err(io_err)?).map_err(io_err)?;
        }
        if let Some(m) = &membership {
            put(&mut txn, MEMBERSHIP_KEY, bincode::serialize(m).map_err(io_err)?)?;
        }
        put(&mut txn, APPLIED_KEY, bincode::serialize(&log_id).map_err(io_err)?)?;
        let position = LogPosition::new(log_id.index, log_id.leader_id.term);
        let info = txn.commit_as_command(position, Durability::Relaxed).map_err(io_err)?;
        let mut compact_ts = None;
        {
            let mut p = self.shared.progress.lock();
            if ok_and_wrote {
                p.revision = revision + 1;
                p.revs.push_back((revision + 1, info.ts));
            }
            if let Some(c) = new_compact {
                p.compact_revision = c;
                let keep_from = p.revs.partition_point(|r| r.0 <= c).saturating_sub(1);
                p.revs.drain(..keep_from);
                compact_ts = p.revs.front().map(|r| r.1);
            }
            if let Some(m) = membership {
                p.membership = m;
            }
            p.applied = Some(log_id);
        }
        if let Some(ts) = compact_ts {
            // Frees history below the compacted revision (etcd's compaction).
            let _ = db.retain_history_since(ts);
        }
        if let Some(t) = &self.shared.trace {
            use std::io::Write;
            let digest = match payload {
                openraft::EntryPayload::Normal(r) => xxhash_rust::xxh3::xxh3_64(&r.body),
                _ => 0,
            };
            let resp = match &response {
                Response::Ok(b) => xxhash_rust::xxh3::xxh3_64(b),
                Response::Err(_) => 1,
            };
            let rev = self.shared.progress.lock().revision;
            let mut t = t.lock();
            let _ = writeln!(
                t,
                "{} {} {} {digest:x} {resp:x} {rev}",
                log_id.index, log_id.leader_id.term, log_id.leader_id.node_id
            );
            let _ = t.flush();
        }
        self.shared.applied_tx.send_replace(log_id.index);
        Ok(response)
    }

    /// Replaces the store with a snapshot file's checkpoint stream (read through a bounded
    /// buffer) and reloads the progress from it.
    fn install_file(&self, meta: &SnapshotMeta, file: &SnapshotFile) -> io::Result<()> {
        let opts = InstallOptions { expected_bytes: Some(file.checkpoint().len()), ..InstallOptions::default() };
        self.shared.db.install_checkpoint_with(&mut file.checkpoint_reader(), opts).map_err(io_err)?;
        let txn = self.shared.db.begin_read().map_err(io_err)?;
        let progress = progress_of(&txn)?;
        if progress.applied != meta.last_log_id {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "snapshot data and metadata disagree"));
        }
        let applied = progress.applied.map_or(0, |a| a.index);
        *self.shared.progress.lock() = progress;
        if let Some(t) = &self.shared.trace {
            use std::io::Write;
            let mut t = t.lock();
            let _ = writeln!(t, "install {applied} {:?}", meta.last_log_id);
            let _ = t.flush();
        }
        self.shared.applied_tx.send_replace(applied);
        Ok(())
    }

    /// Exports a checkpoint into a snapshot file (metadata from the same engine snapshot)
    /// and makes it `current` (synced, renamed, directory synced) unless a newer one already
    /// is (an install that finished meanwhile).
    fn build(&self) -> io::Result<(SnapshotMeta, SnapshotFile)> {
        let (meta, mut file) = self.shared.export_snapshot("build")?;
        self.shared.snaps.promote(&mut file, &meta)?;
        Ok((meta, file))
    }
}

/// Runs one etcd write request; returns the encoded response and a new compaction point.
fn execute(
    w: &mut Writer<'_>,
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
        RequestKind::Publish => Err(ApplyError::Invalid("member attributes applied elsewhere".into())),
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
        while let Some(item) = entries.next().await {
            let (entry, responder) = item?;
            let me = self.clone();
            let log_id = entry.log_id;
            let response = tokio::task::block_in_place(move || me.apply_one(log_id, &entry.payload))?;
            if let Some(r) = responder {
                r.send(response);
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
