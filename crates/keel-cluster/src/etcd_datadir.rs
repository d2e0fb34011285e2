//! `keel serve` on a data directory made by etcd's tools (`etcdutl snapshot restore`, or an
//! etcd member's own): the member imports etcd's backend database (`member/snap/db`) as its
//! initial state, through the same path as `keel snapshot-restore` of an etcd snapshot
//! ([`crate::etcd_snapshot::restore`]), and then runs as a keel member in that directory.
//!
//! Before anything is written it checks what etcd's WAL (`member/wal`) says: the log must hold
//! no client write the database has not applied (an entry past the database's
//! `consistent_index` that carries a request), or importing the database alone would lose
//! acknowledged writes; and the member, the cluster and the membership the directory records
//! must be the ones the flags name.
//!
//! The commit point is the identity file: keel's state is built beside etcd's files and made
//! durable, then the identity is written (atomically, durably); only then are etcd's files
//! moved aside into `member/etcd-imported/`, where etcd no longer finds them. See
//! `docs/design/recovery.md` for the argument case by case.
//!
//! What it must not do: modify or remove any etcd file before the identity is durable, or
//! start from a directory with etcd files that it has not checked.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keeldb::fs::FileSystem;

use crate::config::ServeConfig;
use crate::etcd_snapshot::{self, bbolt, schema, wal};
use crate::files;

/// Where etcd's files go once the import is durable (etcd does not look there).
pub const IMPORTED: &str = "etcd-imported";
/// The directories keel's member keeps in `member/`; anything of these in a directory that
/// is still etcd's is left by an import that did not finish.
const KEEL_DIRS: [&str; 3] = ["sm", "raft", "witness"];

/// Why an etcd data directory cannot be imported.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    #[error("member/snap/db: {0}")]
    Database(etcd_snapshot::Error),
    #[error("member/wal: {0}")]
    Wal(wal::WalError),
    #[error(
        "member/wal holds {count} request(s) the database has not applied (raft indexes {first}..={last}, \
         the database's consistent_index is {consistent_index}): importing it would lose them. Start etcd on \
         this directory once so it applies them, stop it, and start keel again"
    )]
    UnappliedEntries { consistent_index: u64, first: u64, last: u64, count: usize },
    #[error("the etcd directory is member {recorded:x}'s, the flags make this member {flags:x}")]
    OtherMember { recorded: u64, flags: u64 },
    #[error("the etcd directory is cluster {recorded:x}'s, the flags make cluster {flags:x}")]
    OtherCluster { recorded: u64, flags: u64 },
    #[error("the etcd directory records members {recorded}, the flags (--initial-cluster, --initial-cluster-token) give {flags}")]
    Membership { recorded: String, flags: String },
    #[error("an etcd data directory founds a new cluster here: start it with --initial-cluster-state new")]
    JoinExisting,
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> ImportError + '_ {
    move |source| ImportError::Io { path: path.display().to_string(), source }
}

/// What an import found and made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Imported {
    /// The revision the member continues from.
    pub revision: i64,
    pub compact_revision: i64,
    pub consistent_index: u64,
    pub keys: usize,
}

/// Whether `member_dir` holds etcd's files: `snap/db` or `wal/`.
pub fn has_etcd_files(fs: &dyn FileSystem, member_dir: &Path) -> io::Result<bool> {
    Ok(fs.exists(&member_dir.join("snap").join("db"))? || fs.exists(&member_dir.join("wal"))?)
}

/// Reads and checks everything the import needs, writing nothing: the database's state and
/// what the WAL and the membership say against the flags.
fn check(config: &ServeConfig, member_dir: &Path) -> Result<etcd_snapshot::EtcdState, ImportError> {
    let fs = config.fs.as_ref();
    if config.join_existing {
        return Err(ImportError::JoinExisting);
    }
    let db_path = member_dir.join("snap").join("db");
    let db_bytes = files::read(fs, &db_path).map_err(io_at(&db_path))?.ok_or_else(|| ImportError::Io {
        path: db_path.display().to_string(),
        source: io::ErrorKind::NotFound.into(),
    })?;
    let state = etcd_snapshot::read(&db_bytes).map_err(ImportError::Database)?;
    let recorded_members =
        bbolt::Db::open(&db_bytes).and_then(|db| schema::member_ids(&db)).map_err(ImportError::Database)?;
    drop(db_bytes);
    let log = read_wal(fs, &member_dir.join("wal"))?;
    check_entries(&log, state.consistent_index)?;
    check_identity(config, &log, &recorded_members)?;
    Ok(state)
}

/// Reads the WAL's segments in order.
fn read_wal(fs: &dyn FileSystem, dir: &Path) -> Result<wal::Wal, ImportError> {
    let names = wal::segment_order(&fs.list_dir(dir).map_err(io_at(dir))?).map_err(ImportError::Wal)?;
    let mut reader = wal::Reader::default();
    for (i, name) in names.iter().enumerate() {
        let path = dir.join(name);
        let bytes = files::read(fs, &path).map_err(io_at(&path))?.unwrap_or_default();
        reader.segment(&bytes, i + 1 == names.len()).map_err(ImportError::Wal)?;
    }
    Ok(reader.finish())
}

/// Refuses a log with a client write past what the database applied. etcd's leader writes an
/// empty normal entry at each election and a restore writes configuration changes only: those
/// carry no state the database lacks.
pub fn check_entries(log: &wal::Wal, consistent_index: u64) -> Result<(), ImportError> {
    let unapplied: Vec<u64> = log
        .entries
        .iter()
        .filter(|e| e.index > consistent_index && e.kind == wal::ENTRY_NORMAL && e.data_bytes > 0)
        .map(|e| e.index)
        .collect();
    match (unapplied.first(), unapplied.last()) {
        (Some(&first), Some(&last)) => {
            Err(ImportError::UnappliedEntries { consistent_index, first, last, count: unapplied.len() })
        }
        _ => Ok(()),
    }
}

fn hex_list(ids: &[u64]) -> String {
    let ids: Vec<String> = ids.iter().map(|id| format!("{id:x}")).collect();
    format!("[{}]", ids.join(", "))
}

/// The directory must be this member's of this cluster, as the flags derive them (etcd's own
/// derivation, so the same flags given to `etcdutl snapshot restore` and `keel serve` agree).
fn check_identity(config: &ServeConfig, log: &wal::Wal, recorded: &[u64]) -> Result<(), ImportError> {
    let (member, cluster) = (config.member_id(), config.cluster_id());
    if let Some(id) = log.member_id.filter(|&id| id != member) {
        return Err(ImportError::OtherMember { recorded: id, flags: member });
    }
    if let Some(id) = log.cluster_id.filter(|&id| id != cluster) {
        return Err(ImportError::OtherCluster { recorded: id, flags: cluster });
    }
    let flags: Vec<u64> = config.initial_members().into_keys().collect();
    // A backend from before etcd 3.5 records no members; the WAL's ids were checked above.
    if !recorded.is_empty() && recorded != flags.as_slice() {
        return Err(ImportError::Membership { recorded: hex_list(recorded), flags: hex_list(&flags) });
    }
    Ok(())
}

/// Imports the etcd directory `member_dir` as this member's state and writes the identity
/// (`identity` is its path and `line` its text: the caller owns that file's format). Then
/// moves etcd's files aside. Idempotent over crashes: a directory with etcd files and no
/// identity is imported from scratch (leftovers of an earlier attempt removed first).
pub fn import(config: &ServeConfig, member_dir: &Path, identity: &Path, line: &str) -> Result<Imported, ImportError> {
    let fs = config.fs.as_ref();
    let state = check(config, member_dir)?;
    for name in KEEL_DIRS {
        let dir = member_dir.join(name);
        if fs.exists(&dir).map_err(io_at(&dir))? {
            files::remove_tree(fs, &dir).map_err(io_at(&dir))?;
        }
    }
    let sm = member_dir.join("sm");
    files::create_dir_durably(fs, &sm).map_err(io_at(&sm))?;
    let revision = etcd_snapshot::restore(&sm, &state, Arc::clone(&config.fs)).map_err(ImportError::Database)?;
    // The member snapshots this state for later members before it serves them (`node.rs`).
    let marker = sm.join(crate::node::RESTORED);
    files::write_durably(fs, &marker, b"").map_err(io_at(&marker))?;
    // The commit point: from here the directory is a keel member's.
    files::write_durably(fs, identity, line.as_bytes()).map_err(io_at(identity))?;
    set_aside(fs, member_dir)?;
    Ok(Imported {
        revision,
        compact_revision: state.compact_revision,
        consistent_index: state.consistent_index,
        keys: state.keys.len(),
    })
}

/// Moves etcd's `snap/` and `wal/` into `etcd-imported/` (kept, not removed: they are the way
/// back to etcd, and the import's record of what it read). Run after the identity is durable,
/// and again at each start while any is left (a crash between the two renames).
pub fn set_aside(fs: &dyn FileSystem, member_dir: &Path) -> Result<(), ImportError> {
    let aside = member_dir.join(IMPORTED);
    for name in ["snap", "wal"] {
        let from = member_dir.join(name);
        if !fs.exists(&from).map_err(io_at(&from))? {
            continue;
        }
        files::create_dir_durably(fs, &aside).map_err(io_at(&aside))?;
        let to: PathBuf = aside.join(name);
        if fs.exists(&to).map_err(io_at(&to))? {
            // Only an earlier import's own copy can be there; the newer files win.
            files::remove_tree(fs, &to).map_err(io_at(&to))?;
        }
        fs.rename(&from, &to).map_err(io_at(&from))?;
        fs.sync_dir(&aside).map_err(io_at(&aside))?;
        fs.sync_dir(member_dir).map_err(io_at(member_dir))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use wal::{entry, ENTRY_NORMAL};

    fn log_of(entries: &[(i64, Vec<u8>)]) -> wal::Wal {
        wal::read(&[wal::encode(entries)]).unwrap()
    }

    #[test]
    fn only_client_writes_past_the_consistent_index_are_refused() {
        let restored = log_of(&[entry(1, 1, 1, b"add member"), entry(ENTRY_NORMAL, 2, 2, b"")]);
        check_entries(&restored, 1).unwrap();
        let running =
            log_of(&[entry(1, 1, 1, b"add"), entry(0, 2, 2, b""), entry(0, 2, 3, b"put"), entry(0, 2, 4, b"put")]);
        check_entries(&running, 4).unwrap();
        let err = check_entries(&running, 2).unwrap_err();
        assert!(
            matches!(err, ImportError::UnappliedEntries { consistent_index: 2, first: 3, last: 4, count: 2 }),
            "{err}"
        );
    }
}
