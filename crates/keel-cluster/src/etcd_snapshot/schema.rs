//! etcd's backend schema (3.4–3.6) over a bbolt file: bucket names, key encodings and the
//! protobuf values, read into an [`EtcdState`] and written back from one.
//!
//! - `key`: revision key `main u64 BE | '_' | sub u64 BE` (17 bytes), `'t'` appended for a
//!   tombstone, → `mvccpb.KeyValue`. The live state at the newest revision is, per key, the
//!   newest entry unless that entry is a tombstone.
//! - `meta`: `consistent_index`, `term` (u64 BE), `scheduledCompactRev`, `finishedCompactRev`
//!   (revision keys, main part used), `storageVersion` (3.6: text), `confState` (JSON).
//! - `lease`: id (u64 BE) → `leasepb.Lease`.
//! - `members`, `members_removed`: hex member id → member JSON (3.5+).
//! - `auth`: `authEnabled` (`[1]` on), `authRevision` (u64 BE); `authUsers`, `authRoles`:
//!   name → `authpb.User` / `authpb.Role`.
//!
//! What it must not do: touch keel's store (that is `mod.rs`), or accept a record it cannot
//! decode whole: every malformed record is an [`Error::Record`] naming bucket and key.

use std::collections::BTreeMap;

use etcd_client::proto::PbKeyValue;
use prost::Message;

use super::bbolt::{Db, Entries, Rows};
use super::Error;

pub const KEY: &str = "key";
pub const META: &str = "meta";
pub const LEASE: &str = "lease";
pub const AUTH: &str = "auth";
pub const AUTH_USERS: &str = "authUsers";
pub const AUTH_ROLES: &str = "authRoles";
pub const MEMBERS: &str = "members";
pub const MEMBERS_REMOVED: &str = "members_removed";
/// Every bucket etcd 3.6 creates (`schema.AllBuckets`); an exported file has them all.
pub const ALL_BUCKETS: [&str; 10] =
    [KEY, META, LEASE, "alarm", "cluster", MEMBERS, MEMBERS_REMOVED, AUTH, AUTH_USERS, AUTH_ROLES];
const CONSISTENT_INDEX: &[u8] = b"consistent_index";
const TERM: &[u8] = b"term";
const SCHEDULED_COMPACT: &[u8] = b"scheduledCompactRev";
const FINISHED_COMPACT: &[u8] = b"finishedCompactRev";
const STORAGE_VERSION: &[u8] = b"storageVersion";
const AUTH_ENABLED: &[u8] = b"authEnabled";
const AUTH_REVISION: &[u8] = b"authRevision";
const REVISION_LEN: usize = 17;

/// `leasepb.Lease`.
#[derive(Clone, PartialEq, Message)]
pub struct LeasePb {
    #[prost(int64, tag = "1")]
    pub id: i64,
    #[prost(int64, tag = "2")]
    pub ttl: i64,
    #[prost(int64, tag = "3")]
    pub remaining_ttl: i64,
}

/// `authpb.UserAddOptions`.
#[derive(Clone, PartialEq, Message)]
pub struct UserOptionsPb {
    #[prost(bool, tag = "1")]
    pub no_password: bool,
}

/// `authpb.User`; `password` is the bcrypt hash.
#[derive(Clone, PartialEq, Message)]
pub struct UserPb {
    #[prost(bytes = "vec", tag = "1")]
    pub name: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub password: Vec<u8>,
    #[prost(string, repeated, tag = "3")]
    pub roles: Vec<String>,
    #[prost(message, optional, tag = "4")]
    pub options: Option<UserOptionsPb>,
}

/// `authpb.Permission`; `perm_type` 0 read, 1 write, 2 readwrite.
#[derive(Clone, PartialEq, Message)]
pub struct PermissionPb {
    #[prost(int32, tag = "1")]
    pub perm_type: i32,
    #[prost(bytes = "vec", tag = "2")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "3")]
    pub range_end: Vec<u8>,
}

/// `authpb.Role`.
#[derive(Clone, PartialEq, Message)]
pub struct RolePb {
    #[prost(bytes = "vec", tag = "1")]
    pub name: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    pub key_permission: Vec<PermissionPb>,
}

/// What keel keeps of an etcd backend: the live keys at the newest revision, leases, auth.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EtcdState {
    /// The store revision: the newest in `key`, or the compaction point if that is newer.
    pub revision: i64,
    pub compact_revision: i64,
    pub consistent_index: u64,
    pub term: u64,
    /// Live keys in key order.
    pub keys: Vec<PbKeyValue>,
    /// (id, TTL in seconds) in id order.
    pub leases: Vec<(i64, i64)>,
    pub auth_enabled: bool,
    pub auth_revision: u64,
    pub users: Vec<UserPb>,
    pub roles: Vec<RolePb>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn record(bucket: &'static str, key: &[u8], why: impl Into<String>) -> Error {
    Error::Record { bucket, key: hex(key), why: why.into() }
}

/// `(main, sub, tombstone)` of a revision key.
fn revision_of(key: &[u8]) -> Option<(i64, i64, bool)> {
    let tombstone = match key.len() {
        REVISION_LEN => false,
        18 if key.get(17) == Some(&b't') => true,
        _ => return None,
    };
    if key.get(8) != Some(&b'_') {
        return None;
    }
    let main = i64::from_be_bytes(key.get(..8)?.try_into().ok()?);
    let sub = i64::from_be_bytes(key.get(9..17)?.try_into().ok()?);
    Some((main, sub, tombstone))
}

fn revision_key(main: i64, sub: i64) -> Vec<u8> {
    let mut k = Vec::with_capacity(REVISION_LEN);
    k.extend_from_slice(&main.to_be_bytes());
    k.push(b'_');
    k.extend_from_slice(&sub.to_be_bytes());
    k
}

fn u64_value(bucket: &'static str, key: &[u8], value: &[u8]) -> Result<u64, Error> {
    let b: [u8; 8] = value.try_into().map_err(|_| record(bucket, key, "not an 8-byte number"))?;
    Ok(u64::from_be_bytes(b))
}

fn rows<'a>(db: &Db<'a>, bucket: &'static str) -> Result<Entries<'a>, Error> {
    Ok(db.bucket(bucket.as_bytes())?.unwrap_or_default())
}

impl EtcdState {
    /// Reads etcd's buckets from `db`. A file without a `key` or `meta` bucket is not an etcd
    /// backend and is refused; the other buckets may be absent (an older etcd, auth never used).
    pub fn read(db: &Db<'_>) -> Result<EtcdState, Error> {
        let mut state = EtcdState::default();
        let meta = db.bucket(META.as_bytes())?.ok_or(Error::MissingBucket(META))?;
        let mut scheduled = 0;
        for (k, v) in meta {
            match k {
                CONSISTENT_INDEX => state.consistent_index = u64_value(META, k, v)?,
                TERM => state.term = u64_value(META, k, v)?,
                SCHEDULED_COMPACT | FINISHED_COMPACT => {
                    let (main, _, _) = revision_of(v).ok_or_else(|| record(META, k, "not a revision"))?;
                    if k == SCHEDULED_COMPACT {
                        scheduled = main;
                    } else {
                        state.compact_revision = main;
                    }
                }
                _ => {}
            }
        }
        // A compaction etcd scheduled but did not finish is finished on its next start: the
        // history below it is as good as gone.
        state.compact_revision = state.compact_revision.max(scheduled);
        state.read_keys(db)?;
        for (k, v) in rows(db, LEASE)? {
            let lease = LeasePb::decode(v).map_err(|e| record(LEASE, k, e.to_string()))?;
            let id = u64_value(LEASE, k, k)? as i64;
            if lease.id != id {
                return Err(record(LEASE, k, format!("the record names lease {:x}", lease.id)));
            }
            state.leases.push((id, lease.ttl));
        }
        for (k, v) in rows(db, AUTH)? {
            match k {
                AUTH_ENABLED => state.auth_enabled = v == [1],
                AUTH_REVISION => state.auth_revision = u64_value(AUTH, k, v)?,
                _ => {}
            }
        }
        for (k, v) in rows(db, AUTH_USERS)? {
            state.users.push(UserPb::decode(v).map_err(|e| record(AUTH_USERS, k, e.to_string()))?);
        }
        for (k, v) in rows(db, AUTH_ROLES)? {
            state.roles.push(RolePb::decode(v).map_err(|e| record(AUTH_ROLES, k, e.to_string()))?);
        }
        Ok(state)
    }

    /// The newest version of each key, in key order; the revision.
    fn read_keys(&mut self, db: &Db<'_>) -> Result<(), Error> {
        let mut live: BTreeMap<Vec<u8>, PbKeyValue> = BTreeMap::new();
        let mut newest = 0;
        for (k, v) in db.bucket(KEY.as_bytes())?.ok_or(Error::MissingBucket(KEY))? {
            let (main, _, tombstone) = revision_of(k).ok_or_else(|| record(KEY, k, "not a revision key"))?;
            // bbolt keeps keys sorted, so revisions only grow; a file where they do not is
            // corrupt in a way the page checks cannot see.
            if main < newest {
                return Err(record(KEY, k, "revisions out of order"));
            }
            // `etcdutl snapshot restore --bump-revision` marks the new revision with a row
            // without a value: it moves the revision on and holds no key (etcd shows none).
            if v.is_empty() && !tombstone {
                newest = main;
                continue;
            }
            let kv = PbKeyValue::decode(v).map_err(|e| record(KEY, k, e.to_string()))?;
            newest = main;
            if tombstone {
                live.remove(&kv.key);
            } else {
                if kv.mod_revision != main || kv.create_revision > main || kv.version < 1 {
                    return Err(record(KEY, k, "the record's revisions disagree with its key"));
                }
                live.insert(kv.key.clone(), kv);
            }
        }
        self.revision = newest.max(self.compact_revision).max(1);
        self.keys = live.into_values().collect();
        Ok(())
    }

    /// Every bucket of an etcd backend for this state, in name order, each with its rows in
    /// key order, except that `key` is empty: its rows come from [`key_rows`] (streamed, as
    /// they may be many). Both compaction marks are the revision: the history before it is
    /// not in the file, and etcd starts its revision counter from there.
    pub fn buckets_but_keys(&self) -> Vec<(&'static str, Rows)> {
        let compact = revision_key(self.revision, 0);
        let mut meta = vec![
            (CONSISTENT_INDEX.to_vec(), self.consistent_index.to_be_bytes().to_vec()),
            (FINISHED_COMPACT.to_vec(), compact.clone()),
            (SCHEDULED_COMPACT.to_vec(), compact),
            (STORAGE_VERSION.to_vec(), b"3.6.0".to_vec()),
            (TERM.to_vec(), self.term.max(1).to_be_bytes().to_vec()),
        ];
        meta.sort();
        let mut leases: Rows = self
            .leases
            .iter()
            .map(|&(id, ttl)| {
                ((id as u64).to_be_bytes().to_vec(), LeasePb { id, ttl, remaining_ttl: 0 }.encode_to_vec())
            })
            .collect();
        leases.sort();
        let mut auth = vec![
            (AUTH_ENABLED.to_vec(), vec![u8::from(self.auth_enabled)]),
            (AUTH_REVISION.to_vec(), self.auth_revision.to_be_bytes().to_vec()),
        ];
        let mut users: Rows = self.users.iter().map(|u| (u.name.clone(), u.encode_to_vec())).collect();
        users.sort();
        let mut roles: Rows = self.roles.iter().map(|r| (r.name.clone(), r.encode_to_vec())).collect();
        roles.sort();
        let mut names = ALL_BUCKETS;
        names.sort();
        names
            .into_iter()
            .map(|name| {
                let rows = match name {
                    META => std::mem::take(&mut meta),
                    LEASE => std::mem::take(&mut leases),
                    AUTH => std::mem::take(&mut auth),
                    AUTH_USERS => std::mem::take(&mut users),
                    AUTH_ROLES => std::mem::take(&mut roles),
                    _ => Vec::new(),
                };
                (name, rows)
            })
            .collect()
    }
}

/// The ids of the members an etcd backend records (`members`, hex id → member JSON), less
/// those it records as removed (`members_removed`), in id order. Empty for a backend older
/// than etcd 3.5 kept them (those kept membership in the v2 store only).
pub fn member_ids(db: &Db<'_>) -> Result<Vec<u64>, Error> {
    let id = |bucket: &'static str, k: &[u8]| {
        std::str::from_utf8(k)
            .ok()
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .ok_or_else(|| record(bucket, k, "not a hex member id"))
    };
    let mut removed = Vec::new();
    for (k, _) in rows(db, MEMBERS_REMOVED)? {
        removed.push(id(MEMBERS_REMOVED, k)?);
    }
    let mut ids = Vec::new();
    for (k, _) in rows(db, MEMBERS)? {
        let member = id(MEMBERS, k)?;
        if !removed.contains(&member) {
            ids.push(member);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

/// The rows of the `key` bucket for live keys given in `(mod_revision, key)` order: each key
/// once, at its mod revision, sub revisions numbered in key order among keys sharing one.
pub fn key_rows<E>(
    keys: impl IntoIterator<Item = Result<PbKeyValue, E>>,
) -> impl Iterator<Item = Result<(Vec<u8>, Vec<u8>), E>> {
    let mut last = None;
    let mut sub = 0;
    keys.into_iter().map(move |kv| {
        let kv = kv?;
        sub = if last == Some(kv.mod_revision) { sub + 1 } else { 0 };
        last = Some(kv.mod_revision);
        Ok((revision_key(kv.mod_revision, sub), kv.encode_to_vec()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revision_keys_round_trip_and_odd_ones_are_refused() {
        let k = revision_key(7, 2);
        assert_eq!(revision_of(&k), Some((7, 2, false)));
        let mut t = k.clone();
        t.push(b't');
        assert_eq!(revision_of(&t), Some((7, 2, true)));
        t[17] = b'x';
        assert_eq!(revision_of(&t), None);
        let mut bad = k.clone();
        bad[8] = b'-';
        assert_eq!(revision_of(&bad), None);
        assert_eq!(revision_of(&k[..16]), None);
    }
}
