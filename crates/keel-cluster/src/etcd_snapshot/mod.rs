//! Snapshots in etcd's own format, so the migration path from etcd to KeelDB (and back) is a
//! snapshot: [`read`] + [`restore`] turn a file saved by `etcdctl snapshot save` from etcd
//! 3.4–3.6 into a new member's state machine store; [`export`] writes keel's state as such a
//! file, for `etcdutl snapshot status` and `etcdutl snapshot restore`.
//!
//! A snapshot file is a bbolt database (`bbolt.rs`) holding etcd's backend schema
//! (`schema.rs`), plus, when saved through the API, the SHA-256 of the database appended
//! (etcdutl recognizes it by the length: 32 more than a multiple of 512).
//!
//! What is kept: the live keys at the snapshot's newest revision with their create and mod
//! revisions, versions and leases; the revision and compaction point; leases with their TTL;
//! users, roles and whether auth is on. Not kept (as keel's own restore): the history below the
//! revision (reads there answer "compacted"), members and the cluster's identity, alarms.
//!
//! What it must not do: panic or loop on any input (corrupt files are typed errors), or touch
//! the data directory before the whole file has been read and checked.

pub mod bbolt;
pub mod bbolt_writer;
pub mod schema;
pub mod wal;

use std::collections::HashSet;
use std::io::{self, Seek, Write};
use std::path::Path;
use std::sync::Arc;

use keeldb::fs::FileSystem;
use keeldb::{Database, Durability, Options, ReadTxn};
use sha2::{Digest, Sha256};

use bbolt_writer::FileWriter;
use etcd_client::proto::PbKeyValue;

use crate::auth::{AuthOp, AuthState, Perm, Permission};
use crate::mvcc::{Record, COMPACT_KEY, KV, META, REV_KEY};
use crate::{files, lease};
pub use schema::EtcdState;

const HASH: usize = 32;
const ALIGN: usize = 512;
/// Rows per engine transaction while restoring (as keel's own restore).
const ROWS_PER_TXN: usize = 10_000;

/// Why an etcd snapshot cannot be read or restored.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("snapshot checksum mismatch: the last 32 bytes are not the SHA-256 of the rest (damaged file)")]
    HashMismatch,
    #[error("neither a keel snapshot (KEELCKP) nor an etcd one (bbolt database): {0}")]
    NotBbolt(&'static str),
    #[error("the database is truncated: its meta page needs {need} bytes, the file has {have}")]
    Truncated { need: u64, have: u64 },
    #[error("corrupt bbolt page {pgid}: {why}")]
    Page { pgid: u64, why: &'static str },
    #[error("a bucket holds a nested bucket, which etcd's schema never has")]
    NestedBucket,
    #[error("not an etcd backend: bucket `{0}` is missing")]
    MissingBucket(&'static str),
    #[error("corrupt record in bucket `{bucket}` at key {key}: {why}")]
    Record { bucket: &'static str, key: String, why: String },
    #[error("the auth state cannot be rebuilt: {0}")]
    Auth(String),
    #[error("writing the store: {0}")]
    Store(String),
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Error {
        Error::Store(e.to_string())
    }
}

fn store(e: impl std::fmt::Display) -> Error {
    Error::Store(e.to_string())
}

/// Whether `file` is meant as an etcd snapshot (bbolt) rather than keel's own (`KEELCKP`).
/// Anything not keel's is read as etcd's, so a damaged etcd file gets bbolt's errors.
pub fn is_etcd_snapshot(file: &[u8]) -> bool {
    !file.starts_with(b"KEELCKP")
}

/// The database inside a snapshot file: with etcdutl's rule, a length of 32 more than a
/// multiple of 512 means a SHA-256 is appended, which must match; otherwise the file is taken
/// as a bare database (a copy of `member/snap/db`).
pub fn strip_hash(file: &[u8]) -> Result<&[u8], Error> {
    if file.len() % ALIGN != HASH {
        return Ok(file);
    }
    let (db, hash) = file.split_at(file.len() - HASH);
    if Sha256::digest(db).as_slice() != hash {
        return Err(Error::HashMismatch);
    }
    Ok(db)
}

/// Reads an etcd snapshot file whole: hash, pages, schema.
pub fn read(file: &[u8]) -> Result<EtcdState, Error> {
    let db = bbolt::Db::open(strip_hash(file)?)?;
    EtcdState::read(&db)
}

/// Writes the etcd backend database for `state` to `out` (its `keys` ignored: they come from
/// `keys`, in `(mod_revision, key)` order). Returns `out` and the database's length.
fn write_db<W: Write + Seek>(
    state: &EtcdState,
    keys: impl IntoIterator<Item = Result<PbKeyValue, Error>>,
    out: W,
) -> Result<(W, u64), Error> {
    let mut file = FileWriter::new(out)?;
    let mut keys = Some(keys);
    for (name, rows) in state.buckets_but_keys() {
        let streamed = if name == schema::KEY { keys.take() } else { None };
        match streamed {
            Some(keys) => file.bucket(name.as_bytes(), schema::key_rows(keys))?,
            None => file.bucket(name.as_bytes(), rows.into_iter().map(Ok::<_, Error>))?,
        }
    }
    Ok(file.finish()?)
}

/// The snapshot file etcd's tools expect for `state`: the bbolt database and its SHA-256.
pub fn write(state: &EtcdState) -> Result<Vec<u8>, Error> {
    let mut keys: Vec<&PbKeyValue> = state.keys.iter().collect();
    keys.sort_by(|a, b| (a.mod_revision, &a.key).cmp(&(b.mod_revision, &b.key)));
    let (out, _) = write_db(state, keys.into_iter().map(|kv| Ok(kv.clone())), io::Cursor::new(Vec::new()))?;
    let mut file = out.into_inner();
    let hash = Sha256::digest(&file);
    file.extend_from_slice(&hash);
    Ok(file)
}

/// Keel's state as of `txn` as an etcd backend database, written to `out` (a temporary file):
/// every live key, the leases, users, roles and auth, at the store's revision. Returns `out`
/// and the length written. Memory: each key once (to order them by revision), not the values.
///
/// For `Maintenance.Snapshot`: stream these bytes and then their SHA-256, which `etcdctl
/// snapshot save` checks and `etcdutl snapshot restore` strips (the length is a multiple of the
/// page size, so no padding, unlike `backup.rs`'s keel format).
pub fn export_to<W: Write + Seek>(txn: &ReadTxn, out: W) -> Result<(W, u64), Error> {
    let meta_i64 = |key: &[u8]| -> Result<i64, Error> {
        match txn.get(META, key).map_err(store)? {
            Some(v) => bincode::deserialize(&v).map_err(store),
            None => Ok(0),
        }
    };
    let mut state = EtcdState { revision: meta_i64(REV_KEY)?.max(1), ..EtcdState::default() };
    state.compact_revision = meta_i64(COMPACT_KEY)?;
    state.leases = lease::stored_leases(txn).map_err(store)?;
    set_auth(&mut state, &AuthState::load(txn).map_err(Error::Auth)?);
    let mut order = Vec::new();
    for row in txn.scan(KV, keeldb::ScanRange::all()).map_err(store)? {
        let (key, value) = row.map_err(store)?;
        order.push((Record::decode(&value).map_err(store)?.mod_revision, key));
    }
    order.sort();
    let keys = order.into_iter().map(|(_, key)| {
        let value = txn.get(KV, &key).map_err(store)?.ok_or_else(|| store("a key vanished from a read view"))?;
        let r = Record::decode(&value).map_err(store)?;
        Ok(PbKeyValue {
            key,
            create_revision: r.create_revision,
            mod_revision: r.mod_revision,
            version: r.version,
            value: r.value,
            lease: r.lease,
        })
    });
    write_db(&state, keys, out)
}

/// Keel's users, roles and auth switch in etcd's encodings.
fn set_auth(state: &mut EtcdState, auth: &AuthState) {
    state.auth_enabled = auth.enabled;
    state.auth_revision = auth.revision;
    for (name, user) in &auth.users {
        state.users.push(schema::UserPb {
            name: name.as_bytes().to_vec(),
            password: user.password_hash.clone().unwrap_or_default().into_bytes(),
            roles: user.roles.clone(),
            options: Some(schema::UserOptionsPb { no_password: user.no_password }),
        });
    }
    for (name, role) in &auth.roles {
        let perms = role.perms.iter();
        state.roles.push(schema::RolePb {
            name: name.as_bytes().to_vec(),
            key_permission: perms
                .map(|p| schema::PermissionPb {
                    perm_type: p.perm.to_i32(),
                    key: p.key.clone(),
                    range_end: p.range_end.clone(),
                })
                .collect(),
        });
    }
}

/// [`export_to`] in memory, with the SHA-256 appended: the whole file `etcdctl snapshot save`
/// would save.
pub fn export(txn: &ReadTxn) -> Result<Vec<u8>, Error> {
    let (out, _) = export_to(txn, io::Cursor::new(Vec::new()))?;
    let mut file = out.into_inner();
    let hash = Sha256::digest(&file);
    file.extend_from_slice(&hash);
    Ok(file)
}

/// The auth ops that rebuild etcd's users and roles in keel, in an order keel accepts: roles
/// with their permissions, users with their roles, then enable.
fn auth_ops(state: &EtcdState) -> Result<Vec<AuthOp>, Error> {
    let name = |bytes: &[u8]| String::from_utf8(bytes.to_vec()).map_err(|_| Error::Auth("a name is not UTF-8".into()));
    let mut ops = Vec::new();
    for role in &state.roles {
        let name = name(&role.name)?;
        ops.push(AuthOp::RoleAdd { name: name.clone() });
        for p in &role.key_permission {
            let perm = Perm::from_i32(p.perm_type)
                .ok_or_else(|| Error::Auth(format!("role {name}: unknown permission type {}", p.perm_type)))?;
            let perm = Permission { perm, key: p.key.clone(), range_end: p.range_end.clone() };
            ops.push(AuthOp::RoleGrantPermission { name: name.clone(), perm });
        }
    }
    for user in &state.users {
        let user_name = name(&user.name)?;
        let no_password = user.options.as_ref().is_some_and(|o| o.no_password);
        let password_hash = match user.password.is_empty() {
            true => None,
            false => Some(name(&user.password)?),
        };
        ops.push(AuthOp::UserAdd { name: user_name.clone(), password_hash, no_password });
        for role in &user.roles {
            ops.push(AuthOp::UserGrantRole { user: user_name.clone(), role: role.clone() });
        }
    }
    if state.auth_enabled {
        ops.push(AuthOp::Enable { secret: rand::random() });
    }
    Ok(ops)
}

/// A row of keel's store: table, key, value.
type Row = (&'static str, Vec<u8>, Vec<u8>);

/// The rows of keel's store for one etcd key: its record, and its row in the lease's key
/// index.
fn key_rows(kv: &PbKeyValue, leases: &HashSet<i64>) -> impl Iterator<Item = Row> {
    // keel's invariant: a key names a lease only if the lease exists (etcd keeps the
    // attachment of a lease it lost, which then never expires the key).
    let lease = if leases.contains(&kv.lease) { kv.lease } else { 0 };
    let record = Record {
        create_revision: kv.create_revision,
        mod_revision: kv.mod_revision,
        version: kv.version,
        lease,
        value: kv.value.clone(),
    };
    let index = (lease != 0).then(|| (lease::LEASE_KEYS, lease::index_key(lease, &kv.key), Vec::new()));
    std::iter::once((KV, kv.key.clone(), record.encode())).chain(index)
}

/// The rows of keel's store for `state` but its keys: leases, auth, revision. Computed before
/// the store is opened, so state keel's rules refuse (auth) leaves nothing written.
fn other_rows(state: &EtcdState) -> Result<Vec<Row>, Error> {
    let mut out = Vec::new();
    for &(id, ttl) in &state.leases {
        out.push((lease::LEASES, lease::id_key(id).to_vec(), lease::encode_ttl(ttl)));
    }
    let mut auth = AuthState::default();
    for op in auth_ops(state)? {
        for (table, key, value) in auth.apply(&op).map_err(|e| Error::Auth(format!("{op:?}: {e}")))? {
            // A later op may rewrite a row an earlier one wrote; the last write wins.
            if let Some(value) = value {
                out.push((table, key, value));
            }
        }
    }
    out.push((META, REV_KEY.to_vec(), bincode::serialize(&first_revision(state)).map_err(store)?));
    out.push((META, COMPACT_KEY.to_vec(), bincode::serialize(&state.compact_revision).map_err(store)?));
    Ok(out)
}

/// The revision the restored rows are written at. When no key changed at the store's revision
/// (`etcdutl snapshot restore --bump-revision` moved it on, or a compaction point above the
/// newest key), one revision less, and the store's revision then follows in a commit of its
/// own that changes no key: the store's history then truly holds the step to it, so a watch
/// from the revision etcd reports as compacted is served (with nothing at it, as in etcd)
/// rather than refused.
fn first_revision(state: &EtcdState) -> i64 {
    let newest_key = state.keys.iter().map(|kv| kv.mod_revision).max().unwrap_or(0);
    match state.revision > newest_key && state.revision > 1 {
        true => state.revision - 1,
        false => state.revision,
    }
}

/// Makes `dir` (the `sm` directory of a new cluster's member, not yet existing or empty) hold
/// `state`, as `state_machine::restore` does for keel's own snapshots: rows in transactions
/// of [`ROWS_PER_TXN`], made as they are written (the keys are not copied twice in memory).
/// Checkpointed before returning (durable). Returns the revision the new cluster continues from.
pub fn restore(dir: &Path, state: &EtcdState, fs: Arc<dyn FileSystem>) -> Result<i64, Error> {
    let others = other_rows(state)?;
    let leases: HashSet<i64> = state.leases.iter().map(|(id, _)| *id).collect();
    let mut rows = state.keys.iter().flat_map(|kv| key_rows(kv, &leases)).chain(others).peekable();
    let relaxed = Options { fs: Arc::clone(&fs), ..Options::with_durability(Durability::Relaxed) };
    let db = Database::open(dir.join("store"), relaxed).map_err(store)?;
    while rows.peek().is_some() {
        let mut txn = db.begin_write().map_err(store)?;
        for (table, key, value) in rows.by_ref().take(ROWS_PER_TXN) {
            txn.put(table, &key, &value).map_err(store)?;
        }
        txn.commit().map_err(store)?;
    }
    db.checkpoint().map_err(store)?;
    db.close().map_err(store)?;
    if first_revision(state) != state.revision {
        // With history kept (as the member keeps it), so that the step is in the store's
        // history and nothing before it is.
        let options =
            Options { keep_history: true, fs: Arc::clone(&fs), ..Options::with_durability(Durability::Relaxed) };
        let db = Database::open(dir.join("store"), options).map_err(store)?;
        let mut txn = db.begin_write().map_err(store)?;
        txn.put(META, REV_KEY, &bincode::serialize(&state.revision).map_err(store)?).map_err(store)?;
        txn.commit().map_err(store)?;
        db.checkpoint().map_err(store)?;
        db.close().map_err(store)?;
    }
    files::create_dir_durably(fs.as_ref(), &dir.join("snap")).map_err(store)?;
    Ok(state.revision)
}

#[cfg(test)]
mod tests;
