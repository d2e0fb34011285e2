//! etcd's authentication and authorization: users, roles, key-range permissions, the root
//! rules, tokens, and the check every request passes.
//!
//! What it owns: the replicated auth state ([`AuthState`]) as the state machine keeps it (in
//! the `auth_users` and `auth_roles` tables and three `meta` keys, so it is in every snapshot),
//! the operations that change it ([`AuthOp`], carried in the log as `RequestKind::Auth`), the
//! permission check, and the token format. The gRPC service is in `auth_api.rs`.
//!
//! Invariants:
//! - Applying an [`AuthOp`] is deterministic and cheap: passwords arrive already hashed (bcrypt,
//!   hashed by the member that received the request), and the only randomness (the token key
//!   of `AuthEnable`) is chosen by that member and carried in the entry.
//! - Every successful change bumps `revision`, so a revision names one auth state. A request is
//!   checked on the member that receives it and stamped with the revision it was checked at; it
//!   applies only if auth is disabled or the revision is still current ([`AuthState::admit`]),
//!   otherwise it fails with etcd's `ErrAuthOldRevision` and changes nothing.
//! - No password is ever stored or logged in clear: only its bcrypt hash enters the log.
//! - This module never does I/O and never reads the clock except to check a token's expiry.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use keeldb::ReadTxn;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::mvcc::META;
use crate::types::ApplyError;

/// Users: name → bincode [`User`].
pub const USERS: &str = "auth_users";
/// Roles: name → bincode [`Role`].
pub const ROLES: &str = "auth_roles";
const ENABLED_KEY: &[u8] = b"auth_enabled";
const REVISION_KEY: &[u8] = b"auth_revision";
const SECRET_KEY: &[u8] = b"auth_secret";
/// The `meta` keys of the auth state (a restored member copies them with the two tables).
pub const META_KEYS: [&[u8]; 3] = [ENABLED_KEY, REVISION_KEY, SECRET_KEY];
/// The user and role etcd's root rules name.
pub const ROOT: &str = "root";
/// etcd's default bcrypt cost.
pub const BCRYPT_COST: u32 = 10;
pub use crate::config::TOKEN_TTL_S;

/// etcd's permission types (authpb.Permission.Type).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Perm {
    Read,
    Write,
    ReadWrite,
}

impl Perm {
    /// From the protobuf enum value; `None` for an unknown one.
    pub fn from_i32(v: i32) -> Option<Perm> {
        match v {
            0 => Some(Perm::Read),
            1 => Some(Perm::Write),
            2 => Some(Perm::ReadWrite),
            _ => None,
        }
    }

    pub fn to_i32(self) -> i32 {
        match self {
            Perm::Read => 0,
            Perm::Write => 1,
            Perm::ReadWrite => 2,
        }
    }

    fn grants(self, wanted: Perm) -> bool {
        self == Perm::ReadWrite || self == wanted
    }
}

/// One key-range permission of a role (etcd's `authpb.Permission`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Permission {
    pub perm: Perm,
    pub key: Vec<u8>,
    /// Empty: the key alone; `"\0"`: every key from `key` on; otherwise `[key, range_end)`.
    pub range_end: Vec<u8>,
}

/// A user as stored.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct User {
    /// The bcrypt hash; `None` for a user added with `no_password` (who cannot authenticate).
    pub password_hash: Option<String>,
    /// Granted roles, sorted.
    pub roles: Vec<String>,
    pub no_password: bool,
    /// The auth revision at which the user was added or its password last changed: tokens
    /// carry it, so a token outlives neither a password change nor a delete and re-add.
    pub since: u64,
}

/// A role as stored: its permissions, sorted by key.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct Role {
    pub perms: Vec<Permission>,
}

/// An auth change as carried in the log (bincode, body of `RequestKind::Auth`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum AuthOp {
    /// `secret`: the new token key, chosen by the member that received the request.
    Enable {
        secret: [u8; 32],
    },
    Disable,
    UserAdd {
        name: String,
        password_hash: Option<String>,
        no_password: bool,
    },
    UserDelete {
        name: String,
    },
    UserChangePassword {
        name: String,
        password_hash: Option<String>,
    },
    UserGrantRole {
        user: String,
        role: String,
    },
    UserRevokeRole {
        name: String,
        role: String,
    },
    RoleAdd {
        name: String,
    },
    RoleDelete {
        name: String,
    },
    RoleGrantPermission {
        name: String,
        perm: Permission,
    },
    RoleRevokePermission {
        role: String,
        key: Vec<u8>,
        range_end: Vec<u8>,
    },
}

pub use crate::types::{AuthError, AuthStamp};

impl AuthError {
    /// The status etcd answers with (rpctypes).
    pub fn status(&self) -> tonic::Status {
        use AuthError::*;
        let m = self.to_string();
        match self {
            RootUserNotExist | RootRoleNotExist | UserAlreadyExist | UserNotFound | RoleAlreadyExist | RoleNotFound
            | RoleNotGranted | PermissionNotGranted | AuthNotEnabled => tonic::Status::failed_precondition(m),
            UserEmpty | RoleEmpty | AuthFailed | PermissionNotGiven | InvalidAuthMgmt | AuthOldRevision => {
                tonic::Status::invalid_argument(m)
            }
            PermissionDenied => tonic::Status::permission_denied(m),
            InvalidAuthToken => tonic::Status::unauthenticated(m),
        }
    }
}

/// The replicated auth state, mirrored in memory by every member.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuthState {
    pub enabled: bool,
    /// Bumped by every successful change (etcd's auth revision).
    pub revision: u64,
    /// The token key, replaced at every enable.
    secret: [u8; 32],
    pub users: BTreeMap<String, User>,
    pub roles: BTreeMap<String, Role>,
}

/// A row an applied op writes: (table, key, value or `None` to delete).
pub type Write = (&'static str, Vec<u8>, Option<Vec<u8>>);

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // bincode of these plain structs cannot fail (no maps with non-string keys, no
    // unsupported types); an empty row would be refused at load, never silently read.
    bincode::serialize(v).unwrap_or_default()
}

impl AuthState {
    /// Reads the auth state as of `txn`.
    pub fn load(txn: &ReadTxn) -> Result<AuthState, String> {
        let meta = |key: &[u8]| txn.get(META, key).map_err(|e| e.to_string());
        let bad = |what: &str, e: bincode::Error| format!("auth {what}: {e}");
        let mut state = AuthState::default();
        if let Some(v) = meta(ENABLED_KEY)? {
            state.enabled = bincode::deserialize(&v).map_err(|e| bad("enabled", e))?;
        }
        if let Some(v) = meta(REVISION_KEY)? {
            state.revision = bincode::deserialize(&v).map_err(|e| bad("revision", e))?;
        }
        if let Some(v) = meta(SECRET_KEY)? {
            state.secret = bincode::deserialize(&v).map_err(|e| bad("secret", e))?;
        }
        for row in txn.scan(USERS, keeldb::ScanRange::all()).map_err(|e| e.to_string())? {
            let (k, v) = row.map_err(|e| e.to_string())?;
            let name = String::from_utf8(k).map_err(|e| format!("auth user name: {e}"))?;
            state.users.insert(name, bincode::deserialize(&v).map_err(|e| bad("user", e))?);
        }
        for row in txn.scan(ROLES, keeldb::ScanRange::all()).map_err(|e| e.to_string())? {
            let (k, v) = row.map_err(|e| e.to_string())?;
            let name = String::from_utf8(k).map_err(|e| format!("auth role name: {e}"))?;
            state.roles.insert(name, bincode::deserialize(&v).map_err(|e| bad("role", e))?);
        }
        Ok(state)
    }

    /// Whether a request stamped `stamp` may apply now: always while auth is disabled;
    /// otherwise only if it was checked at the current revision by a user (etcd's
    /// `ErrAuthOldRevision`, `ErrUserEmpty`). A request without a stamp is a member's own
    /// (the leader's lease expiry, automatic compaction, a member publishing its URLs): every
    /// client request is stamped by the API before it is proposed, and only members propose,
    /// so an unstamped entry never carries a client's request (etcd's internal requests
    /// bypass auth the same way).
    pub fn admit(&self, stamp: Option<&AuthStamp>) -> Result<(), AuthError> {
        if !self.enabled {
            return Ok(());
        }
        let Some(stamp) = stamp else { return Ok(()) };
        if stamp.revision < self.revision {
            return Err(AuthError::AuthOldRevision);
        }
        if stamp.user.is_none() {
            return Err(AuthError::UserEmpty);
        }
        Ok(())
    }

    pub fn is_root(&self, user: &str) -> bool {
        self.users.get(user).is_some_and(|u| u.roles.iter().any(|r| r == ROOT))
    }

    /// Whether `user` may do `wanted` on `[key, range_end)` (etcd's range forms): the root role
    /// may do everything; otherwise the union of the user's roles' ranges must cover the range.
    pub fn permitted(&self, user: &str, key: &[u8], range_end: &[u8], wanted: Perm) -> bool {
        let Some(u) = self.users.get(user) else { return false };
        if u.roles.iter().any(|r| r == ROOT) {
            return true;
        }
        let granted = u
            .roles
            .iter()
            .filter_map(|r| self.roles.get(r))
            .flat_map(|r| r.perms.iter())
            .filter(|p| p.perm.grants(wanted))
            .map(|p| Span::of(&p.key, &p.range_end));
        covered(granted.collect(), &Span::of(key, range_end))
    }

    /// Applies one op; returns the rows to write, or etcd's error (nothing changed).
    pub fn apply(&mut self, op: &AuthOp) -> Result<Vec<Write>, AuthError> {
        let mut next = self.clone();
        let mut writes = Vec::new();
        let changed = next.change(op, &mut writes)?;
        if changed {
            next.revision += 1;
            writes.push((META, REVISION_KEY.to_vec(), Some(encode(&next.revision))));
            *self = next;
        }
        Ok(writes)
    }

    /// Makes the change on `self`; false if it was a no-op (etcd answers those with success).
    fn change(&mut self, op: &AuthOp, w: &mut Vec<Write>) -> Result<bool, AuthError> {
        use AuthError::*;
        let rev = self.revision + 1;
        match op {
            AuthOp::Enable { secret } => {
                if self.enabled {
                    return Ok(false);
                }
                if !self.users.contains_key(ROOT) {
                    return Err(RootUserNotExist);
                }
                if !self.is_root(ROOT) {
                    return Err(RootRoleNotExist);
                }
                self.enabled = true;
                self.secret = *secret;
                w.push((META, ENABLED_KEY.to_vec(), Some(encode(&true))));
                w.push((META, SECRET_KEY.to_vec(), Some(encode(secret))));
            }
            AuthOp::Disable => {
                if !self.enabled {
                    return Ok(false);
                }
                self.enabled = false;
                w.push((META, ENABLED_KEY.to_vec(), Some(encode(&false))));
            }
            AuthOp::UserAdd { name, password_hash, no_password } => {
                if name.is_empty() {
                    return Err(UserEmpty);
                }
                if self.users.contains_key(name) {
                    return Err(UserAlreadyExist);
                }
                let hash = if *no_password { None } else { password_hash.clone() };
                let user = User { password_hash: hash, roles: Vec::new(), no_password: *no_password, since: rev };
                self.put_user(name, user, w);
            }
            AuthOp::UserDelete { name } => {
                if self.enabled && name == ROOT {
                    return Err(InvalidAuthMgmt);
                }
                if self.users.remove(name).is_none() {
                    return Err(UserNotFound);
                }
                w.push((USERS, name.as_bytes().to_vec(), None));
            }
            AuthOp::UserChangePassword { name, password_hash } => {
                let mut user = self.users.get(name).cloned().ok_or(UserNotFound)?;
                if !user.no_password {
                    user.password_hash = password_hash.clone();
                }
                user.since = rev;
                self.put_user(name, user, w);
            }
            AuthOp::UserGrantRole { user, role } => {
                let mut u = self.users.get(user).cloned().ok_or(UserNotFound)?;
                // etcd lets the root role be granted without being added first.
                if role != ROOT && !self.roles.contains_key(role) {
                    return Err(RoleNotFound);
                }
                match u.roles.binary_search(role) {
                    Ok(_) => return Ok(false),
                    Err(at) => u.roles.insert(at, role.clone()),
                }
                self.put_user(user, u, w);
            }
            AuthOp::UserRevokeRole { name, role } => {
                if self.enabled && name == ROOT && role == ROOT {
                    return Err(InvalidAuthMgmt);
                }
                let mut u = self.users.get(name).cloned().ok_or(UserNotFound)?;
                let before = u.roles.len();
                u.roles.retain(|r| r != role);
                if u.roles.len() == before {
                    return Err(RoleNotGranted);
                }
                self.put_user(name, u, w);
            }
            AuthOp::RoleAdd { name } => {
                if name.is_empty() {
                    return Err(RoleEmpty);
                }
                if self.roles.contains_key(name) {
                    return Err(RoleAlreadyExist);
                }
                self.put_role(name, Role::default(), w);
            }
            AuthOp::RoleDelete { name } => {
                if self.enabled && name == ROOT {
                    return Err(InvalidAuthMgmt);
                }
                if self.roles.remove(name).is_none() {
                    return Err(RoleNotFound);
                }
                w.push((ROLES, name.as_bytes().to_vec(), None));
                let holders: Vec<String> =
                    self.users.iter().filter(|(_, u)| u.roles.contains(name)).map(|(n, _)| n.clone()).collect();
                for holder in holders {
                    if let Some(mut u) = self.users.get(&holder).cloned() {
                        u.roles.retain(|r| r != name);
                        self.put_user(&holder, u, w);
                    }
                }
            }
            AuthOp::RoleGrantPermission { name, perm } => {
                if !valid_permission_range(&perm.key, &perm.range_end) {
                    return Err(InvalidAuthMgmt);
                }
                let mut role = self.roles.get(name).cloned().ok_or(RoleNotFound)?;
                match role.perms.iter_mut().find(|p| p.key == perm.key && p.range_end == perm.range_end) {
                    Some(p) => p.perm = perm.perm,
                    None => {
                        role.perms.push(perm.clone());
                        role.perms.sort_by(|a, b| a.key.cmp(&b.key));
                    }
                }
                self.put_role(name, role, w);
            }
            AuthOp::RoleRevokePermission { role, key, range_end } => {
                let mut r = self.roles.get(role).cloned().ok_or(RoleNotFound)?;
                let before = r.perms.len();
                r.perms.retain(|p| !(p.key == *key && p.range_end == *range_end));
                if r.perms.len() == before {
                    return Err(PermissionNotGranted);
                }
                self.put_role(role, r, w);
            }
        }
        Ok(true)
    }

    fn put_user(&mut self, name: &str, user: User, w: &mut Vec<Write>) {
        w.push((USERS, name.as_bytes().to_vec(), Some(encode(&user))));
        self.users.insert(name.to_string(), user);
    }

    fn put_role(&mut self, name: &str, role: Role, w: &mut Vec<Write>) {
        w.push((ROLES, name.as_bytes().to_vec(), Some(encode(&role))));
        self.roles.insert(name.to_string(), role);
    }

    /// A token for `user`, valid on every member for `ttl_s` seconds from `now_s` or until the
    /// user's password changes, the user is deleted, or auth is re-enabled (new key).
    pub fn issue_token(&self, user: &str, now_s: u64, ttl_s: u64) -> Option<String> {
        let u = self.users.get(user)?;
        let expires = now_s.saturating_add(ttl_s);
        let claim = format!("{}.{}.{}", hex(user.as_bytes()), u.since, expires);
        let mac = hmac_sha256(&self.secret, claim.as_bytes());
        Some(format!("keel.{claim}.{}", hex(&mac)))
    }

    /// The user a token names, if it is genuine, unexpired and still the user's.
    pub fn verify_token(&self, token: &str, now_s: u64) -> Result<String, AuthError> {
        let bad = AuthError::InvalidAuthToken;
        let rest = token.strip_prefix("keel.").ok_or(bad.clone())?;
        let (claim, mac) = rest.rsplit_once('.').ok_or(bad.clone())?;
        let expected = hmac_sha256(&self.secret, claim.as_bytes());
        if !constant_time_eq(hex(&expected).as_bytes(), mac.as_bytes()) {
            return Err(bad);
        }
        let mut parts = claim.split('.');
        let (Some(user), Some(since), Some(expires), None) = (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad);
        };
        let user = unhex(user).and_then(|b| String::from_utf8(b).ok()).ok_or(bad.clone())?;
        let since: u64 = since.parse().map_err(|_| bad.clone())?;
        let expires: u64 = expires.parse().map_err(|_| bad.clone())?;
        if expires <= now_s {
            return Err(bad);
        }
        match self.users.get(&user) {
            Some(u) if u.since == since => Ok(user),
            _ => Err(bad),
        }
    }
}

/// Applies the body of a `RequestKind::Auth` entry to `state`: the state after it and the rows
/// to write, or the error the entry ends with (nothing written).
pub fn apply_entry(state: &AuthState, body: &[u8]) -> Result<(AuthState, Vec<Write>), ApplyError> {
    let op: AuthOp = bincode::deserialize(body).map_err(|e| ApplyError::Invalid(format!("bad auth request: {e}")))?;
    let mut next = state.clone();
    let writes = next.apply(&op).map_err(ApplyError::Auth)?;
    Ok((next, writes))
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// etcd accepts a permission on a key, or on a non-empty range `[key, range_end)`, or from a
/// key on (`range_end` `"\0"`); the empty key only together with `"\0"` (every key).
fn valid_permission_range(key: &[u8], range_end: &[u8]) -> bool {
    if range_end == b"\0" {
        return true;
    }
    if key.is_empty() {
        return false;
    }
    range_end.is_empty() || key < range_end
}

/// A key range `[start, end)`; `end` `None` is unbounded.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Span {
    start: Vec<u8>,
    end: Option<Vec<u8>>,
}

impl Span {
    /// etcd's forms: empty `range_end` is the key alone, `"\0"` everything from the key on.
    fn of(key: &[u8], range_end: &[u8]) -> Span {
        if range_end == b"\0" {
            return Span { start: key.to_vec(), end: None };
        }
        if range_end.is_empty() || range_end <= key {
            let mut next = key.to_vec();
            next.push(0);
            return Span { start: key.to_vec(), end: Some(next) };
        }
        Span { start: key.to_vec(), end: Some(range_end.to_vec()) }
    }
}

/// Whether the union of `granted` covers `wanted` (adjacent and overlapping grants join).
fn covered(mut granted: Vec<Span>, wanted: &Span) -> bool {
    granted.sort_by(|a, b| a.start.cmp(&b.start));
    // The end of the covered run that contains `wanted.start`, grown grant by grant.
    let mut reach: Option<Option<Vec<u8>>> = None;
    for g in granted {
        match &reach {
            None => {
                if g.start <= wanted.start && end_after(&g.end, &wanted.start) {
                    reach = Some(g.end);
                }
            }
            Some(r) => {
                let Some(r_end) = r else { return true };
                if g.start > *r_end {
                    break;
                }
                if end_ge(&g.end, r) {
                    reach = Some(g.end);
                }
            }
        }
        if let Some(r) = &reach {
            if end_ge(r, &wanted.end) {
                return true;
            }
        }
    }
    false
}

/// `end > key` (an unbounded end is after every key).
fn end_after(end: &Option<Vec<u8>>, key: &[u8]) -> bool {
    end.as_deref().is_none_or(|e| e > key)
}

/// `a >= b` for range ends (`None` is the greatest).
fn end_ge(a: &Option<Vec<u8>>, b: &Option<Vec<u8>>) -> bool {
    match (a, b) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(a), Some(b)) => a >= b,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|p| u8::from_str_radix(p, 16).ok())).collect()
}

/// HMAC-SHA256 (RFC 2104) with a 32-byte key.
fn hmac_sha256(key: &[u8; 32], message: &[u8]) -> [u8; 32] {
    let mut inner_pad = [0x36u8; 64];
    let mut outer_pad = [0x5cu8; 64];
    for ((inner, outer), k) in inner_pad.iter_mut().zip(outer_pad.iter_mut()).zip(key) {
        *inner ^= k;
        *outer ^= k;
    }
    let inner = Sha256::new().chain_update(inner_pad).chain_update(message).finalize();
    Sha256::new().chain_update(outer_pad).chain_update(inner).finalize().into()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn state_with(perms: &[(Perm, &str, &str)]) -> AuthState {
        let mut s = AuthState::default();
        s.apply(&AuthOp::UserAdd { name: "u".into(), password_hash: None, no_password: true }).unwrap();
        s.apply(&AuthOp::RoleAdd { name: "r".into() }).unwrap();
        for (perm, key, end) in perms {
            let perm = Permission { perm: *perm, key: key.as_bytes().to_vec(), range_end: end.as_bytes().to_vec() };
            s.apply(&AuthOp::RoleGrantPermission { name: "r".into(), perm }).unwrap();
        }
        s.apply(&AuthOp::UserGrantRole { user: "u".into(), role: "r".into() }).unwrap();
        s
    }

    fn may(s: &AuthState, key: &str, end: &str, p: Perm) -> bool {
        s.permitted("u", key.as_bytes(), end.as_bytes(), p)
    }

    #[test]
    fn a_single_key_permission_covers_that_key_only() {
        let s = state_with(&[(Perm::Read, "k", "")]);
        assert!(may(&s, "k", "", Perm::Read));
        assert!(!may(&s, "k", "", Perm::Write));
        assert!(!may(&s, "k0", "", Perm::Read));
        assert!(!may(&s, "j", "", Perm::Read));
        // The range holding only "k" is "k".."k\0".
        assert!(may(&s, "k", "k\0", Perm::Read));
        assert!(!may(&s, "k", "l", Perm::Read));
    }

    #[test]
    fn a_prefix_permission_covers_ranges_inside_it_only() {
        // etcdctl's --prefix "ro/" is ["ro/", "ro0").
        let s = state_with(&[(Perm::Read, "ro/", "ro0")]);
        assert!(may(&s, "ro/a", "", Perm::Read));
        assert!(may(&s, "ro/", "ro0", Perm::Read));
        assert!(may(&s, "ro/a", "ro/b", Perm::Read));
        assert!(!may(&s, "ro/", "ro1", Perm::Read));
        assert!(!may(&s, "ro", "", Perm::Read));
        assert!(!may(&s, "ro/", "\0", Perm::Read), "from-key reaches past the prefix");
        assert!(!may(&s, "ro/a", "", Perm::Write));
    }

    #[test]
    fn from_key_permissions_are_unbounded_and_adjacent_grants_join() {
        let s = state_with(&[(Perm::Write, "m", "\0")]);
        assert!(may(&s, "zzzz", "", Perm::Write));
        assert!(may(&s, "m", "\0", Perm::Write));
        assert!(!may(&s, "l", "\0", Perm::Write));
        // "a".."c" and "c".."e" together cover "b".."d"; a gap at "e".."f" is not covered.
        let s = state_with(&[(Perm::ReadWrite, "a", "c"), (Perm::Read, "c", "e"), (Perm::Read, "f", "\0")]);
        assert!(may(&s, "b", "d", Perm::Read));
        assert!(!may(&s, "b", "d", Perm::Write));
        assert!(!may(&s, "d", "g", Perm::Read));
        assert!(may(&s, "f", "\0", Perm::Read));
        // The whole key space: key "" with "\0".
        let all = state_with(&[(Perm::Read, "", "\0")]);
        assert!(may(&all, "\0", "\0", Perm::Read));
        assert!(may(&all, "anything", "", Perm::Read));
    }

    #[test]
    fn root_rules_hold() {
        let mut s = AuthState::default();
        assert_eq!(s.apply(&AuthOp::Enable { secret: [1; 32] }), Err(AuthError::RootUserNotExist));
        s.apply(&AuthOp::UserAdd { name: ROOT.into(), password_hash: None, no_password: false }).unwrap();
        assert_eq!(s.apply(&AuthOp::Enable { secret: [1; 32] }), Err(AuthError::RootRoleNotExist));
        s.apply(&AuthOp::UserGrantRole { user: ROOT.into(), role: ROOT.into() }).unwrap();
        let before = s.revision;
        s.apply(&AuthOp::Enable { secret: [1; 32] }).unwrap();
        assert!(s.enabled && s.revision == before + 1);
        let rev = s.revision;
        for op in [
            AuthOp::UserDelete { name: ROOT.into() },
            AuthOp::UserRevokeRole { name: ROOT.into(), role: ROOT.into() },
            AuthOp::RoleDelete { name: ROOT.into() },
        ] {
            assert_eq!(s.apply(&op), Err(AuthError::InvalidAuthMgmt), "{op:?}");
        }
        assert_eq!(s.revision, rev, "refused ops change nothing");
        assert!(s.permitted(ROOT, b"\0", b"\0", Perm::Write));
    }

    #[test]
    fn tokens_are_refused_after_a_password_change_a_delete_expiry_or_forgery() {
        let mut s = AuthState::default();
        s.apply(&AuthOp::UserAdd { name: "a.b".into(), password_hash: Some("h".into()), no_password: false }).unwrap();
        let t = s.issue_token("a.b", 1000, TOKEN_TTL_S).unwrap();
        assert_eq!(s.verify_token(&t, 1000), Ok("a.b".into()));
        assert_eq!(s.verify_token(&t, 1000 + TOKEN_TTL_S), Err(AuthError::InvalidAuthToken));
        let forged = t.replace(&hex(b"a.b"), &hex(b"root"));
        assert_eq!(s.verify_token(&forged, 1000), Err(AuthError::InvalidAuthToken));
        let mut changed = s.clone();
        changed.apply(&AuthOp::UserChangePassword { name: "a.b".into(), password_hash: Some("h2".into()) }).unwrap();
        assert_eq!(changed.verify_token(&t, 1000), Err(AuthError::InvalidAuthToken));
        let mut readded = s.clone();
        readded.apply(&AuthOp::UserDelete { name: "a.b".into() }).unwrap();
        assert_eq!(readded.verify_token(&t, 1000), Err(AuthError::InvalidAuthToken));
        readded
            .apply(&AuthOp::UserAdd { name: "a.b".into(), password_hash: Some("h".into()), no_password: false })
            .unwrap();
        assert_eq!(readded.verify_token(&t, 1000), Err(AuthError::InvalidAuthToken));
    }

    #[test]
    fn hmac_matches_rfc_4231_case_1() {
        // A 20-byte key zero-padded to 32 bytes is the same HMAC key (keys are zero-padded to
        // the block size).
        let mut key = [0u8; 32];
        key[..20].copy_from_slice(&[0x0b; 20]);
        assert_eq!(
            hex(&hmac_sha256(&key, b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
    }

    #[test]
    fn admit_refuses_requests_checked_at_an_older_revision_once_enabled() {
        let mut s = AuthState::default();
        let stamp = |user: Option<&str>, revision| AuthStamp { user: user.map(String::from), revision };
        assert_eq!(s.admit(None), Ok(()));
        s.enabled = true;
        s.revision = 5;
        assert_eq!(s.admit(None), Ok(()), "a member's own request (lease expiry, compaction) is not a client's");
        assert_eq!(s.admit(Some(&stamp(Some("u"), 4))), Err(AuthError::AuthOldRevision));
        assert_eq!(s.admit(Some(&stamp(None, 5))), Err(AuthError::UserEmpty));
        assert_eq!(s.admit(Some(&stamp(Some("u"), 5))), Ok(()));
    }
}
